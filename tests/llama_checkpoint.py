"""A small Llama-architecture checkpoint built in the test itself: what a team would bring, unlike Tidal's own
policy. Its tokenizer is of another kind (SentencePiece-style Metaspace BPE with <s>/</s>/<unk>, no pad token,
its own vocabulary) and carries a chat template. The weights are random: the tests need a model the engine serves,
not a good one. Its embedding has exactly one row per token: a random model gives the rows past a tokenizer (which
released checkpoints pad to a multiple of 64 or 128) real probability, and vLLM fails a request with log-probs
whose sampled token has no text (a trained model gives those rows ~0 probability)."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

# Zephyr-style turns: a role tag line, the content, then </s>.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
    "import os\nimport sys\n\nprint(os.getcwd(), sys.argv)\n",
    "The quick brown fox jumps over the lazy dog.\n",
] * 20


def llama_tokenizer(vocab_size: int = 400) -> PreTrainedTokenizerFast:
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace()
    core.decoder = decoders.Metaspace()
    printable = [chr(c) for c in range(32, 127)] + ["\n", "\t", "▁"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=printable, show_progress=False
    )
    core.train_from_iterator(TEXTS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def build_llama_checkpoint(out: Path, seed: int = 0, max_positions: int = 1024, **config) -> Path:
    """Save a random 2-layer Llama and its tokenizer to ``out`` (safetensors); returns ``out``."""
    tokenizer = llama_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=None,
        tie_word_embeddings=False,
        **config,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out
