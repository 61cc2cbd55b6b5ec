"""The two sides of bench/ppo.py, each run in its own process under the parent's lockstep gate.

    python bench/ppo_sides.py --side tidal|trl --model DIR --batch FILE --steps N --threads N [--full]

Run as a script by bench.ppo (never imported by the TRL side's interpreter as part of the project): the
module imports only the standard library at its top, since the TRL venv holds no project code; the
Tidal side puts the project root on sys.path itself. See bench/ppo.py for what is measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# = training.ppo_config.LORA_TARGETS (the TRL child cannot import the project); a unit test keeps them equal
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Hyper-parameters both trainers get (names as in training.ppo_config.PPOConfig).
SHARED = dict(
    batch_size=64,
    minibatch_size=16,
    epochs=2,
    learning_rate=1e-4,
    clip_eps=0.2,
    value_clip_eps=0.2,
    vf_coef=0.5,
    kl_coef=0.05,
    gamma=1.0,
    gae_lambda=0.95,
    lora_rank=8,
    lora_alpha=16,
    seed=0,
)
_T0 = time.perf_counter()
_WHO = "bench.ppo"  # "bench.ppo:tidal" / "bench.ppo:trl" in the child processes


def log(msg: str) -> None:
    print(f"[{_WHO} {time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


# --- the batch both sides train on --------------------------------------------------------------------
@dataclass
class Batch:
    """B samples of fixed shape: prompt (B, P) and completion (B, T) token ids, (B,) rewards, (B, T) mu."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    rewards: list[float]
    behaviour_logprobs: list[list[float]]

    def __post_init__(self) -> None:
        B = len(self.prompt_ids)
        if not B or {len(self.completion_ids), len(self.rewards), len(self.behaviour_logprobs)} != {B}:
            raise ValueError("batch columns must hold the same number (>= 1) of samples")
        if len({len(p) for p in self.prompt_ids}) != 1 or len({len(c) for c in self.completion_ids}) != 1:
            raise ValueError("every prompt (and every completion) must have the same length: no padding in the bench")
        if any(len(m) != len(c) for m, c in zip(self.behaviour_logprobs, self.completion_ids)):
            raise ValueError("one behaviour log-prob per completion token")

    @property
    def shape(self) -> tuple[int, int, int]:
        """(B, P, T)."""
        return len(self.prompt_ids), len(self.prompt_ids[0]), len(self.completion_ids[0])

    def save(self, path: Path) -> Path:
        path.write_text(json.dumps(asdict(self)))
        return path

    @classmethod
    def load(cls, path: Path) -> Batch:
        return cls(**json.loads(path.read_text()))


# --- lockstep: the two sides take turns, one update step at a time ---------------------------------------
READY, GO = "ready", "go"  # child -> parent before each step (or its JSON at the end); parent -> child


class Gate:
    """The child's end of the lockstep: before each step it says `ready` (stdout) and waits for `go` (stdin).

    The parent lets one side run one step, then the other (alternating who goes first), so the two
    never compute at the same time and a load spike on a shared machine hits both sides alike.
    """

    def __init__(self) -> None:
        self.out, self.inp = sys.__stdout__, sys.stdin  # sys.__stdout__: TRL's logs are redirected off stdout

    def wait(self) -> None:
        print(READY, file=self.out, flush=True)
        if self.inp.readline().strip() != GO:
            raise SystemExit("the parent benchmark went away")


def spans(starts: Sequence[float], ends: Sequence[float]) -> list[float]:
    """Seconds of each step from its start and end times."""
    if len(starts) != len(ends):
        raise ValueError(f"{len(starts)} step starts for {len(ends)} step ends")
    return [e - s for s, e in zip(starts, ends)]


# --- the two sides (each in its own process) ------------------------------------------------------------
def set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def run_tidal(model_dir: Path, batch: Batch, steps: int, threads: int, full: bool, gate: Gate) -> dict:
    """Seconds of compute_reference + rollout + update on the batch, per step after one warm-up step."""
    sys.path.insert(0, str(ROOT))
    import torch

    from data_contracts.samples import RewardSample
    from training.candidate import build_trainable
    from training.policy import load_tokenizer
    from training.ppo_config import PPOConfig
    from training.ppo_trainer import PPOTrainer

    set_threads(threads)
    samples = [
        RewardSample(
            request_id=f"bench-{i}",
            model="bench",
            version=1,
            arm="control",
            user_hash="u",
            prompt_token_ids=p,
            completion_token_ids=c,
            behaviour_logprobs=mu,
            completion_text="",
            event="accepted" if r > 0 else "rejected",
            reward=r,
            reward_rule="bench@1",
            completion_time_ms=0,
        )
        for i, (p, c, r, mu) in enumerate(zip(batch.prompt_ids, batch.completion_ids, batch.rewards, batch.behaviour_logprobs))
    ]
    cfg = PPOConfig(**SHARED, lora=not full, target_kl=None)  # no early stop: every epoch runs, as in TRL
    model = build_trainable(model_dir, model_dir, cfg)
    trainer = PPOTrainer(model, cfg, pad_token_id=load_tokenizer(model_dir).pad_token_id)
    rows = list(range(len(samples)))
    parts: list[tuple[float, float, float]] = []  # per step: reference, rollout, update seconds
    cpu: list[float] = []  # per step: CPU seconds of this process (all threads)
    for it in range(1 + steps):
        gate.wait()
        c0, t0 = time.process_time(), time.perf_counter()
        trainer.compute_reference(samples)  # Tidal does this once per dataset; timed here so both pay for it
        t1 = time.perf_counter()
        ro = trainer.rollout(samples, rows)
        t2 = time.perf_counter()
        trainer.update(ro, it)
        t3 = time.perf_counter()
        parts.append((t1 - t0, t2 - t1, t3 - t2))
        cpu.append(time.process_time() - c0)
        log(f"tidal step {it}{' (warm-up)' if it == 0 else ''}: {t3 - t0:.2f}s")
    timed = parts[1:]
    return {
        "step_s": [round(sum(p), 4) for p in timed],
        "cpu_s": statistics.median(cpu[1:]),
        "reference_s": statistics.median(p[0] for p in timed),
        "rollout_s": statistics.median(p[1] for p in timed),
        "update_s": statistics.median(p[2] for p in timed),
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def run_trl(model_dir: Path, batch: Batch, steps: int, threads: int, full: bool, gate: Gate) -> dict:
    """Seconds of one PPOTrainer.train() iteration on the batch's prompts, per step after one warm-up step."""
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as trl_ppo

    set_threads(threads)
    B, P, T = batch.shape
    gen_s: list[float] = []
    generate = trl_ppo.batch_generation

    def timed_generation(*args, **kwargs):  # the T-token sampling of each iteration, timed apart
        t = time.perf_counter()
        out = generate(*args, **kwargs)
        gen_s.append(time.perf_counter() - t)
        return out

    trl_ppo.batch_generation = timed_generation  # train() looks the module global up on every call

    class Steps(TrainerCallback):
        """(perf_counter, process_time) when each iteration starts (train begin, or resuming after the
        previous step end) and ends (on_step_end); waits at the gate in between."""

        def __init__(self) -> None:
            self.starts: list[tuple[float, float]] = []
            self.ends: list[tuple[float, float]] = []

        def _start(self) -> None:
            gate.wait()
            self.starts.append((time.perf_counter(), time.process_time()))

        def on_train_begin(self, args, state, control, **kwargs):
            self._start()

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append((time.perf_counter(), time.process_time()))
            k = len(self.ends) - 1
            log(f"trl step {k}{' (warm-up)' if k == 0 else ''}: {self.ends[k][0] - self.starts[k][0]:.2f}s")
            if len(self.ends) < 1 + steps:
                self._start()

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    torch.manual_seed(SHARED["seed"])  # the score heads of the value and reward models
    policy = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    value = AutoModelForSequenceClassification.from_pretrained(str(model_dir), num_labels=1, dtype=torch.float32)
    reward = AutoModelForSequenceClassification.from_pretrained(str(model_dir), num_labels=1, dtype=torch.float32)
    data = Dataset.from_dict({"input_ids": batch.prompt_ids})  # the same B prompts every iteration
    peft_config = (
        None
        if full
        else LoraConfig(
            r=SHARED["lora_rank"],
            lora_alpha=SHARED["lora_alpha"],
            lora_dropout=0.0,
            target_modules=list(LORA_TARGETS),
            task_type="CAUSAL_LM",
        )
    )  # = Tidal's PPOConfig.lora_config()
    marks = Steps()
    with tempfile.TemporaryDirectory(prefix="bench-ppo-trl-") as out:
        args = PPOConfig(
            output_dir=out,
            report_to="none",
            save_strategy="no",
            logging_steps=1,
            disable_tqdm=True,
            use_cpu=True,
            bf16=False,
            fp16=False,
            gradient_checkpointing=False,
            dataloader_num_workers=0,
            seed=SHARED["seed"],
            # one dataloader batch = the B prompts = one PPO iteration; minibatch = one micro batch of 16
            total_episodes=B * (1 + steps),
            per_device_train_batch_size=B,
            gradient_accumulation_steps=1,
            num_mini_batches=B // SHARED["minibatch_size"],
            num_ppo_epochs=SHARED["epochs"],
            local_rollout_forward_batch_size=B,
            response_length=T,
            num_sample_generations=0,
            learning_rate=SHARED["learning_rate"],
            cliprange=SHARED["clip_eps"],
            cliprange_value=SHARED["value_clip_eps"],
            vf_coef=SHARED["vf_coef"],
            kl_coef=SHARED["kl_coef"],
            gamma=SHARED["gamma"],
            lam=SHARED["gae_lambda"],
        )
        trainer = PPOTrainer(
            args=args,
            processing_class=tok,
            model=policy,
            ref_model=None,
            reward_model=reward,
            train_dataset=data,
            value_model=value,
            eval_dataset=data,
            callbacks=[marks],
            peft_config=peft_config,
        )
        trainer.train()
    steps_s = spans([s[0] for s in marks.starts], [e[0] for e in marks.ends])[1:]
    gens = gen_s[1 : 1 + len(steps_s)]
    return {
        "step_s": [round(s, 4) for s in steps_s],
        "cpu_s": statistics.median(spans([s[1] for s in marks.starts], [e[1] for e in marks.ends])[1:]),
        "generation_s": statistics.median(gens),
        "trainable_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "trl": trl.__version__,
        "transformers": transformers.__version__,
    }


def side_main(args: argparse.Namespace) -> None:
    """Child mode: run one side under the gate; the last stdout line is its JSON."""
    global _WHO
    _WHO = f"bench.ppo:{args.side}"
    run = run_tidal if args.side == "tidal" else run_trl
    gate = Gate()
    with contextlib.redirect_stdout(sys.stderr):  # libraries' prints (TRL logs its metrics) stay off the protocol
        result = run(Path(args.model), Batch.load(Path(args.batch)), args.steps, args.threads, args.full, gate)
    print(json.dumps(result), file=gate.out, flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="one side of bench/ppo.py (child mode)")
    ap.add_argument("--side", choices=("tidal", "trl"), required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--full", action="store_true")
    side_main(ap.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
