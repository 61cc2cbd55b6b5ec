"""Hindsight samples from partial accepts: the part of a suggestion the user kept, ended where they stopped.

A `partial` verdict with accepted_chars = k says the user kept the suggestion's first k characters and
typed something else after them. The same suggestion cut after those k characters and ended with the
line end is what that user wanted: it would have been accepted (a user only keeps as many characters
as they would accept). Logged suggestions rarely stop early, because an early stop is a rare sample, so
on-policy rows seldom credit a stop; a hindsight row credits the stop at the point the user chose
(hindsight relabelling, Andrychowicz et al. 2017, applied to the user's own verdict, never to model
internals).

A hindsight row was not sampled by the serving engine as a whole: its last token is the line end the
user implied, which μ did not draw. It therefore carries no importance weight: the trainer uses π_old
as its behaviour (w = 1), as for on-policy data, and its stop token's behaviour log-prob is NaN
(unknown). The kept characters reuse the served tokens as far as they end on a token boundary; the
rest of the kept text (a token the user kept only part of) is encoded with the policy's tokenizer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from data_contracts.rewards import RewardRule
from data_contracts.samples import RewardSample


class HindsightSample(RewardSample):
    """A partial's kept prefix plus the stop token, rewarded as an accepted suggestion of that prefix.

    request_id is the partial's id with a '#hindsight' suffix (so the held-out split and the reference
    log-probs keep the rows apart); event is 'accepted'; behaviour_logprobs are μ of the reused served
    tokens and NaN for the rest."""


@dataclass
class HindsightRows:
    samples: list[HindsightSample]
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> partials without a hindsight row


def served_prefix(tokenizer, token_ids: Sequence[int], kept_text: str) -> tuple[int, str]:
    """(j, its text): the longest prefix token_ids[:j] whose decoded text is a prefix of kept_text."""
    reused, text = 0, ""
    for j in range(1, len(token_ids) + 1):
        t = tokenizer.decode(list(token_ids[:j]))
        if not kept_text.startswith(t):
            break
        reused, text = j, t
    return reused, text


def kept_token_ids(tokenizer, token_ids: Sequence[int], kept_text: str) -> tuple[list[int], int] | None:
    """(token ids that decode to kept_text, how many of them are served tokens), or None when the
    tokenizer cannot reproduce kept_text exactly."""
    reused, text = served_prefix(tokenizer, token_ids, kept_text)
    rest = tokenizer.encode(kept_text[len(text) :], add_special_tokens=False) if len(text) < len(kept_text) else []
    ids = list(token_ids[:reused]) + list(rest)
    return (ids, reused) if tokenizer.decode(ids) == kept_text else None


def hindsight_samples(samples: Sequence[RewardSample], tokenizer, rule: RewardRule, stop: str) -> HindsightRows:
    """One HindsightSample per `partial` row of `samples` that kept at least one character.

    `stop`: the text that ends a suggestion (the users' stop string, e.g. a line break); it must be a
    single token of the tokenizer, so the row ends exactly as a served suggestion that stopped there."""
    stop_ids = tokenizer.encode(stop, add_special_tokens=False)
    if len(stop_ids) != 1:
        raise ValueError(
            f"hindsight stop {stop!r} is {len(stop_ids)} tokens of the policy's tokenizer; "
            "expected exactly one (the token a served suggestion ends with)"
        )
    out, skipped = [], {"no_chars_kept": 0, "not_reproducible": 0}
    for s in samples:
        if s.event != "partial":
            continue
        k = min(s.accepted_chars or 0, len(s.completion_text))
        if k == 0:
            skipped["no_chars_kept"] += 1
            continue
        kept = kept_token_ids(tokenizer, s.completion_token_ids, s.completion_text[:k])
        if kept is None:
            skipped["not_reproducible"] += 1
            continue
        ids, reused = kept
        mu = list(s.behaviour_logprobs[:reused]) + [math.nan] * (len(ids) - reused + 1)
        out.append(
            HindsightSample(
                **{
                    **s.model_dump(),
                    "request_id": f"{s.request_id}#hindsight",
                    "completion_token_ids": ids + stop_ids,
                    "behaviour_logprobs": mu,
                    "completion_text": s.completion_text[:k],
                    "event": "accepted",
                    "accepted_chars": k,
                    "reward": rule.reward("accepted", k, s.completion_text[:k]),
                }
            )
        )
    return HindsightRows(out, {r: n for r, n in skipped.items() if n})
