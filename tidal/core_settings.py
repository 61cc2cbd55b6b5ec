"""The core's settings: where state lives (data_dir, the object store), the Prefect and MLflow servers, the
served models, and the settings root every component's own root extends.

Read from `tidal.yaml` and `TIDAL_*` variables. Nested fields use `__`: `TIDAL_FLEET__BASE_PORT=8200`,
`TIDAL_STORE__URL=s3://bucket/tidal`. The file is `$TIDAL_CONFIG` if set, else `./tidal.yaml` when it exists.
A component's process (the fleet supervisor, the gateway) loads its own root, a `SettingsRoot` with its
sections, from the same file, and ignores the sections of others; `tidal.settings.TidalSettings` composes
every root and refuses unknown keys. Settings are loaded once at start-up and passed to whoever needs them;
nothing reads them at import.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, TypeVar
from urllib.parse import urlparse

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, YamlConfigSettingsSource

from tidal.model_settings import ModelSettings
from tidal.section import Section, SettingsError

STORE_AREAS = ("logs", "quarantine", "datasets", "checkpoints", "training", "state", "reports", "mlflow-artifacts")


class StoreSettings(Section):
    url: str = Field("", description="Object store root: '' = <data_dir>/store on local disk, or s3://bucket/prefix.")
    routes: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Top-level areas kept in stores of their own, e.g. {logs: s3://acme-tidal-logs, checkpoints: "
            "s3://acme-tidal-checkpoints}: one bucket (and IAM grant) per kind of data. Keys keep their area prefix "
            f"there. Areas: {', '.join(STORE_AREAS)}; the rest stays under `url`."
        ),
    )

    @model_validator(mode="after")
    def _known_areas(self):
        unknown = sorted(set(self.routes) - set(STORE_AREAS))
        if unknown:
            raise ValueError(f"store.routes: unknown areas {unknown}; expected some of {list(STORE_AREAS)}")
        return self

    s3_endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, moto); None = AWS S3.")
    s3_region: str = Field("us-east-1", description="Region for the S3 client.")


class ServerAccess(Section):
    """How to reach a control plane that runs elsewhere (a cluster, a managed service, a port-forward): its full URL,
    a credential read from the environment or a file (a mounted Secret) when it is used, and the CA that signed its
    TLS certificate. Unset `url`: the server is local and `tidal` starts it."""

    url: str | None = Field(None, description="Full URL of a remote server; set: `tidal` starts no server of this kind.")
    credential_kind: Literal["basic", "bearer"] = Field(
        "basic",
        description=(
            "basic: the credential is 'user:password' (HTTP Basic, what a self-hosted server or its proxy checks); "
            "bearer: it is a token sent as 'Authorization: Bearer' (managed services, token-checking proxies)."
        ),
    )
    credential_env: str | None = Field(None, description="Name of an environment variable holding the credential.")
    credential_file: Path | None = Field(None, description="File holding the credential (e.g. a mounted Secret).")
    ca_file: Path | None = Field(None, description="CA bundle that verifies the server's TLS certificate; None = system CAs.")

    @model_validator(mode="after")
    def _one_credential(self):
        if self.credential_env and self.credential_file:
            raise ValueError("credential_env and credential_file: set one (the credential comes from one place)")
        if self.url is not None:
            parsed = urlparse(self.url)
            if parsed.scheme not in ("http", "https") or not parsed.hostname:
                raise ValueError(f"url {self.url!r}: expected http(s)://host[:port][/path]")
        elif self.credential_env or self.credential_file or self.ca_file:
            raise ValueError("a credential or CA file without `url`: they are for a remote server (set its url)")
        return self

    @property
    def remote(self) -> bool:
        return self.url is not None

    def credential(self, section: str) -> str | None:
        """The credential, read now (a rotated Secret is picked up); a missing one is an error naming where it was
        looked for, never what it holds."""
        if self.credential_env:
            value = os.environ.get(self.credential_env)
            if not value:
                raise SettingsError(f"{section}.credential_env: ${self.credential_env} is not set (expected the credential)")
            return value.strip()
        if self.credential_file:
            try:
                value = self.credential_file.expanduser().read_text().strip()
            except OSError as e:
                raise SettingsError(f"{section}.credential_file {self.credential_file}: {e.strerror}") from None
            if not value:
                raise SettingsError(f"{section}.credential_file {self.credential_file} is empty (expected the credential)")
            return value
        return None

    def auth_headers(self, section: str) -> dict[str, str]:
        """The Authorization header this process's own requests (health checks) send."""
        import base64

        value = self.credential(section)
        if value is None:
            return {}
        if self.credential_kind == "bearer":
            return {"Authorization": f"Bearer {value}"}
        return {"Authorization": "Basic " + base64.b64encode(value.encode()).decode()}

    @property
    def verify(self) -> str | bool:
        """httpx's `verify`: the CA bundle, or the system's."""
        return str(self.ca_file.expanduser()) if self.ca_file else True


class PrefectSettings(ServerAccess):
    host: str = Field("127.0.0.1", description="Address the Prefect server binds to.")
    port: int = Field(4200, ge=1, le=65535, description="Prefect API/UI port.")
    runner_port: int = Field(4201, ge=1, le=65535, description="Health port of the runner that executes scheduled flows.")
    ready_timeout_s: float = Field(180.0, gt=0, description="How long `tidal up` waits for the server.")
    database_timeout_s: float = Field(
        30.0,
        gt=0,
        description=(
            "How long the server's statements wait for its SQLite database (PREFECT_SERVER_DATABASE_TIMEOUT); Prefect's "
            "10 s is short while a trainer holds both cores of a small machine."
        ),
    )

    @property
    def api_url(self) -> str:
        """The API URL clients use: `url` (a remote server's, ending in /api) or the local server's."""
        return self.url.rstrip("/") if self.url else f"http://{self.host}:{self.port}/api"

    def client_env(self) -> dict[str, str]:
        """Prefect's own variables for the credential and CA (its HTTP client and its events websocket read them)."""
        env, value = {}, self.credential("prefect")
        if value is not None:
            env["PREFECT_API_AUTH_STRING" if self.credential_kind == "basic" else "PREFECT_API_KEY"] = value
        if self.ca_file:
            env["PREFECT_API_SSL_CERT_FILE"] = str(self.ca_file.expanduser())
        return env


class MlflowSettings(ServerAccess):
    host: str = Field("127.0.0.1", description="Address the MLflow server binds to.")
    port: int = Field(5000, ge=1, le=65535, description="MLflow tracking/registry port.")
    workers: int = Field(1, ge=1, description="Server workers; 1 keeps it at ~0.5 GB and ready in ~20 s.")
    ready_timeout_s: float = Field(180.0, gt=0, description="How long `tidal up` waits for the server.")
    request_retries: int = Field(
        3,
        ge=0,
        le=10,
        description=(
            "Retries of a failed MLflow request (exponential back-off, ~14 s in all for 3) before a flow fails with "
            "'MLflow ... is unavailable'; MLflow's own default, 7, waits ~4 minutes."
        ),
    )

    @property
    def tracking_uri(self) -> str:
        """The tracking and registry URI clients use: `url` (a remote server's) or the local server's."""
        return self.url.rstrip("/") if self.url else f"http://{self.host}:{self.port}"

    @property
    def server_host(self) -> str:
        """The host clients reach MLflow at (for the checks that pods can reach it)."""
        return urlparse(self.tracking_uri).hostname or self.host

    def client_env(self) -> dict[str, str]:
        """MLflow's own variables for the credential and CA (its REST client reads them per request)."""
        env, value = {}, self.credential("mlflow")
        if value is not None and self.credential_kind == "bearer":
            env["MLFLOW_TRACKING_TOKEN"] = value
        elif value is not None:
            user, _, password = value.partition(":")
            env.update(MLFLOW_TRACKING_USERNAME=user, MLFLOW_TRACKING_PASSWORD=password)
        if self.ca_file:
            env["MLFLOW_TRACKING_SERVER_CERT_PATH"] = str(self.ca_file.expanduser())
        return env


class SettingsRoot(BaseSettings):
    """The sections every component reads: local state, the object store, the servers, the served models."""

    # env_parse_none_str: TIDAL_TRAIN__GATE__MAX_HELDOUT_ROWS=null unsets an optional setting, as `null` does in YAML.
    # extra="ignore": a component's root reads its sections of the shared file; TidalSettings refuses unknown keys.
    model_config = SettingsConfigDict(env_prefix="TIDAL_", env_nested_delimiter="__", extra="ignore", env_parse_none_str="null")

    data_dir: Path = Field(Path(".tidal"), description="Local state: logs, pid files, SQLite DBs, the default object store.")
    admin_token: str | None = Field(
        None, min_length=16, description="Fleet/route admin token; None = generated once into data_dir."
    )
    models: list[ModelSettings] = Field(default_factory=lambda: [ModelSettings(name="tab")], description="Served models.")
    store: StoreSettings = Field(default_factory=StoreSettings)
    prefect: PrefectSettings = Field(default_factory=PrefectSettings)
    mlflow: MlflowSettings = Field(default_factory=MlflowSettings)

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings):
        config = os.environ.get("TIDAL_CONFIG") or ("tidal.yaml" if Path("tidal.yaml").exists() else None)
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if config:
            if not Path(config).is_file():
                raise SettingsError(f"TIDAL_CONFIG points to {config!r}, which is not a file")
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=config))
        return tuple(sources)

    @model_validator(mode="after")
    def _unique_models(self) -> SettingsRoot:
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique, got {names}")
        return self

    # Derived locations, one place each.
    @property
    def data_path(self) -> Path:
        return self.data_dir.expanduser().resolve()

    @property
    def run_dir(self) -> Path:
        return self.data_path / "run"

    @property
    def log_dir(self) -> Path:
        return self.data_path / "logs"

    def train_log(self, model: str) -> Path:
        """The model's train log: every trainer run's output, appended (tasks/train.py, `tidal train`'s progress)."""
        return self.log_dir / f"train-{model}.log"

    @property
    def store_url(self) -> str:
        return self.store.url or (self.data_path / "store").as_uri()

    def model(self, name: str) -> ModelSettings:
        for m in self.models:
            if m.name == name:
                return m
        raise SettingsError(f"unknown model {name!r}; configured models: {[m.name for m in self.models]}")


# Settings whose values are credentials: a settings error names them but never shows what was given.
SECRET_FIELDS = frozenset({"admin_token", "secret", "key", "password", "token", "api_key"})

Root = TypeVar("Root", bound=SettingsRoot)


def load_root(cls: type[Root], **overrides) -> Root:
    """Read a settings root once at start-up; a bad value raises SettingsError naming field and fix."""
    try:
        return cls(**overrides)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = [str(p) for p in err["loc"]]
            if not loc:  # a rule across fields: the message itself says what to change
                lines.append(f"  {err['msg'].removeprefix('Value error, ')} (set it in tidal.yaml or TIDAL_* variables)")
                continue
            # A list item can only be set as a whole list: TIDAL_MODELS='[...]'.
            env_path = loc[: next((i for i, p in enumerate(loc) if p.isdigit()), len(loc))]
            env = "TIDAL_" + "__".join(env_path).upper()
            # A credential is never echoed, nor a whole section (a missing field's input is its section, keys and all).
            value = err.get("input")
            got = "" if any(part in SECRET_FIELDS for part in loc) or isinstance(value, (dict, list)) else f"got {value!r}; "
            lines.append(f"  {'.'.join(loc)}: {err['msg']} ({got}set it in tidal.yaml or {env})")
        raise SettingsError("invalid Tidal settings:\n" + "\n".join(lines)) from None
