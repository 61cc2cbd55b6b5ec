"""The stdlib corpus: file discovery, the hash split, reading."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest

from data_contracts.corpus import read_texts, source_files, split_files, stdlib_root


def test_stdlib_root_holds_the_standard_library() -> None:
    root = stdlib_root()
    assert (root / "os.py").is_file()
    assert (root / "json" / "__init__.py").is_file()


def test_source_files_sorted_python_only_without_site_packages(tmp_path: Path) -> None:
    for rel in ["b.py", "a/c.py", "a/notes.txt", "site-packages/pkg/x.py", "a/site-packages/y.py"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    files = source_files(tmp_path)
    assert [f.relative_to(tmp_path).as_posix() for f in files] == ["a/c.py", "b.py"]


def test_split_is_deterministic_disjoint_and_near_the_fraction() -> None:
    root = stdlib_root()
    files = source_files(root)
    assert len(files) > 500
    train, heldout = split_files(files, root, heldout_fraction=0.1)
    assert set(train).isdisjoint(heldout)
    assert sorted(train + heldout) == files
    assert 0.06 < len(heldout) / len(files) < 0.14
    # Order of the input does not matter, and a rerun gives the same split.
    train2, heldout2 = split_files(list(reversed(files)), root, heldout_fraction=0.1)
    assert sorted(train2) == sorted(train) and sorted(heldout2) == sorted(heldout)


def test_split_follows_the_path_hash(tmp_path: Path) -> None:
    names = [f"m{i}.py" for i in range(200)]
    files = [tmp_path / n for n in names]
    _, heldout = split_files(files, tmp_path, heldout_fraction=0.3)
    expected = {tmp_path / n for n in names if int.from_bytes(hashlib.sha256(n.encode()).digest()[:8], "big") / 2**64 < 0.3}
    assert set(heldout) == expected
    # The side of a file depends on its relative path only, not on where the root is.
    other = tmp_path / "elsewhere"
    _, heldout_other = split_files([other / n for n in names], other, heldout_fraction=0.3)
    assert {p.name for p in heldout_other} == {p.name for p in heldout}


def test_split_rejects_bad_fraction(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        split_files([tmp_path / "a.py"], tmp_path, heldout_fraction=1.5)


def test_read_texts_skips_undecodable_and_empty(tmp_path: Path) -> None:
    good = tmp_path / "good.py"
    good.write_text("print('héllo')\n", encoding="utf-8")
    latin1 = tmp_path / "latin1.py"
    latin1.write_bytes("s = 'caf\xe9'\n".encode("latin-1"))
    empty = tmp_path / "empty.py"
    empty.write_text("")
    assert read_texts([latin1, good, empty]) == ["print('héllo')\n"]


def test_a_models_own_corpus_is_split_like_the_standard_library(tmp_path: Path) -> None:
    from data_contracts.corpus import corpus_name, corpus_split, split_stdlib
    from tidal.model_settings import CorpusSource

    for i in range(30):
        (tmp_path / "src" / f"d{i % 3}").mkdir(parents=True, exist_ok=True)
        (tmp_path / "src" / f"d{i % 3}" / f"m{i}.rs").write_text(f"fn f{i}() {{}}\n")
        (tmp_path / "src" / f"skip{i}.md").write_text("not code\n")
    own = CorpusSource(source=str(tmp_path / "src"), pattern="*.rs")
    train, heldout = corpus_split(own, 0.3)
    files = sorted(train + heldout)
    assert len(files) == 30 and all(f.suffix == ".rs" for f in files) and train and heldout
    assert (train, heldout) == split_files(files, tmp_path / "src", 0.3)  # the same hash rule: stable on any machine
    assert corpus_split(CorpusSource(), 0.3) == split_stdlib(0.3)
    assert corpus_split(CorpusSource(source="none"), 0.3) is None
    assert corpus_name(own) == f"{tmp_path / 'src'} (*.rs)" and corpus_name(CorpusSource()) == "the standard library"
    with pytest.raises(FileNotFoundError, match=r"no file matches '\*.py' under .*src'; point corpus.source"):
        corpus_split(CorpusSource(source=str(tmp_path / "src")), 0.3)
    with pytest.raises(FileNotFoundError, match="no such directory here"):
        corpus_split(CorpusSource(source=str(tmp_path / "gone")), 0.3)


def test_a_corpus_in_s3_is_copied_where_it_is_read_and_split_as_its_keys(s3_endpoint, tmp_path: Path) -> None:
    """A trainer pod has no directory of the team's text: models[].corpus.source names an s3:// prefix, read with
    the store's endpoint, copied into the cache once per listing, and split by the keys' relative paths."""
    from data_contracts.corpus import corpus_split
    from tests.conftest import make_bucket
    from tidal.model_settings import CorpusSource
    from tidal.settings import load_settings
    from tidal.store import S3Store, local_corpus, upload_dir

    src = tmp_path / "docs"
    for i in range(20):
        (src / f"d{i % 2}").mkdir(parents=True, exist_ok=True)
        (src / f"d{i % 2}" / f"page{i}.md").write_text(f"# page {i}\n")
    make_bucket(s3_endpoint, "acme-text")
    bucket = S3Store("acme-text", "", s3_endpoint, "us-east-1")
    upload_dir(bucket, src, "docs/v1")
    settings = load_settings(data_dir=str(tmp_path / ".tidal"), store={"s3_endpoint_url": s3_endpoint})
    remote = CorpusSource(source="s3://acme-text/docs/v1", pattern="*.md")

    here = local_corpus(remote, settings, tmp_path / "cache")
    assert Path(here.source).is_relative_to(tmp_path / "cache") and here.pattern == "*.md"
    copy, mine = corpus_split(here, 0.3), corpus_split(CorpusSource(source=str(src), pattern="*.md"), 0.3)
    for side_copy, side_mine in zip(copy, mine):  # the same files on the same side as the directory uploaded
        assert [p.relative_to(here.source) for p in side_copy] == [p.relative_to(src) for p in side_mine]
    assert copy[0] and copy[1]
    assert local_corpus(remote, settings, tmp_path / "cache") == here  # unchanged: the copy is reused
    time.sleep(1.1)  # S3 times objects to the second: an edit is seen as one from the next second on
    (src / "d0" / "page0.md").write_text("# page 0, edited\n")
    upload_dir(bucket, src / "d0", "docs/v1/d0")
    fresh = local_corpus(remote, settings, tmp_path / "cache")
    assert fresh.source != here.source and (Path(fresh.source) / "d0" / "page0.md").read_text() == "# page 0, edited\n"
    assert local_corpus(CorpusSource(), settings, tmp_path / "cache") == CorpusSource()  # other sources as they are

    with pytest.raises(FileNotFoundError, match=r"no object under 's3://acme-text/docs/v2'; upload the model's text"):
        local_corpus(CorpusSource(source="s3://acme-text/docs/v2"), settings, tmp_path / "cache")
    with pytest.raises(ValueError, match=r"names no prefix: expected s3://bucket/prefix"):
        CorpusSource(source="s3://acme-text")
