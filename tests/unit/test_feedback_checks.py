"""What the gateway takes as feedback for a model: its events, each with its own field, in range; and the ledger
keys that let one completion have a verdict, a score, a thumbs and an edit, but not two of one."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from serving.api_models import FeedbackRequest
from serving.feedback_checks import claim_key, feedback_problem
from serving.feedback_ledger import FeedbackLedger
from tidal.model_settings import FeedbackPolicy

CHAT = FeedbackPolicy(events=["score", "thumbs", "edit"], score_range=(1, 5), max_edit_chars=20)


def problem(policy=CHAT, **body) -> str | None:
    return feedback_problem(FeedbackRequest(request_id="r", **body), "chat", policy)


def test_events_the_model_takes_with_their_fields_pass():
    assert problem(event="score", score=1) is None and problem(event="score", score=5.0) is None
    assert problem(event="thumbs", thumbs="down") is None
    assert problem(event="edit", edit_text="kept") is None
    assert problem(FeedbackPolicy(), event="partial", accepted_chars=3) is None


@pytest.mark.parametrize(
    "policy, body, words",
    [
        (CHAT, {"event": "score", "score": 5.5}, "score: 5.5 is outside model 'chat''s score_range [1, 5]"),
        (CHAT, {"event": "score"}, "score: event 'score' needs it"),
        (CHAT, {"event": "thumbs"}, "thumbs: event 'thumbs' needs it"),
        (
            CHAT,
            {"event": "accepted"},
            "event: 'accepted' is not an event model 'chat' takes; it takes ['score', 'thumbs', 'edit']",
        ),
        (FeedbackPolicy(), {"event": "edit", "edit_text": "x"}, "'edit' is not an event model 'chat' takes (storing an edit's"),
        (CHAT, {"event": "thumbs", "thumbs": "up", "score": 3}, "score: not a field of event 'thumbs' (it takes ['thumbs'])"),
        (CHAT, {"event": "edit", "edit_text": "x" * 21}, "edit_text: 21 characters, more than model 'chat''s max_edit_chars 20"),
        (FeedbackPolicy(), {"event": "partial"}, "accepted_chars: event 'partial' needs it"),
        (
            FeedbackPolicy(),
            {"event": "rejected", "score": 2},
            "score: not a field of event 'rejected' (it takes ['accepted_chars'])",
        ),
    ],
)
def test_each_refusal_names_the_field(policy, body, words):
    assert words in problem(policy, **body)


def test_the_request_model_refuses_unknown_values():
    for body in ({"event": "love"}, {"event": "thumbs", "thumbs": "sideways"}, {"event": "score", "score": float("nan")}):
        with pytest.raises(ValidationError):
            FeedbackRequest(request_id="r", **body)


def test_one_event_of_each_group_per_completion():
    ledger = FeedbackLedger(60_000)
    assert claim_key("r", "partial") == "r"  # as stored before other groups existed: a WAL refill keys the same
    assert all(ledger.claim(claim_key("r", e), 0) for e in ("accepted", "score", "thumbs", "edit"))
    assert not ledger.claim(claim_key("r", "rejected"), 1) and not ledger.claim(claim_key("r", "score"), 1)


def test_a_policy_refuses_an_empty_range_and_a_repeated_event():
    with pytest.raises(ValidationError, match="low must be below high"):
        FeedbackPolicy(score_range=(5, 5))
    with pytest.raises(ValidationError, match="lists an event twice"):
        FeedbackPolicy(events=["score", "score"])
    assert FeedbackPolicy(score_range=(1, 5)).score01(2) == 0.25
