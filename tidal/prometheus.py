"""A local Prometheus for the platform (`tidal up --with-prometheus`): its settings and the configuration it runs on.

    gateway /metrics (job tidal-gateway) ─┐
                                          ├─▶ prometheus (infra/monitoring/rules.yml) ─▶ alerts, the Grafana dashboard
    fleet   /metrics (job tidal-fleet)  ──┘

The binary is Debian's `prometheus` package (`./run.sh setup` installs it). On a cluster the Helm chart's Prometheus
scrapes the same two jobs and loads the same rules.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from pydantic import Field

from tidal.section import Section, SettingsError

RULES = Path(__file__).resolve().parents[1] / "infra" / "monitoring" / "rules.yml"


class PrometheusSettings(Section):
    host: str = Field("127.0.0.1", description="Address Prometheus binds to.")
    port: int = Field(9090, ge=1, le=65535, description="Prometheus web/API port.")
    scrape_interval_s: float = Field(
        15.0, gt=0, le=300, description="How often it scrapes the gateway and the supervisor, and evaluates the rules."
    )
    retention: str = Field("15d", pattern=r"^\d+[smhdwy]$", description="How long it keeps samples (e.g. 15d, 12h).")
    binary: str = Field("prometheus", description="The Prometheus executable (a name on PATH or a path).")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def executable(cfg: PrometheusSettings) -> str:
    found = shutil.which(cfg.binary)
    if found is None:
        raise SettingsError(
            f"prometheus.binary={cfg.binary!r} is not an executable on PATH: install Debian's prometheus package "
            "(`./run.sh setup` does, as root) or set prometheus.binary to its path"
        )
    return found


def config(cfg: PrometheusSettings, gateway: str, fleet: str, rules: Path = RULES) -> dict:
    """prometheus.yml: the two scrape jobs (host:port targets) and Tidal's rules."""
    if not rules.is_file():
        raise SettingsError(f"Tidal's Prometheus rules are not at {rules}: run from a checkout (infra/monitoring/rules.yml)")
    every = f"{round(cfg.scrape_interval_s * 1000)}ms"
    return {
        "global": {"scrape_interval": every, "evaluation_interval": every},
        "rule_files": [str(rules)],
        "scrape_configs": [
            {"job_name": "tidal-gateway", "static_configs": [{"targets": [gateway]}]},
            {"job_name": "tidal-fleet", "static_configs": [{"targets": [fleet]}]},
        ],
    }
