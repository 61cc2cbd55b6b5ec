"""Where the gateway's logs live in the object store, and what a segment id says: the one layout the gateway's
uploader writes and the collect flow and the canary's reader parse. A leaf: it imports no component.

    logs/{kind}/model={model}/date={YYYY-MM-DD}/hour={HH}/part-{segment_id}.parquet   a segment's rows
    quarantine/wal/{kind}/part-{segment_id}.jsonl       its invalid rows ({"reason", "record"} lines)
    quarantine/wal/{kind}/poison-{segment_id}.jsonl     a segment the store refused again and again (+ .reason)

A segment id is `<opened ms, 13 digits>-<writer>-<counter, 6 digits>`: its creation time first, so a reader
can tell when it began taking records; the writer was the pid (7 digits) before it was a random id per writer.
"""

from __future__ import annotations

import re

Partition = tuple[str, str, str]  # (model, YYYY-MM-DD, HH)
LOG_KEY = re.compile(r"^logs/(completions|feedback)/model=([^/]+)/date=(\d{4}-\d{2}-\d{2})/hour=(\d{2})/part-[^/]+\.parquet$")
_SEGMENT_ID = re.compile(r"(\d{13})-(?:[0-9a-f]{12}|\d{7})-\d{6}")


def partition_key(kind: str, part: Partition, segment_id: str) -> str:
    model, date, hour = part
    return f"logs/{kind}/model={model}/date={date}/hour={hour}/part-{segment_id}.parquet"


def poison_key(kind: str, segment_id: str, suffix: str = "jsonl") -> str:
    return f"quarantine/wal/{kind}/poison-{segment_id}.{suffix}"


def quarantine_key(kind: str, segment_id: str) -> str:
    return f"quarantine/wal/{kind}/part-{segment_id}.jsonl"


def segment_id(opened_ms: int, writer: str, counter: int) -> str:
    """A segment's id: its creation time (ms) first, so readers can tell when it began taking records, then
    its writer's id, unique per process and pod, and the writer's own counter."""
    return f"{opened_ms:013d}-{writer}-{counter % 1_000_000:06d}"


def segment_opened_ms(seg_id: str) -> int | None:
    """The creation time (ms) a segment id starts with; None for an id of another form."""
    m = _SEGMENT_ID.fullmatch(seg_id)
    return int(m.group(1)) if m else None


def key_segment_id(key: str) -> str:
    """The segment id of a log object's key (`.../part-<id>.parquet`)."""
    return key.rsplit("/part-", 1)[-1].removesuffix(".parquet")
