"""Probe tolerance per serving dtype, measured on the real engine: how far an engine serving a checkpoint at a dtype
is from each probe Tidal can hold for it, and how far a corrupted checkpoint is from the same probes.

    policy      a small Qwen2 of our own, pretrained here for --pretrain-seconds (a random model's flat
                distributions would hide the gaps), or --checkpoint DIR
    per dtype   the checkpoint saved in that dtype (a bf16 engine serves a bf16 checkpoint), then scored
                against three probes on the same prompts:
                  trainer_fp32   the trainer's probe: an HF forward in float32 (what candidates carry today)
                  trainer_dtype  an HF forward with the weights in the serving dtype
                  engine         the engine's own greedy tokens and log-probs (what `tidal import` records)
                and a corrupted copy (every weight times 1 + 2% Gaussian noise) served the same way.
    figures     for each pair, the largest |Δ log-prob| while the greedy tokens agree and the prompts whose
                tokens differ: a tolerance must sit above the clean figures and below the corrupted ones.

fp8 needs a CUDA engine; bench/gpu_check.py measures it there. Prints one JSON line (last line).

    .venv/bin/python bench/probe_dtype.py --dtypes float32,bfloat16 --prompts 16
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def small_policy(out: Path, seconds: float) -> Path:
    from tasks.bootstrap import load_corpus, pretrain_policy, train_base_tokenizer
    from training.policy import save_policy
    from training.train_settings import BootstrapSettings

    cfg = BootstrapSettings(pretrain={"max_seconds": seconds})
    corpus = load_corpus.fn(cfg.heldout_fraction)
    tok = train_base_tokenizer.fn(corpus.train, cfg.vocab_size)
    model, result = pretrain_policy.fn(tok, corpus, cfg)
    print(f"pretrained {result.steps} steps: held-out {result.heldout_bits_per_byte:.3f} bits/byte", file=sys.stderr)
    return save_policy(model, tok, out)


def saved_as(src: Path, out: Path, dtype: str, noise: float = 0.0, seed: int = 0) -> Path:
    """``src`` with every weight cast to ``dtype`` (times 1 + noise·N(0, 1) when noise > 0)."""
    import torch

    from training.policy import load_policy, load_tokenizer, save_policy

    model = load_policy(src)
    if noise > 0:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + noise * torch.randn(p.shape, generator=gen))
    return save_policy(model.to(getattr(torch, dtype)), load_tokenizer(src), out)


def trainer_probe(ckpt: Path, prompts: list[str], tokens: int, dtype: str):
    import torch

    from training.policy import load_policy, load_tokenizer
    from training.probe import compute_probe

    return compute_probe(load_policy(ckpt, dtype=getattr(torch, dtype)), load_tokenizer(ckpt), prompts, tokens)


def compare(engine, served: str, probe) -> dict:
    from serving.probe import run_probe

    report = run_probe(engine, served, probe, atol=float("inf"))
    return {"max_abs": round(report.max_abs_diff, 6), "non_finite_prompts": report.token_mismatches}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=None, help="a trained float32 policy (default: pretrain one here)")
    p.add_argument("--pretrain-seconds", type=float, default=90.0)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--noise", type=float, default=0.02, help="relative weight noise of the corrupted copy")
    args = p.parse_args()

    from data_contracts import corpus
    from serving.engine import EngineClient, scratch_engine
    from serving.probe import record_probe
    from serving.settings import EngineSettings
    from training.probe import probe_prompts

    t0 = time.monotonic()
    out: dict = {"bench": "probe_dtype", "prompts": args.prompts, "tokens": args.tokens, "noise": args.noise}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        src = args.checkpoint or small_policy(tmp / "policy", args.pretrain_seconds)
        _, heldout = corpus.split_stdlib(0.1)
        prompts = probe_prompts(corpus.read_texts(heldout[:200]), n=args.prompts, seed=3)
        for dtype in args.dtypes.split(","):
            clean = saved_as(src, tmp / f"{dtype}-clean", dtype)
            broken = saved_as(src, tmp / f"{dtype}-corrupt", dtype, noise=args.noise)
            probes = {"trainer_fp32": trainer_probe(clean, prompts, args.tokens, "float32")}
            probes["trainer_dtype"] = trainer_probe(clean, prompts, args.tokens, dtype)
            figures: dict = {}
            es = EngineSettings(dtype=dtype)
            with scratch_engine(es, clean, "clean", tmp / f"{dtype}-clean.log", 300) as url, EngineClient(url) as engine:
                ids = [item.prompt_token_ids for item in probes["trainer_fp32"].items]
                probes["engine"] = record_probe(engine, "clean", ids, args.tokens)
                figures["clean"] = {name: compare(engine, "clean", probe) for name, probe in probes.items()}
            with scratch_engine(es, broken, "broken", tmp / f"{dtype}-broken.log", 300) as url, EngineClient(url) as engine:
                figures["corrupted"] = {name: compare(engine, "broken", probe) for name, probe in probes.items()}
            out[dtype] = figures
            print(f"{dtype}: {json.dumps(figures)}", file=sys.stderr)
    out["seconds"] = round(time.monotonic() - t0, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
