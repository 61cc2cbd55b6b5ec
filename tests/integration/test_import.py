"""`tidal import` on the real platform: a team's Llama checkpoint (built here, tests/llama_checkpoint.py) named
in a model's settings becomes its champion when `tidal up` finds none: checked, probed on the real engine at its
serving dtype, uploaded with its probe and registered with lineage. A checkpoint with NaN weights is refused by
the same flow before any engine or registry sees it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file, save_file

from data_contracts.probe import PROBE_FILE, load_probe
from tests.llama_checkpoint import build_llama_checkpoint
from tidal import lineage
from tidal.registry import CheckpointCache, checkpoint_digest, checkpoint_files
from tidal.settings import load_settings
from tidal.store import open_store
from training.hf_checkpoint import CheckpointRefused

pytestmark = pytest.mark.slow


@pytest.fixture()
def byo_settings(settings, champion, tmp_path, monkeypatch):
    """The session's settings plus model `byo`, which names a checkpoint and serves none of it yet (0 replicas)."""
    ckpt = build_llama_checkpoint(tmp_path / "llama")
    config = yaml.safe_load(Path(os.environ["TIDAL_CONFIG"]).read_text())
    config["models"].append({"name": "byo", "replicas": 0, "update_strategy": "restart", "checkpoint": str(ckpt)})
    path = tmp_path / "tidal.yaml"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.setenv("TIDAL_CONFIG", str(path))
    return load_settings()


def test_up_imports_a_named_checkpoint_as_champion_and_refuses_nan_weights(byo_settings, registry, tmp_path):
    from flows.import_checkpoint import import_checkpoint
    from tidal.cli import ensure_champions

    source = Path(byo_settings.model("byo").checkpoint)
    ensure_champions(byo_settings)  # what `tidal up` does before it starts the fleet

    info = registry.by_alias("byo", "champion")
    assert info is not None and info.version == 1 and info.kind == "full" and info.parent_version is None
    assert info.tags[lineage.ORIGIN] == "import" and info.tags[lineage.SOURCE] == str(source)
    assert info.tags[lineage.ARCHITECTURE] == "LlamaForCausalLM" and info.tags[lineage.PROBE_DTYPE] == "float32"
    assert info.tags[lineage.SOURCE_DIGEST] == checkpoint_digest(checkpoint_files(source))
    assert int(info.tags[lineage.PARAMS]) == sum(t.numel() for t in load_file(str(source / "model.safetensors")).values())

    # The registered files are the source's, byte for byte, plus the probe the engine recorded for them.
    local = CheckpointCache(open_store(byo_settings), tmp_path / "cache").local_dir(info)  # checks the digest
    files = checkpoint_files(local)
    assert {k: v for k, v in files.items() if k != PROBE_FILE} == checkpoint_files(source)
    probe = load_probe(local)
    assert len(probe.items) == byo_settings.bootstrap.probe_prompts
    assert all(len(i.completion_token_ids) == byo_settings.bootstrap.probe_tokens for i in probe.items)
    assert all(max(i.prompt_token_ids) < 238 for i in probe.items)  # the Llama tokenizer's ids, not Tidal's

    ensure_champions(byo_settings)  # a champion exists now: nothing is imported again
    assert registry.versions("byo") == [1]

    weights = load_file(str(source / "model.safetensors"))
    weights["model.embed_tokens.weight"][7, 0] = float("inf")
    save_file(weights, str(source / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointRefused, match="tensor model.embed_tokens.weight in model.safetensors holds NaN or inf"):
        import_checkpoint(model="byo", source=str(source))
    assert registry.versions("byo") == [1]
