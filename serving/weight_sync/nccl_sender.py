"""The sender of one `nccl` update: a checkpoint directory onto one vLLM engine's GPUs, then gone.

Run by the `nccl` strategy (serving/weight_sync/nccl.py) with the engine environment's interpreter, as a
script (`python .../nccl_sender.py ...`): that environment holds CUDA torch and vLLM's trainer-side client but
not the platform's packages, so this file imports only the standard library at module level, and torch, vLLM
and safetensors inside main().

    1. opens rank 0 of a NEW process group at --master-address:--master-port (a port the strategy picked for
       this update only) with the engine's workers at ranks 1..N, through vLLM's NCCLTrainerWeightTransferEngine
       (which POSTs /init_weight_transfer_engine while it rendezvouses);
    2. sends every tensor of the checkpoint's safetensors files (it POSTs /start_weight_update, /update_weights
       concurrently with the broadcast, then /finish_weight_update);
    3. labels the engine's weights (--weight-version, POST /update_weight_version) and destroys its end of the
       group. The strategy then POSTs /shutdown_weight_transfer_engine, which destroys the workers' end.

NCCL allows one rank per GPU in a group: the sender's GPU (CUDA_VISIBLE_DEVICES, engine.nccl_sender_gpu) must
not be one the engine's workers use. Prints one JSON line: {"tensors", "bytes", "seconds"}.

Written against vLLM 0.32's source (vllm/distributed/weight_transfer/nccl_engine.py, clients.py, base.py) and not
run here: bench/gpu_check.sh runs it on a GPU machine.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import time
from pathlib import Path

# safetensors dtype codes → torch dtype names
DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


def safetensors_header(path: Path) -> dict:
    """The JSON header of a .safetensors file: {name: {"dtype", "shape", "data_offsets"}, "__metadata__": ...}."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100_000_000:
            raise ValueError(f"{path}: implausible safetensors header length {n}")
        return json.loads(f.read(n))


def checkpoint_tensors(directory: Path) -> list[tuple[Path, str, str, tuple[int, ...]]]:
    """(file, tensor name, torch dtype name, shape) of every tensor of a checkpoint, in the one order both the
    metadata sent ahead and the broadcast follow: files by name, tensors by name."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} holds no .safetensors files")
    out = []
    for f in files:
        header = safetensors_header(f)
        for name in sorted(k for k in header if k != "__metadata__"):
            code = header[name]["dtype"]
            if code not in DTYPES:
                raise ValueError(f"{f.name}: tensor {name} has dtype {code}, which this sender does not map")
            out.append((f, name, DTYPES[code], tuple(header[name]["shape"])))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine-url", required=True, help="the engine's HTTP root, e.g. http://127.0.0.1:8100")
    p.add_argument("--checkpoint", required=True, type=Path, help="HF checkpoint directory (safetensors)")
    p.add_argument("--master-address", required=True, help="address of this update's rendezvous (this host)")
    p.add_argument("--master-port", required=True, type=int, help="port of this update's rendezvous")
    p.add_argument("--world-size", required=True, type=int, help="1 (this sender) + the engine's workers")
    p.add_argument("--weight-version", default="", help="label the engine reports at /weight_info afterwards")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for each engine HTTP call")
    p.add_argument("--update-id", default="", help="names this update in the logs")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    entries = checkpoint_tensors(args.checkpoint)
    if args.world_size < 2:
        raise SystemExit(f"--world-size {args.world_size}: the sender and at least one engine worker are needed")

    import requests
    import torch
    from safetensors import safe_open
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

    if not torch.cuda.is_available():
        raise SystemExit("the nccl sender needs a CUDA device (none visible: check engine.nccl_sender_gpu)")
    torch.cuda.set_device(0)

    class CheckpointSource(WeightSource):
        """The checkpoint's tensors, loaded onto this GPU one file at a time, in checkpoint_tensors' order."""

        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(name, getattr(torch, dtype), shape) for _, name, dtype, shape in entries]

        def __iter__(self):
            current, handle = None, None
            for f, name, _, _ in entries:
                if f != current:
                    current, handle = f, safe_open(str(f), framework="pt", device="cuda:0")
                yield name, handle.get_tensor(name)

    t0 = time.monotonic()
    client = HTTPVLLMWeightSyncClient(args.engine_url, timeout=args.timeout)
    init = NCCLTrainerInitInfo(
        master_address=args.master_address, master_port=args.master_port, world_size=args.world_size, rank=0
    )
    engine = NCCLTrainerWeightTransferEngine.trainer_init(init, client=client, source=CheckpointSource())
    try:
        engine.send_weights()  # start_weight_update, update_weights ∥ broadcast, finish_weight_update
    finally:
        engine.shutdown()  # this update's communicator goes with it, whatever happened
    if args.weight_version:
        r = requests.post(
            f"{args.engine_url.rstrip('/')}/update_weight_version",
            json={"new_version": args.weight_version},
            timeout=args.timeout,
        )
        if r.status_code != 404:  # an engine without the route still got the weights
            r.raise_for_status()
    size = sum(torch.Size(shape).numel() * getattr(torch, dtype).itemsize for _, _, dtype, shape in entries)
    print(
        json.dumps(
            {"update_id": args.update_id, "tensors": len(entries), "bytes": size, "seconds": round(time.monotonic() - t0, 3)}
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
