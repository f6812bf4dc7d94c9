"""Tokenizers for rljax: one `Tokenizer` class over every vocabulary format rljax reads.

`load_tokenizer(x)` accepts

  * a Hugging Face tokenizer directory (`tokenizer.json`, plus `tokenizer_config.json`,
    `special_tokens_map.json`, `chat_template.jinja` / `chat_template.json` when present),
    or the path of a `tokenizer.json` file inside one;
  * a sentencepiece `.model` file, or a directory holding `tokenizer.model` (and optionally a
    `tokenizer_config.json`) but no `tokenizer.json`;
  * a `.gguf` file whose metadata carries a `gpt2` (byte-level BPE) or `llama` (sentencepiece BPE)
    vocabulary;
  * a built-in name such as `"smollm2-135m-instruct"`.

Every format is turned into a `tokenizers.Tokenizer` (the Rust backend that transformers' fast tokenizers
use), so encoding, decoding and `Tokenizer.save` behave the same whatever the source was. Chat templates are
rendered with a sandboxed jinja2 environment configured like transformers' `apply_chat_template`.

Modules: `base` (the `Tokenizer` class), `loader` (`load_tokenizer`: paths and built-in names to a format),
`hf` (tokenizer.json and the HF configs), `sentencepiece` (`.model` files), `gguf` (GGUF metadata) and
`chat` (chat-template rendering).
"""
from __future__ import annotations

from rljax.tokenizer.base import END_OF_TURN_TOKENS, SPECIAL_TOKEN_NAMES, Tokenizer
from rljax.tokenizer.loader import load_tokenizer

__all__ = ["END_OF_TURN_TOKENS", "SPECIAL_TOKEN_NAMES", "Tokenizer", "load_tokenizer"]
