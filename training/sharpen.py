"""Sharpening: an entropy penalty on what to write, given that the line continues.

docs/learning.md measured that most of version 1's misses are samples from the tail of its own distribution:
the same weights sampled at logits x2 earn x1.65 the accepted characters and x3.6 the accept rate of version
1, with no training at all. The users ask for temperature 1, so the policy itself has to become sharper where
its contexts are predictable. Kept credit (training/kept_credit.py) does that only where users kept text, about
5% of the requests; this term does it at every completion position of the batch, by entropy minimisation (the
negative of PPO's usual entropy bonus): it adds

    sharpen_coef * mean_t H( pi(. | s_t, the line continues) )        over the batch's completion tokens

where the distribution given that the line continues is the policy's with every token that holds the stop
string removed and the rest renormalised. Whether to stop (or abstain) is left to the stop credit and its
abstain budget, which the verdict values exactly; sharpening the stop decision too would push the abstain
probability of version 1 (about 2%) to 0, against the lesson to abstain where suggestions are rejected.

The term moves the policy away from the calibrated distribution, so it raises plain bits/byte on held-out code;
the offline gate's `bpb_temperature_fit` scores the code model at its best temperature, which a sharper but
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

    def entropy_sum(self, logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """logits (B, T, V) at the rows' sampling temperature, mask (B, T) of completion tokens -> the summed
        entropy (nats) of pi(. | s_t, continues) over the masked positions (a differentiable scalar)."""
        cont = logits.float().index_fill(-1, self.stop_ids.to(logits.device), float("-inf"))  # (B, T, V)
        # a position whose top-p nucleus holds only stop tokens has nothing to sharpen (and would give NaN)
        live = torch.isfinite(cont).any(-1)  # (B, T)
        cont = torch.where(live.unsqueeze(-1), cont, torch.zeros_like(cont))
        logp = torch.log_softmax(cont, dim=-1)
        h = -(logp.exp() * logp.clamp_min(torch.finfo(logp.dtype).min)).sum(-1)  # (B, T)
        return (h * (mask.to(h.dtype) * live)).sum()

    def distill_sum(self, logits: torch.Tensor, ref_logits: torch.Tensor, mask: torch.Tensor,
                    temperature: float) -> torch.Tensor:
        """Cross-entropy from the reference at `temperature` (its logits / temperature), both given that the line
        continues, to the policy: logits, ref_logits (B, T, V), mask (B, T) -> the sum over the masked positions.
        A fixed target (the reference does not move), so it sharpens as far as the temperature says and no
        further, where an entropy penalty keeps pushing towards whatever mode the policy has."""
        stops = self.stop_ids.to(logits.device)
        cont = logits.float().index_fill(-1, stops, float("-inf"))  # (B, T, V)
        target = (ref_logits.float() / temperature).index_fill(-1, stops, float("-inf"))
        live = torch.isfinite(cont).any(-1) & torch.isfinite(target).any(-1)  # (B, T)
        cont = torch.where(live.unsqueeze(-1), cont, torch.zeros_like(cont))
        target = torch.where(live.unsqueeze(-1), target, torch.zeros_like(target))
        q = torch.softmax(target, dim=-1)  # (B, T, V), no gradient: the reference's
        logp = torch.log_softmax(cont, dim=-1).clamp_min(torch.finfo(torch.float32).min)
        ce = -(q * logp).sum(-1)  # (B, T)
        return (ce * (mask.to(ce.dtype) * live)).sum()

