"""Probe prompts and the greedy log-prob probe the trainer computes for each version."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from data_contracts.corpus import read_texts, stdlib_root
from training.policy import PolicyConfig, build_policy
from training.probe import ProbeSet, compute_probe, load_probe, probe_prompts, save_probe
from training.tokenizer import train_tokenizer

TINY = PolicyConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64, max_position_embeddings=256)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    root = stdlib_root()
    return read_texts([root / "heapq.py", root / "bisect.py", root / "colorsys.py"])


@pytest.fixture(scope="module")
def tok(texts):
    return train_tokenizer(texts, vocab_size=300)


@pytest.fixture(scope="module")
def model(tok):
    return build_policy(TINY, tok, seed=0)


def test_probe_prompts_are_deterministic_mid_line_snippets(texts) -> None:
    prompts = probe_prompts(texts, n=6, prompt_chars=120, seed=3)
    assert prompts == probe_prompts(texts, n=6, prompt_chars=120, seed=3)
    assert prompts != probe_prompts(texts, n=6, prompt_chars=120, seed=4)
    assert len(prompts) == 6 and len(set(prompts)) == 6
    for p in prompts:
        assert 0 < len(p) <= 120 and p.strip()
        assert not p[-1].isspace()
        # Cut from a text, right before more of the same line.
        hits = [t for t in texts if any(t[i + len(p)] != "\n" for i in _find_all(t, p))]
        assert hits, p


def _find_all(text: str, sub: str) -> list[int]:
    out, i = [], text.find(sub)
    while i != -1 and i + len(sub) < len(text):
        out.append(i)
        i = text.find(sub, i + 1)
    return out


def test_probe_prompts_need_text() -> None:
    with pytest.raises(ValueError):
        probe_prompts([], n=2)


def test_compute_probe_matches_a_direct_forward_pass(model, tok, texts) -> None:
    prompts = probe_prompts(texts, n=3, prompt_chars=80)
    probe = compute_probe(model, tok, prompts, max_new_tokens=6)
    assert probe.max_new_tokens == 6 and len(probe.items) == 3
    assert compute_probe(model, tok, prompts, max_new_tokens=6) == probe
    for prompt, item in zip(prompts, probe.items):
        assert item.prompt_token_ids == tok.encode(prompt, add_special_tokens=False)
        assert len(item.completion_token_ids) == len(item.logprobs) == 6
        seq = torch.tensor([item.prompt_token_ids + item.completion_token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=seq).logits[0].float(), dim=-1)
        n = len(item.prompt_token_ids)
        for k, (token, lp) in enumerate(zip(item.completion_token_ids, item.logprobs)):
            row = logp[n - 1 + k]  # the distribution that produced completion token k
            assert token == int(row.argmax())
            assert lp == pytest.approx(float(row[token]), abs=1e-5)


def test_compute_probe_does_not_stop_at_eos(tok) -> None:
    model = build_policy(TINY.model_copy(update={"tie_word_embeddings": False}), tok, seed=0)
    with torch.no_grad():
        model.lm_head.weight.zero_()  # all logits equal: argmax is id 0, the eos
    probe = compute_probe(model, tok, ["x = "], max_new_tokens=5)
    item = probe.items[0]
    assert item.completion_token_ids == [tok.eos_token_id] * 5
    assert item.logprobs == pytest.approx([-math.log(len(tok))] * 5, abs=1e-5)


def test_probe_save_load_round_trip(model, tok, tmp_path: Path) -> None:
    probe = compute_probe(model, tok, ["def f(", "import o"], max_new_tokens=3, version_note="v7")
    path = save_probe(probe, tmp_path / "v7")
    assert path == tmp_path / "v7" / "probe.json"
    loaded = load_probe(tmp_path / "v7")
    assert isinstance(loaded, ProbeSet) and loaded == probe
    assert loaded.items[0].logprobs == probe.items[0].logprobs  # floats survive JSON exactly


def test_nan_weights_fail_the_served_weight_comparison(model, tok) -> None:
    from serving.probe import compare_item

    [item] = compute_probe(model, tok, ["def f("], max_new_tokens=3).items
    assert compare_item(0, item, item.completion_token_ids, item.logprobs)[:2] == (0.0, False)  # the same weights
    broken = model.__class__(model.config)  # same architecture, every weight NaN
    with torch.no_grad():
        for p in broken.parameters():
            p.fill_(math.nan)
    # such weights cannot even make a probe (NaN would be stored as null, then fail to load obscurely) ...
    with pytest.raises(ValueError, match="non-finite log-probs.*NaN/inf"):
        compute_probe(broken, tok, ["def f("], max_new_tokens=3)
    # ... and served behind a finite probe (a stale probe.json beside them), the comparison fails
    diff, failed, details = compare_item(0, item, item.completion_token_ids, [math.nan] * 3)
    assert failed and diff == 0.0 and "non-finite" in details[0] and "NaN" in details[0]
