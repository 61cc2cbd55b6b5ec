"""Conversations: chat turns linked by their first turn's request id, checked at the gateway and again by the
contract; a later turn's feedback credited to earlier turns with the rule's discount; stored forms before
conversations still read."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_contracts.collect_settings import CollectSettings
from data_contracts.dataset import read_parquet
from data_contracts.records import COMPLETION_SCHEMA_V1
from data_contracts.samples import REWARD_SAMPLE_SCHEMA, upgrade_samples
from data_contracts.scope import rid_owner
from serving.feedback_checks import conversation_problem
from serving.request_ids import RequestIdSigner
from tests.collect_harness import collect_once
from tests.unit.test_contracts_data import T0, FixedVersions, completion, feedback, partition_of, put_logs
from tidal.model_settings import FeedbackPolicy
from tidal.store import LocalStore

MIN = 60_000
CHAT = FeedbackPolicy(events=["thumbs", "score"], score_range=(1, 5))


def blend(discount: float) -> CollectSettings:
    return CollectSettings(reward_rule={"plugin": "feedback-blend", "no_feedback": "drop", "turn_discount": discount})


def conversation(t0: int, turns: int, client: str = "alice", first_i: int = 0) -> list[dict]:
    """`turns` completions of one conversation, a minute apart: the first names itself, the others the first."""
    rows = [completion(t0 + k * MIN, first_i + k, client=client) for k in range(turns)]
    return [r | {"conversation_id": rows[0]["request_id"], "turn": k} for k, r in enumerate(rows)]


def collect(store, discount: float):
    return collect_once(store, FixedVersions([1], 1), "tab", blend(discount), T0 + 2 * 3_600_000, feedback=CHAT)


def test_the_gateway_takes_only_its_own_conversations_of_the_client_and_model() -> None:
    signer = RequestIdSigner(b"k" * 32)
    first = signer.issue("chat", "alice", T0, version=1, arm="control")
    assert conversation_problem(signer, None, "chat", "alice") is None  # a first turn
    assert conversation_problem(signer, first, "chat", "alice") is None
    assert conversation_problem(signer, first, "chat", "bob") == (
        403,
        "conversation_id: the conversation belongs to another client",
    )
    status, message = conversation_problem(signer, first, "tab", "alice")
    assert status == 422 and "conversation_id: the conversation is with model 'chat'" in message
    status, message = conversation_problem(signer, "my-own-id", "chat", "alice")
    assert status == 422 and message.startswith("conversation_id: not a conversation this gateway started (malformed)")
    other = RequestIdSigner(b"z" * 32).issue("chat", "alice", T0)  # another gateway secret's id
    assert conversation_problem(signer, other, "chat", "alice")[1].startswith("conversation_id: not a conversation this")
    assert rid_owner(first) == ("chat", "alice") and rid_owner("my-own-id") is None


def test_a_verdict_on_the_last_turn_is_credited_to_earlier_turns_with_the_rules_discount(tmp_path) -> None:
    store = LocalStore(tmp_path / "a")
    three = conversation(T0 + 10 * MIN, 3)
    two = conversation(T0 + 20 * MIN, 2, first_i=3)  # its own thumbs on both turns: no credit needed
    put_logs(store, "completions", three + two)
    put_logs(
        store,
        "feedback",
        [
            feedback(three[2], "thumbs", thumbs="up"),
            feedback(two[0], "thumbs", thumbs="down"),
            feedback(two[1], "thumbs", thumbs="up"),
        ],
    )
    r = collect(store, discount=0.5)
    rows = {s["request_id"]: s for s in r.samples.to_pylist()}
    assert [rows[c["request_id"]]["reward"] for c in three] == pytest.approx([0.25, 0.5, 1.0])
    assert [rows[c["request_id"]]["credited_from"] for c in three] == [three[2]["request_id"]] * 2 + [None]
    assert [rows[c["request_id"]]["reward"] for c in two] == pytest.approx([-1.0, 1.0])
    assert {rows[c["request_id"]]["conversation_id"] for c in three} == {three[0]["request_id"]}
    assert [rows[c["request_id"]]["turn"] for c in three] == [0, 1, 2]
    # without a discount each turn stands on its own feedback: the first two turns had none
    store_b = LocalStore(tmp_path / "b")
    put_logs(store_b, "completions", three)
    put_logs(store_b, "feedback", [feedback(three[2], "thumbs", thumbs="up")])
    r0 = collect(store_b, discount=0.0)
    assert r0.samples["request_id"].to_pylist() == [three[2]["request_id"]]
    assert r0.manifest.counts.completions.filtered_by_reason == {"no_feedback": 2}


def test_the_contract_quarantines_a_turn_in_another_clients_conversation(tmp_path) -> None:
    store = LocalStore(tmp_path)
    bobs = completion(T0 + 5 * MIN, 9, client="bob")
    mine = conversation(T0 + 10 * MIN, 2)
    intruder = completion(T0 + 12 * MIN, 1) | {"conversation_id": bobs["request_id"], "turn": 1}
    put_logs(store, "completions", [bobs, *mine, intruder])
    put_logs(store, "feedback", [feedback(c, "thumbs", thumbs="up") for c in (bobs, *mine, intruder)])
    r = collect(store, discount=0.0)
    quarantined = read_parquet(store, r.manifest.quarantine["completions"]).to_pylist()
    assert [(q["request_id"], q["reason"]) for q in quarantined] == [(intruder["request_id"], "foreign_conversation")]
    assert r.manifest.counts.completions.kept == 3


def test_completions_and_datasets_stored_before_conversations_still_read(tmp_path) -> None:
    store = LocalStore(tmp_path)
    c = completion(T0 + 10 * MIN)
    old = pa.Table.from_pylist([{k: c[k] for k in COMPLETION_SCHEMA_V1.names}], schema=COMPLETION_SCHEMA_V1)
    model, date, hour = partition_of(c["time_ms"])
    local = tmp_path / "old.parquet"
    pq.write_table(old, local)
    store.put_file(local, f"logs/completions/model={model}/date={date}/hour={hour}/part-old.parquet")
    put_logs(store, "feedback", [feedback(c, "thumbs", thumbs="up")])
    r = collect(store, discount=0.5)
    assert r.manifest.counts.completions.kept == 1 and r.samples["conversation_id"].to_pylist() == [None]
    # datasets written before conversations (and before scores, thumbs and edits) read with the new columns null
    for width in (len(REWARD_SAMPLE_SCHEMA) - 3, len(REWARD_SAMPLE_SCHEMA) - 6):
        older = r.samples.select(REWARD_SAMPLE_SCHEMA.names[:width])
        up = upgrade_samples(older)
        assert up.schema.equals(REWARD_SAMPLE_SCHEMA) and up["turn"].null_count == 1
