"""Tab traffic as the gateway logs it, without the fleet: for offline learning studies and the CI learning test.

The policy (a Hugging Face checkpoint, e.g. version 1) samples one completion per cursor site of the traffic
split at the users' temperature, stops at the first token holding a line break (the users' stop string, as the
engine does: the token is logged, its text is not shown), and the simulated users judge it (sim/users.py's
verdict, against the code they were about to type). Each row is the RewardSample the collection flow would
build: prompt and completion token ids, the sampling log-prob of each token (μ), the verdict and the rule's
reward. μ here is the HF policy's own (float32, no engine): rows carry no train/serve mismatch.
"""

from __future__ import annotations

import random
import time

import torch

from data_contracts.rewards import RewardRule
from data_contracts.samples import RewardSample
from sim.tab_sites import cursor_sites, site_files
from sim.users import SimUsersConfig, population, verdict
from training.stop_credit import stop_token_ids


@torch.no_grad()
def sample_completions(
    model, tokenizer, prompts: list[str], max_tokens: int, temperature: float, seed: int, stop: str = "\n", batch: int = 64
) -> list[tuple[list[int], list[int], list[float], str]]:
    """Per prompt: (prompt ids, completion ids up to and including the first stop token, (T,) μ of each, the
    text shown). Sampled at `temperature` over the whole vocabulary, seeded."""
    model.eval()
    torch.manual_seed(seed)
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    stops = set(stop_token_ids(tokenizer, stop))
    out = []
    try:
        for i in range(0, len(prompts), batch):
            enc = tokenizer(prompts[i : i + batch], return_tensors="pt", padding=True)
            gen = model.generate(
                **enc,
                max_new_tokens=max_tokens,
                do_sample=True,
                temperature=temperature,
                top_k=0,
                top_p=1.0,
                pad_token_id=tokenizer.pad_token_id,
                output_scores=True,
                return_dict_in_generate=True,
            )
            new = gen.sequences[:, enc.input_ids.shape[1] :]  # (b, T) sampled ids
            # (b, T) log-prob of each sampled token under the tempered distribution it was drawn from
            logp = torch.stack(gen.scores, 1).float().log_softmax(-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
            for j in range(new.shape[0]):
                ids, lps = [], []
                for t, tok_id in enumerate(new[j].tolist()):
                    ids.append(tok_id)
                    lps.append(float(logp[j, t]))
                    if tok_id in stops:
                        break
                prompt_ids = enc.input_ids[j][enc.attention_mask[j].bool()].tolist()
                out.append((prompt_ids, ids, lps, tokenizer.decode(ids).split(stop)[0]))
    finally:
        tokenizer.padding_side = side
    return out


def logged_traffic(
    model,
    tokenizer,
    users: SimUsersConfig,
    heldout_fraction: float,
    rule: RewardRule,
    n: int,
    version: int = 1,
    seed: int = 0,
    model_name: str = "tab",
) -> list[RewardSample]:
    """`n` logged Tab requests of the traffic split, sampled by `model` as behaviour `version`, judged by the
    simulated users and rewarded by `rule` (see the module docstring)."""
    root, files = site_files("traffic", heldout_fraction, users.eval_fraction, users.code_dir)
    sites = cursor_sites(root, files, n, seed, users.context_bytes)
    people, rng = population(users), random.Random(f"logged/{seed}")
    sampled = sample_completions(
        model, tokenizer, [s.prompt for s in sites], users.max_tokens, users.temperature, seed, stop=(users.stop or ["\n"])[0]
    )
    now, rows = int(time.time() * 1000), []
    for i, (site, (prompt_ids, ids, lps, text)) in enumerate(zip(sites, sampled)):
        user = people[rng.randrange(len(people))]
        event, kept = verdict(text, site.intended, user.min_chars)
        chars = kept if event == "partial" else (len(text) if event == "accepted" else None)
        rows.append(
            RewardSample(
                request_id=f"sim-{seed}-{i}",
                model=model_name,
                version=version,
                arm="control",
                user_hash=user.user_id,
                prompt_token_ids=prompt_ids,
                completion_token_ids=ids,
                behaviour_logprobs=lps,
                temperature=users.temperature,
                completion_text=text,
                event=event or "none",
                accepted_chars=chars,
                reward=rule.reward(event or "none", chars if event == "partial" else None, text),
                reward_rule=rule.id,
                completion_time_ms=now,
                feedback_time_ms=now if event else None,
            )
        )
    return rows
