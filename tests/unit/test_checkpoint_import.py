"""`tidal import`'s checks of a team's checkpoint, on a Llama checkpoint built here (tests/llama_checkpoint.py):
what it reads, and each refusal with what it names."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from serving.engine import supported_architectures
from serving.settings import EngineSettings
from tasks.import_checkpoint import refuse_non_finite, refuse_unservable
from tests.llama_checkpoint import build_llama_checkpoint
from training.hf_checkpoint import CheckpointRefused, inspect_checkpoint

SERVED = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"})


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return build_llama_checkpoint(tmp_path_factory.mktemp("llama") / "ckpt")


@pytest.fixture()
def copy(llama, tmp_path) -> Path:
    return Path(shutil.copytree(llama, tmp_path / "ckpt"))


def test_a_llama_checkpoint_without_a_pad_token_is_read_with_eos_as_padding(llama):
    facts = inspect_checkpoint(llama)
    weights = load_file(str(llama / "model.safetensors"))
    assert facts.architecture == "LlamaForCausalLM" and facts.model_type == "llama"
    assert facts.context == 1024 and facts.vocab_size == facts.tokenizer_size
    assert not facts.has_pad_token and facts.pad_token_id == facts.eos_token_id == 2  # "</s>", the third special token
    assert facts.chat_template and facts.dtype == "float32"
    assert facts.weight_files == ["model.safetensors"]
    assert facts.parameters == sum(t.numel() for t in weights.values())
    refuse_unservable(llama, facts, SERVED, max_model_len=512)
    refuse_non_finite(llama, facts)


def test_a_missing_tokenizer_is_refused_by_name(copy):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (copy / name).unlink()
    with pytest.raises(CheckpointRefused, match="no tokenizer .*tokenizer.json"):
        inspect_checkpoint(copy)


def test_a_directory_without_config_or_safetensors_is_refused(copy, tmp_path):
    with pytest.raises(CheckpointRefused, match="no such directory"):
        inspect_checkpoint(tmp_path / "nowhere")
    weights = load_file(str(copy / "model.safetensors"))
    (copy / "model.safetensors").unlink()
    torch.save(weights, copy / "pytorch_model.bin")
    with pytest.raises(
        CheckpointRefused, match=r"no \*.safetensors weights \(found pytorch_model.bin: re-save .*safe_serialization"
    ):
        inspect_checkpoint(copy)
    (copy / "config.json").unlink()
    with pytest.raises(CheckpointRefused, match="no config.json"):
        inspect_checkpoint(copy)


def test_a_config_without_an_architecture_or_a_loadable_type_is_refused(copy):
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "model_type": "no-such-family"}))
    with pytest.raises(CheckpointRefused, match="config.json does not load"):
        inspect_checkpoint(copy)
    (copy / "config.json").write_text(json.dumps({**config, "architectures": []}))
    with pytest.raises(CheckpointRefused, match="names no architecture"):
        inspect_checkpoint(copy)


def test_a_tokenizer_larger_than_the_embedding_is_refused(copy):
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))
    with pytest.raises(CheckpointRefused, match=r"the tokenizer has \d+ tokens but the embedding only 100 rows"):
        inspect_checkpoint(copy)


def test_a_checkpoint_without_an_eos_token_is_refused(copy):
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "eos_token_id": None}))
    tok = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in tok.items() if k != "eos_token"}))
    with pytest.raises(CheckpointRefused, match="end-of-sequence token"):
        inspect_checkpoint(copy)


def test_an_architecture_the_engine_lacks_and_a_short_context_are_refused(llama):
    facts = inspect_checkpoint(llama)
    odd = facts.model_copy(update={"architecture": "LlamaForSomethingElse"})
    with pytest.raises(CheckpointRefused, match="cannot serve architecture LlamaForSomethingElse .*e.g. LlamaForCausalLM"):
        refuse_unservable(llama, odd, SERVED, max_model_len=512)
    with pytest.raises(CheckpointRefused, match=r"context is 1024 tokens .*set engine.max_model_len .*at most 1024"):
        refuse_unservable(llama, facts, SERVED, max_model_len=2048)


def test_nan_weights_are_refused_naming_the_tensor(copy):
    weights = load_file(str(copy / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    weights[name][3, 5] = float("nan")
    save_file(weights, str(copy / "model.safetensors"), metadata={"format": "pt"})
    facts = inspect_checkpoint(copy)  # the config and tokenizer are fine: the weights are what is wrong
    with pytest.raises(CheckpointRefused, match=f"tensor {name} in model.safetensors holds NaN or inf"):
        refuse_non_finite(copy, facts)


def test_the_engine_environment_lists_the_architectures_it_serves():
    archs = supported_architectures(EngineSettings())
    assert {"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"} <= archs
    assert "LlamaForSomethingElse" not in archs


def test_an_s3_prefix_is_fetched_whole_with_the_stores_endpoint(s3_endpoint, llama, tmp_path, monkeypatch):
    from tasks.import_checkpoint import fetch_checkpoint
    from tests.conftest import make_bucket
    from tidal.registry import checkpoint_files
    from tidal.settings import load_settings
    from tidal.store import S3Store, upload_dir

    for name in [n for n in os.environ if n.startswith("TIDAL_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    make_bucket(s3_endpoint, "acme-models")
    upload_dir(S3Store("acme-models", "", s3_endpoint, "us-east-1"), llama, "llama/v1")
    settings = load_settings(data_dir=str(tmp_path / ".tidal"), store={"s3_endpoint_url": s3_endpoint})
    got = fetch_checkpoint.fn("s3://acme-models/llama/v1/", settings, tmp_path / "scratch")
    assert checkpoint_files(got) == checkpoint_files(llama) and inspect_checkpoint(got).architecture == "LlamaForCausalLM"
    with pytest.raises(CheckpointRefused, match="cannot import s3://acme-models/llama/v2: no objects under it"):
        fetch_checkpoint.fn("s3://acme-models/llama/v2", settings, tmp_path / "scratch2")
    with pytest.raises(CheckpointRefused, match="expected s3://bucket/prefix"):
        fetch_checkpoint.fn("s3://acme-models", settings, tmp_path / "scratch3")
