"""Exact credit for every token a user kept: raise the probability of the right next token where the verdict
tells which tokens were right.

A `partial` verdict with k kept characters says that the suggestion's first k characters are the user's code;
an `accepted` one says the same of the whole suggestion. At every position j of such a row whose text so far
(the decoded tokens before j) lies inside the kept characters, the tokens that would have shown the next kept
characters are known, all of them and not only the one sampled: every token whose text is a non-empty prefix
of the kept characters still to come. Call that set C_j. (A token running past the kept characters may or may
not have been right; it is not counted.)

The trainer adds the gradient of

    kept_credit_coef * sum_j pi(C_j | s_j)        (summed over a row's credited positions, averaged over rows)

the expected number of right tokens at the credited positions under the sampling policy. Unlike the
log-likelihood of the kept text (what hindsight rows and the code loss train), whose optimum is the calibrated
distribution, the expected-accuracy objective's optimum puts all the mass on the right token: its gradient
pi(C) * grad log pi(C) is largest where the policy is already confident, so it sharpens the policy where users
keep its text (the lesson of docs/learning.md: most of version 1's misses are samples from the tail of its own
distribution). It is the all-action policy gradient for the actions whose value the verdict tells, as in
training/stop_credit.py. Only the user's verdict is used, never model internals. Rejections tell no position's
right token (the user's minimum length is unknown), so they get no kept credit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from data_contracts.samples import RewardSample


class KeptCredit:
    """Per-row credited (position, token) pairs, and the batch's summed probability of the right tokens."""

    def __init__(self, tokenizer):
        texts: dict[str, list[int]] = {}
        for i in range(len(tokenizer)):
            t = tokenizer.decode([i])
            if t and "\ufffd" not in t:  # a token holding part of a multi-byte character shows no whole text
                texts.setdefault(t, []).append(i)
        if not texts:
            raise ValueError("kept credit: the policy's tokenizer decodes no token to text")
        self.tokenizer, self._ids, self._longest = tokenizer, texts, max(map(len, texts))
        self._cache: dict[str, list[tuple[int, int]]] = {}

    @staticmethod
    def kept_text(s: RewardSample) -> str:
        """The characters the user kept ('' when the verdict tells none)."""
        if s.event == "accepted":
            return s.completion_text
        if s.event == "partial" and s.accepted_chars:
            return s.completion_text[: s.accepted_chars]
        return ""

    def right_tokens(self, rest: str) -> list[int]:
        """Every token whose text is a non-empty prefix of `rest` (the kept characters still to come)."""
        out: list[int] = []
        for n in range(1, min(len(rest), self._longest) + 1):
            out += self._ids.get(rest[:n], [])
        return out

    def pairs(self, s: RewardSample) -> list[tuple[int, int]]:
        """(position j, right token) for every credited position of the row; [] when its verdict keeps nothing."""
        if s.request_id in self._cache:
            return self._cache[s.request_id]
        kept, ids, out = self.kept_text(s), s.completion_token_ids, []
        for j in range(len(ids)):
            shown = self.tokenizer.decode(ids[:j])
            if len(shown) >= len(kept) or not kept.startswith(shown):
                break  # past the kept characters (or a cut inside a character): nothing known from here on
            out += [(j, v) for v in self.right_tokens(kept[len(shown) :])]
        self._cache[s.request_id] = out
        return out

    def batch(self, samples: Sequence[RewardSample]) -> torch.Tensor:
        """(N, 3) long tensor of (row, position, right token) over the batch's rows; N may be 0."""
        rows = [(i, j, v) for i, s in enumerate(samples) for j, v in self.pairs(s)]
        return torch.tensor(rows, dtype=torch.long).view(-1, 3)

    @staticmethod
    def gain(logits: torch.Tensor, triples: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """(b, T, V) logits of the sampling distribution for the batch rows `rows` (b,) -> the summed probability
        of the right tokens at their credited positions, sum_j pi(C_j | s_j) over those rows (a scalar)."""
        match = triples[:, :1].to(rows.device) == rows[None, :]  # (N, b): which of `rows` each triple is in
        hit = match.any(1)
        if not bool(hit.any()):
            return logits.sum() * 0.0  # no credited position among these rows: a zero that keeps the graph
        local, t = match[hit].float().argmax(1).to(logits.device), triples[hit].to(logits.device)
        logp = logits[local, t[:, 1]].log_softmax(-1)  # (n, V) at the credited positions only
        return logp.gather(1, t[:, 2:3]).exp().sum()
