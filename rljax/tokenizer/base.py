"""The `Tokenizer` class every format loads into, and backend helpers the format loaders share.

A `Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust backend of transformers' fast tokenizers) plus what
the backend does not carry: named special tokens, the chat template, extra stop tokens and the source path.
Whatever the format, loaders build the backend and hand it here, so encode/decode/save behave the same.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterable, Mapping, Sequence

import tokenizers
from tokenizers import AddedToken, processors

from rljax.tokenizer import chat

# Named special tokens, in the order transformers lists them (`SPECIAL_TOKENS_ATTRIBUTES`).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

# Tokens that end an assistant turn in common chat formats; those present join `Tokenizer.stop_ids`.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end_of_text|>", "<|end|>",
                      "<end_of_turn>")


class Tokenizer:
  """A tokenizer with a chat template, backed by a `tokenizers.Tokenizer`.

  Build one with `load_tokenizer`. Ids are plain Python ints. `pad_id` falls back to `eos_id` when the
  vocabulary names no pad token (generation pads finished rows with it; the attention mask hides it).
  """

  def __init__(self, backend: tokenizers.Tokenizer, *, special_tokens: Mapping[str, str] | None = None,
               chat_template: str | Mapping[str, str] | None = None, source: str = "<memory>",
               extra_stop_tokens: Iterable[str] = (), extra_stop_ids: Iterable[int] = (),
               clean_up_tokenization_spaces: bool = False):
    """Wraps `backend`.

    Args:
      backend: the `tokenizers.Tokenizer` doing the work.
      special_tokens: named special tokens, e.g. {"bos_token": "<s>", "eos_token": "</s>"}.
      chat_template: a jinja template, or a dict of named templates ("default", "tool_use", ...).
      source: where the tokenizer came from, for error messages.
      extra_stop_tokens: more tokens that end generation (e.g. a GGUF's end-of-turn token).
      extra_stop_ids: more ids that end generation (e.g. generation_config.json's eos ids).
      clean_up_tokenization_spaces: transformers' legacy decode cleanup (ignored for BPE, as transformers does).
    """
    self._backend = backend
    self._source = source
    self._special = {k: v for k, v in (special_tokens or {}).items() if k in SPECIAL_TOKEN_NAMES and v is not None}
    self._chat_template = dict(chat_template) if isinstance(chat_template, Mapping) else chat_template
    self._extra_stop_tokens = tuple(extra_stop_tokens)
    self._extra_stop_ids = tuple(int(i) for i in extra_stop_ids)
    self._clean_up = bool(clean_up_tokenization_spaces)

  def __repr__(self):
    return (f"Tokenizer(source={self._source!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_id={self.eos_id}, pad_id={self.pad_id})")

  # -- vocabulary ------------------------------------------------------------------------------------------------

  @property
  def backend(self) -> tokenizers.Tokenizer:
    """The underlying `tokenizers.Tokenizer`."""
    return self._backend

  @property
  def source(self) -> str:
    """The path or name this tokenizer was loaded from."""
    return self._source

  @property
  def vocab_size(self) -> int:
    """Number of ids, added tokens included (the embedding table may be larger)."""
    return self._backend.get_vocab_size(with_added_tokens=True)

  def token_to_id(self, token: str) -> int | None:
    """The id of `token`, or None when it is not in the vocabulary."""
    return self._backend.token_to_id(token)

  def id_to_token(self, token_id: int) -> str | None:
    """The vocabulary entry of `token_id`, or None when out of range."""
    return self._backend.id_to_token(int(token_id))

  def _named_id(self, name: str) -> int | None:
    token = self._special.get(name)
    return None if token is None else self._backend.token_to_id(token)

  @property
  def special_tokens(self) -> dict[str, str]:
    """Named special tokens present, e.g. {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}."""
    return dict(self._special)

  @property
  def all_special_tokens(self) -> list[str]:
    """Every token skipped by `decode(..., skip_special_tokens=True)`, in id order."""
    decoder = self._backend.get_added_tokens_decoder()
    return [decoder[i].content for i in sorted(decoder) if decoder[i].special]

  @property
  def bos_id(self) -> int | None:
    """Beginning-of-sequence id, or None."""
    return self._named_id("bos_token")

  @property
  def eos_id(self) -> int | None:
    """End-of-sequence id, or None."""
    return self._named_id("eos_token")

  @property
  def unk_id(self) -> int | None:
    """Unknown-token id, or None."""
    return self._named_id("unk_token")

  @property
  def pad_id(self) -> int | None:
    """Padding id: the pad token when the vocabulary names one, else `eos_id`."""
    pad = self._named_id("pad_token")
    return self.eos_id if pad is None else pad

  @property
  def stop_ids(self) -> list[int]:
    """Ids that end generation: eos first, then end-of-turn tokens present (`<|im_end|>`, `<|eot_id|>`, ...)."""
    candidates = [self.eos_id, *self._extra_stop_ids]
    candidates += [self._backend.token_to_id(t) for t in (*self._extra_stop_tokens, *END_OF_TURN_TOKENS)]
    out = []
    for i in candidates:
      if i is not None and i not in out:
        out.append(i)
    return out

  # -- encode / decode -------------------------------------------------------------------------------------------

  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    """Token ids of `text`. Special tokens written in the text (e.g. `<|im_end|>`) map to their ids.

    `add_special_tokens=True` applies the post-processor (e.g. prepends BOS where the tokenizer does).
    """
    if not isinstance(text, str):
      raise TypeError(f"encode expects a str, got {type(text).__name__}")
    return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

  def batch_encode(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
    """`encode` over a list of strings."""
    encodings = self._backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
    return [e.ids for e in encodings]

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
    """Text of `ids` (any iterable of ints: list, numpy or jax array)."""
    text = self._backend.decode(_as_int_list(ids), skip_special_tokens=skip_special_tokens)
    return self._clean(text)

  def batch_decode(self, list_of_ids: Iterable[Iterable[int]], skip_special_tokens: bool = True) -> list[str]:
    """`decode` over a batch of id sequences."""
    texts = self._backend.decode_batch([_as_int_list(ids) for ids in list_of_ids],
                                       skip_special_tokens=skip_special_tokens)
    return [self._clean(t) for t in texts]

  def _clean(self, text: str) -> str:
    if not self._clean_up or type(self._backend.model).__name__ == "BPE":
      return text
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
      text = text.replace(before, after)
    return text

  # -- chat template ---------------------------------------------------------------------------------------------

  @property
  def chat_template(self) -> str | dict[str, str] | None:
    """The jinja chat template (or dict of named templates), or None."""
    return self._chat_template

  def get_chat_template(self, chat_template: str | None = None, tools: Any = None) -> str:
    """The template to render: `chat_template` (a template or a template name), else the tokenizer's own."""
    return chat.select_template(self._chat_template, chat_template, tools, self._source)

  def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                          tokenize: bool = False, *, tools: Sequence[Mapping[str, Any]] | None = None,
                          documents: Sequence[Mapping[str, Any]] | None = None, chat_template: str | None = None,
                          **kwargs) -> str | list[int] | list[str] | list[list[int]]:
    """Renders `messages` with the chat template, as transformers' `apply_chat_template(tokenize=False)` does.

    The template sees `messages`, `tools`, `documents`, `add_generation_prompt`, the named special tokens
    (`bos_token`, `eos_token`, ...) and `**kwargs` (which win over the special tokens). Message keys whose
    value is None are dropped. A list of conversations renders each one and returns a list.

    Returns:
      The rendered text, or its token ids (encoded without adding special tokens) when `tokenize=True`.
    """
    template = self.get_chat_template(chat_template, tools)
    batched = bool(messages) and isinstance(messages[0], (list, tuple))
    conversations = messages if batched else [messages]
    variables = {**self._special, **kwargs}
    rendered = [chat.render_chat(template, conv, tools, documents, add_generation_prompt, variables, self._source)
                for conv in conversations]
    if tokenize:
      rendered = [self.encode(text) for text in rendered]
    return rendered if batched else rendered[0]

  # -- saving ----------------------------------------------------------------------------------------------------

  def save(self, directory: str | os.PathLike) -> str:
    """Writes tokenizer.json, tokenizer_config.json (with the chat template) and special_tokens_map.json.

    transformers' `AutoTokenizer.from_pretrained(directory)` and `load_tokenizer(directory)` both load the
    result. Returns the directory.
    """
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    self._backend.save(os.path.join(directory, "tokenizer.json"))
    named = dict(self._special)
    extra = [t for t in self.all_special_tokens if t not in named.values()]
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", **named,
                              "clean_up_tokenization_spaces": self._clean_up}
    if extra:
      config["additional_special_tokens"] = extra
    if isinstance(self._chat_template, dict):
      config["chat_template"] = [{"name": k, "template": v} for k, v in self._chat_template.items()]
    elif self._chat_template is not None:
      config["chat_template"] = self._chat_template
    _write_json(os.path.join(directory, "tokenizer_config.json"), config)
    special_map = dict(named, **({"additional_special_tokens": extra} if extra else {}))
    _write_json(os.path.join(directory, "special_tokens_map.json"), special_map)
    return directory


def _as_int_list(ids: Iterable[int]) -> list[int]:
  if hasattr(ids, "tolist"):
    ids = ids.tolist()
  return [int(i) for i in ids]


def _write_json(path: str, obj: Any):
  with open(path, "w", encoding="utf-8") as f:
    json.dump(obj, f, indent=2, ensure_ascii=False)
    f.write("\n")


# ----------------------------------------------------------------------------------------------------------------
# Backend helpers shared by the format loaders.
# ----------------------------------------------------------------------------------------------------------------


def ensure_special_added(backend: tokenizers.Tokenizer, tokens: Iterable[str]):
  """Registers named special tokens as special added tokens, as transformers does on load."""
  present = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
  missing = [t for t in dict.fromkeys(tokens) if t not in present]
  if missing:
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])


def bos_eos_post_processor(bos: str | None, eos: str | None,
                           backend: tokenizers.Tokenizer) -> processors.PostProcessor:
  """`[bos] $A [eos]` for add_special_tokens=True; pass None to leave a token out.

  GGUF and sentencepiece sources carry add-BOS/add-EOS flags instead of a post-processor; this turns the
  flags into one, so `encode(add_special_tokens=True)` and a saved tokenizer.json both honour them.
  """
  single = " ".join([*(f"{bos}:0",) * (bos is not None), "$A:0", *(f"{eos}:0",) * (eos is not None)])
  pair = single + " " + " ".join([*(f"{bos}:1",) * (bos is not None), "$B:1", *(f"{eos}:1",) * (eos is not None)])
  specials = [(t, backend.token_to_id(t)) for t in dict.fromkeys(x for x in (bos, eos) if x is not None)]
  return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
