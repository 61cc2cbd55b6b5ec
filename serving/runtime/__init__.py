"""Where the fleet's engines run: one interface (base.EngineRuntime), one module per runtime.

    local        subprocesses of the supervisor (local.py)
    kubernetes   pods of one Deployment per (model, base version) (kubernetes.py, k8s_manifest.py)

The fleet calls whichever `fleet.runtime` names, through the same code path (serving/fleet.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from serving.runtime.base import EngineRuntime

if TYPE_CHECKING:
    from serving.settings import ServingSettings


def runtime_for(settings: ServingSettings) -> EngineRuntime:
    """The runtime `fleet.runtime` names (the Kubernetes client is imported only when it is the one)."""
    if settings.fleet.runtime == "local":
        from serving.runtime.local import LocalRuntime

        return LocalRuntime(settings)
    if settings.fleet.runtime == "kubernetes":
        from serving.runtime.kubernetes import KubernetesRuntime

        return KubernetesRuntime(settings)
    raise ValueError(f"unknown fleet.runtime {settings.fleet.runtime!r}; expected 'local' or 'kubernetes'")


__all__ = ["EngineRuntime", "runtime_for"]
