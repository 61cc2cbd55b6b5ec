"""The typed forms of a release that waits for a human: what a human may answer, and what gets recorded."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from release.canary_config import CanaryConfig
from release.policy import Look
from tasks.promote_approval import Approval, StepApproval, go_on_decision, needs_human


def test_a_complete_answer_is_recorded_with_who_and_why() -> None:
    a = Approval(decision="promote", approver="alice", reason="looks fine")
    assert json.loads(a.audit_tags("inconclusive")["tidal.release.approved"]) == {
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


def test_a_step_form_offers_advance_or_rollback_and_records_the_step() -> None:
    a = StepApproval(decision="advance", approver="alice", reason="figures look right")
    assert list(a.audit_tags("step-3")) == ["tidal.release.approved_step_3"]
    assert StepApproval.model_json_schema()["properties"]["decision"]["enum"] == ["advance", "rollback"]
    with pytest.raises(ValidationError):
        StepApproval(decision="promote", approver="alice", reason="wrong form")


@pytest.mark.parametrize("key, decision", [("promote", "promote"), ("inconclusive", "promote"), ("step-2", "advance")])
def test_the_pause_key_says_which_decision_goes_on(key: str, decision: str) -> None:
    assert go_on_decision(key) == decision


@pytest.mark.parametrize(
    "action, settings, asks",
    [
        ("inconclusive", {"on_inconclusive": "ask"}, True),
        ("inconclusive", {}, False),  # rolled back by itself
        ("promote", {"approve_before": [1.0]}, True),
        ("promote", {"approve_before": [0.5]}, False),  # a step's approval, asked during the ramp
        ("rollback", {"approve_before": [1.0], "on_inconclusive": "ask"}, False),  # a regression never waits
    ],
)
def test_which_decisions_wait_for_a_human(action: str, settings: dict, asks: bool) -> None:
    assert needs_human(Look(action, "why", 1, 0.5), CanaryConfig(**settings)) is asks
