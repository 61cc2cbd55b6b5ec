"""Data-parallel plumbing of the PPO trainer: the process group torchrun sets up, this process's rank, and the
sums every rank shares.

`torchrun --nproc-per-node N -m training.job train SPEC` starts N copies of the trainer with WORLD_SIZE, RANK,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT set (torch.distributed.run). `init_from_env` joins them into one process
group: NCCL with one GPU per process (cuda:LOCAL_RANK) when CUDA is available, else gloo on the CPU.

Without WORLD_SIZE, or with WORLD_SIZE=1, no process group exists and every helper is the single-process
identity (world 1, rank 0, a sum of one term): the trainer then runs exactly as a plain `python -m training.job`,
on the machine's GPU when it has one (train.ppo.device).

Every rank computes the same plan, minibatch order and stop decisions, so all ranks call each collective below
at the same point. A rank that fails exits non-zero and torchrun, which watches every worker, stops the others
(a rank blocked in a collective never waits for a peer that is gone); the job then exits non-zero.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# Longest wait inside one collective. The other ranks wait in one while rank 0 alone downloads the champion or
# uploads a checkpoint (a full fine-tune's state is ~3x its weights: weights and Adam's two moments).
TIMEOUT = timedelta(minutes=60)
# Gradients are summed in flat float32 buckets of at most this many elements (64 MiB): one collective per
# bucket instead of one per tensor, without a second copy of a full fine-tune's gradients.
BUCKET_ELEMENTS = 1 << 24
_TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class LaunchEnvError(ValueError):
    """How this process was started does not fit (torchrun variables missing or inconsistent, more processes than
    GPUs or than rows per batch); the message names what and the fix. The same launch would fail the same way."""


@dataclass(frozen=True)
class Launch:
    """What torchrun told this process (world 1, rank 0 when it was started without torchrun)."""

    world: int = 1
    rank: int = 0
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class DataParallel:
    """The processes that split each batch between them: this process's place among them, and the group their
    sums run over. Plain data parallel: every process (group None = the whole world). The Megatron backend: the
    processes that hold the same tensor-parallel shard (its data-parallel group), while the processes of one
    tensor-parallel group see the same rows."""

    rank: int = 0
    size: int = 1
    group: Any = None


def launch_env(environ: Mapping[str, str] | None = None) -> Launch:
    """Read WORLD_SIZE, RANK and LOCAL_RANK; with WORLD_SIZE > 1 every variable torchrun sets must be there."""
    env = os.environ if environ is None else environ
    try:
        world = int(env.get("WORLD_SIZE", "1"))
        if world == 1:
            return Launch()
        missing = [v for v in _TORCHRUN_VARS if not env.get(v)]
        if missing:
            raise LaunchEnvError(
                f"WORLD_SIZE={world} but {', '.join(missing)} not set: start several trainer processes with torchrun "
                "(torchrun --nproc-per-node N -m training.job ...), which sets them all, or unset WORLD_SIZE for one"
            )
        launch = Launch(world, int(env["RANK"]), int(env["LOCAL_RANK"]))
    except ValueError as e:
        if isinstance(e, LaunchEnvError):
            raise
        shown = {v: env.get(v) for v in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
        raise LaunchEnvError(
            f"torchrun variables are not integers ({shown}): start the trainer with torchrun, or "
            "without WORLD_SIZE for one process"
        ) from None
    if world < 1 or not 0 <= launch.rank < world or launch.local_rank < 0:
        raise LaunchEnvError(
            f"inconsistent torchrun variables WORLD_SIZE={world}, RANK={launch.rank}, "
            f"LOCAL_RANK={launch.local_rank}: need 0 <= RANK < WORLD_SIZE and LOCAL_RANK >= 0"
        )
    return launch


def init_from_env(environ: Mapping[str, str] | None = None) -> Launch:
    """Join torchrun's process group (env:// rendezvous); nothing for one process or when already joined."""
    launch = launch_env(environ)
    if launch.world == 1 or active():
        return launch
    if torch.cuda.is_available():
        if launch.local_rank >= torch.cuda.device_count():
            raise LaunchEnvError(
                f"LOCAL_RANK={launch.local_rank} but this node has {torch.cuda.device_count()} GPUs: "
                "start at most one process per GPU (trainer.kubernetes.gpus_per_node)"
            )
        torch.cuda.set_device(launch.local_rank)
        backend = "nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend, timeout=TIMEOUT)
    return launch


def close() -> None:
    """Leave the process group (after the last collective of every rank)."""
    if active():
        dist.destroy_process_group()


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def data_parallel() -> DataParallel:
    """Plain data parallel: every process of the job splits the batch."""
    return DataParallel(rank(), world_size(), None)


def is_main() -> bool:
    return rank() == 0


def _nccl() -> bool:
    return active() and dist.get_backend() == "nccl"


def device(prefer: str = "auto") -> torch.device:
    """Where this rank computes: its own GPU under NCCL (cuda:LOCAL_RANK); a process in a gloo group on the CPU;
    one process (no group) on its GPU for `prefer` 'auto' or 'cuda' when CUDA is available, else the CPU.
    `prefer` is train.ppo.device; 'cuda' without a GPU, or a GPU run asked to stay on the CPU, is refused."""
    if _nccl():
        if prefer == "cpu":
            raise LaunchEnvError(
                "train.ppo.device='cpu' but torchrun joined an NCCL group (CUDA is available): set device='auto', "
                "or hide the GPUs (CUDA_VISIBLE_DEVICES='') for a CPU run"
            )
        return torch.device("cuda", torch.cuda.current_device())
    if prefer == "cuda" and (active() or not torch.cuda.is_available()):
        raise LaunchEnvError(
            "train.ppo.device='cuda' but "
            + ("this process group is gloo (CPU)" if active() else "no CUDA device is visible to this process")
            + ": run the trainer where a GPU is (trainer.kubernetes.gpus_per_node), or set device='auto'"
        )
    if prefer in ("auto", "cuda") and not active() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    if active():
        dist.barrier(device_ids=[torch.cuda.current_device()]) if _nccl() else dist.barrier()


@contextmanager
def main_first() -> Iterator[None]:
    """Rank 0 runs the block first, then the other ranks (e.g. rank 0 fills a download cache the node's ranks
    share, the others then find it complete instead of downloading the same files at once)."""
    if not is_main():
        barrier()
    yield
    if is_main():
        barrier()


def sum_all(t: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Element-wise sum of `t` over the ranks of `group` (None: all; a new tensor; `t` itself for one process)."""
    if not active():
        return t
    out = t.clone()
    dist.all_reduce(out, group=group)
    return out


def sum_grads(params: Sequence[torch.Tensor], extra: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Replace every parameter's gradient by its sum over ranks, and return the sum of the 1-d float `extra`
    (e.g. a minibatch's loss terms), in float32 buckets. A parameter without a gradient on this rank (a rank
    with no rows in the minibatch) adds zeros; it still joins every collective, as all ranks must."""
    if not active():
        return extra
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    buckets: list[list[torch.Tensor]] = [[]]
    size = 0
    for p in params:
        if size and size + p.numel() > BUCKET_ELEMENTS:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.numel()
    for i, bucket in enumerate(buckets):
        last = i == len(buckets) - 1
        parts = [p.grad.reshape(-1).float() for p in bucket] + ([extra.reshape(-1).float()] if last else [])
        flat = torch.cat(parts)  # (elements of the bucket [+ len(extra)],)
        dist.all_reduce(flat, group=group)
        offset = 0
        for p in bucket:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
    return flat[offset:].to(extra.dtype)


def gather_dicts(part: dict, group: Any = None) -> dict:
    """The union of every rank's `part` (keys disjoint across the ranks of `group`, None: all), on every rank;
    values travel pickled."""
    if not active():
        return part
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, part, group=group)
    return {k: v for p in parts for k, v in p.items()}


def broadcast(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (picklable, small: a key, a flag)."""
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
