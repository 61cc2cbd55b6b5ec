"""The offline gate: checks a candidate must pass before any traffic reaches it.

    finite        every served weight (and the critic) is finite
    kl            mean per-token KL(candidate || champion) on held-out logged completions <= max_kl (both at each
                  row's sampling temperature: the distributions users were served)
    ope           off-policy estimate of the candidate's reward on held-out logged rows is not below the
                  champion's estimate by more than ope_tolerance (inconclusive, not failed, when the
                  effective sample size is below min_ess)
    bits_per_byte held-out code bits/byte does not regress by more than bpb_tolerance (with bpb_stop: given that
                  the next token holds no stop string, so the stop decision Tab training moves is not charged;
                  with bpb_fit_temperature: each model at its best temperature, so sharpening is not charged)

Off-policy estimate: self-normalised importance sampling (weighted IS; Precup et al. 2000, Owen 2013
ch. 9). For held-out row i with behaviour log-probs mu_i (logged), completion y_i and reward r_i:

    w_i = exp( sum_t log pi(y_it | x_i, y_i<t) - mu_it )           sequence-level ratio
    V(pi) = sum_i w_i r_i / sum_i w_i,      ESS = (sum_i w_i)^2 / sum_i w_i^2     (Kish)

The KL is exact over the vocabulary at every completion position (not a sampled estimate).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from data_contracts.samples import RewardSample
from training.job_spec import GateCheck, GateReport
from training.ppo_loss import token_logprobs
from training.pretrain import bits_per_byte, fitted_bits_per_byte
from training.rollout import collate
from training.stop_credit import stop_token_ids
from training.tokenizer import padding_id
from training.train_settings import GateConfig
from training.value_head import position_ids_from_mask


@torch.no_grad()
def _completion_logits(model: PreTrainedModel, samples: Sequence[RewardSample], pad_id: int, chunk: int = 32):
    """Yields (batch, logits (b, T, V)) over the samples' completion positions, at each row's sampling temperature
    over the whole vocabulary (the row's top-p nucleus is not applied: `batch.cut_to_nucleus` does that)."""
    model.eval()
    for i in range(0, len(samples), chunk):
        b = collate(samples[i : i + chunk], pad_id)
        out = model(
            input_ids=b.input_ids,
            attention_mask=b.attention_mask,
            position_ids=position_ids_from_mask(b.attention_mask),
            use_cache=False,
        )
        yield b, b.tempered_logits(out.logits)


@torch.no_grad()
def kl_and_ope(
    candidate: PreTrainedModel, champion: PreTrainedModel, samples: Sequence[RewardSample], pad_id: int
) -> dict[str, float]:
    """KL(candidate || champion) per token, and SNIS reward estimates of both against the logged mu."""
    kl_sum, tokens = 0.0, 0.0
    log_w = {"candidate": [], "champion": []}
    rewards: list[float] = []
    pairs = zip(_completion_logits(candidate, samples, pad_id), _completion_logits(champion, samples, pad_id))
    for (b, cand), (_, champ) in pairs:
        m = b.mask  # (b, T)
        lp_cand, lp_champ = torch.log_softmax(cand, -1), torch.log_softmax(champ, -1)  # (b, T, V)
        # (b, T) exact KL per position, of the tempered policies: each model's nucleus is its own, so the cut
        # distributions need not share a support (KL infinite) while the weights moved a little
        kl = (lp_cand.exp() * (lp_cand - lp_champ)).sum(-1)
        kl_sum += float((kl * m).sum())
        tokens += float(m.sum())
        sampled = b.temperatures > 0  # (b,) a greedy row's choice had no density: no importance weight
        for name, logits in (("candidate", cand), ("champion", champ)):
            lp = token_logprobs(b.cut_to_nucleus(logits), b.completion_ids)  # (b, T) where mu was drawn
            log_w[name] += ((lp - b.behaviour_logprobs) * m).sum(1)[sampled].tolist()
        rewards += b.rewards[sampled].tolist()
    out = {
        "kl_per_token": kl_sum / max(tokens, 1.0),
        "heldout_rows": float(len(rewards)),
        "logged_reward": sum(rewards) / max(len(rewards), 1),
    }
    r = torch.tensor(rewards, dtype=torch.float64)
    for name, lw in log_w.items():
        if not lw:  # only greedy rows: nothing to estimate from (ESS 0 reads as inconclusive)
            out[f"ope_{name}"], out[f"ess_{name}"] = math.nan, 0.0
            continue
        lw_t = torch.tensor(lw, dtype=torch.float64)
        w = torch.exp(lw_t - lw_t.max())  # scale-free: SNIS and ESS do not change with a common factor
        out[f"ope_{name}"] = float((w * r).sum() / w.sum())
        out[f"ess_{name}"] = float(w.sum() ** 2 / (w**2).sum())
    return out


def all_finite(*modules: torch.nn.Module) -> tuple[bool, str]:
    for module in modules:
        for name, p in module.named_parameters():
            if not torch.isfinite(p).all():
                return False, f"{name} holds {int((~torch.isfinite(p)).sum())} non-finite values"
    return True, "all weights finite"


def evaluate(
    candidate: PreTrainedModel,
    champion: PreTrainedModel,
    critic: torch.nn.Module | None,
    tokenizer: PreTrainedTokenizerBase,
    heldout_rows: Sequence[RewardSample],
    heldout_code: Sequence[str] | None,
    cfg: GateConfig,
    corpus: str = "the held-out code",
) -> GateReport:
    """Every check of one candidate against its champion. `heldout_code` is the held-out side of the model's corpus
    (`corpus` names it in the report); None = the model has none (models[].corpus.source: none): the bits/byte
    check is reported as skipped by that setting."""
    checks: list[GateCheck] = []
    ok, detail = all_finite(candidate, *([critic] if critic is not None else []))
    checks.append(GateCheck(name="finite", passed=ok, value=None, limit=None, detail=detail))
    if not ok:  # the other figures would be NaN: report the cause alone
        return GateReport(passed=False, checks=checks, figures={})

    figures: dict[str, float] = {}
    if len(heldout_rows) < cfg.min_heldout_rows:
        checks.append(
            GateCheck(
                name="heldout",
                passed=False,
                value=len(heldout_rows),
                limit=cfg.min_heldout_rows,
                detail=f"{len(heldout_rows)} held-out rows < {cfg.min_heldout_rows}: collect more traffic "
                "or raise train.heldout_fraction",
            )
        )
    else:
        figures.update(kl_and_ope(candidate, champion, heldout_rows, padding_id(tokenizer)))
        kl = figures["kl_per_token"]
        checks.append(
            GateCheck(
                name="kl",
                passed=kl <= cfg.max_kl,
                value=kl,
                limit=cfg.max_kl,
                detail=f"KL {kl:.4f} nats/token vs max {cfg.max_kl}",
            )
        )
        ess, gain = figures["ess_candidate"], figures["ope_candidate"] - figures["ope_champion"]
        figures["ope_gain"] = gain
        if ess < cfg.min_ess:
            checks.append(
                GateCheck(
                    name="ope",
                    passed=True,
                    value=gain,
                    limit=-cfg.ope_tolerance,
                    detail=f"inconclusive: ESS {ess:.1f} < {cfg.min_ess} (estimate gain {gain:+.4f})",
                )
            )
        else:
            checks.append(
                GateCheck(
                    name="ope",
                    passed=gain >= -cfg.ope_tolerance,
                    value=gain,
                    limit=-cfg.ope_tolerance,
                    detail=f"reward estimate {figures['ope_candidate']:.4f} vs champion "
                    f"{figures['ope_champion']:.4f} (gain {gain:+.4f}, ESS {ess:.1f})",
                )
            )
    if heldout_code is None:
        checks.append(
            GateCheck(
                name="bits_per_byte",
                passed=True,
                value=None,
                limit=cfg.bpb_tolerance,
                detail="skipped: the model has no corpus (models[].corpus.source: none), so nothing checks its language modelling",
            )
        )
        return GateReport(passed=all(c.passed for c in checks), checks=checks, figures=figures)
    stops = stop_token_ids(tokenizer, cfg.bpb_stop) if cfg.bpb_stop else []
    if cfg.bpb_fit_temperature:
        bpb_cand, n_bytes, scale_cand, _ = fitted_bits_per_byte(
            candidate, tokenizer, heldout_code, cfg.eval_bytes, cfg.seq_len, stops
        )
        bpb_champ, _, scale_champ, _ = fitted_bits_per_byte(champion, tokenizer, heldout_code, cfg.eval_bytes, cfg.seq_len, stops)
        figures.update({"bpb_scale_candidate": scale_cand, "bpb_scale_champion": scale_champ})
    else:
        bpb_cand, n_bytes = bits_per_byte(candidate, tokenizer, heldout_code, cfg.eval_bytes, cfg.seq_len, stops)
        bpb_champ, _ = bits_per_byte(champion, tokenizer, heldout_code, cfg.eval_bytes, cfg.seq_len, stops)
    delta = bpb_cand - bpb_champ
    figures.update({"bpb_candidate": bpb_cand, "bpb_champion": bpb_champ, "bpb_delta": delta, "bpb_bytes": float(n_bytes)})
    checks.append(
        GateCheck(
            name="bits_per_byte",
            passed=math.isfinite(delta) and delta <= cfg.bpb_tolerance,
            value=delta,
            limit=cfg.bpb_tolerance,
            detail=f"{bpb_cand:.4f} vs champion {bpb_champ:.4f} bits/byte on {corpus} (+{delta:.4f} allowed "
            f"{cfg.bpb_tolerance}"
            + (f"; given no token holding {cfg.bpb_stop!r}" if stops else "")
            + (
                f"; each at its best temperature, logits x{figures['bpb_scale_candidate']:.2f} and "
                f"x{figures['bpb_scale_champion']:.2f}"
                if cfg.bpb_fit_temperature
                else ""
            )
            + ")",
        )
    )
    return GateReport(passed=all(c.passed for c in checks), checks=checks, figures=figures)
