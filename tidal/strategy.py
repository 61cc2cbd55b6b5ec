"""How a model's new versions reach its replicas, and which candidates each way can serve (a leaf: no imports
of settings, serving or training)."""

from __future__ import annotations

from typing import Literal

UpdateStrategy = Literal["lora", "restart", "reload", "nccl"]
GPU_ONLY_STRATEGIES = {"reload", "nccl"}  # swap weights into running CUDA engines (serving/weight_sync/)


def strategy_mismatch(strategy: str, lora: bool) -> str | None:
    """Why candidates trained with `lora` cannot be served by `strategy`, with the fix; None when they can.
    'lora' loads adapters beside the base; the others load full checkpoints."""
    if strategy == "lora" and not lora:
        return (
            "training every weight (lora=false) makes full-checkpoint candidates, which the 'lora' strategy "
            "cannot load: serve the model with 'restart' (or 'reload'/'nccl' on GPU engines), or train an adapter "
            "(lora=true)"
        )
    if strategy != "lora" and lora:
        return (
            f"an adapter candidate (lora=true) cannot be served by {strategy!r}, which loads full checkpoints: "
            "train every weight (lora=false), or serve the model with 'lora'"
        )
    return None


def model_mismatch(model: str, strategy: str, lora: bool, lora_setting: str) -> str | None:
    """strategy_mismatch for one model, naming the model and the `lora` setting that trains its candidates."""
    problem = strategy_mismatch(strategy, lora)
    return problem and f"model {model!r} (update_strategy {strategy!r}) with {lora_setting}={str(lora).lower()}: {problem}"
