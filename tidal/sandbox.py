"""An isolated platform configuration: a fresh data directory and free loopback ports.

Tests, benchmarks and fault drills each run their own platform this way, beside any other.
"""

from __future__ import annotations

import os
import random
import socket
import tempfile
from contextlib import contextmanager
from pathlib import Path

import yaml

from tidal.procs import port_free


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replica_port_block(size: int = 60) -> int:
    """A random block start in [20000, 30000) (below the OS's ephemeral range), so sandboxes running
    side by side rarely share replica ports; the fleet skips ports in use anyway."""
    rng = random.Random()
    for _ in range(50):
        base = 20000 + size * rng.randrange(10000 // size)
        if all(port_free("127.0.0.1", base + i) for i in range(4)):
            return base
    raise RuntimeError("no free replica port block found in [20000, 30000)")


def write_config(root: Path, models: list[dict], base_port: int | None = None, pretrain_seconds: float = 25.0, **extra) -> Path:
    """tidal.yaml under root; replica ports from [base_port, base_port+60) (random block if None), services from the OS.

    Secrets are fixed and public (clients alice and bob): a sandbox is for tests and benchmarks only.
    """
    base_port = replica_port_block() if base_port is None else base_port
    config = {
        "data_dir": str(root / "data"),
        "prefect": {"port": free_port(), "runner_port": free_port()},
        "mlflow": {"port": free_port()},
        "fleet": {"admin_port": free_port(), "base_port": base_port, "port_range": 60, "health_interval_s": 1.0,
                  "restart_backoff_s": 1.0, "ready_timeout_s": 300},
        "gateway": {"port": free_port(), "secret": "sandbox-request-id-secret",
                    "clients": [{"client_id": "alice", "key": "alice-key-0123456789"}, {"client_id": "bob", "key": "bob-key-0123456789ab"}],
                    "logsink": {"segment_max_age_s": 1.0, "upload_interval_s": 0.5},
                    "rate_limit_rps": 100_000.0, "rate_limit_burst": 100_000},  # load tests measure the gateway, not the limiter
        "admin_token": "sandbox-admin-token",
        "models": models,
        "bootstrap": {"pretrain": {"max_seconds": pretrain_seconds, "eval_bytes": 50_000}, "probe_prompts": 3},
        **extra,
    }
    path = root / "tidal.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@contextmanager
def sandbox_platform(models: list[dict], base_port: int | None = None, fleet: bool = True, gateway: bool = False, **config):
    """A whole platform for a benchmark: servers, a short bootstrap, fleet, gateway; always torn down."""
    from tidal.platform import Platform, use_platform_env
    from tidal.settings import load_settings

    root = Path(tempfile.mkdtemp(prefix="tidal-sandbox-"))
    for key in [k for k in os.environ if k.startswith("TIDAL_")]:
        del os.environ[key]  # the sandbox's own configuration only
    os.environ["TIDAL_CONFIG"] = str(write_config(root, models, base_port, **config))
    settings = load_settings()
    use_platform_env(settings)
    platform = Platform(settings)
    try:
        platform.up_servers()
        from flows.bootstrap import bootstrap  # after use_platform_env: Prefect reads its API URL on import

        for m in models:
            bootstrap(model=m["name"])
        if fleet:
            platform.up_fleet()
        if gateway:
            platform.up_gateway()
        yield settings, platform
    finally:
        platform.down()
