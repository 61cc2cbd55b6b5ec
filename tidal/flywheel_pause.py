"""Pausing a model's flywheel: the record every stage checks before it acts.

    tidal pause tab   →  state/pause/model=tab/<at_ms>-<uid>.json  {paused: true, by, reason, at_ms}
    tidal resume tab  →  a later record with paused: false

The records are kept (an audit of who paused what, when and why); the latest one is in force. The store is the
truth because every stage can read it wherever it runs (a laptop, a work pool's pod): collect, train and promote
refuse to start while their model is paused, and a canary in progress rolls back at its next look, so traffic
returns to the control arm. Pausing the Prefect deployments as well stops their schedules and triggers in the UI.
"""

from __future__ import annotations

import datetime as dt
import uuid

from pydantic import BaseModel, Field

from tidal.clock import now_ms
from tidal.store import ObjectStore, get_json, put_json


class PauseRecord(BaseModel):
    """One pause or resume of a model's flywheel, as stored."""

    model: str
    paused: bool = Field(description="True: the stages refuse to run and a running canary rolls back.")
    by: str = Field(min_length=1, description="Who paused or resumed it.")
    reason: str = Field(default="", description="Why (shown by `tidal status` and in every refusal).")
    at_ms: int = Field(description="When, Unix ms.")

    def describe(self) -> str:
        verb = "paused" if self.paused else "resumed"
        when = dt.datetime.fromtimestamp(self.at_ms / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        return f"{self.model} {verb} by {self.by} at {when}" + (f": {self.reason}" if self.reason else "")


class FlywheelPaused(RuntimeError):
    """A stage was asked to run for a model whose flywheel is paused."""


def pause_prefix(model: str) -> str:
    return f"state/pause/model={model}/"


def record_pause(store: ObjectStore, model: str, paused: bool, by: str, reason: str = "") -> PauseRecord:
    """Append a pause (paused=True) or resume record; returns it. Keys sort by time: zero-padded ms first."""
    rec = PauseRecord(model=model, paused=paused, by=by, reason=reason, at_ms=now_ms())
    put_json(store, f"{pause_prefix(model)}{rec.at_ms:015d}-{uuid.uuid4().hex[:8]}.json", rec.model_dump(mode="json"))
    return rec


def latest_pause(store: ObjectStore, model: str) -> PauseRecord | None:
    """The record in force (None: the model was never paused)."""
    keys = sorted(k for k in store.list(pause_prefix(model)) if k.endswith(".json"))
    return PauseRecord.model_validate(get_json(store, keys[-1])) if keys else None


def paused(store: ObjectStore, model: str) -> PauseRecord | None:
    """The pause in force, or None while the model's flywheel runs."""
    rec = latest_pause(store, model)
    return rec if rec is not None and rec.paused else None


def ensure_running(store: ObjectStore, model: str, stage: str) -> None:
    """Raise FlywheelPaused, naming who paused it, why and the fix, when `model` is paused."""
    rec = paused(store, model)
    if rec is not None:
        raise FlywheelPaused(f"{stage} refused: {rec.describe()}; `tidal resume {model}` lets the flywheel run again")
