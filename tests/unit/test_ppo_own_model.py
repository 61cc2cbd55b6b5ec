"""The PPO trainer on a team's own model: a Llama checkpoint with a tokenizer of another kind and no pad token
(tests/llama_checkpoint.py). Batches pad with its EOS id, one iteration learns (LoRA and full), and the candidate
it writes reloads and reproduces its probe."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from data_contracts.samples import RewardSample
from tests.llama_checkpoint import TEXTS, build_llama_checkpoint
from tests.unit.conftest import rewarded_row, sample
from tests.unit.ppo_helpers import cfg
from training.candidate import CRITIC_FILE, build_trainable, save_candidate
from training.policy import is_adapter_dir, load_policy, load_tokenizer
from training.ppo_trainer import PPOTrainer, iteration_plan
from training.probe import compute_probe, load_probe, save_probe
from training.tokenizer import padding_id


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    out = build_llama_checkpoint(tmp_path_factory.mktemp("llama") / "v1")
    tok = load_tokenizer(out)
    save_probe(compute_probe(load_policy(out), tok, ["def add(a, b", "for i in ra"], max_new_tokens=4), out)
    return out


@pytest.fixture(scope="module")
def rows(llama) -> list[RewardSample]:
    """Completions sampled from the Llama, rewarded +0.75 when the first token is one of a fixed half of the ids."""
    model, tok = load_policy(llama), load_tokenizer(llama)
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    out = []
    for i in range(64):
        text = TEXTS[i % 5]
        prompt = tok.encode(text[: rng.randrange(8, len(text) - 2)], add_special_tokens=False)
        completion, logps = sample(model, prompt, 4, gen)
        out.append(rewarded_row(i, prompt, completion, logps, accepted=completion[0] % 2 == 0, model="byo"))
    return out


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_one_ppo_iteration_on_a_llama_without_pad_token_learns_and_saves_a_servable_candidate(llama, rows, tmp_path, lora):
    tok = load_tokenizer(llama)
    assert tok.pad_token_id is None and padding_id(tok) == tok.eos_token_id
    c = cfg(lora=lora, passes=1, max_iterations=2, batch_size=32, learning_rate=1e-2)
    trainer = PPOTrainer(build_trainable(llama, llama, c), c, pad_token_id=padding_id(tok))
    good = torch.tensor([r.reward > 0 for r in rows])

    @torch.no_grad()
    def first_logp() -> torch.Tensor:
        return torch.stack([lp[0] for lp in trainer.token_logprobs(rows)])  # (N,)

    before = first_logp()
    trainer.compute_reference(rows)
    history = trainer.train(rows, iteration_plan(len(rows), c))
    gain = first_logp() - before
    assert len(history) == 2 and all(torch.isfinite(torch.tensor(h["ppo/policy_loss"])) for h in history)
    assert float(gain[good].mean() - gain[~good].mean()) > 0.1  # rewarded first tokens gained on the others (0.2 LoRA, 1.4 full)

    out = save_candidate(trainer.model, llama, llama, tmp_path / "cand")
    assert is_adapter_dir(out) == lora and (out / CRITIC_FILE).is_file()
    reloaded = load_policy(out, base_path=llama)
    probe = load_probe(out)
    again = compute_probe(reloaded, tok, [tok.decode(i.prompt_token_ids) for i in probe.items], probe.max_new_tokens)
    for x, y in zip(probe.items, again.items):
        assert x.completion_token_ids == y.completion_token_ids
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
