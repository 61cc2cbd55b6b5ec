"""What a Hugging Face checkpoint directory holds, read before Tidal registers it as a model's version.

`inspect_checkpoint` loads the config and the tokenizer the way the trainer and the engine will
(`AutoConfig` / `AutoTokenizer`, no remote code), lists the weight files, and returns the facts the import
checks against the engine (`tasks/import_checkpoint.py`): architecture, context length, vocabulary, special
tokens, chat template. Anything the loop could not use is refused here with what is wrong and what to do.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from pydantic import BaseModel, Field
from transformers import AutoConfig, AutoTokenizer

# Where configs of the common families keep their context length, most specific first.
_CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


class CheckpointRefused(ValueError):
    """The checkpoint cannot be registered as it is; the message says what is wrong and what is expected."""


class CheckpointFacts(BaseModel):
    """A checkpoint's facts, as the import reads them (and records the main ones as lineage tags)."""

    architecture: str = Field(description="config.architectures[0], the class vLLM and transformers build.")
    model_type: str = Field(description="config.model_type (llama, qwen2, mistral, ...).")
    context: int | None = Field(description="Longest sequence its position embeddings cover; None if the config says not.")
    vocab_size: int = Field(description="Rows of the embedding (config.vocab_size).")
    tokenizer_size: int = Field(description="len(tokenizer): every id the tokenizer can produce is below it.")
    eos_token_id: int = Field(description="The token that ends a completion.")
    pad_token_id: int = Field(description="The id batches are padded with: the pad token, else EOS (masked out anyway).")
    has_pad_token: bool = Field(description="Whether the tokenizer defines a pad token of its own.")
    chat_template: bool = Field(description="Whether the tokenizer carries a chat template (/v1/chat/completions).")
    dtype: str = Field(description="The dtype the weights were saved in (config.torch_dtype), '' if unstated.")
    weight_files: list[str] = Field(description="The *.safetensors files, relative to the checkpoint directory.")
    parameters: int = Field(description="Values in those files (every tensor's element count), from their headers.")


def _refuse(path: Path, what: str) -> CheckpointRefused:
    return CheckpointRefused(f"cannot import {path}: {what}")


def _parameters(path: Path, files: list[str]) -> int:
    """Element count of every tensor, read from the safetensors headers (8-byte length, then JSON) alone."""
    total = 0
    for name in files:
        with (path / name).open("rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise _refuse(path, f"{name} is not a safetensors file (shorter than its header)")
            try:
                header = json.loads(f.read(struct.unpack("<Q", head)[0]))
            except (UnicodeDecodeError, json.JSONDecodeError, MemoryError, OverflowError) as e:
                raise _refuse(path, f"{name} is not a safetensors file (its header is not JSON)") from e
        total += sum(math.prod(meta["shape"]) for key, meta in header.items() if key != "__metadata__")
    return total


def _eos(tokenizer, config) -> int | None:
    for value in (tokenizer.eos_token_id, getattr(config, "eos_token_id", None)):
        if isinstance(value, list):  # some configs list several EOS ids; the first is the tokenizer's own
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return None


def inspect_checkpoint(path: str | Path) -> CheckpointFacts:
    """The facts of the Hugging Face checkpoint at ``path``, or CheckpointRefused naming what is missing."""
    path = Path(path)
    if not path.is_dir():
        raise _refuse(path, "no such directory (expected a save_pretrained directory, or an s3:// prefix holding one)")
    if not (path / "config.json").is_file():
        raise _refuse(path, "no config.json (expected the directory save_pretrained writes: config, weights, tokenizer)")
    try:
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    except Exception as e:  # transformers raises ValueError/KeyError/OSError for unknown or broken configs
        raise _refuse(path, f"config.json does not load ({type(e).__name__}: {str(e)[:300]})") from e
    architectures = getattr(config, "architectures", None) or []
    if not architectures:
        raise _refuse(path, 'config.json names no architecture (expected e.g. "architectures": ["LlamaForCausalLM"])')
    weights = sorted(p.relative_to(path).as_posix() for p in path.rglob("*.safetensors"))
    if not weights:
        pickled = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = f" (found {', '.join(pickled)}: re-save with save_pretrained(..., safe_serialization=True))" if pickled else ""
        raise _refuse(path, f"no *.safetensors weights{hint}; the import checks every tensor is finite before serving it")
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        raise _refuse(
            path, f"no tokenizer (expected one of {', '.join(_TOKENIZER_FILES)} beside the weights: tokenizer.save_pretrained)"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except Exception as e:
        raise _refuse(path, f"the tokenizer does not load ({type(e).__name__}: {str(e)[:300]})") from e
    eos = _eos(tokenizer, config)
    if eos is None:
        raise _refuse(path, "neither the tokenizer nor config.json names an end-of-sequence token: a completion could never end")
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if len(tokenizer) > vocab:
        raise _refuse(
            path,
            f"the tokenizer has {len(tokenizer)} tokens but the embedding only {vocab} rows (config.vocab_size): "
            "ids past the embedding would crash serving; resize the embeddings or use the tokenizer the model was trained with",
        )
    context = next((int(v) for f in _CONTEXT_FIELDS if (v := getattr(config, f, None))), None)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return CheckpointFacts(
        architecture=architectures[0],
        model_type=str(config.model_type),
        context=context,
        vocab_size=vocab,
        tokenizer_size=len(tokenizer),
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos,
        has_pad_token=tokenizer.pad_token_id is not None,
        chat_template=bool(getattr(tokenizer, "chat_template", None)),
        dtype=str(dtype).removeprefix("torch.") if dtype else "",
        weight_files=weights,
        parameters=_parameters(path, weights),
    )


def encode_prompts(path: str | Path, prompts: list[str]) -> list[list[int]]:
    """The prompts as the checkpoint's own tokenizer encodes them (no special tokens, as the probe replays them)."""
    tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    return [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
