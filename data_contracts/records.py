"""The records that cross the serving → data boundary, and their stored (Parquet) schemas.

One explicit type each. The gateway writes them; the collection flow reads and validates their
stored form (the Great Expectations suites check exactly these columns).
"""

from __future__ import annotations

from typing import Literal

import pyarrow as pa
from pydantic import BaseModel, Field

Arm = Literal["control", "canary"]
FinishReason = Literal["stop", "length", "abort", "error", "withheld"]  # withheld: the suggestion filter showed nothing
FeedbackKind = Literal["accepted", "rejected", "partial"]


class SamplingParams(BaseModel):
    """What the engine was asked to sample with (after any arm override)."""

    temperature: float = Field(1.0, ge=0, description="Softmax temperature; 0 = greedy.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus mass.")
    max_tokens: int = Field(16, ge=0, description="Completion token budget.")
    stop: list[str] = Field(default_factory=list, description="Stop strings.")
    seed: int | None = Field(None, description="Engine sampling seed, when the client gave one.")


class CompletionRecord(BaseModel):
    """One served completion: everything PPO needs to use it as an off-policy sample."""

    request_id: str = Field(description="Signed id returned to the client: '<payload>.<sig>' (serving/request_ids.py).")
    time_ms: int = Field(description="Unix epoch milliseconds when the request arrived.")
    model: str = Field(description="Registered model name.")
    version: int = Field(description="Registry version whose weights generated the completion.")
    served_name: str = Field(description="Engine model name used, 'MODEL@vN'.")
    arm: Arm = Field(description="Route arm the user was assigned to.")
    user_hash: str = Field(description="Hash of the user/session id (never the raw id).")
    client_id: str = Field(description="API client that made the request; only it may give feedback.")
    prompt_text: str = Field(description="Prompt as received (scrubbed downstream per data policy).")
    completion_text: str = Field(
        description="Completion as returned to the client: empty when the version's suggestion filter withheld it."
    )
    prompt_token_ids: list[int] = Field(description="(P,) prompt token ids as the engine tokenized them.")
    completion_token_ids: list[int] = Field(description="(T,) sampled token ids (also of a withheld completion).")
    behaviour_logprobs: list[float] = Field(description="(T,) engine log-prob of each sampled token: μ in PPO's IS weight.")
    sampling: SamplingParams = Field(description="Sampling parameters actually used.")
    finish_reason: FinishReason = Field(description="Why generation stopped, or 'withheld' by the suggestion filter.")
    latency_ms: float = Field(description="Gateway receive → last byte sent.")
    replica: str = Field(description="Engine replica that served it.")


class FeedbackEvent(BaseModel):
    """A user's verdict on one completion."""

    request_id: str = Field(description="The signed id of the completion.")
    time_ms: int = Field(description="Unix epoch milliseconds when the feedback arrived.")
    model: str = Field(description="Model of the completion (partitions the feedback log).")
    event: FeedbackKind = Field(description="accepted, rejected or partial.")
    accepted_chars: int | None = Field(None, ge=0, description="Characters kept, for 'partial' (and 'accepted' when known).")
    client_id: str = Field(description="API client that sent the feedback.")


SAMPLING_TYPE = pa.struct(
    [
        ("temperature", pa.float64()),
        ("top_p", pa.float64()),
        ("max_tokens", pa.int64()),
        ("stop", pa.list_(pa.string())),
        ("seed", pa.int64()),
    ]
)

COMPLETION_SCHEMA = pa.schema(
    [
        ("request_id", pa.string()),
        ("time_ms", pa.int64()),
        ("model", pa.string()),
        ("version", pa.int64()),
        ("served_name", pa.string()),
        ("arm", pa.string()),
        ("user_hash", pa.string()),
        ("client_id", pa.string()),
        ("prompt_text", pa.string()),
        ("completion_text", pa.string()),
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("completion_token_ids", pa.list_(pa.int32())),
        ("behaviour_logprobs", pa.list_(pa.float32())),
        ("sampling", SAMPLING_TYPE),
        ("finish_reason", pa.string()),
        ("latency_ms", pa.float64()),
        ("replica", pa.string()),
    ]
)

FEEDBACK_SCHEMA = pa.schema(
    [
        ("request_id", pa.string()),
        ("time_ms", pa.int64()),
        ("model", pa.string()),
        ("event", pa.string()),
        ("accepted_chars", pa.int64()),
        ("client_id", pa.string()),
    ]
)

SCHEMAS: dict[str, pa.Schema] = {"completions": COMPLETION_SCHEMA, "feedback": FEEDBACK_SCHEMA}
RECORD_TYPES: dict[str, type[BaseModel]] = {"completions": CompletionRecord, "feedback": FeedbackEvent}


def to_table(kind: str, rows: list[dict]) -> pa.Table:
    """Rows (model_dump() of the record type) → a table in the stored schema."""
    return pa.Table.from_pylist(rows, schema=SCHEMAS[kind])
