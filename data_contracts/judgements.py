"""Where judge scores live, and how the collection takes them (data_contracts/judge.py asks the judge).

    judgements/model=M/judge=<name@version>/part-<run ms>.parquet        FeedbackEvent rows, source 'judge'
    judgements/model=M/judge=<name@version>/quarantine-<run ms>.parquet  failed judgements with their reasons
    judgements/model=M/judge=<name@version>/run-<run ms>.json            the run's JudgeRun record

A completion is judged once per judge id (scored or failed): a later run takes the completions not judged yet.
"""

from __future__ import annotations

import json

import pyarrow as pa

from data_contracts.dataset import parquet_bytes, put_bytes, read_parquet
from data_contracts.judge import JudgeRun, Verdict, rescale
from data_contracts.logs import Batch, append_rows
from data_contracts.records import SCHEMAS, FeedbackEvent, to_table, with_added_columns
from data_contracts.scope import floor_hour, parse_key
from tidal.judge_settings import JudgeSettings
from tidal.store import ObjectStore

FAILURE_SCHEMA = pa.schema(
    [("request_id", pa.string()), ("reason", pa.string()), ("reply", pa.string()), ("latency_ms", pa.float64())]
)
MAX_REPLY_CHARS = 2000  # of a failed judgement's reply kept in quarantine


def judge_prefix(model: str, judge_id: str) -> str:
    return f"judgements/model={model}/judge={judge_id}"


def _keys(store: ObjectStore, model: str, judge_id: str, kind: str) -> list[str]:
    prefix = judge_prefix(model, judge_id)
    return sorted(k for k in store.list(prefix + "/") if k.rsplit("/", 1)[-1].startswith(kind))


def judged_ids(store: ObjectStore, model: str, judge_id: str) -> set[str]:
    """Request ids this judge scored or failed on already."""
    out: set[str] = set()
    for key in _keys(store, model, judge_id, "part-") + _keys(store, model, judge_id, "quarantine-"):
        out.update(read_parquet(store, key).column("request_id").to_pylist())
    return out


def candidates(store: ObjectStore, model: str, since_ms: int, until_ms: int, done: set[str]) -> list[dict]:
    """Shown completions of `model` served in [since_ms, until_ms) not in `done`, oldest first, once each:
    [{request_id, time_ms, prompt_text, completion_text}]."""
    columns = ["request_id", "time_ms", "prompt_text", "completion_text"]
    seen: dict[str, dict] = {}
    for key in store.list(f"logs/completions/model={model}/"):
        part = parse_key(key, model)
        if part is None or part.hour_ms < floor_hour(since_ms) or part.hour_ms >= until_ms:
            continue
        try:
            table = read_parquet(store, key).select(columns)
        except (KeyError, pa.ArrowException, OSError):  # an object the collection quarantines whole: nothing to judge
            continue
        for r in table.to_pylist():
            rid, t = r["request_id"], r["time_ms"]
            if rid and t is not None and since_ms <= t < until_ms and r["completion_text"] and rid not in done:
                seen.setdefault(rid, r)
    return sorted(seen.values(), key=lambda r: (r["time_ms"], r["request_id"]))


def write_run(
    store: ObjectStore,
    model: str,
    cfg: JudgeSettings,
    verdicts: list[Verdict],
    score_range: tuple[float, float],
    record: dict,
    now_ms: int,
) -> JudgeRun:
    """The scored verdicts as FeedbackEvent rows (score rescaled into the model's score_range), the failed ones
    quarantined with their reasons, and the run's record; returns the record."""
    prefix, started = judge_prefix(model, cfg.id), record["started_ms"]
    events = [
        FeedbackEvent(
            request_id=v.request_id,
            time_ms=now_ms,
            model=model,
            event="score",
            client_id=cfg.client_id,
            score=rescale(cfg, v.score, score_range),
            source="judge",
        ).model_dump()
        for v in verdicts
        if v.score is not None
    ]
    failed = [
        {"request_id": v.request_id, "reason": v.reason, "reply": v.reply[:MAX_REPLY_CHARS], "latency_ms": v.latency_ms}
        for v in verdicts
        if v.score is None
    ]
    scored_key = (
        put_bytes(store, f"{prefix}/part-{started}.parquet", parquet_bytes(to_table("feedback", events))) if events else None
    )
    failed_key = (
        put_bytes(store, f"{prefix}/quarantine-{started}.parquet", parquet_bytes(pa.Table.from_pylist(failed, FAILURE_SCHEMA)))
        if failed
        else None
    )
    run = JudgeRun.model_validate({**record, "judgements_key": scored_key, "quarantine_key": failed_key})
    put_bytes(store, f"{prefix}/run-{started}.json", json.dumps(run.model_dump(), indent=2).encode())
    return run


def attach(store: ObjectStore, batch: Batch, model: str, judge_id: str | None) -> Batch:
    """The batch with the judge's scores of its completions appended to its feedback (joinable, not late), each
    object's key added to batch.files and the rows counted in batch.judged. judge_id None: nothing attached."""
    if judge_id is None or batch.completions.table.num_rows == 0:
        return batch
    ids = batch.completions.table["request_id"].combine_chunks()
    added = 0
    for key in _keys(store, model, judge_id, "part-"):
        table = with_added_columns("feedback", read_parquet(store, key)).select(SCHEMAS["feedback"].names)
        table = table.filter(pa.compute.is_in(table["request_id"], value_set=ids)).cast(SCHEMAS["feedback"])
        added += append_rows(batch, "feedback", key, table)
    if added:
        batch.judged[judge_id] = added
    return batch
