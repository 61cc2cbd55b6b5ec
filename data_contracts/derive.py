"""The frames Great Expectations validates: scalar stored columns plus derived ones, one row per record.

GE validates columns of scalars; row checks it cannot express directly (list lengths and element
ranges, regexes for secrets, joins to the other log) become derived columns here, computed with Arrow
and numpy, and the suites (data_contracts/suites.py) put expectations on them, so every failing row
id still comes from GE. No free text enters a frame (only lengths and the kinds of secrets found), so
validation results and Data Docs never copy a prompt. `_row` is the row's position in its table;
`_first_row` (completions) and `_completion_row` (feedback, -1 if none) are the join's look-ups,
computed once here.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from data_contracts import secrets
from data_contracts.records import FEEDBACK_EVENTS, TAB_EVENTS
from data_contracts.scope import rid_owner, rid_time_ms

COMPLETION_SCALARS = [
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
    "turn",
]
FEEDBACK_SCALARS = ["request_id", "time_ms", "model", "event", "accepted_chars", "client_id", "score", "thumbs", "source"]
SAMPLE_SCALARS = [
    "request_id",
    "model",
    "version",
    "arm",
    "user_hash",
    "event",
    "accepted_chars",
    "reward",
    "reward_rule",
    "completion_time_ms",
    "feedback_time_ms",
    "temperature",
    "top_p",
]


def _col(table: pa.Table, name: str) -> pa.Array:
    col = table[name]
    return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()


def first_index(values: pa.Array, value_set: pa.Array) -> np.ndarray:
    """(N,) position of each value's first occurrence in value_set, -1 where absent or null (hash join in Arrow)."""
    if len(value_set) == 0:
        return np.full(len(values), -1, dtype=np.int64)
    found = pc.index_in(values, value_set=value_set, skip_nulls=True)
    return pc.fill_null(found, -1).to_numpy(zero_copy_only=False).astype(np.int64)


def _float(arr: pa.Array) -> np.ndarray:
    """Nullable numbers → float64 with NaN for null (what GE's pandas backend treats as missing)."""
    return pc.cast(arr, pa.float64()).to_numpy(zero_copy_only=False)


def nullable_bool(values: np.ndarray, valid: np.ndarray) -> pd.arrays.BooleanArray:
    """(N,) bool with missing values where not valid (GE's map expectations skip missing values)."""
    return pd.arrays.BooleanArray(np.asarray(values, dtype=bool), ~np.asarray(valid, dtype=bool))


def list_stats(arr: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A list column → (lengths (N,) float with NaN for a null list, flat values (M,), row of each value (M,))."""
    return (
        _float(pc.list_value_length(arr)),
        pc.list_flatten(arr).to_numpy(zero_copy_only=False),
        pc.list_parent_indices(arr).to_numpy(zero_copy_only=False),
    )


def per_row_max(values: np.ndarray, rows: np.ndarray, n: int) -> np.ndarray:
    """(N,) max of each row's finite-or-infinite values, ignoring NaN; NaN for rows without any."""
    out = np.full(n, np.nan)
    if len(values):
        starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])  # rows are sorted: one run per list
        out[rows[starts]] = np.fmax.reduceat(values.astype(np.float64), starts)
    return out


def count_where(mask: np.ndarray, rows: np.ndarray, n: int) -> np.ndarray:
    return np.bincount(rows[mask], minlength=n).astype(np.int64)


def replays(table: pa.Table, keys: pa.Array | None = None) -> tuple[pd.Series, np.ndarray, np.ndarray]:
    """Duplicate request ids: an exact copy of an earlier row is a harmless replay (dedupe drops it), the
    same id with different content is a conflict (the contract quarantines all of them).

    Returns (distinct_record_id: (N,) str, the request id with replays blanked, so a uniqueness
    expectation fails exactly the conflicts; replay: (N,) bool; first: (N,) the first row with the
    same id, the row itself where it has none)."""
    ids = _col(table, "request_id") if keys is None else keys  # keys: the record's id when not its request id alone
    n = len(ids)
    first = first_index(ids, ids)  # each row's first row with the same id
    has_id = first >= 0
    repeats = np.bincount(first[has_id], minlength=n)
    dup = has_id & (repeats[np.maximum(first, 0)] > 1)
    replay = np.zeros(n, dtype=bool)
    if dup.any():
        idx = np.flatnonzero(dup)
        contents = [repr(sorted(r.items())) for r in table.take(pa.array(idx)).to_pylist()]
        groups: dict[int, list[tuple[int, str]]] = {}
        for i, content in zip(idx.tolist(), contents):
            groups.setdefault(int(first[i]), []).append((i, content))
        for members in groups.values():
            if len({c for _, c in members}) == 1:  # all identical: keep the first
                replay[[i for i, _ in members[1:]]] = True
    distinct = pc.if_else(pa.array(replay), pa.scalar(None, pa.string()), ids)
    return pd.Series(distinct.to_pandas(), dtype="str"), replay, np.where(has_id, first, np.arange(n))


def conversation_owned(table: pa.Table) -> pd.arrays.BooleanArray:
    """(N,) whether a chat turn's conversation id (its first turn's request id) names the row's own model and
    client (missing outside conversations): a turn cannot join another client's conversation."""
    conv = _col(table, "conversation_id")
    valid = pc.is_valid(conv).to_numpy(zero_copy_only=False)
    ok = np.zeros(table.num_rows, dtype=bool)
    rows = np.flatnonzero(valid)
    if len(rows):
        ids = conv.take(pa.array(rows)).to_pylist()
        models = _col(table, "model").take(pa.array(rows)).to_pylist()
        clients = _col(table, "client_id").take(pa.array(rows)).to_pylist()
        ok[rows] = [rid_owner(c) == (m, k) for c, m, k in zip(ids, models, clients)]
    return nullable_bool(ok, valid)


def completion_frame(table: pa.Table) -> tuple[pd.DataFrame, np.ndarray]:
    """(GE frame, replay mask) of completions in the stored schema."""
    n = table.num_rows
    frame = table.select(COMPLETION_SCALARS).to_pandas()
    frame["_row"] = np.arange(n)
    p_len, p_ids, p_rows = list_stats(_col(table, "prompt_token_ids"))
    c_len, c_ids, c_rows = list_stats(_col(table, "completion_token_ids"))
    lp_len, lp, lp_rows = list_stats(_col(table, "behaviour_logprobs"))
    frame["prompt_chars"] = _float(pc.utf8_length(_col(table, "prompt_text")))
    frame["completion_chars"] = _float(pc.utf8_length(_col(table, "completion_text")))
    frame["prompt_tokens"], frame["completion_tokens"], frame["logprob_count"] = p_len, c_len, lp_len
    frame["total_tokens"] = p_len + c_len
    frame["negative_token_ids"] = count_where(p_ids < 0, p_rows, n) + count_where(c_ids < 0, c_rows, n)
    frame["max_logprob"] = per_row_max(lp, lp_rows, n)
    frame["nonfinite_logprobs"] = count_where(~np.isfinite(lp), lp_rows, n)
    # The distribution mu was drawn from: PPO scores pi at the same temperature (null struct -> null fields)
    sampling = _col(table, "sampling")
    frame["temperature"] = _float(pc.struct_field(sampling, "temperature"))
    frame["top_p"] = _float(pc.struct_field(sampling, "top_p"))
    expected_name = pc.binary_join_element_wise(_col(table, "model"), pc.cast(_col(table, "version"), pa.string()), "@v")
    same = pc.equal(_col(table, "served_name"), expected_name)
    frame["served_name_matches"] = nullable_bool(
        pc.fill_null(same, False).to_numpy(zero_copy_only=False), pc.is_valid(same).to_numpy(zero_copy_only=False)
    )
    frame["conversation_owned"] = conversation_owned(table)
    frame["prompt_secrets"] = secrets.detect(_col(table, "prompt_text")).to_pandas()
    frame["completion_secrets"] = secrets.detect(_col(table, "completion_text")).to_pandas()
    frame["distinct_record_id"], replay, frame["_first_row"] = replays(table)
    return frame, replay


def feedback_frame(
    table: pa.Table, joinable: np.ndarray, completions: pa.Table, policy_events: tuple[str, ...] = TAB_EVENTS
) -> tuple[pd.DataFrame, np.ndarray]:
    """(GE frame, replay mask) of feedback; joinable (N,) marks rows that must refer to one of `completions`;
    policy_events: the events the model takes (models[].feedback.events)."""
    frame = table.select(FEEDBACK_SCALARS).to_pandas()
    frame["_row"] = np.arange(table.num_rows)
    frame["accepted_chars"] = _float(_col(table, "accepted_chars"))
    frame["partial_without_chars"] = ((frame["event"] == "partial").fillna(False) & frame["accepted_chars"].isna()).to_numpy()
    # each event needs its own field: a score its number, a thumbs its direction, an edit its text
    event = frame["event"]
    edit_text = _col(table, "edit_text")
    frame["score_without_value"] = ((event == "score").fillna(False) & frame["score"].isna()).to_numpy()
    frame["thumbs_without_value"] = ((event == "thumbs").fillna(False) & frame["thumbs"].isna()).to_numpy()
    frame["edit_without_text"] = (
        (event == "edit").fillna(False) & ~pc.is_valid(edit_text).to_numpy(zero_copy_only=False)
    ).to_numpy()
    frame["edit_chars"] = _float(pc.utf8_length(edit_text))
    frame["edit_secrets"] = secrets.detect(edit_text).to_pandas()
    # an event the model does not take; unknown and null events are the contract's bad_event and null:event alone
    # a judge's score is taken whatever users may send: the model's judge is its opt-in (data_contracts/judge.py)
    judge = (frame["source"] == "judge").fillna(False).to_numpy() & (event == "score").fillna(False).to_numpy()
    frame["event_taken"] = nullable_bool(event.isin(policy_events).to_numpy() | judge, event.isin(FEEDBACK_EVENTS).to_numpy())
    # A judge's score is dated when the judge ran, which may be after the collection that takes it (re-scoring a
    # dataset): the time checks read its completion's time (from the signed id) instead; users' rows their own.
    signed = rid_time_ms(_col(table, "request_id")).astype(np.float64)
    frame["dated_ms"] = np.where(judge, np.where(signed >= 0, signed, np.nan), _float(_col(table, "time_ms")))
    # Look-ups into this run's completions (the first row of an id; conflicting duplicates are quarantined anyway).
    pos = first_index(_col(table, "request_id"), _col(completions, "request_id"))
    found = pos >= 0
    frame["completion_found"] = nullable_bool(found, joinable)
    matched = joinable & found
    at = pa.array(np.maximum(pos, 0))
    if completions.num_rows:
        client = pc.take(_col(completions, "client_id"), at)
        same_client = pc.fill_null(pc.equal(client, _col(table, "client_id")), False).to_numpy(zero_copy_only=False)
        shown = _float(pc.take(pc.utf8_length(_col(completions, "completion_text")), at))
    else:
        same_client, shown = np.zeros(len(frame), dtype=bool), np.full(len(frame), np.nan)
    # feedback comes from the completion's client, or from a judge (written by the judge stage, not the gateway)
    by_judge = judge & frame["client_id"].str.startswith("judge:").fillna(False).to_numpy()
    frame["client_matches"] = nullable_bool(matched & (same_client | by_judge), matched)
    kept = frame["accepted_chars"].to_numpy()
    known = matched & ~np.isnan(kept) & ~np.isnan(shown)
    frame["chars_within_completion"] = nullable_bool(known & (kept <= shown), known)
    frame["_completion_row"] = pos
    frame["distinct_record_id"], replay, _ = replays(table, group_ids(table))
    return frame, replay


def group_ids(table: pa.Table) -> pa.Array:
    """(N,) '<request id>#<group>' of feedback rows: one event of each group per completion (records.FEEDBACK_GROUPS),
    so a Tab verdict and a score on one completion are two records, two verdicts are a conflict; a judge's score is
    a group of its own ('score@judge'), beside the user's."""
    event = _col(table, "event")
    verdict = pc.fill_null(pc.is_in(event, value_set=pa.array(list(TAB_EVENTS))), False)
    group = pc.if_else(verdict, pa.scalar("verdict"), event)
    judged = pc.fill_null(pc.equal(_col(table, "source"), "judge"), False)
    group = pc.if_else(judged, pc.binary_join_element_wise(group, pa.scalar("judge"), "@"), group)
    return pc.binary_join_element_wise(_col(table, "request_id"), group, "#")


def sample_frame(table: pa.Table) -> pd.DataFrame:
    """GE frame of RewardSample rows (the dataset about to be written)."""
    n = table.num_rows
    frame = table.select(SAMPLE_SCALARS).to_pandas()
    frame["_row"] = np.arange(n)
    p_len, _, _ = list_stats(_col(table, "prompt_token_ids"))
    c_len, _, _ = list_stats(_col(table, "completion_token_ids"))
    lp_len, lp, lp_rows = list_stats(_col(table, "behaviour_logprobs"))
    frame["completion_tokens"], frame["logprob_count"], frame["total_tokens"] = c_len, lp_len, p_len + c_len
    frame["max_logprob"] = per_row_max(lp, lp_rows, n)
    frame["nonfinite_logprobs"] = count_where(~np.isfinite(lp), lp_rows, n)
    frame["accepted_chars"] = _float(_col(table, "accepted_chars"))
    frame["feedback_time_ms"] = _float(_col(table, "feedback_time_ms"))
    return frame
