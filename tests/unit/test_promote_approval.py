"""The typed approval form of an inconclusive canary: what a human may answer, and what gets recorded."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from tasks.promote_approval import Approval


def test_a_complete_answer_is_recorded_with_who_and_why() -> None:
    a = Approval(decision="promote", approver="alice", reason="looks fine")
    assert json.loads(a.audit_tags()["tidal.release.approved"]) == {
        "decision": "promote",
        "approver": "alice",
        "reason": "looks fine",
    }
    assert a.summary() == "promote approved by alice: looks fine"


@pytest.mark.parametrize(
    "answer",
    [
        {"decision": "maybe", "approver": "alice", "reason": "hmm"},
        {"decision": "promote", "approver": "", "reason": "ok then"},
        {"decision": "rollback", "approver": "bob"},
    ],
)
def test_bad_answers_are_refused(answer: dict) -> None:
    with pytest.raises(ValidationError):
        Approval(**answer)


def test_the_form_schema_offers_exactly_the_two_decisions() -> None:
    schema = Approval.model_json_schema()
    assert schema["properties"]["decision"]["enum"] == ["promote", "rollback"]
    assert set(schema["required"]) == {"decision", "approver", "reason"}
