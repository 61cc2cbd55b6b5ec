"""The flywheel: one cycle = collect → train (PPO + offline gate) → promote (canary A/B) → report.

    logs ─collect─▶ dataset ─train─▶ gated candidate ─promote─▶ champion (or rolled back)

Each stage is its own flow, run here as a subflow, so the Prefect UI shows every stage of every cycle.
A candidate that fails the gate ends its cycle with the reason; the champion keeps serving. A cycle
with no new logs since the champion last trained ends as `no_new_data`.
"""

from __future__ import annotations

from prefect import flow

from flows.collect import collect
from flows.promote import promote
from flows.train import train
from tasks.cycle_report import CycleReport
from tasks.flywheel import close_cycle, close_failed_training, load_cycles, open_cycle, publish_cycles, record_cycle
from tidal.flywheel_pause import ensure_running
from tidal.registry import Registry
from tidal.settings import load_settings
from tidal.store import open_store


@flow(name="flywheel", log_prints=True)
def flywheel(model: str = "tab", cycles: int = 1, include_open_hour: bool = False) -> list[CycleReport]:
    """Returns one report per cycle (tasks/cycle_report.py); each is also recorded in the
    object store (`state/flywheel/model=M/cycle-N.json`), numbered after the cycles already there."""
    settings = load_settings()
    settings.model(model)  # unknown model → clear error
    registry, store = Registry(settings.mlflow.tracking_uri), open_store(settings)
    reports, first = [], 1 + len(load_cycles(store, model))
    for n in range(first, first + cycles):
        ensure_running(store, model, f"flywheel cycle {n}")  # each stage checks too: a pause mid-cycle ends it
        dataset = collect(model, include_open_hour, driver="flywheel")
        report = open_cycle(registry, store, model, n, dataset)
        if report.decision != "no_new_data":
            trained = train(model, dataset, driver="flywheel", return_state=True)
            if trained.is_completed():
                report.candidate = trained.result()
                released = promote(model, candidate=str(report.candidate), return_state=True)
                report = (
                    close_cycle(registry, report, released.result(), store=store)
                    if released.is_completed()
                    else close_cycle(registry, report, "release_failed", released.message or "no message", store)
                )
            else:
                report = close_failed_training(registry, report, trained.message or "")
        record_cycle(store, report)
        reports.append(report)
        print(
            f"{model} cycle {n}: {report.decision}"
            + (f" v{report.candidate}" if report.candidate else "")
            + (f" ({report.reason})" if report.reason else "")
            + f"; champion v{report.champion_after}"
        )
    publish_cycles(model, reports)
    return reports
