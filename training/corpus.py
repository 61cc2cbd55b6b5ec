"""The pretraining corpus: the Python standard library's own source code.

Every machine with Python 3.11 has it, so the demo needs no download. The
train/held-out split hashes each file's path relative to the library root, so
the same files land on the same side on any machine.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterable
from pathlib import Path

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
    files = [
        p
        for p in root.rglob("*.py")
        if p.is_file() and not _SKIP_DIRS.intersection(p.relative_to(root).parts)
    ]
    return sorted(files)


def _heldout_score(path: Path, root: Path) -> float:
    """A uniform number in [0, 1) fixed by the path relative to ``root``."""
    rel = Path(path).relative_to(root).as_posix()
    digest = hashlib.sha256(rel.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_files(
    files: Iterable[Path], root: Path, heldout_fraction: float = 0.1
) -> tuple[list[Path], list[Path]]:
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
