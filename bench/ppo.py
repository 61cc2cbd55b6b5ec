"""PPO update throughput: Tidal's trainer against TRL's PPOTrainer (trl.experimental.ppo, trl==1.12.0).

    .venv/bin/python -m bench.ppo [--steps 5] [--threads 2] [--full]

What is measured: tokens/s of ONE PPO update on one batch of 64 samples, each a 200-token prompt
(windows of real stdlib code) and a 32-token completion, for both trainers on the same tiny policy
(the default PolicyConfig, ~1M-parameter Qwen2 with random weights, built and saved once by the
parent) and the same prompts. tokens/s = 64 * (200 + 32) / wall seconds of one update step, the
median over --steps timed steps after one warm-up step, identically on both sides.

    tidal  compute_reference (the reference forward) + rollout (pi_old, values, IS weights, GAE)
           + update (epochs x minibatches of forward/backward) on the logged completions
    trl    one iteration of PPOTrainer.train(): generate 32 tokens, reference / value / reward
           forwards, GAE, then the same epochs x minibatches of PPO steps (timed between
           on_train_begin / on_step_end callbacks; generation is timed apart by wrapping
           batch_generation, so `trl_update_only_tokens_per_s` excludes it)

Shared settings: LoRA r=8 alpha=16 on all projections (--full: every weight), 2 epochs, minibatches
of 16, lr 1e-4, clip 0.2, value clip 0.2, vf_coef 0.5, kl_coef 0.05, gamma 1, lambda 0.95, float32,
no gradient checkpointing, no early stop, the same torch thread count. Differences that are part of
each design (not equalised): TRL samples its completions and scores them with a reward model, and its
critic is a separate value model (a full Qwen2 trunk, all weights trained) while Tidal's value head
shares the policy's trunk; TRL's reference is the policy with its adapter disabled (a frozen copy
with --full); Tidal clips gradient norms, TRL's loop does not.

Each side runs in its own process: Tidal in the project's venv, TRL in a venv of its own
(~/.cache/tidal/envs/bench-trl-1.12.0, created on first use with trl==1.12.0 and the project's own
torch/transformers/tokenizers/peft/accelerate versions, reused while those match; TRL is never a
project requirement; where pip finds no `torch==X+cpu` wheel, set PIP_EXTRA_INDEX_URL to PyTorch's CPU
index, https://download.pytorch.org/whl/cpu). The two
processes run in lockstep, one update step at a time, taking turns (who goes first alternates per
round): they never compute at once, and load from other work on a shared machine hits both alike.
Progress goes to stderr; the last stdout line is one JSON object (tidal_tokens_per_s, trl_tokens_per_s,
ratio = their quotient, per-phase seconds, CPU seconds per step, versions, threads). On a busy machine
compare `ratio` with `ratio_paired` (median of per-round ratios) and `ratio_best` (best step of each
side): when they disagree, other work slowed some steps. Nothing is asserted on the timings.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench.ppo_sides import GO, READY, SHARED, Batch, log

SIDES = Path(__file__).resolve().with_name("ppo_sides.py")  # each side's process runs this script
TRL_VERSION = "1.12.0"
TRL_ENV = Path.home() / ".cache" / "tidal" / "envs" / f"bench-trl-{TRL_VERSION}"
ENV_MARKER = "tidal-bench.json"  # written into the TRL venv once its install succeeded
# Installed into the TRL venv at exactly the project venv's versions, so both sides run the same kernels.
PINNED = ("torch", "transformers", "tokenizers", "safetensors", "huggingface-hub", "peft", "accelerate")
# A few stdlib modules: the tokenizer's training text and the source of the prompt/completion windows.
CORPUS_FILES = (
    "argparse.py",
    "inspect.py",
    "typing.py",
    "dataclasses.py",
    "functools.py",
    "enum.py",
    "textwrap.py",
    "pathlib.py",
    "subprocess.py",
    "heapq.py",
    "bisect.py",
    "json/decoder.py",
)


def batch_tokens(batch: Batch) -> int:
    """Prompt + completion tokens of the batch: the numerator of tokens/s on both sides."""
    B, P, T = batch.shape
    return B * (P + T)


def tokens_per_s(tokens: int, seconds: float) -> float:
    return tokens / seconds


def paired_ratio(tidal_s: Sequence[float], trl_s: Sequence[float]) -> float:
    """Median over rounds of trl seconds / tidal seconds of the same round. The two steps of a round run
    back to back, so a load spike from other work that spans a round cancels out of its ratio."""
    if len(tidal_s) != len(trl_s) or not tidal_s:
        raise ValueError("one step per side and round")
    return statistics.median(b / a for a, b in zip(tidal_s, trl_s))


def code_windows(token_streams: Sequence[Sequence[int]], n: int, width: int) -> list[list[int]]:
    """n disjoint windows of `width` consecutive tokens, taken in order from the streams (one per file)."""
    out: list[list[int]] = []
    for ids in token_streams:
        for i in range(0, len(ids) - width + 1, width):
            if len(out) == n:
                return out
            out.append(list(ids[i : i + width]))
    if len(out) < n:
        raise ValueError(f"the corpus holds only {len(out)} windows of {width} tokens, {n} needed")
    return out


def prepare(model_dir: Path, n: int, prompt_len: int, completion_len: int, seed: int) -> Batch:
    """Train the tokenizer, build and save the tiny policy into model_dir, and cut the batch from real code:
    prompt = `prompt_len` tokens, completion = the `completion_len` tokens that follow it in the file."""
    import torch

    from data_contracts.corpus import read_texts, stdlib_root
    from training.policy import PolicyConfig, build_policy, save_policy
    from training.tokenizer import train_tokenizer

    texts = read_texts([stdlib_root() / f for f in CORPUS_FILES])
    tok = train_tokenizer(texts, vocab_size=1024)
    model = build_policy(PolicyConfig(), tok, seed=seed)
    save_policy(model, tok, model_dir)
    streams = [tok(t)["input_ids"] for t in texts]
    windows = code_windows(streams, n, prompt_len + completion_len)
    if any(tok.pad_token_id in w for w in windows):  # TRL reads pad ids as padding: keep them out of the batch
        raise ValueError("the pad token occurs in the corpus windows")
    ids = torch.tensor(windows)  # (B, P + T)
    with torch.no_grad():  # mu = the policy's own log-probs of the completion tokens (IS weights ~ 1)
        logits = model(input_ids=ids).logits[:, prompt_len - 1 : -1]  # (B, T, V) predicting tokens P..P+T-1
        mu = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, prompt_len:, None]).squeeze(-1)  # (B, T)
    rng = random.Random(seed)
    return Batch(
        prompt_ids=[w[:prompt_len] for w in windows],
        completion_ids=[w[prompt_len:] for w in windows],
        rewards=[rng.choice((-1.0, 1.0)) for _ in windows],
        behaviour_logprobs=[[round(float(x), 6) for x in row] for row in mu],
    )


# --- the TRL venv ---------------------------------------------------------------------------------------
def pinned_requirements() -> list[str]:
    """`name==version` of the project venv's torch stack (read in the running interpreter), plus trl."""
    from importlib.metadata import version

    return [f"trl=={TRL_VERSION}"] + [f"{name}=={version(name)}" for name in PINNED]


def ensure_trl_env(env: Path = TRL_ENV) -> Path:
    """The TRL venv's python, creating the venv or (re)installing the pins when they are missing or stale."""
    python, marker = env / "bin" / "python", env / ENV_MARKER
    reqs = pinned_requirements()
    if python.is_file() and marker.is_file() and json.loads(marker.read_text()).get("requirements") == reqs:
        return python
    if not python.is_file():
        log(f"creating {env} (first run: installs {reqs[0]}, a few minutes)")
        # the base interpreter of the project venv (venv resolves sys._base_executable): same CPython build
        subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
    log(f"pip install {' '.join(reqs)}")
    subprocess.run(
        [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", *reqs], check=True, stdout=sys.stderr
    )
    marker.write_text(json.dumps({"requirements": reqs}))
    return python


class Side:
    """The parent's end of one child process running `--side NAME`."""

    def __init__(self, name: str, python: Path, model_dir: Path, batch_file: Path, args: argparse.Namespace):
        cmd = [
            str(python),
            str(SIDES),
            "--side",
            name,
            "--model",
            str(model_dir),
            "--batch",
            str(batch_file),
            "--steps",
            str(args.steps),
            "--threads",
            str(args.threads),
        ]
        env = dict(
            os.environ,
            OMP_NUM_THREADS=str(args.threads),
            MKL_NUM_THREADS=str(args.threads),
            TOKENIZERS_PARALLELISM="false",
            TRL_EXPERIMENTAL_SILENCE="1",
            HF_HUB_OFFLINE="1",
            HF_DATASETS_OFFLINE="1",
            TRANSFORMERS_VERBOSITY="error",
        )
        self.name = name
        self.proc = subprocess.Popen(
            cmd + (["--full"] if args.full else []), env=env, text=True, bufsize=1, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )  # stderr passes through
        self.line = self._read()  # blocks through the child's setup, until it waits before step 0

    def _read(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} side exited with status {self.proc.wait()} (its stderr is above)")
        return line.strip()

    def step(self) -> None:
        """Let the child run one step; returns when it waits before the next one (or printed its result)."""
        if self.line != READY:
            raise RuntimeError(f"the {self.name} side is not waiting for a step: {self.line[:200]!r}")
        self.proc.stdin.write(GO + "\n")
        self.proc.stdin.flush()
        self.line = self._read()

    def result(self) -> dict:
        if self.proc.wait() != 0:
            raise RuntimeError(f"the {self.name} side exited with status {self.proc.returncode}")
        return json.loads(self.line)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def run_lockstep(sides: list[Side], steps: int) -> None:
    """1 + steps rounds; each side runs one step per round, the first one alternating between rounds."""
    for k in range(1 + steps):
        for side in sides if k % 2 == 0 else sides[::-1]:
            side.step()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5, help="timed update steps per side (after one warm-up)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads on both sides")
    ap.add_argument("--full", action="store_true", help="fine-tune every weight on both sides instead of LoRA")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.threads < 1:
        ap.error("--steps and --threads must be >= 1")
    trl_python = ensure_trl_env()
    with tempfile.TemporaryDirectory(prefix="bench-ppo-") as tmp:
        model_dir, batch_file = Path(tmp) / "policy", Path(tmp) / "batch.json"
        log("building the tiny policy and the batch")
        batch = prepare(model_dir, n=SHARED["batch_size"], prompt_len=200, completion_len=32, seed=SHARED["seed"])
        batch.save(batch_file)
        log(f"batch (B, P, T) = {batch.shape}; starting the Tidal side, then the TRL side")
        sides: list[Side] = []
        try:  # started one after the other, so their setups do not overlap either
            sides.append(Side("tidal", Path(sys.executable), model_dir, batch_file, args))
            sides.append(Side("trl", trl_python, model_dir, batch_file, args))
            log(f"both sides ready: {1 + args.steps} rounds of one step each, taking turns")
            run_lockstep(sides, args.steps)
            tidal, trl = (s.result() for s in sides)
        finally:
            for s in sides:
                s.kill()

    tokens = batch_tokens(batch)
    tidal_s, trl_s = statistics.median(tidal["step_s"]), statistics.median(trl["step_s"])
    trl_update_s = trl_s - trl["generation_s"]  # TRL's median step less its median time in batch_generation
    result = {
        "bench": "ppo",
        "tidal_tokens_per_s": round(tokens_per_s(tokens, tidal_s), 1),
        "trl_tokens_per_s": round(tokens_per_s(tokens, trl_s), 1),
        "ratio": round(trl_s / tidal_s, 2),  # = tidal_tokens_per_s / trl_tokens_per_s
        "trl_update_only_tokens_per_s": round(tokens_per_s(tokens, trl_update_s), 1),
        "ratio_vs_trl_update_only": round(trl_update_s / tidal_s, 2),
        # robust to other work on the machine: per-round ratios' median, and best step of each side
        "ratio_paired": round(paired_ratio(tidal["step_s"], trl["step_s"]), 2),
        "ratio_best": round(min(trl["step_s"]) / min(tidal["step_s"]), 2),
        "tidal_step_s": round(tidal_s, 3),
        "trl_step_s": round(trl_s, 3),
        "trl_generation_s": round(trl["generation_s"], 3),
        "tidal_reference_s": round(tidal["reference_s"], 3),
        "tidal_rollout_s": round(tidal["rollout_s"], 3),
        "tidal_update_s": round(tidal["update_s"], 3),
        # CPU seconds per step (all threads): less sensitive than wall time to other work on a shared machine
        "tidal_cpu_s": round(tidal["cpu_s"], 3),
        "trl_cpu_s": round(trl["cpu_s"], 3),
        "tidal_steps_s": tidal["step_s"],
        "trl_steps_s": trl["step_s"],
        "batch": dict(zip(("samples", "prompt_tokens", "completion_tokens"), batch.shape)),
        "tokens": tokens,
        "epochs": SHARED["epochs"],
        "minibatch_size": SHARED["minibatch_size"],
        "finetune": "full" if args.full else "lora_r8",
        "tidal_trainable_params": tidal["trainable_params"],
        "trl_trainable_params": trl["trainable_params"],
        "threads": {"tidal": tidal["threads"], "trl": trl["threads"]},
        "torch": tidal["torch"],
        "trl_torch": trl["torch"],
        "trl": trl["trl"],
        "trl_transformers": trl["transformers"],
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
