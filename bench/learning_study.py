"""The offline learning study (docs/learning.md): several training configurations on the same logged traffic.

Each configuration is one `bench/offline_ppo.py --simulate N` run in its own process, all reading one
`--rows-file` (the checkpoint's Tab traffic, sampled once and judged by the simulated users), all scored on the
same held-out requests. Prints a markdown table, one row per configuration and evaluation: the trained policy
against the checkpoint, paired on the same requests (ratios and differences with 95% intervals), against the
checkpoint's best truncation, and held-out code bits/byte. The last line is JSON: every configuration's
learning report (sim/learning_report.py).

Usage:
  .venv/bin/python bench/learning_study.py --checkpoint .tidal/store/checkpoints/model=tab/version=1 \\
      --simulate 4000 --iterations 120 --eval-at 40,80 --configs ppo,stop1,stop1_chars
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's packages, run as a script

# The PPO settings every configuration starts from: the demo's, with the training levers the study measures
# turned off and two passes (the demo's settings when the study was run; the demo now runs `stop1_budget50_kept4_ptxc`).
STUDY_BASE = {
    "passes": 2,
    "stop_credit_coef": 0.0,
    "abstain_budget": 1.0,
    "kept_credit_coef": 0.0,
    "ptx_coef": 0.0,
    "ptx_given_continues": False,
    "hindsight_partials": False,
    "partial_credit": "last_token",
}

# name: (PPO overrides, reward-rule overrides), each on top of STUDY_BASE
CONFIGS: dict[str, tuple[dict, dict]] = {
    "ppo": ({}, {}),
    "stop1": ({"stop_credit_coef": 1.0}, {}),
    "stop4": ({"stop_credit_coef": 4.0}, {}),
    "chars": ({}, {"accept_scale_by_chars": True}),
    "stop1_chars": ({"stop_credit_coef": 1.0}, {"accept_scale_by_chars": True}),
    "stop1_kl02": ({"stop_credit_coef": 1.0, "kl_coef": 0.02}, {}),
    "hindsight": ({"hindsight_partials": True}, {}),
    "kl01": ({"kl_coef": 0.01}, {}),
    "hindsight_kl01": ({"hindsight_partials": True, "kl_coef": 0.01}, {}),
    "stop1_shown": ({"stop_credit_coef": 1.0, "stop_credit_abstain": False}, {}),
    "stop4_shown": ({"stop_credit_coef": 4.0, "stop_credit_abstain": False}, {}),
    "stop1_shown_hindsight": ({"stop_credit_coef": 1.0, "stop_credit_abstain": False, "hindsight_partials": True}, {}),
    "stop1_hindsight": ({"stop_credit_coef": 1.0, "hindsight_partials": True}, {}),
    # a rejection costs a glance: -0.02 or -0.05 instead of -0.25 (the accept and partial rewards unchanged)
    "rej02_stop1_hindsight": ({"stop_credit_coef": 1.0, "hindsight_partials": True}, {"rejected": -0.02}),
    "rej05_stop1_hindsight": ({"stop_credit_coef": 1.0, "hindsight_partials": True}, {"rejected": -0.05}),
    "stop1_hindsight_ptx": ({"stop_credit_coef": 1.0, "hindsight_partials": True, "ptx_coef": 1.0}, {}),
    # the expected number of right tokens where users kept the text (training/kept_credit.py)
    "kept1": ({"kept_credit_coef": 1.0}, {}),
    "kept4": ({"kept_credit_coef": 4.0}, {}),
    # abstaining credited, on at most a quarter of the requests (training/stop_credit.py)
    "stop1_budget25_kept4_ptx": ({"stop_credit_coef": 1.0, "abstain_budget": 0.25, "kept_credit_coef": 4.0, "ptx_coef": 1.0}, {}),
    "stop1_budget25": ({"stop_credit_coef": 1.0, "abstain_budget": 0.25}, {}),
    "stop1_budget25_kept4_hindsight": (
        {"stop_credit_coef": 1.0, "abstain_budget": 0.25, "kept_credit_coef": 4.0, "hindsight_partials": True},
        {},
    ),
    "stop1_budget25_kept4_ptx025": (
        {"stop_credit_coef": 1.0, "abstain_budget": 0.25, "kept_credit_coef": 4.0, "ptx_coef": 0.25},
        {},
    ),
    "stop2_budget25_kept8_ptx025": (
        {"stop_credit_coef": 2.0, "abstain_budget": 0.25, "kept_credit_coef": 8.0, "ptx_coef": 0.25},
        {},
    ),
    "stop1_budget25_kept4_ptxc": (
        {"stop_credit_coef": 1.0, "abstain_budget": 0.25, "kept_credit_coef": 4.0, "ptx_coef": 1.0, "ptx_given_continues": True},
        {},
    ),
    "stop1_budget30_kept4_ptxc": (
        {"stop_credit_coef": 1.0, "abstain_budget": 0.3, "kept_credit_coef": 4.0, "ptx_coef": 1.0, "ptx_given_continues": True},
        {},
    ),
    "stop1_budget50_kept4_ptxc": (
        {"stop_credit_coef": 1.0, "abstain_budget": 0.5, "kept_credit_coef": 4.0, "ptx_coef": 1.0, "ptx_given_continues": True},
        {},
    ),
    "stop1_budget25_kept4_ptx05": (
        {"stop_credit_coef": 1.0, "abstain_budget": 0.25, "kept_credit_coef": 4.0, "ptx_coef": 0.5},
        {},
    ),
    "stop1_budget25_ptx": ({"stop_credit_coef": 1.0, "abstain_budget": 0.25, "ptx_coef": 1.0}, {}),
    # the demo's levers plus an entropy penalty given that the line continues (training/sharpen.py)
    "stop1_budget50_kept4_ptxc_sharp01": (
        {
            "stop_credit_coef": 1.0,
            "abstain_budget": 0.5,
            "kept_credit_coef": 4.0,
            "ptx_coef": 1.0,
            "ptx_given_continues": True,
            "sharpen_coef": 0.1,
        },
        {},
    ),
    "stop1_budget50_kept4_ptxc_sharp03": (
        {
            "stop_credit_coef": 1.0,
            "abstain_budget": 0.5,
            "kept_credit_coef": 4.0,
            "ptx_coef": 1.0,
            "ptx_given_continues": True,
            "sharpen_coef": 0.3,
        },
        {},
    ),
    "stop1_budget50_kept4_sharp03": (
        {"stop_credit_coef": 1.0, "abstain_budget": 0.5, "kept_credit_coef": 4.0, "sharpen_coef": 0.3},
        {},
    ),
    "stop1_budget50_kept4_ptxc_sharp1": (
        {
            "stop_credit_coef": 1.0,
            "abstain_budget": 0.5,
            "kept_credit_coef": 4.0,
            "ptx_coef": 1.0,
            "ptx_given_continues": True,
            "sharpen_coef": 1.0,
        },
        {},
    ),
    # the demo's levers plus distillation from version 1 at a lower temperature (training/sharpen.py)
    "stop1_budget50_kept4_ptxc_t07": (
        {
            "stop_credit_coef": 1.0,
            "abstain_budget": 0.5,
            "kept_credit_coef": 4.0,
            "ptx_coef": 1.0,
            "ptx_given_continues": True,
            "sharpen_coef": 1.0,
            "sharpen_temperature": 0.7,
        },
        {},
    ),
    "stop1_budget50_kept4_ptxc_t05": (
        {
            "stop_credit_coef": 1.0,
            "abstain_budget": 0.5,
            "kept_credit_coef": 4.0,
            "ptx_coef": 1.0,
            "ptx_given_continues": True,
            "sharpen_coef": 1.0,
            "sharpen_temperature": 0.5,
        },
        {},
    ),
    # the same without the code loss: the frozen reference anchors the code model, the budget the abstaining
    "stop1_budget20_kept4_t06": (
        {
            "stop_credit_coef": 1.0,
            "abstain_budget": 0.2,
            "kept_credit_coef": 4.0,
            "sharpen_coef": 1.0,
            "sharpen_temperature": 0.6,
        },
        {},
    ),
    "stop1_budget20_kept4_t08": (
        {
            "stop_credit_coef": 1.0,
            "abstain_budget": 0.2,
            "kept_credit_coef": 4.0,
            "sharpen_coef": 1.0,
            "sharpen_temperature": 0.8,
        },
        {},
    ),
    "full_stop1_budget20_kept4_t06": (
        {
            "lora": False,
            "learning_rate": 1e-4,
            "stop_credit_coef": 1.0,
            "abstain_budget": 0.2,
            "kept_credit_coef": 4.0,
            "sharpen_coef": 1.0,
            "sharpen_temperature": 0.6,
        },
        {},
    ),
    # every weight trained, the final norm (the temperature) at its own learning rate
    "full_norm1e2_stop1_budget20_kept4_t06": (
        {
            "lora": False,
            "learning_rate": 1e-4,
            "final_norm_learning_rate": 1e-2,
            "stop_credit_coef": 1.0,
            "abstain_budget": 0.2,
            "kept_credit_coef": 4.0,
            "sharpen_coef": 1.0,
            "sharpen_temperature": 0.6,
        },
        {},
    ),
    "full_norm1e2_stop2_budget25_kept4_t05": (
        {
            "lora": False,
            "learning_rate": 1e-4,
            "final_norm_learning_rate": 1e-2,
            "stop_credit_coef": 2.0,
            "abstain_budget": 0.25,
            "kept_credit_coef": 4.0,
            "sharpen_coef": 1.0,
            "sharpen_temperature": 0.5,
        },
        {},
    ),
    # the demo's configuration pushed towards fewer suggestions: stronger stop credit (the budget then binds), or
    # a weaker KL penalty holding the abstain probability back
    "full_norm1e2_stop4_budget25_kept4_t05": (
        {
            "lora": False,
            "learning_rate": 1e-4,
            "final_norm_learning_rate": 1e-2,
            "stop_credit_coef": 4.0,
            "abstain_budget": 0.25,
            "kept_credit_coef": 4.0,
            "sharpen_coef": 1.0,
            "sharpen_temperature": 0.5,
        },
        {},
    ),
    "full_norm1e2_stop4_budget25_kept8_t05": (
        {
            "lora": False,
            "learning_rate": 1e-4,
            "final_norm_learning_rate": 1e-2,
            "stop_credit_coef": 4.0,
            "abstain_budget": 0.25,
            "kept_credit_coef": 8.0,
            "sharpen_coef": 1.0,
            "sharpen_temperature": 0.5,
        },
        {},
    ),
    "full_norm1e2_stop2_budget25_kept4_t05_kl05": (
        {
            "lora": False,
            "learning_rate": 1e-4,
            "final_norm_learning_rate": 1e-2,
            "stop_credit_coef": 2.0,
            "abstain_budget": 0.25,
            "kept_credit_coef": 4.0,
            "sharpen_coef": 1.0,
            "sharpen_temperature": 0.5,
            "kl_coef": 0.05,
        },
        {},
    ),
    "full_norm1e2_stop1_budget20_kept4": (
        {
            "lora": False,
            "learning_rate": 1e-4,
            "final_norm_learning_rate": 1e-2,
            "stop_credit_coef": 1.0,
            "abstain_budget": 0.2,
            "kept_credit_coef": 4.0,
        },
        {},
    ),
    # every weight trained (the final norm can scale the logits), sharpened, with or without the code loss
    "full_stop1_budget50_kept4_sharp03": (
        {
            "lora": False,
            "learning_rate": 1e-4,
            "stop_credit_coef": 1.0,
            "abstain_budget": 0.5,
            "kept_credit_coef": 4.0,
            "sharpen_coef": 0.3,
        },
        {},
    ),
    "full_stop1_budget50_kept4_ptxc_sharp1": (
        {
            "lora": False,
            "learning_rate": 1e-4,
            "stop_credit_coef": 1.0,
            "abstain_budget": 0.5,
            "kept_credit_coef": 4.0,
            "ptx_coef": 1.0,
            "ptx_given_continues": True,
            "sharpen_coef": 1.0,
        },
        {},
    ),
    # every weight trained (no adapter: the final norm can scale the logits), at a tenth of the learning rate
    "full_kept4_ptx": ({"lora": False, "learning_rate": 1e-4, "kept_credit_coef": 4.0, "ptx_coef": 1.0}, {}),
    "full_ppo": ({"lora": False, "learning_rate": 1e-4}, {}),
    "kept4_stop1_shown_ptx": (
        {"kept_credit_coef": 4.0, "stop_credit_coef": 1.0, "stop_credit_abstain": False, "ptx_coef": 1.0},
        {},
    ),
}

# the demo's configuration with the abstain decision credited in log space (ppo_config.abstain_credit): a rare
# abstain moves as fast as a sampled token; the budget decides how often
_DEMO = CONFIGS["full_norm1e2_stop2_budget25_kept4_t05"][0]
CONFIGS["demo_abstain_log"] = ({**_DEMO, "abstain_credit": "log"}, {})
CONFIGS["demo_abstain_log_budget20"] = ({**_DEMO, "abstain_credit": "log", "abstain_budget": 0.2}, {})
CONFIGS["demo_abstain_log_best_cut"] = ({**_DEMO, "abstain_credit": "log", "abstain_vs_best_cut": True}, {})
CONFIGS["demo_abstain_log_budget15"] = ({**_DEMO, "abstain_credit": "log", "abstain_budget": 0.15}, {})
CONFIGS["demo_abstain_log_best_cut_anchor"] = (
    {**_DEMO, "abstain_credit": "log", "abstain_vs_best_cut": True, "stop_anchor_coef": 1.0},
    {},
)
CONFIGS["demo_abstain_log_stop1"] = ({**_DEMO, "abstain_credit": "log", "stop_credit_coef": 1.0}, {})


def fmt(x, ci=None, digits: int = 2) -> str:
    if x is None:
        return "n/a"
    text = f"{x:.{digits}f}"
    return text + (f" [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]" if ci else "")


def run(name: str, args: argparse.Namespace) -> tuple[list[dict], dict]:
    """One configuration: its evaluation lines and its learning report."""
    ppo, rule = CONFIGS[name]
    cmd = [
        sys.executable,
        str(Path(__file__).with_name("offline_ppo.py")),
        "--simulate",
        str(args.simulate),
        "--rows-file",
        str(args.rows_file),
        "--checkpoint",
        str(args.checkpoint),
        "--iterations",
        str(args.iterations),
        "--eval-at",
        args.eval_at,
        "--eval-requests",
        str(args.eval_requests),
        "--seed",
        str(args.seed),
        "--ppo",
        json.dumps({**STUDY_BASE, **ppo}),
        "--rule",
        json.dumps(rule),
        "--threads",
        str(args.threads),
        *(["--suggestion-filter"] if args.suggestion_filter else []),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"configuration {name} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    return [x for x in lines if "at" in x], lines[-1]


def sharpened(args: argparse.Namespace, scales: list[float]) -> None:
    """Version 1 with its logits multiplied by each scale (sampling it at temperature 1/scale, no training),
    paired with version 1 on the held-out requests: how much a sharper policy alone would move the figures."""
    import torch

    from bench.offline_ppo import EVAL_SEED, completions
    from sim.evaluate import eval_cases, outcomes
    from sim.paired import compare
    from tidal.settings import load_settings
    from training.policy import load_policy, load_tokenizer

    torch.set_num_threads(args.threads)
    settings = load_settings()
    users, rule = settings.demo.users, settings.collect.rule_for("tab")
    tok = load_tokenizer(args.checkpoint)
    tok.padding_side = "left"  # generation pads prompts on the left
    cases = eval_cases(users, settings.bootstrap.heldout_fraction, args.eval_requests, EVAL_SEED)
    v1 = outcomes(cases, completions(load_policy(args.checkpoint), tok, cases, users.max_tokens, users.temperature), rule)
    print("| logits × | suggestion ×v1 | accept ×v1 | chars ×v1 | reward − v1 |\n|---|---|---|---|---|")
    for scale in scales:
        model = load_policy(args.checkpoint)
        head = model.get_output_embeddings()
        with torch.no_grad():  # untied from the input embeddings: only the predictions sharpen
            head.weight = torch.nn.Parameter(head.weight.detach().clone() * scale)
        c = compare(v1, outcomes(cases, completions(model, tok, cases, users.max_tokens, users.temperature), rule))
        sug, acc, chars, rew = (
            c[m] for m in ("suggestion_rate", "accept_rate", "accepted_chars_per_request", "reward_per_request")
        )
        print(
            f"| {scale:g} | {fmt(sug.ratio.mean, (sug.ratio.low, sug.ratio.high))} | "
            f"{fmt(acc.ratio.mean, (acc.ratio.low, acc.ratio.high)) if acc.ratio else 'n/a'} | "
            f"{fmt(chars.ratio.mean, (chars.ratio.low, chars.ratio.high)) if chars.ratio else 'n/a'} | "
            f"{fmt(rew.delta.mean, (rew.delta.low, rew.delta.high), 3)} |",
            flush=True,
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=Path, required=True, help="full checkpoint directory (the behaviour policy)")
    p.add_argument("--simulate", type=int, default=4000, help="logged requests sampled by the checkpoint")
    p.add_argument("--rows-file", type=Path, default=Path("learning-study-rows.jsonl"), help="the shared logged rows")
    p.add_argument("--iterations", type=int, default=120)
    p.add_argument("--eval-at", default="", help="comma-separated iterations to evaluate at besides the last")
    p.add_argument("--eval-requests", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--suggestion-filter",
        action="store_true",
        help="score every policy with its suggestion filter, as the gateway serves it (bench/offline_ppo.py)",
    )
    p.add_argument("--configs", default="ppo,stop1,stop1_chars", help=f"comma-separated, of: {', '.join(CONFIGS)}")
    p.add_argument(
        "--logit-scales",
        default="",
        help=("instead of training: version 1 with its logits scaled by each of these (e.g. 1.5,2,3), paired with version 1"),
    )
    args = p.parse_args()
    if args.logit_scales:
        sharpened(args, [float(x) for x in args.logit_scales.split(",") if x])
        return
    names = [c for c in args.configs.split(",") if c]
    if unknown := [c for c in names if c not in CONFIGS]:
        p.error(f"unknown configurations {unknown}; expected some of {list(CONFIGS)}")

    head = (
        "| config | at | suggestion rate | accept rate | accepted chars/req | reward/req | bits/byte Δ | "
        "Δ given the line continues | the same at the best temperature |\n|---|---|---|---|---|---|---|---|---|"
    )
    report_head = (
        "| config | suggestion ×v1 | accept ×v1 | chars ×v1 | reward − v1 | chars − best cut | reward − best cut "
        "| train s |\n|---|---|---|---|---|---|---|---|"
    )
    reports, rows, started = {}, [], time.perf_counter()
    for name in names:  # each configuration's rows as soon as it ends (a long study can be read as it goes)
        evals, r = run(name, args)
        reports[name] = r
        print(
            head
            + "\n"
            + "\n".join(
                f"| {name} | {e['at']} | {fmt(e['suggestion_rate'])} | {fmt(e['accept_rate'], digits=3)} | "
                f"{fmt(e['accepted_chars_per_request'])} | {fmt(e['reward_per_request'], digits=3)} | "
                f"{e['bpb_delta']:+.3f} | {e['bpb_stop_delta']:+.3f} | {e.get('bpb_fit_delta', 0.0):+.3f} "
                f"(×{e.get('fit_scale', 1.0):.2f}) |"
                for e in evals
            ),
            flush=True,
        )
        rows.append(
            f"| {name} | {fmt(r['suggestion_ratio'], r['suggestion_ratio_ci'])} | "
            f"{fmt(r['accept_ratio'], r['accept_ratio_ci'])} | {fmt(r['chars_ratio'], r['chars_ratio_ci'])} | "
            f"{fmt(r['reward_delta'], r['reward_delta_ci'], 3)} | "
            f"{fmt(r['chars_vs_truncation'], r['chars_vs_truncation_ci'])} | "
            f"{fmt(r['reward_vs_truncation'], r['reward_vs_truncation_ci'], 3)} | {r['train_s']:.0f} |"
        )
        print(report_head + "\n" + rows[-1] + "\n", flush=True)
    print(report_head + "\n" + "\n".join(rows))
    print(json.dumps({"reports": reports, "total_s": round(time.perf_counter() - started, 1)}))


if __name__ == "__main__":
    main()
