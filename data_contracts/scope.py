"""What one collection run takes: the watermark, the partitions to read, and which rows each run owns.

Event-time accounting, so that every stored record is counted by exactly one run:

* A completion is owned by the run whose range [completions_through before, after) holds its time.
* A feedback row is accounted once both its completion time t_c (read from the signed request id) is
  before `completions_through` and its own time t_f before `feedback_through`; a run owns the rows that
  this becomes true for. Those whose completion is in the run's range and that came within
  feedback_timeout_s are joined (or are orphans); the others are `late_feedback`.
* A scheduled run takes hours that ended feedback_timeout_s + upload_grace_s ago, so each completion's
  verdict window is over and uploaded; `include_open_hour` takes everything up to upload_grace_s ago
  instead (tests, manual runs, the demo): a record younger than that may still be on its way from a
  gateway's write-ahead log, and once the range passed its time it would never be owned by any run.
* Records from the future (past the clock skew) are owned at once, so they are quarantined when first
  seen; the watermark keeps their ids until the range passes them, so they are not counted again.
* A row without a time, or a file that does not match its schema, is owned by the run that completes
  its partition's hour.
* Late arrivals: an object first listed by a run (modified after the previous run listed the store) may
  hold rows whose time an earlier run's range already passed: an upload delayed past upload_grace_s (a
  store outage), a gateway clock running behind, or an object uploaded again after it was collected. No
  range owns them any more, so the run that first lists the object takes them and quarantines them with
  reason `late_arrival`: counted, kept in the quarantine, never silently dropped.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, Field

from data_contracts.log_layout import LOG_KEY

HOUR_MS = 3_600_000
_RID_HEAD_CHARS = 28  # base64 characters covering the id's first 21 bytes
ID_FORMATS = (1, 2)  # request id formats whose head (format, nonce, time_ms) this reads
_B64URL_VALUES = np.full(256, 255, dtype=np.uint8)
_B64URL_VALUES[np.frombuffer(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_", dtype=np.uint8)] = np.arange(64)


class Watermark(BaseModel):
    """`state/watermarks/model=M.json`: how far collection of a model has got."""

    model: str
    hour: str | None = Field(None, description="Last fully processed hour, 'YYYY-MM-DDTHH' (UTC).")
    completions_through_ms: int = Field(description="Every completion with time < this has been accounted.")
    feedback_through_ms: int = Field(description="Feedback with t_f < this and t_c < completions_through has been accounted.")
    future_seen: dict[str, dict[str, int]] = Field(
        default_factory=lambda: {"completions": {}, "feedback": {}},
        description=("Future-dated rows already quarantined, kind → request id → time, until the range passes them."),
    )
    dataset_id: str | None = Field(None, description="Dataset written by the run that set this watermark.")
    updated_ms: int | None = None
    listed_from_ms: int | None = Field(
        None,
        description=(
            "Log objects last modified before this time (the store's clock) were listed by the run that set this "
            "watermark: the start of its listing less max_clock_skew_s. Later ones are new to the next run, which "
            "looks in them for late arrivals. None: not recorded (an older watermark): no object counts as new."
        ),
    )
    listed_recent: list[str] = Field(
        default_factory=list,
        description=("Keys that run listed which were modified at or after listed_from_ms: they are not new to the next run."),
    )


def watermark_key(model: str) -> str:
    return f"state/watermarks/model={model}.json"


def floor_hour(ms: int) -> int:
    return ms - ms % HOUR_MS


def hour_label(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%dT%H")


def initial_watermark(model: str, as_of_ms: int, window_s: float) -> Watermark:
    """A model's first run starts at the hour the collection window opens in."""
    start = floor_hour(as_of_ms - int(window_s * 1000))
    return Watermark(model=model, completions_through_ms=start, feedback_through_ms=start)


@dataclass(frozen=True)
class Partition:
    kind: str  # completions | feedback
    hour_ms: int  # start of the partition's hour

    @property
    def end_ms(self) -> int:
        return self.hour_ms + HOUR_MS


@dataclass(frozen=True)
class Range:
    """One run's bounds: before = the watermark it starts from, after = the one it would write."""

    c_old: int
    c_new: int
    f_old: int
    f_new: int
    as_of_ms: int
    future_ms: int  # times past this are 'in the future'
    timeout_ms: int


def next_range(wm: Watermark, as_of_ms: int, include_open_hour: bool, timeout_s: float, grace_s: float, skew_s: float) -> Range:
    timeout_ms, grace_ms = int(timeout_s * 1000), int(grace_s * 1000)
    if include_open_hour:  # everything that had time to reach the store
        c_new = f_new = as_of_ms - grace_ms + 1
    else:  # hours whose verdict window closed and whose records had time to reach the store
        c_new, f_new = floor_hour(as_of_ms - timeout_ms - grace_ms), as_of_ms - grace_ms
    return Range(
        wm.completions_through_ms,
        max(c_new, wm.completions_through_ms),
        wm.feedback_through_ms,
        max(f_new, wm.feedback_through_ms),
        as_of_ms,
        as_of_ms + int(skew_s * 1000),
        timeout_ms,
    )


def parse_key(key: str, model: str) -> Partition | None:
    """The partition of a log object key, or None for a key that is not a log part of this model."""
    m = LOG_KEY.match(key)
    if m is None or m.group(2) != model:
        return None
    start = datetime.strptime(f"{m.group(3)} {m.group(4)}", "%Y-%m-%d %H").replace(tzinfo=UTC)
    return Partition(m.group(1), int(start.timestamp() * 1000))


def partition_prefix(key: str) -> str:
    return key.rsplit("/", 1)[0]


def first_hour(rng: Range, kind: str) -> int:
    """Partitions before this hour hold nothing the run can own (feedback comes after its completion)."""
    return floor_hour(rng.c_old if kind == "completions" else min(rng.c_old, rng.f_old))


def completes_hour(rng: Range, part: Partition, kind: str) -> bool:
    """Whether this run is the one that finishes the partition's hour (owner of its undatable rows)."""
    old, new = (rng.c_old, rng.c_new) if kind == "completions" else (rng.f_old, rng.f_new)
    return old < part.end_ms <= new


def rid_time_ms(request_ids: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """(N,) completion times read from signed request ids (formats 1 and 2 of serving/request_ids.py, whose
    heads agree: base64url of format byte, 12-byte nonce, 8-byte big-endian time_ms, ...); -1 where an id is not
    readable. The signature is not checked: a forged id refers to no stored completion, so its feedback is an orphan.

    Vectorised: the first 28 characters encode bytes 0..20, which hold the version and the time."""
    ids = request_ids.combine_chunks() if isinstance(request_ids, pa.ChunkedArray) else request_ids
    out = np.full(len(ids), -1, dtype=np.int64)
    head = pc.utf8_slice_codeunits(pc.fill_null(ids, ""), 0, _RID_HEAD_CHARS)
    full = pc.binary_length(head).to_numpy(zero_copy_only=False) == _RID_HEAD_CHARS
    if not full.any():
        return out
    head = pc.filter(head, pa.array(full)).cast(pa.binary())
    offsets = np.frombuffer(head.buffers()[1], dtype=np.int32)[head.offset : head.offset + len(head) + 1]
    chars = np.frombuffer(head.buffers()[2], dtype=np.uint8)[offsets[0] : offsets[-1]].reshape(-1, _RID_HEAD_CHARS)
    sextets = _B64URL_VALUES[chars]  # (K, 28), 255 marks a non-base64url character
    readable = (sextets < 64).all(axis=1)
    version = (sextets[:, 0].astype(np.uint16) << 2) | (sextets[:, 1] >> 4)  # byte 0
    t = np.zeros(len(chars), dtype=np.uint64)
    for c in range(16, 28):  # characters 16..27 are bytes 12..20; the low 64 bits are bytes 13..20
        t = (t << np.uint64(6)) | sextets[:, c].astype(np.uint64)
    ok = readable & np.isin(version, ID_FORMATS) & (t < np.uint64(2**62))
    out[np.flatnonzero(full)[ok]] = t[ok].astype(np.int64)
    return out


_HEAD_BYTES = {1: 21, 2: 26}  # request id format → bytes before the model's length byte (serving/request_ids.py)


def rid_owner(request_id: str | None) -> tuple[str, str] | None:
    """(model, client id) a signed request id names, or None where it is not readable. The signature is not checked:
    the gateway verified it when the id came back as a conversation id; the contract checks the row agrees."""
    payload = (request_id or "").partition(".")[0]
    try:
        raw = base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))
        i = _HEAD_BYTES[raw[0]]
        m_end = i + 1 + raw[i]
        c_end = m_end + 1 + raw[m_end]
        if c_end != len(raw):
            return None
        return raw[i + 1 : m_end].decode(), raw[m_end + 1 : c_end].decode()
    except (ValueError, IndexError, KeyError):  # binascii.Error and UnicodeDecodeError are ValueErrors
        return None


def _seen(ids: pa.Array | pa.ChunkedArray, seen: dict[str, int]) -> np.ndarray:
    return np.array([i in seen for i in ids.to_pylist()], dtype=bool)


def owned_completions(
    rng: Range, t: np.ndarray, has_t: np.ndarray, in_done_hour: bool, ids: pa.Array | pa.ChunkedArray, seen: dict[str, int]
) -> np.ndarray:
    """(N,) bool: the completions of one file this run owns. t: (N,) times (any value where has_t is False);
    seen: ids of future rows an earlier run quarantined (rare, so the look-up may be slow)."""
    future = has_t & (t > rng.future_ms)
    in_range = has_t & (t >= rng.c_old) & (t < rng.c_new)
    if seen and (future.any() or in_range.any()):
        was_seen = _seen(ids, seen)
        future &= ~was_seen
        in_range &= ~was_seen
    return in_range | future | (~has_t & in_done_hour)


def owned_feedback(
    rng: Range,
    t_f: np.ndarray,
    has_t: np.ndarray,
    t_c: np.ndarray,
    in_done_hour: bool,
    ids: pa.Array | pa.ChunkedArray,
    seen: dict[str, int],
) -> tuple[np.ndarray, np.ndarray]:
    """(owned, joinable), each (N,) bool, for the feedback rows of one file. joinable rows may be matched
    to a completion of this run; owned but not joinable rows are late (or undatable)."""
    t_c = np.where(t_c >= 0, t_c, t_f)  # an unreadable id: as if its completion came with it (→ orphan)
    accounted_after = (t_c < rng.c_new) & (t_f < rng.f_new)
    accounted_before = (t_c < rng.c_old) & (t_f < rng.f_old)
    future = has_t & (t_f > rng.future_ms)
    if seen and (future.any() or accounted_after.any()):
        was_seen = _seen(ids, seen)
        future &= ~was_seen
        accounted_after &= ~was_seen
    owned = (has_t & accounted_after & ~accounted_before) | future | (~has_t & in_done_hour)
    joinable = owned & has_t & ~future & (t_c >= rng.c_old) & (t_c < rng.c_new) & (t_f - t_c <= rng.timeout_ms)
    return owned, joinable


def is_new(wm: Watermark, recent: set[str], key: str, modified_ms: int) -> bool:
    """Whether a log object was not there when the run that set `wm` listed the store (recent: wm.listed_recent)."""
    return wm.listed_from_ms is not None and modified_ms >= wm.listed_from_ms and key not in recent


def late_rows(
    rng: Range, kind: str, part: Partition, t: np.ndarray, has_t: np.ndarray, t_c: np.ndarray | None = None
) -> np.ndarray:
    """(N,) bool: the rows of a new object that an earlier run's range already passed (see the module's doc).
    t: (N,) row times; t_c: feedback only, (N,) completion times from the request ids (-1: unreadable)."""
    if kind == "completions":
        passed, old = t < rng.c_old, rng.c_old
    else:
        t_c = np.where(t_c >= 0, t_c, t)
        passed, old = (t_c < rng.c_old) & (t < rng.f_old), rng.f_old
    return (has_t & passed) | (~has_t & (part.end_ms <= old))  # undatable rows of an hour an earlier run completed


def advance(
    wm: Watermark,
    rng: Range,
    future: dict[str, dict[str, int]],
    dataset_id: str,
    now_ms: int,
    listed_from_ms: int | None = None,
    listed_recent: list[str] | None = None,
) -> Watermark:
    """The watermark after a successful run: the new range, future ids kept until the range passes them, and
    what this run listed (so the next one knows which objects are new to it)."""
    seen = {}
    for kind, through in (("completions", rng.c_new), ("feedback", rng.f_new)):
        merged = {**wm.future_seen.get(kind, {}), **future.get(kind, {})}
        seen[kind] = {rid: t for rid, t in merged.items() if t >= through}
    last_full = floor_hour(rng.c_new) - HOUR_MS
    return Watermark(
        model=wm.model,
        hour=hour_label(last_full),
        completions_through_ms=rng.c_new,
        feedback_through_ms=rng.f_new,
        future_seen=seen,
        dataset_id=dataset_id,
        updated_ms=now_ms,
        listed_from_ms=listed_from_ms,
        listed_recent=sorted(listed_recent or []),
    )
