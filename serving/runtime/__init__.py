"""Where the fleet's engines run: one interface (base.EngineRuntime), one module per runtime.

    local        subprocesses of the supervisor (local.py)

The fleet calls it through one code path (serving/fleet.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from serving.runtime.base import EngineRuntime

if TYPE_CHECKING:
    from tidal.settings import TidalSettings


def runtime_for(settings: TidalSettings) -> EngineRuntime:
    """The runtime the fleet's engines run in."""
    from serving.runtime.local import LocalRuntime

    return LocalRuntime(settings)


__all__ = ["EngineRuntime", "runtime_for"]
