"""Offline learning check: PPO on logged flywheel datasets, scored on held-out simulated users.

Answers "does this training configuration learn anything from these logs?" in minutes, without the
fleet: the trainer's own code (PPOTrainer, select_samples, the dataset split) on stored reward
datasets, then the policy samples completions for a fixed held-out sample of Tab sites (eval files,
never trained on) and the simulated users' verdicts give the flywheel's metrics with 95% intervals.
Completions come from the HF model (sampling at the settings' temperature, cut at the first line
break), not from vLLM: compare rows of one run, not with `tidal eval` figures.

Rewards are recomputed with the given reward rule, so rules can be compared on the same logs.

Usage (a data directory left by `tidal demo`):
  .venv/bin/python bench/offline_ppo.py --data-dir .tidal --checkpoint .tidal/store/checkpoints/model=tab/version=1 \
      --iterations 60 --eval-at 20,40 --ppo '{"kl_coef": 0.05}' --rule '{"accept_scale_by_chars": true}'
Prints one JSON line per evaluation (`"at": iteration`, 0 = the checkpoint itself). Each line carries
`bpb_delta`: held-out code bits/byte against the checkpoint, as the offline gate measures it with the demo's
gate settings (the gate refuses a candidate above `bpb_tolerance`), and `bpb_stop_delta`: the same given that the
line continues (the gate's `bpb_stop`: the stop decision not charged). The last line is the learning report
(sim/learning_report.py, the keys of the demo's report.json): the trained policy (`final_version`: the
checkpoint's version + 1) against the checkpoint, paired on the same requests, and against the checkpoint's
completions cut to their best k characters; `promoted` is null; `train_s` leaves the evaluations out.
With `--filter-budgets 0.03:0.2,0.03:0.4`, one line per budget comes before it (`"at": "final"`): the final
policy's samples served under a suggestion filter fitted at that budget, with the report's keys.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


EVAL_SEED = 11  # seeds the held-out requests: every run (and learning_study's --logit-scales) scores the same ones


def completions(model, tok, cases, max_tokens: int, temperature: float, batch: int = 50) -> list[str]:
    """One sampled completion per case, cut at the first line break (the users' stop string)."""
    return sampled(model, tok, cases, max_tokens, temperature, batch)[0]


def sampled(model, tok, cases, max_tokens: int, temperature: float, batch: int = 50) -> tuple[list[str], list[float]]:
    """completions(), and the (N,) raw log-prob of each completion's first token (the engine's logged log-prob,
    which a version's suggestion filter reads)."""
    model.eval()
    torch.manual_seed(0)
    out, first = [], []
    with torch.no_grad():
        for i in range(0, len(cases), batch):
            enc = tok([c.site.prompt for c in cases[i : i + batch]], return_tensors="pt", padding=True)
            gen = model.generate(
                **enc,
                max_new_tokens=max_tokens,
                do_sample=True,
                temperature=temperature,
                top_k=0,
                top_p=1.0,
                pad_token_id=tok.pad_token_id,
                output_logits=True,
                return_dict_in_generate=True,
            )
            new = gen.sequences[:, enc.input_ids.shape[1] :]  # (B, T)
            first += torch.log_softmax(gen.logits[0].float(), -1).gather(1, new[:, :1])[:, 0].tolist()  # raw logits
            out += [tok.decode(row, skip_special_tokens=True).split("\n")[0] for row in new]
    return out, first


def filtered(texts: list[str], first: list[float], threshold: float | None) -> list[str]:
    """The completions as the gateway serves them under a suggestion filter's `threshold`: a completion whose first
    token's log-prob is below it is withheld ("")."""
    from data_contracts.suggestion_filter import withholds

    return [("" if t and withholds(threshold, [lp]) else t) for t, lp in zip(texts, first)]


def evaluate(model, tok, cases, rule, users, bpb, threshold: float | None = None) -> tuple[dict, list[str], tuple]:
    """The users' metrics on the model's completions (one JSON line's figures), the completions as served (withheld
    ones "" under a suggestion filter's `threshold`), and (the sampled completions, their first tokens' log-probs)."""
    from sim.evaluate import score

    t0 = time.perf_counter()
    raw, first = sampled(model, tok, cases, users.max_tokens, users.temperature)
    texts = filtered(raw, first, threshold)
    s = score(cases, texts, rule)
    return (
        {
            **{k: round(e.mean, 4) for k, e in s.items()},
            **{f"{k}_ci": [round(e.low, 4), round(e.high, 4)] for k, e in s.items()},
            **{k: round(v, 4) for k, v in bpb(model).items()},
            "eval_s": round(time.perf_counter() - t0, 1),
        },
        texts,
        (raw, first),
    )


def cached_rows(path: Path | None, key: dict) -> list | None:
    """The rows of a --rows-file written for the same checkpoint, N, seed and version; None if there are none."""
    from data_contracts.samples import RewardSample

    if path is None or not path.exists():
        return None
    lines = path.read_text().splitlines()
    if not lines or json.loads(lines[0]) != key:
        raise ValueError(
            f"--rows-file {path} holds rows of {lines[0] if lines else 'nothing'}; expected {key}: "
            "give another file, or delete it to simulate again"
        )
    return [RewardSample.model_validate_json(line) for line in lines[1:]]


def final_report(cases, rule, base_texts: list[str], final_texts: list[str], version: int, total_s: float, train_s: float):
    """The learning report of the trained policy against the checkpoint, paired on the same held-out requests."""
    from sim.evaluate import best_truncation, outcomes
    from sim.learning_report import learning_report
    from sim.paired import compare

    k, _ = best_truncation(cases, base_texts, rule)
    base, final = outcomes(cases, base_texts, rule), outcomes(cases, final_texts, rule)
    cut = outcomes(cases, [t[:k] for t in base_texts], rule)
    return learning_report(compare(base, final), compare(cut, final), version, len(cases), None, total_s, train_s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", type=Path, default=None, help="Tidal data directory holding the datasets")
    p.add_argument(
        "--simulate",
        type=int,
        default=0,
        help=(
            "instead of stored datasets: N logged requests of the traffic split sampled by the checkpoint and judged by "
            "the simulated users (bench/logged_traffic.py)"
        ),
    )
    p.add_argument(
        "--rows-file",
        type=Path,
        default=None,
        help=(
            "with --simulate: a JSON-lines file of the simulated rows; read if it holds the same checkpoint, N and seed, "
            "else written, so several configurations train on the same logs"
        ),
    )
    p.add_argument("--checkpoint", type=Path, required=True, help="full checkpoint directory the logs were served from")
    p.add_argument("--version", type=int, default=1, help="its registry version (behaviour-version filter)")
    p.add_argument("--model", default="tab")
    p.add_argument("--datasets", default="", help="comma-separated dataset ids (default: all of the model's)")
    p.add_argument("--iterations", type=int, default=60)
    p.add_argument("--eval-at", default="", help="comma-separated iterations to evaluate at besides the last")
    p.add_argument("--eval-requests", type=int, default=2000)
    p.add_argument("--ppo", default="{}", help="JSON overrides of the demo's PPO settings")
    p.add_argument("--rule", default="{}", help="JSON overrides of the reward rule (rewards are recomputed)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="seeds the simulated traffic (--simulate)")
    p.add_argument(
        "--suggestion-filter",
        action="store_true",
        help=(
            "score each trained policy as the gateway would serve it with its suggestion filter, fitted on the logged rows "
            "with the demo's train.suggestion_filter budgets (the checkpoint is also scored with its own filter, as "
            "'at': '0+filter'); the learning report compares the filtered final policy with the unfiltered checkpoint"
        ),
    )
    p.add_argument(
        "--filter-budgets",
        default="",
        help=(
            "comma-separated MAX_CHARS_LOSS:MAX_WITHHELD pairs: the final policy's filter fitted at each budget on the "
            "logged rows and applied to the same held-out samples, one report line per budget (the filter budget study)"
        ),
    )
    args = p.parse_args()
    started = time.perf_counter()
    budgets = [tuple(float(x) for x in b.split(":")) for b in args.filter_budgets.split(",") if b]
    if any(len(b) != 2 for b in budgets):
        p.error(f"--filter-budgets {args.filter_budgets!r}: expected MAX_CHARS_LOSS:MAX_WITHHELD pairs, e.g. 0.03:0.4,0.05:0.5")
    if (args.data_dir is None) == (not args.simulate):
        p.error("give --data-dir (train on its stored datasets) or --simulate N (train on N simulated logged requests)")
    if args.data_dir is not None:
        os.environ["TIDAL_DATA_DIR"] = str(args.data_dir)

    from data_contracts import corpus
    from data_contracts.rewards import RewardRule
    from sim.evaluate import eval_cases
    from tidal.settings import load_settings
    from tidal.store import open_store
    from training.candidate import build_trainable
    from training.job import loss_terms
    from training.partial_credit import partial_rows
    from training.policy import load_policy, load_tokenizer
    from training.ppo_trainer import PPOTrainer, iteration_plan
    from training.pretrain import bits_per_byte, fitted_bits_per_byte
    from training.reward_data import load_dataset, split
    from training.rollout import select_samples
    from training.stop_credit import stop_token_ids

    torch.set_num_threads(args.threads)
    settings = load_settings()
    store, users = (open_store(settings) if args.data_dir else None), settings.demo.users
    # validated, so a misspelt or inconsistent override is refused with pydantic's message naming it
    rule = RewardRule.model_validate({**settings.collect.rule_for(args.model).model_dump(), **json.loads(args.rule)})
    ppo = settings.demo.train.ppo
    cfg = type(ppo).model_validate({**ppo.model_dump(), **json.loads(args.ppo), "max_iterations": args.iterations})
    tok = load_tokenizer(args.checkpoint)
    tok.padding_side = "left"  # generation pads prompts on the left
    root = corpus.stdlib_root()
    _, code_files = corpus.split_stdlib(settings.bootstrap.heldout_fraction, root)
    code, gate = corpus.read_texts(code_files), settings.demo.train.gate

    def bpb(model) -> dict[str, float]:
        """Held-out code bits/byte, plain and given that the line continues (the gate's `bpb_stop`), and the latter
        at the model's best temperature (the gate's `bpb_fit_temperature`)."""
        model.eval()
        stops = stop_token_ids(tok, "\n")
        fit = fitted_bits_per_byte(model, tok, code, gate.eval_bytes, gate.seq_len, stops)  # one pass, every scale
        return {
            "bpb": bits_per_byte(model, tok, code, gate.eval_bytes, gate.seq_len)[0],
            "bpb_stop": fit.at_scale_1,
            "bpb_stop_fit": fit.bpb,
            "fit_scale": fit.scale,
        }

    cases = eval_cases(users, settings.bootstrap.heldout_fraction, args.eval_requests, seed=EVAL_SEED)

    if args.simulate:
        from bench.logged_traffic import logged_traffic

        t0 = time.perf_counter()
        ids = [f"simulated:{args.simulate}"]
        key = {"checkpoint": str(args.checkpoint.resolve()), "n": args.simulate, "seed": args.seed, "version": args.version}
        rows = cached_rows(args.rows_file, key)
        if rows is None:
            rows = logged_traffic(
                load_policy(args.checkpoint),
                tok,
                users,
                settings.bootstrap.heldout_fraction,
                rule,
                args.simulate,
                version=args.version,
                seed=args.seed,
            )
            if args.rows_file:
                args.rows_file.write_text("\n".join([json.dumps(key)] + [r.model_dump_json() for r in rows]) + "\n")
        print(f"{len(rows)} simulated logged requests in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    else:
        ids = [d for d in args.datasets.split(",") if d] or sorted(
            {k.split("/")[2] for k in store.list(f"datasets/model={args.model}/")}
        )
        rows = [s for d in ids for s in load_dataset(store, args.model, d).samples]
    rewards = rule.rewards(
        np.array([r.event for r in rows], dtype=object),
        np.array([np.nan if r.accepted_chars is None else r.accepted_chars for r in rows], dtype=float),
        np.array([len(r.completion_text) for r in rows]),
    )
    rows = [r.model_copy(update={"reward": float(v), "reward_rule": rule.id}) for r, v in zip(rows, rewards)]
    train_rows, _ = split(rows, settings.train.heldout_fraction)
    picked = select_samples(train_rows, args.version, cfg.max_stale_versions).kept
    shaped = partial_rows(picked, tok, rule, cfg)
    picked = shaped.samples
    head = {
        "datasets": ids,
        "rows": len(rows),
        "train_rows": len(picked),
        "hindsight_rows": len(shaped.hindsight.samples),
        "credited_partials": shaped.credit.credited if shaped.credit else 0,
        "rule": rule.model_dump(mode="json"),
        "ppo": cfg.model_dump(
            mode="json",
            include={
                "learning_rate",
                "kl_coef",
                "batch_size",
                "epochs",
                "max_iterations",
                "hindsight_partials",
                "partial_credit",
                "ptx_coef",
                "stop_credit_coef",
                "stop_credit_abstain",
                "abstain_budget",
                "kept_credit_coef",
                "ptx_given_continues",
                "sharpen_coef",
                "sharpen_temperature",
                "lora",
                "final_norm_learning_rate",
            },
        ),
    }
    base, base_texts, _ = evaluate(load_policy(args.checkpoint), tok, cases, rule, users, bpb)
    print(json.dumps({"at": 0, **head, **base, "bpb_delta": 0.0, "bpb_stop_delta": 0.0, "bpb_fit_delta": 0.0}), flush=True)

    def fitted(model, budget: tuple[float, float] | None = None) -> dict:
        """The model's suggestion filter on the logged rows (what the offline gate registers with a candidate), with the
        demo's budgets or `budget` (max_chars_loss, max_withheld)."""
        from data_contracts.suggestion_filter import describe
        from training.suggestion_filter import fit_for

        fcfg = settings.demo.train.suggestion_filter
        if budget is not None:
            fcfg = type(fcfg).model_validate({**fcfg.model_dump(), "max_chars_loss": budget[0], "max_withheld": budget[1]})
        f = fit_for(model, rows, tok.pad_token_id, fcfg)
        return {"threshold": f.min_first_logprob, "filter": describe(f), "filter_withheld_share": round(f.withheld_share, 4)}

    if args.suggestion_filter:
        v1_filter = fitted(load_policy(args.checkpoint))
        v1_filtered, v1_texts, _ = evaluate(load_policy(args.checkpoint), tok, cases, rule, users, bpb, v1_filter["threshold"])
        from sim.evaluate import outcomes
        from sim.paired import compare

        pairs = compare(outcomes(cases, base_texts, rule), outcomes(cases, v1_texts, rule))
        line = {"at": "0+filter", **v1_filtered, **v1_filter, "bpb_delta": 0.0, "bpb_stop_delta": 0.0}
        print(json.dumps(line | {"paired_vs_checkpoint": {m: c.describe() for m, c in pairs.items()}}), flush=True)

    trainer = PPOTrainer(
        build_trainable(args.checkpoint, args.checkpoint, cfg),
        cfg,
        tok.pad_token_id,
        **loss_terms(cfg, tok, rule, settings.bootstrap.heldout_fraction),
    )
    plan = iteration_plan(len(picked), cfg)
    trainer.compute_reference(picked, rows=(r for batch in plan for r in batch))
    looks = {int(x) for x in args.eval_at.split(",") if x} | {len(plan)}
    last = {"texts": base_texts, "sampled": None, "eval_s": 0.0}

    def after(it: int, metrics: dict[str, float]) -> None:
        if it + 1 in looks:
            kl = {
                k.split("/")[1]: round(v, 4)
                for k, v in metrics.items()
                if k
                in (
                    "ppo/kl_ref",
                    "ppo/approx_kl",
                    "ppo/ptx_loss",
                    "ppo/stop_credit_loss",
                    "ppo/sharpen_loss",
                    "ppo/stop_anchor_loss",
                )
            }
            t0 = time.perf_counter()
            f = fitted(trainer.model.policy) if args.suggestion_filter else {"threshold": None}
            now, last["texts"], last["sampled"] = evaluate(trainer.model.policy, tok, cases, rule, users, bpb, f["threshold"])
            now.update(f)
            last["eval_s"] += time.perf_counter() - t0
            print(
                json.dumps(
                    {
                        "at": it + 1,
                        **kl,
                        **now,
                        "bpb_delta": round(now["bpb"] - base["bpb"], 4),
                        "bpb_stop_delta": round(now["bpb_stop"] - base["bpb_stop"], 4),
                        "bpb_fit_delta": round(now["bpb_stop_fit"] - base["bpb_stop_fit"], 4),
                    }
                ),
                flush=True,
            )
            trainer.model.train()

    t_train = time.perf_counter()
    trainer.train(picked, plan, 0, after)
    train_s = time.perf_counter() - t_train - last["eval_s"]
    total_s = time.perf_counter() - started
    for budget in budgets:  # the same samples of the final policy, served under each budget's filter
        f = fitted(trainer.model.policy, budget)
        texts = filtered(*last["sampled"], f["threshold"])
        report = final_report(cases, rule, base_texts, texts, args.version + 1, total_s, train_s)
        line = {"at": "final", "max_chars_loss": budget[0], "max_withheld": budget[1], **f}
        print(json.dumps(line | json.loads(report.model_dump_json())), flush=True)
    report = final_report(cases, rule, base_texts, last["texts"], args.version + 1, total_s, train_s)
    print(report.model_dump_json(), flush=True)


if __name__ == "__main__":
    main()
