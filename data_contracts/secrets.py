"""Secrets and personal data in logged text: detection (vectorised, RE2 through Arrow) and redaction.

Kinds and the quarantine reason each gives: `secret:aws_access_key`, `secret:private_key`,
`secret:api_key`, `pii:email`. Redaction replaces a match with `[REDACTED:<kind>]`.
"""

from __future__ import annotations

import re

import pyarrow as pa
import pyarrow.compute as pc

# kind → (category, pattern). The patterns are valid in both RE2 (Arrow) and Python's re.
PATTERNS: dict[str, tuple[str, str]] = {
    "aws_access_key": ("secret", r"AKIA[0-9A-Z]{16}"),
    # a whole PEM block when it is complete, else from the header to the end of the text
    "private_key": ("secret", r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----(?:[\s\S]*?-----END [A-Z0-9 ]*PRIVATE KEY-----|[\s\S]*)"),
    # OpenAI/Anthropic-style (sk-...), GitHub (ghp_..., github_pat_...) and Slack (xox?-...) tokens
    "api_key": (
        "secret",
        r"\b(?:sk-[A-Za-z0-9_-]{20,}|gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,}|xox[abprs]-[A-Za-z0-9-]{10,})",
    ),
    "email": ("pii", r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\b"),
}
ANY = "|".join(f"(?:{p})" for _, p in PATTERNS.values())
_COMPILED = {kind: re.compile(p) for kind, (_, p) in PATTERNS.items()}


def reason(kind: str) -> str:
    return f"{PATTERNS[kind][0]}:{kind}"


def kinds_in(text: str) -> list[str]:
    return [kind for kind, rx in _COMPILED.items() if rx.search(text)]


def detect(texts: pa.Array | pa.ChunkedArray) -> pa.Array:
    """(N,) texts → (N,) strings: the kinds found, comma-joined in PATTERNS order; '' when clean or null.

    One RE2 pass over all rows finds candidates; only those are checked kind by kind in Python.
    """
    hits = pc.fill_null(pc.match_substring_regex(texts, ANY), False).to_numpy(zero_copy_only=False)
    out = [""] * len(hits)
    if hits.any():
        values = texts.to_pylist() if len(texts) < 4096 else None
        for i in hits.nonzero()[0].tolist():
            text = values[i] if values is not None else texts[i].as_py()
            out[i] = ",".join(kinds_in(text))
    return pa.array(out, pa.string())


def redact(text: str) -> tuple[str, dict[str, int]]:
    """Text with every match replaced by [REDACTED:<kind>], and the count per kind."""
    counts: dict[str, int] = {}
    for kind, rx in _COMPILED.items():
        text, n = rx.subn(f"[REDACTED:{kind}]", text)
        if n:
            counts[kind] = n
    return text, counts
