"""Request/response models of the gateway's HTTP API (OpenAI-compatible where OpenAI defines it)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from data_contracts.records import FeedbackKind, Thumbs
from serving.routes import ArmSpec


class _Request(BaseModel):
    # Unknown OpenAI fields (e.g. presence_penalty) are accepted and not forwarded; malformed known ones are 422.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str = Field(min_length=1, max_length=128, description="Registered model name, e.g. 'tab'.")
    max_tokens: int | None = Field(None, ge=0, description="Completion token budget (capped by gateway.max_tokens).")
    temperature: float | None = Field(None, ge=0, le=2, description="Sampling temperature; 0 = greedy.")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus mass.")
    stop: str | list[str] | None = Field(None, description="Stop string(s).")
    seed: int | None = Field(None, description="Sampling seed.")
    stream: bool = Field(False, description="Server-sent events.")
    user: str | None = Field(None, max_length=256, description="End-user/session id: sticks the user to one arm.")
    n: int = Field(1, ge=1, le=1, description="One sample per request (production logs are one per prompt).")

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Request):
    prompt: str = Field(description="Text to complete.")
    logprobs: int | None = Field(None, ge=0, le=5, description="Return this many top log-probs per token.")
    echo: bool = Field(False, description="Not supported; must be false.")
    return_token_ids: bool = Field(False, description="Return prompt and completion token ids (vLLM extension).")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant"] = Field(description="Author of the message.")
    content: str = Field(description="Message text.")


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1, description="Conversation so far.")
    logprobs: bool = Field(False, description="Return per-token log-probs.")
    top_logprobs: int | None = Field(None, ge=0, le=5, description="Top alternatives per token, with logprobs.")
    max_completion_tokens: int | None = Field(None, ge=0, description="OpenAI's newer name for max_tokens.")
    conversation_id: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description=(
            "For every turn after the first: the conversation's id, which the first turn's reply carries "
            "(`tidal.conversation_id`, the first turn's request id). With the OpenAI SDK: extra_body={'conversation_id': ...}."
        ),
    )


class FeedbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(min_length=1, max_length=256, description="The signed id the completion came with.")
    event: FeedbackKind = Field(
        description="accepted, rejected, partial, score, thumbs or edit: those the model's feedback.events lists."
    )
    accepted_chars: int | None = Field(None, ge=0, le=1_000_000, description="Characters kept; required for partial.")
    score: float | None = Field(None, allow_inf_nan=False, description="Required for 'score': within the model's score_range.")
    thumbs: Thumbs | None = Field(None, description="Required for 'thumbs': up or down.")
    edit_text: str | None = Field(
        None, max_length=200_000, description="Required for 'edit': the text kept (at most the model's max_edit_chars)."
    )


class FeedbackResponse(BaseModel):
    request_id: str
    event: FeedbackKind
    recorded: bool = True


class RoutesUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    arms: list[ArmSpec] = Field(description="The new arms; weights sum to 1, one 'control'.")
    reason: str = Field("", max_length=500, description="Why (kept in the route history).")
    by: str = Field("admin", max_length=100, description="Who made the change.")


class CanaryUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=1, description="Canary version (must be served by the fleet).")
    weight: float = Field(ge=0, le=1, description="Canary share of users.")
    reason: str = Field("", max_length=500)
    by: str = Field("admin", max_length=100)
    watch_s: float | None = Field(
        None,
        gt=0,
        le=30 * 86400,
        description=(
            "The caller watches this canary and checks in (POST .../canary/watch) within this many seconds, or the "
            "gateway rolls it back; None: nobody watches it (a canary set by hand)."
        ),
    )


class CanaryWatch(BaseModel):
    """A release's check-in: it still watches its canary."""

    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=1, description="The canary version the caller watches (409 when it is no longer routed).")
    watch_s: float = Field(gt=0, le=30 * 86400, description="Next check-in due within this many seconds.")


class RollbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: str = Field("", max_length=500)
    by: str = Field("admin", max_length=100)
