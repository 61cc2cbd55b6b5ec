"""`nccl`: vLLM's weight-transfer engine, a process group created for one update and torn down after."""

from __future__ import annotations

from serving.weight_sync.base import GpuPathPending


class NcclSync(GpuPathPending):
    name = "nccl"
    cpu_reason = "NCCL weight transfer moves CUDA tensors between trainer and engine GPUs"
