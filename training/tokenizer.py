"""A small byte-level BPE tokenizer trained on the corpus.

Byte-level means no text is ever out of vocabulary: the 256 byte symbols are
all in the initial vocabulary, so every string encodes, and decoding gives the
string back.

The pipeline copies the one ``transformers`` rebuilds for any Qwen2 checkpoint:
``AutoTokenizer.from_pretrained`` on a directory whose config says
``model_type: qwen2`` (which is how vLLM loads a served policy) ignores the
normalizer and pre-tokenizer in ``tokenizer.json`` and installs Qwen2's own
(NFC normalization, Qwen2's split regex, byte-level mapping). Training with
that same pipeline makes the trainer's tokenizer and the server's tokenize
every text identically. The price is NFC: text that is not in NFC form (4 of
~1800 stdlib files contain some) decodes to its NFC form, not byte for byte.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# The one special token: separates documents in pretraining (eos), pads batches,
# and is declared bos/unk too; nothing prepends it automatically.
EOT = "<|endoftext|>"

# A plain-text chat format, so /v1/chat/completions works on a code model: each message as
# "<role>: <content>" on its own line, then "assistant: " for the reply.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)

# Qwen2's pre-tokenization regex (transformers.models.qwen2.tokenization_qwen2):
# contractions, letter runs with one leading non-letter, single digits,
# punctuation runs, newline runs, whitespace runs.
QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer with at most ``vocab_size`` entries on ``texts``.

    The vocabulary holds ``EOT`` (id 0), the 256 byte symbols, then learned
    merges (fewer than asked for when the texts run out of pairs to merge).
    """
    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(byte_alphabet) + 1:
        raise ValueError(f"vocab_size must be at least {len(byte_alphabet) + 1}, got {vocab_size}")

    core = Tokenizer(models.BPE())
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            # The regex already split the text; add_prefix_space=False keeps it unchanged.
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=byte_alphabet,
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer=trainer)

    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        chat_template=CHAT_TEMPLATE,
        bos_token=EOT,
        eos_token=EOT,
        pad_token=EOT,
        unk_token=EOT,
        # Source code has meaningful spaces before punctuation; keep decode exact.
        clean_up_tokenization_spaces=False,
    )


def padding_id(tokenizer) -> int:
    """The id to pad training batches with: the tokenizer's pad token, else its end-of-sequence token.

    Llama- and Mistral-style tokenizers define no pad token. Padded positions are masked out of attention and of
    every loss (training/rollout.py), so any id the embedding holds will do; the EOS token is the usual choice.
    """
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, list):  # some configs list several EOS ids
            value = value[0] if value else None
        if value is not None:
            return int(value)
    raise ValueError(
        f"tokenizer {type(tokenizer).__name__} has neither a pad token nor an end-of-sequence token: set one "
        "(e.g. tokenizer.pad_token = tokenizer.eos_token, or add an EOS token) in the checkpoint's tokenizer_config.json"
    )
