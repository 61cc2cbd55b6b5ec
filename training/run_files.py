"""A training run's files: its PPO state checkpoints in the object store, and local checkouts of the champion,
its base and the run's candidate.

    training/model=M/<run-key>/state/iter-000004.pt    every checkpoint_every iterations (training/job_spec.py)
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from tidal.registry import CheckpointCache, Registry, VersionInfo
from tidal.store import ObjectStore, download_dir
from training.job_spec import TrainJob

STATE_DIR = "state"


def save_state(store: ObjectStore, prefix: str, iteration: int, state: dict) -> str:
    """One file per checkpoint, written whole (LocalStore renames into place, an S3 put is atomic)."""
    key = f"{prefix}/{STATE_DIR}/iter-{iteration:06d}.pt"
    with tempfile.TemporaryDirectory() as tmp:
        torch.save({**state, "iteration": iteration}, Path(tmp) / "state.pt")
        store.put_file(Path(tmp) / "state.pt", key)
    return key


def latest_state_key(store: ObjectStore, prefix: str) -> str | None:
    keys = sorted(k for k in store.list(f"{prefix}/{STATE_DIR}/") if k.endswith(".pt"))
    return keys[-1] if keys else None


def load_state(store: ObjectStore, key: str) -> dict:
    """A saved state on the CPU (the trainer moves it to its model's device)."""
    with tempfile.TemporaryDirectory() as tmp:
        store.get_file(key, Path(tmp) / "state.pt")
        return torch.load(Path(tmp) / "state.pt", weights_only=True, map_location="cpu")


class Checkouts:
    """Local directories of the champion, its base, and the run's candidate."""

    def __init__(self, spec: TrainJob, store: ObjectStore, registry: Registry, cache_dir: Path):
        self.cache = CheckpointCache(store, cache_dir)
        self.champion: VersionInfo = registry.get(spec.model, spec.champion_version)
        base = (
            self.champion
            if self.champion.base_version == self.champion.version
            else registry.get(spec.model, self.champion.base_version)
        )
        self.champion_dir, self.base_dir = self.cache.local_dir(self.champion), self.cache.local_dir(base)
        self.store, self.spec, self.cache_dir = store, spec, cache_dir

    def candidate_dir(self) -> Path:
        return download_dir(self.store, f"{self.spec.prefix}/candidate", self.cache_dir / self.spec.prefix / "candidate")
