"""From validated logs to RewardSample rows: join verdicts, reward, drop stale and duplicate rows.

Every step takes and returns the run's `Work`, recording each row's fate in its kind's Ledger.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from data_contracts.ledger import Ledger
from data_contracts.logs import Batch
from data_contracts.records import TAB_EVENTS
from data_contracts.reward_rules import BaseRewardRule, Verdicts
from data_contracts.samples import REWARD_SAMPLE_SCHEMA, WITHHELD_SCHEMA
from data_contracts.validate import Outcome
from tidal.model_settings import FeedbackPolicy


@dataclass
class Work:
    batch: Batch
    completions: Ledger
    feedback: Ledger
    c_frame: pd.DataFrame  # GE frame of the completions (derive.completion_frame)
    f_frame: pd.DataFrame
    c_replay: np.ndarray  # (N,) bool: exact copy of an earlier completion row
    f_replay: np.ndarray
    outcomes: dict[str, Outcome]
    scrubbed: Counter = field(default_factory=Counter)  # redactions per kind
    prompt_ids: dict[int, list[int]] = field(default_factory=dict)  # completion row → re-encoded prompt of a scrubbed row
    edits: dict[int, str] = field(default_factory=dict)  # feedback row → its edit text redacted (pii_policy 'scrub')
    # set by join_feedback: what users said about each completion row (records.FEEDBACK_GROUPS, one event each)
    verdicts: Verdicts | None = None
    score: np.ndarray | None = None  # (N,) float, the user's score as given (in the model's range), NaN = none
    judge_score: np.ndarray | None = None  # (N,) float, the judge's score (rescaled into the model's range), NaN = none
    feedback_time: np.ndarray | None = None  # (N,) float, time of the last of its events, NaN = no feedback
    verdict_of: np.ndarray | None = None  # (F,) completion row each feedback row became an event of, -1 if none
    reward: np.ndarray | None = None  # (N,) float, set by assign_rewards
    credited_from: np.ndarray | None = None  # (N,) object: the later turn a reward was credited from (assign_rewards)

    @property
    def event(self) -> np.ndarray:  # (N,) object: the Tab verdict, accepted | rejected | partial | none
        return self.verdicts.event

    @property
    def accepted_chars(self) -> np.ndarray:  # (N,) float, NaN = not given
        return self.verdicts.accepted_chars


def join_feedback(work: Work, policy: FeedbackPolicy | None = None) -> Work:
    """Each completion's events, at most one per group (the contract quarantines conflicting duplicates, so besides
    exact replays one is left): its Tab verdict, score (rescaled to [0, 1] by policy.score_range for the rule),
    thumbs and edit. policy: the model's `models[].feedback` (None: the defaults)."""
    policy = policy or FeedbackPolicy()
    fb, comp = work.feedback, work.completions
    fb.filter(work.f_replay, "duplicate")
    fb.filter(~work.batch.feedback.joinable, "late_feedback")
    n = comp.rows
    target = work.f_frame["_completion_row"].to_numpy()  # first completion row with the feedback's id, -1 if none
    if n:
        fb.filter((target >= 0) & comp.quarantine_mask[np.maximum(target, 0)], "completion_quarantined")
    use = np.flatnonzero(fb.live & (target >= 0))
    work.verdict_of = np.full(fb.rows, -1, dtype=np.int64)
    work.verdict_of[use] = target[use]
    # Replay copies of a completion share its events (they are dropped by dedupe anyway).
    first_of = work.c_frame["_first_row"].to_numpy()
    events = work.f_frame["event"].to_numpy(dtype=object)

    def joined(event_mask: np.ndarray, values: np.ndarray, fill, dtype) -> np.ndarray:
        out = np.full(n, fill, dtype=dtype)
        rows = use[event_mask[use]]
        out[target[rows]] = values[rows]
        return out[first_of]

    verdict = np.isin(events, TAB_EVENTS)
    thumbs = work.f_frame["thumbs"].to_numpy(dtype=object)
    edit_text = work.batch.feedback.table["edit_text"].to_numpy(zero_copy_only=False).astype(object)
    for row, text in work.edits.items():
        edit_text[row] = text
    when = np.full(n, np.nan)
    np.fmax.at(when, target[use], work.f_frame["time_ms"].to_numpy(dtype=np.float64)[use])
    by_judge = (work.f_frame["source"] == "judge").fillna(False).to_numpy()
    scores = work.f_frame["score"].to_numpy(dtype=np.float64)
    work.score = joined((events == "score") & ~by_judge, scores, np.nan, np.float64)
    work.judge_score = joined((events == "score") & by_judge, scores, np.nan, np.float64)
    work.verdicts = Verdicts(
        event=joined(verdict, events, "none", object),
        accepted_chars=joined(verdict, work.f_frame["accepted_chars"].to_numpy(), np.nan, np.float64),
        completion_chars=np.nan_to_num(work.c_frame["completion_chars"].to_numpy(dtype=np.float64), nan=0.0),
        score=policy.score01(work.score),
        judge_score=policy.score01(work.judge_score),
        thumbs=joined(events == "thumbs", np.where(thumbs == "up", 1.0, np.where(thumbs == "down", -1.0, 0.0)), 0.0, np.float64),
        edit_text=joined(events == "edit", edit_text, None, object),
        completion_text=work.batch.completions.table["completion_text"].to_numpy(zero_copy_only=False).astype(object),
    )
    work.feedback_time = when[first_of]
    return work


def assign_rewards(work: Work, rule: BaseRewardRule) -> Work:
    """Reward every live completion; a conversation's turn without an event the rule reads may take a later turn's,
    discounted (rule.turn_discount); else `rule.no_feedback` decides (empty ones are always kept)."""
    v, live = work.verdicts, work.completions.live
    work.reward = np.full(work.completions.rows, np.nan)
    rows = np.flatnonzero(live)
    work.reward[rows] = rule.reward_verdicts(v.take(rows))
    told = rule.rewarded(v)
    if rule.turn_discount > 0:
        told |= credit_turns(work, told & live, rule.turn_discount)
    if rule.no_feedback == "drop":
        work.completions.filter(~told & (v.completion_chars > 0), "no_feedback")
    return work


def credit_turns(work: Work, told: np.ndarray, discount: float) -> np.ndarray:
    """Each live turn without feedback of its own (told: (N,) bool) takes the reward of the nearest later turn of its
    conversation with feedback, x discount per turn between them; sets work.credited_from (N,) object (that turn's
    request id, None where the reward is the row's own) and returns (N,) bool: the rows credited."""
    table = work.batch.completions.table
    conv = table["conversation_id"].to_numpy(zero_copy_only=False).astype(object)
    turn = work.c_frame["turn"].to_numpy(dtype=np.float64)
    rids = table["request_id"].to_numpy(zero_copy_only=False).astype(object)
    work.credited_from = np.full(len(conv), None, dtype=object)
    credited = np.zeros(len(conv), dtype=bool)
    rows = np.flatnonzero(work.completions.live & np.not_equal(conv, None) & ~np.isnan(turn))
    by_conv: dict[str, list[int]] = {}
    for r in rows[np.lexsort((-turn[rows], conv[rows].astype(str)))]:  # each conversation's turns, last first
        by_conv.setdefault(conv[r], []).append(int(r))
    for turns in by_conv.values():
        later = None  # the nearest later turn with feedback
        for r in turns:
            if told[r]:
                later = r
            elif later is not None and turn[later] > turn[r]:
                work.reward[r] = work.reward[later] * discount ** (turn[later] - turn[r])
                work.credited_from[r], credited[r] = rids[later], True
    return credited


def drop_withheld(work: Work) -> Work:
    """A completion the version's suggestion filter withheld reached its user as nothing: no verdict can be about
    its text, and its tokens are not what the user saw, so it is never a training row (counted as `withheld`)."""
    work.completions.filter(work.c_frame["finish_reason"].to_numpy(dtype=object) == "withheld", "withheld")
    return work


def build_withheld(work: Work) -> pa.Table:
    """The completions filtered as withheld (each once: replays left out) as WithheldSample rows, sorted by
    (completion time, request id): what the next candidate's suggestion filter is fitted on besides the verdicts."""
    withheld = (work.completions.filtered == "withheld") & ~work.c_replay
    rows = np.flatnonzero(withheld)
    src = work.batch.completions.table.take(pa.array(rows, pa.int64()))
    prompt_ids = src["prompt_token_ids"]
    if work.prompt_ids:
        original = prompt_ids.to_pylist()
        prompt_ids = pa.array([work.prompt_ids.get(int(r), o) for r, o in zip(rows, original)], pa.list_(pa.int32()))
    table = pa.table(
        {
            "request_id": src["request_id"],
            "model": src["model"],
            "version": src["version"],
            "prompt_token_ids": prompt_ids,
            "completion_token_ids": src["completion_token_ids"],
            "behaviour_logprobs": src["behaviour_logprobs"],
            "completion_time_ms": src["time_ms"],
        },
        schema=WITHHELD_SCHEMA,
    )
    order = pc.sort_indices(table, sort_keys=[("completion_time_ms", "ascending"), ("request_id", "ascending")])
    return table.take(order)


def versions_behind(versions: np.ndarray, known: list[int], champion: int) -> np.ndarray:
    """(N,) how many registered versions lie after each version, up to the champion (0 at or past it)."""
    ordered = np.array(sorted(known))
    return np.clip(np.searchsorted(ordered, champion, side="right") - np.searchsorted(ordered, versions, side="right"), 0, None)


def drop_stale(work: Work, known: list[int], champion: int, max_stale: int) -> Work:
    """Behaviour versions more than max_stale versions behind the champion are too far off-policy."""
    versions = np.nan_to_num(work.c_frame["version"].to_numpy(dtype=np.float64), nan=0).astype(np.int64)
    work.completions.filter(versions_behind(versions, known, champion) > max_stale, "stale")
    return work


def dedupe(work: Work) -> Work:
    """Exact replays of a completion row (same request id, same content) are kept once."""
    work.completions.filter(work.c_replay, "duplicate")
    return work


def settle_feedback(work: Work) -> Work:
    """A verdict's row shares the fate of its completion (kept, or filtered for the completion's reason)."""
    rows = np.flatnonzero(work.verdict_of >= 0)
    reasons = work.completions.filtered[work.verdict_of[rows]]
    dropped = ~np.equal(reasons, None)
    work.feedback.filtered[rows[dropped]] = reasons[dropped]
    return work


def build_samples(work: Work, rule: BaseRewardRule) -> pa.Table:
    """The kept completions as RewardSample rows, sorted by (completion time, request id)."""
    rows = np.flatnonzero(work.completions.live)
    src = work.batch.completions.table.take(pa.array(rows, pa.int64()))
    prompt_ids = src["prompt_token_ids"]
    if work.prompt_ids:
        replaced = [work.prompt_ids.get(int(r)) for r in rows]
        original = prompt_ids.to_pylist()
        prompt_ids = pa.array([o if r is None else r for o, r in zip(original, replaced)], pa.list_(pa.int32()))
    chars = work.accepted_chars[rows]
    when = work.feedback_time[rows]
    thumbs = work.verdicts.thumbs[rows]  # (K,) +1 up, -1 down, 0 none
    sampling = src["sampling"].combine_chunks()
    table = pa.table(
        {
            "request_id": src["request_id"],
            "model": src["model"],
            "version": src["version"],
            "arm": src["arm"],
            "user_hash": src["user_hash"],
            "prompt_token_ids": prompt_ids,
            "completion_token_ids": src["completion_token_ids"],
            "behaviour_logprobs": src["behaviour_logprobs"],
            "temperature": pc.struct_field(sampling, "temperature"),
            "top_p": pc.struct_field(sampling, "top_p"),
            "completion_text": src["completion_text"],
            "event": pa.array(work.event[rows].astype(str), pa.string()),
            "accepted_chars": pa.array(np.nan_to_num(chars).astype(np.int64), pa.int64(), mask=np.isnan(chars)),
            "reward": pa.array(work.reward[rows], pa.float64()),
            "reward_rule": pa.array(np.full(len(rows), rule.id, dtype=object), pa.string()),
            "completion_time_ms": src["time_ms"],
            "feedback_time_ms": pa.array(np.nan_to_num(when).astype(np.int64), pa.int64(), mask=np.isnan(when)),
            "score": pa.array(work.score[rows], pa.float64(), mask=np.isnan(work.score[rows])),
            "thumbs": pa.array(np.where(thumbs > 0, "up", "down").astype(object), pa.string(), mask=thumbs == 0),
            "edit_text": pa.array(work.verdicts.edit_text[rows].tolist(), pa.string()),
            "judge_score": pa.array(work.judge_score[rows], pa.float64(), mask=np.isnan(work.judge_score[rows])),
            "conversation_id": src["conversation_id"],
            "turn": src["turn"],
            "credited_from": pa.array(
                [None] * len(rows) if work.credited_from is None else work.credited_from[rows].tolist(), pa.string()
            ),
        },
        schema=REWARD_SAMPLE_SCHEMA,
    )
    order = pc.sort_indices(table, sort_keys=[("completion_time_ms", "ascending"), ("request_id", "ascending")])
    return table.take(order)
