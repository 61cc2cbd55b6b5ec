"""Megatron's model-parallel state on top of the job's process group.

torchrun starts tp * pp * dp processes; Megatron splits them into tensor-, pipeline- and data-parallel
groups (ranks of one tensor-parallel group are adjacent, so a group stays inside one node). The default
process group must exist first: the trainer's (training/distributed.py under torchrun), or one this module
opens for a single process, so that a one-process run needs no launcher.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tidal.procs import free_port


def init_model_parallel(tp: int = 1, pp: int = 1, seed: int = 0) -> None:
    """Set up Megatron's groups for tensor_parallel=tp, pipeline_parallel=pp (the rest is data parallel)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mp_random

    from training.distributed import LaunchEnvError

    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise LaunchEnvError(
                "started by torchrun but no process group is open: open it (training.distributed) before the Megatron backend"
            )
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    world = dist.get_world_size()
    if world % (tp * pp):
        raise LaunchEnvError(
            f"{world} processes do not split into tensor_parallel={tp} x pipeline_parallel={pp}: "
            f"start a multiple of {tp * pp} processes (torchrun --nproc-per-node)"
        )
    if ps.model_parallel_is_initialized():
        if (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()) != (tp, pp):
            raise RuntimeError("Megatron's model-parallel state is already set up with another layout")
        return
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    if torch.cuda.is_available():
        mp_random.model_parallel_cuda_manual_seed(seed)
    else:
        _answer_cuda_device_with_cpu()
        # No CUDA generator to fork on a CPU; the backend runs without dropout, so forward passes draw no
        # random numbers and the no-op tracker changes nothing.
        mp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def _answer_cuda_device_with_cpu() -> None:
    """megatron-core allocates buffers and moves RoPE tables to `torch.cuda.current_device()`, which raises on a
    machine without CUDA. There, and only there, that call answers the CPU: CPU runs (tests, conversion checks)
    use the same megatron code as GPU runs instead of a copy of it. A CUDA machine is left untouched."""
    if torch.cuda.is_available():
        return
    torch.cuda.current_device = lambda: torch.device("cpu")  # the one shim: see the docstring


def device() -> torch.device:
    """Where the shards live: megatron-core computes on the current CUDA device wherever one exists (its RoPE
    tables and buffers go there), so a Megatron run uses the GPU even as one process; else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def destroy_model_parallel() -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()


def data_parallel():
    """The processes that split each batch: Megatron's data-parallel group (one rank per tensor-parallel shard
    position); the processes of one tensor-parallel group see the same rows."""
    from megatron.core import parallel_state as ps

    from training.distributed import DataParallel

    return DataParallel(ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), ps.get_data_parallel_group())


def tensor_parallel_rank() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank()


def gather_tensor_parallel(obj):
    """Every tensor-parallel rank's `obj`, in rank order, on every rank of the group (pickled: states, shards)."""
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() == 1:
        return [obj]
    out = [None] * ps.get_tensor_model_parallel_world_size()
    dist.all_gather_object(out, obj, group=ps.get_tensor_model_parallel_group())
    return out
