"""Import flow: register a team's own Hugging Face checkpoint as a model's next version (`tidal import`)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import mlflow
from prefect import flow
from prefect.artifacts import create_markdown_artifact

from tasks.import_checkpoint import check_checkpoint, fetch_checkpoint, probe_on_engine, publish_imported
from tidal.registry import Registry
from tidal.settings import load_settings


@flow(name="import", log_prints=True)
def import_checkpoint(model: str, source: str, champion: bool = False) -> int:
    settings = load_settings()
    settings.model(model)  # unknown model → clear error
    registry = Registry(settings.mlflow.tracking_uri)
    mlflow.set_tracking_uri(settings.mlflow.tracking_uri)
    mlflow.set_experiment(f"{model}/import")
    with tempfile.TemporaryDirectory() as scratch, mlflow.start_run(run_name="import") as run:
        path = fetch_checkpoint(source, settings, Path(scratch))
        facts = check_checkpoint(path, settings)
        mlflow.log_params({"source": source, "engine.dtype": settings.engine.dtype, **facts.model_dump(exclude={"weight_files"})})
        probe = probe_on_engine(path, model, settings)
        info = publish_imported(registry, model, source, path, facts, probe, settings, champion, run.info.run_id)

    create_markdown_artifact(
        key=f"{model}-import-v{info.version}",
        description="Imported checkpoint",
        markdown=(
            f"# {model}: v{info.version} imported\n\n| fact | value |\n|---|---|\n"
            f"| source | `{source}` |\n| architecture | {facts.architecture} |\n| parameters | {facts.parameters:,} |\n"
            f"| context | {facts.context} |\n| tokenizer | {facts.tokenizer_size} tokens, pad "
            f"{'its own' if facts.has_pad_token else 'EOS (none of its own)'}, chat template "
            f"{'yes' if facts.chat_template else 'no'} |\n| probe | {len(probe.items)} prompts at {settings.engine.dtype} |\n"
            f"| champion | {'yes' if champion else 'no'} |\n| checkpoint | `{info.source}` |\n"
        ),
    )
    print(f"{model} v{info.version} imported from {source}" + (" and made champion" if champion else ""))
    return info.version
