"""The README's main command, `tidal demo`, on the session's platform with tiny `TIDAL_DEMO__*` settings: simulated
users through the gateway and the vLLM fleet, one flywheel cycle (collect → train → offline gate → canary →
decision) run by the flows runner through the Prefect and MLflow servers, then the held-out replay and the report.
Afterwards the registry, the route table, the events, the artifacts, the MLflow run and the PNG agree with the
cycle's record; a second demo interrupted during its canary leaves everyone on the champion.
(Runs after the release-plane tests: it may promote a new champion.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime

import httpx
import pytest

from sim.learning_report import LearningReport
from tasks.flywheel import load_cycles
from tidal.store import get_json, open_store
from tidal.tokens import admin_token
from training.job_spec import TrainJob, TrainResult
from training.reward_data import load_dataset, split
from training.rollout import select_samples

pytestmark = pytest.mark.slow

# A laptop demo cut to what one cycle needs to pass every stage: 60 requests from 200 users, a 2-iteration PPO run
# of 16-row batches with the opt-in learning aids (hindsight rows, split credit from partial verdicts, stop credit
# from every verdict, the code loss, distillation from the champion at 0.5) on an adapter served by the 'lora'
# strategy (the session's fleet; the demo's own full-weight training and 'restart' strategy would add two engine
# boots: restart's canary has its own tests in test_fleet.py and test_promote.py), a gate on 50 held-out rows and
# 5 kB of code that lets any sane candidate through (the gate's refusals have their own tests) and one 50% canary
# step that ends within 25 s, decided or rolled back as inconclusive; then 20 held-out requests per version.
TINY = {
    "TIDAL_DEMO__REQUESTS_PER_CYCLE": "60",
    "TIDAL_DEMO__FIRST_CYCLE_REQUESTS": "60",
    "TIDAL_DEMO__EVAL_REQUESTS": "20",
    "TIDAL_DEMO__USERS__USERS": "200",
    "TIDAL_DEMO__USERS__SITES": "400",
    "TIDAL_DEMO__USERS__CONCURRENCY": "2",
    "TIDAL_DEMO__USERS__THINK_S": "[0.1, 0.3]",
    "TIDAL_DEMO__USERS__FEEDBACK_DELAY_S": "[0.1, 0.5]",
    "TIDAL_DEMO__UPDATE_STRATEGY": "lora",
    "TIDAL_DEMO__TRAIN__PPO__LORA": "true",
    "TIDAL_DEMO__TRAIN__PPO__FINAL_NORM_LEARNING_RATE": "null",
    "TIDAL_DEMO__TRAIN__PPO__MAX_ITERATIONS": "2",
    "TIDAL_DEMO__TRAIN__PPO__BATCH_SIZE": "16",
    "TIDAL_DEMO__TRAIN__PPO__HINDSIGHT_PARTIALS": "true",
    "TIDAL_DEMO__TRAIN__PPO__PARTIAL_CREDIT": "kept_prefix",
    "TIDAL_DEMO__TRAIN__PPO__PTX_COEF": "1.0",
    "TIDAL_DEMO__TRAIN__PPO__STOP_CREDIT_COEF": "1.0",
    "TIDAL_DEMO__TRAIN__CHECKPOINT_EVERY": "2",
    "TIDAL_DEMO__TRAIN__GATE__MAX_HELDOUT_ROWS": "50",
    "TIDAL_DEMO__TRAIN__GATE__EVAL_BYTES": "5000",
    "TIDAL_DEMO__TRAIN__GATE__OPE_TOLERANCE": "1.0",
    "TIDAL_DEMO__TRAIN__GATE__BPB_TOLERANCE": "0.2",
    "TIDAL_DEMO__CANARY__STEPS": "[0.5]",
    "TIDAL_DEMO__CANARY__MIN_SAMPLES": "40",
    "TIDAL_DEMO__CANARY__MIN_TEST_SAMPLES": "10",
    "TIDAL_DEMO__CANARY__MAX_STEP_S": "25",
    "TIDAL_DEMO__CANARY__POLL_S": "2",
    "TIDAL_DEMO__CANARY__FEEDBACK_WAIT_S": "3",
    "TIDAL_DEMO__CANARY__UNLOAD_GRACE_S": "0",
}


# The tide (demo.capacity.mode tidal; the default is static, as the demo's): users on a 2-minute day from
# mid-morning (about 3.5 req/s), the capacity scheduler lending training what serving's minimum leaves. tide_env holds
# tab at the replicas the session runs (no engine starts: the ramp and its revocation are test_tidal_scheduling.py's)
# with one unit beside the fleet to lend. The run waits for its lease (3-8 minutes more on 2 cores), so the demo test
# on the tide runs with --long; the suite runs the demo as `./run.sh demo` does.
TIDE = {
    "TIDAL_DEMO__CAPACITY__MODE": "tidal",
    "TIDAL_DEMO__DAY__DAY_S": "120",
    "TIDAL_DEMO__DAY__PEAK_RPS": "6",
    "TIDAL_DEMO__DAY__START_HOUR": "8",
}


def tide_env(platform) -> dict[str, str]:
    running = {name: m.desired_replicas for name, m in platform.fleet_client().status().models.items()}
    return {
        **TIDE,
        "TIDAL_DEMO__CAPACITY__TOTAL_UNITS": str(sum(running.values()) + 1),
        "TIDAL_DEMO__SERVING__MIN_REPLICAS": str(running["tab"]),
        "TIDAL_DEMO__SERVING__MAX_REPLICAS": str(running["tab"]),
    }


def demo_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}
    return {**env, "TIDAL_CONFIG": os.environ["TIDAL_CONFIG"], **TINY, **extra, "PYTHONUNBUFFERED": "1"}


def events_named(api: str, name: str) -> list[dict]:
    r = httpx.post(
        f"{api}/events/filter",
        json={"filter": {"event": {"name": [name]}, "occurred": {"since": "2000-01-01T00:00:00Z"}}, "limit": 50},
        timeout=30,
    )
    r.raise_for_status()
    return r.json()["events"]


def flow_runs(api: str, body: dict) -> list[dict]:
    r = httpx.post(f"{api}/flow_runs/filter", json=body, timeout=30)
    r.raise_for_status()
    return r.json()


def arm_weights(platform) -> list[tuple[str, float]]:
    """(name, weight) of each arm of tab's route, control first; none before a release has written the route."""
    route = platform.routes_client().show().routes.get("tab")
    return [(a.name, a.weight) for a in route.arms] if route else []


@pytest.fixture
def session_runner(platform, settings):
    """The demo restarts the flows runner on its own profile (demo.train, demo.canary); afterwards the runner runs on
    the session's settings again, for whatever test needs it next."""
    yield
    platform.write_settings_file()
    platform.stop("capacity")  # the demo's scheduler: the session's fleet is the tests' to size
    platform.stop("flows")  # returns once the runner's port can be bound again
    platform.up_flows()


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("capacity", ["static", pytest.param("tidal", marks=pytest.mark.long)])
def test_tidal_demo_runs_one_cycle_and_reports(settings, platform, registry, gateway, session_runner, capacity):
    api, store = settings.prefect.api_url, open_store(settings)
    tide = capacity == "tidal"
    champion_before = registry.aliases("tab")["champion"]
    cycles_before = len(load_cycles(store, "tab"))
    since = datetime.now(UTC).isoformat()
    out = subprocess.run(
        [sys.executable, "-m", "tidal.cli", "demo", "--cycles", "1"],
        env=demo_env(**(tide_env(platform) if tide else {})),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    print(out.stdout[-4000:], out.stderr[-3000:], sep="\n")
    assert out.returncode == 0, out.stderr[-3000:]

    # The cycle's record: one new cycle, from the champion, on a dataset holding its traffic; the canary ran.
    [report] = load_cycles(store, "tab")[cycles_before:]
    assert report.cycle == cycles_before + 1 and report.champion_before == champion_before, report
    assert report.rows > 0 and report.served[champion_before]["requests"] > 0, report
    assert report.decision in {"promoted", "rolled_back"}, report
    cand = registry.get("tab", report.candidate)
    assert cand.tags["tidal.dataset_id"] == report.dataset_id and cand.tags["tidal.parent_version"] == str(champion_before)
    assert "tidal.release.verified" in cand.tags and json.loads(cand.tags["tidal.release.step_1"])["weight"] == 0.5
    # ... and its step table: per step the outcomes per arm, each metric's interval and margin, the reason
    record = report.canary
    assert record is not None, report
    assert (record.control, record.canary) == (champion_before, cand.version), record
    assert record.steps[-1].action in {"promote", "rollback", "inconclusive"} and record.steps[-1].n_canary > 0, record
    assert {m.metric for m in record.steps[-1].metrics} >= {"reward", "accepted_chars", "error_rate", "slow_share"}
    assert "step 1 at 50%: " in out.stdout and "accepted_chars" in out.stdout, out.stdout[-3000:]

    # The demo's training settings reached the trainer: 2 iterations, and every partial verdict among the training
    # rows became a hindsight row and a credited row (or was counted as skipped); the trainer took the code loss and
    # the stop credit.
    result = TrainResult.model_validate(get_json(store, f"training/model=tab/{cand.tags['tidal.train_run']}/result.json"))
    assert result.iterations == 2, result
    data = load_dataset(store, "tab", report.dataset_id)
    train_rows, _ = split(data.samples, settings.demo.train.heldout_fraction)
    kept = select_samples(train_rows, champion_before, settings.demo.train.ppo.max_stale_versions).kept
    partials = sum(s.event == "partial" for s in kept)
    assert result.hindsight_rows + sum(result.hindsight_skipped.values()) == partials, (result, partials)
    assert partials == 0 or result.hindsight_rows > 0, result
    no_chars = sum(s.event == "partial" and not s.accepted_chars for s in kept)
    assert result.credited_partials == partials - no_chars, (result, partials, no_chars)
    assert result.final["ppo/ptx_loss"] > 0, result.final
    assert "ppo/stop_credit_loss" in result.final and result.final["ppo/sharpen_loss"] > 0, result.final

    if tide:
        assert_the_run_trained_on_the_tide(settings, cand, out.stdout)

    # Registry and routes agree with the decision; no canary is left behind.
    aliases, arms = registry.aliases("tab"), platform.routes_client().show().routes["tab"].arms
    assert [(a.name, a.weight) for a in arms] == [("control", 1.0)]
    if report.decision == "promoted":
        assert aliases["champion"] == cand.version == report.champion_after == arms[0].version
        assert "tidal.release.promoted" in cand.tags
    else:
        assert aliases["champion"] == champion_before == report.champion_after == arms[0].version
        assert json.loads(cand.tags["tidal.release.rolled_back"])["reason"] == report.reason

    # The cycle ran as one flywheel flow run of the deployment, through the runner; its stages announced themselves
    # as the flywheel's, so no chained train or promote run started.
    runs = flow_runs(api, {"flow_runs": {"start_time": {"after_": since}}, "deployments": {"name": {"any_": ["flywheel-tab"]}}})
    assert [r["state"]["type"] for r in runs] == ["COMPLETED"], runs
    assert (
        flow_runs(
            api, {"flow_runs": {"start_time": {"after_": since}}, "deployments": {"name": {"any_": ["train-tab", "promote-tab"]}}}
        )
        == []
    )
    ready = [e for e in events_named(api, "tidal.dataset.ready") if e["payload"]["dataset_id"] == report.dataset_id]
    assert [e["resource"]["tidal.driver"] for e in ready] == ["flywheel"]
    registered = [e for e in events_named(api, "tidal.candidate.registered") if e["payload"]["version"] == cand.version]
    assert [e["resource"]["tidal.driver"] for e in registered] == ["flywheel"]

    # Prefect artifacts: the cycle table, the demo's summary and the link to its MLflow run.
    arts = {
        a["key"]: a
        for a in httpx.post(
            f"{api}/artifacts/filter",
            timeout=30,
            json={"artifacts": {"key": {"any_": ["tab-flywheel", "tab-demo", "tab-demo-plot"]}}, "sort": "CREATED_DESC"},
        ).json()[::-1]
    }
    assert arts["tab-flywheel"]["type"] == "table" and report.dataset_id in json.dumps(arts["tab-flywheel"]["data"])
    assert arts["tab-demo"]["type"] == "markdown" and "demo, 1 cycles" in arts["tab-demo"]["data"]
    assert arts["tab-demo-plot"]["type"] == "markdown"  # Prefect keeps a link artifact as its markdown link

    # The MLflow demo run: parameters, a cycle metric, held-out figures for each version replayed, the PNG.
    import mlflow

    client = mlflow.MlflowClient(settings.mlflow.tracking_uri)
    [run] = client.search_runs(
        [client.get_experiment_by_name("tab/demo").experiment_id], order_by=["start_time DESC"], max_results=1
    )
    versions = sorted({1, report.champion_after, cand.version})
    assert run.data.params["versions"] == ",".join(f"v{v}" for v in versions)
    assert run.info.run_id in arts["tab-demo-plot"]["data"]
    for v in versions:
        assert 0 <= run.data.metrics[f"eval/v{v}/accept_rate"] <= 1
    assert "cycle/accept_rate" in run.data.metrics and run.data.metrics["demo/minutes"] > 0
    assert {f.path for f in client.list_artifacts(run.info.run_id)} >= {
        "tab-flywheel.png",
        "cycles.json",
    }
    assert run.data.params["capacity"] == capacity and ("tide: " in arts["tab-demo"]["data"]) == tide
    if tide:
        assert "tab-tide.png" in {f.path for f in client.list_artifacts(run.info.run_id)}
        assert run.data.metrics["tide/grants"] >= 1

    # The files and the printed report.
    png = settings.data_path / "demo" / "tab-flywheel.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((settings.data_path / "demo" / "tab-cycles.json").read_text())[-1]["dataset_id"] == report.dataset_id
    assert "held-out users (20 requests" in out.stdout and f"{report.decision} v{cand.version}" in out.stdout
    assert "learning claim" in out.stdout and f"plot: {png}" in out.stdout
    if tide:
        assert "the users follow a 120-s day (1.5 to 6 req/s)" in out.stdout and "the users were quiet" not in out.stdout
    for v in versions[1:]:
        assert f"v{v} − v1, paired on the same 20 requests" in out.stdout
    # The final report: the final champion against v1 on the same 20 requests, and the cycle's trainer seconds.
    learned = LearningReport.model_validate_json((settings.data_path / "demo" / "report.json").read_text())
    assert (learned.final_version, learned.requests_per_version) == (report.champion_after, 20), learned
    assert learned.promoted == (report.decision == "promoted") and learned.train_s == result.train_s > 0, learned
    assert 0 < learned.train_s < learned.total_s and learned.suggestion_ratio is not None, learned
    for v in versions:
        assert f"\nv{v} " in out.stdout and f"v{v} cut to" in out.stdout


def assert_the_run_trained_on_the_tide(settings, cand, stdout: str) -> None:
    """The tide: the run trained on a lease of the unit beside the fleet, with that many threads, and gave it back;
    the demo's report holds the scheduler's timeline, its figures and its plot."""
    run_key = cand.tags["tidal.train_run"]
    spec = TrainJob.model_validate_json((settings.run_dir / f"train-tab-{run_key}.json").read_text())
    assert spec.torch_threads == 1, spec.torch_threads
    events = httpx.get(
        f"http://{settings.capacity.host}:{settings.capacity.port}/capacity",
        headers={"Authorization": f"Bearer {admin_token(settings)}"},
        timeout=10,
    ).json()["events"]
    assert [(e["kind"], e["units"]) for e in events if e["holder"] == run_key] == [("grant", 1), ("release", 1)], events
    timeline = json.loads((settings.data_path / "demo" / "tab-tide.json").read_text())
    assert timeline["summary"]["grants"] >= 1 and timeline["summary"]["revocations"] == 0, timeline["summary"]
    assert {s["lent_units"] for s in timeline["samples"]} >= {1} and {s["replicas"] for s in timeline["samples"]} == {2}
    assert (settings.data_path / "demo" / "tab-tide.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"tide: {timeline['summary']['grants']} lease(s) granted" in stdout


@pytest.mark.long  # a second cycle up to its canary: ~7 minutes on 2 cores
@pytest.mark.timeout(900)
def test_interrupting_the_demo_during_its_canary_leaves_the_champion_serving_everyone(
    settings, platform, registry, gateway, session_runner
):
    # A canary that cannot end by itself before the interrupt: many outcomes needed, a long step.
    champion = registry.aliases("tab")["champion"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tidal.cli", "demo", "--cycles", "1"],
        text=True,
        env=demo_env(**tide_env(platform), TIDAL_DEMO__CANARY__MIN_SAMPLES="100000", TIDAL_DEMO__CANARY__MAX_STEP_S="600"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 600
        while [a for a, _ in arm_weights(platform)] != ["control", "canary"]:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "the demo's canary never started"
            time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=180)
    finally:
        proc.kill()
    print(output[-3000:])
    assert proc.returncode == 130, output[-3000:]
    # The cancelled release rolls its canary back itself (flows/promote.py); if it could not, the demo does.
    last = platform.routes_client().show().routes["tab"]
    assert "interrupted" in output, output[-3000:]
    assert "the interrupted canary was rolled back" in output or last.updated_by == "promote", (last, output[-3000:])
    assert arm_weights(platform) == [("control", 1.0)]
    assert registry.aliases("tab")["champion"] == champion
    # The cancelled cycle's flow run stops in the runner, and nothing puts the canary back.
    api, deadline = settings.prefect.api_url, time.monotonic() + 90
    while (
        state := flow_runs(api, {"deployments": {"name": {"any_": ["flywheel-tab"]}}, "sort": "START_TIME_DESC", "limit": 1})[0][
            "state"
        ]["type"]
    ) != "CANCELLED":
        assert time.monotonic() < deadline, state
        time.sleep(1)
    assert arm_weights(platform) == [("control", 1.0)]
    assert platform.routes_client().show().routes["tab"].arms[0].version == champion
