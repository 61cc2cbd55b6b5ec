"""A team's own model through the whole loop on the real platform: `byo`, a Llama with a tokenizer of another kind
(no pad token, its own vocabulary, a chat template), imported as its champion by the session's `tidal up` step, is
served on the real CPU engine, takes chat and completion traffic through the gateway, is collected into a reward
dataset, trained by PPO (one iteration, in the trainer process, through the offline gate) and released through the
canary, which ends the ramp with a decision and leaves serving as the decision says."""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest

from tests.integration.release_helpers import Promote, Users, cursor_prompts, start_at_first_step
from tidal import lineage
from training.reward_data import load_dataset

pytestmark = pytest.mark.slow


def chat(gateway: str, key: str, user: str, wait_s: float = 0.0) -> dict:
    """One chat turn; `wait_s`: how long a 503 (the gateway has not yet seen a replica the fleet just started: it
    polls the fleet every gateway.fleet_poll_s) is retried."""
    deadline = time.monotonic() + wait_s
    while True:
        r = post_chat(gateway, key, user)
        if r.status_code != 503 or time.monotonic() > deadline:
            r.raise_for_status()
            return r.json()
        time.sleep(0.5)


def post_chat(gateway: str, key: str, user: str) -> httpx.Response:
    return httpx.post(
        gateway + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
        json={
            "model": "byo",
            "messages": [{"role": "user", "content": "Write a loop that prints squares."}],
            "max_tokens": 6,
            "temperature": 1.0,
            "user": user,
        },
    )


@pytest.mark.timeout(1800)
def test_an_imported_llama_is_served_trained_and_released_through_the_canary(
    settings, registry, platform, fleet, gateway, keys, checkpoints, tmp_path, monkeypatch
):
    from flows.collect import collect  # after the platform is up: Prefect reads its API URL on import
    from flows.train import train

    fleet.scale("byo", 1)
    try:
        assert fleet.status().models["byo"].serving_version == 1
        h = {"Authorization": f"Bearer {keys['alice']}"}
        answers = [chat(gateway, keys["alice"], f"chat-user-{i}", wait_s=30 if i == 0 else 0) for i in range(8)]
        for a in answers:
            assert a["object"] == "chat.completion" and isinstance(a["choices"][0]["message"]["content"], str)
            assert a["tidal"]["version"] == 1
            httpx.post(
                gateway + "/v1/feedback", headers=h, timeout=30, json={"request_id": a["id"], "event": "rejected"}
            ).raise_for_status()
        prompts = cursor_prompts(settings, 120, seed=5)
        users = Users(gateway, keys["alice"], prompts, model="byo", stop=["\n"])
        users.start()
        deadline = time.monotonic() + 300
        while sum(users.by_arm.values()) < 120 and time.monotonic() < deadline:
            time.sleep(1)
        users.stop.set()
        users.join(timeout=120)
        assert not users.errors, users.errors[:3]
        time.sleep(3)  # segment age + upload interval of the sandbox log sink
        dataset_id = collect(model="byo", include_open_hour=True)
        data = load_dataset(checkpoints.store, "byo", dataset_id)
        chat_ids = {a["id"] for a in answers}
        assert len(data.samples) >= 64 and chat_ids <= {s.request_id for s in data.samples}
        assert all(max(s.prompt_token_ids + s.completion_token_ids) < 238 for s in data.samples)  # the Llama's ids

        monkeypatch.setenv("TIDAL_TRAIN__PPO__MAX_ITERATIONS", "1")
        version = train(model="byo", dataset_id=dataset_id)
        info = registry.get("byo", version)
        assert info.parent_version == 1 and info.kind == "lora" and info.dataset_id == dataset_id
        assert info.gate_passed, info.gate_reason
        assert "the standard library" in info.tags[lineage.GATE_PREFIX + "bits_per_byte"]

        # The candidate barely moved (one iteration): the canary cannot tell the arms apart within its step, and an
        # inconclusive step rolls back. What matters here is that the ramp runs on this model and decides.
        env = {**os.environ, "TIDAL_CANARY__MAX_STEP_S": "30", "TIDAL_CANARY__ON_INCONCLUSIVE": "rollback"}
        users = Users(gateway, keys["alice"], prompts, model="byo", stop=["\n"])
        promote = Promote(version, tmp_path / "promote.log", env=env, model="byo")
        try:
            start_at_first_step(users, registry, promote, version, model="byo")
            rc, out = promote.finish(timeout=900)
        finally:
            users.stop.set()
            users.join(timeout=120)
        assert rc == 0, out[-3000:]
        assert users.by_arm.get("canary", 0) > 0 and users.by_arm.get("control", 0) > 0 and not users.errors
        t = registry.get("byo", version).tags
        assert {"tidal.release.deployed", "tidal.release.verified", "tidal.release.step_1"} <= set(t)
        decided = "tidal.release.promoted" if "tidal.release.promoted" in t else "tidal.release.rolled_back"
        assert decided in t and json.loads(t[decided])
        serving = fleet.status().models["byo"].serving_version
        assert serving == (version if decided == "tidal.release.promoted" else 1)
    finally:
        fleet.scale("byo", 0)
