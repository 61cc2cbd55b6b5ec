"""Render Tidal's Grafana dashboard (infra/monitoring/dashboard.json) from a real Prometheus as one PNG: each panel's
queries over a time window (query_range), one small plot per panel, one line per series. What the README shows.

    python infra/monitoring/render_dashboard.py --prometheus http://127.0.0.1:9090 --minutes 30 --out docs/dashboard.png
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import httpx

DASHBOARD = Path(__file__).resolve().parent / "dashboard.json"


def series(prometheus: str, expr: str, start: float, end: float, step_s: float) -> list[tuple[str, list[float], list[float]]]:
    """(label text, times in minutes from start, values) of each series the query returns over [start, end]."""
    r = httpx.get(
        f"{prometheus}/api/v1/query_range",
        params={"query": expr, "start": start, "end": end, "step": step_s},
        timeout=30,
    )
    r.raise_for_status()
    out = []
    for s in r.json()["data"]["result"]:
        labels = {k: v for k, v in s["metric"].items() if k not in ("__name__", "job", "instance")}
        name = " ".join(f"{k}={v}" for k, v in sorted(labels.items())) or expr
        t = [(float(ts) - start) / 60 for ts, _ in s["values"]]
        v = [float(x) for _, x in s["values"]]
        out.append((name, t, v))
    return out


def render(prometheus: str, minutes: float, out: Path, step_s: float = 15.0) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = json.loads(DASHBOARD.read_text())["panels"]
    end = time.time()
    start = end - minutes * 60
    cols = 4
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.2 * rows), squeeze=False)
    empty = []
    for ax, panel in zip(axes.flat, panels):
        found = [s for target in panel["targets"] for s in series(prometheus, target["expr"], start, end, step_s)]
        for name, t, v in found[:8]:  # a panel with many series shows its first eight
            ax.plot(t, v, label=name[:60], linewidth=1.2)
        if not found:
            empty.append(panel["title"])
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
        ax.set_title(panel["title"], fontsize=10)
        ax.set_xlabel("minutes", fontsize=8)
        ax.tick_params(labelsize=7)
        if found:
            ax.legend(fontsize=6, loc="best")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(f"Tidal dashboard: the last {minutes:.0f} minutes from {prometheus}", fontsize=12)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    return {"panels": len(panels), "empty": empty, "out": str(out)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prometheus", default="http://127.0.0.1:9090")
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--step-s", type=float, default=15.0)
    p.add_argument("--out", type=Path, default=Path("docs/dashboard.png"))
    args = p.parse_args()
    print(json.dumps(render(args.prometheus, args.minutes, args.out, args.step_s)))


if __name__ == "__main__":
    main()
