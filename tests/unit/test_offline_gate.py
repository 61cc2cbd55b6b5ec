"""The offline gate on the tiny policy: an unchanged candidate passes with exact figures; NaN weights, a
candidate far from the champion, a code regression and too little evidence each fail with their reason."""

from __future__ import annotations

import copy

import pytest
import torch

from data_contracts.corpus import read_texts, stdlib_root
from training.offline_gate import evaluate, kl_and_ope
from training.policy import load_policy, load_tokenizer
from training.train_settings import GateConfig

CODE = read_texts([stdlib_root() / "bisect.py"])
CFG = GateConfig(eval_bytes=2000, seq_len=64, min_heldout_rows=4)


@pytest.fixture(scope="module")
def champion(champion_dir):
    return load_policy(champion_dir)


@pytest.fixture(scope="module")
def tok(champion_dir):
    return load_tokenizer(champion_dir)


def test_unchanged_candidate_passes_with_exact_figures(champion, tok, samples) -> None:
    report = evaluate(copy.deepcopy(champion), champion, None, tok, samples[:40], CODE, CFG)
    assert report.passed, report.reason
    f = report.figures
    assert f["kl_per_token"] == pytest.approx(0.0, abs=1e-6) and f["bpb_delta"] == pytest.approx(0.0, abs=1e-6)
    # the samples were drawn from the champion, so every importance weight is 1: SNIS = plain mean, ESS = N
    assert f["ope_champion"] == pytest.approx(sum(s.reward for s in samples[:40]) / 40, abs=1e-4)
    assert f["ess_champion"] == pytest.approx(40, rel=1e-3) and f["ope_gain"] == pytest.approx(0.0, abs=1e-6)
    assert report.tags()["tidal.gate.passed"] == "true" and "tidal.gate.reason" not in report.tags()


def test_nan_weights_fail_the_finite_check_alone(champion, tok, samples) -> None:
    bad = copy.deepcopy(champion)
    with torch.no_grad():
        next(bad.parameters())[0, 0] = float("nan")
    report = evaluate(bad, champion, None, tok, samples[:40], CODE, CFG)
    assert not report.passed and [c.name for c in report.checks] == ["finite"]
    assert "1 non-finite values" in report.reason and report.tags()["tidal.gate.passed"] == "false"


def test_a_candidate_far_from_the_champion_fails_kl_and_bits_per_byte(champion, tok, samples) -> None:
    far = copy.deepcopy(champion)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in far.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=gen))
    report = evaluate(far, champion, None, tok, samples[:40], CODE, CFG)
    failed = {c.name for c in report.checks if not c.passed}
    assert {"kl", "bits_per_byte"} <= failed
    assert "nats/token vs max 0.5" in report.tags()["tidal.gate.kl"] and "tidal.gate.reason" in report.tags()


def test_too_few_heldout_rows_fail(champion, tok, samples) -> None:
    report = evaluate(copy.deepcopy(champion), champion, None, tok, samples[:2], CODE, CFG)
    assert not report.passed and "2 held-out rows < 4" in report.reason


def test_low_effective_sample_size_is_inconclusive_not_failed(champion, tok, samples) -> None:
    rows = [
        s.model_copy(update={"behaviour_logprobs": [lp - 3.0 * (i % 2) for lp in s.behaviour_logprobs]})
        for i, s in enumerate(samples[:40])
    ]
    figures = kl_and_ope(champion, champion, rows, tok.pad_token_id)
    assert figures["ess_champion"] < 40  # unequal weights now
    report = evaluate(copy.deepcopy(champion), champion, None, tok, rows, CODE, CFG.model_copy(update={"min_ess": 1000}))
    [ope] = [c for c in report.checks if c.name == "ope"]
    assert ope.passed and ope.detail.startswith("inconclusive")


def test_bpb_stop_scores_the_code_model_not_the_stop_decision(champion, tok, samples) -> None:
    """With bpb_stop, a candidate that only raises its line-break logits (stopping earlier, what Tab training
    teaches) keeps the champion's bits/byte exactly; plain bits/byte charges it. A change to the code predictions
    themselves is still charged."""
    from training.stop_credit import stop_token_ids

    stops = stop_token_ids(tok, "\n")
    stopper, broken = copy.deepcopy(champion), copy.deepcopy(champion)
    with torch.no_grad():
        for m in (stopper, broken):  # untied from the input embeddings: only the predictions change
            m.get_output_embeddings().weight = torch.nn.Parameter(m.get_output_embeddings().weight.clone())
        head = stopper.get_output_embeddings().weight  # (V, H): the logit of token v is head[v] · h
        head[stops] *= 3.0
        other = [v for v in range(head.shape[0]) if v not in set(stops)]
        broken.get_output_embeddings().weight[other[: len(other) // 2]] *= -1.0
    given = CFG.model_copy(update={"bpb_stop": "\n"})
    plain = evaluate(stopper, champion, None, tok, samples[:8], CODE, CFG).figures["bpb_delta"]
    neutral = evaluate(stopper, champion, None, tok, samples[:8], CODE, given)
    assert plain > 0.05 and neutral.figures["bpb_delta"] == pytest.approx(0.0, abs=1e-4), (plain, neutral.figures)
    assert "given no token holding '\\n'" in next(c.detail for c in neutral.checks if c.name == "bits_per_byte")
    assert not evaluate(broken, champion, None, tok, samples[:8], CODE, given).passed


def test_bpb_fit_temperature_scores_the_code_model_not_its_temperature(champion, tok, samples) -> None:
    """With bpb_fit_temperature, a candidate that is the champion at another temperature (every logit ×2, what
    sharpening teaches, or ×0.5) keeps the champion's bits/byte; plain bits/byte charges the change (this tiny
    champion, trained on the scored file, is best at logits ×1.3: flatter is charged). A worse code model is
    still charged at every temperature."""
    fit = CFG.model_copy(update={"bpb_fit_temperature": True})
    for factor in (2.0, 0.5):  # 2^(±8/8): the fitted grid shifted by eight steps, inside it for this champion
        other = copy.deepcopy(champion)
        with torch.no_grad():  # untied from the input embeddings: only the predictions change
            other.get_output_embeddings().weight = torch.nn.Parameter(other.get_output_embeddings().weight * factor)
        f = evaluate(other, champion, None, tok, samples[:8], CODE, fit).figures
        assert f["bpb_delta"] == pytest.approx(0.0, abs=1e-4), (factor, f)
        assert f["bpb_scale_champion"] / f["bpb_scale_candidate"] == pytest.approx(factor, rel=1e-6)
    plain = evaluate(other, champion, None, tok, samples[:8], CODE, CFG)
    assert plain.figures["bpb_delta"] > CFG.bpb_tolerance and not plain.passed
    broken = copy.deepcopy(champion)
    with torch.no_grad():
        head = torch.nn.Parameter(broken.get_output_embeddings().weight.clone())
        head[: head.shape[0] // 2] *= -1.0
        broken.get_output_embeddings().weight = head
    rejected = evaluate(broken, champion, None, tok, samples[:8], CODE, fit)
    assert not rejected.passed and rejected.figures["bpb_delta"] > CFG.bpb_tolerance
    assert "each at its best temperature" in next(c.detail for c in rejected.checks if c.name == "bits_per_byte")


def test_the_bits_per_byte_check_names_its_corpus_and_a_model_without_one_skips_it(champion, tok, samples) -> None:
    named = evaluate(copy.deepcopy(champion), champion, None, tok, samples[:40], CODE, CFG, "acme/src (*.rs)")
    assert "bits/byte on acme/src (*.rs)" in next(c.detail for c in named.checks if c.name == "bits_per_byte")
    report = evaluate(copy.deepcopy(champion), champion, None, tok, samples[:40], None, CFG)
    check = next(c for c in report.checks if c.name == "bits_per_byte")
    assert report.passed and check.passed and check.value is None
    assert check.detail.startswith("skipped: the model has no corpus (models[].corpus.source: none)")
    assert "bpb_delta" not in report.figures and "kl_per_token" in report.figures  # the other checks still ran
