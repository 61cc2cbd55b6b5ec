"""Auditing simulated traffic: reading back what the gateway's log sink stored, for exact-count checks
(every acknowledged record stored exactly once)."""

from __future__ import annotations

import tempfile
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def stored_rows(store, kind: str) -> list[dict]:
    """Every row of every Parquet object under logs/<kind>/ (completions or feedback)."""
    tables = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, key in enumerate(store.list(f"logs/{kind}/")):
            store.get_file(key, Path(tmp) / f"{i}.parquet")
            tables.append(pq.read_table(Path(tmp) / f"{i}.parquet"))
    return pa.concat_tables(tables).to_pylist() if tables else []


def wait_stored(store, kind: str, ids: set[str], timeout: float = 60) -> list[dict]:
    """All stored rows of `kind`, once every id in `ids` is among them (or the timeout passed)."""
    deadline = time.monotonic() + timeout
    while True:
        rows = stored_rows(store, kind)
        if ids <= {r["request_id"] for r in rows} or time.monotonic() > deadline:
            return rows
        time.sleep(0.5)


def not_exactly_once(acked: list[str], rows: list[dict]) -> dict[str, int]:
    """Acknowledged request ids stored other than exactly once, with their count (empty = nothing lost or doubled)."""
    counts = Counter(r["request_id"] for r in rows)
    return {rid: counts.get(rid, 0) for rid in acked if counts.get(rid, 0) != 1}
