"""Tokenizers stored in GGUF metadata (`tokenizer.ggml.*`), read by rljax/gguf_file.py (no `gguf` package needed).

Two vocabulary kinds are supported: `gpt2` (byte-level BPE, built here) and `llama` (a sentencepiece BPE
vocabulary with scores, rebuilt by `sentencepiece.build_sentencepiece`). The split a byte-level vocabulary
was trained with is not stored in the file; it is looked up from `tokenizer.ggml.pre`, as llama.cpp does.
"""
from __future__ import annotations

import warnings
from typing import Any, Mapping

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from rljax.errors import TokenizerError
from rljax.gguf_file import GGUFFormatError, read_metadata
from rljax.tokenizer import sentencepiece as spm
from rljax.tokenizer.base import Tokenizer, bos_eos_post_processor, ensure_special_added

# tokenizer.ggml.pre -> pre-tokenizer regex (None: GPT-2's, built into ByteLevel).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_GGUF_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# llama.cpp isolates digits before GPT-2's split for these (SmolLM's tokenizer.json does the same).
_GGUF_DIGITS_FIRST = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_GGUF_GPT2_PRES = ("default", "gpt2", "gpt-2", "mpt", "olmo", "jais")

# Named special tokens -> the tokenizer.ggml.<key> holding their id ("seperator" is GGUF's spelling).
_SPECIAL_KEYS = (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                 ("sep_token", "seperator_token_id"), ("pad_token", "padding_token_id"),
                 ("cls_token", "cls_token_id"), ("mask_token", "mask_token_id"))


def load_gguf(path: str) -> Tokenizer:
  """A GGUF file's tokenizer metadata: `gpt2` (byte-level BPE) or `llama` (sentencepiece BPE)."""
  meta = read_tokenizer_metadata(path)
  kind = meta.get("tokenizer.ggml.model")
  if kind is None or "tokenizer.ggml.tokens" not in meta:
    raise TokenizerError(f"{path}: GGUF file has no tokenizer metadata (tokenizer.ggml.model / "
                         "tokenizer.ggml.tokens); load the tokenizer from the model's HF directory instead.")
  if kind == "gpt2":
    backend = _build_byte_level(meta, path)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
  elif kind == "llama":
    backend, _ = spm.build_sentencepiece(_sentencepiece_spec(meta, path), False, False)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))
  else:
    raise TokenizerError(f"{path}: GGUF tokenizer.ggml.model {kind!r} is not supported (supported: 'gpt2', "
                         "'llama'); load the tokenizer from the model's HF directory instead.")
  special = {name: _token(meta, key) for name, key in _SPECIAL_KEYS}
  special = {k: v for k, v in special.items() if v is not None}
  ensure_special_added(backend, special.values())
  add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
  backend.post_processor = bos_eos_post_processor(special.get("bos_token") if add_bos else None,
                                                  special.get("eos_token") if add_eos else None, backend)
  stops = [t for t in (_token(meta, "eot_token_id"), _token(meta, "eom_token_id")) if t is not None]
  return Tokenizer(backend, special_tokens=special, chat_template=_chat_template(meta), source=path,
                   extra_stop_tokens=stops)


# ----------------------------------------------------------------------------------------------------------------
# Reading the metadata.
# ----------------------------------------------------------------------------------------------------------------


def read_tokenizer_metadata(path: str) -> dict[str, Any]:
  """The `tokenizer.*` metadata of a GGUF file as Python values (strings, numbers, lists), tensors unread."""
  try:
    return read_metadata(path, keep=lambda key: key.startswith("tokenizer."))
  except OSError as err:
    raise TokenizerError(f"{path}: cannot read ({err}).") from err
  except GGUFFormatError as err:
    raise TokenizerError(f"{path}: {err}.") from None


def _token(meta: Mapping[str, Any], key: str) -> str | None:
  """The token whose id is stored under tokenizer.ggml.<key>, or None."""
  tokens = meta["tokenizer.ggml.tokens"]
  i = meta.get(f"tokenizer.ggml.{key}")
  return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None


def _chat_template(meta: Mapping[str, Any]) -> str | dict[str, str] | None:
  """tokenizer.chat_template, plus named ones (tokenizer.chat_template.<name>) as a dict."""
  default = meta.get("tokenizer.chat_template")
  prefix = "tokenizer.chat_template."
  named = {k[len(prefix):]: v for k, v in meta.items() if k.startswith(prefix) and isinstance(v, str)}
  if not named:
    return default
  return {**({"default": default} if default is not None else {}), **named}


# ----------------------------------------------------------------------------------------------------------------
# Vocabularies.
# ----------------------------------------------------------------------------------------------------------------


def _byte_level_pre_tokenizer(pre: str | None, path: str) -> pre_tokenizers.PreTokenizer:
  """The split a byte-level vocabulary was trained with, from GGUF's tokenizer.ggml.pre."""
  if pre in _GGUF_SPLITS:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_GGUF_SPLITS[pre]), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre in _GGUF_DIGITS_FIRST:
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
  if pre is not None and pre not in _GGUF_GPT2_PRES:
    warnings.warn(f"{path}: unknown tokenizer.ggml.pre {pre!r}; splitting text like GPT-2, which may differ "
                  "from the model's own tokenizer on digits and whitespace.", stacklevel=3)
  return gpt2


def _byte_alphabet() -> dict[int, str]:
  """GPT-2's byte -> printable character map (printable Latin-1 bytes map to themselves)."""
  keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
  table, shifted = {}, 0
  for b in range(256):
    if b in keep:
      table[b] = chr(b)
    else:
      table[b] = chr(256 + shifted)
      shifted += 1
  return table


def _build_byte_level(meta: Mapping[str, Any], path: str) -> tokenizers.Tokenizer:
  """A byte-level BPE (`gpt2` GGUF vocabulary). Control / user-defined tokens become added tokens."""
  tokens = meta["tokenizer.ggml.tokens"]
  types = meta.get("tokenizer.ggml.token_type") or [spm.NORMAL] * len(tokens)
  merges = meta.get("tokenizer.ggml.merges")
  if merges is None:
    raise TokenizerError(f"{path}: gpt2 GGUF vocabulary without tokenizer.ggml.merges.")
  alphabet = _byte_alphabet()
  spelled = set(alphabet.values())
  vocab = {}
  for i, (token, kind) in enumerate(zip(tokens, types)):
    if kind == spm.NORMAL and not set(token) <= spelled:  # raw text: write it in the byte alphabet
      token = "".join(alphabet[b] for b in token.encode("utf-8"))
    vocab.setdefault(token, i)
  try:
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    model = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
  except Exception as err:  # tokenizers raises on merges naming unknown tokens.
    raise TokenizerError(f"{path}: inconsistent GGUF vocabulary/merges ({err}).") from err
  backend = tokenizers.Tokenizer(model)
  backend.pre_tokenizer = _byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre"), path)
  backend.decoder = decoders.ByteLevel()
  backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                              for t, k in zip(tokens, types) if k == spm.CONTROL])
  user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == spm.USER_DEFINED]
  if user:
    backend.add_tokens(user)
  return backend


def _sentencepiece_spec(meta: Mapping[str, Any], path: str) -> spm.SentencePieceSpec:
  """A `llama` (sentencepiece BPE) GGUF vocabulary as a sentencepiece spec."""
  tokens = meta["tokenizer.ggml.tokens"]
  scores = meta.get("tokenizer.ggml.scores")
  if scores is None or len(scores) != len(tokens):
    raise TokenizerError(f"{path}: llama GGUF vocabulary needs tokenizer.ggml.scores, one per token.")
  types = meta.get("tokenizer.ggml.token_type") or [spm.NORMAL] * len(tokens)
  unk = meta.get("tokenizer.ggml.unknown_token_id")
  if unk is None and spm.UNKNOWN in types:
    unk = types.index(spm.UNKNOWN)
  charsmap = meta.get("tokenizer.ggml.precompiled_charsmap")
  return spm.SentencePieceSpec(
      pieces=list(tokens), scores=[float(s) for s in scores], types=[int(t) for t in types], algorithm="bpe",
      byte_fallback=spm.BYTE in types, add_dummy_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
      remove_extra_whitespaces=bool(meta.get("tokenizer.ggml.remove_extra_whitespaces", False)),
      charsmap=bytes(charsmap) if charsmap else None, bos_id=meta.get("tokenizer.ggml.bos_token_id"),
      eos_id=meta.get("tokenizer.ggml.eos_token_id"), pad_id=meta.get("tokenizer.ggml.padding_token_id"),
      unk_id=unk)
