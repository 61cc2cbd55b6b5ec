"""`tidal quarantine list|show|release MODEL`: what the collect flow set aside, by reason; the rows of one reason;
and letting chosen rows back into the next collection (data_contracts/release.py), with the release recorded."""

from __future__ import annotations

import datetime as dt
import json

from tidal.settings import TidalSettings


def _when(ms: int | None) -> str:
    return "-" if ms is None else dt.datetime.fromtimestamp(ms / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M")


def _release(settings: TidalSettings, store, args) -> None:
    import getpass

    from data_contracts import release
    from tidal.clock import now_ms

    settings.model(args.model)  # unknown model → clear error
    plan = release.plan_release(store, args.model, args.reason, args.dataset, args.kind, args.request_id)
    n = {k: t.num_rows for k, t in plan.rows.items()}
    what = (
        f"{n.get('completions', 0)} completions and {n.get('feedback', 0)} feedback rows "
        f"({plan.verdicts_from_logs} verdicts read back from the logs)"
    )
    again = ", ".join(f"{r}: {c}" for r, c in plan.other_reasons.items())
    if args.dry_run:
        print(f"{args.model}: would release {what}, waiving {args.reason!r}")
    else:
        by = args.by or getpass.getuser()
        record = release.write_release(store, args.model, args.reason, by, args.why, now_ms(), plan)
        print(f"{args.model}: released {what} as {record.release_id}, waiving {args.reason!r}; the next collection takes them")
    if again:
        print(f"  rows that also broke other contracts will be quarantined again ({again})")
    if plan.skipped:
        print(f"  skipped {plan.skipped} rows an earlier release holds")


def _print_releases(store, model: str) -> None:
    from data_contracts import release

    found = release.releases(store, model)
    if not found:
        return
    print("released:")
    for r, used in found:
        state = f"taken by {used.dataset_id}" if used else "pending (the next collection takes it)"
        rows = ", ".join(f"{k} {v}" for k, v in r.rows.items())
        print(f"  {r.release_id}  {_when(r.created_ms)}  {r.waived_reason:24s} {rows}  by {r.by}: {r.why}  [{state}]")


def cmd_quarantine(settings: TidalSettings, args) -> None:
    from data_contracts import quarantine
    from tidal.store import open_store

    store = open_store(settings)
    if args.quarantine_cmd == "release":
        _release(settings, store, args)
        return
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
        _print_releases(store, args.model)
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
    rel = qs.add_parser("release", help="let the rows quarantined for one reason back into the next collection")
    rel.add_argument("model")
    rel.add_argument("reason", help="the one reason waived; a row that broke another contract is quarantined again")
    rel.add_argument("--why", required=True, help="why they may come back (recorded with the release)")
    rel.add_argument("--by", default=None, help="who releases them (default: the user running the command)")
    rel.add_argument("--dataset", default=None, help="one collection's dataset id (default: all)")
    rel.add_argument("--kind", choices=("completions", "feedback"), default=None)
    rel.add_argument("--request-id", action="append", default=None, help="only this request id (repeatable)")
    rel.add_argument("--dry-run", action="store_true", help="say what would be released; write nothing")
    for parser in (ls, sh, rel):
        parser.set_defaults(func=cmd_quarantine)
