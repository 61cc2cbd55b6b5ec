"""Probe data: what the trainer's own forward pass says each model version should serve.

For a few fixed prompts the trainer decodes greedily and records every
completion token with its log-probability. The serving side replays the same
prompts (greedy, ignoring eos) and compares, which catches a server that
loaded the wrong or corrupted weights.
"""

from __future__ import annotations

import random

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from data_contracts.probe import PROBE_FILE, ProbeItem, ProbeSet, load_probe, save_probe


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


__all__ = ["PROBE_FILE", "ProbeItem", "ProbeSet", "compute_probe", "load_probe", "probe_prompts", "save_probe"]
