"""Trainer launchers: one interface (base.TrainerLauncher), one module per place the trainer runs.

    local        a subprocess of the flow, on this machine (local.py)
    kubernetes   a batch/v1 Job, one pod, on the cluster's training nodes (kubernetes.py, k8s_manifest.py)

The train flow calls whichever `trainer.launcher` names, through the same code path (tasks/train.py::_job).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from training.launch.base import EXIT_NOT_RUN, STORE_REF, LaunchError, StopSignal, TrainerLauncher, spec_key

if TYPE_CHECKING:
    from tidal.store import ObjectStore
    from training.train_settings import LaunchSettings


def launcher_for(cfg: LaunchSettings, store: ObjectStore) -> TrainerLauncher:
    """The launcher `cfg.launcher` names (the Kubernetes client is imported only when it is the one)."""
    if cfg.launcher == "local":
        from training.launch.local import LocalLauncher

        return LocalLauncher(cfg.local_processes)
    if cfg.launcher == "kubernetes":
        from training.launch.kubernetes import KubernetesLauncher

        return KubernetesLauncher(cfg.kubernetes, store)
    raise LaunchError(f"unknown trainer.launcher {cfg.launcher!r}; expected 'local' or 'kubernetes'")


__all__ = ["EXIT_NOT_RUN", "STORE_REF", "LaunchError", "StopSignal", "TrainerLauncher", "launcher_for", "spec_key"]
