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
from data_contracts.records import TAB_EVENTS
from data_contracts.reward_rules import BaseRewardRule
from data_contracts.rewards import kept_chars
from data_contracts.scope import floor_hour, parse_key
from release.canary_records import History, Outcome
from tidal.store import ObjectStore


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
                t = pq.read_table(local, columns=columns)
                seen[key] = t.filter(pa.compute.greater_equal(t["time_ms"], self.since_ms))
        return pa.concat_tables(list(seen.values())) if seen else None


def request_kind(prompt_text: str) -> str:
    """A Tab request's kind, a stratum of the canary's comparison: 'line_start' when only indentation precedes
    the cursor on its line (the next statement is to be guessed), else 'mid_line' (a line is to be finished)."""
    return "mid_line" if prompt_text.rsplit("\n", 1)[-1].strip() else "line_start"


def read_outcomes(
    logs: LogReader,
    versions: dict[str, int],
    rule: BaseRewardRule,
    feedback_wait_s: float,
    now_ms: int,
    history: dict[str, History] | None = None,
    until_ms: int | None = None,
) -> list[Outcome]:
    """Resolved outcomes of requests to `versions` ({"control": v, "canary": w}) served since the reader's start
    (and before until_ms, if given), each with its request kind, its user, and that user's `history`."""
    done = logs.table(
        "completions", ["request_id", "time_ms", "version", "arm", "completion_text", "latency_ms", "prompt_text", "user_hash"]
    )
    if done is None or done.num_rows == 0:
        return []
    fb = logs.table("feedback", ["request_id", "time_ms", "event", "accepted_chars"])
    verdicts: dict[str, tuple[str, int | None]] = {}
    if fb is not None:
        order = np.argsort(np.asarray(fb["time_ms"]), kind="stable")  # the first verdict counts (the gateway refuses repeats)
        rids, events, chars = fb["request_id"].to_pylist(), fb["event"].to_pylist(), fb["accepted_chars"].to_pylist()
        for i in order:
            if events[i] in TAB_EVENTS:  # scores, thumbs and edits are not what this canary compares
                verdicts.setdefault(rids[i], (events[i], chars[i]))
    wait_ms = int(feedback_wait_s * 1000)
    rows, picked = done.to_pylist(), []
    for r in rows:
        if versions.get(r["arm"]) != r["version"] or (until_ms is not None and r["time_ms"] >= until_ms):
            continue
        verdict = verdicts.get(r["request_id"])
        if verdict is None and r["completion_text"] and now_ms - r["time_ms"] < wait_ms:
            continue  # a verdict may still come
        picked.append((r, verdict or ("none", None)))
    if not picked:
        return []
    events = np.array([v[0] for _, v in picked], dtype=object)
    chars = np.array([np.nan if v[1] is None else v[1] for _, v in picked], dtype=np.float64)
    lengths = np.array([len(r["completion_text"]) for r, _ in picked])
    rewards = rule.rewards(events, chars, lengths)
    kept = kept_chars(events, chars, lengths)
    history = history or {}
    return [
        Outcome(
            arm=r["arm"],
            reward=float(rw),
            accepted=float(ev == "accepted"),
            accepted_chars=float(k),
            latency_ms=float(r["latency_ms"]),
            time_ms=int(r["time_ms"]),
            kind=request_kind(r["prompt_text"]),
            history=history.get(r["user_hash"]),
            user=r["user_hash"],
        )
        for (r, _), rw, ev, k in zip(picked, rewards, events, kept)
    ]
