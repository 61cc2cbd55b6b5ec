"""The code corpus and its train/held-out split: the Python standard library's own source code.

Every machine with Python 3.11 has it, so the demo needs no download. The train/held-out split hashes each
file's path relative to the library root, so the same files land on the same side on any machine. It is a
contract between the planes: pretraining and the trainer's pretraining-mix loss read only the train side, the
simulated users and `tidal eval` only the held-out side, so it lives here, beside the records, with
`unit_hash`, the one sha256 → [0, 1) rule every stable split uses (files, rows, eval sites).
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterable
from pathlib import Path

from tidal.model_settings import CorpusSource

# Third-party packages may be installed inside the stdlib tree; they are not ours.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_root() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path) -> list[Path]:
    """All ``*.py`` files under ``root``, sorted, outside any site-packages.

    Files that are not valid UTF-8 are kept here and dropped by :func:`read_texts`.
    """
    root = Path(root)
    files = [p for p in root.rglob("*.py") if p.is_file() and not _SKIP_DIRS.intersection(p.relative_to(root).parts)]
    return sorted(files)


def unit_hash(text: str, salt: bytes = b"") -> float:
    """A uniform number in [0, 1) fixed by `text` (and `salt`, for a split independent of the unsalted one):
    the first 8 bytes of sha256(salt + utf-8 text), as an integer over 2**64."""
    return int.from_bytes(hashlib.sha256(salt + text.encode("utf-8")).digest()[:8], "big") / 2**64


def _heldout_score(path: Path, root: Path) -> float:
    """A uniform number in [0, 1) fixed by the path relative to ``root``."""
    return unit_hash(Path(path).relative_to(root).as_posix())


def split_files(files: Iterable[Path], root: Path, heldout_fraction: float = 0.1) -> tuple[list[Path], list[Path]]:
    """Split ``files`` into (train, held-out) by a hash of each relative path.

    The split depends only on the relative paths, not on their order or on the
    machine, and a file's side never changes when other files are added.
    """
    if not 0.0 <= heldout_fraction <= 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1], got {heldout_fraction}")
    train: list[Path] = []
    heldout: list[Path] = []
    for path in files:
        (heldout if _heldout_score(path, Path(root)) < heldout_fraction else train).append(path)
    return train, heldout


def split_stdlib(heldout_fraction: float, root: Path | None = None) -> tuple[list[Path], list[Path]]:
    """(train, held-out) source files of the standard library (or of `root`): the bootstrap's split, with its
    `bootstrap.heldout_fraction`, is the one every plane must use."""
    root = Path(root) if root is not None else stdlib_root()
    return split_files(source_files(root), root, heldout_fraction)


def read_texts(files: Iterable[Path]) -> list[str]:
    """The UTF-8 text of each file, dropping files that do not decode or are empty."""
    texts: list[str] = []
    for path in files:
        try:
            text = Path(path).read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text:
            texts.append(text)
    return texts


def corpus_split(corpus: CorpusSource, heldout_fraction: float) -> tuple[list[Path], list[Path]] | None:
    """(train, held-out) files of a model's corpus, split as the standard library is; None for source 'none'.
    Raises FileNotFoundError naming the setting when the directory is missing or holds no matching file."""
    if corpus.source == "none":
        return None
    if corpus.source == "stdlib":
        return split_stdlib(heldout_fraction)
    root = Path(corpus.source).expanduser()
    files = sorted(p for p in root.rglob(corpus.pattern) if p.is_file()) if root.is_dir() else []
    if not files:
        raise FileNotFoundError(
            f"models[].corpus: no file matches {corpus.pattern!r} under {corpus.source!r}"
            f"{'' if root.is_dir() else ' (no such directory here)'}; point corpus.source at the model's text, "
            "or set it to 'none' (and train.ppo.ptx_coef to 0)"
        )
    return split_files(files, root, heldout_fraction)


def corpus_name(corpus: CorpusSource) -> str:
    """How reports name the corpus."""
    if corpus.source in ("stdlib", "none"):
        return {"stdlib": "the standard library", "none": "no corpus"}[corpus.source]
    return f"{corpus.source} ({corpus.pattern})"
