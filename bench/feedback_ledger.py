"""Duplicate-feedback check: cost of one verdict's check with N request ids inside the feedback window, the
gateway's ledger against the dict it replaced (rebuilt whenever it held more than 100k ids), side by side.

    .venv/bin/python bench/feedback_ledger.py [--sizes 100000,1000000] [--claims 200] [--rounds 5]

What is measured: for each N, both structures are filled with N ids whose verdicts all lie inside a 24 h
window (the default), then --claims new verdicts are checked and recorded one by one, timed per claim; the
median over --rounds interleaved rounds is reported, with the min and max as the spread. Memory: bytes per
id of the ledger at the largest N (tracemalloc, ids included). Runs on the calling thread, as on the
gateway's event loop. Nothing is asserted; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serving.feedback_ledger import FeedbackLedger

WINDOW_MS = 86_400_000


class RebuiltDict:
    """The previous check: a dict of id → time, rebuilt without expired ids whenever it held over 100k."""

    def __init__(self, window_ms: int):
        self.window_ms, self.seen = window_ms, {}

    def claim(self, rid: str, now: int) -> bool:
        if rid in self.seen:
            return False
        self.seen[rid] = now
        if len(self.seen) > 100_000:
            cutoff = now - self.window_ms
            self.seen = {k: t for k, t in self.seen.items() if t >= cutoff}
        return True

    def fill(self, n: int) -> None:
        # as the dict stood after n verdicts (filled directly: through claim() the fill alone is quadratic)
        self.seen = {f"{i:016x}-req.sig": i for i in range(n)}


def fill_ledger(ledger: FeedbackLedger, n: int) -> None:
    for i in range(n):
        ledger.claim(f"{i:016x}-req.sig", i)  # all within the window


def per_claim_us(make, n: int, claims: int) -> float:
    s = make(WINDOW_MS)
    s.fill(n) if isinstance(s, RebuiltDict) else fill_ledger(s, n)
    t0 = time.perf_counter()
    for j in range(claims):
        s.claim(f"new-{j:012x}-req.sig", n + j)
    return (time.perf_counter() - t0) / claims * 1e6


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="100000,1000000", help="ids inside the window, comma-separated")
    ap.add_argument("--claims", type=int, default=200, help="verdicts timed per round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    out: dict = {"bench": "feedback_ledger", "window_ms": WINDOW_MS, "claims": args.claims, "rounds": args.rounds}
    for n in sizes:
        ledger, old = [], []
        for _ in range(args.rounds):  # interleaved: the two see the same machine load
            ledger.append(per_claim_us(FeedbackLedger, n, args.claims))
            old.append(per_claim_us(RebuiltDict, n, args.claims))
            print(f"[ledger] n={n}: ledger {ledger[-1]:.2f} us, rebuilt dict {old[-1]:.0f} us", file=sys.stderr, flush=True)
        out[f"ledger_us_{n}"] = round(statistics.median(ledger), 3)
        out[f"ledger_us_{n}_spread"] = [round(min(ledger), 3), round(max(ledger), 3)]
        out[f"rebuilt_dict_us_{n}"] = round(statistics.median(old), 1)
        out[f"rebuilt_dict_us_{n}_spread"] = [round(min(old), 1), round(max(old), 1)]
        out[f"speedup_{n}"] = round(statistics.median(old) / statistics.median(ledger), 1)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    ledger_obj = FeedbackLedger(WINDOW_MS)
    fill_ledger(ledger_obj, max(sizes))
    out["ledger_bytes_per_id"] = round((tracemalloc.get_traced_memory()[0] - before) / max(sizes), 1)
    tracemalloc.stop()
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
