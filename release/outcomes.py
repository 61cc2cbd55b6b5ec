"""Per-request outcomes of a canary, read from the gateway's stored logs: what each arm's users got.

A completion served since the canary started becomes an Outcome once it is resolved: its feedback
arrived (reward from the model's reward rule), nothing was shown (reward `empty`), or it waited
longer than `feedback_wait_s` without a verdict (event 'none', reward `ignored`). Younger
unresolved completions are left for a later look, so both arms are measured the same way.
Only rows of the two versions under test, in their own arm, count.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data_contracts.log_layout import key_segment_id, segment_opened_ms
from data_contracts.records import TAB_EVENTS, feedback_group, with_added_columns
from data_contracts.reward_rules import BaseRewardRule, Verdicts
from data_contracts.rewards import kept_chars
from data_contracts.scope import floor_hour, parse_key
from release.canary_records import History, Outcome
from tidal.model_settings import FeedbackPolicy
from tidal.store import ObjectStore

FEEDBACK_COLUMNS = ("request_id", "time_ms", "event", "accepted_chars", "score", "thumbs", "edit_text", "source")


class LogReader:
    """The model's log objects since a time, read once each: objects are immutable (their keys derive from
    segment ids; a re-upload rewrites the same rows), so each look only reads what is new.

    With `segment_span_s` (how long a gateway keeps a segment open, `gateway.logsink.segment_max_age_s`, plus
    slack for clock skew between the gateway and this process), objects of segments opened longer than that
    before `since_ms` hold only older records and are skipped unread: a canary's first look then reads the
    minutes since its start, not the whole hour of logs (one object per segment, each a few seconds long).
    Objects whose names carry no segment time are always read."""

    def __init__(self, store: ObjectStore, model: str, since_ms: int, segment_span_s: float | None = None):
        self.store, self.model, self.since_ms = store, model, since_ms
        self.opened_after_ms = None if segment_span_s is None else since_ms - int(segment_span_s * 1000)
        self._tables: dict[str, dict[str, pa.Table]] = {"completions": {}, "feedback": {}}

    def _closed_before_start(self, key: str) -> bool:
        # A gateway's object key names its WAL segment (part-<segment id>.parquet); every record in it was
        # written within the segment's lifetime, which begins at the time its id starts with.
        if self.opened_after_ms is None:
            return False
        opened = segment_opened_ms(key_segment_id(key))
        return opened is not None and opened < self.opened_after_ms

    def table(self, kind: str, columns: list[str]) -> pa.Table | None:
        seen, start = self._tables[kind], floor_hour(self.since_ms)
        with tempfile.TemporaryDirectory() as tmp:
            for key in self.store.list(f"logs/{kind}/model={self.model}/"):
                part = parse_key(key, self.model)
                if key in seen or part is None or part.hour_ms < start or self._closed_before_start(key):
                    continue
                local = Path(tmp) / "part.parquet"
                self.store.get_file(key, local)
                # rows stored before their schema gained columns read them as null (records.with_added_columns)
                t = pq.read_table(local, columns=None if kind == "feedback" else columns)
                t = with_added_columns(kind, t).select(columns)
                seen[key] = t.filter(pa.compute.greater_equal(t["time_ms"], self.since_ms))
        return pa.concat_tables(list(seen.values())) if seen else None


def request_kind(prompt_text: str) -> str:
    """A Tab request's kind, a stratum of the canary's comparison: 'line_start' when only indentation precedes
    the cursor on its line (the next statement is to be guessed), else 'mid_line' (a line is to be finished)."""
    return "mid_line" if prompt_text.rsplit("\n", 1)[-1].strip() else "line_start"


def _verdicts(fb: pa.Table | None, rids: list[str], texts: list[str], policy: FeedbackPolicy) -> Verdicts:
    """What users said about each of the requests `rids` (shown `texts`): the first event of each group (the
    gateway refuses a second one). Judges' scores are left out: a canary measures its users."""
    n = len(rids)
    v = Verdicts.tab(np.full(n, "none", dtype=object), np.full(n, np.nan), [len(t) for t in texts], texts)
    if fb is None or fb.num_rows == 0:
        return v
    row_of = {rid: i for i, rid in enumerate(rids)}
    cols = {c: fb[c].to_pylist() for c in FEEDBACK_COLUMNS if c != "time_ms"}
    seen: set[tuple[int, str]] = set()
    for i in np.argsort(np.asarray(fb["time_ms"]), kind="stable"):
        row, event = row_of.get(cols["request_id"][i]), cols["event"][i]
        if row is None or cols["source"][i] == "judge" or (row, feedback_group(event)) in seen:
            continue
        seen.add((row, feedback_group(event)))
        if event in TAB_EVENTS:
            v.event[row] = event
            v.accepted_chars[row] = np.nan if cols["accepted_chars"][i] is None else cols["accepted_chars"][i]
        elif event == "score" and cols["score"][i] is not None:
            v.score[row] = policy.score01(cols["score"][i])
        elif event == "thumbs":
            v.thumbs[row] = {"up": 1.0, "down": -1.0}.get(cols["thumbs"][i], 0.0)
        elif event == "edit":
            v.edit_text[row] = cols["edit_text"][i]
    return v


def read_outcomes(
    logs: LogReader,
    versions: dict[str, int],
    rule: BaseRewardRule,
    feedback_wait_s: float,
    now_ms: int,
    history: dict[str, History] | None = None,
    until_ms: int | None = None,
    policy: FeedbackPolicy | None = None,
) -> list[Outcome]:
    """Resolved outcomes of requests to `versions` ({"control": v, "canary": w}) served since the reader's start
    (and before until_ms, if given), each with its request kind, its user, and that user's `history`. A request
    resolves once an event the rule reads arrived (later events of other groups update it at the next look), when
    nothing was shown, or after feedback_wait_s. policy: the model's feedback policy (its score range)."""
    done = logs.table(
        "completions", ["request_id", "time_ms", "version", "arm", "completion_text", "latency_ms", "prompt_text", "user_hash"]
    )
    if done is None or done.num_rows == 0:
        return []
    rows = [
        r for r in done.to_pylist() if versions.get(r["arm"]) == r["version"] and (until_ms is None or r["time_ms"] < until_ms)
    ]
    fb = logs.table("feedback", list(FEEDBACK_COLUMNS))
    texts = [r["completion_text"] or "" for r in rows]
    v = _verdicts(fb, [r["request_id"] for r in rows], texts, policy or FeedbackPolicy())
    told = rule.rewarded(v)
    wait_ms = int(feedback_wait_s * 1000)
    # a shown completion without an event the rule reads waits for one until feedback_wait_s
    keep = np.array([bool(told[i] or not texts[i] or now_ms - r["time_ms"] >= wait_ms) for i, r in enumerate(rows)], bool)
    if not keep.any():
        return []
    picked = np.flatnonzero(keep)
    v = v.take(picked)
    rewards = rule.reward_verdicts(v)
    kept = kept_chars(v.event, v.accepted_chars, v.completion_chars)
    history = history or {}
    out = []
    for j, i in enumerate(picked):
        r = rows[i]
        out.append(
            Outcome(
                arm=r["arm"],
                reward=float(rewards[j]),
                accepted=float(v.event[j] == "accepted"),
                accepted_chars=float(kept[j]),
                latency_ms=float(r["latency_ms"]),
                time_ms=int(r["time_ms"]),
                kind=request_kind(r["prompt_text"]),
                history=history.get(r["user_hash"]),
                user=r["user_hash"],
                shown_chars=float(v.completion_chars[j]),
                thumbs_up=float(v.thumbs[j] > 0),
                thumbs_down=float(v.thumbs[j] < 0),
                score=float(v.score[j]),
            )
        )
    return out
