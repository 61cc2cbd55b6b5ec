"""What can be checked of the `reload` and `nccl` strategies on a CPU machine, honestly: refusals and their reasons,
the nccl sender's per-update rendezvous and inputs, and our own update plans and bookkeeping.

None of this shows that vLLM behaves as the plans assume: the fakes below stand in for our Python objects, not for
an engine. tests/integration/test_gpu_weight_sync.py (marked gpu) and bench/gpu_check.sh run the real paths.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import pytest

from serving.probe import ProbeFailed, ProbeReport
from serving.settings import EngineSettings, FleetSettings
from serving.weight_sync import StrategyUnavailable, inplace, strategy_for
from serving.weight_sync.inplace import Call, inplace_refusal, move_plan, pick_canary, reload_calls, run_calls
from serving.weight_sync.nccl import fresh_rendezvous, sender_command, sender_env
from serving.weight_sync.nccl_sender import checkpoint_tensors, parse_args
from tidal.registry import VersionInfo

ROOT = Path(__file__).resolve().parents[2]


def v(n: int) -> VersionInfo:
    return VersionInfo("tab", n, "full", n, "")


# ---- refusals ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, words", [("reload", "oneDNN"), ("nccl", "CUDA tensors")])
def test_in_place_strategies_refuse_cpu_engines_with_the_measured_reason(name, words):
    with pytest.raises(StrategyUnavailable, match=words):
        strategy_for(name).check_engine("cpu")


@pytest.mark.parametrize("name", ["reload", "nccl"])
def test_in_place_strategies_refuse_adapters(name):
    with pytest.raises(StrategyUnavailable, match="LoRA adapter"):
        strategy_for(name).deploy(None, None, VersionInfo("tab", 3, "lora", 1, ""))


def test_in_place_strategies_refuse_engines_of_other_runtimes():
    fleet = SimpleNamespace(runtime=SimpleNamespace(name="kubernetes"))
    with pytest.raises(StrategyUnavailable, match="dev-mode routes.*'kubernetes'.*'restart'"):
        strategy_for("reload").move(fleet, None, None, v(2))


def test_a_deploy_needs_a_replica_left_on_the_champion():
    base = v(1)
    group = SimpleNamespace(
        base=base,
        strategy=SimpleNamespace(name="reload"),
        settings=SimpleNamespace(name="tab"),
        ready_replicas=lambda: [SimpleNamespace(base=base, index=0)],
    )
    with pytest.raises(StrategyUnavailable, match="1 ready replica.*scale the model to 2.*'restart'"):
        pick_canary(group)
    two = [SimpleNamespace(base=base, index=0), SimpleNamespace(base=base, index=3), SimpleNamespace(base=v(2), index=5)]
    group.ready_replicas = lambda: two
    assert pick_canary(group).index == 3  # the newest on the base; the one on v2 is already a canary


def _checkpoint(d: Path, vocab: dict | None = None, prefix: str | None = None, **config) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 64, "transformers_version": "x", **config}))
    model = {"type": "BPE", "vocab": vocab or {"a": 0, "b": 1}, "merges": [], "continuing_subword_prefix": prefix}
    (d / "tokenizer.json").write_text(json.dumps({"model": model, "added_tokens": [{"id": 0, "content": "a"}]}))
    return d


def test_in_place_needs_the_same_architecture_and_tokenizer(tmp_path):
    a = _checkpoint(tmp_path / "a")
    # saved again by a trainer: other library version, cosmetic tokenizer fields
    assert inplace_refusal(a, _checkpoint(tmp_path / "b", prefix="", transformers_version="y")) is None
    assert "hidden_size" in inplace_refusal(a, _checkpoint(tmp_path / "c", hidden_size=128))
    assert "tokenizer" in inplace_refusal(a, _checkpoint(tmp_path / "d", vocab={"a": 1, "b": 0}))


def test_a_checkpoint_saved_again_can_replace_its_parent_in_place(tmp_path):
    """The real case: a tokenizer trained here, saved with a policy, and saved again by noisy_copy."""
    from training.policy import PolicyConfig, build_policy, save_policy
    from training.tokenizer import train_tokenizer
    from training.variants import noisy_copy

    tok = train_tokenizer(["def f(x):\n    return x + 1\n" * 20], vocab_size=280)
    model = build_policy(
        PolicyConfig(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32, max_position_embeddings=64),
        tok,
        seed=0,
    )
    v1 = save_policy(model, tok, tmp_path / "v1")
    from training.probe import compute_probe, save_probe

    save_probe(compute_probe(model, tok, ["def f(x):"], max_new_tokens=2), v1)
    assert inplace_refusal(v1, noisy_copy(v1, tmp_path / "v2", seed=1)) is None


# ---- the nccl sender -----------------------------------------------------------------------------------------------


def test_each_update_gets_a_fresh_rendezvous():
    recent: deque = deque(maxlen=32)
    a = fresh_rendezvous("127.0.0.1", 2, recent)
    b = fresh_rendezvous("127.0.0.1", 2, recent)
    assert a.port != b.port and a.update_id != b.update_id
    assert a.world_size == b.world_size == 3  # the sender + the engine's two workers
    ports = iter([a.port, b.port, 40001])  # the OS offers recently used ports first: they are skipped
    c = fresh_rendezvous("127.0.0.1", 1, recent, pick=lambda _: next(ports))
    assert c.port == 40001 and c.world_size == 2 and list(recent)[-1] == 40001


def test_sender_command_carries_the_rendezvous(tmp_path):
    rdv = fresh_rendezvous("127.0.0.1", 4, deque())
    cmd = sender_command("/engine/bin/python", "http://127.0.0.1:8100", str(tmp_path), rdv, "tab@v7", 90.0)
    assert cmd[0] == "/engine/bin/python" and Path(cmd[1]).name == "nccl_sender.py" and Path(cmd[1]).is_file()
    args = parse_args(cmd[2:])
    assert (args.master_address, args.master_port, args.world_size) == ("127.0.0.1", rdv.port, 5)
    assert (args.engine_url, args.checkpoint, args.weight_version, args.update_id) == (
        "http://127.0.0.1:8100",
        tmp_path,
        "tab@v7",
        rdv.update_id,
    )
    assert sender_env("1")["CUDA_VISIBLE_DEVICES"] == "1"


def test_sender_runs_without_the_platform_packages():
    """It runs in the engine environment (vLLM, torch; no mlflow, no tidal): its module level is stdlib only."""
    code = (
        "import sys, builtins; real = builtins.__import__\n"
        "def guard(name, *a, **k):\n"
        "    if name.split('.')[0] in ('torch', 'vllm', 'safetensors', 'mlflow', 'tidal', 'serving', 'training'):\n"
        "        raise ImportError('imported at module level: ' + name)\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = guard\n"
        f"import runpy; runpy.run_path({str(ROOT / 'serving/weight_sync/nccl_sender.py')!r}, run_name='probe')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_sender_metadata_matches_the_checkpoint_files(tmp_path):
    import torch
    from safetensors.torch import save_file

    save_file(
        {"model.norm.weight": torch.ones(8), "model.embed_tokens.weight": torch.zeros(4, 8, dtype=torch.bfloat16)},
        str(tmp_path / "model-00002.safetensors"),
    )
    save_file({"lm_head.weight": torch.zeros(4, 8, dtype=torch.float16)}, str(tmp_path / "model-00001.safetensors"))
    got = [(f.name, n, d, s) for f, n, d, s in checkpoint_tensors(tmp_path)]
    assert got == [
        ("model-00001.safetensors", "lm_head.weight", "float16", (4, 8)),
        ("model-00002.safetensors", "model.embed_tokens.weight", "bfloat16", (4, 8)),
        ("model-00002.safetensors", "model.norm.weight", "float32", (8,)),
    ]
    with pytest.raises(FileNotFoundError):
        checkpoint_tensors(tmp_path / "none")


# ---- our update plans and bookkeeping ------------------------------------------------------------------------------


def test_move_plan_order_and_rollback_from_disk():
    swap = [Call("SWAP", "/ckpt/v2")]
    plan = move_plan(swap, "/ckpt/v1", "tab@v1", 90.0)
    assert [c.path for c in plan.forward] == ["/pause?mode=wait", "/ckpt/v2", "/reset_prefix_cache", "/resume"]
    assert [c.path for c in plan.rollback] == [
        "/pause?mode=wait",
        "/collective_rpc",
        "/update_weight_version",
        "/reset_prefix_cache",
        "/resume",
    ]
    assert plan.rollback[1].body == {"method": "reload_weights", "kwargs": {"weights_path": "/ckpt/v1"}, "timeout": 90.0}
    assert plan.rollback[2].body == {"new_version": "tab@v1"} and 404 in plan.rollback[2].tolerate
    assert reload_calls("/ckpt/v2", "tab@v2", 5.0)[0].body["kwargs"] == {"weights_path": "/ckpt/v2"}


class RecordingClient:
    """Records the calls our executor makes; answers what we tell it (no HTTP, no engine)."""

    def __init__(self, fail_on: str = "", cache_refusals: int = 0):
        self.url, self.calls, self.fail_on, self.cache_refusals = "http://engine", [], fail_on, cache_refusals
        self.http = SimpleNamespace(request=self._request)

    def _request(self, method, path, json=None):
        self.calls.append(path)
        ok = path != self.fail_on
        return SimpleNamespace(is_success=ok, status_code=200 if ok else 500, text="boom", json=lambda: {})

    def post(self, path, json=None):
        self.calls.append(path)
        if path == "/reset_prefix_cache" and self.cache_refusals:
            self.cache_refusals -= 1
            return SimpleNamespace(json=lambda: {"success": False})
        return SimpleNamespace(json=lambda: {"success": True})


def test_run_calls_expands_the_swap_and_always_resumes():
    plan = move_plan([Call("SWAP", "/ckpt/v2")], "/ckpt/v1", "tab@v1", 9.0)
    client = RecordingClient(cache_refusals=1)
    run_calls(client, plan.forward, lambda path: reload_calls(path, "tab@v2", 9.0))
    assert client.calls == [
        "/pause?mode=wait",
        "/collective_rpc",
        "/update_weight_version",
        "/reset_prefix_cache",
        "/reset_prefix_cache",
        "/resume",
    ]
    failing = RecordingClient(fail_on="/collective_rpc")
    with pytest.raises(Exception, match="collective_rpc -> 500"):
        run_calls(failing, plan.forward, lambda path: reload_calls(path, "tab@v2", 9.0))
    assert failing.calls == ["/pause?mode=wait", "/collective_rpc", "/resume"]


@pytest.fixture
def moving(monkeypatch, tmp_path):
    """A replica, a fleet and a group made of plain objects; the engine calls and the probe are recorded."""
    dirs = {n: _checkpoint(tmp_path / f"v{n}") for n in (1, 2)}
    log, outcome = [], {"probe": {}, "calls": []}

    class Client(RecordingClient):
        def __init__(self, url, timeout=None):
            super().__init__(fail_on=outcome["calls"].pop(0) if outcome["calls"] else "")
            self.calls = log

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

    def verify(client, name, path, atol, replica=""):
        log.append(f"probe {name}")
        if not outcome["probe"].get(name, True):
            raise ProbeFailed(f"probe FAIL for {name}")
        return ProbeReport(name, replica, True, 0.0, 0, 1)

    monkeypatch.setattr(inplace, "EngineClient", Client)
    monkeypatch.setattr(inplace, "verify", verify)
    monkeypatch.setattr(inplace.time, "sleep", lambda s: None)
    restarts = []
    fleet = SimpleNamespace(
        settings=SimpleNamespace(engine=EngineSettings(), fleet=FleetSettings(probe_atol=1e-3)),
        checkpoints=SimpleNamespace(local_dir=lambda info: dirs[info.version]),
        restart_replica=lambda group, r, why: restarts.append(why),
    )
    replica = SimpleNamespace(
        name="tab-1",
        url="http://engine",
        base=v(1),
        adapters={},
        probes=[],
        state="ready",
        health_failures=0,
        last_error="",
        index=1,
    )
    return SimpleNamespace(fleet=fleet, replica=replica, log=log, outcome=outcome, restarts=restarts)


def test_a_move_changes_the_recorded_version_only_after_its_probe(moving):
    report = strategy_for("reload").move(moving.fleet, None, moving.replica, v(2))
    assert report.ok and moving.replica.base == v(2) and moving.replica.state == "ready"
    assert moving.log == [
        "/pause?mode=wait",
        "/collective_rpc",
        "/update_weight_version",
        "/reset_prefix_cache",
        "/resume",
        "probe tab@v2",
    ]


def test_a_failed_probe_rolls_the_replica_back_and_verifies_the_old_weights(moving):
    moving.outcome["probe"]["tab@v2"] = False
    with pytest.raises(ProbeFailed, match="probe FAIL for tab@v2(.|\n)*rolled back to tab@v1 and verified"):
        strategy_for("reload").move(moving.fleet, None, moving.replica, v(2))
    forward = ["/pause?mode=wait", "/collective_rpc", "/update_weight_version", "/reset_prefix_cache", "/resume"]
    assert moving.log == forward + ["probe tab@v2"] + forward + ["probe tab@v1"]
    assert moving.replica.base == v(1) and moving.replica.state == "ready" and moving.restarts == []


def test_a_replica_that_cannot_roll_back_is_restarted_on_its_old_version(moving):
    moving.outcome["calls"] = ["/collective_rpc", "/collective_rpc"]  # the swap fails, and so does the rollback
    with pytest.raises(Exception, match="reload update of tab-1 to tab@v2 failed(.|\n)*restarting on it"):
        strategy_for("reload").move(moving.fleet, None, moving.replica, v(2))
    assert moving.replica.base == v(1) and len(moving.restarts) == 1 and "tab@v1" in moving.restarts[0]


def test_deploy_and_retire_map_onto_canary_promotion_and_rollback(monkeypatch):
    """deploy moves one replica (a canary), retire(candidate) moves it back, retire(base) moves the rest."""
    sync = strategy_for("nccl")
    moves = []

    def move(fleet, group, replica, new):
        moves.append((replica.index, new.version))
        replica.base = new
        return ProbeReport(new.served_name, str(replica.index), True, 0.0, 0, 1)

    monkeypatch.setattr(sync, "move", move)
    replicas = [SimpleNamespace(base=v(1), index=i, state="ready", probes=[]) for i in range(3)]
    group = SimpleNamespace(
        base=v(1),
        surge={},
        adapters={},
        serving=1,
        replicas=replicas,
        strategy=sync,
        settings=SimpleNamespace(name="tab"),
        ready_replicas=lambda: replicas,
        live_replicas=lambda: replicas,
    )
    sync.deploy(None, group, v(2))
    assert moves == [(2, 2)] and group.surge == {2: v(2)}
    sync.retire(None, group, v(2))  # rollback
    assert moves[-1] == (2, 1) and group.surge == {}
    sync.deploy(None, group, v(2))
    sync.retire(None, group, v(1))  # promotion
    assert moves[-2:] == [(0, 2), (1, 2)] and (group.base, group.serving, group.surge) == (v(2), 2, {})
    assert all(r.base == v(2) for r in replicas)
    with pytest.raises(StrategyUnavailable, match="deploy another version first"):
        sync.retire(None, group, v(2))


def test_the_canary_check_of_a_release_accepts_in_place_canaries():
    from release.operations import candidate_verified
    from serving.fleet_replies import ReplicaStatus

    def replica(i: int, served: dict[str, int]) -> ReplicaStatus:
        return ReplicaStatus(
            name=f"tab-{i}",
            state="ready",
            url=f"http://127.0.0.1:{8100 + i}",
            pid=None,
            base_version=1,
            served=served,
            restarts=0,
            last_error="",
        )

    # what FleetClient.replicas answers: one replica moved in place to the candidate, one still on the champion
    fleet = SimpleNamespace(replicas=lambda model: [replica(0, {"tab@v1": 1}), replica(1, {"tab@v2": 2})])
    for strategy in ("restart", "reload", "nccl"):
        assert candidate_verified(fleet, "tab", v(2), strategy)
    assert not candidate_verified(fleet, "tab", v(2), "lora")
