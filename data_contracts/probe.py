"""The probe file (`probe.json` beside every checkpoint): what the trainer's own forward pass says a model
version should serve. The trainer writes it (training/probe.py computes it); the fleet replays its prompts on
every replica and compares (serving/probe.py). A leaf: pydantic only, so serving reads it without torch."""

from __future__ import annotations

import math
from pathlib import Path

from pydantic import BaseModel, Field, field_validator

PROBE_FILE = "probe.json"


class ProbeItem(BaseModel):
    """One prompt and the model's greedy continuation of it."""

    prompt_token_ids: list[int] = Field(description="The prompt, encoded without special tokens.")
    completion_token_ids: list[int] = Field(description="Greedy next tokens, eos not treated as a stop.")
    logprobs: list[float] = Field(description="float32 log_softmax of the raw logits at each completion token.")

    @field_validator("logprobs", mode="before")
    @classmethod
    def _finite(cls, v):
        # JSON stores NaN as null: either way, the weights that computed this probe are broken.
        if isinstance(v, list) and any(x is None or (isinstance(x, float) and not math.isfinite(x)) for x in v):
            raise ValueError("non-finite log-probs: the weights that computed this probe hold NaN/inf")
        return v


class ProbeSet(BaseModel):
    """The probe for one model version."""

    version_note: str = Field("", description="Free text naming the version the probe was computed for.")
    max_new_tokens: int = Field(description="Completion length of every item.")
    items: list[ProbeItem] = Field(description="One entry per probe prompt.")


def save_probe(probe: ProbeSet, directory: str | Path) -> Path:
    """Write ``probe.json`` into ``directory``; returns its path."""
    path = Path(directory) / PROBE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(probe.model_dump_json(indent=1))
    return path


def load_probe(directory: str | Path) -> ProbeSet:
    """Read ``probe.json`` from ``directory``."""
    return ProbeSet.model_validate_json((Path(directory) / PROBE_FILE).read_text())
