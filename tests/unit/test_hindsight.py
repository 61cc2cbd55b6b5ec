"""Hindsight rows from partial verdicts: what the user kept plus the stop token, trained with IS weight 1."""

from __future__ import annotations

import math

import pytest
import torch

from data_contracts.rewards import RewardRule
from data_contracts.samples import RewardSample
from tests.unit.ppo_helpers import cfg, make_trainer
from training.hindsight import HindsightSample, hindsight_samples, kept_token_ids
from training.policy import load_tokenizer

TEXT = "heap.append(item)"


@pytest.fixture(scope="module")
def tok(champion_dir):
    return load_tokenizer(champion_dir)


def served(tok, event: str, kept: int | None, text: str = TEXT, rid: str = "r1") -> RewardSample:
    ids = tok.encode(text, add_special_tokens=False)
    return RewardSample(
        request_id=rid,
        model="tab",
        version=1,
        arm="control",
        user_hash="u",
        prompt_token_ids=tok.encode("def f(heap, item):\n    ", add_special_tokens=False),
        completion_token_ids=ids,
        behaviour_logprobs=[-0.1 * (i + 1) for i in range(len(ids))],
        completion_text=text,
        event=event,
        accepted_chars=kept,
        reward=0.0,
        reward_rule="cursor-tab@1",
        completion_time_ms=0,
    )


def boundaries(tok, text: str) -> list[int]:
    """Character counts at which the served tokens of `text` end."""
    ids = tok.encode(text, add_special_tokens=False)
    return [len(tok.decode(ids[:j])) for j in range(1, len(ids) + 1)]


def test_a_partial_on_a_token_boundary_reuses_the_served_tokens_and_ends_with_the_stop_token(tok) -> None:
    k = boundaries(tok, TEXT)[1]  # the first two served tokens
    rows = hindsight_samples([served(tok, "partial", k)], tok, RewardRule(), "\n")
    assert rows.skipped == {} and len(rows.samples) == 1
    h = rows.samples[0]
    assert isinstance(h, HindsightSample) and h.request_id == "r1#hindsight" and h.event == "accepted"
    assert h.completion_text == TEXT[:k] and h.accepted_chars == k
    (nl,) = tok.encode("\n", add_special_tokens=False)
    assert h.completion_token_ids == tok.encode(TEXT, add_special_tokens=False)[:2] + [nl]
    assert h.behaviour_logprobs[:2] == pytest.approx([-0.1, -0.2]) and math.isnan(h.behaviour_logprobs[2])
    assert tok.decode(h.completion_token_ids) == TEXT[:k] + "\n"
    assert h.reward == RewardRule().accepted  # an accepted suggestion, whatever share of the original it was


def test_a_partial_inside_a_token_encodes_the_kept_rest(tok) -> None:
    ends = boundaries(tok, TEXT)
    k = next(c for c in range(1, len(TEXT)) if c not in ends and c > ends[0])  # inside the second token or later
    h = hindsight_samples([served(tok, "partial", k)], tok, RewardRule(), "\n").samples[0]
    reused = sum(e <= k for e in ends)
    assert tok.decode(h.completion_token_ids[:-1]) == TEXT[:k]
    assert h.completion_token_ids[:reused] == tok.encode(TEXT, add_special_tokens=False)[:reused]
    assert all(math.isnan(x) for x in h.behaviour_logprobs[reused:]) and not any(map(math.isnan, h.behaviour_logprobs[:reused]))
    assert len(h.behaviour_logprobs) == len(h.completion_token_ids)


def test_scaled_rule_rewards_the_kept_characters_and_other_verdicts_add_nothing(tok) -> None:
    rule = RewardRule(accept_scale_by_chars=True, accept_chars_cap=32)
    rows = hindsight_samples(
        [
            served(tok, "accepted", None, rid="a"),
            served(tok, "rejected", None, rid="b"),
            served(tok, "partial", 8, rid="c"),
            served(tok, "partial", 0, rid="d"),
            served(tok, "none", None, rid="e"),
        ],
        tok,
        rule,
        "\n",
    )
    assert [h.request_id for h in rows.samples] == ["c#hindsight"] and rows.skipped == {"no_chars_kept": 1}
    assert rows.samples[0].reward == pytest.approx(0.75 * 8 / 32)


def test_a_stop_text_of_several_tokens_is_refused(tok) -> None:
    assert len(tok.encode("\n\n\nx", add_special_tokens=False)) > 1
    with pytest.raises(ValueError, match=r"hindsight stop '\\n\\n\\nx' is \d+ tokens .* expected exactly one"):
        hindsight_samples([served(tok, "partial", 3)], tok, RewardRule(), "\n\n\nx")


def test_text_the_tokenizer_cannot_reproduce_is_skipped(tok) -> None:
    assert kept_token_ids(tok, [], "heap") is not None
    row = served(tok, "partial", 4).model_copy(update={"completion_text": "\u212bheap"})  # Å: NFC-normalised on encode
    rows = hindsight_samples([row], tok, RewardRule(), "\n")
    assert rows.samples == [] and rows.skipped == {"not_reproducible": 1}


def test_the_trainer_gives_hindsight_rows_is_weight_one_and_served_rows_their_own(champion_dir, samples, tok) -> None:
    trainer = make_trainer(champion_dir, cfg(is_truncation=2.0))
    k = boundaries(tok, TEXT)[1]
    far = served(tok, "partial", k).model_copy(update={"behaviour_logprobs": [-30.0] * len(tok.encode(TEXT))})
    h = hindsight_samples([far], tok, RewardRule(), "\n").samples[0]
    # the hindsight row's reused tokens carry a served mu far below pi_old, which would cap their weight at C
    rows = [samples[0], h.model_copy(update={"behaviour_logprobs": [-30.0, -30.0, math.nan]})]
    trainer.compute_reference(rows)
    ro = trainer.rollout(rows, [0, 1])
    assert torch.equal(ro.is_weight[1, :3], torch.ones(3))
    served_w = torch.exp(ro.logp_old[0] - torch.tensor(samples[0].behaviour_logprobs)).clamp(max=2.0)
    assert ro.is_weight[0, : len(samples[0].completion_token_ids)] == pytest.approx(served_w, abs=1e-4)
    assert torch.isfinite(ro.advantages).all()
