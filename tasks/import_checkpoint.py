"""Prefect tasks of `tidal import` (composed by flows/import_checkpoint.py): a team's own Hugging Face
checkpoint becomes a model's next version, checked, probed on the real engine at its serving dtype, and
registered with lineage, instead of a pretrained base."""

from __future__ import annotations

import tempfile
from pathlib import Path
from urllib.parse import urlparse

from prefect import task
from prefect.cache_policies import NO_CACHE

from data_contracts import corpus as corpus_mod
from data_contracts.probe import PROBE_FILE, ProbeSet, save_probe
from serving.engine import EngineClient, scratch_engine, supported_architectures
from serving.finite_weights import first_non_finite
from serving.probe import record_probe
from tidal import lineage
from tidal.registry import Registry, VersionInfo, checkpoint_digest, checkpoint_files, code_revision, publish
from tidal.section import PROJECT_ROOT
from tidal.settings import TidalSettings
from tidal.store import download_dir, local_corpus, open_store, open_url
from training.hf_checkpoint import CheckpointFacts, CheckpointRefused, encode_prompts, inspect_checkpoint
from training.probe import probe_prompts


@task(cache_policy=NO_CACHE)
def fetch_checkpoint(source: str, settings: TidalSettings, scratch: Path) -> Path:
    """The checkpoint as a local directory: ``source`` itself, or a copy of everything under an s3:// prefix
    (read with the store's endpoint and credentials)."""
    if not source.startswith("s3://"):
        return Path(source).expanduser().resolve()
    parsed = urlparse(source)
    prefix = parsed.path.strip("/")
    if not parsed.netloc or not prefix:
        raise CheckpointRefused(f"cannot import {source}: expected s3://bucket/prefix, the prefix holding one checkpoint")
    bucket = open_url(f"s3://{parsed.netloc}", settings, "the import source")
    try:
        return download_dir(bucket, prefix, scratch / "source")
    except FileNotFoundError as e:
        raise CheckpointRefused(f"cannot import {source}: no objects under it") from e


def refuse_unservable(path: Path, facts: CheckpointFacts, architectures: frozenset[str], max_model_len: int) -> None:
    """The engine's own limits: an architecture its registry lacks, a context shorter than engine.max_model_len."""
    if facts.architecture not in architectures:
        near = sorted(a for a in architectures if a.startswith(facts.architecture[:4]))[:8]
        raise CheckpointRefused(
            f"cannot import {path}: the engine cannot serve architecture {facts.architecture} (config.architectures); "
            f"the installed vLLM serves {len(architectures)} others" + (f", e.g. {', '.join(near)}" if near else "")
        )
    if facts.context is not None and facts.context < max_model_len:
        raise CheckpointRefused(
            f"cannot import {path}: its context is {facts.context} tokens (config max_position_embeddings) but the "
            f"engine is set to serve {max_model_len} (engine.max_model_len); vLLM refuses to start a model past its "
            f"context: set engine.max_model_len (and collect.max_model_len) to at most {facts.context}"
        )


def refuse_non_finite(path: Path, facts: CheckpointFacts) -> None:
    for name in facts.weight_files:
        bad = first_non_finite(path / name)
        if bad is not None:
            raise CheckpointRefused(f"cannot import {path}: tensor {bad} in {name} holds NaN or inf; a broken export?")


@task(cache_policy=NO_CACHE)
def check_checkpoint(path: Path, settings: TidalSettings) -> CheckpointFacts:
    """Config, tokenizer and weights load; every tensor is finite; the engine serves the architecture and context."""
    facts = inspect_checkpoint(path)
    refuse_unservable(path, facts, supported_architectures(settings.engine), settings.engine.max_model_len)
    refuse_non_finite(path, facts)
    return facts


@task(cache_policy=NO_CACHE)
def probe_on_engine(path: Path, model: str, settings: TidalSettings) -> ProbeSet:
    """Start one engine on the checkpoint at the serving dtype (engine.dtype) and record its greedy tokens and
    log-probs on prompts cut from the held-out side of the model's corpus (the standard library's for a model
    without one): the probe every replica serving this version must match."""
    cfg = settings.bootstrap
    corpus = local_corpus(settings.model(model).corpus, settings, settings.data_path / "cache")
    split = corpus_mod.corpus_split(corpus, cfg.heldout_fraction)
    train, heldout = split if split is not None else corpus_mod.split_stdlib(cfg.heldout_fraction)
    texts = corpus_mod.read_texts(heldout) or corpus_mod.read_texts(train)  # a small corpus may hold out no file
    prompts = probe_prompts(texts, n=cfg.probe_prompts, seed=cfg.pretrain.seed)
    ids = encode_prompts(path, prompts)
    served = f"{model}@import"
    log = settings.log_dir / f"import-{model}.log"
    with scratch_engine(settings.engine, path, served, log, settings.fleet.ready_timeout_s) as url, EngineClient(url) as engine:
        return record_probe(engine, served, ids, cfg.probe_tokens, note=f"{model} import, {settings.engine.dtype} engine")


@task(cache_policy=NO_CACHE)
def publish_imported(
    registry: Registry,
    model: str,
    source: str,
    path: Path,
    facts: CheckpointFacts,
    probe: ProbeSet,
    settings: TidalSettings,
    champion: bool,
    run_id: str | None,
) -> VersionInfo:
    """Upload the checkpoint with its probe and register it as the model's next version (no parent): the source's
    own files, linked rather than copied, plus probe.json."""
    source_files = {k: v for k, v in checkpoint_files(path).items() if k != PROBE_FILE}
    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / "checkpoint"
        for rel in source_files:
            (staged / rel).parent.mkdir(parents=True, exist_ok=True)
            (staged / rel).symlink_to((path / rel).resolve())
        save_probe(probe, staged)
        tags = {
            lineage.PARENT_VERSION: "none",
            lineage.ORIGIN: "import",
            lineage.SOURCE: source,
            lineage.SOURCE_DIGEST: checkpoint_digest(source_files),
            lineage.ARCHITECTURE: facts.architecture,
            lineage.PROBE_DTYPE: settings.engine.dtype,
            lineage.PARAMS: str(facts.parameters),
            lineage.CODE_REVISION: code_revision(PROJECT_ROOT),
        }
        info = publish(registry, open_store(settings), model, staged, "full", None, tags, run_id)
    if champion:
        registry.set_alias(model, "champion", info.version)
    return info
