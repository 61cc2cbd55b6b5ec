"""The records that cross the serving → data boundary, and their stored (Parquet) schemas.

One explicit type each. The gateway writes them; the collection flow reads and validates their
stored form (the Great Expectations suites check exactly these columns).
"""

from __future__ import annotations

from typing import Literal, get_args

import pyarrow as pa
from pydantic import BaseModel, Field

Arm = Literal["control", "canary"]
FinishReason = Literal["stop", "length", "abort", "error", "withheld"]  # withheld: the suggestion filter showed nothing
TabVerdict = Literal["accepted", "rejected", "partial"]  # the Tab events: one verdict on what was shown
FeedbackKind = Literal["accepted", "rejected", "partial", "score", "thumbs", "edit"]
TAB_EVENTS: tuple[str, ...] = get_args(TabVerdict)
FEEDBACK_EVENTS: tuple[str, ...] = get_args(FeedbackKind)
Thumbs = Literal["up", "down"]
FeedbackSource = Literal["user", "judge"]  # who gave it: the client's user, or a judge model (its own flow stage)
# A completion takes at most one event of each group: one Tab verdict, one score, one thumbs, one edit (a second
# of the same group is a duplicate, refused by the gateway and quarantined by the contract).
FEEDBACK_GROUPS: dict[str, str] = {
    "accepted": "verdict",
    "rejected": "verdict",
    "partial": "verdict",
    "score": "score",
    "thumbs": "thumbs",
    "edit": "edit",
}


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
    conversation_id: str | None = Field(
        None,
        description=(
            "A chat turn's conversation: the request id of its first turn (the first turn's own id); None outside "
            "a conversation (plain completions)."
        ),
    )
    turn: int | None = Field(
        None, ge=0, description="Assistant replies before this one in the conversation (0: the first turn); None outside one."
    )


class FeedbackEvent(BaseModel):
    """A verdict on one completion: a Tab verdict, a score, a thumbs or an edit (one of each group per completion)."""

    request_id: str = Field(description="The signed id of the completion.")
    time_ms: int = Field(description="Unix epoch milliseconds when the feedback arrived.")
    model: str = Field(description="Model of the completion (partitions the feedback log).")
    event: FeedbackKind = Field(description="accepted, rejected, partial, score, thumbs or edit.")
    accepted_chars: int | None = Field(None, ge=0, description="Characters kept, for 'partial' (and 'accepted' when known).")
    client_id: str = Field(description="API client that sent the feedback.")
    score: float | None = Field(None, description="For 'score': the number given, within the model's feedback.score_range.")
    thumbs: Thumbs | None = Field(None, description="For 'thumbs': up or down.")
    edit_text: str | None = Field(
        None, description="For 'edit': the text the user finally kept (models opted in only; scrubbed like prompts)."
    )
    source: FeedbackSource = Field("user", description="'user' (through the gateway) or 'judge' (the judge stage).")


def feedback_group(event: str) -> str:
    """The group an event belongs to (one event per group per completion); an unknown event is its own group."""
    return FEEDBACK_GROUPS.get(event, event)


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
        ("conversation_id", pa.string()),
        ("turn", pa.int64()),
    ]
)
# The completion schema before conversations: files written in it are read with conversation_id and turn null.
COMPLETION_SCHEMA_V1 = pa.schema([COMPLETION_SCHEMA.field(n) for n in COMPLETION_SCHEMA.names[:17]])

FEEDBACK_SCHEMA = pa.schema(
    [
        ("request_id", pa.string()),
        ("time_ms", pa.int64()),
        ("model", pa.string()),
        ("event", pa.string()),
        ("accepted_chars", pa.int64()),
        ("client_id", pa.string()),
        ("score", pa.float64()),
        ("thumbs", pa.string()),
        ("edit_text", pa.string()),
        ("source", pa.string()),
    ]
)
# The feedback schema before scores, thumbs, edits and sources: files written in it are read with those four
# columns null (source 'user'), so logs stored by an older gateway stay collectable.
FEEDBACK_SCHEMA_V1 = pa.schema([FEEDBACK_SCHEMA.field(n) for n in FEEDBACK_SCHEMA.names[:6]])

SCHEMAS: dict[str, pa.Schema] = {"completions": COMPLETION_SCHEMA, "feedback": FEEDBACK_SCHEMA}
RECORD_TYPES: dict[str, type[BaseModel]] = {"completions": CompletionRecord, "feedback": FeedbackEvent}


def with_added_columns(kind: str, table: pa.Table) -> pa.Table:
    """A table of `kind` rows (possibly with extra columns, as quarantine files have) written before its schema
    gained columns: feedback's score, thumbs, edit_text and source (null; source 'user'), completions'
    conversation_id and turn (null), appended."""
    n = table.num_rows
    if kind == "feedback":
        added = {
            "score": pa.nulls(n, pa.float64()),
            "thumbs": pa.nulls(n, pa.string()),
            "edit_text": pa.nulls(n, pa.string()),
            "source": pa.array(["user"] * n, pa.string()),
        }
    else:
        added = {"conversation_id": pa.nulls(n, pa.string()), "turn": pa.nulls(n, pa.int64())}
    for name, column in added.items():
        if name not in table.column_names:
            table = table.append_column(SCHEMAS[kind].field(name), column)
    return table


EARLIER_SCHEMAS = {"feedback": FEEDBACK_SCHEMA_V1, "completions": COMPLETION_SCHEMA_V1}


def upgrade(kind: str, table: pa.Table) -> pa.Table | None:
    """A table in an earlier stored schema of `kind`, in the current one; None if it is in no known schema."""
    schema = table.schema.remove_metadata()
    if schema.equals(SCHEMAS[kind]):
        return table
    if schema.equals(EARLIER_SCHEMAS[kind]):
        return with_added_columns(kind, table).select(SCHEMAS[kind].names)
    return None


def to_table(kind: str, rows: list[dict]) -> pa.Table:
    """Rows (model_dump() of the record type) → a table in the stored schema."""
    return pa.Table.from_pylist(rows, schema=SCHEMAS[kind])
