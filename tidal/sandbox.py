"""An isolated platform configuration: a fresh data directory and free loopback ports.

Tests, benchmarks and fault drills each run their own platform this way, beside any other.
"""

from __future__ import annotations

import os
import random
import tempfile
from contextlib import contextmanager
from pathlib import Path

import yaml

from tidal.procs import port_free
from tidal.section import deep_merge

BLOCK = 80  # ports per sandbox: services at +0..+4, spare for tests at +5..+7, the registry webhook at +8,
# Prometheus at +9, replicas from +10 to +69, a Pushgateway at +70, the capacity scheduler at +71
SPARE = 5  # offset of the spare ports (from prefect.port)


def port_block() -> int:
    """A random free block start in [20000, 32000): below the OS's ephemeral range (32768+), so outgoing
    connections can't take a sandbox's ports between choosing and binding them, and sandboxes
    running side by side rarely meet (the fleet skips replica ports in use anyway)."""
    rng = random.Random()
    for _ in range(50):
        base = 20000 + BLOCK * rng.randrange(12000 // BLOCK)
        if all(port_free("127.0.0.1", base + i) for i in (0, 1, 2, 3, 4, 10, 11, 12, 13, 70)):
            return base
    raise RuntimeError("no free port block found in [20000, 32000)")


def write_config(
    root: Path,
    models: list[dict],
    base_port: int | None = None,
    pretrain_seconds: float = 25.0,
    pushgateway: bool = False,
    **extra,
) -> Path:
    """tidal.yaml under root, every port from one block (random if base_port is None); with `pushgateway`, trainers
    push to a local Pushgateway on the block's port (Platform.up_pushgateway starts it).

    Secrets are fixed and public (clients alice and bob): a sandbox is for tests and benchmarks only.
    """
    b = port_block() if base_port is None else base_port
    config = {
        "data_dir": str(root / "data"),
        "prefect": {"port": b, "runner_port": b + 1},
        "mlflow": {"port": b + 2},
        "prometheus": {"port": b + 9, "scrape_interval_s": 1.0}
        | ({"pushgateway_url": f"http://127.0.0.1:{b + 70}"} if pushgateway else {}),
        "registry_webhook": {"port": b + 8},
        "capacity": {"port": b + 71},
        "fleet": {
            "admin_port": b + 3,
            "base_port": b + 10,
            "port_range": 60,
            "health_interval_s": 1.0,
            "restart_backoff_s": 1.0,
            "ready_timeout_s": 300,
        },
        "gateway": {
            "port": b + 4,
            "secret": "sandbox-request-id-secret",
            "clients": [
                {"client_id": "alice", "key": "alice-key-0123456789"},
                {"client_id": "bob", "key": "bob-key-0123456789ab"},
            ],
            "logsink": {"segment_max_age_s": 1.0, "upload_interval_s": 0.5},
            "rate_limit_rps": 100_000.0,
            "rate_limit_burst": 100_000,
        },  # load tests measure the gateway, not the limiter
        "admin_token": "sandbox-admin-token",
        "models": models,
        "bootstrap": {"pretrain": {"max_seconds": pretrain_seconds, "eval_bytes": 50_000}, "probe_prompts": 3},
        # records reach the store within segment age + upload interval (1.5 s) of their completion
        "collect": {"upload_grace_s": 2.0},
    }
    deep_merge(config, extra)
    path = root / "tidal.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@contextmanager
def sandbox_platform(
    models: list[dict],
    base_port: int | None = None,
    fleet: bool = True,
    gateway: bool = False,
    gateway_settings: dict | None = None,
    **config,
):
    """A whole platform for a benchmark: servers, a short bootstrap, fleet, gateway; always torn down.
    gateway_settings merge into the sandbox's `gateway` section (config's other sections likewise)."""
    from tidal.client_env import use_platform_env
    from tidal.platform import Platform
    from tidal.settings import load_settings

    root = Path(tempfile.mkdtemp(prefix="tidal-sandbox-"))
    for key in [k for k in os.environ if k.startswith("TIDAL_")]:
        del os.environ[key]  # the sandbox's own configuration only
    if gateway_settings:
        config["gateway"] = gateway_settings
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
