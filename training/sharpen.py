"""Sharpening: a penalty on the spread of what to write, given that the line continues.

docs/learning.md measured that most of version 1's misses are samples from the tail of its own distribution:
the same weights sampled at logits x2 earn x1.65 the accepted characters and x3.6 the accept rate of version
1, with no training at all. The users ask for temperature 1, so the policy itself has to become sharper where
its contexts are predictable. Kept credit (training/kept_credit.py) does that only where users kept text, about
5% of the requests; this term does it at every completion position of the batch, by entropy minimisation (the
negative of PPO's usual entropy bonus) or by distillation from the reference at a lower temperature
(`sharpen_temperature`, a fixed target): it adds

    sharpen_coef * mean_t H( pi(. | s_t, the line continues) )                       over the batch's completion tokens
    sharpen_coef * mean_t CE( pi_ref^(1/tau)(. | s_t, continues), pi(. | s_t, continues) )   with a temperature tau

where the distribution given that the line continues is the policy's with every token that holds the stop
string removed and the rest renormalised. Whether to stop (or abstain) is left to the stop credit and its
abstain budget, which the verdict values exactly; sharpening the stop decision too would push the abstain
probability of version 1 (about 2%) to 0, against the lesson to abstain where suggestions are rejected.

The term moves the policy away from the calibrated distribution, so it raises plain bits/byte on held-out code;
the offline gate's `bpb_fit_temperature` scores the code model at its best temperature, which a sharper but
intact code model keeps (GateConfig).
"""

from __future__ import annotations

import torch

from training.stop_credit import stop_token_ids


class Sharpen:
    """The entropy of next-token distributions given that the line continues, summed over a batch's tokens."""

    def __init__(self, tokenizer, stop: str = "\n"):
        ids = stop_token_ids(tokenizer, stop)
        if not ids:
            raise ValueError(f"sharpen: no token of the policy's tokenizer holds the stop string {stop!r}")
        self.stop_ids = torch.tensor(ids)  # (S,) removed before the entropy is taken

    def _given_continues(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, V) logits -> (the same with every stop token at -inf, (B, T) bool: the position has a token that
        continues). A position whose top-p nucleus holds only stop tokens has nothing to sharpen (and would give
        NaN): its logits are zeroed and it is not live."""
        cont = logits.float().index_fill(-1, self.stop_ids.to(logits.device), float("-inf"))  # (B, T, V)
        live = torch.isfinite(cont).any(-1)  # (B, T)
        return torch.where(live.unsqueeze(-1), cont, torch.zeros_like(cont)), live

    def entropy_sum(self, logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """logits (B, T, V) at the rows' sampling temperature, mask (B, T) of completion tokens -> the summed
        entropy (nats) of pi(. | s_t, continues) over the masked positions (a differentiable scalar)."""
        cont, live = self._given_continues(logits)
        logp = torch.log_softmax(cont, dim=-1)
        h = -(logp.exp() * logp.clamp_min(torch.finfo(logp.dtype).min)).sum(-1)  # (B, T)
        return (h * (mask.to(h.dtype) * live)).sum()

    def distill_sum(self, logits: torch.Tensor, ref_logits: torch.Tensor, mask: torch.Tensor, temperature: float) -> torch.Tensor:
        """Cross-entropy from the reference at `temperature` (its logits / temperature), both given that the line
        continues, to the policy: logits, ref_logits (B, T, V), mask (B, T) -> the sum over the masked positions.
        A fixed target (the reference does not move), so it sharpens as far as the temperature says and no
        further, where an entropy penalty keeps pushing towards whatever mode the policy has."""
        cont, live = self._given_continues(logits)
        target, live_ref = self._given_continues(ref_logits / temperature)
        q = torch.softmax(target, dim=-1)  # (B, T, V), no gradient: the reference's
        logp = torch.log_softmax(cont, dim=-1).clamp_min(torch.finfo(torch.float32).min)
        ce = -(q * logp).sum(-1)  # (B, T)
        return (ce * (mask.to(ce.dtype) * live * live_ref)).sum()
