"""A training run's progress after each iteration: its metrics to MLflow, a checkpoint when due (or when a stop
was requested: training/preemption.py), a line on stdout with the time left. Rank 0 alone logs, writes and prints;
every rank joins the checkpoint's collective and stops at the same iteration."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tidal.clock import now_ms
from tidal.store import ObjectStore
from training import distributed, run_metrics
from training.job_spec import TrainJob
from training.preemption import EXIT_PREEMPTED, Preempted, StopRequest
from training.run_files import save_state

if TYPE_CHECKING:
    from training.job import Built

SHOWN = {
    "ppo/policy_loss",
    "ppo/value_loss",
    "ppo/approx_kl",
    "ppo/clipfrac",
    "ppo/is_weight_mean",
    "ppo/reward_mean",
    "ppo/ptx_loss",
    "ppo/stop_credit_loss",
    "charts/tokens_per_s",
}


class Progress:
    """After each iteration: its metrics to MLflow, a checkpoint when due, a line on stdout (rank 0 alone); on a
    stop request, a checkpoint of that iteration and Preempted (every rank)."""

    def __init__(self, spec: TrainJob, store: ObjectStore, built: Built, iterations: int, stop: StopRequest | None = None):
        from mlflow.tracking import MlflowClient

        self.spec, self.store, self.built, self.iterations, self.stop = spec, store, built, iterations, stop
        self.mlflow = MlflowClient(spec.tracking_uri) if distributed.is_main() else None
        self.mlflow_s = 0.0  # wall seconds in MLflow calls, reported with the result
        self.started: tuple[int, float] | None = None  # (first iteration this process ran, its start): the ETA's base
        url = spec.pushgateway_url if self.mlflow is not None else None  # rank 0 alone pushes
        self.pushed = run_metrics.RunProgress(url, spec.model, spec.run_key, iterations) if url else None

    def after_iteration(self, it: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        if self.started is None:  # a resumed run times only what it ran itself
            self.started = (it, time.monotonic() - metrics.get("charts/iteration_s", 0.0))
        last = it + 1 == self.iterations
        # rank 0's word on every rank: all stop after the same iteration, behind one checkpoint (a run at its last
        # iteration just finishes)
        stop = self.stop is not None and distributed.broadcast(self.stop.requested) and not last
        due = stop or last or (it + 1) % self.spec.train.checkpoint_every == 0
        saved = self.built.state() if due else None  # every rank joins (Megatron gathers), rank 0 alone writes
        if self.mlflow is None:
            if stop:
                raise Preempted(it)
            return
        now, t = now_ms(), time.perf_counter()
        self.mlflow.log_batch(self.spec.mlflow_run_id, metrics=[Metric(k, v, now, it) for k, v in metrics.items()])
        self.mlflow_s += time.perf_counter() - t
        if saved is not None:
            save_state(self.store, self.spec.prefix, it, {**saved, "final": metrics})
        elapsed, left = timing(self.started, it, self.iterations)
        if self.pushed is not None and (line := self.pushed.after_iteration(it, metrics, left)):
            print(line, flush=True)
        print(
            f"iteration {it + 1}/{self.iterations} ({eta(elapsed, left)}): "
            + ", ".join(f"{k.split('/')[1]}={v:.4g}" for k, v in metrics.items() if k in SHOWN),
            flush=True,
        )
        if stop:
            print(f"{self.spec.run_key}: stop requested; checkpointed iteration {it + 1}, exiting {EXIT_PREEMPTED}", flush=True)
            raise Preempted(it)


def timing(started: tuple[int, float], it: int, iterations: int, now: float | None = None) -> tuple[float, float]:
    """(elapsed s, s left) after iteration `it`, from the mean time of the iterations this process ran."""
    first, t0 = started
    elapsed = (time.monotonic() if now is None else now) - t0
    return elapsed, elapsed / (it + 1 - first) * max(0, iterations - it - 1)


def eta(elapsed: float, left: float) -> str:
    """'<elapsed> s, ~<left> s left', or '<elapsed> s, done' after the last iteration."""
    return f"{elapsed:.0f} s, done" if left <= 0 else f"{elapsed:.0f} s, ~{left:.0f} s left"
