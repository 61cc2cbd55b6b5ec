"""Checkpoint digests: what is published is what every loader (fleet, trainer) gets, or a clear refusal."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import make_bucket
from tidal.registry import (
    DIGEST_TAG,
    CheckpointCache,
    CheckpointCorrupt,
    VersionInfo,
    checkpoint_digest,
    checkpoint_files,
    checkpoint_key,
)
from tidal.store import LocalStore, S3Store, upload_dir

BUCKET = "tidal-digest-tests"


def checkpoint(path: Path) -> Path:
    (path / "sub").mkdir(parents=True)
    (path / "config.json").write_text('{"hidden_size": 64}')
    (path / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (path / "probe.json").write_text('{"prompts": []}')
    (path / "sub" / "tokenizer.json").write_text("{}")
    return path


def published(store, src: Path, version: int = 2) -> VersionInfo:
    """What `publish` does, minus MLflow: upload, and the digest as the version's tag."""
    upload_dir(store, src, checkpoint_key("tab", version))
    digest = checkpoint_digest(checkpoint_files(src))
    return VersionInfo("tab", version, "full", version, "", {DIGEST_TAG: digest})


def test_digest_covers_every_file_name_and_byte_but_not_cache_markers(tmp_path) -> None:
    src = checkpoint(tmp_path / "ckpt")
    digest = checkpoint_digest(checkpoint_files(src))
    assert digest.startswith("sha256:") and len(digest) == 7 + 64
    (src / ".complete").touch()  # a download cache's marker
    assert checkpoint_digest(checkpoint_files(src)) == digest
    (src / "sub" / "tokenizer.json").rename(src / "sub" / "tokenizer2.json")
    assert checkpoint_digest(checkpoint_files(src)) != digest


@pytest.mark.parametrize("damage", ["truncate", "flip_byte", "extra_file", "missing_file"])
def test_local_store_checkpoint_that_changed_is_refused(tmp_path, damage) -> None:
    store = LocalStore(tmp_path / "store")
    info = published(store, checkpoint(tmp_path / "ckpt"))
    cache = CheckpointCache(store, tmp_path / "cache")
    assert cache.local_dir(info) == store.root / info.key  # intact: handed out
    weights = store.root / info.key / "model.safetensors"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "flip_byte":
        data = bytearray(weights.read_bytes())
        data[77] ^= 0xFF
        weights.write_bytes(bytes(data))
    elif damage == "extra_file":
        (store.root / info.key / "adapter_model.bin").write_bytes(b"x")
    else:
        (store.root / info.key / "sub" / "tokenizer.json").unlink()
    with pytest.raises(CheckpointCorrupt, match=r"tab@v2 .* does not match the digest registered with it .* publish"):
        cache.local_dir(info)


def test_version_without_a_digest_is_loaded_unchecked(tmp_path) -> None:
    store = LocalStore(tmp_path / "store")
    info = published(store, checkpoint(tmp_path / "ckpt"))
    legacy = VersionInfo("tab", 2, "full", 2, "", {})  # registered before digests were recorded
    (store.root / info.key / "model.safetensors").write_bytes(b"changed")
    assert CheckpointCache(store, tmp_path / "cache").local_dir(legacy).is_dir()


def test_s3_download_is_checked_against_the_digest(s3_endpoint, tmp_path) -> None:
    make_bucket(s3_endpoint, BUCKET)
    store = S3Store(BUCKET, "digest", s3_endpoint, "us-east-1")
    src = checkpoint(tmp_path / "ckpt")
    info = published(store, src, version=3)
    good = CheckpointCache(store, tmp_path / "cache-a").local_dir(info)
    assert checkpoint_files(good) == checkpoint_files(src)
    # the store's copy is overwritten with a truncated file (a bad upload, a tampered bucket)
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    (bad / "model.safetensors").write_bytes(b"\0" * 10)
    upload_dir(store, bad, info.key)
    with pytest.raises(CheckpointCorrupt, match="tab@v3"):
        CheckpointCache(store, tmp_path / "cache-b").local_dir(info)


def test_s3_download_is_hashed_once_then_trusted_by_its_marker(s3_endpoint, tmp_path, monkeypatch) -> None:
    import tidal.registry as registry_module

    make_bucket(s3_endpoint, BUCKET)
    store = S3Store(BUCKET, "digest-once", s3_endpoint, "us-east-1")
    info = published(store, checkpoint(tmp_path / "ckpt"), version=4)
    cache = CheckpointCache(store, tmp_path / "cache")
    hashed = []
    real = registry_module.verify_checkpoint
    monkeypatch.setattr(registry_module, "verify_checkpoint", lambda i, p: (hashed.append(p), real(i, p)))
    first, second = cache.local_dir(info), cache.local_dir(info)
    assert first == second and len(hashed) == 1 and (first / ".verified").read_text() == info.tags[DIGEST_TAG]
    assert checkpoint_files(first) == checkpoint_files(tmp_path / "ckpt")  # the marker is not part of the digest
