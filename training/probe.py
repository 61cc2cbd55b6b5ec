"""Probe data: what the trainer's own forward pass says each model version should serve.

For a few fixed prompts the trainer decodes greedily and records every
completion token with its log-probability. The serving side replays the same
prompts (greedy, ignoring eos) and compares, which catches a server that
loaded the wrong or corrupted weights.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import torch
from pydantic import BaseModel, Field, field_validator
from transformers import PreTrainedModel, PreTrainedTokenizerBase

PROBE_FILE = "probe.json"


class ProbeItem(BaseModel):
    """One prompt and the model's greedy continuation of it."""

    prompt_token_ids: list[int] = Field(description="The prompt, encoded without special tokens.")
    completion_token_ids: list[int] = Field(description="Greedy next tokens, eos not treated as a stop.")
    logprobs: list[float] = Field(
        description="float32 log_softmax of the raw logits at each completion token."
    )

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


def probe_prompts(texts: list[str], n: int = 4, prompt_chars: int = 200, seed: int = 0) -> list[str]:
    """``n`` distinct snippets of at most ``prompt_chars`` characters cut from ``texts``.

    Each starts at the beginning of a line and stops in the middle of one, right
    after a non-space character, so the model has a line to finish. The same
    texts and seed always give the same snippets.
    """
    rng = random.Random(seed)
    pool = [t for t in texts if len(t) >= 2]
    if not pool:
        raise ValueError("no text to cut probe prompts from")
    prompts: list[str] = []
    for _ in range(1000 * n):
        if len(prompts) == n:
            break
        text = pool[rng.randrange(len(pool))]
        end = rng.randrange(1, len(text))
        # Mid-line: a non-space character before the cut, more of the same line after it.
        if text[end - 1].isspace() or text[end] == "\n":
            continue
        start = max(0, end - prompt_chars)
        if start > 0 and text[start - 1] != "\n":
            newline = text.find("\n", start, end)
            # Begin on the next full line; a line longer than the window is cut as is.
            start = newline + 1 if newline != -1 else start
        prompt = text[start:end]
        if prompt.strip() and prompt not in prompts:
            prompts.append(prompt)
    if len(prompts) < n:
        raise ValueError(f"could only cut {len(prompts)} of {n} distinct probe prompts")
    return prompts


@torch.no_grad()
def compute_probe(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    max_new_tokens: int = 8,
    version_note: str = "",
) -> ProbeSet:
    """Greedy-decode ``max_new_tokens`` after each prompt and record the log-probs.

    A plain loop that re-runs the whole sequence every step: no KV cache, no
    ``generate`` (whose stopping and processing rules could differ from the
    server's), and eos is just another token.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    items: list[ProbeItem] = []
    for prompt in prompts:
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        ids = list(prompt_ids)
        completion: list[int] = []
        logprobs: list[float] = []
        for _ in range(max_new_tokens):
            x = torch.tensor([ids], device=device)  # (1, T)
            logits = model(input_ids=x).logits[0, -1].float()  # (vocab,)
            logp = torch.log_softmax(logits, dim=-1)
            token = int(torch.argmax(logp))
            completion.append(token)
            logprobs.append(float(logp[token]))
            ids.append(token)
        items.append(ProbeItem(prompt_token_ids=prompt_ids, completion_token_ids=completion, logprobs=logprobs))
    model.train(was_training)
    return ProbeSet(version_note=version_note, max_new_tokens=max_new_tokens, items=items)


def save_probe(probe: ProbeSet, directory: str | Path) -> Path:
    """Write ``probe.json`` into ``directory``; returns its path."""
    path = Path(directory) / PROBE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(probe.model_dump_json(indent=1))
    return path


def load_probe(directory: str | Path) -> ProbeSet:
    """Read ``probe.json`` from ``directory``."""
    return ProbeSet.model_validate_json((Path(directory) / PROBE_FILE).read_text())
