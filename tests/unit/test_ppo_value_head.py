"""The value head and the policy+value wrapper, on a tiny Qwen2 plain and with LoRA."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from training.ppo_config import PPOConfig
from training.ppo_loss import ppo_losses, token_logprobs
from training.value_head import PolicyWithValue, ValueHead, position_ids_from_mask

VOCAB = 300
# peft calls a transformers API deprecated in v5; not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


def tiny_qwen(seed: int = 0) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_sliding_window=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config).eval()


def lora(model: Qwen2ForCausalLM, init_lora_weights: bool = True):
    from peft import get_peft_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        return get_peft_model(model, PPOConfig().lora_config(init_lora_weights=init_lora_weights))


@pytest.fixture()
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    return ids, torch.ones_like(ids)


def test_value_head_init_is_zero_or_seeded_small() -> None:
    h = torch.randn(2, 5, 8)
    assert torch.equal(ValueHead(8)(h), torch.zeros(2, 5))
    a, b = ValueHead(8, init_std=0.01, seed=3), ValueHead(8, init_std=0.01, seed=3)
    assert torch.equal(a.linear.weight, b.linear.weight) and a.linear.weight.abs().max() < 0.1
    assert ValueHead(8)(h.to(torch.bfloat16)).dtype == torch.float32


def test_plain_policy_logits_unchanged_and_values_per_token(batch) -> None:
    ids, am = batch
    base = tiny_qwen()
    pv = PolicyWithValue(base, ValueHead(32, init_std=0.1, seed=0))
    with torch.no_grad():
        logits, values = pv(ids, am)
        ref = base(input_ids=ids, output_hidden_states=True)
    assert logits.shape == (2, 6, VOCAB) and values.shape == (2, 6)
    torch.testing.assert_close(logits, ref.logits)
    torch.testing.assert_close(values, pv.value_head(ref.hidden_states[-1]))
    assert values.abs().sum() > 0


def test_peft_policy_logits_equal_base_and_gradients_reach_only_trainable_weights(batch) -> None:
    ids, am = batch
    with torch.no_grad():
        base_logits = tiny_qwen()(input_ids=ids).logits
    pv = PolicyWithValue(lora(tiny_qwen()))  # B = 0: the adapter starts as the identity
    logits, values = pv(ids, am)
    assert logits.shape == (2, 6, VOCAB) and values.shape == (2, 6)
    torch.testing.assert_close(logits, base_logits)

    pv = PolicyWithValue(lora(tiny_qwen(), init_lora_weights=False), ValueHead(32, init_std=0.1, seed=0))
    logits, values = pv(ids, am)
    logp = token_logprobs(logits[:, :-1], ids[:, 1:])  # (2, 5)
    mask, ones = torch.ones_like(logp), torch.ones_like(logp)
    parts = ppo_losses(logp, logp.detach() - 0.01, ones, values[:, :-1], values[:, :-1].detach(), ones, ones, mask, 0.2, 0.2)
    parts.total(vf_coef=0.5, entropy_coef=0.0).backward()

    assert pv.value_head.linear.weight.grad.abs().sum() > 0
    named = dict(pv.policy.named_parameters())
    lora_params = {n: p for n, p in named.items() if "lora_" in n}
    assert lora_params and all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora_params.values())
    frozen = {n: p for n, p in named.items() if "lora_" not in n}
    assert frozen and all(not p.requires_grad and p.grad is None for p in frozen.values())

    groups = pv.param_groups(learning_rate=1e-4, critic_learning_rate=3e-4)
    assert [g["lr"] for g in groups] == [1e-4, 3e-4]
    assert {id(p) for p in groups[0]["params"]} == {id(p) for p in lora_params.values()}
    assert groups[1]["params"] == list(pv.value_head.parameters())


def test_full_fine_tune_trains_every_weight(batch) -> None:
    ids, am = batch
    pv = PolicyWithValue(tiny_qwen(), ValueHead(32, init_std=0.1, seed=0))
    logits, values = pv(ids, am)
    (token_logprobs(logits[:, :-1], ids[:, 1:]).sum() + values.sum()).backward()
    assert all(p.grad is not None for p in pv.parameters())
    assert len(pv.param_groups(1e-4, 1e-4)[0]["params"]) == len(list(pv.policy.parameters()))


def test_the_final_norm_can_train_at_its_own_rate_in_a_full_weight_run() -> None:
    """The final norm's weights scale what the LM head reads (the policy's temperature): their own group."""
    pv = PolicyWithValue(tiny_qwen(), ValueHead(32, init_std=0.1, seed=0))
    policy, head, norm = pv.param_groups(1e-4, 3e-4, final_norm_learning_rate=1e-2)
    assert [g["name"] for g in (policy, head, norm)] == ["policy", "value_head", "final_norm"]
    assert norm["lr"] == 1e-2 and [id(p) for p in norm["params"]] == [id(pv.policy.model.norm.weight)]
    assert len(policy["params"]) + 1 == len(list(pv.policy.parameters()))
    assert id(pv.policy.model.norm.weight) not in {id(p) for p in policy["params"]}
    from training.ppo_config import PPOConfig

    with pytest.raises(ValueError, match="needs lora=false"):
        PPOConfig(final_norm_learning_rate=1e-2)  # an adapter run never trains the final norm


def test_left_padding_gives_the_unpadded_outputs() -> None:
    pv = PolicyWithValue(tiny_qwen(), ValueHead(32, init_std=0.1, seed=0))
    ids = torch.randint(1, VOCAB, (1, 5), generator=torch.Generator().manual_seed(4))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    am = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    assert position_ids_from_mask(am).tolist() == [[0, 0, 0, 0, 1, 2, 3, 4]]
    seen: dict = {}
    pv.policy.register_forward_pre_hook(lambda _m, _a, kw: seen.update(kw), with_kwargs=True)
    with torch.no_grad():
        logits, values = pv(ids)
        plog, pval = pv(padded, am)
    # positions as served (RoPE is shift-invariant, so the outputs alone would not show a shift)
    assert seen["position_ids"].tolist() == [[0, 0, 0, 0, 1, 2, 3, 4]]
    torch.testing.assert_close(plog[:, 3:], logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pval[:, 3:], values, rtol=1e-5, atol=1e-5)
