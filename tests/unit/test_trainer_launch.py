"""Trainer launchers run locally: the local launcher running a real trainer process through the same code path as
the train flow, torchrun, and the launch settings' checks. The Kubernetes launcher: tests/unit/test_trainer_kubernetes.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.unit.terraform_hcl import ROOT
from tests.unit.trainer_fixtures import IMAGE, STOPS, STUCK, StandIn, clean_env, spec  # noqa: F401  (clean_env: autouse fixture)
from tidal.section import SettingsError
from tidal.settings import load_settings
from tidal.store import LocalStore
from training.job_spec import EXIT_BAD_INPUT, EXIT_PREEMPTED, TrainJob
from training.launch import STORE_REF, StopSignal, spec_key
from training.train_settings import LaunchSettings

# ---- the local launcher: a real trainer process, through the flow's code path ---------------------


def test_local_launcher_runs_the_trainer_and_maps_its_exit_code(tmp_path):
    from tasks.train import TrainerRejected, TrainPlan, _job

    spec_path, log_path = tmp_path / "spec.json", tmp_path / "logs" / "train-tab.log"
    spec_path.write_text('{"model": "tab"}')  # not a TrainJob: the trainer refuses it at once
    plan = TrainPlan(spec(), None, {}, spec_path, log_path, LaunchSettings())
    with pytest.raises(TrainerRejected, match=f"exit {EXIT_BAD_INPUT}"):
        _job(plan, "train", LocalStore(tmp_path / "store"))
    log = log_path.read_text()
    assert log.startswith(f"--- train {plan.spec.run_key}\n") and "is not a valid TrainJob" in log


@pytest.mark.parametrize(("script", "code", "line"), [(STOPS, EXIT_PREEMPTED, "exiting 75"), (STUCK, -9, "killed")])
def test_a_stop_request_sigterms_the_local_trainer_and_kills_it_after_the_grace_period(tmp_path, script, code, line):
    from tasks.train import TrainerPreempted, TrainPlan, _job

    plan = TrainPlan(spec(), None, {}, tmp_path / "spec.json", tmp_path / "train.log", LaunchSettings())

    def revoked_once_running() -> StopSignal:  # the run's lease, revoked once the trainer runs
        stop, ready = StopSignal(threading.Event(), grace_s=1.0), tmp_path / "ready"
        ready.unlink(missing_ok=True)

        def revoke() -> None:
            while not ready.exists():
                time.sleep(0.02)
            stop.event.set()

        threading.Thread(target=revoke, daemon=True).start()
        return stop

    assert StandIn(script).run("train", plan.spec, plan.spec_path, plan.log_path, revoked_once_running()) == code
    log = plan.log_path.read_text()
    assert "stop requested: SIGTERM to the trainer" in log and line in log
    with pytest.raises(TrainerPreempted, match=f"exit {code}"):  # through the flow's code path: not a crash
        _job(plan, "train", LocalStore(tmp_path / "store"), revoked_once_running(), launcher=StandIn(script))


def test_the_trainer_reads_its_spec_from_a_path_or_the_store(tmp_path):
    from training.job import SpecError, read_spec

    s = spec()
    (tmp_path / "spec.json").write_text(s.model_dump_json())
    assert read_spec(str(tmp_path / "spec.json")) == s
    LocalStore(tmp_path / ".tidal" / "store").put_file(tmp_path / "spec.json", spec_key(s))  # the default store
    assert read_spec(STORE_REF + spec_key(s)) == s
    with pytest.raises(SpecError, match="no spec 'training/model=tab/other.json' in the object store"):
        read_spec(STORE_REF + "training/model=tab/other.json")
    with pytest.raises(SpecError, match="not found"):
        read_spec(str(tmp_path / "missing.json"))


TORCHRUN_ENV = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"}


def test_a_half_set_torchrun_environment_is_refused(monkeypatch, tmp_path, capsys):
    from training.job import main

    monkeypatch.setenv("WORLD_SIZE", "2")  # without torchrun's other variables no process group can form
    assert main(["train", str(tmp_path / "spec.json")]) == EXIT_BAD_INPUT
    assert "RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT not set" in capsys.readouterr().err


def test_the_gate_runs_in_rank_0_alone(monkeypatch, tmp_path):
    from training.job import main

    for k, v in TORCHRUN_ENV.items():
        monkeypatch.setenv(k, v)
    assert main(["gate", str(tmp_path / "missing.json")]) == 0  # rank 1: done at once, no group, no spec read


def torchrun(tmp_path: Path, command: str, s: TrainJob) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node 2 -m training.job <command>` on a spec, with this directory's default settings."""
    (tmp_path / "spec.json").write_text(s.model_dump_json())
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_") and k not in TORCHRUN_ENV}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "training.job",
            command,
            str(tmp_path / "spec.json"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_torchrun_starts_the_trainer_as_two_processes_that_agree(tmp_path):
    """Without servers: a finished run (result.json present) and a missing dataset, the two ends of train() that
    need none. Each rank joins the gloo group; rank 0 alone prints progress, each rank its own error."""
    s = spec()
    LocalStore(tmp_path / ".tidal" / "store").put_file(_json(tmp_path, {"iterations": 1}), f"{s.prefix}/result.json")
    done = torchrun(tmp_path, "train", s)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("already finished; nothing to do") == 1

    other = s.model_copy(update={"run_key": "run-fedcba9876543210"})  # no result.json, no dataset: bad input
    bad = torchrun(tmp_path, "train", other)
    assert bad.returncode != 0  # torchrun's own code for a failed worker (1), not the worker's EXIT_BAD_INPUT
    assert bad.stderr.count("error: dataset ds-1 of tab not found") == 1  # rank 0's
    assert bad.stderr.count("error: rank 1: dataset ds-1 of tab not found") == 1
    assert "exitcode  : 2" in bad.stderr  # every rank exited with the documented code


def _json(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "obj.json"
    path.write_text(json.dumps(data))
    return path


# ---- settings -------------------------------------------------------------------------------------


def test_kubernetes_launcher_settings_are_checked_at_start_up():
    with pytest.raises(SettingsError) as e:
        load_settings(trainer={"launcher": "kubernetes", "kubernetes": {"image": "tidal:latest", "gpus_per_node": 2}})
    msg = str(e.value)
    assert "not latest" in msg and "s3://bucket/prefix" in msg and "host '127.0.0.1' (mlflow.url or mlflow.host)" in msg
    assert "gpus_per_node" not in msg  # several GPUs: torchrun, one data-parallel process per GPU
    with pytest.raises(SettingsError, match="set trainer.kubernetes.image"):
        load_settings(trainer={"launcher": "kubernetes"}, store={"url": "s3://b/t"}, mlflow={"host": "tidal-mlflow"})
    with pytest.raises(SettingsError, match=r"training \(local disk\)"):  # one area routed back to local disk
        load_settings(
            trainer={"launcher": "kubernetes", "kubernetes": {"image": IMAGE}},
            store={"url": "s3://b/t", "routes": {"training": ""}},
            mlflow={"host": "tidal-mlflow"},
        )
    with pytest.raises(SettingsError, match="memory_request 8Gi > memory_limit 4Gi"):
        load_settings(trainer={"kubernetes": {"memory_request": "8Gi", "memory_limit": "4Gi"}})
    ok = load_settings(
        trainer={"launcher": "kubernetes", "kubernetes": {"image": IMAGE + "@sha256:" + "a" * 64}},
        store={"url": "s3://b/t"},
        mlflow={"host": "tidal-mlflow.tidal.svc.cluster.local", "port": 80},
    )
    assert ok.trainer.launcher == "kubernetes"
    assert load_settings().trainer.launcher == "local"  # today's behaviour by default


def test_where_the_trainer_runs_changes_neither_run_key_nor_spec():
    from tasks.train import trainer_threads

    s = load_settings(
        trainer={"launcher": "kubernetes", "kubernetes": {"image": IMAGE, "cpu_limit": 6}},
        store={"url": "s3://b/t"},
        mlflow={"host": "tidal-mlflow"},
    )
    assert s.train == load_settings().train and "launcher" not in s.train.model_dump()
    assert trainer_threads(s) == 6  # the pod's CPU limit, not the flow machine's cores


@pytest.mark.parametrize(
    ("strategy", "lora", "fix"),
    [("lora", False, "serve the model with 'restart'"), ("restart", True, "train every weight \\(lora=false\\)")],
)
def test_a_run_whose_candidate_the_models_strategy_cannot_serve_is_refused_before_training(strategy, lora, fix):
    from tasks.train import plan_run
    from tidal.section import SettingsError

    s = load_settings(models=[{"name": "tab", "update_strategy": strategy}], train={"ppo": {"lora": lora}})
    with pytest.raises(SettingsError, match=f"model 'tab' \\(update_strategy '{strategy}'\\) with train.ppo.lora=.*{fix}"):
        plan_run.fn(s, None, "tab", None, {})  # refused before it reads the store or the registry


def test_local_processes_run_the_trainer_under_torchrun_and_must_fill_tensor_parallel_groups(tmp_path):
    from training.launch import launcher_for
    from training.train_settings import LaunchSettings

    one = launcher_for(LaunchSettings(), None).command("train", tmp_path / "spec.json")
    assert one[1:] == ["-m", "training.job", "train", str(tmp_path / "spec.json")]
    two = launcher_for(LaunchSettings(local_processes=2), None).command("train", tmp_path / "spec.json")
    assert two[1:4] == ["-m", "torch.distributed.run", "--standalone"] and two[two.index("--nproc-per-node") + 1] == "2"
    assert two[-4:] == ["-m", "training.job", "train", str(tmp_path / "spec.json")]
    megatron = {"ppo": {"backend": "megatron", "lora": False, "tensor_parallel": 2}}
    with pytest.raises(
        SettingsError,
        match="tensor_parallel=2 needs a multiple of 2 trainer processes, but "
        "trainer.local_processes=1: set trainer.local_processes to 2",
    ):
        load_settings(train=megatron)
    assert load_settings(train=megatron, trainer={"local_processes": 4}).trainer.local_processes == 4
    with pytest.raises(SettingsError, match="trainer.kubernetes.gpus_per_node=1"):
        load_settings(
            train=megatron,
            trainer={"kubernetes": {"gpus_per_node": 1, "image": IMAGE}, "launcher": "kubernetes"},
            store={"url": "s3://b/t"},
            mlflow={"host": "tidal-mlflow"},
        )
