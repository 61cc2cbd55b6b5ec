"""`tidal import` on the real platform: the session's model `byo` names a team's Llama checkpoint (built by the
settings fixture, tests/llama_checkpoint.py), and `tidal up`'s step that gives every model a champion imported it:
checked, probed on the real engine at its serving dtype, uploaded with its probe and registered with lineage. A
checkpoint with an inf weight is refused by the same flow before any engine or registry sees it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from data_contracts.probe import PROBE_FILE, load_probe
from tidal import lineage
from tidal.registry import checkpoint_digest, checkpoint_files
from training.hf_checkpoint import CheckpointRefused

pytestmark = pytest.mark.slow


def test_up_imported_the_named_checkpoint_as_champion(settings, registry, champion, checkpoints):
    from tidal.cli import ensure_champions

    source = Path(settings.model("byo").checkpoint)
    info = registry.by_alias("byo", "champion")
    assert info is not None and info.version == 1 and info.kind == "full" and info.parent_version is None
    assert info.tags[lineage.ORIGIN] == "import" and info.tags[lineage.SOURCE] == str(source)
    assert info.tags[lineage.ARCHITECTURE] == "LlamaForCausalLM" and info.tags[lineage.PROBE_DTYPE] == "float32"
    assert info.tags[lineage.SOURCE_DIGEST] == checkpoint_digest(checkpoint_files(source))
    assert int(info.tags[lineage.PARAMS]) == sum(t.numel() for t in load_file(str(source / "model.safetensors")).values())

    # The registered files are the source's, byte for byte, plus the probe the engine recorded for them.
    local = checkpoints.local_dir(info)  # checks the registered digest
    assert {k: v for k, v in checkpoint_files(local).items() if k != PROBE_FILE} == checkpoint_files(source)
    probe = load_probe(local)
    assert len(probe.items) == settings.bootstrap.probe_prompts
    assert all(len(i.completion_token_ids) == settings.bootstrap.probe_tokens for i in probe.items)
    assert all(max(i.prompt_token_ids) < 238 for i in probe.items)  # the Llama tokenizer's ids, not Tidal's

    ensure_champions(settings)  # a champion exists now: nothing is imported again
    assert registry.versions("byo")[0] == 1 and registry.by_alias("byo", "champion").version == 1


def test_a_checkpoint_with_an_inf_weight_is_refused_before_anything_is_registered(settings, registry, champion, tmp_path):
    from flows.import_checkpoint import import_checkpoint

    source = Path(shutil.copytree(settings.model("byo").checkpoint, tmp_path / "broken"))
    weights = load_file(str(source / "model.safetensors"))
    weights["model.embed_tokens.weight"][7, 0] = float("inf")
    save_file(weights, str(source / "model.safetensors"), metadata={"format": "pt"})
    before = registry.versions("byo")
    with pytest.raises(CheckpointRefused, match="tensor model.embed_tokens.weight in model.safetensors holds NaN or inf"):
        import_checkpoint(model="byo", source=str(source))
    assert registry.versions("byo") == before
