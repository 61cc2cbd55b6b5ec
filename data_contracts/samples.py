"""RewardSample: one served completion joined with its verdict and reward, as the trainer reads it.

A collected dataset (`datasets/model=M/<dataset-id>/part-0.parquet`) holds rows of exactly this type
in REWARD_SAMPLE_SCHEMA. The behaviour log-probs travel with every row: PPO's truncated importance
weight min(π_old/μ, C) needs μ, the probability the *served* weights gave each sampled token.

Beside it, `withheld.parquet` holds the completions the serving version's suggestion filter withheld
(WithheldSample in WITHHELD_SCHEMA): never training rows, but the next candidate's filter is fitted on them too.
"""

from __future__ import annotations

from typing import Literal

import pyarrow as pa
from pydantic import BaseModel, Field

from data_contracts.records import Arm, Thumbs

SampleEvent = Literal["accepted", "rejected", "partial", "none"]


class RewardSample(BaseModel):
    """A completion, the user's verdict on it (or "none"), and the reward the model's rule gave it."""

    request_id: str = Field(description="Signed request id of the completion (unique within a dataset).")
    model: str = Field(description="Registered model name.")
    version: int = Field(description="Behaviour version: the registry version whose weights sampled the completion.")
    arm: Arm = Field(description="Route arm that served it (control = champion, canary = candidate).")
    user_hash: str = Field(description="Hash of the user/session id.")
    prompt_token_ids: list[int] = Field(
        description="(P,) prompt token ids as the engine saw them (re-encoded if the prompt was scrubbed)."
    )
    completion_token_ids: list[int] = Field(description="(T,) sampled token ids.")
    behaviour_logprobs: list[float] = Field(
        description=(
            "(T,) served log-prob of each sampled token under the distribution it was drawn from (after temperature "
            "and top-p: the engines log processed log-probs): μ in PPO's IS weight."
        )
    )
    temperature: float = Field(
        1.0,
        ge=0,
        description=(
            "Temperature the completion was sampled at; the trainer scores π at the same temperature, so π/μ compares "
            "like with like. 0 = greedy: no exploration, and PPO does not train on it."
        ),
    )
    top_p: float = Field(
        1.0, gt=0, le=1, description="Nucleus mass it was sampled with (μ is renormalised over the nucleus below 1)."
    )
    completion_text: str = Field(description="Completion as shown to the user ('' = nothing shown).")
    event: SampleEvent = Field(
        description="The verdict: accepted, rejected, partial, or none (no feedback in time / nothing shown)."
    )
    accepted_chars: int | None = Field(None, ge=0, description="Characters the user kept, when the feedback said.")
    reward: float = Field(description="Terminal reward from the rule named in reward_rule.")
    reward_rule: str = Field(description="Rule that computed the reward, 'name@version'.")
    completion_time_ms: int = Field(description="Unix epoch ms of the completion request.")
    feedback_time_ms: int | None = Field(
        None, description="Unix epoch ms of the completion's last feedback event; None without feedback."
    )
    score: float | None = Field(None, description="The score given, in the model's score_range; None without one.")
    thumbs: Thumbs | None = Field(None, description="up or down; None without one.")
    edit_text: str | None = Field(None, description="The text the user finally kept (redacted if it held a secret).")
    judge_score: float | None = Field(
        None, description="The model's judge's score, rescaled into its score_range; None without one."
    )
    conversation_id: str | None = Field(None, description="A chat turn's conversation (its first turn's request id).")
    turn: int | None = Field(None, ge=0, description="Assistant replies before this one in its conversation.")
    credited_from: str | None = Field(
        None,
        description=(
            "The later turn whose feedback this turn's reward was credited from (its reward x the rule's "
            "turn_discount per turn between them); None: the reward is the turn's own."
        ),
    )


REWARD_SAMPLE_SCHEMA = pa.schema(
    [
        ("request_id", pa.string()),
        ("model", pa.string()),
        ("version", pa.int64()),
        ("arm", pa.string()),
        ("user_hash", pa.string()),
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("completion_token_ids", pa.list_(pa.int32())),
        ("behaviour_logprobs", pa.list_(pa.float32())),
        ("temperature", pa.float64()),
        ("top_p", pa.float64()),
        ("completion_text", pa.string()),
        ("event", pa.string()),
        ("accepted_chars", pa.int64()),
        ("reward", pa.float64()),
        ("reward_rule", pa.string()),
        ("completion_time_ms", pa.int64()),
        ("feedback_time_ms", pa.int64()),
        ("score", pa.float64()),
        ("thumbs", pa.string()),
        ("edit_text", pa.string()),
        ("judge_score", pa.float64()),
        ("conversation_id", pa.string()),
        ("turn", pa.int64()),
        ("credited_from", pa.string()),
    ]
)
# Columns added after the first datasets were written, in order: a dataset written before some of them is read with
# those null (score, thumbs, edit_text came with feedback beyond Tab; judge_score and the last three together).
ADDED_SAMPLE_COLUMNS = ("score", "thumbs", "edit_text", "judge_score", "conversation_id", "turn", "credited_from")


def upgrade_samples(table: pa.Table) -> pa.Table:
    """A dataset written before (a tail of) ADDED_SAMPLE_COLUMNS existed, with them null; any other table as it is."""
    names = REWARD_SAMPLE_SCHEMA.names
    missing = [c for c in names if c not in table.column_names]
    if not missing or tuple(missing) != ADDED_SAMPLE_COLUMNS[-len(missing) :] or table.column_names != names[: -len(missing)]:
        return table
    for c in missing:
        table = table.append_column(REWARD_SAMPLE_SCHEMA.field(c), pa.nulls(table.num_rows, REWARD_SAMPLE_SCHEMA.field(c).type))
    return table


def samples_table(rows: list[dict]) -> pa.Table:
    """Rows (model_dump() of RewardSample) → a table in the stored schema."""
    return pa.Table.from_pylist(rows, schema=REWARD_SAMPLE_SCHEMA)


class WithheldSample(BaseModel):
    """A completion the serving version's suggestion filter withheld: sampled, logged, never shown, so no verdict.
    The next candidate's filter scores its first token (data_contracts/suggestion_filter.py)."""

    request_id: str = Field(description="Signed request id of the completion.")
    model: str = Field(description="Registered model name.")
    version: int = Field(description="Behaviour version: the registry version whose weights sampled the completion.")
    prompt_token_ids: list[int] = Field(
        min_length=1, description="(P,) prompt token ids as the engine saw them (re-encoded if the prompt was scrubbed)."
    )
    completion_token_ids: list[int] = Field(min_length=1, description="(T,) sampled token ids (the user saw none).")
    behaviour_logprobs: list[float] = Field(min_length=1, description="(T,) served log-prob of each sampled token: μ.")
    completion_time_ms: int = Field(description="Unix epoch ms of the completion request.")


WITHHELD_SCHEMA = pa.schema(
    [
        ("request_id", pa.string()),
        ("model", pa.string()),
        ("version", pa.int64()),
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("completion_token_ids", pa.list_(pa.int32())),
        ("behaviour_logprobs", pa.list_(pa.float32())),
        ("completion_time_ms", pa.int64()),
    ]
)
