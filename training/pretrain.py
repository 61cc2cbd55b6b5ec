"""Pretraining the policy on the corpus, and held-out bits per byte.

nanoGPT-style: the training texts become one long token stream (documents
separated by eos) from which random windows are drawn; AdamW with linear warmup
and cosine decay; training stops at ``max_steps`` or ``max_seconds``, whichever
comes first.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from pydantic import BaseModel, Field
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from training.pretrain_config import PretrainConfig


class PretrainResult(BaseModel):
    """What a pretraining run did and how good the model got."""

    steps: int = Field(description="Optimizer steps taken.")
    tokens_seen: int = Field(description="Training tokens consumed (steps * batch_size * seq_len).")
    seconds: float = Field(description="Wall-clock seconds spent in training steps.")
    tokens_per_s: float = Field(description="Training throughput.")
    train_loss: float = Field(description="Smoothed (EMA) training loss at the end, nats/token.")
    heldout_bits_per_byte: float = Field(description="Held-out loss in bits per UTF-8 byte.")
    heldout_bytes: int = Field(description="Held-out bytes the bits/byte figure covers.")


def token_stream(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str]) -> torch.Tensor:
    """All texts as one 1-D LongTensor, each followed by eos: [t1..., eos, t2..., eos, ...]."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for doc in tokenizer(list(texts), add_special_tokens=False)["input_ids"]:
        ids.extend(doc)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def sample_batch(data: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: inputs and next-token targets, both (batch_size, seq_len)."""
    starts = torch.randint(0, len(data) - seq_len, (batch_size,), generator=gen)
    x = torch.stack([data[s : s + seq_len] for s in starts.tolist()])
    y = torch.stack([data[s + 1 : s + 1 + seq_len] for s in starts.tolist()])
    return x, y


def lr_at(step: int, horizon: int, cfg: PretrainConfig) -> float:
    """Linear warmup to the peak, then cosine decay to min_lr_ratio * peak at ``horizon``."""
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, horizon - cfg.warmup_steps))
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.learning_rate * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


# Logit scales tried by fitted_bits_per_byte: 2^(k/8) for k in -8..16, i.e. 0.5 to 4 (temperatures 2 to 0.25).
FIT_SCALES = tuple(2 ** (k / 8) for k in range(-8, 17))


class FittedBpb(NamedTuple):
    bpb: float  # bits/byte at the best scale
    n_bytes: int  # bytes covered
    scale: float  # the best of FIT_SCALES
    at_scale_1: float  # plain bits_per_byte, from the same pass


def fitted_bits_per_byte(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    max_bytes: int,
    seq_len: int,
    given_not: Sequence[int] = (),
) -> FittedBpb:
    """bits_per_byte at the model's best temperature: the least bits/byte over its logits multiplied by each of
    FIT_SCALES (one forward pass; the scales only re-weigh the same logits). A model that is only sharper or
    flatter than another, the same code model at another temperature, scores as that one does; a model that
    predicts the code worse scores worse at every scale."""
    per_scale, n_bytes = _bits_by_scale(model, tokenizer, texts, max_bytes, seq_len, given_not, FIT_SCALES)
    best = min(range(len(FIT_SCALES)), key=per_scale.__getitem__)
    return FittedBpb(per_scale[best], n_bytes, FIT_SCALES[best], per_scale[FIT_SCALES.index(1.0)])


def bits_per_byte(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    max_bytes: int,
    seq_len: int,
    given_not: Sequence[int] = (),
) -> tuple[float, int]:
    """Held-out loss in bits per UTF-8 byte over (the first ``max_bytes`` of) ``texts``.

    The texts form one eos-separated stream that starts with eos, cut into
    windows of seq_len predictions. Every text token is predicted once, from
    the previous tokens in its window; the eos separators are context but are
    not scored, since they stand for no bytes. Returns (bits/byte, bytes covered).

    ``given_not`` (token ids, e.g. every token holding a line break): score the
    model *given* that the next token is none of them: those ids are masked out
    of every prediction (log-softmax over the rest), and the positions whose
    target is one of them are not scored (their bytes still count). Moving
    probability between those ids and the rest leaves the figure unchanged; a
    worse prediction of the code itself does not.
    """
    (bpb,), n_bytes = _bits_by_scale(model, tokenizer, texts, max_bytes, seq_len, given_not, (1.0,))
    return bpb, n_bytes


@torch.no_grad()
def _bits_by_scale(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    max_bytes: int,
    seq_len: int,
    given_not: Sequence[int],
    scales: Sequence[float],
) -> tuple[list[float], int]:
    """bits/byte (see bits_per_byte) with the logits multiplied by each of `scales`, from one pass."""
    docs: list[str] = []
    remaining = max_bytes
    for text in texts:
        if remaining <= 0:
            break
        # Cut on a byte budget without splitting a character.
        doc = text.encode("utf-8")[:remaining].decode("utf-8", errors="ignore")
        if doc:
            docs.append(doc)
            remaining -= len(doc.encode("utf-8"))
    n_bytes = max_bytes - remaining
    if not docs:
        raise ValueError("no held-out text to score")

    stream = torch.cat([torch.tensor([tokenizer.eos_token_id]), token_stream(tokenizer, docs)])
    scored = torch.ones_like(stream, dtype=torch.bool)
    # Positions of the eos appended after each document (the stream's own eos ids
    # could also come from text that spells out the special token, so count, not compare).
    ends = torch.tensor([len(d) for d in tokenizer(docs, add_special_tokens=False)["input_ids"]])
    scored[torch.cumsum(ends + 1, 0)] = False

    was_training = model.training
    model.eval()
    device = _device(model)
    total_nats = torch.zeros(len(scales), dtype=torch.float64)
    excluded = torch.tensor(sorted(set(given_not)), dtype=torch.long, device=device)
    # Window i predicts targets stream[i*seq_len+1 : (i+1)*seq_len+1] from the tokens before them.
    for start in range(0, len(stream) - 1, seq_len):
        x = stream[start : start + seq_len].unsqueeze(0).to(device)  # (1, T)
        y = stream[start + 1 : start + 1 + seq_len].to(device)  # (T',), T' <= T at the tail
        keep = scored[start + 1 : start + 1 + seq_len].to(device)
        logits = model(input_ids=x).logits[0, : len(y)].float()  # (T', vocab)
        if len(given_not):
            logits[:, excluded] = -math.inf
            keep = keep & ~torch.isin(y, excluded)
        for i, scale in enumerate(scales):
            nll = F.cross_entropy(logits * scale if scale != 1.0 else logits, y, reduction="none")
            total_nats[i] += nll[keep].sum().item()
    model.train(was_training)
    return (total_nats / math.log(2) / n_bytes).tolist(), n_bytes


def pretrain(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    train_texts: Sequence[str],
    heldout_texts: Sequence[str],
    cfg: PretrainConfig,
    progress: bool = True,
) -> PretrainResult:
    """Train ``model`` in place on ``train_texts``; score it on ``heldout_texts``.

    The cosine schedule decays over ``max_steps``, or, while the time budget is
    the tighter limit, over the number of steps that fit in ``max_seconds`` at
    the average step time measured so far (re-estimated every step). Batches
    are fixed by ``cfg.seed``; with a time budget binding, how many are taken
    depends on machine speed.
    """
    if cfg.torch_threads is not None:
        torch.set_num_threads(cfg.torch_threads)
    device = _device(model)
    data = token_stream(tokenizer, train_texts)
    if len(data) <= cfg.seq_len:
        raise ValueError(f"training stream has {len(data)} tokens, need more than seq_len={cfg.seq_len}")
    gen = torch.Generator().manual_seed(cfg.seed)

    # Decay matrices (embeddings, projections) but not norms or biases, as in nanoGPT.
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(0.9, 0.95))
    use_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()

    model.train()
    step, ema, horizon = 0, 0.0, cfg.max_steps
    bar = tqdm(total=cfg.max_steps, disable=not progress, desc="pretrain", dynamic_ncols=True)
    t0 = time.perf_counter()
    elapsed = 0.0
    while step < cfg.max_steps and elapsed < cfg.max_seconds:
        lr = lr_at(step, horizon, cfg)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = sample_batch(data, cfg.batch_size, cfg.seq_len, gen)
        x, y = x.to(device), y.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
            logits = model(input_ids=x).logits  # (B, T, vocab)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()

        step += 1
        elapsed = time.perf_counter() - t0
        # Bias-corrected EMA, so early values are not pulled towards 0.
        ema = 0.9 * ema + 0.1 * loss.item()
        smooth = ema / (1 - 0.9**step)
        # Steps that fit in the budget at the mean speed so far (never fewer than taken).
        horizon = min(cfg.max_steps, max(step, int(cfg.max_seconds * step / elapsed)))
        tok_s = step * cfg.batch_size * cfg.seq_len / elapsed
        bar.update(1)
        bar.set_postfix(loss=f"{smooth:.3f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}", refresh=False)
    bar.close()
    model.eval()

    tokens = step * cfg.batch_size * cfg.seq_len
    bpb, n_bytes = bits_per_byte(model, tokenizer, heldout_texts, cfg.eval_bytes, cfg.seq_len)
    return PretrainResult(
        steps=step,
        tokens_seen=tokens,
        seconds=elapsed,
        tokens_per_s=tokens / elapsed if elapsed > 0 else 0.0,
        train_loss=ema / (1 - 0.9**step) if step else float("nan"),
        heldout_bits_per_byte=bpb,
        heldout_bytes=n_bytes,
    )
