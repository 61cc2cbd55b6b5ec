"""`tidal quarantine list|show MODEL`: what the collect flow set aside, by reason, and the rows of one reason."""

from __future__ import annotations

import datetime as dt
import json

from tidal.settings import TidalSettings


def _when(ms: int | None) -> str:
    return "-" if ms is None else dt.datetime.fromtimestamp(ms / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M")


def cmd_quarantine(settings: TidalSettings, args) -> None:
    from data_contracts import quarantine
    from tidal.store import open_store

    store = open_store(settings)
    if args.quarantine_cmd == "list":
        found = quarantine.index(store, args.model)
        if args.json:
            print(found.model_dump_json(indent=2))
            return
        if not found.counts and not found.files:
            print(f"{args.model}: nothing quarantined")
            return
        print(f"{args.model}: rows quarantined, by reason (a row with several reasons counts under each)")
        for reason, n in found.by_reason().items():
            print(f"  {reason:32s} {n:8d}")
        print("by collection:")
        for c in found.counts:
            print(f"  {c.dataset_id}  {_when(c.created_ms)}  {c.kind:11s} {c.reason:32s} {c.rows:8d}")
        for f in found.files:
            print(f"  {f.dataset_id}  whole file {f.key}" + (f" ({f.kind}, {f.rows} rows: {f.detail})" if f.kind else ""))
        return
    tables = quarantine.rows(store, args.model, args.reason, args.dataset, args.kind, reveal=args.reveal)
    shown = 0
    for kind, table in tables.items():
        records = table.slice(0, max(args.limit - shown, 0)).to_pylist()
        shown += len(records)
        for r in records:
            print(json.dumps({"kind": kind, **r}, default=str) if args.json else f"[{kind}] " + json.dumps(r, default=str))
    total = sum(t.num_rows for t in tables.values())
    if not args.json:
        note = "" if args.reveal else "; text redacted (--reveal shows it as stored)"
        print(f"{shown} of {total} rows quarantined for {args.reason!r}{note}")


def add_parser(sub) -> None:
    q = sub.add_parser("quarantine", help="rows the collect flow set aside: counts by reason, and the rows of one")
    qs = q.add_subparsers(dest="quarantine_cmd", required=True)
    ls = qs.add_parser("list", help="rows quarantined per reason, per collection and kind; files quarantined whole")
    ls.add_argument("model")
    ls.add_argument("--json", action="store_true", help="the QuarantineIndex record")
    sh = qs.add_parser("show", help="the rows quarantined for one reason (among others)")
    sh.add_argument("model")
    sh.add_argument("reason", help="a reason as `list` prints it, e.g. secret:api_key or completion_quarantined")
    sh.add_argument("--dataset", default=None, help="one collection's dataset id (default: all)")
    sh.add_argument("--kind", choices=("completions", "feedback"), default=None)
    sh.add_argument("--limit", type=int, default=20, help="rows to print (default 20)")
    sh.add_argument("--reveal", action="store_true", help="print the text as stored (it may hold a secret)")
    sh.add_argument("--json", action="store_true", help="one JSON object per row")
    for parser in (ls, sh):
        parser.set_defaults(func=cmd_quarantine)
