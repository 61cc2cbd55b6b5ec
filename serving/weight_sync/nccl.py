"""`nccl`: vLLM's weight-transfer engine moves a checkpoint into a running engine over NCCL, through a process
group created for that one update and torn down after it. Deploy/retire semantics, the pause frame, the probe
and the rollback (a reload of the old checkpoint from disk) are serving/weight_sync/inplace.py's.

Per update of one replica:
    GET /get_world_size                    the engine's workers (TP × PP × DP) → group size 1 + N
    a fresh rendezvous                     a free port not used by the last updates, a new update id
    sender process (nccl_sender.py)        in the engine environment, on engine.nccl_sender_gpu: rank 0;
                                           it drives /init_weight_transfer_engine, /start_weight_update,
                                           /update_weights ∥ NCCL broadcast, /finish_weight_update,
                                           /update_weight_version, then destroys its communicator
    POST /shutdown_weight_transfer_engine  the workers' communicator goes too (always, even after a failure)

Never one long-lived group: a sender that dies takes only its own update down. Engines of `nccl` models are
launched with --weight-transfer-config '{"backend": "nccl"}' (serving/engine.py). The sender runs next to the
supervisor, so only the local runtime can use this strategy; NCCL allows one rank per GPU, so the sender needs
a GPU the engine does not use.

Written against vLLM 0.32's source (vllm/distributed/weight_transfer/, vllm/entrypoints/rl/online/api_router.py)
and not run here: bench/gpu_check.sh and tests/integration/test_gpu_weight_sync.py must pass on a GPU machine.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from serving.engine import EngineError
from serving.weight_sync.inplace import Call, InPlaceSync
from tidal.procs import free_port

log = logging.getLogger("tidal.fleet")

SENDER = Path(__file__).with_name("nccl_sender.py")
SHUTDOWN_TIMEOUT_S = 60.0  # a worker stuck in a dead sender's broadcast never answers: do not wait for long


@dataclass(frozen=True)
class Rendezvous:
    """Where one update's process group meets: the sender is rank 0, the engine's workers 1..world_size-1."""

    address: str
    port: int
    world_size: int
    update_id: str


def fresh_rendezvous(address: str, engine_workers: int, recent: deque, pick=free_port, tries: int = 20) -> Rendezvous:
    """A rendezvous for one update only: a port the OS says is free that none of the `recent` updates used
    (their TCP stores may still linger), and a new update id. Remembers the port in `recent`."""
    if engine_workers < 1:
        raise EngineError(f"the engine reports {engine_workers} workers; expected at least 1")
    for _ in range(tries):
        port = pick(address)
        if port not in recent:
            recent.append(port)
            return Rendezvous(address, port, 1 + engine_workers, uuid.uuid4().hex[:12])
    raise EngineError(f"no fresh rendezvous port on {address} after {tries} tries")


def sender_command(
    python: str, engine_url: str, checkpoint: str, rdv: Rendezvous, weight_version: str, timeout_s: float
) -> list[str]:
    return [
        python,
        str(SENDER),
        "--engine-url",
        engine_url,
        "--checkpoint",
        checkpoint,
        "--master-address",
        rdv.address,
        "--master-port",
        str(rdv.port),
        "--world-size",
        str(rdv.world_size),
        "--weight-version",
        weight_version,
        "--timeout",
        str(timeout_s),
        "--update-id",
        rdv.update_id,
    ]


def sender_env(sender_gpu: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDAL_")}
    if sender_gpu:
        env["CUDA_VISIBLE_DEVICES"] = sender_gpu
    return env


class NcclSync(InPlaceSync):
    name = "nccl"
    cpu_reason = "NCCL weight transfer moves CUDA tensors between the sender's and the engine's GPUs"

    def __init__(self) -> None:
        self.recent_ports: deque[int] = deque(maxlen=32)

    def swap(self, fleet, group, replica, client, info, path: str) -> list[Call]:
        engine = fleet.settings.engine
        r = client.http.get("/get_world_size")
        if not r.is_success:
            raise EngineError(
                f"GET {client.url}/get_world_size -> {r.status_code}: {r.text[:300]} (engines need VLLM_SERVER_DEV_MODE=1)"
            )
        rdv = fresh_rendezvous(replica.host, int(r.json()["world_size"]), self.recent_ports)
        cmd = sender_command(
            str(engine.resolved_python()), replica.url, path, rdv, info.served_name, engine.weight_update_timeout_s
        )
        log.info(
            "nccl update %s: %s -> %s over %s:%d (world %d)",
            rdv.update_id,
            info.served_name,
            replica.name,
            rdv.address,
            rdv.port,
            rdv.world_size,
        )
        failure = None
        try:
            out = subprocess.run(
                cmd,
                env=sender_env(engine.nccl_sender_gpu),
                capture_output=True,
                text=True,
                timeout=engine.weight_update_timeout_s,
                stdin=subprocess.DEVNULL,
            )
            if out.returncode != 0:
                failure = (
                    f"nccl sender of update {rdv.update_id} exited with {out.returncode}: "
                    f"{(out.stderr or out.stdout).strip()[-800:]}"
                )
        except subprocess.TimeoutExpired as e:
            failure = f"nccl sender of update {rdv.update_id} ran past {e.timeout:.0f} s (engine.weight_update_timeout_s)"
        try:
            shut_down_transfer(client, rdv)
        except Exception as e:  # noqa: BLE001  the sender's failure, if any, is the one to report
            failure = f"{failure}; then {e}" if failure else str(e)
        if failure:
            raise EngineError(failure)
        log.info("nccl update %s done: %s", rdv.update_id, last_json_line(out.stdout))
        return []


def shut_down_transfer(client, rdv: Rendezvous) -> None:
    """The workers' end of this update's group goes, whatever happened to the sender. A worker still blocked in
    the group (a sender died mid-broadcast) cannot answer: the error surfaces and the rollback restarts it."""
    r = client.http.post("/shutdown_weight_transfer_engine", timeout=SHUTDOWN_TIMEOUT_S)
    if r.status_code == 404:  # a vLLM without the route: the next init replaces the communicator
        log.warning(
            "engine %s has no /shutdown_weight_transfer_engine; update %s's group is left to the next one",
            client.url,
            rdv.update_id,
        )
    elif not r.is_success:
        raise EngineError(f"shutting down update {rdv.update_id}'s group on {client.url} -> {r.status_code}: {r.text[:300]}")


def last_json_line(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return {}
