"""From the champion's HF checkpoint to this rank's trainable Megatron shard, and from the trained shards back
to the HF candidate the fleet serves (the counterparts of training/candidate.py's build_trainable and
save_candidate for backend='megatron')."""

from __future__ import annotations

from pathlib import Path

import torch

from training.candidate import CRITIC_FILE, save_candidate
from training.megatron.convert import hf_to_mcore, mcore_to_hf
from training.megatron.model import MegatronPolicyWithValue, build_gpt
from training.megatron.parallel import gather_tensor_parallel, init_model_parallel
from training.policy import is_adapter_dir, load_policy
from training.ppo_config import PPOConfig
from training.value_head import PolicyWithValue, ValueHead


def _champion_hf(champion_dir: Path, base_dir: Path):
    policy = load_policy(champion_dir, base_path=base_dir)
    return policy.merge_and_unload() if is_adapter_dir(champion_dir) else policy  # a lora champion, folded


def build_megatron_trainable(champion_dir: Path, base_dir: Path, cfg: PPOConfig) -> MegatronPolicyWithValue:
    """This rank's shard of the champion (all weights trainable) with the value head, float32."""
    from megatron.core import parallel_state as ps

    init_model_parallel(cfg.tensor_parallel, cfg.pipeline_parallel, cfg.seed)
    hf = _champion_hf(champion_dir, base_dir)
    gpt, shape = build_gpt(hf.config, cfg.tensor_parallel, cfg.pipeline_parallel)
    sd = hf.state_dict()
    if shape.tied_embeddings:
        sd.pop("lm_head.weight", None)
    shard = hf_to_mcore(sd, shape, cfg.tensor_parallel, cfg.pipeline_parallel)[ps.get_pipeline_model_parallel_rank()][
        ps.get_tensor_model_parallel_rank()
    ]
    missing, unexpected = gpt.load_state_dict(shard, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(
            f"the converted champion does not fit the Megatron model (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}): a conversion bug, report it with the model's config"
        )
    gpt.requires_grad_(True)
    head = ValueHead(shape.hidden_size, seed=cfg.seed)
    critic = champion_dir / CRITIC_FILE
    if critic.is_file():
        head.load_state_dict(torch.load(critic, weights_only=True))
    model = MegatronPolicyWithValue(gpt, shape, head)
    model.train()
    return model


def gather_hf_policy(model: MegatronPolicyWithValue, champion_dir: Path, base_dir: Path):
    """The trained policy as one HF model, on tensor-parallel rank 0 (None on the other ranks)."""
    from megatron.core import parallel_state as ps

    shards = gather_tensor_parallel(model.hf_state_dict_shard())  # small policies; a large one streams per layer
    if ps.get_tensor_model_parallel_rank() != 0:
        return None
    hf = _champion_hf(champion_dir, base_dir)
    missing, unexpected = hf.load_state_dict(mcore_to_hf([shards], model.shape), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight" or not model.shape.tied_embeddings]:
        raise RuntimeError(f"gathered weights do not fit {champion_dir} (missing {missing[:3]}, unexpected {unexpected[:3]})")
    if model.shape.tied_embeddings:
        hf.tie_weights()
    return hf


def save_megatron_candidate(
    model: MegatronPolicyWithValue, champion_dir: Path, base_dir: Path, out: Path, note: str = ""
) -> Path | None:
    """Gather the shards and write the HF candidate (weights, probe, critic) on tensor-parallel rank 0."""
    hf = gather_hf_policy(model, champion_dir, base_dir)
    if hf is None:
        return None
    return save_candidate(PolicyWithValue(hf, model.value_head), champion_dir, base_dir, out, note)
