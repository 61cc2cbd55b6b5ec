"""A local Prometheus for the platform (`tidal up --with-prometheus`): its settings and the configuration it runs on.

    gateway /metrics (job tidal-gateway) ────────────┐
    fleet   /metrics (job tidal-fleet)  ─────────────┼─▶ prometheus (infra/monitoring/rules.yml) ─▶ alerts, dashboard
    trainer ─push─▶ pushgateway (job tidal-training) ┘

A trainer lives minutes and may run in a pod nothing scrapes, so it pushes each iteration and each attempt's
outcome to a Pushgateway (training/run_metrics.py), which Prometheus scrapes with the pushed labels kept.
The binaries are Debian's `prometheus` and `prometheus-pushgateway` packages (`./run.sh setup` installs them). On a
cluster the Helm chart's Prometheus scrapes the same jobs (the chart's `metrics.pushgateway`) and loads the same rules.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from urllib.parse import unquote, urlsplit

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
    pushgateway_url: str | None = Field(
        None,
        pattern=r"^https?://[^/\s]+(/\S*)?$",
        description=(
            "The Prometheus Pushgateway trainers push to: each iteration's figures and each attempt's outcome "
            "(job tidal-training, training/run_metrics.py). None: training runs are not pushed (their metrics stay in "
            "MLflow). A loopback URL (http://127.0.0.1:9091) names a local one that `tidal up --with-prometheus` "
            "starts and scrapes; any other is your cluster's (the Helm chart's metrics.pushgateway)."
        ),
    )
    pushgateway_binary: str = Field(
        "prometheus-pushgateway",
        description="The Pushgateway executable a local pushgateway_url runs (a name on PATH or a path).",
    )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def local_pushgateway(cfg: PrometheusSettings) -> tuple[str, int] | None:
    """(host, port) of the Pushgateway `tidal up --with-prometheus` runs, when pushgateway_url is a loopback one."""
    if cfg.pushgateway_url is None:
        return None
    url = urlsplit(cfg.pushgateway_url)
    if url.hostname not in LOOPBACK:
        return None
    if url.path.strip("/") or url.username is not None:
        raise SettingsError(
            f"prometheus.pushgateway_url names a local Pushgateway with a path or a user ({url.hostname}:{url.port}): "
            "the one `tidal up` starts serves at the root, without auth; use http://HOST:PORT"
        )
    return url.hostname, url.port or 9091


def executable(cfg: PrometheusSettings, field: str = "binary") -> str:
    name = getattr(cfg, field)
    found = shutil.which(name)
    if found is None:
        package = "prometheus" if field == "binary" else "prometheus-pushgateway"
        raise SettingsError(
            f"prometheus.{field}={name!r} is not an executable on PATH: install Debian's {package} package "
            f"(`./run.sh setup` does, as root) or set prometheus.{field} to its path"
        )
    return found


def config(cfg: PrometheusSettings, gateway: str, fleet: str, rules: Path = RULES, capacity: str | None = None) -> dict:
    """prometheus.yml: the scrape jobs (host:port targets) and Tidal's rules. The Pushgateway's job keeps the labels
    the trainers pushed (honor_labels), so a run's `model` is the run's, not the Pushgateway's instance."""
    if not rules.is_file():
        raise SettingsError(f"Tidal's Prometheus rules are not at {rules}: run from a checkout (infra/monitoring/rules.yml)")
    every = f"{round(cfg.scrape_interval_s * 1000)}ms"
    jobs = [
        {"job_name": "tidal-gateway", "static_configs": [{"targets": [gateway]}]},
        {"job_name": "tidal-fleet", "static_configs": [{"targets": [fleet]}]},
    ]
    if capacity is not None:  # the capacity scheduler (capacity.mode tidal)
        jobs.append({"job_name": "tidal-capacity", "static_configs": [{"targets": [capacity]}]})
    if cfg.pushgateway_url is not None:
        url = urlsplit(cfg.pushgateway_url)
        job = {
            "job_name": "tidal-training",
            "honor_labels": True,
            "scheme": url.scheme,
            "metrics_path": url.path.rstrip("/") + "/metrics",
            "static_configs": [{"targets": [url.netloc.rpartition("@")[2]]}],
        }
        if url.username is not None:  # the trainers push with the same basic auth (training/run_metrics.py)
            job["basic_auth"] = {"username": unquote(url.username), "password": unquote(url.password or "")}
        jobs.append(job)
    return {
        "global": {"scrape_interval": every, "evaluation_interval": every},
        "rule_files": [str(rules)],
        "scrape_configs": jobs,
    }
