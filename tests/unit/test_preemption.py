"""A training run preempted by SIGTERM (training/preemption.py): the iteration in progress finishes and is
checkpointed whatever checkpoint_every says, the run stops with Preempted (exit EXIT_PREEMPTED), and a run resumed
from that checkpoint ends with the weights of a run never interrupted, bit for bit. Real signals, the real trainer
on the tiny policy, the real object store and MLflow (SQLite, no server)."""

from __future__ import annotations

import signal

import pytest
import torch

from tests.unit.ppo_helpers import cfg, make_trainer, trained_uninterrupted
from tests.unit.trainer_fixtures import spec
from tidal.store import LocalStore
from training.job import Built
from training.job_spec import EXIT_PREEMPTED
from training.preemption import Preempted, StopRequest
from training.progress import Progress
from training.run_files import latest_state_key, load_state
from training.train_settings import TrainSettings


def mlflow_run(tmp_path) -> tuple[str, str]:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    return uri, client.create_run(client.create_experiment("preemption")).info.run_id


def test_a_stop_request_checkpoints_that_iteration_and_the_resumed_run_reaches_the_same_weights(champion_dir, samples, tmp_path):
    c = cfg(passes=2, max_iterations=4)
    rows = samples[:128]
    straight, plan, used = trained_uninterrupted(champion_dir, c, rows)

    uri, run_id = mlflow_run(tmp_path)
    # checkpoint_every 100: the only checkpoint before the end is the one the stop request writes
    job = spec().model_copy(update={"tracking_uri": uri, "mlflow_run_id": run_id, "train": TrainSettings(checkpoint_every=100)})
    store = LocalStore(tmp_path / "store")
    first = make_trainer(champion_dir, c)
    first.compute_reference(rows, rows=used)
    before = signal.getsignal(signal.SIGTERM)
    with StopRequest() as stop:
        progress = Progress(job, store, Built(first, megatron=False), len(plan), stop)

        def after(it: int, metrics: dict[str, float]) -> None:
            progress.after_iteration(it, metrics)
            if it == 0:
                signal.raise_signal(signal.SIGTERM)  # arrives between iterations 1 and 2: the process goes on

        with pytest.raises(Preempted) as stopped:
            first.train(rows, plan, 0, after)
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is the run's alone
    assert stopped.value.iteration == 1  # iteration 2 (index 1) finished, then the run stopped
    key = latest_state_key(store, job.prefix)
    assert key is not None and key.endswith("iter-000001.pt")

    resumed = make_trainer(champion_dir, c)  # the next attempt: a fresh model, then the checkpoint
    state = load_state(store, key)
    resumed.load_state_dict(state)
    resumed.train(rows, plan, start=state["iteration"] + 1)
    expected = dict(straight.model.named_parameters())
    for name, p in resumed.model.named_parameters():
        assert torch.equal(p, expected[name]), name


def test_a_stop_request_at_the_last_iteration_lets_the_run_finish(champion_dir, samples, tmp_path):
    c = cfg(passes=1, max_iterations=1)
    rows = samples[:32]
    uri, run_id = mlflow_run(tmp_path)
    job = spec().model_copy(update={"tracking_uri": uri, "mlflow_run_id": run_id})
    trainer = make_trainer(champion_dir, c)
    trainer.compute_reference(rows)
    with StopRequest() as stop:
        stop.requested = True
        history = trainer.train(
            rows, [list(range(32))], 0, Progress(job, LocalStore(tmp_path / "s"), Built(trainer, False), 1, stop).after_iteration
        )
    assert len(history) == 1  # nothing left to resume: the run publishes its candidate instead


def test_the_trainer_exits_with_the_preempted_code(monkeypatch, tmp_path):
    from training import job as trainer_job

    (tmp_path / "spec.json").write_text(spec().model_dump_json())

    def preempted(_spec) -> None:
        raise Preempted(3)

    monkeypatch.setattr(trainer_job, "train", preempted)
    assert trainer_job.main(["train", str(tmp_path / "spec.json")]) == EXIT_PREEMPTED == 75
