"""PPO's pieces as pure tensor functions, one completion per prompt.

Shapes: B sequences, T completion tokens (right-padded), V vocabulary. Every (B, T) tensor is
aligned so that column t holds quantities of the t-th *completion* token; ``mask`` (B, T) is 1 on
real tokens and 0 on padding. Padding positions of every returned (B, T) tensor are 0.

Sources: PPO clipped surrogate and value clipping, Schulman et al. 2017 ("Proximal Policy
Optimization Algorithms", arXiv:1707.06347) as implemented in cleanRL's ppo.py; GAE, Schulman et
al. 2016 ("High-Dimensional Continuous Control Using Generalized Advantage Estimation",
arXiv:1506.02438); truncated importance weights, Espeholt et al. 2018 (IMPALA / V-trace,
arXiv:1802.01561), used here for the train/serve mismatch between the trainer's pi_old and the
served behaviour probabilities mu (low-precision serving, stale versions).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

# exp() of a log-ratio clamped to [-_MAX_LOG_RATIO, ...] stays finite and > 0 in float32.
_MAX_LOG_RATIO = 40.0


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log pi(token_t | context_t): logits (B, T, V) predicting tokens (B, T) -> (B, T) float32.

    Computed as logit[token] - logsumexp(logits) in float32, i.e. log_softmax gathered at the
    token, without materialising a second (B, T, V) log-prob tensor.
    """
    logits = logits.float()  # (B, T, V): bf16 log-probs are too coarse for ratios near 1
    picked = logits.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)  # (B, T)
    return picked - torch.logsumexp(logits, dim=-1)  # (B, T)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of each next-token distribution: logits (B, T, V) -> (B, T) float32, -sum p log p.
    Tokens at -inf (outside a top-p nucleus) have p = 0 and add nothing."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # (B, T, V)
    return -(logp.exp() * logp.clamp_min(torch.finfo(logp.dtype).min)).sum(-1)  # (B, T)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over positions where mask is 1 (over all of them, or along ``dim``); 0 if none."""
    m = mask.to(x.dtype)
    if dim is None:
        return (x * m).sum() / m.sum().clamp_min(1.0)
    return (x * m).sum(dim) / m.sum(dim).clamp_min(1.0)


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    eps: float = 1e-8,
    sum_all: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """(x - mean) / std over the masked positions (population std); padding stays 0. x, mask: (B, T).

    ``sum_all`` sums a tensor over data-parallel processes that each hold some rows of one batch: the mean and
    variance are then those of every process's masked positions together (None: this tensor's alone).
    """
    if sum_all is None:
        mean = masked_mean(x, mask)
        var = masked_mean((x - mean) ** 2, mask)
    else:
        m = mask.to(x.dtype)
        total, count = sum_all(torch.stack([(x * m).sum(), m.sum()])).unbind()
        count = count.clamp_min(1.0)
        mean = total / count
        var = sum_all(((x - mean) ** 2 * m).sum()) / count
    return (x - mean) * torch.rsqrt(var + eps) * mask.to(x.dtype)


def _lengths(mask: torch.Tensor) -> torch.Tensor:
    """(B,) number of real tokens per row, checking that rows are right-padded (1...1 0...0)."""
    if mask.shape[1] > 1 and bool((mask[:, 1:] > mask[:, :-1]).any()):
        raise ValueError("mask must be right-padded: real completion tokens first, then padding")
    return mask.long().sum(1)


def kl_penalized_rewards(
    task_reward: torch.Tensor,
    logp_old: torch.Tensor,
    logp_ref: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    is_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token rewards (B, T): -kl_coef * w * (logp_old - logp_ref) on every real token, plus the
    task reward: (B,) on each sequence's last real token, or (B, T) per token as given (a partial's reward
    split along the suggestion, training/partial_credit.py; its padding is ignored).

    (logp_old - logp_ref) is the single-sample estimate of KL(pi_old || pi_ref) at a token drawn from
    pi_old; as a reward it pulls the policy back towards the reference (the champion), as in Ziegler
    et al. 2019 and Ouyang et al. 2022. Logged tokens were drawn from the behaviour policy mu, so
    each estimate is weighted by w ~ pi_old / mu (`is_weight`, (B, T); None: on-policy, w = 1).
    Unweighted, on tokens mu ~ pi_ref sampled, the term averages -KL(pi_ref || pi_old) <= 0: a bonus
    that grows with completion length, which measurably taught the policy to suggest more and stop
    less. A row with no real token gets no reward at all (nothing to credit).
    """
    m = mask.to(torch.float32)
    w = m if is_weight is None else is_weight.float() * m  # (B, T)
    rewards = -kl_coef * w * (logp_old.float() - logp_ref.float())  # (B, T)
    lengths = _lengths(mask)  # (B,)
    if task_reward.dim() == 2:
        return (rewards + task_reward.float() * m).detach()
    rows = torch.nonzero(lengths > 0).squeeze(-1)  # rows that have a last token
    rewards[rows, lengths[rows] - 1] += task_reward.float()[rows]
    return rewards.detach()


@torch.no_grad()
def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over completion tokens -> (advantages, returns), both (B, T).

        delta_t = r_t + gamma * V_{t+1} - V_t          (V after a sequence's last token = 0)
        A_t     = delta_t + gamma * lam * A_{t+1}      (A after the last token = 0)
        R_t     = A_t + V_t                            (the critic's regression target)

    Schulman et al. 2016, eq. 16, computed backwards as in cleanRL. Rows are right-padded and may
    differ in length: the mask of the next column ends each row's recursion. Padding gets 0.
    """
    _lengths(mask)  # right-padding check
    m = mask.to(torch.float32)  # (B, T)
    r, v = rewards.float() * m, values.float() * m  # (B, T); padding values are never used
    B, T = r.shape
    advantages = torch.zeros_like(r)  # (B, T)
    next_adv = torch.zeros(B, dtype=r.dtype, device=r.device)  # (B,) A_{t+1}
    next_value = torch.zeros_like(next_adv)  # (B,) V_{t+1}
    for t in reversed(range(T)):
        # m[:, t+1] is already folded into next_value/next_adv: both are 0 past a row's end.
        delta = r[:, t] + gamma * next_value - v[:, t]  # (B,)
        next_adv = (delta + gamma * lam * next_adv) * m[:, t]  # (B,) zero on padding
        advantages[:, t] = next_adv
        next_value = v[:, t]
    returns = (advantages + v) * m
    return advantages, returns


@torch.no_grad()
def truncated_is_weight(
    logp_old: torch.Tensor,
    behaviour_logp: torch.Tensor,
    mask: torch.Tensor,
    C: float,
    level: Literal["token", "sequence"] = "token",
) -> torch.Tensor:
    """Truncated importance weight min(pi_old / mu, C): (B, T), detached, 0 on padding.

    ``token``: w_t = min(exp(logp_old_t - mu_t), C). ``sequence``: every token of a row gets
    min(exp(sum_t (logp_old_t - mu_t)), C). mu is what the served weights gave each sampled token;
    the weight corrects for sampling from mu instead of pi_old, truncated at C as in IMPALA's
    V-trace (Espeholt et al. 2018) to bound the variance. Non-finite inputs are made safe before
    exp: a NaN log-ratio gives weight 0 (the token, or the whole sequence, is ignored), +inf gives
    C, -inf gives ~0.
    """
    if level not in ("token", "sequence"):
        raise ValueError(f"level must be 'token' or 'sequence', not {level!r}")
    if not C > 0:
        raise ValueError(f"the truncation C must be > 0, not {C}")
    real = mask.bool()  # (B, T)
    log_ratio = logp_old.float() - behaviour_logp.float()  # (B, T)
    bad = torch.isnan(log_ratio) & real  # (B, T) unusable tokens
    log_ratio = torch.nan_to_num(log_ratio, nan=0.0, posinf=_MAX_LOG_RATIO, neginf=-_MAX_LOG_RATIO)
    log_ratio = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO) * real  # (B, T)
    if level == "sequence":
        log_ratio = log_ratio.sum(1, keepdim=True).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # (B, 1)
        bad = bad.any(1, keepdim=True)  # (B, 1)
    # Clamp the log-ratio just above log C before exp (no overflow), then cap exactly at C, so
    # weights below C pass through unchanged and every truncated weight equals C.
    ratio = torch.exp(log_ratio.clamp(max=math.log(C) + 1.0))
    weight = ratio.clamp(max=C).masked_fill(bad, 0.0)  # (B, T) or (B, 1)
    return (weight * real).detach()  # broadcast (B, 1) -> (B, T); 0 on padding


@dataclass
class LossParts:
    """PPO losses (differentiable) and diagnostics (detached), all 0-dim tensors."""

    policy_loss: torch.Tensor  # -mean(w * min(r A, clip(r) A)) over real tokens
    value_loss: torch.Tensor  # 0.5 * mean(max((v - R)^2, (v_clip - R)^2))
    entropy: torch.Tensor  # mean entropy of pi_theta (differentiable when given), else 0
    approx_kl: torch.Tensor  # k3 estimate of KL(pi_old || pi_theta)
    clipfrac: torch.Tensor  # fraction of real tokens whose surrogate is clipped (zero gradient)
    is_weight_mean: torch.Tensor  # mean truncated IS weight over real tokens
    is_truncated_frac: torch.Tensor  # fraction of real tokens whose IS weight sits at the cap C

    def total(self, vf_coef: float, entropy_coef: float) -> torch.Tensor:
        """The loss to minimise: policy + vf_coef * value - entropy_coef * entropy."""
        return self.policy_loss + vf_coef * self.value_loss - entropy_coef * self.entropy


def ppo_losses(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    values_new: torch.Tensor,
    values_old: torch.Tensor,
    returns: torch.Tensor,
    is_weight: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    value_clip_eps: float | None,
    entropy: torch.Tensor | None = None,
    is_truncation: float = math.inf,
) -> LossParts:
    """PPO-clip losses for one minibatch; every tensor argument is (B, T).

    Policy (Schulman et al. 2017, eq. 7, weighted by the truncated IS weight w):
        r_t = exp(logp_new_t - logp_old_t)
        L_pi = -mean_t( w_t * min(r_t A_t, clip(r_t, 1 - eps, 1 + eps) A_t) )
    Value (clipped around the rollout's values, as in OpenAI baselines / cleanRL):
        L_v = 0.5 * mean_t( max((v_t - R_t)^2, (v_old_t + clip(v_t - v_old_t, -eps_v, eps_v) - R_t)^2) )
        (value_clip_eps None: 0.5 * mean_t((v_t - R_t)^2)); the value loss is not IS-weighted.
    approx_kl is the k3 estimator mean((r - 1) - log r) (Schulman, "Approximating KL Divergence",
    2020): unbiased for KL(pi_old || pi_theta) and never negative. Means run over real tokens of the
    whole minibatch (token-level averaging). ``is_truncation`` is the C that made ``is_weight``; it
    only feeds is_truncated_frac (inf: nothing counts as truncated).
    """
    m = mask.to(torch.float32)  # (B, T)
    adv, w = advantages.detach().float(), is_weight.detach().float()  # (B, T) constants
    log_ratio = logp_new.float() - logp_old.detach().float()  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    surr = -adv * ratio  # (B, T) unclipped loss
    surr_clipped = -adv * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)  # (B, T)
    policy_loss = masked_mean(w * torch.maximum(surr, surr_clipped), m)

    v, v_old, ret = values_new.float(), values_old.detach().float(), returns.detach().float()  # (B, T)
    v_err = (v - ret) ** 2  # (B, T)
    if value_clip_eps is not None:
        v_clipped = v_old + torch.clamp(v - v_old, -value_clip_eps, value_clip_eps)  # (B, T)
        v_err = torch.maximum(v_err, (v_clipped - ret) ** 2)
    value_loss = 0.5 * masked_mean(v_err, m)

    ent = masked_mean(entropy.float(), m) if entropy is not None else torch.zeros((), device=m.device)
    with torch.no_grad():
        approx_kl = masked_mean((ratio - 1.0) - log_ratio, m)
        clipfrac = masked_mean((surr_clipped > surr).float(), m)  # the clipped branch is the max
        is_weight_mean = masked_mean(w, m)
        is_truncated_frac = masked_mean((w >= is_truncation).float(), m)
    return LossParts(
        policy_loss=policy_loss,
        value_loss=value_loss,
        entropy=ent,
        approx_kl=approx_kl,
        clipfrac=clipfrac,
        is_weight_mean=is_weight_mean,
        is_truncated_frac=is_truncated_frac,
    )
