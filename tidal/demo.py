"""`tidal demo` and `tidal eval`: the whole loop on one machine, with simulated users.

demo:  platform up (bootstrap if needed) → simulated users send Tab traffic through the gateway, all along
       → N × [wait for `requests_per_cycle` new requests (`first_cycle_requests` before the model's first)
       → flywheel cycle] → held-out eval of version 1 vs the final champion → table, PNG plot (MLflow run +
       Prefect artifact), where to look.
eval:  the same held-out replay for any versions.

The demo's cycles use `demo.canary` and `demo.train` (sized for a laptop) and start the flows runner with
`flywheel.loop: manual`, so no schedule or trigger runs a second loop beside the demo's.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

from release.operations import roll_back_canary
from tasks.cycle_report import CycleReport, cycle_table
from tidal.loop_settings import DemoSettings, FlywheelSettings
from tidal.section import SettingsError
from tidal.settings import TidalSettings
from tidal.strategy import model_mismatch

METRIC_NAMES = ("suggestion_rate", "accept_rate", "reward_per_request", "accepted_chars_per_request")


def demo_profile(settings: TidalSettings, model: str) -> TidalSettings:
    """The settings the demo runs under: its canary and training, no schedule, and `demo.update_strategy` for the model
    it cycles (the other models are not trained by the demo: they keep theirs, and the fleet keeps serving them)."""
    demo, train = settings.demo, settings.demo.train
    if demo.quiet_while_training and train.torch_threads is None:
        train = train.model_copy(update={"torch_threads": os.cpu_count() or 1})  # the users are quiet: every core
    models = [
        m.model_copy(update={"update_strategy": demo.update_strategy})
        if m.name == model and demo.update_strategy is not None
        else m
        for m in settings.models
    ]
    cycled = next(m for m in models if m.name == model)
    if problem := model_mismatch(cycled.name, cycled.update_strategy, train.ppo.lora, "demo.train.ppo.lora"):
        raise SettingsError(f"{problem}; or set demo.update_strategy")
    return settings.model_copy(
        update={
            "canary": demo.canary,
            "train": train,
            "models": models,
            "flywheel": FlywheelSettings(loop="manual", schedule_cron=settings.flywheel.schedule_cron),
        }
    )


def fleet_strategies(platform) -> dict[str, str] | None:
    """{model: update strategy} of the running fleet supervisor; None when it is not running."""
    if platform.running("fleet") is None:
        return None
    return {name: g.strategy for name, g in platform.fleet_client(timeout_s=30.0).status().models.items()}


def use_settings_file(platform) -> None:
    """This process's flows read exactly the platform's settings (the file its services were given)."""
    platform.write_settings_file()
    for key in [k for k in os.environ if k.startswith("TIDAL_")]:
        del os.environ[key]
    os.environ["TIDAL_CONFIG"] = str(platform.settings_file)


# ---- eval ------------------------------------------------------------------------------------------
def replica_serving(fleet, model: str, version: int) -> str | None:
    for r in fleet.replicas(model):
        if r.state == "ready" and version in r.served.values():
            return r.url
    return None


def evaluate_versions(
    settings: TidalSettings, platform, model: str, versions: list[int], n: int, seed: int, code_dir: Path | None = None
) -> dict:
    """{version: {"suggestion_filter": what it withholds, "metrics": {name: Estimate}, "baseline_k": k, "baseline":
    {name: Estimate}, "outcomes": Outcomes,
    "baseline_outcomes": Outcomes}} on held-out users (outcomes: request by request, for paired comparisons).
    Versions not loaded are deployed for the replay and unloaded after (lora: an adapter; restart: a surge
    replica)."""
    from data_contracts.suggestion_filter import describe, from_tags
    from sim.evaluate import best_truncation, complete_all, eval_cases, outcomes, summarize
    from tidal.registry import Registry

    registry, fleet = Registry(settings.mlflow.tracking_uri), platform.fleet_client()
    cfg, rule = settings.demo.users, settings.collect.rule_for(model)
    cases = eval_cases(cfg, settings.bootstrap.heldout_fraction, n, seed, code_dir)
    out = {}
    for v in versions:
        info = registry.get(model, v)
        url, loaded_here = replica_serving(fleet, model, v), False
        if url is None:  # lora: the adapter is loaded; restart: a surge replica boots on it
            fleet.deploy(model, v)
            url, loaded_here = replica_serving(fleet, model, v), True
        try:
            texts = complete_all(
                url,
                info.served_name,
                cases,
                cfg.max_tokens,
                cfg.temperature,
                cfg.stop,
                settings.demo.eval_concurrency,
                None if (f := from_tags(info.tags)) is None else f.min_first_logprob,
            )
        finally:
            if loaded_here and registry.aliases(model).get("champion") != v:
                fleet.undeploy(model, v)
        k, baseline = best_truncation(cases, texts, rule)
        served = outcomes(cases, texts, rule)  # the users' verdicts once; metrics and paired comparisons share them
        out[v] = {
            "suggestion_filter": describe(from_tags(info.tags)),
            "metrics": summarize(served),
            "baseline_k": k,
            "baseline": baseline,
            "outcomes": served,
            "baseline_outcomes": outcomes(cases, [t[:k] for t in texts], rule),
        }
    return out


def paired(result: dict, reference: int) -> dict[int, dict]:
    """{version: {metric: Comparison}} of every other version against `reference` on the same requests."""
    from sim.paired import compare

    return {v: compare(result[reference]["outcomes"], r["outcomes"]) for v, r in result.items() if v != reference}


def print_eval(model: str, result: dict, n: int, reference: int | None = None) -> None:
    print(f"\n{model}: held-out users ({n} requests from eval files never trained on; 95% CIs)")
    print(f"{'version':<22}" + "".join(f"{m:>30}" for m in METRIC_NAMES))
    for v, r in result.items():
        print(f"{'v' + str(v):<22}" + "".join(f"{str(r['metrics'][m]):>30}" for m in METRIC_NAMES))
        label = f"  v{v} cut to {r['baseline_k']} chars"
        print(f"{label:<22}" + "".join(f"{str(r['baseline'][m]):>30}" for m in METRIC_NAMES))
        print(f"  v{v} {r['suggestion_filter']}")
    reference = next(iter(result)) if reference is None else reference
    for v, comparisons in paired(result, reference).items():
        print(f"v{v} − v{reference}, paired on the same {n} requests (×: ratio b/a; ±: difference; 95% bootstrap CIs)")
        for m in METRIC_NAMES:
            print(f"  {comparisons[m].describe():<60} {'significant' if comparisons[m].significant else ''}")


def cmd_eval(settings: TidalSettings, args) -> None:
    from tidal.client_env import use_platform_env
    from tidal.platform import Platform

    use_platform_env(settings)
    versions = [int(v.strip().lstrip("v")) for v in args.versions.split(",") if v.strip()]
    if not versions:
        raise ValueError("--versions needs at least one version, e.g. --versions 1,4")
    code_dir = Path(args.code_dir) if args.code_dir else None
    result = evaluate_versions(settings, Platform(settings), args.model, versions, args.requests, args.seed, code_dir)
    if args.json:
        print(
            json.dumps(
                {
                    "versions": {v: _flat(r) for v, r in result.items()},
                    "reference": versions[0],
                    "paired": {v: {m: _comparison(c) for m, c in cs.items()} for v, cs in paired(result, versions[0]).items()},
                }
            )
        )
    else:
        print_eval(args.model, result, args.requests, versions[0])


def _flat(r: dict) -> dict:
    return {
        **{m: vars(e) for m, e in r["metrics"].items()},
        "baseline_k": r["baseline_k"],
        "suggestion_filter": r["suggestion_filter"],
        **{f"baseline_{m}": vars(e) for m, e in r["baseline"].items()},
    }


def _comparison(c) -> dict:
    return {"a": c.a, "b": c.b, "delta": vars(c.delta), "ratio": vars(c.ratio) if c.ratio else None, "significant": c.significant}


# ---- demo ------------------------------------------------------------------------------------------
def plot_versions(rows: list[dict], path: Path) -> Path:
    """One panel per metric, a point per version with its interval."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METRIC_NAMES), figsize=(4 * len(METRIC_NAMES), 3.4))
    for ax, m in zip(axes, METRIC_NAMES):
        for kind, style in (("version", "o-"), ("baseline", "x")):
            pts = [(i, r) for i, r in enumerate(rows) if r["kind"] == kind]
            if pts:
                ax.errorbar(
                    [i for i, _ in pts],
                    [r[m].mean for _, r in pts],
                    capsize=4,
                    fmt=style,
                    label=kind,
                    yerr=[[r[m].mean - r[m].low for _, r in pts], [r[m].high - r[m].mean for _, r in pts]],
                )
        ax.set_xticks(range(len(rows)), [r["label"] for r in rows], rotation=30)
        ax.set_title(m.replace("_", " "))
    axes[0].legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def requests_before(demo: DemoSettings, cycle: int) -> int:
    """New simulated requests the demo waits for before `cycle` (1 = the model's first) collects."""
    return demo.first_cycle_requests if cycle == 1 else demo.requests_per_cycle


def wait_for_traffic(traffic, since: int, n: int, desc: str) -> None:
    """Until the users sent `n` requests after the first `since` (a progress bar); fails if the gateway keeps erroring."""
    from tqdm import tqdm

    with tqdm(total=n, desc=desc, unit="req", leave=False) as bar:
        while (done := min(n, traffic.sent - since)) < n:
            if not traffic.is_alive():
                raise RuntimeError(f"simulated traffic stopped; last errors: {traffic.tally.errors[-3:]}")
            if len(traffic.tally.errors) > 50 and len(traffic.tally.errors) > 0.2 * max(1, traffic.sent):
                raise RuntimeError(f"simulated users see errors: {traffic.tally.errors[-3:]}")
            bar.update(done - bar.n)
            time.sleep(0.5)
        bar.update(n - bar.n)


def leave_consistent(platform, model: str) -> None:
    """After an interrupt: a canary left by the interrupted cycle goes back to 0 at once."""
    if roll_back_canary(platform.routes_client(), model, by="demo", reason="demo interrupted during a canary"):
        print(f"{model}: the interrupted canary was rolled back; the champion serves everyone")


def stop_on_signals() -> None:
    """SIGTERM (a supervisor, `kill`) and SIGINT stop the demo as Ctrl-C does: the running cycle is cancelled and a
    canary rolled back. SIGINT is restored too: a process started in the background by a non-interactive shell
    inherits it ignored, and would otherwise never see Ctrl-C's signal."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def run_cycle(model: str, n: int, quiet_while: str | None = None, traffic=None) -> float:
    """One cycle through the `flywheel-<model>` deployment (the runner executes it; the Prefect UI shows it),
    with a status line of the stage in progress. While the stage `quiet_while` (a child flow's name) runs, the
    users are quiet (`traffic.quiet`). Returns the seconds they were quiet. An interrupt cancels the run."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.deployments import run_deployment
    from prefect.states import Cancelling
    from tqdm import tqdm

    run = run_deployment(
        name=f"flywheel/flywheel-{model}", timeout=0, parameters={"model": model, "cycles": 1, "include_open_hour": True}
    )
    names: dict = {}
    quiet_event = traffic.quiet if traffic is not None else threading.Event()  # no users: nobody to quiet
    quiet_s, last = 0.0, time.monotonic()
    with get_client(sync_client=True) as client, tqdm(desc=f"cycle {n}", bar_format="{desc} [{elapsed}]") as bar:
        try:
            while not (state := client.read_flow_run(run.id).state).is_final():
                children = client.read_flow_runs(
                    flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run.id]))
                )
                stages, quiet = [], False
                for c in sorted(children, key=lambda c: c.created):
                    names.setdefault(c.flow_id, client.read_flow(c.flow_id).name)
                    stages.append(f"{names[c.flow_id]} {c.state.name.lower() if c.state else '?'}")
                    quiet |= names[c.flow_id] == quiet_while and not (c.state and c.state.is_final())
                now = time.monotonic()
                if quiet_event.is_set():
                    quiet_s += now - last
                last = now
                if quiet:
                    quiet_event.set()
                else:
                    quiet_event.clear()
                bar.set_description_str(f"cycle {n}: " + (" → ".join(stages) or state.name.lower()))
                time.sleep(2.0)
        except KeyboardInterrupt:
            client.set_flow_run_state(run.id, Cancelling(), force=True)
            raise
        finally:
            quiet_event.clear()
    if not state.is_completed():
        raise RuntimeError(
            f"flywheel cycle {n} ended {state.name}: {state.message}; see the flow run '{run.name}' in the Prefect UI"
        )
    return quiet_s


def cmd_demo(settings: TidalSettings, args) -> None:
    from serving.settings import client_keys
    from sim.users import SimTraffic
    from tidal.cli import ensure_champions, print_status
    from tidal.client_env import use_platform_env
    from tidal.platform import Platform
    from tidal.registry import Registry
    from tidal.store import open_store

    stop_on_signals()
    model = args.model or settings.models[0].name
    settings.model(model)  # an unknown name fails here, naming the models there are
    settings = demo_profile(settings, model)
    demo, cycles = settings.demo, args.cycles or settings.demo.cycles
    use_platform_env(settings)
    from tasks.flywheel import load_cycles  # Prefect reads its API URL on import: after the environment is set

    platform = Platform(settings)
    started = time.monotonic()
    platform.up_servers()
    use_settings_file(platform)
    ensure_champions(settings)
    platform.stop("flows")  # the runner executes the demo's cycles: it must read the demo's settings
    running = fleet_strategies(platform)
    strategy = settings.model(model).update_strategy
    if running and running.get(model, strategy) != strategy:
        print(f"fleet: restarting the supervisor, which serves {model} with {running[model]!r}, with the demo's {strategy!r}")
        platform.stop("fleet")
    platform.up_flows()
    platform.up_fleet()
    platform.up_gateway()
    print_status(platform.status())
    registry, store = Registry(settings.mlflow.tracking_uri), open_store(settings)
    first = 1 + len(load_cycles(store, model))
    g = settings.gateway
    traffic = SimTraffic(
        demo.users, f"http://{g.host}:{g.port}", client_keys(settings)[0].key, model, settings.bootstrap.heldout_fraction
    )
    settle_s = g.logsink.segment_max_age_s + g.logsink.upload_interval_s + demo.users.feedback_delay_s[1] + 1
    print(
        f"\n{model}: {cycles} flywheel cycles from champion v{registry.aliases(model)['champion']}, "
        f"{demo.requests_per_cycle} simulated requests each"
        + (f" ({demo.first_cycle_requests} before the first)" if first == 1 else "")
        + f" ({demo.users.users} users)"
    )
    traffic.start()
    collected = 0  # requests sent before the last cycle collected: the users keep typing while a cycle runs
    try:
        for n in range(first, first + cycles):
            wait_for_traffic(traffic, collected, requests_before(demo, n), f"cycle {n}: traffic")
            time.sleep(settle_s)  # the last records and verdicts reach the store
            collected = traffic.sent
            quiet_s = run_cycle(model, n, "train" if demo.quiet_while_training else None, traffic)
            reports = load_cycles(store, model)[first - 1 :]
            print(
                "\n"
                + cycle_table(reports)
                + f"\n({traffic.sent} simulated requests so far"
                + (f"; the users were quiet for {quiet_s:.0f} s while the cycle trained)" if quiet_s else ")")
            )
    except KeyboardInterrupt:
        leave_consistent(platform, model)
        raise
    finally:
        traffic.stop.set()
        traffic.join(timeout=120)
    reports = load_cycles(store, model)[first - 1 :]
    final = registry.aliases(model)["champion"]
    # Version 1, the final champion, and the last candidate (what training did, promoted or not).
    last = [r.candidate for r in reports if r.candidate and r.decision != "train_failed"][-1:]
    versions = sorted({1, final, *last})
    result = evaluate_versions(settings, platform, model, versions, demo.eval_requests, demo.users.seed + 1)
    print_eval(model, result, demo.eval_requests)
    report_demo(settings, model, reports, result, versions, final, time.monotonic() - started, traffic)


def train_seconds(settings: TidalSettings, model: str, reports: list[CycleReport]) -> float:
    """The trainer's wall seconds over the cycles' candidates (each run's result.json)."""
    from tidal.registry import Registry
    from tidal.store import get_json, open_store
    from training.job_spec import TrainResult

    registry, store, total = Registry(settings.mlflow.tracking_uri), open_store(settings), 0.0
    for r in reports:
        if r.candidate:
            run = registry.get(model, r.candidate).train_run
            if run and store.exists(key := f"training/model={model}/{run}/result.json"):
                total += TrainResult.model_validate(get_json(store, key)).train_s
    return total


def report_demo(
    settings: TidalSettings,
    model: str,
    reports: list[CycleReport],
    result: dict,
    versions: list[int],
    final: int,
    elapsed_s: float,
    traffic,
) -> None:
    import mlflow
    from prefect.artifacts import create_link_artifact, create_markdown_artifact

    from sim.learning_report import learning_report
    from sim.paired import claim_line, compare

    rows = []
    for v in versions:
        rows.append({"label": f"v{v}", "kind": "version", **result[v]["metrics"]})
    for v in versions:
        rows.append({"label": f"v{v} cut@{result[v]['baseline_k']}", "kind": "baseline", **result[v]["baseline"]})
    png = plot_versions(rows, settings.data_path / "demo" / f"{model}-flywheel.png")
    stored = [r.model_dump(mode="json") for r in reports]
    (settings.data_path / "demo" / f"{model}-cycles.json").write_text(json.dumps(stored, indent=2))
    first, last = result[1]["metrics"], result[final]["metrics"]
    vs_v1, vs_cut = (
        compare(result[1]["outcomes"], result[final]["outcomes"]),
        compare(result[1]["baseline_outcomes"], result[final]["outcomes"]),
    )
    report = learning_report(
        vs_v1,
        vs_cut,
        final,
        settings.demo.eval_requests,
        sum(r.decision == "promoted" for r in reports),
        elapsed_s,
        train_seconds(settings, model, reports),
    )
    (settings.data_path / "demo" / "report.json").write_text(report.model_dump_json(indent=2))
    mlflow.set_tracking_uri(settings.mlflow.tracking_uri)
    mlflow.set_experiment(f"{model}/demo")
    with mlflow.start_run(run_name=f"demo {len(reports)} cycles") as run:
        mlflow.log_params(
            {
                "cycles": len(reports),
                "requests_per_cycle": settings.demo.requests_per_cycle,
                "first_cycle_requests": settings.demo.first_cycle_requests,
                "users": settings.demo.users.users,
                "eval_requests": settings.demo.eval_requests,
                "versions": ",".join(f"v{v}" for v in versions),
            }
        )
        for r in reports:
            for m, x in r.champion_metrics().items():
                mlflow.log_metric(f"cycle/{m}", x, step=r.cycle)
        for v in versions:
            mlflow.log_metrics({f"eval/v{v}/{m}": e.mean for m, e in result[v]["metrics"].items()})
        ratios = {k: getattr(report, k) for k in ("accept_ratio", "suggestion_ratio", "chars_ratio", "reward_delta")}
        mlflow.log_metrics({f"eval/{k}": x for k, x in ratios.items() if x is not None} | {"demo/minutes": elapsed_s / 60})
        mlflow.log_artifact(str(png))
        mlflow.log_dict(stored, "cycles.json")
        mlflow.log_dict(report.model_dump(), "report.json")
    run_url = f"{settings.mlflow.tracking_uri}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
    create_link_artifact(
        key=f"{model}-demo-plot", link=run_url, link_text=f"{model}: flywheel metrics by version (PNG in MLflow)"
    )
    create_markdown_artifact(
        key=f"{model}-demo",
        description="tidal demo",
        markdown=(
            f"# {model}: demo, {len(reports)} cycles in {elapsed_s / 60:.1f} min\n\n```\n{cycle_table(reports)}\n```\n\n"
            f"Held-out accept rate v1 → v{final} (final champion): {first['accept_rate']} → {last['accept_rate']}\n\n"
            f"[plot and figures in MLflow]({run_url})\n"
        ),
    )
    if final == 1:
        print(
            "\nlearning claim: none — no candidate was promoted, the champion is still v1 (see each cycle's 'why' above; "
            "the last candidate's paired differences are under the held-out table)"
        )
    else:
        print(
            "\n"
            + claim_line(vs_v1, "v1", f"v{final}", settings.demo.eval_requests)
            + "\n  (Cursor reported +28% accept rate with 21% fewer suggestions)"
        )
    gaps = {m: vs_cut[m] for m in ("accepted_chars_per_request", "reward_per_request")}
    print(
        f"against v1 cut to its best {result[1]['baseline_k']} characters: "
        + "; ".join(f"{m} {c.delta.mean:+.4f} [{c.delta.low:+.4f}, {c.delta.high:+.4f}]" for m, c in gaps.items())
        + ("" if report.beats_truncation else f" — v{final} does not yet match the truncation baseline")
    )
    print(
        f"\ndemo done in {elapsed_s / 60:.1f} min; {traffic.sent} simulated requests; plot: {png}; "
        f"report: {settings.data_path / 'demo' / 'report.json'}\n"
        f"  Prefect UI: http://{settings.prefect.host}:{settings.prefect.port}  (flows, deployments, artifacts)\n"
        f"  MLflow UI:  {settings.mlflow.tracking_uri}  (experiment {model}/demo; registry: model {model})\n"
        f"  stop everything: .venv/bin/tidal down"
    )
