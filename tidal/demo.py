"""`tidal demo`: the whole loop on one machine, with simulated users.

    platform up (bootstrap if needed; the capacity scheduler under demo.capacity.mode tidal)
    → simulated users send Tab traffic through the gateway all along (on a compressed daily curve under the tide)
    → N × [wait for `requests_per_cycle` new requests (`first_cycle_requests` before the model's first)
           → flywheel cycle, whose trainer waits for a lease of the trough (tidal) or has the cores while the users
             pause (static)]
    → held-out eval of version 1 vs the final champion (tidal/heldout_eval.py) → table, PNG plots of the versions
      and of the tide (MLflow run + Prefect artifact), where to look.

The demo's cycles use `demo.canary`, `demo.train` and `demo.capacity` (sized for a laptop) and start the flows
runner with `flywheel.loop: manual`, so no schedule or trigger runs a second loop beside the demo's.
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
from tidal.demo_tide import TideWatch, plot_tide, summarize_tide, tidal_updates
from tidal.heldout_eval import METRIC_NAMES, evaluate_versions, print_eval
from tidal.loop_settings import DemoSettings, FlywheelSettings
from tidal.section import SettingsError
from tidal.settings import TidalSettings, tab_aids_problem
from tidal.strategy import model_mismatch


def demo_profile(settings: TidalSettings, model: str) -> TidalSettings:
    """The settings the demo runs under: its canary, training and capacity, no schedule, and `demo.update_strategy`
    for the model it cycles (the other models are not trained by the demo: they keep theirs, and the fleet keeps
    serving them). Under demo.capacity.mode tidal, the tide's settings too (tidal/demo_tide.py)."""
    demo, train = settings.demo, settings.demo.train
    static = demo.capacity.mode == "static"
    if static and demo.quiet_while_training and train.torch_threads is None:
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
    # the demo's training becomes every model's while it runs (training settings are platform-wide)
    for m in models:
        if problem := tab_aids_problem(m.name, settings.collect.rule_for(m.name), "demo.train", train.ppo):
            raise SettingsError(f"the demo's training would apply to every model while it runs: {problem}")
    update = {
        "canary": demo.canary,
        "train": train,
        "models": models,
        "capacity": demo.capacity.model_copy(update={"host": settings.capacity.host, "port": settings.capacity.port}),
        "flywheel": FlywheelSettings(loop="manual", schedule_cron=settings.flywheel.schedule_cron),
    }
    return settings.model_copy(update=update | ({} if static else tidal_updates(settings, models, model)))


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
    platform.stop("capacity")  # so must the scheduler, which sizes the fleet by the demo's bounds (none: static)
    running = fleet_strategies(platform)
    strategy = settings.model(model).update_strategy
    if running and running.get(model, strategy) != strategy:
        print(f"fleet: restarting the supervisor, which serves {model} with {running[model]!r}, with the demo's {strategy!r}")
        platform.stop("fleet")
    platform.up_flows()
    platform.up_fleet()
    platform.up_gateway()
    platform.up_capacity()  # tidal: after the fleet and the gateway it observes
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
    tidal = demo.capacity.mode == "tidal"
    if tidal:
        day = demo.users.daily
        print(
            f"{model}: the users follow a {day.day_s:g}-s day ({day.trough_rps:g} to {day.peak_rps:g} req/s); the capacity "
            f"scheduler sizes {model} between {demo.serving.min_replicas} and {settings.model(model).capacity.max_replicas} "
            f"replicas and lends the rest of {settings.capacity.usable_units} {settings.capacity.unit}(s) to each cycle's trainer"
        )
    tide = TideWatch(platform, model, demo.users.daily) if tidal else None
    traffic.start()
    if tide:
        tide.start()
    collected = 0  # requests sent before the last cycle collected: the users keep typing while a cycle runs
    try:
        for n in range(first, first + cycles):
            wait_for_traffic(traffic, collected, requests_before(demo, n), f"cycle {n}: traffic")
            time.sleep(settle_s)  # the last records and verdicts reach the store
            collected = traffic.sent
            quiet_s = run_cycle(model, n, "train" if demo.quiet_while_training and not tidal else None, traffic)
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
        if tide:
            tide.stop.set()
        traffic.join(timeout=120)
    reports = load_cycles(store, model)[first - 1 :]
    final = registry.aliases(model)["champion"]
    # Version 1, the final champion, and the last candidate (what training did, promoted or not).
    last = [r.candidate for r in reports if r.candidate and r.decision != "train_failed"][-1:]
    versions = sorted({1, final, *last})
    result = evaluate_versions(settings, platform, model, versions, demo.eval_requests, demo.users.seed + 1)
    print_eval(model, result, demo.eval_requests)
    report_demo(settings, model, reports, result, versions, final, time.monotonic() - started, traffic, tide)


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
    tide: TideWatch | None = None,
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
    tide_png, tide_summary = None, None
    if tide is not None and tide.samples:  # the tide's plot and figures (tidal/demo_tide.py)
        objective_ms = settings.model(model).capacity.latency_objective_ms
        tide_png = plot_tide(tide.samples, model, objective_ms, settings.data_path / "demo" / f"{model}-tide.png")
        tide_summary = summarize_tide(tide.samples, objective_ms)
        tide_record = {"summary": tide_summary.model_dump(), "samples": [s.model_dump() for s in tide.samples]}
        (settings.data_path / "demo" / f"{model}-tide.json").write_text(json.dumps(tide_record))
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
                "capacity": settings.capacity.mode,
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
        if tide_summary is not None:
            mlflow.log_metrics({f"tide/{k}": float(v) for k, v in tide_summary.model_dump().items() if v is not None})
            mlflow.log_artifact(str(tide_png))
            mlflow.log_dict(tide_record, "tide.json")
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
            + (f"{tide_summary.describe()}\n\n" if tide_summary else "")
            + f"[plots and figures in MLflow]({run_url})\n"
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
    if tide_summary is not None:
        print(f"\n{tide_summary.describe()}; plot: {tide_png}")
    print(
        f"\ndemo done in {elapsed_s / 60:.1f} min; {traffic.sent} simulated requests; plot: {png}; "
        f"report: {settings.data_path / 'demo' / 'report.json'}\n"
        f"  Prefect UI: http://{settings.prefect.host}:{settings.prefect.port}  (flows, deployments, artifacts)\n"
        f"  MLflow UI:  {settings.mlflow.tracking_uri}  (experiment {model}/demo; registry: model {model})\n"
        f"  stop everything: .venv/bin/tidal down"
    )
