"""Shared fixtures of the unit tests: a tiny pretrained policy and samples drawn from it; the log sinks a test started."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from data_contracts.corpus import read_texts, stdlib_root
from data_contracts.samples import RewardSample
from serving.logsink import LogSink
from training.policy import (
    PolicyConfig,
    build_policy,
    load_policy,
    load_tokenizer,
    save_policy,
)
from training.pretrain import PretrainConfig, pretrain
from training.probe import compute_probe, save_probe
from training.tokenizer import train_tokenizer

TINY = PolicyConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64, max_position_embeddings=256)


@pytest.fixture(scope="session")
def champion_dir(tmp_path_factory) -> Path:
    root = stdlib_root()
    texts = read_texts([root / "heapq.py", root / "bisect.py"])
    tok = train_tokenizer(texts, vocab_size=300)
    model = build_policy(TINY, tok, seed=0)
    # A few hundred steps make the distribution peaked like a real policy's (a random one is near uniform)
    pretrain(
        model,
        tok,
        texts,
        texts[1:],
        PretrainConfig(max_steps=300, max_seconds=600, seq_len=128, batch_size=8, warmup_steps=10, eval_bytes=2000),
        progress=False,
    )
    out = save_policy(model, tok, tmp_path_factory.mktemp("champion") / "v1")
    save_probe(compute_probe(model, tok, ["def heappush(heap, item", "import bis"], max_new_tokens=4), out)
    return out


@torch.no_grad()
def sample(model, prompt_ids: list[int], n_tokens: int, gen: torch.Generator) -> tuple[list[int], list[float]]:
    """Temperature-1 ancestral sampling with the sampled tokens' log-probs (the behaviour mu)."""
    ids, out, logps = list(prompt_ids), [], []
    for _ in range(n_tokens):
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)
        t = int(torch.multinomial(logp.exp(), 1, generator=gen))
        out.append(t)
        logps.append(float(logp[t]))
        ids.append(t)
    return out, logps


@pytest.fixture(scope="session")
def samples(champion_dir) -> list[RewardSample]:
    """Completions of the champion, rewarded +0.75 when they start with whitespace, -0.25 otherwise."""
    model = load_policy(champion_dir)
    tok_texts = read_texts([stdlib_root() / "heapq.py"])[0]
    tok = load_tokenizer(champion_dir)
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    rows = []
    for i in range(160):
        start = rng.randrange(0, len(tok_texts) - 200)
        prompt = tok.encode(tok_texts[start : start + rng.randrange(40, 120)], add_special_tokens=False)
        completion, logps = sample(model, prompt, 4, gen)
        accepted = tok.decode(completion[:1])[:1].isspace()
        rows.append(rewarded_row(i, prompt, completion, logps, accepted))
    return rows


def rewarded_row(
    i: int, prompt: list[int], completion: list[int], logps: list[float], accepted: bool, model: str = "tab"
) -> RewardSample:
    """One logged version-1 completion with its verdict: +0.75 accepted, -0.25 rejected."""
    return RewardSample(
        request_id=f"r{i}",
        model=model,
        version=1,
        arm="control",
        user_hash="u",
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        behaviour_logprobs=logps,
        completion_text="x",
        event="accepted" if accepted else "rejected",
        reward=0.75 if accepted else -0.25,
        reward_rule="r@1",
        completion_time_ms=0,
    )


@pytest.fixture
def sinks() -> Iterator[list[LogSink]]:
    """Sinks a test started; stopped at the end (a 'crashed' one is simply not put in the list)."""
    started: list[LogSink] = []
    yield started
    for s in started:
        s.stop(timeout_s=1)
