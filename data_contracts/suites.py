"""The data contracts as Great Expectations suites, built in code per run (their bounds depend on the
run's clock, the registry's versions and the model's context length).

Each expectation names, in `meta["reason"]`, the quarantine reason of the rows it fails; the secrets
expectations name theirs from the kinds found (`meta["reasons_from"] = "secrets"`). Columns are those
of data_contracts/derive.py. Bump CONTRACT_VERSION on any change: it is part of every dataset id.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import get_args

import great_expectations as gx
import great_expectations.expectations as gxe

from data_contracts.records import Arm, FeedbackKind, FeedbackSource, FinishReason, Thumbs
from data_contracts.reward_rules import BaseRewardRule
from data_contracts.rewards import EVENTS
from tidal.model_settings import FeedbackPolicy

CONTRACT_VERSION = "3"  # 2: scores, thumbs, edits and their source; 3: conversations, judges' scores
# The value sets are the records' own types (data_contracts/records.py), so the suites cannot drift from them.
ARMS = list(get_args(Arm))
FINISH_REASONS = list(get_args(FinishReason))
FEEDBACK_EVENTS = list(get_args(FeedbackKind))


@dataclass(frozen=True)
class ContractParams:
    model: str
    known_versions: tuple[int, ...]  # every version registered for the model
    max_model_len: int  # most prompt+completion tokens
    oldest_ms: int  # start of the collection window
    newest_ms: int  # the run's clock plus the allowed skew
    feedback: FeedbackPolicy = field(default_factory=FeedbackPolicy)  # the events the model takes, its score range


def _meta(reason: str) -> dict:
    return {"reason": reason}


def _not_null(columns: dict[str, str]) -> list:
    """{frame column: stored field it stands for} → one not-null expectation each (reason null:<field>)."""
    return [gxe.ExpectColumnValuesToNotBeNull(column=c, meta=_meta(f"null:{field}")) for c, field in columns.items()]


def _time(p: ContractParams, column: str) -> list:
    return [
        gxe.ExpectColumnValuesToBeBetween(column=column, max_value=p.newest_ms, meta=_meta("future_time")),
        gxe.ExpectColumnValuesToBeBetween(column=column, min_value=p.oldest_ms, meta=_meta("too_old")),
    ]


def _sampling() -> list:
    # mu is a probability under these parameters; outside the ranges the engines accept, it means nothing
    return [
        gxe.ExpectColumnValuesToBeBetween(column="temperature", min_value=0.0, max_value=2.0, meta=_meta("bad_temperature")),
        gxe.ExpectColumnValuesToBeBetween(column="top_p", min_value=0.0, max_value=1.0, strict_min=True, meta=_meta("bad_top_p")),
    ]


def _logprobs(p: ContractParams) -> list:
    return [
        gxe.ExpectColumnPairValuesToBeEqual(
            column_A="completion_tokens",
            column_B="logprob_count",
            ignore_row_if="either_value_is_missing",
            meta=_meta("logprob_length_mismatch"),
        ),
        gxe.ExpectColumnValuesToBeBetween(column="max_logprob", max_value=0.0, meta=_meta("positive_logprob")),
        gxe.ExpectColumnValuesToBeBetween(column="nonfinite_logprobs", min_value=0, max_value=0, meta=_meta("nonfinite_logprob")),
        gxe.ExpectColumnValuesToBeBetween(
            column="total_tokens", min_value=0, max_value=p.max_model_len, meta=_meta("too_many_tokens")
        ),
    ]


def _suite(name: str, expectations: list) -> gx.ExpectationSuite:
    # Expectations are given at construction: add_expectation would need an active GE context.
    return gx.ExpectationSuite(name=name, expectations=expectations, meta={"contract_version": CONTRACT_VERSION})


def completion_suite(p: ContractParams) -> gx.ExpectationSuite:
    """CompletionRecord in stored form (frame: derive.completion_frame)."""
    return _suite(
        "completions",
        [
            *_not_null(
                {
                    c: c
                    for c in [
                        "request_id",
                        "time_ms",
                        "model",
                        "version",
                        "served_name",
                        "arm",
                        "user_hash",
                        "client_id",
                        "finish_reason",
                        "latency_ms",
                        "replica",
                    ]
                }
            ),
            *_not_null(
                {
                    "prompt_chars": "prompt_text",
                    "completion_chars": "completion_text",
                    "prompt_tokens": "prompt_token_ids",
                    "completion_tokens": "completion_token_ids",
                    "logprob_count": "behaviour_logprobs",
                    "temperature": "sampling.temperature",
                    "top_p": "sampling.top_p",
                }
            ),
            *_sampling(),
            gxe.ExpectColumnValuesToBeUnique(column="distinct_record_id", meta=_meta("duplicate_request_id")),
            gxe.ExpectColumnValuesToBeInSet(column="model", value_set=[p.model], meta=_meta("wrong_model")),
            gxe.ExpectColumnValuesToBeInSet(column="version", value_set=list(p.known_versions), meta=_meta("unknown_version")),
            gxe.ExpectColumnValuesToBeInSet(column="served_name_matches", value_set=[True], meta=_meta("served_name_mismatch")),
            gxe.ExpectColumnValuesToBeInSet(column="arm", value_set=ARMS, meta=_meta("bad_arm")),
            gxe.ExpectColumnValuesToBeInSet(column="conversation_owned", value_set=[True], meta=_meta("foreign_conversation")),
            gxe.ExpectColumnValuesToBeBetween(column="turn", min_value=0, meta=_meta("negative_turn")),
            gxe.ExpectColumnValuesToBeInSet(column="finish_reason", value_set=FINISH_REASONS, meta=_meta("bad_finish_reason")),
            gxe.ExpectColumnValuesToBeBetween(column="latency_ms", min_value=0, meta=_meta("negative_latency")),
            *_time(p, "time_ms"),
            *_logprobs(p),
            gxe.ExpectColumnValuesToBeBetween(
                column="negative_token_ids", min_value=0, max_value=0, meta=_meta("negative_token_id")
            ),
            gxe.ExpectColumnValuesToBeInSet(column="prompt_secrets", value_set=[""], meta={"reasons_from": "secrets"}),
            gxe.ExpectColumnValuesToBeInSet(column="completion_secrets", value_set=[""], meta={"reasons_from": "secrets"}),
        ],
    )


def feedback_suite(p: ContractParams) -> gx.ExpectationSuite:
    """FeedbackEvent in stored form (frame: derive.feedback_frame)."""
    return _suite(
        "feedback",
        [
            *_not_null({c: c for c in ["request_id", "time_ms", "model", "event", "client_id"]}),
            gxe.ExpectColumnValuesToBeUnique(column="distinct_record_id", meta=_meta("duplicate_request_id")),
            gxe.ExpectColumnValuesToBeInSet(column="model", value_set=[p.model], meta=_meta("wrong_model")),
            gxe.ExpectColumnValuesToBeInSet(column="event", value_set=FEEDBACK_EVENTS, meta=_meta("bad_event")),
            gxe.ExpectColumnValuesToBeBetween(column="accepted_chars", min_value=0, meta=_meta("negative_accepted_chars")),
            gxe.ExpectColumnValuesToBeInSet(
                column="partial_without_chars", value_set=[False], meta=_meta("partial_without_chars")
            ),
            *_time(p, "dated_ms"),  # derive.feedback_frame: a judge's score by its completion's time
            gxe.ExpectColumnValuesToBeInSet(column="completion_found", value_set=[True], meta=_meta("orphan_feedback")),
            gxe.ExpectColumnValuesToBeInSet(column="client_matches", value_set=[True], meta=_meta("foreign_feedback")),
            gxe.ExpectColumnValuesToBeInSet(
                column="chars_within_completion", value_set=[True], meta=_meta("accepted_chars_over_completion")
            ),
            *_feedback_fields(p),
        ],
    )


def _feedback_fields(p: ContractParams) -> list:
    """Scores, thumbs and edits: an event the model takes, with its own field, in range; an edit's secrets."""
    low, high = p.feedback.score_range
    return [
        gxe.ExpectColumnValuesToBeInSet(column="event_taken", value_set=[True], meta=_meta("event_not_taken")),
        gxe.ExpectColumnValuesToBeInSet(column="score_without_value", value_set=[False], meta=_meta("score_without_value")),
        gxe.ExpectColumnValuesToBeBetween(column="score", min_value=low, max_value=high, meta=_meta("score_out_of_range")),
        gxe.ExpectColumnValuesToBeInSet(column="thumbs_without_value", value_set=[False], meta=_meta("thumbs_without_value")),
        gxe.ExpectColumnValuesToBeInSet(column="thumbs", value_set=list(get_args(Thumbs)), meta=_meta("bad_thumbs")),
        gxe.ExpectColumnValuesToBeInSet(column="edit_without_text", value_set=[False], meta=_meta("edit_without_text")),
        gxe.ExpectColumnValuesToBeBetween(column="edit_chars", max_value=p.feedback.max_edit_chars, meta=_meta("edit_too_long")),
        gxe.ExpectColumnValuesToBeInSet(column="edit_secrets", value_set=[""], meta={"reasons_from": "secrets"}),
        gxe.ExpectColumnValuesToBeInSet(column="source", value_set=list(get_args(FeedbackSource)), meta=_meta("bad_source")),
    ]


def reward_sample_suite(p: ContractParams, rule: BaseRewardRule) -> gx.ExpectationSuite:
    """RewardSample as written to a dataset (frame: derive.sample_frame). A failure here is a bug in the
    collection code, not bad input: the dataset is not written."""
    low, high = rule.bounds()
    return _suite(
        "reward_samples",
        [
            *_not_null(
                {
                    c: c
                    for c in [
                        "request_id",
                        "model",
                        "version",
                        "arm",
                        "user_hash",
                        "event",
                        "reward",
                        "reward_rule",
                        "completion_time_ms",
                        "completion_tokens",
                        "logprob_count",
                        "temperature",
                        "top_p",
                    ]
                }
            ),
            *_sampling(),
            gxe.ExpectColumnValuesToBeUnique(column="request_id", meta=_meta("duplicate_request_id")),
            gxe.ExpectColumnValuesToBeInSet(column="model", value_set=[p.model], meta=_meta("wrong_model")),
            gxe.ExpectColumnValuesToBeInSet(column="version", value_set=list(p.known_versions), meta=_meta("unknown_version")),
            gxe.ExpectColumnValuesToBeInSet(column="arm", value_set=ARMS, meta=_meta("bad_arm")),
            gxe.ExpectColumnValuesToBeInSet(column="event", value_set=list(EVENTS), meta=_meta("bad_event")),
            gxe.ExpectColumnValuesToBeInSet(column="reward_rule", value_set=[rule.id], meta=_meta("wrong_reward_rule")),
            gxe.ExpectColumnValuesToBeBetween(column="reward", min_value=low, max_value=high, meta=_meta("reward_out_of_range")),
            gxe.ExpectColumnValuesToBeBetween(column="accepted_chars", min_value=0, meta=_meta("negative_accepted_chars")),
            *_logprobs(p),
        ],
    )
