"""`tidal status` links each model's latest Data Docs: the store's own file for a local store, a local copy of the
site for S3 (a browser opens neither s3:// nor a private bucket)."""

from __future__ import annotations

import os

import pytest

from data_contracts.dataset import data_docs_prefix, latest_data_docs, write_watermark
from data_contracts.scope import Watermark
from tests.conftest import make_bucket
from tidal.store import LocalStore, S3Store, upload_dir


def publish_docs(store, tmp_path, model: str, ds_id: str) -> None:
    site = tmp_path / "site" / ds_id
    (site / "validations").mkdir(parents=True)
    (site / "index.html").write_text(f"<html>{ds_id}</html>")
    (site / "validations" / "run.html").write_text("<html>run</html>")
    upload_dir(store, site, data_docs_prefix(model, ds_id))
    write_watermark(store, Watermark(model=model, completions_through_ms=1, feedback_through_ms=1, dataset_id=ds_id))


@pytest.fixture()
def platform(tmp_path, monkeypatch):
    from tidal.platform import Platform
    from tidal.settings import load_settings

    monkeypatch.chdir(tmp_path)
    for key in [k for k in os.environ if k.startswith("TIDAL_")]:
        monkeypatch.delenv(key)
    return Platform(load_settings(data_dir=tmp_path / "data"))


def test_a_local_store_links_its_own_file_of_the_latest_collection(tmp_path, platform) -> None:
    store = LocalStore(tmp_path / "store")
    assert latest_data_docs(store, "tab") is None and platform.data_docs_link(store, "tab") is None
    publish_docs(store, tmp_path, "tab", "ds-1")
    publish_docs(store, tmp_path, "tab", "ds-2")
    link = platform.data_docs_link(store, "tab")
    assert link == (tmp_path / "store" / data_docs_prefix("tab", "ds-2") / "index.html").as_uri()


def test_an_s3_store_links_a_local_copy_of_the_site(tmp_path, platform, s3_endpoint) -> None:
    make_bucket(s3_endpoint, "tidal-docs")
    store = S3Store("tidal-docs", "/docs-link/", s3_endpoint, "us-east-1")
    publish_docs(store, tmp_path, "tab", "ds-7")
    link = platform.data_docs_link(store, "tab")
    assert link.startswith("file://") and link.endswith("/ds-7/index.html")
    copy = platform.settings.data_path / "docs" / data_docs_prefix("tab", "ds-7")
    assert (copy / "index.html").read_text() == "<html>ds-7</html>" and (copy / "validations" / "run.html").is_file()
