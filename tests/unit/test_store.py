"""Object store: the local directory store, S3 (against a moto server), and the directory helpers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import make_bucket
from tidal.registry import checkpoint_key, registry_source
from tidal.settings import load_settings
from tidal.store import LocalStore, S3Store, download_dir, open_store, upload_dir

BUCKET = "tidal-test"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in list(os.environ):
        if name.startswith("TIDAL_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


def make_file(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def make_tree(root: Path) -> dict[str, str]:
    files = {"config.json": '{"a": 1}', "weights/model.safetensors": "w" * 100, "weights/extra/probe.json": "[]"}
    for rel, text in files.items():
        make_file(root / rel, text)
    return files


# ---- shared behaviour, run on both stores ---------------------------------------------------------


def check_round_trip(store, tmp_path: Path) -> None:
    src = make_file(tmp_path / "src" / "a.txt", "hello")
    store.put_file(src, "dir/sub/a.txt")
    assert store.exists("dir/sub/a.txt")
    out = tmp_path / "out" / "deep" / "a.txt"
    store.get_file("dir/sub/a.txt", out)
    assert out.read_text() == "hello"


def check_overwrite(store, tmp_path: Path) -> None:
    store.put_file(make_file(tmp_path / "v1", "one"), "k/obj")
    store.put_file(make_file(tmp_path / "v2", "two"), "k/obj")
    store.get_file("k/obj", tmp_path / "got")
    assert (tmp_path / "got").read_text() == "two"
    assert store.list("k/") == ["k/obj"]


def check_list(store, tmp_path: Path) -> None:
    for key in ["m/a/1", "m/a/2", "m/b/3", "other/4"]:
        store.put_file(make_file(tmp_path / "f", key), key)
    assert store.list("m/") == ["m/a/1", "m/a/2", "m/b/3"]
    assert store.list("m/a/") == ["m/a/1", "m/a/2"]
    assert store.list("missing/") == []
    assert store.list("") == ["m/a/1", "m/a/2", "m/b/3", "other/4"]


def check_dir_round_trip(store, tmp_path: Path) -> None:
    files = make_tree(tmp_path / "ckpt")
    key = checkpoint_key("tab", 3)
    keys = upload_dir(store, tmp_path / "ckpt", key)
    assert sorted(keys) == sorted(f"{key}/{rel}" for rel in files)
    assert store.list(key + "/") == sorted(keys)
    local = download_dir(store, key, tmp_path / "cache")
    assert local == tmp_path / "cache"
    for rel, text in files.items():
        assert (local / rel).read_text() == text
    assert (local / ".complete").exists()


# ---- LocalStore ---------------------------------------------------------------------------------


def test_local_round_trip(tmp_path: Path) -> None:
    check_round_trip(LocalStore(tmp_path / "store"), tmp_path)


def test_local_overwrite(tmp_path: Path) -> None:
    check_overwrite(LocalStore(tmp_path / "store"), tmp_path)


def test_local_list_and_missing_prefix(tmp_path: Path) -> None:
    check_list(LocalStore(tmp_path / "store"), tmp_path)


def test_local_list_of_empty_store_is_empty(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    assert store.list("") == []
    assert store.list("checkpoints/") == []


def test_local_exists_and_missing_get(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    assert not store.exists("nope/x")
    with pytest.raises(FileNotFoundError, match="nope/x"):
        store.get_file("nope/x", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_local_put_leaves_no_temporary_file(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    store.put_file(make_file(tmp_path / "f", "x"), "a/b")
    assert sorted(p.name for p in (tmp_path / "store" / "a").iterdir()) == ["b"]


@pytest.mark.parametrize("key", ["../outside", "a/../../outside", "/etc/passwd"])
def test_local_key_escaping_root_raises(tmp_path: Path, key: str) -> None:
    store = LocalStore(tmp_path / "store")
    src = make_file(tmp_path / "f", "x")
    with pytest.raises(ValueError, match="escapes the store root"):
        store.put_file(src, key)
    with pytest.raises(ValueError, match="escapes the store root"):
        store.exists(key)
    with pytest.raises(ValueError, match="escapes the store root"):
        store.get_file(key, tmp_path / "out")
    assert not (tmp_path / "outside").exists()


def test_local_uri_is_file_uri_of_object(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    assert store.url == (tmp_path / "store").as_uri()
    assert store.uri("a/b") == (tmp_path / "store" / "a" / "b").resolve().as_uri()


def test_upload_and_download_dir_round_trip(tmp_path: Path) -> None:
    check_dir_round_trip(LocalStore(tmp_path / "store"), tmp_path)


def test_download_dir_reuses_a_completed_cache(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    make_tree(tmp_path / "ckpt")
    upload_dir(store, tmp_path / "ckpt", "checkpoints/model=tab/version=1")
    cache = download_dir(store, "checkpoints/model=tab/version=1", tmp_path / "cache")
    # Change the object in the store: a completed cache must not be fetched again.
    store.put_file(make_file(tmp_path / "new", "changed"), "checkpoints/model=tab/version=1/config.json")
    (cache / "weights" / "model.safetensors").unlink()
    again = download_dir(store, "checkpoints/model=tab/version=1", tmp_path / "cache")
    assert again == cache
    assert (cache / "config.json").read_text() == '{"a": 1}'
    assert not (cache / "weights" / "model.safetensors").exists()


def test_download_dir_redoes_an_incomplete_cache(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    make_tree(tmp_path / "ckpt")
    upload_dir(store, tmp_path / "ckpt", "p")
    make_file(tmp_path / "cache" / "config.json", "partial")  # no .complete marker
    download_dir(store, "p", tmp_path / "cache")
    assert (tmp_path / "cache" / "config.json").read_text() == '{"a": 1}'


def test_download_dir_of_missing_prefix_raises(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    with pytest.raises(FileNotFoundError, match="no objects under"):
        download_dir(store, "checkpoints/model=tab/version=9", tmp_path / "cache")
    assert not (tmp_path / "cache" / ".complete").exists()


def test_download_dir_does_not_mix_sibling_prefixes(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    store.put_file(make_file(tmp_path / "a", "1"), "checkpoints/model=tab/version=1/a")
    store.put_file(make_file(tmp_path / "b", "10"), "checkpoints/model=tab/version=10/b")
    local = download_dir(store, "checkpoints/model=tab/version=1", tmp_path / "cache")
    assert sorted(p.name for p in local.iterdir()) == [".complete", "a"]


# ---- open_store -----------------------------------------------------------------------------------


def test_open_store_default_is_local_under_data_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TIDAL_DATA_DIR", str(tmp_path / "state"))
    store = open_store(load_settings())
    assert isinstance(store, LocalStore)
    assert store.root == tmp_path / "state" / "store"
    assert store.root.is_dir()


def test_open_store_handles_data_dir_with_space(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TIDAL_DATA_DIR", str(tmp_path / "my state"))
    store = open_store(load_settings())
    assert store.root == tmp_path / "my state" / "store"


def test_open_store_rejects_unknown_scheme(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDAL_STORE__URL", "ftp://x")
    with pytest.raises(ValueError) as exc:
        open_store(load_settings())
    msg = str(exc.value)
    assert "ftp://x" in msg and "store.url" in msg and "s3://bucket/prefix" in msg


def test_open_store_rejects_s3_without_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDAL_STORE__URL", "s3://")
    with pytest.raises(ValueError) as exc:
        open_store(load_settings())
    msg = str(exc.value)
    assert "names no bucket" in msg and "s3://bucket/prefix" in msg


def test_registry_source_for_local_store(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    key = checkpoint_key("tab", 2)
    assert key == "checkpoints/model=tab/version=2"
    assert registry_source(store, key) == "tidal://store/checkpoints/model=tab/version=2"


# ---- S3Store against moto -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_bucket(s3_endpoint: str) -> str:
    make_bucket(s3_endpoint, BUCKET)
    return s3_endpoint


@pytest.fixture
def s3_store(s3_bucket: str, request: pytest.FixtureRequest) -> S3Store:
    # A prefix per test keeps the tests independent on the shared bucket.
    return S3Store(BUCKET, f"/runs/{request.node.name.replace('[', '-').rstrip(']')}/", s3_bucket, "us-east-1")


def test_s3_round_trip(s3_store: S3Store, tmp_path: Path) -> None:
    check_round_trip(s3_store, tmp_path)


def test_s3_object_lands_under_the_prefix(s3_store: S3Store, tmp_path: Path) -> None:
    s3_store.put_file(make_file(tmp_path / "f", "x"), "a/b")
    listed = s3_store.client.list_objects_v2(Bucket=BUCKET, Prefix=s3_store.prefix + "/")
    assert [o["Key"] for o in listed["Contents"]] == [f"{s3_store.prefix}/a/b"]
    assert not s3_store.prefix.startswith("/") and not s3_store.prefix.endswith("/")


def test_s3_overwrite(s3_store: S3Store, tmp_path: Path) -> None:
    check_overwrite(s3_store, tmp_path)


def test_s3_list_and_missing_prefix(s3_store: S3Store, tmp_path: Path) -> None:
    check_list(s3_store, tmp_path)


def test_s3_exists_false_for_missing_key(s3_store: S3Store) -> None:
    assert s3_store.exists("no/such/key") is False


def test_s3_upload_and_download_dir_round_trip(s3_store: S3Store, tmp_path: Path) -> None:
    check_dir_round_trip(s3_store, tmp_path)


def test_s3_uri_and_url(s3_store: S3Store) -> None:
    assert s3_store.uri("checkpoints/x") == f"s3://{BUCKET}/{s3_store.prefix}/checkpoints/x"
    assert s3_store.url == f"s3://{BUCKET}/{s3_store.prefix}"


def test_s3_without_prefix(s3_bucket: str, tmp_path: Path) -> None:
    store = S3Store(BUCKET, "", s3_bucket, "us-east-1")
    assert store.url == f"s3://{BUCKET}"
    assert store.uri("noprefix/k") == f"s3://{BUCKET}/noprefix/k"
    store.put_file(make_file(tmp_path / "f", "x"), "noprefix/k")
    assert store.list("noprefix/") == ["noprefix/k"]


def test_registry_source_for_s3_store(s3_store: S3Store) -> None:
    key = checkpoint_key("tab", 4)
    assert registry_source(s3_store, key) == f"s3://{BUCKET}/{s3_store.prefix}/checkpoints/model=tab/version=4"


def test_open_store_builds_s3_store_from_settings(monkeypatch: pytest.MonkeyPatch, s3_bucket: str, tmp_path: Path) -> None:
    s3_endpoint = s3_bucket
    monkeypatch.setenv("TIDAL_STORE__URL", f"s3://{BUCKET}/from-settings")
    monkeypatch.setenv("TIDAL_STORE__S3_ENDPOINT_URL", s3_endpoint)
    store = open_store(load_settings())
    assert isinstance(store, S3Store)
    assert (store.bucket, store.prefix, store.url) == (BUCKET, "from-settings", f"s3://{BUCKET}/from-settings")
    store.put_file(make_file(tmp_path / "f", "x"), "k")
    assert store.exists("k")


def test_json_objects_round_trip(tmp_path) -> None:
    from tidal.store import LocalStore, get_json, put_json

    store = LocalStore(tmp_path / "s")
    put_json(store, "training/run/result.json", {"iterations": 3, "final": {"ppo/approx_kl": 0.01}})
    assert get_json(store, "training/run/result.json") == {"iterations": 3, "final": {"ppo/approx_kl": 0.01}}


def test_routed_store_keeps_each_area_in_its_own_store(tmp_path) -> None:
    from tidal.store import RoutedStore

    default, logs, ckpt = (LocalStore(tmp_path / n) for n in ("default", "logs", "ckpt"))
    store = RoutedStore(default, {"logs": logs, "checkpoints": ckpt})
    for key in (
        "logs/completions/model=tab/a.parquet",
        "checkpoints/model=tab/version=1/probe.json",
        "datasets/model=tab/ds-1/manifest.json",
        "state/watermarks/tab.json",
    ):
        store.put_file(make_file(tmp_path / "src" / key, key), key)
    assert logs.list("") == ["logs/completions/model=tab/a.parquet"]  # same keys, area prefix kept
    assert ckpt.list("") == ["checkpoints/model=tab/version=1/probe.json"]
    assert default.list("") == ["datasets/model=tab/ds-1/manifest.json", "state/watermarks/tab.json"]
    assert store.list("logs/") == logs.list("logs/") and store.list("datasets/") == default.list("datasets/")
    assert store.list("") == sorted(logs.list("") + ckpt.list("") + default.list(""))
    assert store.exists("checkpoints/model=tab/version=1/probe.json") and not store.exists("logs/nope")
    store.get_file("logs/completions/model=tab/a.parquet", tmp_path / "back")
    assert (tmp_path / "back").read_text() == "logs/completions/model=tab/a.parquet"
    assert store.uri("checkpoints/x") == ckpt.uri("checkpoints/x")


def test_store_routes_come_from_settings_and_unknown_areas_are_refused(monkeypatch, tmp_path) -> None:
    from tidal.store import RoutedStore

    monkeypatch.setenv("TIDAL_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("TIDAL_STORE__ROUTES", f'{{"logs": "{(tmp_path / "logs").as_uri()}", "checkpoints": "{tmp_path / "c"}"}}')
    store = open_store(load_settings())
    assert isinstance(store, RoutedStore) and set(store.routes) == {"logs", "checkpoints"}
    assert store.routes["checkpoints"].url == (tmp_path / "c").as_uri()  # a plain directory is a local store
    monkeypatch.setenv("TIDAL_STORE__ROUTES", '{"logz": "s3://b"}')
    with pytest.raises(Exception, match=r"unknown areas \['logz'\].*expected some of"):
        load_settings()
    monkeypatch.setenv("TIDAL_STORE__ROUTES", '{"logs": "ftp://x"}')
    with pytest.raises(ValueError, match=r"store.routes.logs 'ftp://x'"):
        open_store(load_settings())


def test_download_dir_refuses_a_key_that_climbs_out_of_the_cache(s3_store: S3Store, tmp_path: Path) -> None:
    """S3 keys may hold '..' segments: `ckpt/../../x` was written two levels above the cache directory."""
    s3_store.put_file(make_file(tmp_path / "f", "weights"), "ckpt/model.safetensors")
    s3_store.put_file(make_file(tmp_path / "g", "planted"), "ckpt/../../planted.py")
    with pytest.raises(ValueError, match=r"'ckpt/\.\./\.\./planted\.py'.*outside"):
        download_dir(s3_store, "ckpt", tmp_path / "a" / "b" / "cache")
    assert not (tmp_path / "a" / "planted.py").exists() and not (tmp_path / "a" / "b" / "cache" / ".complete").exists()
