"""`nccl`: vLLM's weight-transfer engine, a process group created for one update and torn down after."""

from __future__ import annotations

from serving.weight_sync.base import StrategyUnavailable, WeightSync


class NcclSync(WeightSync):
    name = "nccl"
    gpu_only = True
    cpu_reason = "NCCL weight transfer moves CUDA tensors between trainer and engine GPUs"

    def deploy(self, fleet, group, info):
        raise StrategyUnavailable("the 'nccl' GPU path is not implemented yet; use 'restart'")

    def retire(self, fleet, group, info):
        raise StrategyUnavailable("the 'nccl' GPU path is not implemented yet; use 'restart'")
