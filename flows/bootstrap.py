"""Bootstrap flow: pretrain the base policy on real Python source and register it as version 1."""

from __future__ import annotations

import mlflow
from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from tasks.bootstrap import (
    compute_version_probe,
    load_corpus,
    pretrain_policy,
    publish_base_version,
    refuse_short_context,
    train_base_tokenizer,
)
from tidal.registry import Registry
from tidal.settings import load_settings
from tidal.store import open_store


@flow(name="bootstrap", log_prints=True)
def bootstrap(model: str = "tab", force: bool = False) -> int:
    settings = load_settings()
    settings.model(model)  # unknown model → clear error
    cfg, registry, store = settings.bootstrap, Registry(settings.mlflow.tracking_uri), open_store(settings)
    champion = registry.by_alias(model, "champion")
    if champion is not None and not force:
        get_run_logger().info("%s already has a champion (v%d); nothing to do", model, champion.version)
        return champion.version
    refuse_short_context(cfg, settings.engine.max_model_len)

    mlflow.set_tracking_uri(settings.mlflow.tracking_uri)
    mlflow.set_experiment(f"{model}/bootstrap")
    with mlflow.start_run(run_name="bootstrap") as run:
        mlflow.log_params(
            {
                "vocab_size": cfg.vocab_size,
                "heldout_fraction": cfg.heldout_fraction,
                **{f"policy.{k}": v for k, v in cfg.policy.model_dump().items()},
                **{f"pretrain.{k}": v for k, v in cfg.pretrain.model_dump().items()},
            }
        )
        corpus = load_corpus(cfg.heldout_fraction)
        tokenizer = train_base_tokenizer(corpus.train, cfg.vocab_size)
        policy, result = pretrain_policy(tokenizer, corpus, cfg)
        mlflow.log_metrics({f"pretrain/{k}": float(v) for k, v in result.model_dump().items()})
        probe = compute_version_probe(policy, tokenizer, corpus.heldout, cfg)
        info = publish_base_version(registry, store, model, policy, tokenizer, probe, result, cfg, run.info.run_id)

    create_markdown_artifact(
        key=f"{model}-bootstrap",
        description="Base policy",
        markdown=(
            f"# {model}: base policy v{info.version}\n\n| figure | value |\n|---|---|\n"
            f"| train / held-out files | {corpus.train_files} / {corpus.heldout_files} |\n"
            f"| steps | {result.steps} |\n| tokens | {result.tokens_seen} |\n| tokens/s | {result.tokens_per_s:.0f} |\n"
            f"| held-out bits/byte | {result.heldout_bits_per_byte:.3f} (over {result.heldout_bytes} bytes) |\n"
            f"| checkpoint | `{info.source}` |\n"
        ),
    )
    print(f"{model} v{info.version} registered as champion: held-out {result.heldout_bits_per_byte:.3f} bits/byte")
    return info.version
