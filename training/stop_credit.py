"""Exact credit for the stop decision at every position of a logged suggestion, read from the user's verdict.

A Tab suggestion ends where the policy samples a token holding the line break (or shows nothing when that is
its first token). The verdict on the whole suggestion also says what stopping earlier would have earned, under
the users' rule (sim/users.py, and any editor whose verdict is "kept a prefix"):

    cut text c (what stopping before token j shows)   verdict on the suggestion   reward of stopping there
    ''   (j = 0: abstain)                              any                         R(empty) (0 for cursor-tab)
    non-empty                                          rejected                    R(rejected): every cut is rejected
    len(c) == k                                        partial, k chars kept       R(accepted, c): the user kept c
    len(c) > k                                         partial, k chars kept       R(partial, k, c)
    anything else                                      -                           unknown (the user's minimum
                                                                                   length decides), not credited

Going on as logged earned the row's reward R. At each credited position j that did not itself sample a stop, the
trainer adds the gradient of the stop-versus-go-on choice, pi(stop | s_j) * (R_stop(j) - R) (the exact action
value of stopping, so no importance weight and no critic is needed for it), with `stop_credit_coef` as its
weight. "Stop" there is every token whose text *begins* with the stop string: those show exactly the cut. A
token such as ')\n' also ends the suggestion, but shows one more character, whose verdict is not known. It is
the all-action policy gradient (Sutton et al. 2000; "mean actor-critic", Allen et al. 2017) for the one action
whose value the verdict tells. The sampled tokens keep their PPO terms. Only the user's verdict
is used, never model internals.

Abstaining is the one decision every rejection credits: for a policy whose suggestions are mostly rejected, the
exact lesson is "show nothing" almost everywhere, and the policy learns silence (docs/learning.md). A budget b
(`abstain_budget`) turns that into a constrained problem: the penalty BUDGET_PENALTY * max(0, mean pi(abstain) - b)
over a minibatch's rows pulls every row back once the policy abstains on more than b of them. Its weight exceeds
any credit the rule can give (|R_stop - R| <= accepted - rejected = 1 under the default rule), so at the cap the
rows whose verdicts say silence pays least are pushed down first: the policy learns *where* to abstain.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from data_contracts.rewards import RewardRule
from data_contracts.samples import RewardSample

BUDGET_PENALTY = 2.0  # per unit of abstain share above the budget, in reward units: more than any |R_stop - R|


def stop_token_ids(tokenizer, stop: str = "\n") -> list[int]:
    """Every token whose text holds the stop string: sampling one ends a suggestion (its text before the stop
    is shown, e.g. ')' of ')\\n')."""
    return [i for i in range(len(tokenizer)) if stop in tokenizer.decode([i])]


def clean_stop_ids(tokenizer, stop: str = "\n") -> list[int]:
    """The tokens whose text begins with the stop string: sampling one ends a suggestion showing nothing more."""
    return [i for i in range(len(tokenizer)) if tokenizer.decode([i]).startswith(stop)]


class StopCredit:
    """Per-position advantages of stopping for logged rows, and pi(stop) of a batch's logits."""

    def __init__(self, tokenizer, rule: RewardRule, stop: str = "\n", abstain: bool = True, abstain_vs_best_cut: bool = False):
        """`abstain`: credit stopping before the first token (showing nothing) too; False credits only where a shown
        suggestion ends. `abstain_vs_best_cut`: abstaining is weighed against the best the verdict says showing could
        have earned (the best known cut, e.g. a partial's kept characters), not against the row's own reward."""
        self.tokenizer, self.rule, self.abstain, self.vs_best_cut = tokenizer, rule, abstain, abstain_vs_best_cut
        clean = clean_stop_ids(tokenizer, stop)
        if not clean:
            raise ValueError(f"stop credit: no token of the policy's tokenizer begins with the stop string {stop!r}")
        self.stop_ids = torch.tensor(clean)  # (S,) the credited action: stop, showing exactly the cut
        self._stops = set(stop_token_ids(tokenizer, stop))  # a position that sampled any of these ended the row
        self._cache: dict[str, tuple[list[float], list[bool]]] = {}

    def stop_reward(self, s: RewardSample, cut: str) -> float | None:
        """What showing `cut` (a prefix of the suggestion) would have earned from this verdict; None = unknown."""
        if not s.completion_text.startswith(cut):
            return None  # a cut inside a multi-byte character
        if not cut:
            return self.rule.empty if self.abstain else None
        if s.event == "rejected":
            return self.rule.rejected
        if s.event == "partial" and s.accepted_chars is not None:
            k = s.accepted_chars
            if len(cut) == k:
                return self.rule.reward("accepted", None, cut)
            if len(cut) > k:
                return self.rule.reward("partial", k, cut)
        return None

    def advantages(self, s: RewardSample) -> tuple[list[float], list[bool]]:
        """(T,) R_stop(j) - R before each completion token j, and (T,) whether it is known and credited."""
        if s.request_id in self._cache:
            return self._cache[s.request_id]
        ids, adv, known = s.completion_token_ids, [], []
        for j in range(len(ids)):
            r = None if ids[j] in self._stops or s.event == "none" else self.stop_reward(s, self.tokenizer.decode(ids[:j]))
            adv.append(0.0 if r is None else r - s.reward)
            known.append(r is not None)
        if self.vs_best_cut and known and known[0]:  # adv[j] + R: the known reward of stopping before token j
            showing = max([s.reward] + [a + s.reward for a, k in zip(adv[1:], known[1:]) if k])
            adv[0] = self.rule.empty - showing
        self._cache[s.request_id] = (adv, known)
        return adv, known

    def batch(self, samples: Sequence[RewardSample], T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T) advantages of stopping and (B, T) float mask of the credited positions, 0 on padding."""
        adv, known = torch.zeros((len(samples), T)), torch.zeros((len(samples), T))
        for i, s in enumerate(samples):
            a, k = self.advantages(s)
            adv[i, : len(a)], known[i, : len(k)] = torch.tensor(a), torch.tensor(k, dtype=torch.float32)
        return adv, known

    @staticmethod
    def credit_loss(p_stop: torch.Tensor, adv: torch.Tensor, known: torch.Tensor, abstain_log: bool) -> torch.Tensor:
        """(b, T) pi(stop), (b, T) R_stop - R, (b, T) credited mask -> minus the summed credit of the b rows.

        `abstain_log`: position 0 (abstaining) is weighed by log pi(abstain) instead of pi(abstain), i.e. the exact
        gradient divided by pi(abstain), so a rare abstain moves as fast as a sampled token (ppo_config.abstain_credit).
        """
        weight = p_stop
        if abstain_log:  # clamp: a row whose abstain probability underflows still gets a finite, bounded push
            weight = torch.cat([p_stop[:, :1].clamp_min(1e-6).log(), p_stop[:, 1:]], dim=1)
        return -(weight * adv * known).sum()

    @staticmethod
    def anchor_sum(p_stop: torch.Tensor, p_ref: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(b, T) pi(stop), (b, T) the reference's pi(stop), (b, T) completion mask -> the summed binary KL from the
        reference's stop-or-go-on choice to the policy's at every position after the first (ppo_config.stop_anchor_coef).

        Stop and abstain share the stop tokens' logits, so credit that moves the abstain decision also moves stopping
        mid-suggestion, where rejections say nothing (every cut of a rejection is rejected too); this holds it."""
        p, q = p_stop[:, 1:].clamp(1e-6, 1 - 1e-6), p_ref[:, 1:].detach().clamp(1e-6, 1 - 1e-6)
        kl = q * (q.log() - p.log()) + (1 - q) * ((1 - q).log() - (1 - p).log())
        return (kl * mask[:, 1:].to(kl.dtype)).sum()

    @staticmethod
    def over_budget(
        stop_prob: torch.Tensor, first: torch.Tensor, budget: float, whole: tuple[float, float] | None = None
    ) -> torch.Tensor:
        """(b, T) pi(stop) of a minibatch's rows, (b,) 1 where a row has a first token -> BUDGET_PENALTY times the
        rows' mean abstain probability above `budget` (0 within it).

        `whole` (share, rows with a first token) of the whole minibatch when these rows are one micro-batch of it:
        then this micro-batch's part of the whole minibatch's penalty, linear in its rows, so that the parts add up
        to the whole's penalty in value and gradient (the share decides whether it applies, as it would at once)."""
        if whole is not None:
            share, n_first = whole
            if share <= budget:
                return stop_prob.sum() * 0.0  # within the budget: a zero that keeps the graph
            return BUDGET_PENALTY * ((stop_prob[:, 0] * first).sum() - budget * first.sum()) / max(n_first, 1.0)
        share = (stop_prob[:, 0] * first).sum() / first.sum().clamp_min(1.0)
        return BUDGET_PENALTY * torch.relu(share - budget)

    def stop_prob(self, logits: torch.Tensor) -> torch.Tensor:
        """(b, T, V) logits of the sampling distribution -> (b, T) probability of stopping there, showing the cut."""
        return logits.softmax(-1)[..., self.stop_ids.to(logits.device)].sum(-1)
