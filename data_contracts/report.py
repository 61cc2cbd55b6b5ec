"""Human-readable reports of a collection run, from its manifest (Prefect artifacts render these)."""

from __future__ import annotations

from data_contracts.manifest import DatasetManifest
from tidal.store import ObjectStore


def quarantine_rows(manifest: DatasetManifest) -> list[dict]:
    """One row per (kind, reason): rows quarantined for it (a row with several reasons counts under each)."""
    return [
        {"kind": kind, "reason": reason, "rows": n}
        for kind in ("completions", "feedback")
        for reason, n in getattr(manifest.counts, kind).quarantined_by_reason.items()
    ]


def _fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"


def report_markdown(manifest: DatasetManifest, docs_uri: str | None, run_id: str | None, store: ObjectStore) -> str:
    m = manifest
    stored = m.stored()  # the counts and the summary as stored: the tables below show their keys
    c, s, model, ds = stored["counts"], stored["summary"], m.model, m.dataset_id
    lines = [
        f"# {model}: collected {ds}",
        "",
        f"Reward rule `{m.reward_rule.id}`, contract v{m.contract_version}, "
        f"watermark {m.watermark_before.hour or 'start'} → {m.watermark_after.hour}, "
        f"{len(m.source_partitions)} partitions.",
        "",
        "| rows | in | kept | quarantined | filtered |",
        "|---|---|---|---|---|",
    ]
    for kind in ("completions", "feedback", "total"):
        k = c[kind]
        lines.append(f"| {kind} | {k['in']} | {k['kept']} | {k['quarantined']} | {k['filtered']} |")
    lines += [
        "",
        "in = kept + quarantined + filtered (checked).",
        "",
        "## Quarantined and filtered, by reason",
        "",
        "| kind | outcome | reason | rows |",
        "|---|---|---|---|",
    ]
    for kind in ("completions", "feedback"):
        for outcome, key in (("quarantined", "quarantined_by_reason"), ("filtered", "filtered_by_reason")):
            lines += [f"| {kind} | {outcome} | {reason} | {n} |" for reason, n in c[kind][key].items()]
    if m.scrubbed:
        lines += ["", "Scrubbed (redactions by kind): " + ", ".join(f"{k} {n}" for k, n in m.scrubbed.items())]
    lines += [
        "",
        "## Rewards",
        "",
        f"{s['rows']} samples, mean reward {_fmt(s['reward_mean'])}; events: "
        + (", ".join(f"{e} {n}" for e, n in s["events"].items()) or "none"),
        "",
        "| reward from | to | rows |",
        "|---|---|---|",
    ]
    lines += [f"| {b['from']:+.3f} | {b['to']:+.3f} | {b['rows']} |" for b in s["reward_histogram"]]
    lines += [
        "",
        "## Accept rate by version and arm",
        "",
        "| version | arm | samples | verdicts | accept rate | mean reward |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| v{r['version']} | {r['arm']} | {r['rows']} | {r['verdicts']} | {_fmt(r['accept_rate'])} | {_fmt(r['mean_reward'])} |"
        for r in s["by_version_arm"]
    ]
    q = m.quarantine
    lines += [
        "",
        "## Links",
        "",
        f"- dataset: `{m.data_uri}` (digest `{m.digest}`)",
        f"- manifest: `{store.uri(m.data_key.rsplit('/', 1)[0] + '/manifest.json')}`",
    ]
    lines += [f"- quarantined {kind}: `{store.uri(key)}`" for kind, key in q.items() if kind != "files"]
    lines += [f"- quarantined file: `{store.uri(key)}`" for key in q.get("files", [])]
    if docs_uri:
        lines.append(f"- Great Expectations Data Docs: [{docs_uri}]({docs_uri})")
    if run_id:
        lines.append(f"- MLflow run: `{run_id}` (experiment `{model}/collect`)")
    return "\n".join(lines) + "\n"
