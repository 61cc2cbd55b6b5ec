"""Where simulated users press Tab: cursor positions in real code the policy never trained on.

The standard library's held-out files (the bootstrap's `heldout_fraction`, never pretrained on) are split
once more by a second path hash: `traffic` files feed the simulated production traffic (and so, through
the logs, PPO), `eval` files feed `tidal eval` and are never used for pretraining or training. A user may
also name any directory of code; its files are split the same way.

A site is the code before the cursor (the prompt) and the rest of that line (what the user intends).
Users ask for a suggestion where they pause: right after finishing a word (an identifier or keyword,
mid-line). Pausing mid-word or after whitespace is rarer, and such prompts end inside what the policy's
BPE tokenizer would have merged into one token (" return", "    self"): measured on the 5-minute base,
greedy 3-character suggestions were right at 10% of word ends but under 1% of random positions and 0%
of line starts — a tokenizer artefact (token healing in serving would lift it), not a user's behaviour.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from data_contracts import corpus

Split = Literal["traffic", "eval"]
EVAL_SALT = b"tidal-eval-split/"


@dataclass(frozen=True)
class TabSite:
    file: str  # path relative to its code root
    offset: int  # cursor position (characters into the file)
    prompt: str  # code before the cursor, at most `context_bytes` UTF-8 bytes of it
    intended: str  # the true rest of the line: what the user is about to type


def _eval_score(rel: str) -> float:
    return corpus.unit_hash(rel, EVAL_SALT)


def site_files(
    split: Split, heldout_fraction: float, eval_fraction: float = 0.5, code_dir: Path | None = None
) -> tuple[Path, list[Path]]:
    """(root, files) of one split. Without `code_dir`: the stdlib's held-out files (pretraining's split with
    `heldout_fraction`), divided into traffic and eval by a second hash; with it: all *.py files there."""
    if code_dir is None:
        root = corpus.stdlib_root()
        _, pool = corpus.split_stdlib(heldout_fraction, root)
    else:
        root = Path(code_dir)
        if not root.is_dir():
            raise FileNotFoundError(f"sim code directory {root} does not exist; expected a directory of *.py files")
        pool = corpus.source_files(root)
    files = [p for p in pool if (_eval_score(p.relative_to(root).as_posix()) < eval_fraction) == (split == "eval")]
    if not files:
        raise ValueError(f"no {split} files under {root} (heldout_fraction={heldout_fraction}, eval_fraction={eval_fraction})")
    return root, files


def _word(c: str) -> bool:
    return c.isalnum() or c == "_"


def _word_end(text: str, cut: int) -> bool:
    return _word(text[cut - 1]) and not _word(text[cut])


def tail_bytes(text: str, limit: int) -> str:
    """The longest suffix of `text` whose UTF-8 encoding fits in `limit` bytes."""
    raw = text[-limit:].encode("utf-8")
    return raw[-limit:].decode("utf-8", errors="ignore")


def cursor_sites(
    root: Path, files: list[Path], n: int, seed: int, context_bytes: int = 480, min_intended: int = 1
) -> list[TabSite]:
    """`n` sites drawn uniformly over the characters of `files` (deterministic given the seed). A site sits at
    the end of a word, mid-line, with at least `min_intended` characters left on the line."""
    rng = random.Random(seed)
    texts = [(p.relative_to(root).as_posix(), t) for p, t in zip(files, corpus.read_texts(files)) if len(t) > 1]
    if not texts:
        raise ValueError(f"no readable code among {len(files)} files under {root}")
    sizes = [len(t) for _, t in texts]
    out: list[TabSite] = []
    for _ in range(n * 200):
        if len(out) == n:
            return out
        rel, text = rng.choices(texts, weights=sizes)[0]
        cut = rng.randrange(1, len(text))
        end = text.find("\n", cut)
        intended = text[cut : end if end != -1 else len(text)].rstrip()
        if len(intended) >= min_intended and _word_end(text, cut):
            out.append(TabSite(rel, cut, tail_bytes(text[:cut], context_bytes), intended))
    raise ValueError(f"found only {len(out)} of {n} cursor sites in {len(texts)} files under {root}")
