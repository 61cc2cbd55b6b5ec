"""Prefect tasks of the base-policy bootstrap (composed by flows/bootstrap.py)."""

from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from data_contracts import corpus as corpus_mod
from tidal import lineage
from tidal.registry import Registry, VersionInfo, code_revision, publish
from tidal.section import PROJECT_ROOT, SettingsError
from tidal.store import ObjectStore
from training.policy import build_policy, save_policy
from training.pretrain import PretrainResult, pretrain
from training.probe import ProbeSet, compute_probe, probe_prompts, save_probe
from training.tokenizer import train_tokenizer
from training.train_settings import BootstrapSettings


@dataclass
class Corpus:
    train: list[str]
    heldout: list[str]
    train_files: int
    heldout_files: int


def refuse_short_context(cfg: BootstrapSettings, engine_max_model_len: int) -> None:
    """Before any pretraining: the engines must be able to serve the policy (vLLM refuses to start a model past its
    context), as `tidal import` checks a checkpoint's."""
    context = cfg.policy.max_position_embeddings
    if context < engine_max_model_len:
        raise SettingsError(
            f"bootstrap.policy.max_position_embeddings={context} is below engine.max_model_len={engine_max_model_len}: "
            f"the engines could not serve the policy pretrained here; raise bootstrap.policy.max_position_embeddings to "
            f"{engine_max_model_len} or lower engine.max_model_len"
        )


@task(cache_policy=NO_CACHE)
def load_corpus(heldout_fraction: float) -> Corpus:
    """The interpreter's standard library, split train/held-out by a hash of each file's path."""
    root = corpus_mod.stdlib_root()
    train, heldout = corpus_mod.split_stdlib(heldout_fraction, root)
    return Corpus(corpus_mod.read_texts(train), corpus_mod.read_texts(heldout), len(train), len(heldout))


@task(cache_policy=NO_CACHE)
def train_base_tokenizer(texts: list[str], vocab_size: int):
    return train_tokenizer(texts, vocab_size)


@task(cache_policy=NO_CACHE)
def pretrain_policy(tokenizer, corpus: Corpus, cfg: BootstrapSettings):
    model = build_policy(cfg.policy, tokenizer)
    result = pretrain(model, tokenizer, corpus.train, corpus.heldout, cfg.pretrain, progress=sys.stderr.isatty())
    return model, result


@task(cache_policy=NO_CACHE)
def compute_version_probe(model, tokenizer, heldout: list[str], cfg: BootstrapSettings) -> ProbeSet:
    prompts = probe_prompts(heldout, n=cfg.probe_prompts, seed=cfg.pretrain.seed)
    return compute_probe(model, tokenizer, prompts, max_new_tokens=cfg.probe_tokens)


@task(cache_policy=NO_CACHE)
def publish_base_version(
    registry: Registry,
    store: ObjectStore,
    model_name: str,
    model,
    tokenizer,
    probe: ProbeSet,
    result: PretrainResult,
    cfg: BootstrapSettings,
    run_id: str | None,
) -> VersionInfo:
    """Upload the checkpoint with its probe, register it (no parent), make it the champion."""
    with tempfile.TemporaryDirectory() as tmp:
        out = save_policy(model, tokenizer, Path(tmp) / "checkpoint")
        save_probe(probe, out)
        tags = {
            lineage.PARENT_VERSION: "none",
            lineage.ORIGIN: "bootstrap",
            lineage.CODE_REVISION: code_revision(PROJECT_ROOT),
            lineage.HELDOUT_BITS_PER_BYTE: f"{result.heldout_bits_per_byte:.4f}",
            lineage.PARAMS: str(sum(p.numel() for p in model.parameters())),
        }
        info = publish(registry, store, model_name, out, "full", None, tags, run_id)
    registry.set_alias(model_name, "champion", info.version)
    return info
