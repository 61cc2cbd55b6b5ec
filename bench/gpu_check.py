"""The GPU paths, measured on one CUDA machine (bench/gpu_check.sh runs this after its checks and setup).

    policy     a tiny Qwen2 policy of our own (tokenizer trained here, a short pretrain), v1, and v2 = a noisy
               copy of it, each with its served-weight probe (nothing comes from a hub)
    engine A   float32, launched as the `nccl` strategy launches engines (weight-transfer flag, any version's
               name); the strategies' own per-replica code (InPlaceSync.move) moves it:
               reload v1 → v2 (+ probe; v1's probe must now fail), then, with 2+ GPUs, nccl v2 → v1 → v2 (a fresh
               group per update: the second one proves the first was torn down)
    A, B, C    the same prompts and sampled completions scored on float32 (A), bfloat16 (B), bfloat16 + FP8
               weights (C): mean/max |Δ log-prob| and the share of tokens whose truncated importance weight
               min(π_old/μ, C) the trainer caps (training/ppo_loss.py truncated_is_weight, C = is_truncation)
    megatron   one Megatron-core PPO step on the GPU, its logits against the HF model's (training/megatron/check.py)
    trainer    one PPO iteration of the Hugging Face trainer on the GPU (train.ppo.device 'auto'): float32 whole and in
               micro-batches, bf16 autocast with recomputed layers, a LoRA adapter under bf16; seconds and peak
               memory of each, the micro-batched step against the whole one (training/trainer_check.py)

Prints a summary, then one JSON line of named figures (last line). Exit status 1 when a required figure failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import httpx

ROOT = Path(__file__).resolve().parents[1]
MODEL = "gpucheck"


class Deadline:
    def __init__(self, at: float):
        self.at = at

    def left(self, reserve: float = 0.0) -> float:
        return self.at - time.time() - reserve

    def cap(self, seconds: float, reserve: float = 20.0) -> float:
        left = self.left(reserve)
        if left < 5:
            raise TimeoutError("the gpu check's time budget is spent")
        return min(seconds, left)


def tiny_versions(work: Path, pretrain_s: float = 20.0, seed: int = 0) -> tuple[Path, Path]:
    """v1 (a briefly pretrained tiny policy, head dim 64) and v2 (a noisy copy), each with its probe."""
    import torch

    from data_contracts.corpus import read_texts, source_files, stdlib_root
    from training.policy import PolicyConfig, build_policy, save_policy
    from training.pretrain import PretrainConfig, pretrain
    from training.probe import compute_probe, probe_prompts, save_probe
    from training.tokenizer import train_tokenizer
    from training.variants import noisy_copy

    texts = read_texts(source_files(stdlib_root())[:60])
    tok = train_tokenizer(texts, vocab_size=512)
    cfg = PolicyConfig(
        hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=512, max_position_embeddings=512
    )
    model = build_policy(cfg, tok, seed=seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pretrain(
        model.to(device),
        tok,
        texts[:-5],
        texts[-5:],
        PretrainConfig(max_seconds=pretrain_s, seq_len=128, eval_bytes=5_000),
        progress=False,
    )
    model = model.to("cpu", torch.float32)
    v1 = save_policy(model, tok, work / "v1")
    save_probe(compute_probe(model, tok, probe_prompts(texts, n=4, seed=seed)), v1)
    return v1, noisy_copy(v1, work / "v2", seed=seed + 1, noise=0.05)


def version(n: int):
    from tidal.registry import VersionInfo

    return VersionInfo(MODEL, n, "full", n, "")


def bench_fleet(engine_settings, dirs: dict[int, Path]):
    """What InPlaceSync.move reads of a fleet: settings, checkpoint directories, and a restart to record."""
    from serving.settings import FleetSettings

    fleet = SimpleNamespace(
        settings=SimpleNamespace(engine=engine_settings, fleet=FleetSettings()),
        restarted=[],
        checkpoints=SimpleNamespace(local_dir=lambda info: dirs[info.version]),
    )
    fleet.restart_replica = lambda group, replica, why: fleet.restarted.append(why)
    return fleet


@contextmanager
def engine(es, model_dir: Path, port: int, logs: Path, strategy: str, ready_s: float):
    from serving.engine import launch, wait_ready
    from serving.replica import Replica
    from tidal.procs import stop_group

    replica = Replica(MODEL, port, port, "127.0.0.1", version(1))
    log = logs / f"engine-{port}.log"
    replica.proc, _ = launch(
        es, replica.name, model_dir, [replica.base.served_name], replica.host, port, False, log, update_strategy=strategy
    )
    try:
        wait_ready(replica.url, ready_s, replica.proc, str(log), f"engine on {port}", replica.base.served_name)
        replica.state = "ready"
        yield replica
    finally:
        stop_group(replica.proc.pid, timeout=15)


def timed_move(strategy, fleet, replica, info) -> float:
    t0 = time.monotonic()
    strategy.move(fleet, None, replica, info)
    return round(time.monotonic() - t0, 3)


def probe_fails(url: str, name: str, checkpoint: Path, atol: float) -> bool:
    from serving.engine import EngineClient
    from serving.probe import ProbeFailed, verify

    with EngineClient(url) as client:
        try:
            verify(client, name, checkpoint, atol)
        except ProbeFailed:
            return True
    return False


def sample_set(url: str, name: str, v1: Path, n: int = 32, tokens: int = 32) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, sampled completion ids): prompts cut from the stdlib, completions sampled at temperature 1."""
    from data_contracts.corpus import read_texts, source_files, stdlib_root
    from training.policy import load_tokenizer
    from training.probe import probe_prompts

    tok = load_tokenizer(v1)
    prompts = probe_prompts(read_texts(source_files(stdlib_root())[60:90]), n=n, prompt_chars=160, seed=7)
    out = []
    for i, p in enumerate(prompts):
        ids = tok.encode(p, add_special_tokens=False)
        body = {
            "model": name,
            "prompt": ids,
            "max_tokens": tokens,
            "temperature": 1.0,
            "seed": i,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        r.raise_for_status()
        out.append((ids, list(r.json()["choices"][0]["token_ids"])))
    return out


def score(url: str, name: str, pairs) -> list[list[float]]:
    """The engine's log-prob of each completion token, from prompt_logprobs over prompt + completion."""
    rows = []
    for ids, completion in pairs:
        body = {"model": name, "prompt": ids + completion, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        r.raise_for_status()
        plp = r.json()["choices"][0]["prompt_logprobs"]
        rows.append([float(plp[len(ids) + j][str(t)]["logprob"]) for j, t in enumerate(completion)])
    return rows


def mismatch(reference: list[list[float]], behaviour: list[list[float]]) -> dict:
    """|Δ log-prob| between two engines on the same tokens, and the share the trainer's truncation caps when
    `reference` plays π_old and `behaviour` μ."""
    import torch

    from training.ppo_config import PPOConfig
    from training.ppo_loss import truncated_is_weight

    old, mu = torch.tensor(reference), torch.tensor(behaviour)  # (B, T)
    diff = (old - mu).abs()
    C = PPOConfig().is_truncation
    w = truncated_is_weight(old, mu, torch.ones_like(old), C)
    return {
        "tokens": diff.numel(),
        "mean_abs_dlogp": round(float(diff.mean()), 6),
        "max_abs_dlogp": round(float(diff.max()), 6),
        "truncated_share": round(float((w >= C).float().mean()), 6),
        "is_truncation_C": C,
    }


def own_process(module: str, function: str, policy_dir: Path, timeout_s: float) -> dict:
    """`module.function(policy_dir)` in its own process (Megatron's process-group state and each CUDA context stay
    out of this one); its figures, or {"error": ...}."""
    code = f"import json, sys\nfrom {module} import {function}\nprint(json.dumps({function}(sys.argv[1])))\n"
    out = subprocess.run(
        [sys.executable, "-c", code, str(policy_dir)], capture_output=True, text=True, timeout=timeout_s, cwd=ROOT
    )
    if out.returncode != 0:
        return {"error": (out.stderr or out.stdout).strip()[-400:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(args) -> tuple[dict, list[str]]:
    from serving.settings import EngineSettings
    from serving.weight_sync.nccl import NcclSync
    from serving.weight_sync.reload import ReloadSync
    from tidal.procs import port_free

    dl, work, figures, errors = Deadline(args.deadline), Path(args.work), {"gpus": args.gpus}, []
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    v1, v2 = tiny_versions(work, pretrain_s=max(5.0, min(20.0, dl.left() - 280)))  # the engines need ~4 min
    figures["policy_s"] = round(time.monotonic() - t0, 1)
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")  # engines on GPU 0; the nccl sender on GPU 1
    python = ROOT / ".engine-venv" / "bin" / "python"
    base = dict(
        python=python,
        flavor="cuda",
        max_model_len=512,
        enforce_eager=True,
        extra_args=["--gpu-memory-utilization", "0.2"],
        nccl_sender_gpu="1" if args.gpus >= 2 else "",
        weight_update_timeout_s=90.0,
    )
    port = next(p for p in range(args.port, args.port + 50) if port_free("127.0.0.1", p))
    fleet = bench_fleet(EngineSettings(dtype="float32", **base), {1: v1, 2: v2})
    atol = fleet.settings.fleet.probe_tolerance(fleet.settings.engine)
    reload, nccl = ReloadSync(), NcclSync()
    reload.drain_grace_s = nccl.drain_grace_s = 0.0
    pairs, scores = [], {}
    t1 = time.monotonic()
    with engine(fleet.settings.engine, v1, port, logs, "nccl", dl.cap(240)) as a:
        figures["engine_ready_s"] = round(time.monotonic() - t1, 1)
        figures["probe_v1_at_start"] = not probe_fails(a.url, version(1).served_name, v1, atol)
        try:
            figures["reload_update_s"] = timed_move(reload, fleet, a, version(2))
            figures["reload_probe_pass"] = True  # move() raises unless the new version's probe passed
            figures["reload_changed_weights"] = probe_fails(a.url, version(1).served_name, v1, atol)
        except Exception as e:  # noqa: BLE001
            figures["reload_probe_pass"] = False
            errors.append(f"reload: {e}")
        if args.gpus < 2:
            figures["nccl"] = (
                "not run: one GPU; NCCL allows one rank per GPU in a group, so the sender needs a GPU the engine does not use"
            )
        else:
            try:
                figures["nccl_update_s"] = timed_move(nccl, fleet, a, version(1))
                figures["nccl_second_update_s"] = timed_move(nccl, fleet, a, version(2))
                figures["nccl_probe_pass"] = True
                figures["nccl_rendezvous_ports"] = list(nccl.recent_ports)
            except Exception as e:  # noqa: BLE001
                figures["nccl_probe_pass"] = False
                errors.append(f"nccl: {e}")
        figures["restarts_requested"] = list(fleet.restarted)
        name = a.base.served_name  # whatever version it serves now: the comparison only needs the same weights
        weights = fleet.checkpoints.local_dir(a.base)
        pairs = sample_set(a.url, name, v1)
        scores["float32"] = score(a.url, name, pairs)
    for label, extra in (("bfloat16", {}), ("fp8", {"quantization": "fp8"})):
        es = EngineSettings(dtype="bfloat16", **base, **extra)
        try:
            with engine(es, weights, port, logs, "", dl.cap(240)) as other:
                scores[label] = score(other.url, other.base.served_name, pairs)
        except Exception as e:  # noqa: BLE001
            errors.append(f"{label} engine: {e}")
    if "bfloat16" in scores and "fp8" in scores:
        figures["fp8_vs_bf16"] = mismatch(scores["bfloat16"], scores["fp8"])
    if "bfloat16" in scores:
        figures["bf16_vs_fp32"] = mismatch(scores["float32"], scores["bfloat16"])
    try:
        figures["megatron"] = own_process("training.megatron.check", "gpu_check_step", v1, dl.cap(120))
    except Exception as e:  # noqa: BLE001
        figures["megatron"] = {"error": str(e)[:300]}
    try:
        trainer = figures["trainer"] = own_process("training.trainer_check", "gpu_check_trainer", v1, dl.cap(120))
    except Exception as e:  # noqa: BLE001
        trainer = figures["trainer"] = {"error": str(e)[:300]}
    if trainer_problem := trainer_fails(trainer):
        errors.append(f"trainer: {trainer_problem}")
    return figures, errors


def trainer_fails(t: dict) -> str:
    """What is wrong with the one-GPU trainer's figures ('' when nothing)."""
    if "error" in t:
        return t["error"]
    if t["trainer_device"] != "cuda":
        return f"the trainer ran on {t['trainer_device']}, not the GPU (train.ppo.device 'auto')"
    if not t["trainer_finite"]:
        return "a loss or metric is not finite"
    if t["trainer_micro_vs_whole"] > 0.01:
        return f"micro-batches moved the weights {t['trainer_micro_vs_whole']:.3g} of the step away from the whole minibatch's"
    if t["trainer_lora_frozen_dtype"] != "bfloat16":
        return f"the LoRA run's frozen base was {t['trainer_lora_frozen_dtype']}, not bfloat16 as stored"
    if t["trainer_bf16_vs_fp32_cosine"] < 0.9:
        return f"the bf16 step points elsewhere than float32's (cosine {t['trainer_bf16_vs_fp32_cosine']:.3f})"
    return ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="GPU paths check (see bench/gpu_check.sh)")
    p.add_argument("--deadline", type=float, required=True, help="epoch seconds by which everything must be done")
    p.add_argument("--work", required=True, help="scratch directory (policy, logs)")
    p.add_argument("--gpus", type=int, required=True, help="CUDA devices nvidia-smi lists")
    p.add_argument("--port", type=int, default=8390, help="first engine port to try")
    args = p.parse_args(argv)
    try:
        figures, errors = run(args)
    except Exception as e:  # noqa: BLE001  the JSON line must come out whatever happened
        traceback.print_exc()
        figures, errors = {"gpus": args.gpus}, [f"{type(e).__name__}: {e}"]
    figures["errors"] = [x[:600] for x in errors]
    if errors:  # what the engines said, for whoever reads the run's output
        for log in sorted((Path(args.work) / "logs").glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-15:]
            print(f"--- {log.name} (last lines)\n" + "\n".join(tail), file=sys.stderr)
    for k, v in figures.items():
        print(f"  {k}: {v}")
    print(json.dumps(figures, default=str))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
