"""The promote flow on the real platform: real vLLM replicas, the gateway, simulated Tab users who keep
suggestions that stay on the line they are typing. A degraded candidate (an adapter pushing the
model towards line breaks), better on reward under a rule that pays for silence but worse on accepted
characters, is rolled back at the first step with about 5% of users exposed; a candidate an operator sets in the
MLflow registry is released, and `tidal rollback` ends its ramp at once, as does `tidal pause` another's; a step and
the promotion listed in `canary.approve_before` wait for a typed human answer (`tidal approve`, or the Prefect API);
the audit trail shows each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from mlflow import MlflowClient

from release.operations import rollback_now
from release.report import CanaryRecord, canary_key
from tests.integration.release_helpers import (
    Promote,
    Users,
    canary_user_share,
    cursor_prompts,
    merged,
    newline_adapter,
    start_at_first_step,
    tags,
)
from tidal import lineage
from tidal.flywheel_pause import paused as paused_now
from tidal.registry import publish
from tidal.store import get_json, open_store

pytestmark = pytest.mark.slow


@pytest.mark.timeout(1800)  # ~15 canary outcomes at 5% of a few requests/s, plus the platform when run alone
def test_degraded_candidate_is_rolled_back_at_the_first_step(
    settings, registry, checkpoints, base_dir, gateway, keys, tmp_path, chaos_report, no_canary
):
    """The pilot's silent-collapse trap, live: these users ask for single-line suggestions (stop at a line break),
    so the degraded candidate, which starts a new line at once, mostly shows nothing; under a reward rule that pays
    1.0 for an empty completion (more than an accept) it earns more reward per request than the champion while its
    users keep no characters. The accepted-characters guardrail (the production 5% margin) rolls it back."""
    bad = newline_adapter(base_dir, tmp_path / "degraded")
    info = publish(registry, checkpoints.store, "tab", bad, "lora", 1, {"tidal.origin": "test: degraded"})
    users = Users(gateway, keys["alice"], cursor_prompts(settings, 300, seed=11), stop=["\n"])
    # This regression is large (accepted characters per request fall to nothing), so the sequential test may look
    # from 15 outcomes per arm: ~15 canary outcomes at 5%, half the wait of the default small-n guard (30).
    env = {
        **os.environ,
        "TIDAL_CANARY__MIN_TEST_SAMPLES": "15",
        "TIDAL_CANARY__MARGINS__ACCEPTED_CHARS": "0.05",
        "TIDAL_COLLECT__REWARD_RULE__EMPTY": "1.0",
    }
    promote = Promote(info.version, tmp_path / "promote.log", env=env)
    try:
        start_at_first_step(users, registry, promote, info.version)
        rc, out = promote.finish(timeout=840)
    finally:
        users.stop.set()
        if users.is_alive():
            users.join(timeout=120)
    assert rc == 0 and "rolled back" in out, out[-3000:]
    t = tags(registry, info.version)
    assert {"tidal.release.deployed", "tidal.release.verified", "tidal.release.step_1", "tidal.release.rolled_back"} <= set(t)
    assert "tidal.release.step_2" not in t  # never went past 5%
    rolled = json.loads(t["tidal.release.rolled_back"])
    print("degraded canary:", rolled["reason"], rolled["figures"])
    assert rolled["by"] == "promote" and rolled["figures"]["step"] == 1, rolled
    assert rolled["reason"].startswith("accepted chars per request fell"), rolled["reason"]
    # the step table in the store: reward rose while accepted characters fell
    record = CanaryRecord.model_validate(get_json(checkpoints.store, canary_key("tab", info.version)))
    last = record.steps[-1]
    metrics = {m.metric: m for m in last.metrics}
    assert (record.control, record.canary, last.action, last.step) == (1, info.version, "rollback", 1)
    assert metrics["reward"].canary > metrics["reward"].control, metrics["reward"]
    chars = metrics["accepted_chars"]
    assert chars.high < -chars.margin and chars.margin == pytest.approx(0.05 * chars.control, rel=1e-3), chars
    exposed = rolled["figures"]["n_canary"] / (rolled["figures"]["n_canary"] + rolled["figures"]["n_control"])
    # The first step's 5% weight exposes the users the keyed hash puts below 0.05: 25 of these 400 with the session's
    # secret (6.25%, within the binomial spread of 5% of 400 users, ±1.1 points); each sends the same share of requests.
    w = settings.canary.steps[0]
    hashed = canary_user_share(settings, "tab", users.users, w)
    assert abs(hashed - w) <= 3 * (w * (1 - w) / users.users) ** 0.5, hashed
    assert abs(exposed - hashed) <= 0.015, (exposed, hashed)
    step_1_ms = json.loads(t["tidal.release.step_1"])["at_ms"]  # canary traffic starts
    chaos_report.record(
        "7. regressed candidate mid-ramp",
        rolled_back_at_step=rolled["figures"]["step"],
        time_to_rollback_s=round((rolled["at_ms"] - step_1_ms) / 1000, 1),
        exposed_canary_outcomes=rolled["figures"]["n_canary"],
        exposed_share=round(exposed, 3),
        reason=rolled["reason"][:120],
    )
    assert users.errors == []
    # routes: the canary is gone, the champion serves everyone
    routes = json.loads(
        subprocess.run(
            [sys.executable, "-m", "tidal.cli", "route", "show"], capture_output=True, text=True, check=True, env=dict(os.environ)
        ).stdout
    )["routes"]["tab"]["arms"]
    assert [(a["name"], a["version"], a["weight"]) for a in routes] == [("control", 1, 1.0)]
    assert registry.aliases("tab")["champion"] == 1


def tidal(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tidal.cli", *args], capture_output=True, text=True, env=dict(os.environ))


def neutral_ramp_at_step_1(registry, checkpoints, neutral_adapter, users, tmp_path, origin: str):
    """A candidate with the champion's own outputs (no decision soon) released until its first step is routed;
    returns its version info and the running `tidal promote`."""
    info = publish(registry, checkpoints.store, "tab", neutral_adapter, "lora", 1, {"tidal.origin": origin})
    promote = Promote(info.version, tmp_path / "promote.log")
    start_at_first_step(users, registry, promote, info.version)
    return info, promote


@pytest.mark.long  # ~50 s; alias moves through the real webhook stay in test_registry_webhooks.py
def test_a_candidate_set_in_the_registry_ramps_until_an_operator_rolls_it_back(
    settings, registry, checkpoints, neutral_adapter, users, platform
):
    """The operator sets `candidate` in the MLflow registry (its client, as the UI does): the webhook's receiver starts
    the promote deployment, which verifies and ramps it; `tidal rollback` ends the ramp at once."""
    platform.up_flows()  # the flows runner runs the release the receiver starts
    info = publish(registry, checkpoints.store, "tab", neutral_adapter, "lora", 1, {"tidal.origin": "test: neutral"})
    mlflow_ui = MlflowClient(settings.mlflow.tracking_uri)
    mlflow_ui.set_model_version_tag("tab", str(info.version), lineage.GATE_OVERRIDE, "oncall: an A/A adapter, no gate run")
    mlflow_ui.set_registered_model_alias("tab", "candidate", str(info.version))
    start_at_first_step(users, registry, None, info.version)  # the release runs in the flows runner
    deadline = time.monotonic() + 600
    t = tags(registry, info.version)
    started, override = json.loads(t["tidal.release.registry_release"]), json.loads(t["tidal.release.gate_override"])
    assert override["by"] == "oncall: an A/A adapter, no gate run" and override["alias"] == "candidate"
    time.sleep(5)  # the canary serves for a moment
    rb = tidal("rollback", "tab", "--by", "oncall", "--reason", "pager says no")
    assert rb.returncode == 0, rb.stdout + rb.stderr
    result = json.loads(rb.stdout)
    assert result["serving"] == 1 and result["rolled_back"] == [info.version] and result["route_change_s"] < 5
    run = f"{settings.prefect.api_url}/flow_runs/{started['flow_run']}"
    while (state := httpx.get(run, timeout=30).json()["state"])["type"] not in ("COMPLETED", "FAILED", "CRASHED"):
        assert time.monotonic() < deadline + 300, state
        time.sleep(1)
    assert state["type"] == "COMPLETED", state
    t = tags(registry, info.version)
    manual, ended = json.loads(t["tidal.release.manual_rollback"]), json.loads(t["tidal.release.rolled_back"])
    assert (manual["by"], manual["reason"], manual["to"]) == ("oncall", "pager says no", 1)
    assert ended["reason"].startswith("canary removed from the routes by an operator")
    assert "tidal.release.promoted" not in t and registry.aliases("tab")["champion"] == 1
    assert users.errors == []


# Behind --long (~1 minute: a ramp of its own). The suite ends a ramp by an operator's rollback (the test above);
# the pause's record, refusals and resume are tests/unit/test_flywheel_pause.py's.
@pytest.mark.long
def test_pausing_the_flywheel_mid_canary_returns_traffic_to_control(
    settings, registry, checkpoints, neutral_adapter, users, tmp_path, platform
):
    # only the pause ends this ramp
    info, promote = neutral_ramp_at_step_1(registry, checkpoints, neutral_adapter, users, tmp_path, "test: paused")
    try:
        paused = tidal("pause", "tab", "--by", "oncall", "--reason", "labels broken upstream")
        assert paused.returncode == 0, paused.stdout + paused.stderr
        assert json.loads(paused.stdout)["record"]["paused"] is True
        rc, out = promote.finish(timeout=300)
        assert rc == 0 and "rolled back" in out and "flywheel paused" in out, out[-3000:]
        users.stop.set()  # the commands below need no traffic: the cores are theirs
        arms = platform.routes_client().show().routes["tab"].arms
        assert [(a.name, a.version, a.weight) for a in arms] == [("control", 1, 1.0)]
        ended = json.loads(tags(registry, info.version)["tidal.release.rolled_back"])
        assert "oncall" in ended["reason"] and "labels broken upstream" in ended["reason"]
        status = json.loads(tidal("status", "--json").stdout)
        assert (status["paused"]["tab"]["by"], status["paused"]["tab"]["reason"]) == ("oncall", "labels broken upstream")
        refused = tidal("promote", "tab", "--candidate", str(info.version), "--no-gate")
        assert refused.returncode == 1 and "promote refused" in refused.stderr and "tidal resume tab" in refused.stderr, (
            refused.stdout + refused.stderr
        )
        assert "Traceback" not in refused.stderr
    finally:
        resumed = tidal("resume", "tab", "--by", "oncall", "--reason", "labels fixed")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert paused_now(open_store(settings), "tab") is None
    assert registry.aliases("tab")["champion"] == 1
    assert users.errors == []


def paused_promote_run(api: str, key: str, promote: Promote, timeout: float = 600) -> dict:
    """The promote run once it waits for a human's answer to `key` (its pause key: step-N, promote, inconclusive)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = httpx.post(
            f"{api}/flow_runs/filter",
            timeout=30,
            json={"flow_runs": {"state": {"type": {"any_": ["PAUSED"]}}}, "flows": {"name": {"any_": ["promote"]}}},
        ).json()
        found = [r for r in runs if r["state"]["state_details"]["pause_key"] == key]
        if found:
            return found[0]
        assert promote.running(), promote.log.read_text()[-3000:]
        time.sleep(2)
    raise AssertionError(f"no promote run paused for {key!r}")


def resume_run(api: str, run_id: str, run_input: dict, attempts: int = 3) -> dict:
    """POST /flow_runs/{id}/resume as an operator would: a server error (no orchestration result) is retried while the
    run is still paused, since a failed request leaves it paused; any orchestration answer is returned as it is."""
    for _ in range(attempts):
        r = httpx.post(f"{api}/flow_runs/{run_id}/resume", timeout=30, json={"run_input": run_input})
        body = r.json()
        if "status" in body:
            return body
        state = httpx.get(f"{api}/flow_runs/{run_id}", timeout=30).json()["state"]["type"]
        assert state == "PAUSED", (r.status_code, body, state)
        time.sleep(2)
    raise AssertionError(f"resume kept failing: HTTP {r.status_code} {body}")


@pytest.mark.timeout(1500)
def test_better_candidate_is_promoted_through_every_step(
    settings, registry, checkpoints, single_line_adapter, users, tmp_path, platform
):
    # The newline adapter reversed: the model breaks lines less often, so these users accept more.
    info = publish(registry, checkpoints.store, "tab", single_line_adapter, "lora", 1, {"tidal.origin": "test: better"})
    env = {
        **os.environ,
        "TIDAL_CANARY__STEPS": "[0.3, 0.5]",
        "TIDAL_CANARY__MIN_SAMPLES": "30",
        "TIDAL_CANARY__MAX_STEP_S": "600",
        # the second step waits for a typed human answer (the promotion's own form: tests/unit/test_promote_approval.py)
        "TIDAL_CANARY__APPROVE_BEFORE": "[0.5]",
    }
    api = settings.prefect.api_url
    promote = Promote(info.version, tmp_path / "promote.log", env=env)
    start_at_first_step(users, registry, promote, info.version)
    run = paused_promote_run(api, "step-2", promote, timeout=900)
    assert "tidal.release.step_2" not in tags(registry, info.version)  # held at step 1 while it waits
    bad = resume_run(api, run["id"], {"decision": "promote", "approver": "", "reason": "?"})  # not this form's answer
    assert bad["status"] == "REJECT" and "Reason" in bad["details"]["reason"]
    assert httpx.get(f"{api}/flow_runs/{run['id']}", timeout=30).json()["state"]["type"] == "PAUSED"
    ok = tidal("approve", "tab", "--by", "alice", "--reason", "step 1 figures look right")
    assert ok.returncode == 0 and "advance" in ok.stdout, ok.stdout + ok.stderr
    rc, out = promote.finish(timeout=1200)
    assert rc == 0 and "promoted" in out, out[-3000:]
    t = tags(registry, info.version)
    assert {"tidal.release.step_1", "tidal.release.step_2", "tidal.release.promoted"} <= set(t)
    assert json.loads(t["tidal.release.approved_step_2"])["approver"] == "alice"
    promoted = json.loads(t["tidal.release.promoted"])
    print("better canary:", promoted["reason"], promoted["figures"])
    assert "rose" in promoted["reason"] and "tidal.release.approved" not in t  # 100% was not asked about
    aliases = registry.aliases("tab")
    assert (aliases["champion"], aliases["previous"]) == (info.version, 1)
    arms = platform.routes_client().show().routes["tab"].arms
    assert [(a.name, a.version, a.weight) for a in arms] == [("control", info.version, 1.0)]
    # A LoRA promotion left the fleet's serving version on the base: a gateway with no routes served the old model.
    assert platform.fleet_client().status().models["tab"].serving_version == info.version
    assert users.errors == []
    users.stop.set()  # the rollback below needs no traffic: the cores are its
    # instant rollback after a promotion: back to the previous champion, which is still loaded
    rb = tidal("rollback", "tab", "--reason", "undo")
    assert rb.returncode == 0, rb.stdout + rb.stderr
    result = json.loads(rb.stdout)
    assert result["serving"] == 1 and result["route_change_s"] < 5
    assert registry.aliases("tab")["champion"] == 1
    assert [(a.version, a.weight) for a in platform.routes_client().show().routes["tab"].arms] == [(1, 1.0)]
    assert platform.fleet_client().status().models["tab"].serving_version == 1


# Behind --long (~2 minutes here: a surge engine and a rolling replacement booted on two busy cores). The suite keeps
# the restart strategy's surge canary and its rollback (tests/integration/test_fleet.py) and every ramp and decision
# on the LoRA model (the tests above); this one adds the restart promotion and an operator rollback in its grace.
@pytest.mark.long
@pytest.mark.timeout(1500)
def test_restart_strategy_canary_runs_on_a_surge_replica_and_promotes(
    settings, registry, checkpoints, base_dir, single_line_adapter, gateway, keys, platform, tmp_path, chaos_report
):
    # tabfull serves full checkpoints with `restart`: the candidate boots on its own replica beside the champion's
    better = merged(single_line_adapter, base_dir, tmp_path / "single-line")
    info = publish(
        registry,
        checkpoints.store,
        "tabfull",
        better,
        "full",
        None,
        {"tidal.origin": "test: better, full", "tidal.parent_version": "1"},
    )
    users = Users(gateway, keys["alice"], cursor_prompts(settings, 300, seed=12), model="tabfull")
    try:
        # The surge engine is the fourth on two shared cores here, and answered with a median of ~130 ms against
        # the control replica's ~26 ms over a whole ramp (warm-up does not close the gap): the p99 guardrail
        # rightly rolled the release back at that. This test is about the restart path, so it tolerates that, and
        # ramps in one 50% step (walking every step is test_better_candidate_is_promoted_through_every_step's).
        # The old champion stays loaded 30 s after the promotion, and an operator rolls back within them: the
        # promote task's unload at the end of the grace must then be refused, since users are on that version again.
        env = {
            **os.environ,
            "TIDAL_CANARY__STEPS": "[0.5]",
            "TIDAL_CANARY__MIN_SAMPLES": "30",
            "TIDAL_CANARY__MAX_STEP_S": "600",
            "TIDAL_CANARY__MAX_P99_RATIO": "20",
            "TIDAL_CANARY__UNLOAD_GRACE_S": "30",
        }
        promote = Promote(info.version, tmp_path / "promote.log", env=env, model="tabfull")
        start_at_first_step(users, registry, promote, info.version, model="tabfull")
        routes, deadline = platform.routes_client(), time.monotonic() + 1200
        while [(a.version, a.weight) for a in getattr(routes.show().get("tabfull"), "arms", [])] != [
            (info.version, 1.0)
        ]:  # the promotion's route change
            assert promote.running() and time.monotonic() < deadline, promote.log.read_text()[-3000:]
            time.sleep(0.2)
        # the operator's `tidal rollback`, called in this process (a CLI start takes seconds on a loaded machine)
        rolled = rollback_now(registry, routes, platform.fleet_client(), "tabfull", by="oncall", reason="within the grace")
        grace_left = promote.running()
        rc, out = promote.finish(timeout=300)
        time.sleep(3)  # users keep being served by the old champion after its unload was refused
    finally:
        users.stop.set()
        if users.is_alive():
            users.join(timeout=120)
    assert rc == 0 and "promoted" in out, out[-3000:]
    assert grace_left, (rolled, out[-2000:])
    t = registry.get("tabfull", info.version).tags
    assert {"tidal.release.verified", "tidal.release.step_1", "tidal.release.promoted"} <= set(t)
    assert json.loads(t["tidal.release.step_1"])["weight"] == 0.5
    print("restart canary:", json.loads(t["tidal.release.promoted"])["figures"])
    assert rolled["serving"] == 1 and "kept tabfull@v1" in out and "still gets traffic" in out, out[-2000:]
    chaos_report.record(
        "10. operator rollback during the unload grace (restart strategy)",
        route_change_s=rolled["route_change_s"],
        old_champion_unload="refused (routed)",
        requests=sum(users.by_arm.values()),
        client_errors=len(users.errors),
    )
    assert users.by_arm.get("canary", 0) > 0 and users.errors == []
    assert registry.aliases("tabfull")["champion"] == 1
    fleet = platform.fleet_client()
    assert fleet.status().models["tabfull"].serving_version == 1  # the fleet follows the routes too
    assert {v for r in fleet.replicas("tabfull") for v in r.served.values()} == {1, info.version}

    # forward again, then unload v1: the rolling replacement boots the candidate before the old replica goes
    fwd = subprocess.run(
        [sys.executable, "-m", "tidal.cli", "rollback", "tabfull", "--to", str(info.version), "--reason", "forward"],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        check=False,
    )
    assert fwd.returncode == 0, fwd.stdout + fwd.stderr
    fleet.undeploy("tabfull", 1)
    assert [r.served for r in fleet.replicas("tabfull")] == [{f"tabfull@v{info.version}": info.version}]
    assert fleet.status().models["tabfull"].serving_version == info.version
    arms = platform.routes_client().show().routes["tabfull"].arms
    assert [(a.name, a.version, a.weight) for a in arms] == [("control", info.version, 1.0)]
