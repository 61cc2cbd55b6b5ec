"""The byte-level BPE tokenizer: exact round trips, save/load, agreement with Qwen2 loading."""

from __future__ import annotations

import unicodedata
from pathlib import Path

import pytest
from transformers import AutoTokenizer, Qwen2Config

from data_contracts.corpus import read_texts, stdlib_root
from training.tokenizer import EOT, train_tokenizer

SAMPLES = [
    "def f(x):\n    return x ** 2  # square\n",
    "s = 'héllo wörld — 世界 🚀 ∑ x² naïve'\r\n\tpass\n",
    '    if a  !=  b :\n\n\n        raise ValueError(f"{a!r} vs {b!r}")   \n',
    "x = 12345678901234567890; y = 0xDEAD_BEEF\n",
    "\x00\x07 control chars \u200b zero width \ufeff bom\n",
    f"text that spells {EOT} out\n",
    "",
    " leading space",
]


@pytest.fixture(scope="module")
def texts() -> list[str]:
    root = stdlib_root()
    return read_texts([root / n for n in ("heapq.py", "bisect.py", "textwrap.py", "shlex.py", "string.py")])


@pytest.fixture(scope="module")
def tok(texts: list[str]):
    return train_tokenizer(texts, vocab_size=400)


def test_vocab_special_tokens_and_no_bos(tok) -> None:
    assert len(tok) <= 400 and len(tok) > 300
    assert tok.convert_tokens_to_ids(EOT) == 0
    assert tok.bos_token_id == tok.eos_token_id == tok.pad_token_id == tok.unk_token_id == 0
    assert tok.encode("x = 1") == tok.encode("x = 1", add_special_tokens=False)
    assert 0 not in tok.encode("x = 1")


@pytest.mark.parametrize("s", SAMPLES)
def test_round_trip(tok, s: str) -> None:
    assert tok.decode(tok.encode(s)) == s


def test_round_trip_on_corpus_and_merges_compress(tok, texts: list[str]) -> None:
    for t in texts:
        ids = tok.encode(t)
        assert tok.decode(ids) == t
        assert len(ids) < 0.6 * len(t.encode("utf-8"))  # merges were learned and used


def test_non_nfc_text_decodes_to_its_nfc_form(tok) -> None:
    s = "cafe\u0301"  # 'e' + combining acute
    assert tok.decode(tok.encode(s)) == unicodedata.normalize("NFC", s) == "caf\u00e9"


def test_every_byte_is_in_the_vocabulary(tok) -> None:
    s = "".join(chr(c) for c in range(32, 0x250))
    ids = tok.encode(s)
    assert tok.unk_token_id not in ids
    assert tok.decode(ids) == s


def test_save_and_load_with_auto_tokenizer(tok, texts: list[str], tmp_path: Path) -> None:
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert len(loaded) == len(tok)
    assert loaded.eos_token_id == loaded.bos_token_id == loaded.pad_token_id == 0
    for s in SAMPLES + texts[:2]:
        assert loaded.encode(s) == tok.encode(s)
        assert loaded.decode(loaded.encode(s)) == s


def test_qwen2_directory_loads_an_identical_tokenizer(tok, texts: list[str], tmp_path: Path) -> None:
    # Next to a qwen2 config, AutoTokenizer (and so vLLM) builds Qwen2's own pipeline.
    Qwen2Config(vocab_size=len(tok)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert len(loaded) == len(tok) and loaded.eos_token_id == 0
    for s in SAMPLES + texts + ["cafe\u0301"]:
        assert loaded.encode(s) == tok.encode(s)


def test_too_small_vocab_is_rejected() -> None:
    with pytest.raises(ValueError):
        train_tokenizer(["abc"], vocab_size=100)


def test_padding_falls_back_to_eos_for_tokenizers_without_a_pad_token(tok) -> None:
    from transformers import PreTrainedTokenizerFast

    from training.tokenizer import padding_id

    assert padding_id(tok) == tok.pad_token_id
    llama_like = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, eos_token=EOT)  # no pad token
    assert llama_like.pad_token_id is None and padding_id(llama_like) == llama_like.eos_token_id
    bare = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer)
    with pytest.raises(ValueError, match="neither a pad token nor an end-of-sequence token"):
        padding_id(bare)
