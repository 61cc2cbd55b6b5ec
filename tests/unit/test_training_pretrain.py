"""Pretraining loop, learning-rate schedule and bits per byte."""

from __future__ import annotations

import math

import pytest
import torch

from data_contracts.corpus import read_texts, stdlib_root
from training.policy import PolicyConfig, build_policy
from training.pretrain import (
    PretrainConfig,
    bits_per_byte,
    lr_at,
    pretrain,
    sample_batch,
    token_stream,
)
from training.tokenizer import train_tokenizer

TINY = PolicyConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, max_position_embeddings=128)
TRAIN = [
    "heapq.py",
    "bisect.py",
    "abc.py",
    "colorsys.py",
    "fnmatch.py",
    "glob.py",
    "keyword.py",
    "linecache.py",
    "numbers.py",
    "queue.py",
    "sched.py",
    "shlex.py",
    "string.py",
    "textwrap.py",
]
HELDOUT = ["copy.py", "reprlib.py"]


@pytest.fixture(scope="module")
def corpus() -> tuple[list[str], list[str]]:
    root = stdlib_root()
    return read_texts([root / n for n in TRAIN]), read_texts([root / n for n in HELDOUT])


@pytest.fixture(scope="module")
def tok(corpus):
    return train_tokenizer(corpus[0], vocab_size=300)


def quick_cfg(**kw) -> PretrainConfig:
    base = dict(
        seq_len=64, batch_size=8, learning_rate=1e-2, warmup_steps=5, max_steps=60, max_seconds=60.0, eval_bytes=6000, seed=0
    )
    return PretrainConfig(**{**base, **kw})


def test_lr_schedule_warmup_then_cosine_to_floor() -> None:
    cfg = PretrainConfig(learning_rate=1.0, min_lr_ratio=0.1, warmup_steps=10)
    assert lr_at(0, 100, cfg) == pytest.approx(0.1)
    assert lr_at(9, 100, cfg) == pytest.approx(1.0)
    assert lr_at(10, 100, cfg) == pytest.approx(1.0)
    assert lr_at(55, 100, cfg) == pytest.approx(0.55)  # halfway down the cosine
    assert lr_at(100, 100, cfg) == pytest.approx(0.1)
    assert lr_at(500, 100, cfg) == pytest.approx(0.1)
    lrs = [lr_at(s, 100, cfg) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_token_stream_and_windows(tok) -> None:
    data = token_stream(tok, ["ab", "cd"])
    assert data.dtype == torch.long and data.dim() == 1
    assert data.tolist() == tok.encode("ab") + [0] + tok.encode("cd") + [0]
    data = torch.arange(100)
    x, y = sample_batch(data, 4, 10, torch.Generator().manual_seed(1))
    assert x.shape == y.shape == (4, 10)
    assert torch.equal(y, x + 1)  # targets are the next tokens
    x2, _ = sample_batch(data, 4, 10, torch.Generator().manual_seed(1))
    assert torch.equal(x, x2)


def test_bits_per_byte_of_a_uniform_model_by_hand(tok, corpus) -> None:
    model = build_policy(TINY.model_copy(update={"tie_word_embeddings": False}), tok, seed=0)
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every logit 0: each token costs ln(vocab) nats
    texts = corpus[1]
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    n_tokens = sum(len(tok.encode(t)) for t in texts)
    bpb, covered = bits_per_byte(model, tok, texts, max_bytes=10**9, seq_len=64)
    assert covered == n_bytes
    assert bpb == pytest.approx(math.log2(len(tok)) * n_tokens / n_bytes, rel=1e-5)


def test_bits_per_byte_budget_cuts_on_character_boundaries(tok) -> None:
    model = build_policy(TINY, tok, seed=0)
    texts = ["aé" * 10, "zzz"]  # 3 bytes per "aé"
    bpb, covered = bits_per_byte(model, tok, texts[:1], max_bytes=8, seq_len=16)
    assert covered == 7  # "aéaéa" + "é" would be 9 bytes; the half "é" is dropped
    assert 0 < bpb < 20
    _, covered = bits_per_byte(model, tok, texts, max_bytes=8, seq_len=16)
    assert covered == 8  # the next text fills the last byte: "z"
    _, covered_all = bits_per_byte(model, tok, texts, max_bytes=1000, seq_len=16)
    assert covered_all == 33


def test_pretrain_learns_and_reports_sensible_numbers(tok, corpus) -> None:
    train, heldout = corpus
    model = build_policy(TINY, tok, seed=0)
    cfg = quick_cfg()
    before, _ = bits_per_byte(model, tok, heldout, cfg.eval_bytes, cfg.seq_len)
    result = pretrain(model, tok, train, heldout, cfg, progress=False)
    assert result.steps == cfg.max_steps
    assert result.tokens_seen == cfg.max_steps * cfg.batch_size * cfg.seq_len
    assert result.seconds > 0 and result.tokens_per_s == pytest.approx(result.tokens_seen / result.seconds)
    assert result.heldout_bytes == cfg.eval_bytes or result.heldout_bytes >= cfg.eval_bytes - 4
    assert result.train_loss < math.log(len(tok)) - 1.0  # well below uniform
    assert result.heldout_bits_per_byte < before - 0.5
    assert not model.training
    after, _ = bits_per_byte(model, tok, heldout, cfg.eval_bytes, cfg.seq_len)
    assert after == pytest.approx(result.heldout_bits_per_byte)


def test_pretrain_is_deterministic(tok, corpus) -> None:
    cfg = quick_cfg(max_steps=5)
    models = [build_policy(TINY, tok, seed=1) for _ in range(2)]
    results = [pretrain(m, tok, corpus[0], corpus[1], cfg, progress=False) for m in models]
    assert results[0].train_loss == results[1].train_loss
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q)


def test_pretrain_stops_at_the_time_budget(tok, corpus) -> None:
    cfg = quick_cfg(max_steps=100_000, max_seconds=0.5, eval_bytes=500)
    result = pretrain(build_policy(TINY, tok), tok, corpus[0], corpus[1], cfg, progress=False)
    assert 1 <= result.steps < 100_000
    assert 0.5 <= result.seconds < 30.0  # stopped by the clock, right after the step that crossed it


def test_pretrain_and_bits_per_byte_on_a_lora_model(tok, corpus) -> None:
    from peft import LoraConfig, get_peft_model

    base = build_policy(TINY, tok, seed=0)
    frozen_before = base.model.layers[0].mlp.up_proj.weight.detach().clone()
    base_bpb, _ = bits_per_byte(base, tok, corpus[1], 3000, 64)
    model = get_peft_model(base, LoraConfig(r=4, init_lora_weights=False, target_modules=["q_proj", "up_proj"]))
    lora_bpb, covered = bits_per_byte(model, tok, corpus[1], 3000, 64)
    assert covered == 3000 and lora_bpb != base_bpb and math.isfinite(lora_bpb)
    result = pretrain(model, tok, corpus[0], corpus[1], quick_cfg(max_steps=20, eval_bytes=3000), progress=False)
    assert result.heldout_bits_per_byte < lora_bpb
    # Only the adapter trained; the base weights under it are untouched.
    assert torch.equal(model.base_model.model.model.layers[0].mlp.up_proj.base_layer.weight, frozen_before)
