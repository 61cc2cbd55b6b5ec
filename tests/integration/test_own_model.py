"""A team's own chat model through the whole loop on the real platform, rewarded by the team's own rule.

`byo` is a Llama with a tokenizer of another kind (no pad token, its own vocabulary, a chat template), imported as its
champion by the session's `tidal up` step. Its settings make it a chat model: it takes thumbs and scores, and its
canary decides on the reward with thumbs-down guarded (tests/platform_fixtures.py). Here it is served on the real CPU
engine; simulated chat users (sim/chat_users.py, the OpenAI SDK's chat API) hold
conversations with it and rate each one's last turn, a few completion requests get a thumbs; the hour is collected
under `acme-thumbs`, a rule from a package of its own (tests/rule_plugin.py) that this test installs for its own
processes (the collection, the trainer, `tidal promote`); PPO trains a candidate (one iteration, in the trainer
process, through the offline gate); the canary decides on that rule's reward with the model's guardrail and leaves
serving as the decision says. The registry's lineage names the plugin and its package's version."""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter

import httpx
import pytest

from tests.integration.release_helpers import Promote, start_at_first_step
from tests.rule_plugin import write_plugin
from tidal import lineage
from training.reward_data import load_dataset

pytestmark = pytest.mark.slow

# The team's rule: thumbs up +1 / down -1, less 0.001 per character shown; a verdict on a conversation's last turn
# is credited to the turn before it at 0.8.
RULE = {"byo": {"plugin": "acme-thumbs", "turn_discount": 0.8}}


def complete(gateway: str, key: str, prompt: str, user: str, wait_s: float = 0.0) -> dict:
    """One completion; `wait_s`: how long a 503 (the gateway has not yet seen a replica the fleet just started: it
    polls the fleet every gateway.fleet_poll_s) is retried."""
    deadline = time.monotonic() + wait_s
    while True:
        r = httpx.post(
            gateway + "/v1/completions",
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
            json={"model": "byo", "prompt": prompt, "max_tokens": 6, "temperature": 1.0, "user": user, "stop": ["\n"]},
        )
        if r.status_code != 503 or time.monotonic() > deadline:
            r.raise_for_status()
            return r.json()
        time.sleep(0.5)


class ChatUsers(threading.Thread):
    """Simulated chat users until stopped: rounds of ten conversations (a new seed, so new sites and users, each
    round); turns per arm and errors counted."""

    def __init__(self, gateway: str, key: str, heldout_fraction: float):
        super().__init__(daemon=True)
        self.gateway, self.key, self.heldout_fraction = gateway, key, heldout_fraction
        self.stop, self.arms, self.errors = threading.Event(), Counter(), Counter()

    def run(self) -> None:
        from sim.chat_users import ChatUsersConfig, hold_conversations

        seed = 100
        while not self.stop.is_set():
            cfg = ChatUsersConfig(conversations=10, seed=seed, max_tokens=8)
            tally = hold_conversations(self.gateway, self.key, "byo", self.heldout_fraction, cfg, stop=self.stop)
            self.arms.update(tally.arms)
            self.errors.update(tally.errors)
            seed += 1


@pytest.mark.timeout(1800)
def test_an_imported_chat_llama_is_rewarded_by_a_plugin_rule_trained_and_released_on_its_own_canary(
    settings, registry, platform, fleet, gateway, keys, checkpoints, tmp_path, monkeypatch
):
    from flows.collect import collect  # after the platform is up: Prefect reads its API URL on import
    from flows.train import train
    from sim.chat_users import ChatUsersConfig, hold_conversations

    # `pip install acme-rules` for this test's processes: this one (the collection runs in it), and through
    # PYTHONPATH the trainer and `tidal promote`; the gateway and fleet never compute a reward.
    site = write_plugin(tmp_path / "site", version="1.2.0")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in [str(site), os.environ.get("PYTHONPATH", "")] if p))
    monkeypatch.setenv("TIDAL_COLLECT__REWARD_RULES", json.dumps(RULE))

    fleet.scale("byo", 1)
    try:
        assert fleet.status().models["byo"].serving_version == 1
        h = {"Authorization": f"Bearer {keys['alice']}"}
        # Completion traffic too: the model serves both APIs, each answer rated with a thumbs.
        answers = [
            complete(gateway, keys["alice"], "def main():\n    ", f"byo-user-{i}", wait_s=30 if i == 0 else 0) for i in range(8)
        ]
        for a in answers:
            assert a["tidal"]["version"] == 1
            text = a["choices"][0]["text"]
            thumbs = "up" if text.strip() else "down"
            httpx.post(
                gateway + "/v1/feedback", headers=h, timeout=30, json={"request_id": a["id"], "event": "thumbs", "thumbs": thumbs}
            ).raise_for_status()
        # An edit is an opt-in this model did not take: refused, naming it.
        edit = {"request_id": answers[0]["id"], "event": "edit", "edit_text": "for i in range(3):"}
        bad = httpx.post(gateway + "/v1/feedback", headers=h, timeout=30, json=edit)
        assert bad.status_code == 422 and "edit" in bad.text and "opt-in" in bad.text, bad.text
        chats = hold_conversations(
            gateway, keys["alice"], "byo", settings.bootstrap.heldout_fraction, ChatUsersConfig(conversations=48, max_tokens=8)
        )
        summary = chats.summary()
        assert summary["conversations"] == 48 and not chats.errors, summary
        print("chat traffic:", summary)
        time.sleep(3)  # segment age + upload interval of the sandbox log sink

        dataset_id = collect(model="byo", include_open_hour=True)
        data = load_dataset(checkpoints.store, "byo", dataset_id)
        assert data.reward_rule.startswith("acme-thumbs@") and data.rule is None  # the plugin's, not the Tab rule
        by_id = {s.request_id: s for s in data.samples}
        assert {a["id"] for a in answers} <= set(by_id)
        assert all(max(s.prompt_token_ids + s.completion_token_ids) < 238 for s in data.samples)  # the Llama's ids
        # Every turn of every conversation trains: its last turn on its own thumbs, the turn before on the last
        # turn's reward x 0.8 (the rule's turn_discount).
        two_turns = [c for c in chats.conversations if len(c.request_ids) == 2]
        assert two_turns, summary  # the small model rarely finishes a line right at the first try
        for c in chats.conversations:
            assert set(c.request_ids) <= set(by_id)
            last = by_id[c.request_ids[-1]]
            assert last.thumbs == c.thumbs and last.credited_from is None and last.turn == len(c.request_ids) - 1
            shown = len(last.completion_text)
            assert last.reward == pytest.approx((1.0 if c.thumbs == "up" else -1.0) - 0.001 * shown)
        for c in two_turns:
            first, last = by_id[c.request_ids[0]], by_id[c.request_ids[1]]
            assert (first.conversation_id, first.turn, first.credited_from) == (c.request_ids[0], 0, last.request_id)
            assert first.reward == pytest.approx(0.8 * last.reward)

        monkeypatch.setenv("TIDAL_TRAIN__PPO__MAX_ITERATIONS", "1")
        version = train(model="byo", dataset_id=dataset_id)
        info = registry.get("byo", version)
        assert info.parent_version == 1 and info.kind == "lora" and info.dataset_id == dataset_id
        assert info.gate_passed, info.gate_reason
        assert "the standard library" in info.tags[lineage.GATE_PREFIX + "bits_per_byte"]
        # The lineage names the team's rule, its plugin and the package (and version) that provided it.
        assert info.tags[lineage.REWARD_RULE] == data.reward_rule
        assert info.tags[lineage.REWARD_RULE_PLUGIN] == "acme-thumbs (acme-rules 1.2.0)"

        # The candidate barely moved (one iteration): the canary cannot tell the arms apart within its one 50% step,
        # and an inconclusive step rolls back. What matters here is that the ramp runs on this model's own metrics
        # (the plugin's reward, thumbs-down guarded; not Tab's accepted characters) and decides.
        env = {
            **os.environ,
            "TIDAL_CANARY__STEPS": "[0.5]",
            "TIDAL_CANARY__MAX_STEP_S": "30",
            "TIDAL_CANARY__ON_INCONCLUSIVE": "rollback",
        }
        users = ChatUsers(gateway, keys["alice"], settings.bootstrap.heldout_fraction)
        promote = Promote(version, tmp_path / "promote.log", env=env, model="byo")
        try:
            start_at_first_step(users, registry, promote, version, model="byo")
            rc, out = promote.finish(timeout=900)
        finally:
            users.stop.set()
            users.join(timeout=120)
        assert rc == 0, out[-3000:]
        assert users.arms["canary"] > 0 and users.arms["control"] > 0 and not users.errors, (users.arms, users.errors)
        t = registry.get("byo", version).tags
        assert {"tidal.release.deployed", "tidal.release.verified", "tidal.release.step_1"} <= set(t)
        decided = "tidal.release.promoted" if "tidal.release.promoted" in t else "tidal.release.rolled_back"
        assert decided in t, sorted(t)
        figures = json.loads(t[decided])["figures"]
        print("byo canary:", decided, figures)
        assert {"reward_delta", "thumbs_down_delta", "score_delta"} <= set(figures) and "accepted_chars_delta" not in figures
        serving = fleet.status().models["byo"].serving_version
        assert serving == (version if decided == "tidal.release.promoted" else 1)
    finally:
        fleet.scale("byo", 0)
