"""Typed settings, one model per component, read from `tidal.yaml` and `TIDAL_*` variables.

Nested fields use `__`: `TIDAL_FLEET__BASE_PORT=8200`, `TIDAL_STORE__URL=s3://bucket/tidal`.
The file is `$TIDAL_CONFIG` if set, else `./tidal.yaml` when it exists. Settings are loaded once
at start-up (`load_settings`) and passed to whoever needs them; nothing reads them at import.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, YamlConfigSettingsSource

from data_contracts.collect_settings import CollectSettings
from release.policy import CanaryConfig, Margins
from serving.kube_settings import KubernetesFleetSettings
from serving.logsink import LogSinkSettings
from tidal.loop_settings import DemoSettings, FlywheelSettings
from tidal.section import Section
from tidal.strategy import UpdateStrategy
from serving.routes import RouteLimits
from training.policy_config import PolicyConfig
from training.pretrain_config import PretrainConfig
from training.train_settings import LaunchSettings, TrainSettings

PROJECT_ROOT = Path(__file__).resolve().parents[1]


class SettingsError(ValueError):
    """A bad setting, with the fix in its message."""


STORE_AREAS = ("logs", "quarantine", "datasets", "checkpoints", "training", "state", "reports", "mlflow-artifacts")


class StoreSettings(Section):
    url: str = Field("", description="Object store root: '' = <data_dir>/store on local disk, or s3://bucket/prefix.")
    routes: dict[str, str] = Field(default_factory=dict, description=(
        "Top-level areas kept in stores of their own, e.g. {logs: s3://acme-tidal-logs, checkpoints: "
        "s3://acme-tidal-checkpoints}: one bucket (and IAM grant) per kind of data. Keys keep their area prefix "
        f"there. Areas: {', '.join(STORE_AREAS)}; the rest stays under `url`."))

    @model_validator(mode="after")
    def _known_areas(self):
        unknown = sorted(set(self.routes) - set(STORE_AREAS))
        if unknown:
            raise ValueError(f"store.routes: unknown areas {unknown}; expected some of {list(STORE_AREAS)}")
        return self
    s3_endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, moto); None = AWS S3.")
    s3_region: str = Field("us-east-1", description="Region for the S3 client.")


class PrefectSettings(Section):
    host: str = Field("127.0.0.1", description="Address the Prefect server binds to.")
    port: int = Field(4200, ge=1, le=65535, description="Prefect API/UI port.")
    runner_port: int = Field(4201, ge=1, le=65535, description="Health port of the runner that executes scheduled flows.")
    ready_timeout_s: float = Field(180.0, gt=0, description="How long `tidal up` waits for the server.")
    database_timeout_s: float = Field(30.0, gt=0, description=(
        "How long the server's statements wait for its SQLite database (PREFECT_SERVER_DATABASE_TIMEOUT); Prefect's "
        "10 s is short while a trainer holds both cores of a small machine."))

    @property
    def api_url(self) -> str:
        return f"http://{self.host}:{self.port}/api"


class MlflowSettings(Section):
    host: str = Field("127.0.0.1", description="Address the MLflow server binds to.")
    port: int = Field(5000, ge=1, le=65535, description="MLflow tracking/registry port.")
    workers: int = Field(1, ge=1, description="Server workers; 1 keeps it at ~0.5 GB and ready in ~20 s.")
    ready_timeout_s: float = Field(180.0, gt=0, description="How long `tidal up` waits for the server.")
    request_retries: int = Field(3, ge=0, le=10, description=(
        "Retries of a failed MLflow request (exponential back-off, ~14 s in all for 3) before a flow fails with "
        "'MLflow ... is unavailable'; MLflow's own default, 7, waits ~4 minutes."))

    @property
    def tracking_uri(self) -> str:
        return f"http://{self.host}:{self.port}"


class EngineSettings(Section):
    python: Path | None = Field(None, description="Interpreter of the engine (vLLM) environment; None = ./.engine-venv/bin/python.")
    flavor: Literal["auto", "cpu", "cuda"] = Field("auto", description="Engine build; auto reads the installed vLLM distribution.")
    dtype: str = Field("float32", description="Serving dtype (float32 on CPU; bfloat16/fp8 on GPU).")
    max_model_len: int = Field(512, ge=16, description="Longest prompt+completion a replica accepts, in tokens.")
    kv_cache_gib: int = Field(1, ge=1, description="VLLM_CPU_KVCACHE_SPACE per replica on CPU engines.")
    enforce_eager: bool = Field(True, description="Skip graph capture/compile: ~45 s faster start on CPU.")
    max_lora_rank: int = Field(8, ge=1, description="Largest LoRA rank a replica can load.")
    max_loras: int = Field(4, ge=1, description="Adapters resident at once per replica (champion+candidate need 2).")
    cpu_omp_bind: str = Field("nobind", description=(
        "VLLM_CPU_OMP_THREADS_BIND on CPU engines. vLLM's 'auto' pins every replica's worker to the same "
        "first core (and reserves the rest), so several replicas on one machine starve each other; 'nobind' "
        "lets the OS spread them. Use explicit core lists ('0-3') for one replica per NUMA node."))
    cpu_threads: int = Field(1, ge=1, description="OMP_NUM_THREADS per CPU replica (with 'nobind'); raise it for one big replica.")
    chunked_prefill: bool = Field(False, description=(
        "vLLM's chunked prefill (a long prompt split across engine steps). Off by default: on vllm-cpu, a seeded "
        "request whose prefill is split kills the engine (`RuntimeError: CPU Generator does not use offset`, when it "
        "rewinds that request's generator), and a client setting `seed` must never crash a replica. Off, a prompt "
        "is prefilled in one step. CUDA engines serving long prompts may turn it on."))
    extra_args: list[str] = Field(default_factory=list, description="Appended to the vLLM server command line.")
    quantization: Literal["", "fp8"] = Field("", description=(
        "'fp8': CUDA engines serve with `--quantization fp8` (weights quantized to FP8 at load, about half the "
        "memory of BF16); refused on CPU engines. Served log-probs then differ from the trainer's: the PPO "
        "trainer's truncated importance weight min(pi_old / mu, C) (train.ppo.is_truncation; training/ppo_loss.py "
        "truncated_is_weight) is what corrects that mismatch, as it does stale versions. bench/gpu_check.sh "
        "measures the gap and the share of tokens the truncation caps. '' = the dtype's own weights."))
    nccl_sender_gpu: str = Field("", description=(
        "CUDA_VISIBLE_DEVICES of the `nccl` strategy's sender process; '' = inherited. NCCL allows one rank per "
        "GPU in a group, so it must name a GPU the replicas' engines do not use."))
    weight_update_timeout_s: float = Field(600.0, gt=0, description=(
        "Longest one in-place update (`reload` or `nccl`) of one replica may take, per engine call and per sender, "
        "before it is rolled back."))

    @model_validator(mode="after")
    def _quantization_needs_cuda(self):
        if self.quantization and self.flavor == "cpu":
            raise ValueError(f"engine.quantization '{self.quantization}' needs CUDA engines: vllm-cpu has no "
                             f"{self.quantization} kernels. Unset engine.quantization, or use engine.flavor 'cuda'")
        return self

    def resolved_python(self) -> Path:
        return self.python or PROJECT_ROOT / ".engine-venv" / "bin" / "python"


class FleetSettings(Section):
    runtime: Literal["local", "kubernetes"] = Field("local", description=(
        "Where the replicas' engines run: 'local' = subprocesses of the supervisor on ports from base_port; "
        "'kubernetes' = pods of one Deployment per (model, base version) that the supervisor, running in the cluster, "
        "creates, scales and verifies (fleet.kubernetes; needs pinned images, an s3:// checkpoints store and an MLflow "
        "the cluster reaches, checked at start-up)."))
    kubernetes: KubernetesFleetSettings = Field(default_factory=KubernetesFleetSettings, description=(
        "The engine pods, with runtime 'kubernetes'."))
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
    warmup_bursts: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 8], description=(
        "Concurrent sampled completions a replica answers, burst by burst, after its probe and before it joins "
        "rotation: a fresh engine's first requests are several times slower (measured on CPU: ~1 s against "
        "50 ms once warm), which users, and a canary's latency guardrail, would otherwise take. [] = none."))


class ModelSettings(Section):
    name: str = Field(..., pattern=r"^[a-z][a-z0-9_-]{0,62}$", description="Registered model name; also the served name prefix.")
    replicas: int = Field(1, ge=0, description="Replicas the fleet keeps running.")
    update_strategy: UpdateStrategy = Field("lora", description=(
        "How new versions reach the replicas: 'lora' loads adapters beside the base; 'restart' boots replicas on a "
        "full checkpoint; 'reload' and 'nccl' (CUDA engines only, 2+ replicas) swap a full checkpoint into running "
        "engines in place, one replica at a time (serving/weight_sync/)."))
    serve_alias: str = Field("champion", description="Registry alias whose version the replicas serve at start.")
    canary_margins: Margins | None = Field(None, description=(
        "This model's guardrail non-inferiority margins for its canaries; None = canary.margins."))


class ClientKey(Section):
    client_id: str = Field(..., pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Name of the API client (logged with its requests).")
    key: str = Field(..., min_length=16, description="Its secret API key (Authorization: Bearer <key>); never logged.")


class GatewaySettings(Section):
    host: str = Field("127.0.0.1", description="Address the gateway binds to.")
    port: int = Field(8000, ge=1, le=65535, description="OpenAI-compatible API port.")
    clients: list[ClientKey] = Field(default_factory=list, description="API clients; empty = one client 'local' whose key is generated into data_dir/secrets.")
    secret: str | None = Field(None, min_length=16, description="HMAC secret for request ids and user hashes; None = generated into data_dir/secrets.")
    feedback_window_s: float = Field(86400.0, gt=0, description="Feedback older than this (since the completion) is refused.")
    max_body_bytes: int = Field(256 * 1024, ge=1024, description="Larger request bodies are refused with 413 before parsing.")
    max_prompt_chars: int = Field(32_000, ge=1, description="Longest prompt accepted, in characters.")
    max_tokens: int = Field(256, ge=1, description="Largest max_tokens a client may ask for.")
    rate_limit_rps: float = Field(200.0, gt=0, description="Sustained requests/s per client (token bucket).")
    rate_limit_burst: int = Field(400, ge=1, description="Requests a client may send at once.")
    fleet_poll_s: float = Field(1.0, gt=0, description="How often the replica list is refreshed from the fleet supervisor.")
    upstream_timeout_s: float = Field(120.0, gt=0, description="Longest a single engine call may take.")
    connect_timeout_s: float = Field(2.0, gt=0, description=(
        "Longest wait for a connection to a replica; past it the call fails over to another replica."))
    first_byte_timeout_s: float = Field(30.0, gt=0, description=(
        "Longest wait for a replica's response headers (for a non-streamed completion, its whole generation); past it "
        "the call fails over, so a hung replica (alive, not answering) costs this rather than upstream_timeout_s."))
    max_in_flight_per_replica: int = Field(64, ge=1, description=(
        "Engine calls in flight per replica; a request whose version's replicas are all at it gets 503 with Retry-After."))
    wal_append_timeout_s: float = Field(10.0, gt=0, description=(
        "A record not durable in the WAL by then fails its request (503) and /health reports the WAL stuck."))
    logsink: LogSinkSettings = Field(default_factory=LogSinkSettings, description="Write-ahead log and upload of records.")
    route_limits: RouteLimits = Field(default_factory=RouteLimits, description="Bounds on arm sampling overrides.")

    @model_validator(mode="after")
    def _check(self) -> GatewaySettings:
        if self.first_byte_timeout_s > self.upstream_timeout_s:
            raise ValueError(f"gateway.first_byte_timeout_s={self.first_byte_timeout_s:g} exceeds gateway.upstream_timeout_s="
                             f"{self.upstream_timeout_s:g}: the whole call would end first; lower it or raise upstream_timeout_s")
        if self.logsink.retain_s < self.feedback_window_s:
            raise ValueError(f"gateway.logsink.retain_s={self.logsink.retain_s:g} is shorter than gateway.feedback_window_s="
                             f"{self.feedback_window_s:g}: a restarted gateway refills its duplicate-feedback check from the "
                             "retained WAL, so a verdict older than retain_s could be recorded twice; raise retain_s")
        return self


class BootstrapSettings(Section):
    vocab_size: int = Field(1024, ge=300, description="Byte-level BPE vocabulary size of the base tokenizer.")
    heldout_fraction: float = Field(0.1, gt=0, lt=1, description="Share of stdlib files (by path hash) never trained on.")
    policy: PolicyConfig = Field(default_factory=PolicyConfig, description="Base policy architecture.")
    pretrain: PretrainConfig = Field(default_factory=PretrainConfig, description="Pretraining budget and optimiser.")
    probe_prompts: int = Field(4, ge=1, description="Prompts in each version's served-weight probe.")
    probe_tokens: int = Field(8, ge=1, description="Greedy tokens per probe prompt.")


class TidalSettings(BaseSettings):
    # env_parse_none_str: TIDAL_TRAIN__GATE__MAX_HELDOUT_ROWS=null unsets an optional setting, as `null` does in YAML
    model_config = SettingsConfigDict(env_prefix="TIDAL_", env_nested_delimiter="__", extra="forbid", env_parse_none_str="null")

    data_dir: Path = Field(Path(".tidal"), description="Local state: logs, pid files, SQLite DBs, the default object store.")
    admin_token: str | None = Field(None, min_length=16, description="Fleet/route admin token; None = generated once into data_dir.")
    models: list[ModelSettings] = Field(default_factory=lambda: [ModelSettings(name="tab")], description="Served models.")
    store: StoreSettings = Field(default_factory=StoreSettings)
    prefect: PrefectSettings = Field(default_factory=PrefectSettings)
    mlflow: MlflowSettings = Field(default_factory=MlflowSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    fleet: FleetSettings = Field(default_factory=FleetSettings)
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    bootstrap: BootstrapSettings = Field(default_factory=BootstrapSettings)
    collect: CollectSettings = Field(default_factory=CollectSettings, description="Collection flow: contracts, reward rules, watermark timing.")
    train: TrainSettings = Field(default_factory=TrainSettings, description="Training plane: PPO, checkpoints, offline gate.")
    trainer: LaunchSettings = Field(default_factory=LaunchSettings, description="Where the trainer process runs: a local subprocess or a Kubernetes Job.")
    canary: CanaryConfig = Field(default_factory=CanaryConfig, description="Release plane: canary ramp, sequential test, guardrails.")
    flywheel: FlywheelSettings = Field(default_factory=FlywheelSettings, description="How the deployed loop is scheduled.")
    demo: DemoSettings = Field(default_factory=DemoSettings, description="What `tidal demo` runs: cycles, simulated users, its canary and training.")

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
        fixed = {"prefect.port": self.prefect.port, "mlflow.port": self.mlflow.port, "fleet.admin_port": self.fleet.admin_port,
                 "gateway.port": self.gateway.port, "prefect.runner_port": self.prefect.runner_port}
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
        if self.fleet.runtime == "kubernetes":  # the supervisor reads MLflow, its pods read checkpoints
            k8s = self.fleet.kubernetes
            problems = k8s.problems(self.store.routes.get("checkpoints", self.store.url), self.mlflow.host, self.engine.flavor,
                                    {m.name: m.update_strategy for m in self.models})
            if problems:
                raise ValueError("fleet.runtime 'kubernetes':" + "".join(f"\n    - {p}" for p in problems))
        if self.trainer.launcher == "kubernetes":  # the trainer reads datasets, checkpoints and writes training/
            stores = {area: self.store.routes.get(area, self.store.url) for area in ("datasets", "checkpoints", "training")}
            problems = self.trainer.kubernetes.problems(stores, self.mlflow.host)
            if problems:
                raise ValueError("trainer.launcher 'kubernetes':" + "".join(f"\n    - {p}" for p in problems))
        # every trainer process holds one tensor-parallel shard; the processes must fill whole shard groups
        processes = self.trainer.local_processes if self.trainer.launcher == "local" else max(1, self.trainer.kubernetes.gpus_per_node)
        tp = self.train.ppo.tensor_parallel
        if processes % tp:
            where = "trainer.local_processes" if self.trainer.launcher == "local" else "trainer.kubernetes.gpus_per_node"
            raise ValueError(f"train.ppo.tensor_parallel={tp} needs a multiple of {tp} trainer processes, but {where}="
                             f"{processes}: set {where} to {tp} (or a multiple)")
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


# Settings whose values are credentials: a settings error names them but never shows what was given.
SECRET_FIELDS = frozenset({"admin_token", "secret", "key", "password", "token", "api_key"})


def _is_secret(loc: list[str]) -> bool:
    return any(part in SECRET_FIELDS for part in loc)


def load_settings(**overrides) -> TidalSettings:
    """Read settings once at start-up; a bad value raises SettingsError naming field and fix."""
    try:
        return TidalSettings(**overrides)
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
            got = "" if _is_secret(loc) or isinstance(value, (dict, list)) else f"got {value!r}; "
            lines.append(f"  {'.'.join(loc)}: {err['msg']} ({got}set it in tidal.yaml or {env})")
        raise SettingsError("invalid Tidal settings:\n" + "\n".join(lines)) from None
