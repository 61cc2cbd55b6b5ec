"""Collection throughput: validate + join + reward over N completions and their feedback, stored form.

    python -m bench.pipeline [--rows 1000000] [--partitions 10]

Generates CompletionRecord/FeedbackEvent rows written like the gateway's uploader does (records.to_table,
Parquet, partition keys) into a local store, then times the collection steps (generation and loading
are reported apart). Also runs every row check of the suites as plain pandas on the same frames, so
`ge_over_pandas` = Great Expectations validation time / the same checks in pandas. Runs twice over the same
completions, side by side: Tab verdicts alone, then with scores, thumbs, edits, a judge's scores and two-turn
conversations in the mix (under the blend rule, which reads them all, the judge's at half weight, and credits a
conversation's verdict to the turn before at 0.9): `records_per_s` and `records_per_s_with_new_events`. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import get_args

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from data_contracts.collect_settings import CollectSettings
from data_contracts.derive import completion_frame, feedback_frame
from data_contracts.log_layout import partition_key
from data_contracts.pipeline import (
    Versions,
    assemble_samples,
    contract_params,
    find_partitions,
    load_logs,
    reconcile,
    validate_logs,
)
from data_contracts.records import FeedbackKind, to_table
from data_contracts.suites import completion_suite, feedback_suite
from data_contracts.validate import validate_frames
from serving.request_ids import RequestIdSigner
from tidal.model_settings import FeedbackPolicy
from tidal.store import LocalStore

HOUR = 3_600_000
T0 = 1_767_225_600_000  # 2026-01-01T00:00Z


def generate(store: LocalStore, rows: int, partitions: int, feedback_share: float, seed: int, mix: bool = False) -> int:
    """`partitions` hours of completions (and feedback for a share of them), one object per hour each. mix: besides
    the Tab verdicts, a score on every 4th completion with feedback, a thumbs on every 3rd, an edit on every 10th and a
    judge's score on every 6th; and two of every five completions are the two turns of a chat conversation."""
    rng, signer = np.random.default_rng(seed), RequestIdSigner(b"bench-request-id-secret")
    per = rows // partitions
    n_feedback = 0
    with tempfile.TemporaryDirectory() as tmp:
        for p in range(partitions):
            start = T0 + p * HOUR
            times = np.sort(rng.integers(start, start + HOUR - 120_000, per)).tolist()
            versions = rng.choice([1, 2, 3], per, p=[0.1, 0.8, 0.1]).tolist()
            versions[::1499] = [9] * len(versions[::1499])  # a few defects (unknown version, positive log-prob)
            n_out = rng.integers(0, 12, per).tolist()
            comps, fbs = [], []
            for i, (t, v, k) in enumerate(zip(times, versions, n_out)):
                rid = signer.issue("tab", "alice", t)
                if mix and i % 5 == 0:  # a conversation's first turn: its own id is the conversation's
                    conversation = {"conversation_id": rid, "turn": 0}
                elif mix and i % 5 == 1:
                    conversation = {"conversation_id": comps[-1]["request_id"], "turn": 1}
                else:
                    conversation = {}
                comps.append(
                    {
                        "request_id": rid,
                        "time_ms": t,
                        "model": "tab",
                        "version": v,
                        "served_name": f"tab@v{v}",
                        "arm": "canary" if v == 3 else "control",
                        "user_hash": f"u{i % 5000}",
                        "client_id": "alice",
                        "prompt_text": "def f(x):\n    return x * " + str(i % 97),
                        "completion_text": "abcdefghijkl"[:k],
                        "prompt_token_ids": list(range(i % 50, i % 50 + 32)),
                        "completion_token_ids": list(range(1, k + 1)),
                        "behaviour_logprobs": [0.5 if i % 997 == 0 else -0.25] * k,
                        "sampling": {"temperature": 1.0, "top_p": 1.0, "max_tokens": 16, "stop": [], "seed": None},
                        "finish_reason": "length",
                        "latency_ms": 40.0 + i % 13,
                        "replica": "tab-0",
                    }
                    | conversation
                )
                if (i * 2654435761) % 1000 < feedback_share * 1000:
                    event = ("accepted", "rejected", "partial")[i % 3]
                    fbs.append(
                        {
                            "request_id": rid,
                            "time_ms": t + 1500,
                            "model": "tab",
                            "event": event,
                            "accepted_chars": min(k, 3) if event == "partial" else None,
                            "client_id": "alice",
                        }
                    )
                    if mix:
                        fbs.extend(new_events(rid, t, i))
            for kind, batch in (("completions", comps), ("feedback", fbs)):
                local = Path(tmp) / f"{kind}.parquet"
                pq.write_table(to_table(kind, batch), local)  # the uploader's writing path
                d = pd.Timestamp(start, unit="ms", tz="UTC")
                store.put_file(local, partition_key(kind, ("tab", f"{d:%Y-%m-%d}", f"{d:%H}"), f"{p:012d}"))
            n_feedback += len(fbs)
    return n_feedback


def new_events(rid: str, t: int, i: int) -> list[dict]:
    """Scores, thumbs, edits and a judge's scores on some completions (the mix of a chat model's feedback)."""
    base = {"request_id": rid, "model": "tab", "accepted_chars": None, "client_id": "alice"}
    out = []
    if i % 4 == 0:
        out.append(base | {"time_ms": t + 2000, "event": "score", "score": float(1 + i % 5)})
    if i % 3 == 0:
        out.append(base | {"time_ms": t + 2500, "event": "thumbs", "thumbs": "up" if i % 2 else "down"})
    if i % 10 == 0:
        out.append(base | {"time_ms": t + 3000, "event": "edit", "edit_text": "    return x * " + str(i % 89)})
    if i % 6 == 0:  # written by the judge stage (data_contracts/judgements.py) a minute after the completion
        judge = {"event": "score", "score": float(1 + i % 5), "source": "judge", "client_id": "judge:critic"}
        out.append(base | {"time_ms": t + 60_000} | judge)
    return out


def pandas_failures(suite, frame: pd.DataFrame) -> dict[str, np.ndarray]:
    """The suite's expectations evaluated with plain pandas: {expectation: failing `_row` ids}."""
    out = {}
    for e in suite.expectations:
        kw = e.configuration.kwargs
        if e.expectation_type == "expect_column_pair_values_to_be_equal":
            a, b = frame[kw["column_A"]], frame[kw["column_B"]]
            bad = a.notna() & b.notna() & (a != b)
        else:
            col = frame[kw["column"]]
            present = col.notna()
            if e.expectation_type == "expect_column_values_to_not_be_null":
                bad = ~present
            elif e.expectation_type == "expect_column_values_to_be_unique":
                bad = present & col.duplicated(keep=False)
            elif e.expectation_type == "expect_column_values_to_be_in_set":
                bad = present & ~col.isin(kw["value_set"])
            elif e.expectation_type == "expect_column_values_to_be_between":
                lo, hi = kw.get("min_value"), kw.get("max_value")
                bad = present & (((col < lo) if lo is not None else False) | ((col > hi) if hi is not None else False))
            else:
                raise ValueError(f"no pandas equivalent for {e.expectation_type}")
        out[f"{e.expectation_type}:{kw.get('column', '')}"] = frame["_row"].to_numpy()[np.asarray(bad, dtype=bool)]
    return out


def measure(rows: int, partitions: int, feedback_share: float, seed: int, mix: bool) -> dict:
    """One collection over generated logs, timed step by step. mix: the new events and conversations too, under the
    blend rule (which reads them all, the judge's at half weight, and credits earlier turns), for a model that takes
    them; else Tab verdicts under the Tab rule."""
    rule_spec = {"plugin": "feedback-blend", "judge_weight": 0.5, "turn_discount": 0.9} if mix else {}
    cfg = CollectSettings(window_s=30 * 86400, reward_rule=rule_spec)
    policy = FeedbackPolicy(events=list(get_args(FeedbackKind))) if mix else FeedbackPolicy()
    versions = Versions([1, 2, 3], champion=2)
    as_of = T0 + (partitions + 1) * HOUR
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp:
        store = LocalStore(Path(tmp))
        t = time.perf_counter()
        n_feedback = generate(store, rows, partitions, feedback_share, seed, mix)
        t_generate = time.perf_counter() - t

        t = time.perf_counter()
        batch = load_logs(store, find_partitions(store, "tab", cfg, as_of, include_open_hour=False))
        t_load = time.perf_counter() - t

        params, rule = contract_params("tab", versions, cfg, as_of, policy), cfg.rule_for("tab")
        t, cpu = time.perf_counter(), time.process_time()
        work = validate_logs(batch, params)
        t_validate = time.perf_counter() - t
        t = time.perf_counter()
        work, samples = assemble_samples(work, rule, versions, cfg.max_stale_versions, params)
        t_assemble = time.perf_counter() - t
        cpu = time.process_time() - cpu
        counts = reconcile(work)

        # GE against plain pandas, same frames and checks
        t = time.perf_counter()
        c_frame, _ = completion_frame(batch.completions.table)
        f_frame, _ = feedback_frame(batch.feedback.table, batch.feedback.joinable, batch.completions.table, tuple(policy.events))
        t_derive = time.perf_counter() - t
        checks = [(completion_suite(params), c_frame), (feedback_suite(params), f_frame)]
        t = time.perf_counter()
        outcomes = validate_frames(checks)
        t_ge = time.perf_counter() - t
        t = time.perf_counter()
        plain = [pandas_failures(suite, frame) for suite, frame in checks]
        t_pandas = time.perf_counter() - t
        ge_rows = [set(o.reasons) for o in outcomes.values()]
        pandas_rows = [set(np.concatenate(list(p.values())).tolist()) for p in plain]

    seconds = t_validate + t_assemble
    return {
        "completions": batch.completions.table.num_rows,
        "feedback": n_feedback,
        "reward_rule": rule.id,
        "records_per_s": round(batch.completions.table.num_rows / seconds),
        "log_rows_per_s": round((batch.completions.table.num_rows + n_feedback) / seconds),
        "records_per_cpu_s": round(batch.completions.table.num_rows / cpu),
        "validate_s": round(t_validate, 2),
        "assemble_s": round(t_assemble, 2),
        "derive_s": round(t_derive, 2),
        "ge_validate_s": round(t_ge, 2),
        "pandas_checks_s": round(t_pandas, 3),
        "ge_over_pandas": round(t_ge / t_pandas, 1),
        "failing_rows": sum(map(len, ge_rows)),
        "pandas_agrees": ge_rows == pandas_rows,
        "load_s": round(t_load, 2),
        "generate_s": round(t_generate, 1),
        "samples": samples.num_rows,
        "credited_turns": int(samples.column("credited_from").is_valid().to_numpy(zero_copy_only=False).sum()),
        "rows_in": counts["total"]["in"],
        "kept": counts["total"]["kept"],
        "filtered": counts["total"]["filtered"],
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000, help="completions (feedback comes on top)")
    ap.add_argument("--partitions", type=int, default=10, help="hours (one Parquet object per kind each)")
    ap.add_argument("--feedback-share", type=float, default=0.8, help="share of completions with a verdict")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    # the same completions twice, side by side: Tab verdicts alone, then with scores, thumbs, edits, judges' scores and
    # conversations in the mix
    tab = measure(args.rows, args.partitions, args.feedback_share, args.seed, mix=False)
    mixed = measure(args.rows, args.partitions, args.feedback_share, args.seed, mix=True)
    result = {
        "bench": "pipeline",
        **tab,
        "records_per_s_with_new_events": mixed["records_per_s"],
        "with_new_events": mixed,
        "with_over_without": round(mixed["records_per_s"] / tab["records_per_s"], 2),
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
    }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
