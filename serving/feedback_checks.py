"""What a feedback event must be to be taken: an event the model lists, the fields its event carries and no
other, a score within the model's range, an edit within its length; and the ledger key that makes a second event of
the same group a duplicate. The gateway answers a problem with 422 naming the field. Also a chat turn's
conversation id: one this gateway started, of the turn's own client and model."""

from __future__ import annotations

from data_contracts.records import feedback_group
from serving.api_models import FeedbackRequest
from serving.request_ids import InvalidRequestId, RequestIdSigner
from tidal.model_settings import FeedbackPolicy


def claim_key(request_id: str, event: str) -> str:
    """The ledger's key of a feedback event: the request id for a Tab verdict (as gateways stored it before other
    groups existed, so a WAL written then refills the same keys), '<id>#<group>' for the others."""
    group = feedback_group(event)
    return request_id if group == "verdict" else f"{request_id}#{group}"


# the fields each event carries; any other given is refused (a score sent with a thumbs is a client's mistake)
EVENT_FIELDS = {
    "accepted": {"accepted_chars"},
    "rejected": {"accepted_chars"},  # taken as before scores existed (the contract checks the count's range)
    "partial": {"accepted_chars"},
    "score": {"score"},
    "thumbs": {"thumbs"},
    "edit": {"edit_text"},
}
REQUIRED_FIELD = {"partial": "accepted_chars", "score": "score", "thumbs": "thumbs", "edit": "edit_text"}


def feedback_problem(req: FeedbackRequest, model: str, policy: FeedbackPolicy) -> str | None:
    """Why the model cannot take this event (a 422 naming the field), or None."""
    if req.event not in policy.events:
        opt_in = " (storing an edit's text is an opt-in)" if req.event == "edit" else ""
        return (
            f"event: '{req.event}' is not an event model '{model}' takes{opt_in}; it takes {policy.events} "
            f"(models[].feedback.events)"
        )
    required = REQUIRED_FIELD.get(req.event)
    if required is not None and getattr(req, required) is None:
        return f"{required}: event '{req.event}' needs it"
    extra = sorted(f for f in ("accepted_chars", "score", "thumbs", "edit_text") if getattr(req, f) is not None)
    extra = [f for f in extra if f not in EVENT_FIELDS[req.event]]
    if extra:
        return f"{extra[0]}: not a field of event '{req.event}' (it takes {sorted(EVENT_FIELDS[req.event]) or 'none'})"
    low, high = policy.score_range
    if req.score is not None and not low <= req.score <= high:
        return f"score: {req.score:g} is outside model '{model}''s score_range [{low:g}, {high:g}]"
    if req.edit_text is not None and len(req.edit_text) > policy.max_edit_chars:
        return f"edit_text: {len(req.edit_text)} characters, more than model '{model}''s max_edit_chars {policy.max_edit_chars}"
    return None


def conversation_problem(
    signer: RequestIdSigner, conversation_id: str | None, model: str, client_id: str
) -> tuple[int, str] | None:
    """(HTTP status, message naming the field) if a chat turn's conversation id is not one this gateway started (a
    first turn's request id), for this model, of this client; None if it is, or if there is none (a first turn)."""
    if conversation_id is None:
        return None
    try:
        claims = signer.verify(conversation_id)
    except InvalidRequestId as e:
        return 422, (
            f"conversation_id: not a conversation this gateway started ({e.reason}); pass the first turn's id "
            "(its reply's tidal.conversation_id)"
        )
    if claims.client_id != client_id:
        return 403, "conversation_id: the conversation belongs to another client"
    if claims.model != model:
        return 422, f"conversation_id: the conversation is with model {claims.model!r}, not {model!r}"
    return None
