"""A training run's figures for Prometheus, pushed to a Pushgateway (prometheus.pushgateway_url).

A trainer lives minutes, in a process or a pod that no Prometheus scrapes, so it pushes (the Pushgateway's use):

    trainer (rank 0), after each iteration  ─PUT─▶ {job="tidal-training", model=M}               the latest run's progress
    train task, after each trainer attempt  ─PUT─▶ {job="tidal-training", model=M, outcome=O}    when a run last ended so

A push replaces its group, so the progress group holds the model's latest run and each outcome group the last
attempt that ended that way (finished, crashed, bad_input, diverged): the alerts compare their timestamps
(infra/monitoring/rules.yml TidalTrainingFailing, TidalTrainingStalled). A failed push is reported and tried again
with the next one; training never waits more than PUSH_TIMEOUT_S on its metrics, nor fails for them.
"""

from __future__ import annotations

import time
from urllib.parse import unquote, urlsplit, urlunsplit

from prometheus_client import CollectorRegistry, Gauge, push_to_gateway
from prometheus_client.exposition import basic_auth_handler, default_handler

from training.job_spec import EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_PREEMPTED

JOB = "tidal-training"
PUSH_TIMEOUT_S = 2.0
OUTCOMES = ("finished", "crashed", "bad_input", "diverged", "preempted")

# the trainer's per-iteration figures (training/ppo_trainer.py keys) → the gauge each is pushed as
FIGURES = {
    "ppo/reward_mean": ("tidal_train_reward_mean", "Mean reward of the iteration's batch."),
    "ppo/approx_kl": ("tidal_train_approx_kl", "Approximate KL between the policy before and after the iteration."),
    "ppo/clipfrac": ("tidal_train_clip_fraction", "Share of tokens whose probability ratio was clipped."),
    "ppo/is_weight_mean": ("tidal_train_is_weight_mean", "Mean truncated importance weight (train/serve mismatch)."),
    "ppo/value_loss": ("tidal_train_value_loss", "The critic's loss."),
    "charts/iteration_s": ("tidal_train_iteration_seconds", "Wall seconds of the iteration."),
    "charts/tokens_per_s": ("tidal_train_tokens_per_second", "Tokens trained per second in the iteration."),
}


def where(url: str) -> str:
    """host:port of a URL, for messages (never its credentials or path)."""
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port}" if parts.port else str(parts.hostname)


def push(url: str, grouping: dict[str, str], registry: CollectorRegistry) -> str | None:
    """PUT the registry's gauges as the group (with basic auth when the URL carries user:password@); the error as one
    line when it failed, else None."""
    parts, handler = urlsplit(url), default_handler
    if parts.username is not None:
        user, password = unquote(parts.username), unquote(parts.password or "")
        url = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))

        def handler(url, method, timeout, headers, data):  # noqa: ANN001, ANN202  prometheus_client's handler signature
            return basic_auth_handler(url, method, timeout, headers, data, user, password)

    try:
        push_to_gateway(url, job=JOB, registry=registry, grouping_key=grouping, timeout=PUSH_TIMEOUT_S, handler=handler)
    except Exception as e:  # noqa: BLE001  URLError, a refused connection, an HTTP error: reported by the caller
        return f"metrics not pushed to the Pushgateway at {where(url)} ({type(e).__name__}: {str(e)[:120]})"
    return None


class RunProgress:
    """The trainer's pushes: after each iteration, how far the run is and the iteration's figures."""

    def __init__(self, url: str, model: str, run: str, iterations: int):
        self.url, self.model, self.run, self.iterations = url, model, run, iterations
        self.failing: str | None = None  # the last failure, reported once until a push succeeds again

    def registry(self, it: int, metrics: dict[str, float], seconds_left: float, now: float) -> CollectorRegistry:
        reg, labels = CollectorRegistry(), ("run",)

        def gauge(name: str, doc: str, value: float) -> None:
            Gauge(name, doc, labels, registry=reg).labels(self.run).set(value)

        gauge("tidal_train_iteration", "Iterations of the run done (resumed ones included).", it + 1)
        gauge("tidal_train_iterations", "Iterations the run plans.", self.iterations)
        gauge("tidal_train_seconds_left", "Estimated seconds to the run's last iteration.", seconds_left)
        gauge("tidal_train_last_iteration_timestamp_seconds", "When the last iteration ended (unix s).", now)
        for key, (name, doc) in FIGURES.items():
            if key in metrics:
                gauge(name, doc, metrics[key])
        return reg

    def after_iteration(self, it: int, metrics: dict[str, float], seconds_left: float) -> str | None:
        """Push; returns a line to print when pushing starts failing or recovers, else None."""
        error = push(self.url, {"model": self.model}, self.registry(it, metrics, seconds_left, time.time()))
        if error is None:
            line = f"metrics: pushing to {where(self.url)} again" if self.failing else None
        else:
            line = None if self.failing else f"{error}; training goes on, the next iteration tries again"
        self.failing = error
        return line


def outcome_of(exit_code: int) -> str:
    """A trainer attempt's outcome from its exit code (training/job.py's EXIT_* contract)."""
    return {0: "finished", EXIT_BAD_INPUT: "bad_input", EXIT_DIVERGED: "diverged", EXIT_PREEMPTED: "preempted"}.get(
        exit_code, "crashed"
    )


def push_outcome(url: str, model: str, run: str, outcome: str, seconds: float, now: float | None = None) -> str | None:
    """The train task's push after a trainer attempt: when it ended, how long it ran. The error line, else None."""
    if outcome not in OUTCOMES:
        raise ValueError(f"unknown training outcome {outcome!r}: expected one of {', '.join(OUTCOMES)}")
    reg = CollectorRegistry()
    ended = Gauge(
        "tidal_train_run_end_timestamp_seconds", "When the model's last attempt with this outcome ended.", ["run"], registry=reg
    )
    took = Gauge("tidal_train_attempt_seconds", "Wall seconds of that attempt.", ["run"], registry=reg)
    ended.labels(run).set(time.time() if now is None else now)
    took.labels(run).set(seconds)
    return push(url, {"model": model, "outcome": outcome}, reg)
