"""The Megatron-core policy+value model: a GPTModel shard built from an HF Qwen2/Llama config, with the
same forward contract as training.value_head.PolicyWithValue, so PPOTrainer and its loss run unchanged.

    forward(input_ids (B, L), attention_mask (B, L)) -> logits (B, L, V) full vocabulary, values (B, L)

Two things differ from the HF model and are handled here:
- Megatron's rotary embedding numbers positions by column and ignores position ids, while the trainer's
  batches are left-padded (training/rollout.py). Each row is rotated so its tokens start at column 0
  (pads move to the end, where causal attention keeps them out of every real token's context), run, and
  rotated back: every real token gets the position it had when served, as with the HF backend.
- With tensor parallelism the gradient norm is global: sharded weights add their squares across the
  tensor-parallel group, replicated ones (norms, the value head) count once (`clip_grad_norm`).

Needs torch.distributed and megatron's model-parallel state set up first (training/megatron/parallel.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from training.megatron.convert import ModelShape
from training.value_head import ValueHead


def transformer_config(hf_config, shape: ModelShape, tp: int, pp: int, dtype: torch.dtype = torch.float32):
    from megatron.core.transformer.transformer_config import TransformerConfig

    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r}: the Megatron backend converts SwiGLU (silu) models only")
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn_hidden_size,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        normalization="RMSNorm",
        layernorm_epsilon=float(hf_config.rms_norm_eps),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        # no dropout: pi_old must equal pi_theta at the first step (and no RNG stream is consumed)
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not torch.cuda.is_available(),
        # unfused paths: identical numerics on CPU and GPU without apex / Transformer Engine kernels
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )


def build_gpt(hf_config, tp: int = 1, pp: int = 1, dtype: torch.dtype = torch.float32):
    """This rank's GPTModel shard for an HF config (random weights; load a converted shard into it)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    shape = ModelShape.of(hf_config)
    shape.check(tp, pp)
    # transformers 5 keeps RoPE settings in rope_parameters (older versions: rope_theta + rope_scaling)
    rope = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"RoPE {rope}: the Megatron backend converts plain (default) RoPE only")
    rope_theta = rope.get("rope_theta") or hf_config.rope_theta
    from megatron.core import parallel_state as ps

    return GPTModel(
        transformer_config(hf_config, shape, tp, pp, dtype),
        get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=shape.padded_vocab(tp),
        max_sequence_length=int(hf_config.max_position_embeddings),
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        position_embedding_type="rope",
        rotary_base=int(rope_theta),
        share_embeddings_and_output_weights=shape.tied_embeddings,
        parallel_output=False,  # gather the vocabulary: PPO's log-softmax needs every logit
    ), shape


def _leading_pads(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.long().cumsum(-1) == 0).sum(-1)  # (B,) pads before each row's first token


class MegatronPolicyWithValue(nn.Module):
    """A GPTModel shard (the whole model when tp = pp = 1) and a ValueHead on its final-norm output."""

    def __init__(self, gpt: nn.Module, shape: ModelShape, value_head: ValueHead | None = None) -> None:
        super().__init__()
        self.policy, self.shape = gpt, shape
        self.value_head = value_head if value_head is not None else ValueHead(shape.hidden_size)
        self._hidden: torch.Tensor | None = None
        # (L, B, H) final-norm output, the hidden state the output layer reads (as HF's hidden_states[-1])
        gpt.decoder.final_layernorm.register_forward_hook(lambda _m, _i, out: setattr(self, "_hidden", out))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        B, L = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        cols = torch.arange(L, device=input_ids.device)
        to_right = (cols[None, :] + _leading_pads(attention_mask)[:, None]) % L  # (B, L) left- -> right-aligned
        back = torch.argsort(to_right, dim=1)  # (B, L) the inverse rotation
        ids = input_ids.gather(1, to_right)
        positions = cols[None, :].expand(B, L)
        # (1, 1, L, L) True = masked: causal only, since every row's pads now come after its tokens
        causal = torch.triu(torch.ones(L, L, dtype=torch.bool, device=input_ids.device), diagonal=1)[None, None]
        logits = self.policy(ids, positions, causal)
        hidden = self._hidden.transpose(0, 1)  # (B, L, H)
        logits = logits[..., : self.shape.vocab_size]  # drop the vocabulary padding of tensor parallelism
        values = self.value_head(hidden)
        logits = logits.gather(1, back[..., None].expand(-1, -1, logits.shape[-1]))
        return logits, values.gather(1, back)

    def param_groups(self, learning_rate: float, critic_learning_rate: float) -> list[dict]:
        policy = [p for p in self.policy.parameters() if p.requires_grad]
        head = [p for p in self.value_head.parameters() if p.requires_grad]
        return [
            {"params": policy, "lr": learning_rate, "name": "policy"},
            {"params": head, "lr": critic_learning_rate, "name": "value_head"},
        ]

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip by the norm of the whole model's gradient (all tensor-parallel shards); returns that norm."""
        from megatron.core import parallel_state as ps

        sharded, replicated = torch.zeros(()), torch.zeros(())
        params = [p for p in self.parameters() if p.grad is not None]
        for p in params:
            sq = p.grad.detach().float().pow(2).sum().cpu()
            if getattr(p, "tensor_model_parallel", False):
                sharded += sq
            else:
                replicated += sq
        if ps.get_tensor_model_parallel_world_size() > 1:
            group = ps.get_tensor_model_parallel_group()
            sharded = sharded.to(params[0].device) if params else sharded
            torch.distributed.all_reduce(sharded, group=group)
            sharded = sharded.cpu()
        norm = (sharded + replicated).sqrt()
        coef = min(max_norm / (float(norm) + 1e-6), 1.0)  # as torch.nn.utils.clip_grad_norm_
        if torch.isfinite(norm) and coef < 1.0:
            for p in params:
                p.grad.mul_(coef)
        return norm

    def hf_state_dict_shard(self) -> dict[str, torch.Tensor]:
        """This rank's Megatron weights (no extra state), ready for convert.mcore_to_hf after a gather."""
        return {
            k: v.detach().cpu()
            for k, v in self.policy.state_dict().items()
            if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")
        }
