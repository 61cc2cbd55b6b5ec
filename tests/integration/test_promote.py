"""The promote flow on the real platform: real vLLM replicas, the gateway, simulated Tab users who keep
suggestions that stay on the line they are typing. A degraded candidate (an adapter pushing the
model towards line breaks) is rolled back at the first step with about 5% of users exposed; an
operator's `tidal rollback` ends a ramp at once; an inconclusive ramp asks a human; the audit trail
shows each."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tidal.registry import publish
from training import corpus

pytestmark = pytest.mark.slow


def cursor_prompts(settings, n: int, seed: int) -> list[tuple[str, str]]:
    """(code before the cursor, rest of its line) at random mid-line positions of held-out stdlib files."""
    root = corpus.stdlib_root()
    _, heldout = corpus.split_files(corpus.source_files(root), root, settings.bootstrap.heldout_fraction)
    texts = corpus.read_texts(heldout[:100])
    rng, out = random.Random(seed), []
    while len(out) < n:
        text = texts[rng.randrange(len(texts))]
        cut = rng.randrange(1, len(text))
        end = text.find("\n", cut)
        intended = text[cut : end if end != -1 else len(text)]
        if intended.strip() and not text[cut - 1].isspace():
            out.append((text[max(0, cut - 300) : cut], intended))
    return out


class Users(threading.Thread):
    """Tab users at random cursor positions of held-out code: they accept a suggestion that stays on the
    current line and reject one that runs over it. (The sandbox's 25-second base model rarely predicts
    the exact rest of a line, so exact-match users would give too few accepts to compare arms in a test.)
    Runs until stopped; counts requests per arm and errors."""

    def __init__(self, gateway: str, key: str, prompts: list[tuple[str, str]], users: int = 400, model: str = "tab"):
        super().__init__(daemon=True)
        self.gateway, self.key, self.prompts, self.users, self.model = gateway, key, prompts, users, model
        self.stop, self.errors, self.by_arm = threading.Event(), [], {}

    def one(self, i: int) -> None:
        prompt, _ = self.prompts[i % len(self.prompts)]
        h = {"Authorization": f"Bearer {self.key}"}
        try:
            r = httpx.post(self.gateway + "/v1/completions", headers=h, timeout=60, json={
                "model": self.model, "prompt": prompt, "max_tokens": 6, "temperature": 1.0, "user": f"user-{i % self.users}"})
            r.raise_for_status()
            a = r.json()
            text, arm = a["choices"][0]["text"], a["tidal"]["arm"]
            self.by_arm[arm] = self.by_arm.get(arm, 0) + 1
            if text:
                event = "rejected" if "\n" in text else "accepted"
                httpx.post(self.gateway + "/v1/feedback", headers=h, timeout=30,
                           json={"request_id": a["id"], "event": event}).raise_for_status()
        except Exception as e:  # noqa: BLE001  counted and asserted on
            self.errors.append(repr(e))

    def run(self) -> None:
        # 4 users typing at once, each checking `stop` before every request, so a stop ends the traffic within one
        # request (the test's teardown waits for it; a two-core machine answers a request in seconds under load)
        counter = iter(range(10**9))

        def user() -> None:
            while not self.stop.is_set():
                self.one(next(counter))

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda _: user(), range(4)))


def newline_adapter(base_dir, out, strength: float = 40.0):
    """A rank-1 LoRA on the last MLP's down projection that adds the newline token's embedding direction to
    the residual stream in proportion to the layer's mean activation: the model breaks lines far more often
    (measured through the fleet: accepted single-line suggestions 70% -> 49% at strength 40)."""
    import torch
    from peft import LoraConfig, get_peft_model

    from training.policy import load_policy, load_tokenizer
    from training.probe import compute_probe, save_probe
    from training.variants import probe_prompts_of

    model, tok = load_policy(base_dir), load_tokenizer(base_dir)
    down = model.model.layers[-1].mlp.down_proj
    acts = []
    hook = down.register_forward_hook(lambda m, i, o: acts.append(i[0].detach().flatten(0, 1)))  # (T, I)
    code = corpus.read_texts([corpus.stdlib_root() / "bisect.py"])[0]
    with torch.no_grad():
        model(input_ids=torch.tensor([tok.encode(code, add_special_tokens=False)[:256]]))
    hook.remove()
    mean = torch.cat(acts).mean(0)  # (I,) typical input of down_proj
    peft = get_peft_model(model, LoraConfig(r=1, lora_alpha=1, target_modules=["down_proj"]))  # B = 0 elsewhere
    lora = peft.base_model.model.model.layers[-1].mlp.down_proj
    newline = model.get_input_embeddings().weight[tok.encode("\n", add_special_tokens=False)[0]].detach()  # (H,)
    with torch.no_grad():
        lora.lora_A["default"].weight.copy_((mean / mean.norm()).unsqueeze(0))  # (1, I)
        lora.lora_B["default"].weight.copy_((strength * newline / newline.norm()).unsqueeze(1))  # (H, 1)
    peft.save_pretrained(str(out))
    save_probe(compute_probe(load_policy(out, base_path=base_dir), tok, probe_prompts_of(base_dir)), out)
    return out


def merged(adapter_dir, base_dir, out):
    """The adapter folded into a full checkpoint (what the `restart` strategy serves), with its own probe."""
    from training.policy import load_policy, load_tokenizer, save_policy
    from training.probe import compute_probe, save_probe
    from training.variants import probe_prompts_of

    full = load_policy(adapter_dir, base_path=base_dir).merge_and_unload()
    tok = load_tokenizer(base_dir)
    save_policy(full, tok, out)
    save_probe(compute_probe(full, tok, probe_prompts_of(base_dir)), out)
    return out


def zero_adapter(base_dir, out):
    """A LoRA adapter with B = 0: serves exactly the base's outputs (an A/A candidate), with its own probe."""
    from peft import get_peft_model

    from training.policy import load_policy, load_tokenizer
    from training.ppo_config import PPOConfig
    from training.probe import compute_probe, save_probe
    from training.variants import probe_prompts_of

    get_peft_model(load_policy(base_dir), PPOConfig().lora_config()).save_pretrained(str(out))
    save_probe(compute_probe(load_policy(out, base_path=base_dir), load_tokenizer(base_dir), probe_prompts_of(base_dir)), out)
    return out


def tags(registry, version: int) -> dict:
    return registry.get("tab", version).tags


@pytest.fixture(scope="module")
def base_dir(registry, checkpoints):
    return checkpoints.local_dir(registry.get("tab", 1))


@pytest.fixture()
def users(settings, gateway, keys, platform):
    """Tab users, not yet typing: a test starts them once its candidate is built and published, so the traffic
    does not slow that work down on a small machine; stopped after the test."""
    routes = platform.routes_client()
    current = routes.show()["routes"].get("tab", {}).get("arms", [])
    if any(a["name"] == "canary" for a in current):  # a canary left by another test
        routes.rollback("tab", by="test", reason="clean start")
    u = Users(gateway, keys["alice"], cursor_prompts(settings, 300, seed=11))
    yield u
    u.stop.set()
    if u.is_alive():
        u.join(timeout=120)


class Promote:
    """`tidal promote` in a subprocess, its output in a file (a pipe nobody reads would block it)."""

    def __init__(self, version: int, log, env: dict | None = None, model: str = "tab"):
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "tidal.cli", "promote", model, "--candidate", str(version),
                                          "--no-gate"], stdout=out, stderr=subprocess.STDOUT, env=env or dict(os.environ))

    def running(self) -> bool:
        return self.proc.poll() is None

    def finish(self, timeout: float) -> tuple[int, str]:
        rc = self.proc.wait(timeout=timeout)
        return rc, self.log.read_text()


def start_when_verified(users: Users, registry, promote: Promote, version: int, model: str = "tab") -> None:
    """Users start typing once the fleet serves the candidate's verified weights: deploying and verifying it does not
    share the cores with their traffic, and the canary's first step starts at once with users on both arms."""
    deadline = time.monotonic() + 600
    while "tidal.release.verified" not in registry.get(model, version).tags:
        assert promote.running() and time.monotonic() < deadline, promote.log.read_text()[-3000:]
        time.sleep(0.5)
    users.start()


def canary_user_share(settings, model: str, users: int, weight: float, client: str = "alice") -> float:
    """The share of `client`'s simulated users `user-0 … user-{users-1}` the gateway's keyed hash puts on a canary."""
    from serving.routes import ArmSpec, ModelRoutes, arm_key, assign, assignment_key
    from tidal.tokens import secret

    key = arm_key(secret(settings, "request_id", settings.gateway.secret).encode())
    routes = ModelRoutes(model=model, updated_ms=0, updated_by="test", arms=[
        ArmSpec(name="control", version=1, weight=1 - weight), ArmSpec(name="canary", version=2, weight=weight)])
    return sum(assign(routes, assignment_key(client, f"user-{i}"), key).name == "canary" for i in range(users)) / users


@pytest.mark.timeout(1800)  # ~15 canary outcomes at 5% of a few requests/s, plus the platform when run alone
def test_degraded_candidate_is_rolled_back_at_the_first_step(settings, registry, checkpoints, base_dir, users, tmp_path,
                                                             chaos_report):
    bad = newline_adapter(base_dir, tmp_path / "degraded")
    info = publish(registry, checkpoints.store, "tab", bad, "lora", 1, {"tidal.origin": "test: degraded"})
    # This regression is large (accepted characters per request fall about fourfold), so the sequential test may
    # look from 15 outcomes per arm: ~15 canary outcomes at 5%, half the wait of the default small-n guard (30).
    promote = Promote(info.version, tmp_path / "promote.log", env={**os.environ, "TIDAL_CANARY__MIN_TEST_SAMPLES": "15"})
    start_when_verified(users, registry, promote, info.version)
    rc, out = promote.finish(timeout=840)
    assert rc == 0 and "rolled back" in out, out[-3000:]
    t = tags(registry, info.version)
    assert {"tidal.release.deployed", "tidal.release.verified", "tidal.release.step_1", "tidal.release.rolled_back"} <= set(t)
    assert "tidal.release.step_2" not in t  # never went past 5%
    rolled = json.loads(t["tidal.release.rolled_back"])
    print("degraded canary:", rolled["reason"], rolled["figures"])
    assert rolled["by"] == "promote" and rolled["figures"]["step"] == 1 and "fell" in rolled["reason"]
    exposed = rolled["figures"]["n_canary"] / (rolled["figures"]["n_canary"] + rolled["figures"]["n_control"])
    # The first step's 5% weight exposes the users the keyed hash puts below 0.05: 25 of these 400 with the session's
    # secret (6.25%, within the binomial spread of 5% of 400 users, ±1.1 points); each sends the same share of requests.
    w = settings.canary.steps[0]
    hashed = canary_user_share(settings, "tab", users.users, w)
    assert abs(hashed - w) <= 3 * (w * (1 - w) / users.users) ** 0.5, hashed
    assert abs(exposed - hashed) <= 0.015, (exposed, hashed)
    step_1_ms = json.loads(t["tidal.release.step_1"])["at_ms"]  # canary traffic starts
    chaos_report.record("7. regressed candidate mid-ramp", rolled_back_at_step=rolled["figures"]["step"],
                        time_to_rollback_s=round((rolled["at_ms"] - step_1_ms) / 1000, 1),
                        exposed_canary_outcomes=rolled["figures"]["n_canary"], exposed_share=round(exposed, 3),
                        reason=rolled["reason"][:120])
    assert users.errors == []
    # routes: the canary is gone, the champion serves everyone
    routes = json.loads(subprocess.run([sys.executable, "-m", "tidal.cli", "route", "show"], capture_output=True, text=True,
                                       check=True, env=dict(os.environ)).stdout)["routes"]["tab"]["arms"]
    assert [(a["name"], a["version"], a["weight"]) for a in routes] == [("control", 1, 1.0)]
    assert registry.aliases("tab")["champion"] == 1


def test_operator_rollback_ends_a_ramp_at_once(settings, registry, checkpoints, base_dir, users, tmp_path):
    same = zero_adapter(base_dir, tmp_path / "neutral")  # the champion's own outputs: no decision soon
    info = publish(registry, checkpoints.store, "tab", same, "lora", 1, {"tidal.origin": "test: neutral"})
    promote = Promote(info.version, tmp_path / "promote.log")
    start_when_verified(users, registry, promote, info.version)
    deadline = time.monotonic() + 600
    while "tidal.release.step_1" not in tags(registry, info.version):
        assert promote.running() and time.monotonic() < deadline, promote.log.read_text()[-3000:]
        time.sleep(1)
    time.sleep(5)  # the canary serves for a moment
    rb = subprocess.run([sys.executable, "-m", "tidal.cli", "rollback", "tab", "--by", "oncall", "--reason", "pager says no"],
                        capture_output=True, text=True, env=dict(os.environ), check=False)
    assert rb.returncode == 0, rb.stdout + rb.stderr
    result = json.loads(rb.stdout)
    assert result["serving"] == 1 and result["rolled_back"] == [info.version] and result["route_change_s"] < 5
    rc, out = promote.finish(timeout=300)
    assert rc == 0 and "rolled back" in out and "operator" in out, out[-3000:]
    t = tags(registry, info.version)
    manual, ended = json.loads(t["tidal.release.manual_rollback"]), json.loads(t["tidal.release.rolled_back"])
    assert (manual["by"], manual["reason"], manual["to"]) == ("oncall", "pager says no", 1)
    assert ended["reason"].startswith("canary removed from the routes by an operator")
    assert "tidal.release.promoted" not in t
    assert users.errors == []


def wait_for_tag(registry, promote: Promote, version: int, tag: str, timeout: float = 600, model: str = "tab") -> None:
    deadline = time.monotonic() + timeout
    while f"tidal.release.{tag}" not in registry.get(model, version).tags:
        assert promote.running() and time.monotonic() < deadline, promote.log.read_text()[-3000:]
        time.sleep(0.5)


def tab_arms(platform) -> list[tuple]:
    return [(a["name"], a["version"], a["weight"]) for a in platform.routes_client().show()["routes"]["tab"]["arms"]]


def test_a_promote_run_killed_mid_ramp_leaves_no_canary_behind(settings, registry, checkpoints, base_dir, users, tmp_path,
                                                               platform, chaos_report):
    """kill -9 of the process running a release (the CLI here; a runner or a worker pod likewise) left its canary
    routed at its weight with nothing watching it, for good. The gateway's watchdog now takes it off."""
    same = zero_adapter(base_dir, tmp_path / "killed")
    info = publish(registry, checkpoints.store, "tab", same, "lora", 1, {"tidal.origin": "test: killed release"})
    watchdog_s = 8.0  # ≥ 3 × the session's 2 s looks
    env = {**os.environ, "TIDAL_CANARY__WATCHDOG_S": str(watchdog_s), "TIDAL_CANARY__MIN_SAMPLES": "1000000"}
    promote = Promote(info.version, tmp_path / "promote.log", env=env)
    start_when_verified(users, registry, promote, info.version)
    wait_for_tag(registry, promote, info.version, "step_1")
    time.sleep(5)  # the ramp runs, checking in at every look
    assert tab_arms(platform)[1][:2] == ("canary", info.version)
    promote.proc.kill()
    killed = time.monotonic()
    promote.proc.wait(timeout=30)
    while len(tab_arms(platform)) == 2:
        assert time.monotonic() - killed < watchdog_s + 10, "the canary outlived its release"
        time.sleep(0.2)
    back_s = time.monotonic() - killed
    last = platform.routes_client().show()["routes"]["tab"]
    assert tab_arms(platform) == [("control", 1, 1.0)] and last["updated_by"] == "watchdog", last
    time.sleep(3)  # users keep being served by the control arm
    users.stop.set()
    users.join(timeout=120)
    chaos_report.record("11. promote run killed mid-ramp (kill -9)", watchdog_s=watchdog_s,
                        traffic_back_on_control_s=round(back_s, 1), client_errors=len(users.errors))
    # the check-in deadline was at most watchdog_s after the kill, then one watchdog period
    assert back_s <= watchdog_s + 2.0, back_s
    assert users.errors == []
    platform.fleet_client().undeploy("tab", info.version)


def test_a_release_that_fails_mid_ramp_takes_its_canary_off_at_once(settings, registry, checkpoints, base_dir, tmp_path,
                                                                    platform, s3_endpoint):
    """An error raised out of the flow mid-ramp (here the object store holding the logs cannot be reached) left the
    canary at its weight. The flow now rolls it back before it fails, and says why on the version."""
    same = zero_adapter(base_dir, tmp_path / "failing")
    info = publish(registry, checkpoints.store, "tab", same, "lora", 1, {"tidal.origin": "test: failing release"})
    # This process only: its log reads go to a bucket that does not exist; the fleet and gateway are untouched.
    env = {**os.environ, "TIDAL_STORE__ROUTES": json.dumps({"logs": "s3://no-such-bucket-tidal"}),
           "TIDAL_STORE__S3_ENDPOINT_URL": s3_endpoint}
    promote = Promote(info.version, tmp_path / "promote.log", env=env)
    rc, out = promote.finish(timeout=600)
    assert rc != 0 and "NoSuchBucket" in out, out[-3000:]
    t = tags(registry, info.version)
    assert "tidal.release.step_1" in t, out[-3000:]  # it failed mid-ramp, not before
    ended = json.loads(t["tidal.release.rolled_back"])
    assert ended["by"] == "promote" and ended["reason"].startswith("the release failed:"), ended
    assert tab_arms(platform) == [("control", 1, 1.0)]
    assert all(f"tab@v{info.version}" not in r["served"] for r in platform.fleet_client().replicas("tab"))


def test_a_release_after_a_crash_between_the_route_and_alias_writes_finds_the_routes_authoritative(
        settings, registry, checkpoints, base_dir, tmp_path, platform):
    """A promotion that died after its route change but before the aliases left routes on vN, the champion alias
    on v1 and the fleet on v1; releasing vN again then built a canary whose two arms were both vN."""
    same = zero_adapter(base_dir, tmp_path / "half-promoted")
    info = publish(registry, checkpoints.store, "tab", same, "lora", 1, {"tidal.origin": "test: half promoted"})
    fleet, routes = platform.fleet_client(), platform.routes_client()
    fleet.deploy("tab", info.version)
    deadline = time.monotonic() + 60
    while True:  # the gateway learns of the new adapter at its next fleet poll
        try:
            routes.set("tab", [{"name": "control", "version": info.version, "weight": 1.0}], by="promote", reason="crashed after this")
            break
        except Exception:  # noqa: BLE001  409 until the gateway has polled the fleet
            assert time.monotonic() < deadline
            time.sleep(0.5)
    assert registry.aliases("tab")["champion"] == 1  # the crash: no alias written
    rc, out = Promote(info.version, tmp_path / "promote.log").finish(timeout=300)
    assert rc != 0 and f"v{info.version} is already the champion" in out, out[-3000:]
    assert "reconciled champion alias: v1 → v" in out, out[-3000:]
    aliases = registry.aliases("tab")
    assert (aliases["champion"], aliases["previous"]) == (info.version, 1)
    assert fleet.status()["models"]["tab"]["serving_version"] == info.version
    assert tab_arms(platform) == [("control", info.version, 1.0)]  # no canary of vN against vN
    rb = subprocess.run([sys.executable, "-m", "tidal.cli", "rollback", "tab", "--to", "1", "--reason", "test cleanup"],
                        capture_output=True, text=True, env=dict(os.environ), check=False)
    assert rb.returncode == 0 and registry.aliases("tab")["champion"] == 1, rb.stdout + rb.stderr
    fleet.undeploy("tab", info.version)


def paused_promote_run(api: str, timeout: float = 600) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = httpx.post(f"{api}/flow_runs/filter", timeout=30, json={
            "flow_runs": {"state": {"type": {"any_": ["PAUSED"]}}}, "flows": {"name": {"any_": ["promote"]}}}).json()
        if runs:
            return runs[0]
        time.sleep(2)
    raise AssertionError("no paused promote run")


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


def test_inconclusive_ramp_asks_a_human_and_a_typed_answer_promotes(settings, registry, checkpoints, base_dir, users,
                                                                    tmp_path, platform):
    same = zero_adapter(base_dir, tmp_path / "aa")
    info = publish(registry, checkpoints.store, "tab", same, "lora", 1, {"tidal.origin": "test: A/A"})
    env = {**os.environ, "TIDAL_CANARY__STEPS": "[0.5]", "TIDAL_CANARY__MAX_STEP_S": "20",
           "TIDAL_CANARY__ON_INCONCLUSIVE": "ask", "TIDAL_CANARY__MIN_SAMPLES": "1000000"}
    promote = Promote(info.version, tmp_path / "promote.log", env=env)
    start_when_verified(users, registry, promote, info.version)
    api = settings.prefect.api_url
    run = paused_promote_run(api)
    bad = resume_run(api, run["id"], {"decision": "maybe", "approver": "", "reason": "?"})
    assert bad["status"] == "REJECT" and "Reason" in bad["details"]["reason"]
    assert httpx.get(f"{api}/flow_runs/{run['id']}", timeout=30).json()["state"]["type"] == "PAUSED"
    good = resume_run(api, run["id"], {"decision": "promote", "approver": "alice", "reason": "A/A by construction"})
    assert good["status"] == "ACCEPT", good
    rc, out = promote.finish(timeout=300)
    assert rc == 0 and "promoted" in out, out[-3000:]
    t = tags(registry, info.version)
    approved = json.loads(t["tidal.release.approved"])
    assert (approved["decision"], approved["approver"]) == ("promote", "alice") and "tidal.release.promoted" in t
    aliases = registry.aliases("tab")
    assert (aliases["champion"], aliases["previous"]) == (info.version, 1)
    arms = platform.routes_client().show()["routes"]["tab"]["arms"]
    assert [(a["name"], a["version"], a["weight"]) for a in arms] == [("control", info.version, 1.0)]

    # instant rollback after a promotion: back to the previous champion, which is still loaded
    rb = subprocess.run([sys.executable, "-m", "tidal.cli", "rollback", "tab", "--reason", "undo"], capture_output=True,
                        text=True, env=dict(os.environ), check=False)
    assert rb.returncode == 0, rb.stdout + rb.stderr
    result = json.loads(rb.stdout)
    assert result["serving"] == 1 and result["route_change_s"] < 5
    assert registry.aliases("tab")["champion"] == 1
    assert [(a["version"], a["weight"]) for a in platform.routes_client().show()["routes"]["tab"]["arms"]] == [(1, 1.0)]
    assert users.errors == []


@pytest.mark.timeout(1500)
def test_better_candidate_is_promoted_through_every_step(settings, registry, checkpoints, base_dir, users, tmp_path, platform):
    # The newline adapter reversed: the model breaks lines less often, so these users accept more.
    better = newline_adapter(base_dir, tmp_path / "single-line", strength=-40.0)
    info = publish(registry, checkpoints.store, "tab", better, "lora", 1, {"tidal.origin": "test: better"})
    env = {**os.environ, "TIDAL_CANARY__STEPS": "[0.3, 0.5]", "TIDAL_CANARY__MIN_SAMPLES": "30",
           "TIDAL_CANARY__MAX_STEP_S": "600"}
    promote = Promote(info.version, tmp_path / "promote.log", env=env)
    start_when_verified(users, registry, promote, info.version)
    rc, out = promote.finish(timeout=1200)
    assert rc == 0 and "promoted" in out, out[-3000:]
    t = tags(registry, info.version)
    assert {"tidal.release.step_1", "tidal.release.step_2", "tidal.release.promoted"} <= set(t)
    promoted = json.loads(t["tidal.release.promoted"])
    print("better canary:", promoted["reason"], promoted["figures"])
    assert "rose" in promoted["reason"]
    aliases = registry.aliases("tab")
    assert (aliases["champion"], aliases["previous"]) == (info.version, 1)
    arms = platform.routes_client().show()["routes"]["tab"]["arms"]
    assert [(a["name"], a["version"], a["weight"]) for a in arms] == [("control", info.version, 1.0)]
    # A LoRA promotion left the fleet's serving version on the base: a gateway with no routes served the old model.
    assert platform.fleet_client().status()["models"]["tab"]["serving_version"] == info.version
    assert users.errors == []
    # back to version 1 for the tests that follow
    rb = subprocess.run([sys.executable, "-m", "tidal.cli", "rollback", "tab", "--to", "1", "--reason", "test cleanup"],
                        capture_output=True, text=True, env=dict(os.environ), check=False)
    assert rb.returncode == 0 and registry.aliases("tab")["champion"] == 1, rb.stdout + rb.stderr
    assert platform.fleet_client().status()["models"]["tab"]["serving_version"] == 1


@pytest.mark.timeout(1500)
def test_restart_strategy_canary_runs_on_a_surge_replica_and_promotes(settings, registry, checkpoints, base_dir, gateway,
                                                                       keys, platform, tmp_path, chaos_report):
    # tabfull serves full checkpoints with `restart`: the candidate boots on its own replica beside the champion's
    better = merged(newline_adapter(base_dir, tmp_path / "adapter", strength=-40.0), base_dir, tmp_path / "single-line")
    info = publish(registry, checkpoints.store, "tabfull", better, "full", None,
                   {"tidal.origin": "test: better, full", "tidal.parent_version": "1"})
    users = Users(gateway, keys["alice"], cursor_prompts(settings, 300, seed=12), model="tabfull")
    try:
        # The surge engine is the fourth on two shared cores here, and answered with a median of ~130 ms against
        # the control replica's ~26 ms over a whole ramp (warm-up does not close the gap): the p99 guardrail
        # rightly rolled the release back at that. This test is about the restart path, so it tolerates that, and
        # ramps in one 50% step (walking every step is test_better_candidate_is_promoted_through_every_step's).
        # The old champion stays loaded 20 s after the promotion, and an operator rolls back within them: the
        # promote task's unload at the end of the grace must then be refused, since users are on that version again.
        env = {**os.environ, "TIDAL_CANARY__STEPS": "[0.5]", "TIDAL_CANARY__MIN_SAMPLES": "30",
               "TIDAL_CANARY__MAX_STEP_S": "600", "TIDAL_CANARY__MAX_P99_RATIO": "20", "TIDAL_CANARY__UNLOAD_GRACE_S": "20"}
        promote = Promote(info.version, tmp_path / "promote.log", env=env, model="tabfull")
        start_when_verified(users, registry, promote, info.version, model="tabfull")
        wait_for_tag(registry, promote, info.version, "promoted", timeout=1200, model="tabfull")
        rb = subprocess.run([sys.executable, "-m", "tidal.cli", "rollback", "tabfull", "--by", "oncall", "--reason",
                             "within the grace"], capture_output=True, text=True, env=dict(os.environ), check=False)
        grace_left = promote.running()
        rc, out = promote.finish(timeout=300)
        time.sleep(3)  # users keep being served by the old champion after its unload was refused
    finally:
        users.stop.set()
        if users.is_alive():
            users.join(timeout=120)
    assert rc == 0 and "promoted" in out, out[-3000:]
    assert rb.returncode == 0 and grace_left, (rb.stdout + rb.stderr, out[-2000:])
    t = registry.get("tabfull", info.version).tags
    assert {"tidal.release.verified", "tidal.release.step_1", "tidal.release.promoted"} <= set(t)
    assert json.loads(t["tidal.release.step_1"])["weight"] == 0.5
    print("restart canary:", json.loads(t["tidal.release.promoted"])["figures"])
    rolled = json.loads(rb.stdout)
    assert rolled["serving"] == 1 and "kept tabfull@v1" in out and "still gets traffic" in out, out[-2000:]
    chaos_report.record("10. operator rollback during the unload grace (restart strategy)",
                        route_change_s=rolled["route_change_s"], old_champion_unload="refused (routed)",
                        requests=sum(users.by_arm.values()), client_errors=len(users.errors))
    assert users.by_arm.get("canary", 0) > 0 and users.errors == []
    assert registry.aliases("tabfull")["champion"] == 1
    fleet = platform.fleet_client()
    assert fleet.status()["models"]["tabfull"]["serving_version"] == 1  # the fleet follows the routes too
    assert {v for r in fleet.replicas("tabfull") for v in r["served"].values()} == {1, info.version}

    # forward again, then unload v1: the rolling replacement boots the candidate before the old replica goes
    fwd = subprocess.run([sys.executable, "-m", "tidal.cli", "rollback", "tabfull", "--to", str(info.version), "--reason",
                          "forward"], capture_output=True, text=True, env=dict(os.environ), check=False)
    assert fwd.returncode == 0, fwd.stdout + fwd.stderr
    fleet.undeploy("tabfull", 1)
    assert [r["served"] for r in fleet.replicas("tabfull")] == [{f"tabfull@v{info.version}": info.version}]
    assert fleet.status()["models"]["tabfull"]["serving_version"] == info.version
    arms = platform.routes_client().show()["routes"]["tabfull"]["arms"]
    assert [(a["name"], a["version"], a["weight"]) for a in arms] == [("control", info.version, 1.0)]
