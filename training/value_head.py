"""The critic: a scalar value head on the policy's last hidden states, and the policy+value wrapper.

The head shares the policy's trunk (one forward pass gives logits and values), so the value
loss also trains the trunk's trainable weights (LoRA adapters, or all weights). The head itself
is not served: only the policy (or its adapter) is saved for inference.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel


class ValueHead(nn.Module):
    """V(s_t) = w . h_t + b on a hidden state h_t (..., H) -> (...), in float32.

    ``init_std`` 0 (the default) starts the critic at V = 0 everywhere, a neutral baseline for
    rewards around 0; the head still learns at once, since dL/dw = dL/dV * h is non-zero.
    """

    def __init__(self, hidden_size: int, init_std: float = 0.0, seed: int | None = None) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1, dtype=torch.float32)
        with torch.no_grad(), torch.random.fork_rng(devices=[]):  # no global RNG side effect
            if seed is not None:
                torch.manual_seed(seed)
            if init_std > 0:
                nn.init.normal_(self.linear.weight, std=init_std)
            else:
                self.linear.weight.zero_()
            self.linear.bias.zero_()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # (..., H) -> (..., 1) -> (...); float32 regardless of the trunk's dtype (bf16 on a GPU)
        return self.linear(hidden.to(self.linear.weight.dtype)).squeeze(-1)


def _hidden_size(model: nn.Module) -> int:
    return int(model.config.hidden_size)  # PeftModel forwards .config to the base model


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) positions counted over real tokens only: 0, 1, 2, ... after any left padding.

    With left-padded prompts every token gets the position it had when served unpadded, so the
    trainer's log-probs match the engine's instead of being shifted by the pad count.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


class PolicyWithValue(nn.Module):
    """A causal LM (plain Qwen2ForCausalLM or a PeftModel around one) plus a ValueHead.

    ``forward(input_ids, attention_mask)`` -> (logits (B, L, V), values (B, L)); values[:, i] is
    the value of the state after token i, i.e. of the context from which logits[:, i] predicts
    token i + 1.
    """

    def __init__(
        self,
        policy: PreTrainedModel | nn.Module,
        value_head: ValueHead | None = None,
        autocast_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.policy = policy
        self.value_head = value_head if value_head is not None else ValueHead(_hidden_size(policy))
        # train.ppo.precision 'bf16': the policy's forward (and so its backward) under autocast to this dtype, its
        # weights left as they are (float32 master weights); None runs in the weights' own dtype
        self.autocast_dtype = autocast_dtype

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        dtype = self.autocast_dtype
        with torch.autocast(input_ids.device.type, dtype=dtype, enabled=dtype is not None):
            out = self.policy(
                input_ids=input_ids,  # (B, L)
                attention_mask=attention_mask,  # (B, L), 0 on padding
                position_ids=position_ids_from_mask(attention_mask),  # (B, L)
                output_hidden_states=True,
                use_cache=False,
            )
        # hidden_states[-1] is the final-norm output the LM head reads: (B, L, H); the head runs in float32, outside
        # autocast, and the logits leave in float32 (log-softmax and the losses are computed in it)
        values = self.value_head(out.hidden_states[-1])  # (B, L)
        return out.logits.float(), values  # (B, L, V), (B, L)

    def param_groups(
        self, learning_rate: float, critic_learning_rate: float, final_norm_learning_rate: float | None = None
    ) -> list[dict]:
        """Optimizer groups: the policy's trainable weights at one rate, the value head at another, and with
        `final_norm_learning_rate` the final norm's weights (a full-weight run's per-dimension scale of what the LM
        head reads: the policy's temperature) at a third.

        Frozen weights (a LoRA run's base model) are left out.
        """
        norm = []
        if final_norm_learning_rate is not None:
            norm = [p for p in _final_norm(self.policy).parameters() if p.requires_grad]
            if not norm:
                raise ValueError(
                    "final_norm_learning_rate is set but the final norm is frozen (a LoRA run): "
                    "train every weight (lora=false) or leave it unset"
                )
        taken = {id(p) for p in norm}
        policy = [p for p in self.policy.parameters() if p.requires_grad and id(p) not in taken]
        head = [p for p in self.value_head.parameters() if p.requires_grad]
        return [
            {"params": policy, "lr": learning_rate, "name": "policy"},
            {"params": head, "lr": critic_learning_rate, "name": "value_head"},
        ] + ([{"params": norm, "lr": final_norm_learning_rate, "name": "final_norm"}] if norm else [])


def _final_norm(policy: nn.Module) -> nn.Module:
    """The norm whose output the LM head reads (Qwen2/Llama-style decoders: `model.norm`)."""
    decoder = policy.get_decoder() if hasattr(policy, "get_decoder") else None
    norm = getattr(decoder, "norm", None)
    if not isinstance(norm, nn.Module):
        raise ValueError(
            f"{type(policy).__name__} has no final norm at .get_decoder().norm: "
            "final_norm_learning_rate supports Qwen2/Llama-style decoders"
        )
    return norm
