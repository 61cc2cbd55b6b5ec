"""The local platform: Prefect server, MLflow server and the fleet supervisor as supervised processes.

`up` is idempotent (running services are reused), `down` leaves nothing running, `status` reads pid
files and health endpoints. Each service maps to one Kubernetes workload in production.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml
from pydantic import BaseModel, Field

from capacity.api import CapacityStatus
from serving.fleet_replies import FleetState, FleetStatus
from tidal import prometheus
from tidal.client_env import TELEMETRY_OFF
from tidal.core_settings import ServerAccess
from tidal.flywheel_pause import PauseRecord, paused
from tidal.procs import (
    NotReady,
    ProcInfo,
    alive,
    group_members,
    read_procinfo,
    require_port,
    save_procinfo,
    spawn,
    stop_group,
    tail,
    wait_http,
    wait_port_free,
)
from tidal.section import SettingsError
from tidal.settings import TidalSettings
from tidal.store import download_dir, open_store
from tidal.tokens import admin_token, fernet_key, secret

log = logging.getLogger("tidal.platform")


class ServiceStatus(BaseModel):
    """One process `tidal up` runs, as `tidal status` shows it."""

    remote: bool = Field(False, description="A server configured by URL: `tidal` runs no process for it.")
    running: bool = Field(description="Its process is alive (False for a remote server).")
    pid: int | None
    url: str
    healthy: bool = Field(description="Its readiness URL answered 2xx.")
    log: str = Field(description="Its log file.")


class PlatformStatus(BaseModel):
    """`tidal status`: the platform's processes, and the fleet's state when its supervisor is healthy."""

    services: dict[str, ServiceStatus]
    fleet: FleetStatus | None = None
    capacity: CapacityStatus | None = None  # capacity.mode tidal, while the scheduler answers
    paused: dict[str, PauseRecord] = {}  # model → the `tidal pause` in force (models absent run)
    data_docs: dict[str, str] = {}  # model → a local link to its latest collection's Data Docs (file URI)


@dataclass
class Service:
    name: str
    cmd: list[str]
    host: str
    port: int
    port_setting: str  # the setting to change when the port is taken
    ready_url: str
    ready_timeout_s: float
    url: str
    env: dict[str, str] = field(default_factory=dict)
    dirs: list[Path] = field(default_factory=list)  # made before the process starts


class Platform:
    def __init__(self, settings: TidalSettings):
        self.settings = settings
        self.run_dir, self.log_dir = settings.run_dir, settings.log_dir

    # ---- services -------------------------------------------------------------------------------
    def services(self) -> dict[str, Service]:
        s, data, py = self.settings, self.settings.data_path, sys.executable
        mlflow_env = {
            **TELEMETRY_OFF,
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
            # the registry webhook's receiver is on this host (http, a loopback address); MLflow keeps webhook secrets
            # encrypted with this key, which must outlive a restart and be the same in every server worker
            "MLFLOW_WEBHOOK_ALLOWED_SCHEMES": "http,https",
            "MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS": "true",
            "MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY": fernet_key(secret(data, "mlflow_webhook_key")),
        }
        if s.store.s3_endpoint_url:
            mlflow_env["MLFLOW_S3_ENDPOINT_URL"] = s.store.s3_endpoint_url
        child = {"TIDAL_CONFIG": str(self.settings_file)}
        return {
            "prefect": Service(
                "prefect",
                [py, "-m", "prefect", "server", "start", "--host", s.prefect.host, "--port", str(s.prefect.port)],
                s.prefect.host,
                s.prefect.port,
                "prefect.port",
                f"{s.prefect.api_url}/health",
                s.prefect.ready_timeout_s,
                s.prefect.api_url.removesuffix("/api") if s.prefect.remote else f"http://{s.prefect.host}:{s.prefect.port}",
                {
                    **TELEMETRY_OFF,
                    "PREFECT_HOME": str(data / "prefect"),
                    "PREFECT_API_URL": s.prefect.api_url,
                    "PREFECT_SERVER_DATABASE_TIMEOUT": str(s.prefect.database_timeout_s),
                    "PREFECT_SERVER_DATABASE_CONNECTION_TIMEOUT": str(s.prefect.database_timeout_s),
                },
            ),
            "mlflow": Service(
                "mlflow",
                [
                    py,
                    "-m",
                    "mlflow",
                    "server",
                    "--host",
                    s.mlflow.host,
                    "--port",
                    str(s.mlflow.port),
                    "--workers",
                    str(s.mlflow.workers),
                    "--backend-store-uri",
                    f"sqlite:///{data / 'mlflow' / 'mlflow.db'}",
                    "--artifacts-destination",
                    f"{s.store.routes.get('mlflow-artifacts', s.store_url).rstrip('/')}/mlflow-artifacts",
                ],
                s.mlflow.host,
                s.mlflow.port,
                "mlflow.port",
                f"{s.mlflow.tracking_uri}/health",
                s.mlflow.ready_timeout_s,
                s.mlflow.tracking_uri,
                mlflow_env,
                [data / "mlflow"],
            ),
            "fleet": Service(
                "fleet",
                [py, "-m", "serving.supervisor"],
                s.fleet.host,
                s.fleet.admin_port,
                "fleet.admin_port",
                f"http://{s.fleet.host}:{s.fleet.admin_port}/health",
                60.0,
                f"http://{s.fleet.host}:{s.fleet.admin_port}",
                child,
            ),
            "flows": Service(
                "flows",
                [py, "-m", "flows.deployments"],
                s.prefect.host,
                s.prefect.runner_port,
                "prefect.runner_port",
                f"http://{s.prefect.host}:{s.prefect.runner_port}/health",
                120.0,
                f"http://{s.prefect.host}:{s.prefect.runner_port}",
                child,
            ),
            "webhook": Service(
                "webhook",
                [py, "-m", "release.webhook_app"],
                s.registry_webhook.host,
                s.registry_webhook.port,
                "registry_webhook.port",
                f"http://{s.registry_webhook.host}:{s.registry_webhook.port}/health",
                60.0,
                f"http://{s.registry_webhook.host}:{s.registry_webhook.port}",
                child,
            ),
            "prometheus": Service(
                "prometheus",
                [
                    s.prometheus.binary,
                    f"--config.file={self.run_dir / 'prometheus.yml'}",
                    f"--storage.tsdb.path={data / 'prometheus'}",
                    f"--storage.tsdb.retention.time={s.prometheus.retention}",
                    f"--web.listen-address={s.prometheus.host}:{s.prometheus.port}",
                ],
                s.prometheus.host,
                s.prometheus.port,
                "prometheus.port",
                f"{s.prometheus.url}/-/ready",
                60.0,
                s.prometheus.url,
                dirs=[data / "prometheus"],
            ),
            **self._pushgateway(),
            "capacity": Service(
                "capacity",
                [py, "-m", "capacity.scheduler"],
                s.capacity.host,
                s.capacity.port,
                "capacity.port",
                f"http://{s.capacity.host}:{s.capacity.port}/health",
                60.0,
                f"http://{s.capacity.host}:{s.capacity.port}",
                child,
                [data / "capacity"],
            ),
            "gateway": Service(
                "gateway",
                [py, "-m", "serving.gateway_app"],
                s.gateway.host,
                s.gateway.port,
                "gateway.port",
                f"http://{s.gateway.host}:{s.gateway.port}/health",
                60.0,
                f"http://{s.gateway.host}:{s.gateway.port}",
                child,
            ),
        }

    def _pushgateway(self) -> dict[str, Service]:
        """The local Pushgateway trainers push to, when prometheus.pushgateway_url is a loopback address."""
        s, local = self.settings.prometheus, prometheus.local_pushgateway(self.settings.prometheus)
        if local is None:
            return {}
        host, port = local
        data, url = self.settings.data_path / "pushgateway", f"http://{host}:{port}"
        cmd = [
            s.pushgateway_binary,
            f"--web.listen-address={host}:{port}",
            f"--persistence.file={data / 'pushed.metrics'}",  # the last pushes outlive a restart
            "--persistence.interval=30s",
        ]
        return {
            "pushgateway": Service(
                "pushgateway", cmd, host, port, "prometheus.pushgateway_url", f"{url}/-/ready", 30.0, url, dirs=[data]
            )
        }

    @property
    def settings_file(self) -> Path:
        """Where child processes read the settings this process resolved (written by `ensure`)."""
        return self.run_dir / "settings.yaml"

    def write_settings_file(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        data = self.settings.model_dump(mode="json")
        data["data_dir"] = str(self.settings.data_path)
        # Private from its first byte (it may hold keys): a 0600 temporary file renamed over the old one.
        tmp = self.settings_file.with_name(f".settings.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(yaml.safe_dump(data, sort_keys=False))
        os.replace(tmp, self.settings_file)

    def running(self, name: str) -> ProcInfo | None:
        info = read_procinfo(self.run_dir / f"{name}.json")
        return info if info and alive(info.pid) else None

    def ensure(self, svc: Service) -> ProcInfo:
        """Start svc unless it already runs; wait for readiness; never leave a half-started process."""
        info = self.running(svc.name)
        if info is not None:
            wait_http(svc.ready_url, svc.ready_timeout_s, svc.name, log=info.log)
            return info
        require_port(svc.host, svc.port, svc.name, svc.port_setting)
        self.write_settings_file()
        for d in svc.dirs:
            d.mkdir(parents=True, exist_ok=True)
        proc, info = spawn(svc.name, svc.cmd, self.log_dir / f"{svc.name}.log", env=svc.env, cwd=self.settings.data_path)
        info.url = svc.url
        save_procinfo(self.run_dir / f"{svc.name}.json", info)
        try:
            wait_http(svc.ready_url, svc.ready_timeout_s, svc.name, proc=proc, log=info.log)
        except BaseException:
            stop_group(proc.pid)
            (self.run_dir / f"{svc.name}.json").unlink(missing_ok=True)
            raise
        return info

    def remote(self, name: str) -> ServerAccess | None:
        """The access settings of a control plane configured by URL (`tidal` starts no such server), else None."""
        access = {"prefect": self.settings.prefect, "mlflow": self.settings.mlflow}.get(name)
        return access if access is not None and access.remote else None

    def answers(self, name: str, svc: Service, timeout_s: float = 2.0) -> httpx.Response:
        """svc's readiness URL, asked with the credential and CA of a remote server."""
        access = self.remote(name)
        if access is None:
            return httpx.get(svc.ready_url, timeout=timeout_s)
        return httpx.get(svc.ready_url, headers=access.auth_headers(name), verify=access.verify, timeout=timeout_s)

    def up_servers(self) -> None:
        """Start the local Prefect and MLflow servers; a remote one is only checked (reachable, credential accepted)."""
        svcs = self.services()
        for name in ("prefect", "mlflow"):
            if self.remote(name) is None:
                self.ensure(svcs[name])
                continue
            try:
                reply = self.answers(name, svcs[name], timeout_s=10.0)
            except httpx.HTTPError as e:
                raise NotReady(f"{name} at {svcs[name].url} is unreachable ({type(e).__name__}: {e}); check {name}.url") from None
            if reply.status_code in (401, 403):
                raise NotReady(
                    f"{name} at {svcs[name].url} refused the credential (HTTP {reply.status_code}); check "
                    f"{name}.credential_env / credential_file and credential_kind"
                )
            if not reply.is_success:
                raise NotReady(f"{name} at {svcs[name].url}: {svcs[name].ready_url} answered HTTP {reply.status_code}")

    def up_flows(self) -> ProcInfo:
        """The runner of scheduled flows (deployments registered with the Prefect server)."""
        if self.settings.flywheel.work_pool:
            raise SettingsError(
                f"flywheel.work_pool={self.settings.flywheel.work_pool!r}: flow runs belong to that pool's "
                "workers, not a local runner; register the deployments with `python -m flows.deployments`"
            )
        info = self.ensure(self.services()["flows"])
        if self.settings.registry_webhook.enabled:  # alias moves in the registry start releases
            self.ensure(self.services()["webhook"])
        return info

    def up_fleet(self, timeout_s: float | None = None) -> dict:
        """Start the supervisor and wait until every configured replica is verified (or start-up failed)."""
        svc = self.services()["fleet"]
        info = self.ensure(svc)
        deadline = time.monotonic() + (timeout_s or self.settings.fleet.ready_timeout_s * 3)
        while time.monotonic() < deadline:
            status = self.fleet_client().status()
            if status.error:
                self.stop("fleet")
                raise NotReady(f"fleet failed to start: {status.error}; see {info.log}{tail(info.log)}")
            if status.ready:
                return status
            time.sleep(1.0)
        raise NotReady(f"fleet not ready after {timeout_s} s; see {info.log}{tail(info.log)}")

    def up_gateway(self) -> ProcInfo:
        return self.ensure(self.services()["gateway"])

    def up_capacity(self) -> ProcInfo | None:
        """The capacity scheduler, under capacity.mode tidal (after the fleet and the gateway it observes); else None."""
        if self.settings.capacity.mode != "tidal":
            return None
        return self.ensure(self.services()["capacity"])

    def up_pushgateway(self) -> ProcInfo | None:
        """The local Pushgateway (a loopback prometheus.pushgateway_url), else None: none configured, or the cluster's."""
        svc = self.services().get("pushgateway")
        if svc is None:
            return None
        prometheus.executable(self.settings.prometheus, "pushgateway_binary")
        return self.ensure(svc)

    def up_prometheus(self) -> ProcInfo:
        """Prometheus scraping the gateway, the supervisor and the trainers' Pushgateway (started here when local),
        with Tidal's alert rules (tidal/prometheus.py)."""
        s = self.settings
        capacity = f"{s.capacity.host}:{s.capacity.port}" if s.capacity.mode == "tidal" else None
        cfg = prometheus.config(
            s.prometheus, f"{s.gateway.host}:{s.gateway.port}", f"{s.fleet.host}:{s.fleet.admin_port}", capacity=capacity
        )
        prometheus.executable(s.prometheus)  # a clear error before a spawn that could only fail
        self.up_pushgateway()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        return self.ensure(self.services()["prometheus"])

    def routes_client(self):
        from serving.client import routes_client

        return routes_client(self.settings)

    def fleet_client(self, timeout_s: float = 1800.0):
        """timeout_s: a deploy or scale answers once its replicas are verified (minutes); status reads need less."""
        from serving.client import fleet_client

        return fleet_client(self.settings, timeout_s)

    # ---- stopping -------------------------------------------------------------------------------
    def stop(self, name: str) -> None:
        """Stop the service and, when it ran, wait until its port can be bound again, so a restart right after
        (`tidal demo` restarts the flows runner on its own settings) does not meet its own old connections."""
        info = read_procinfo(self.run_dir / f"{name}.json")
        if info is not None and (alive(info.pid) or group_members(info.pid)):  # a dead leader's group: stopped too
            stop_group(info.pid, timeout=30.0)
            svc = self.services().get(name)
            if svc is not None and not wait_port_free(svc.host, svc.port, timeout=60.0):
                log.warning("%s stopped, but port %s:%s is still taken after 60 s", name, svc.host, svc.port)
        (self.run_dir / f"{name}.json").unlink(missing_ok=True)

    def down(self) -> list[str]:
        """Stop the gateway (it flushes its log), the fleet (it stops its replicas), then MLflow and
        Prefect; kill any replica left behind."""
        order = ("capacity", "prometheus", "pushgateway", "gateway", "webhook", "flows", "fleet", "mlflow", "prefect")
        stopped = [n for n in order if self.running(n)]
        for name in order:
            self.stop(name)
        for pid in self.replica_pids():
            if group_members(pid):  # leader or orphaned engine children still there
                stop_group(pid)
                stopped.append(f"replica pid {pid}")
        return stopped

    def replica_pids(self) -> list[int]:
        """The engines the last fleet started (its replicas.json), to stop any the supervisor left behind."""
        path = self.run_dir / "replicas.json"
        try:
            fleet = FleetState.model_validate_json(path.read_text())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as e:  # ValidationError is a ValueError
            log.warning("cannot read %s (%s): engines the fleet started may still be running", path, type(e).__name__)
            return []
        return [r.pid for m in fleet.models.values() for r in m.replicas if r.pid]

    # ---- status ---------------------------------------------------------------------------------
    def status(self) -> PlatformStatus:
        services = {}
        for name, svc in self.services().items():
            info, remote = self.running(name), self.remote(name) is not None
            if name in ("prometheus", "pushgateway") and info is None:
                continue  # optional (`tidal up --with-prometheus`): listed while it runs
            if name == "webhook" and not self.settings.registry_webhook.enabled:
                continue
            if name == "capacity" and self.settings.capacity.mode != "tidal" and info is None:
                continue
            healthy = False
            if info is not None or remote:
                try:
                    healthy = self.answers(name, svc).is_success
                except (httpx.HTTPError, SettingsError):
                    pass
            services[name] = ServiceStatus(
                remote=remote,
                running=info is not None,
                pid=info.pid if info else None,
                url=svc.url,
                healthy=healthy,
                log=str(self.log_dir / f"{name}.log"),
            )
        fleet = self.fleet_client().status() if services["fleet"].healthy else None
        capacity = self.capacity_status() if "capacity" in services and services["capacity"].healthy else None
        store = open_store(self.settings)
        held = {m.name: paused(store, m.name) for m in self.settings.models}
        docs = {m.name: self.data_docs_link(store, m.name) for m in self.settings.models}
        return PlatformStatus(
            services=services,
            fleet=fleet,
            capacity=capacity,
            paused={m: p for m, p in held.items() if p is not None},
            data_docs={m: link for m, link in docs.items() if link},
        )

    def capacity_status(self) -> CapacityStatus | None:
        s = self.settings
        try:
            r = httpx.get(
                f"http://{s.capacity.host}:{s.capacity.port}/capacity",
                headers={"Authorization": f"Bearer {admin_token(s)}"},
                timeout=5.0,
            )
            r.raise_for_status()
        except httpx.HTTPError as e:
            log.warning("capacity scheduler status unavailable: %s", e)
            return None
        return CapacityStatus.model_validate_json(r.content)

    def data_docs_link(self, store, model: str) -> str | None:
        """A link a browser opens: the store's own file for a local store, else a copy under data_dir/docs/."""
        from data_contracts.dataset import latest_data_docs

        prefix = latest_data_docs(store, model)
        if prefix is None:
            return None
        index = store.uri(f"{prefix}/index.html")
        if index.startswith("file://"):
            return index
        local = download_dir(store, prefix, self.settings.data_path / "docs" / prefix)
        return (local / "index.html").as_uri()


class ServerUnavailable(RuntimeError):
    """A platform server (Prefect) went away while a command needed it."""


@contextmanager
def prefect_reachable(settings: TidalSettings) -> Iterator[None]:
    """Run flows in this block; a Prefect server that stopped answering becomes one error naming it and the fix
    (Prefect's own is a bare `ConnectError: [Errno 111] Connection refused` once its client has connected)."""
    api = settings.prefect.api_url.rstrip("/")
    said = f"Prefect at {api} is unavailable"
    fix = "start it with `tidal up`, then retry (every Tidal flow is safe to run again)"
    try:
        yield
    except httpx.TransportError as e:  # refused, reset, dropped keep-alive, timed out
        try:
            url = str(e.request.url)
        except RuntimeError:  # no request attached: not one of Prefect's calls
            raise e from None
        if not url.startswith(api):
            raise
        raise ServerUnavailable(f"{said} ({e}); {fix}") from e
    except RuntimeError as e:
        if "Failed to reach API" not in str(e):
            raise
        raise ServerUnavailable(f"{said} ({e}); {fix}") from e
