"""Chaos: broken candidates are refused before any traffic reaches them, with the reason recorded.

Each candidate goes through `tidal promote` on the running platform (real fleet, gateway, registry):
NaN weights, a checkpoint file truncated after publishing, a file swapped for another (digest mismatch),
and an adapter of another architecture. Every release must fail at deploy/verify, tag the version
`tidal.release.rolled_back` with why, and leave the route table untouched: no route change ever names it.
Serving must be sound afterwards: every replica ready on the champion and answering (a NaN adapter,
once loaded and unloaded, used to leave its engine answering NaN log-probs for the base).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import httpx
import pytest

from tidal.registry import publish

pytestmark = pytest.mark.slow


def adapter(base_dir, out, *, nan: bool = False, wider: bool = False):
    """A LoRA adapter on the base with its probe; `nan` fills it with NaN, `wider` builds it for a policy 32
    wider (another architecture: its tensors cannot apply to the served base)."""
    import torch
    from peft import get_peft_model

    from training.policy import PolicyConfig, build_policy, load_policy, load_tokenizer
    from training.ppo_config import PPOConfig
    from training.probe import compute_probe, save_probe
    from training.variants import probe_prompts_of

    tok = load_tokenizer(base_dir)
    base = load_policy(base_dir)
    if wider:
        hidden = base.config.hidden_size + 32
        cfg = PolicyConfig(
            hidden_size=hidden,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=2 * hidden,
            max_position_embeddings=512,
        )
        base = build_policy(cfg, tok, seed=0)
    peft = get_peft_model(base, PPOConfig().lora_config())
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.fill_(math.nan if nan else 0.01)
    peft.save_pretrained(str(out))
    if nan:  # NaN weights cannot make a probe: a stale one (the base's) sits beside them
        probe_model = load_policy(base_dir)
    else:  # from the weights it was built for
        probe_model = peft if wider else load_policy(out, base_path=base_dir)
    save_probe(compute_probe(probe_model, tok, probe_prompts_of(base_dir)), out)
    return out


def canary_completions(gateway: str) -> float:
    """Completions the gateway has logged on tab's canary arm (its Prometheus counter)."""
    return sum(
        float(line.split()[-1])
        for line in httpx.get(gateway + "/metrics", timeout=30).text.splitlines()
        if line.startswith("gateway_completions_total{") and 'arm="canary"' in line and 'model="tab"' in line
    )


def promote(version: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tidal.cli", "promote", "tab", "--candidate", str(version), "--no-gate"],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=600,
        check=False,
    )


@pytest.mark.parametrize("kind", ["nan_weights", "truncated_file", "digest_mismatch", "wrong_architecture"])
def test_broken_candidate_is_refused_before_any_traffic(
    kind, settings, registry, checkpoints, gateway, platform, tmp_path, chaos_report
):
    base_dir = checkpoints.local_dir(registry.get("tab", 1))
    if kind == "nan_weights":
        src = adapter(base_dir, tmp_path / "nan", nan=True)
    elif kind == "wrong_architecture":
        src = adapter(base_dir, tmp_path / "wide", wider=True)
    else:
        src = adapter(base_dir, tmp_path / "ok")
    info = publish(registry, checkpoints.store, "tab", src, "lora", 1, {"tidal.origin": f"chaos: {kind}"})
    stored = checkpoints.store.root / info.key / "adapter_model.safetensors"
    if kind == "truncated_file":
        stored.write_bytes(stored.read_bytes()[: stored.stat().st_size // 2])
    elif kind == "digest_mismatch":  # a well-formed file, but not the one registered (a swapped upload)
        data = bytearray(stored.read_bytes())
        data[-1] ^= 0x01
        stored.write_bytes(bytes(data))
    routes_before, fleet_before = platform.routes_client().show(), platform.fleet_client().replicas("tab")
    canary_before = canary_completions(gateway)

    t0 = time.monotonic()
    out = promote(info.version)
    refused_s = time.monotonic() - t0
    canary_requests = canary_completions(gateway) - canary_before  # measured by the gateway, not assumed

    assert out.returncode != 0, out.stdout[-2000:]
    tags = registry.get("tab", info.version).tags
    assert "tidal.release.verified" not in tags
    reason = json.loads(tags["tidal.release.rolled_back"])["reason"]
    print(f"{kind}: {reason[:300]}")
    assert reason.startswith("deploy or served-weight verification failed")
    if kind in ("truncated_file", "digest_mismatch"):  # caught before an engine ever sees the files
        assert "does not match the digest registered with it" in reason, reason
    if kind == "nan_weights":  # refused from its tensors, before an engine loads it (one such load poisoned a replica)
        assert "adapter weights hold non-finite values" in reason, reason
    assert canary_requests == 0
    routes_after = platform.routes_client().show()
    assert routes_after.get("tab") == routes_before.get("tab")
    assert not any(a.version == info.version for h in routes_after.history if h.model == "tab" for a in h.arms)
    served = {name for r in platform.fleet_client().replicas("tab") for name in r.served}
    assert info.served_name not in served  # nothing of it stays loaded anywhere
    # and serving recovers: an engine a bad adapter broke is restarted by the fleet, on the champion only
    restarts = serving_recovers(platform.fleet_client(), before=fleet_before)
    print(f"{kind}: replica restarts it caused: {restarts}")
    chaos_report.record(
        "6. bad candidate: " + kind.replace("_", " "),
        refused_in_s=round(refused_s, 1),
        canary_requests=canary_requests,
        replica_restarts=restarts,
        reason=reason[:160],
    )


def serving_recovers(fleet, before: list, timeout_s: float = 300.0) -> int:
    """Wait until every tab replica is ready again, serves exactly v1 and answers; returns the restarts since."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = fleet.replicas("tab")
        if len(now) == len(before) and all(r.state == "ready" and r.served == {"tab@v1": 1} for r in now):
            break
        assert time.monotonic() < deadline, f"tab replicas not back after {timeout_s} s: {now}"
        time.sleep(2)
    for r in now:
        answer = httpx.post(
            r.url + "/v1/completions",
            timeout=60,
            json={"model": "tab@v1", "prompt": "def f(x):\n    return", "max_tokens": 4, "logprobs": 1},
        ).json()
        lp = answer["choices"][0]["logprobs"]["token_logprobs"]  # (T,) one per generated token, T <= 4
        assert 1 <= len(lp) <= 4 and all(math.isfinite(x) and x <= 0 for x in lp), answer  # real log-probs, no NaN
    return sum(r.restarts for r in now) - sum(r.restarts for r in before)
