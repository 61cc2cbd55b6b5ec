"""Auditing simulated traffic: reading back what the gateway's log sink stored, for exact-count checks
(every acknowledged record stored exactly once)."""

from __future__ import annotations

import time
from collections import Counter

import pyarrow as pa

from data_contracts.dataset import read_parquet


def parquet_rows(store, prefix: str) -> list[dict]:
    """Every row of every Parquet object under prefix."""
    tables = [read_parquet(store, key) for key in store.list(prefix) if key.endswith(".parquet")]
    return pa.concat_tables(tables).to_pylist() if tables else []


def stored_rows(store, kind: str, model: str | None = None) -> list[dict]:
    """Every row the gateway's uploader stored under logs/<kind>/ (completions or feedback), of one model or all."""
    return parquet_rows(store, f"logs/{kind}/" + (f"model={model}/" if model else ""))


def wait_stored(store, kind: str, ids: set[str], timeout: float = 60, model: str | None = None) -> list[dict]:
    """All stored rows of `kind`, once every id in `ids` is among them (or the timeout passed)."""
    deadline = time.monotonic() + timeout
    while True:
        rows = stored_rows(store, kind, model)
        if ids <= {r["request_id"] for r in rows} or time.monotonic() > deadline:
            return rows
        time.sleep(0.5)


def not_exactly_once(acked: list[str], rows: list[dict]) -> dict[str, int]:
    """Acknowledged request ids stored other than exactly once, with their count (empty = nothing lost or doubled)."""
    counts = Counter(r["request_id"] for r in rows)
    return {rid: counts.get(rid, 0) for rid in acked if counts.get(rid, 0) != 1}
