"""Typed settings, one model per component, read from `tidal.yaml` and `TIDAL_*` variables.

Nested fields use `__`: `TIDAL_FLEET__BASE_PORT=8200`, `TIDAL_STORE__URL=s3://bucket/tidal`.
The file is `$TIDAL_CONFIG` if set, else `./tidal.yaml` when it exists. Settings are loaded once
at start-up (`load_settings`) and passed to whoever needs them; nothing reads them at import.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, YamlConfigSettingsSource

from training.policy import PolicyConfig
from training.pretrain import PretrainConfig

PROJECT_ROOT = Path(__file__).resolve().parents[1]
UpdateStrategy = Literal["lora", "restart", "reload", "nccl"]
GPU_ONLY_STRATEGIES = {"reload", "nccl"}


class SettingsError(ValueError):
    """A bad setting, with the fix in its message."""


class StoreSettings(BaseModel):
    url: str = Field("", description="Object store root: '' = <data_dir>/store on local disk, or s3://bucket/prefix.")
    s3_endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, moto); None = AWS S3.")
    s3_region: str = Field("us-east-1", description="Region for the S3 client.")


class PrefectSettings(BaseModel):
    host: str = Field("127.0.0.1", description="Address the Prefect server binds to.")
    port: int = Field(4200, ge=1, le=65535, description="Prefect API/UI port.")
    ready_timeout_s: float = Field(180.0, gt=0, description="How long `tidal up` waits for the server.")

    @property
    def api_url(self) -> str:
        return f"http://{self.host}:{self.port}/api"


class MlflowSettings(BaseModel):
    host: str = Field("127.0.0.1", description="Address the MLflow server binds to.")
    port: int = Field(5000, ge=1, le=65535, description="MLflow tracking/registry port.")
    workers: int = Field(1, ge=1, description="Server workers; 1 keeps it at ~0.5 GB and ready in ~20 s.")
    ready_timeout_s: float = Field(180.0, gt=0, description="How long `tidal up` waits for the server.")

    @property
    def tracking_uri(self) -> str:
        return f"http://{self.host}:{self.port}"


class EngineSettings(BaseModel):
    python: Path | None = Field(None, description="Interpreter of the engine (vLLM) environment; None = ./.engine-venv/bin/python.")
    flavor: Literal["auto", "cpu", "cuda"] = Field("auto", description="Engine build; auto reads the installed vLLM distribution.")
    dtype: str = Field("float32", description="Serving dtype (float32 on CPU; bfloat16/fp8 on GPU).")
    max_model_len: int = Field(512, ge=16, description="Longest prompt+completion a replica accepts, in tokens.")
    kv_cache_gib: int = Field(1, ge=1, description="VLLM_CPU_KVCACHE_SPACE per replica on CPU engines.")
    enforce_eager: bool = Field(True, description="Skip graph capture/compile: ~45 s faster start on CPU.")
    max_lora_rank: int = Field(8, ge=1, description="Largest LoRA rank a replica can load.")
    max_loras: int = Field(4, ge=1, description="Adapters resident at once per replica (champion+candidate need 2).")
    extra_args: list[str] = Field(default_factory=list, description="Appended to the vLLM server command line.")

    def resolved_python(self) -> Path:
        return self.python or PROJECT_ROOT / ".engine-venv" / "bin" / "python"


class FleetSettings(BaseModel):
    host: str = Field("127.0.0.1", description="Address replicas and the supervisor bind to.")
    admin_port: int = Field(8090, ge=1, le=65535, description="Port of the fleet supervisor's admin API.")
    base_port: int = Field(8100, ge=1, le=65535, description="First port of the replica port range.")
    port_range: int = Field(100, ge=1, description="Size of the replica port range.")
    ready_timeout_s: float = Field(300.0, gt=0, description="A replica not ready by then is killed and reported.")
    health_interval_s: float = Field(2.0, gt=0, description="Seconds between health checks of each replica.")
    health_failures: int = Field(3, ge=1, description="Consecutive failed checks before a live replica is restarted.")
    restart_backoff_s: float = Field(2.0, ge=0, description="First restart delay; doubles per consecutive crash.")
    restart_backoff_max_s: float = Field(60.0, ge=0, description="Cap of the restart delay.")
    probe_atol: float = Field(2e-3, gt=0, description="Largest |served - trainer| token log-prob accepted by the probe.")


class ModelSettings(BaseModel):
    name: str = Field(..., pattern=r"^[a-z][a-z0-9_-]{0,62}$", description="Registered model name; also the served name prefix.")
    replicas: int = Field(1, ge=0, description="Replicas the fleet keeps running.")
    update_strategy: UpdateStrategy = Field("lora", description="How new versions reach the replicas.")
    serve_alias: str = Field("champion", description="Registry alias whose version the replicas serve at start.")


class BootstrapSettings(BaseModel):
    vocab_size: int = Field(1024, ge=300, description="Byte-level BPE vocabulary size of the base tokenizer.")
    heldout_fraction: float = Field(0.1, gt=0, lt=1, description="Share of stdlib files (by path hash) never trained on.")
    policy: PolicyConfig = Field(default_factory=PolicyConfig, description="Base policy architecture.")
    pretrain: PretrainConfig = Field(default_factory=PretrainConfig, description="Pretraining budget and optimiser.")
    probe_prompts: int = Field(4, ge=1, description="Prompts in each version's served-weight probe.")
    probe_tokens: int = Field(8, ge=1, description="Greedy tokens per probe prompt.")


class TidalSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TIDAL_", env_nested_delimiter="__", extra="forbid")

    data_dir: Path = Field(Path(".tidal"), description="Local state: logs, pid files, SQLite DBs, the default object store.")
    admin_token: str | None = Field(None, description="Fleet/route admin token; None = generated once into data_dir.")
    models: list[ModelSettings] = Field(default_factory=lambda: [ModelSettings(name="tab")], description="Served models.")
    store: StoreSettings = Field(default_factory=StoreSettings)
    prefect: PrefectSettings = Field(default_factory=PrefectSettings)
    mlflow: MlflowSettings = Field(default_factory=MlflowSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    fleet: FleetSettings = Field(default_factory=FleetSettings)
    bootstrap: BootstrapSettings = Field(default_factory=BootstrapSettings)

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
    def _check_combinations(self) -> TidalSettings:
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique, got {names}")
        fixed = {"prefect.port": self.prefect.port, "mlflow.port": self.mlflow.port, "fleet.admin_port": self.fleet.admin_port}
        if len(set(fixed.values())) != len(fixed):
            raise ValueError(f"ports must differ: {fixed}")
        lo, hi = self.fleet.base_port, self.fleet.base_port + self.fleet.port_range
        clash = [k for k, p in fixed.items() if lo <= p < hi]
        if clash:
            raise ValueError(f"{clash} inside the replica range [{lo}, {hi}); move fleet.base_port")
        if hi > 65536:
            raise ValueError(f"replica range [{lo}, {hi}) passes 65535; lower fleet.base_port or fleet.port_range")
        if any(m.update_strategy == "lora" for m in self.models) and self.engine.max_loras < 2:
            raise ValueError("update_strategy 'lora' serves champion and candidate side by side: set engine.max_loras >= 2")
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

    @property
    def store_url(self) -> str:
        return self.store.url or (self.data_path / "store").as_uri()

    def model(self, name: str) -> ModelSettings:
        for m in self.models:
            if m.name == name:
                return m
        raise SettingsError(f"unknown model {name!r}; configured models: {[m.name for m in self.models]}")


def load_settings(**overrides) -> TidalSettings:
    """Read settings once at start-up; a bad value raises SettingsError naming field and fix."""
    try:
        return TidalSettings(**overrides)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            where = ".".join(str(p) for p in err["loc"]) or "settings"
            env = "TIDAL_" + "__".join(str(p) for p in err["loc"]).upper() if err["loc"] else "tidal.yaml"
            lines.append(f"  {where}: {err['msg']} (got {err.get('input')!r}; set it in tidal.yaml or {env})")
        raise SettingsError("invalid Tidal settings:\n" + "\n".join(lines)) from None
