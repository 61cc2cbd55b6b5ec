"""Hugging Face Qwen2/Llama weights <-> Megatron-core GPTModel shards (tensor and pipeline parallel).

Pure tensor bookkeeping, no process group: the trainer converts the champion into its own shard and
gathers the shards back into one HF state dict for the candidate the fleet serves.

Layouts (megatron-core 0.16, local layer spec; every per-layer key below is under `decoder.layers.{i}.`):

    HF                                   Megatron                               TP split
    model.embed_tokens.weight (V, H)     embedding.word_embeddings.weight       dim 0, vocab padded to a multiple of tp
    q/k/v_proj.weight + bias             self_attention.linear_qkv.weight/bias  dim 0 by query group: rows are
                                         ((nq/ng + 2) * d per group: the group's q heads, then its k, then its v)
    o_proj.weight (H, nq*d)              self_attention.linear_proj.weight      dim 1 (row parallel)
    gate_proj / up_proj (F, H)           mlp.linear_fc1.weight (2F, H)          gate and up each dim 0; a shard is
                                                                                [gate_r; up_r] (Megatron's SwiGLU chunk)
    down_proj.weight (H, F)              mlp.linear_fc2.weight                  dim 1 (row parallel)
    input_layernorm / post_attention_    input_layernorm / pre_mlp_layernorm    replicated
    model.norm.weight                    decoder.final_layernorm.weight         replicated (last stage)
    lm_head.weight (untied only)         output_layer.weight                    dim 0, padded like the embedding

Pipeline stage s holds layers [s*L/pp, (s+1)*L/pp), renumbered from 0; the first stage holds the
embedding, the last the final norm and the output layer (with tied embeddings and pp > 1 the last stage
keeps its own copy of the embedding as `output_layer.weight`, which Megatron keeps in sync).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Shards = list[list[dict[str, torch.Tensor]]]  # [pipeline stage][tensor rank] -> Megatron state dict
_HF_LAYER = "model.layers.{i}."
_MC_LAYER = "decoder.layers.{i}."


class ConversionError(ValueError):
    """A model or a parallel layout the conversion cannot represent; the message names the fix."""


@dataclass(frozen=True)
class ModelShape:
    """What the conversion needs of a model's config (Qwen2Config / LlamaConfig field names)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool

    @classmethod
    def of(cls, config) -> ModelShape:
        heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        arch = (getattr(config, "model_type", "") or "").lower()
        return cls(
            num_layers=int(config.num_hidden_layers),
            hidden_size=int(config.hidden_size),
            num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            ffn_hidden_size=int(config.intermediate_size),
            vocab_size=int(config.vocab_size),
            tied_embeddings=bool(config.tie_word_embeddings),
            qkv_bias=bool(getattr(config, "attention_bias", arch == "qwen2")),
        )

    def padded_vocab(self, tp: int) -> int:
        return -(-self.vocab_size // tp) * tp

    def check(self, tp: int, pp: int) -> None:
        problems = []
        if tp < 1 or pp < 1:
            problems.append(f"tensor_parallel={tp}, pipeline_parallel={pp}: both must be >= 1")
        else:
            if self.num_kv_heads % tp:
                problems.append(
                    f"{self.num_kv_heads} key/value heads do not split over tensor_parallel={tp}: "
                    f"use a divisor of {self.num_kv_heads}"
                )
            if self.ffn_hidden_size % tp:
                problems.append(f"MLP width {self.ffn_hidden_size} does not split over tensor_parallel={tp}")
            if self.num_layers % pp:
                problems.append(
                    f"{self.num_layers} layers do not split evenly over pipeline_parallel={pp}: "
                    f"use a divisor of {self.num_layers}"
                )
        if self.num_heads % self.num_kv_heads:
            problems.append(f"{self.num_heads} query heads are not a multiple of {self.num_kv_heads} key/value heads")
        if problems:
            raise ConversionError("; ".join(problems))


def _split(t: torch.Tensor, n: int, dim: int) -> list[torch.Tensor]:
    return [c.clone() for c in torch.chunk(t, n, dim=dim)]


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    # Padded vocabulary rows are zero; the backend slices logits back to the real vocabulary.
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: ModelShape) -> torch.Tensor:
    """(nq*d, ...), (ng*d, ...), (ng*d, ...) -> (ng*(nq/ng+2)*d, ...) grouped as Megatron's linear_qkv."""
    per, rest = s.num_heads // s.num_kv_heads, q.shape[1:]
    q = q.reshape(s.num_kv_heads, per * s.head_dim, *rest)
    k = k.reshape(s.num_kv_heads, s.head_dim, *rest)
    v = v.reshape(s.num_kv_heads, s.head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _unfuse_qkv(qkv: torch.Tensor, s: ModelShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    per, rest = s.num_heads // s.num_kv_heads, qkv.shape[1:]
    g = qkv.reshape(s.num_kv_heads, (per + 2) * s.head_dim, *rest)
    q, k, v = torch.split(g, [per * s.head_dim, s.head_dim, s.head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _layer_to_mcore(hf: dict[str, torch.Tensor], i: int, s: ModelShape, tp: int) -> list[dict[str, torch.Tensor]]:
    h = _HF_LAYER.format(i=i)
    a = h + "self_attn."
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    qkv = {"weight": _fuse_qkv(hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"], s)}
    if s.qkv_bias:
        qkv["bias"] = _fuse_qkv(hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"], s)
    split = {
        **{f"self_attention.linear_qkv.{n}": _split(t, tp, 0) for n, t in qkv.items()},  # whole groups per rank
        "self_attention.linear_proj.weight": _split(hf[a + "o_proj.weight"], tp, 1),
        "mlp.linear_fc1.weight": [
            torch.cat([g, u])
            for g, u in zip(_split(hf[h + "mlp.gate_proj.weight"], tp, 0), _split(hf[h + "mlp.up_proj.weight"], tp, 0))
        ],
        "mlp.linear_fc2.weight": _split(hf[h + "mlp.down_proj.weight"], tp, 1),
    }
    for r in range(tp):
        out[r] = {k: v[r] for k, v in split.items()}
        out[r]["input_layernorm.weight"] = hf[h + "input_layernorm.weight"].clone()
        out[r]["pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"].clone()
    return out


def hf_to_mcore(hf: dict[str, torch.Tensor], shape: ModelShape, tp: int = 1, pp: int = 1) -> Shards:
    """An HF state dict -> Megatron state dicts, `[stage][tensor rank]`."""
    shape.check(tp, pp)
    per_stage, V = shape.num_layers // pp, shape.padded_vocab(tp)
    shards: Shards = [[{} for _ in range(tp)] for _ in range(pp)]
    embed = _split(_pad_rows(hf["model.embed_tokens.weight"], V), tp, 0)
    head = embed if shape.tied_embeddings else _split(_pad_rows(hf["lm_head.weight"], V), tp, 0)
    for i in range(shape.num_layers):
        stage, local = divmod(i, per_stage)
        for r, layer in enumerate(_layer_to_mcore(hf, i, shape, tp)):
            shards[stage][r].update({_MC_LAYER.format(i=local) + k: v for k, v in layer.items()})
    for r in range(tp):
        shards[0][r]["embedding.word_embeddings.weight"] = embed[r]
        last = shards[-1][r]
        last["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
        if not shape.tied_embeddings or pp > 1:
            last["output_layer.weight"] = head[r].clone()
    return shards


def mcore_to_hf(shards: Shards, shape: ModelShape) -> dict[str, torch.Tensor]:
    """Megatron state dicts `[stage][tensor rank]` -> one HF state dict (padded vocabulary rows dropped)."""
    pp, tp = len(shards), len(shards[0])
    shape.check(tp, pp)
    per_stage, hf = shape.num_layers // pp, {}

    def cat(stage: int, key: str, dim: int) -> torch.Tensor:
        missing = [r for r in range(tp) if key not in shards[stage][r]]
        if missing:
            raise ConversionError(
                f"Megatron shard (stage {stage}, tensor ranks {missing}) has no {key!r}: "
                "the shards come from another model shape or layout"
            )
        return torch.cat([shards[stage][r][key] for r in range(tp)], dim=dim)

    for i in range(shape.num_layers):
        stage, local = divmod(i, per_stage)
        m, h, a = _MC_LAYER.format(i=local), _HF_LAYER.format(i=i), _HF_LAYER.format(i=i) + "self_attn."
        groups = [shards[stage][r][m + "self_attention.linear_qkv.weight"] for r in range(tp)]
        q, k, v = _unfuse_qkv(torch.cat(groups), shape)
        hf.update({a + "q_proj.weight": q, a + "k_proj.weight": k, a + "v_proj.weight": v})
        if shape.qkv_bias:
            q, k, v = _unfuse_qkv(cat(stage, m + "self_attention.linear_qkv.bias", 0), shape)
            hf.update({a + "q_proj.bias": q, a + "k_proj.bias": k, a + "v_proj.bias": v})
        hf[a + "o_proj.weight"] = cat(stage, m + "self_attention.linear_proj.weight", 1)
        fc1 = [torch.chunk(shards[stage][r][m + "mlp.linear_fc1.weight"], 2, dim=0) for r in range(tp)]
        hf[h + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in fc1])
        hf[h + "mlp.up_proj.weight"] = torch.cat([u for _, u in fc1])
        hf[h + "mlp.down_proj.weight"] = cat(stage, m + "mlp.linear_fc2.weight", 1)
        hf[h + "input_layernorm.weight"] = shards[stage][0][m + "input_layernorm.weight"].clone()
        hf[h + "post_attention_layernorm.weight"] = shards[stage][0][m + "pre_mlp_layernorm.weight"].clone()
    hf["model.embed_tokens.weight"] = cat(0, "embedding.word_embeddings.weight", 0)[: shape.vocab_size]
    hf["model.norm.weight"] = shards[-1][0]["decoder.final_layernorm.weight"].clone()
    if not shape.tied_embeddings:
        hf["lm_head.weight"] = cat(pp - 1, "output_layer.weight", 0)[: shape.vocab_size]
    return hf
