"""Sentencepiece vocabularies (a `.model` file, or a `llama` GGUF via `gguf.py`) as `tokenizers` pipelines.

A `.model` file is parsed with the `sentencepiece` package's own ModelProto schema. Encoding and decoding
are not delegated to `sentencepiece.SentencePieceProcessor`: the model is rebuilt as a `tokenizers.Tokenizer`
(the way transformers' sentencepiece converters do), because

  * `llama` GGUF vocabularies carry pieces, scores and types but no model proto to hand to sentencepiece;
  * `Tokenizer.save` writes a tokenizer.json that transformers loads, which needs a `tokenizers` pipeline;
  * special tokens written in text map to their ids, and text around added tokens is encoded segment by
    segment, as transformers and llama.cpp do (sentencepiece would spell `</s>` out in characters).

The rebuilt pipeline is tested against sentencepiece itself (same ids, same decoded text).
"""
from __future__ import annotations

import dataclasses
import os

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers

from rljax.errors import TokenizerError
from rljax.tokenizer import hf
from rljax.tokenizer.base import Tokenizer, bos_eos_post_processor, ensure_special_added

# sentencepiece piece types (also GGUF's tokenizer.ggml.token_type values).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# sentencepiece's TrainerSpec.ModelType values this module can rebuild.
_ALGORITHMS = {1: "unigram", 2: "bpe"}


@dataclasses.dataclass
class SentencePieceSpec:
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


def load_sentencepiece(model_path: str, directory: str | None) -> Tokenizer:
  """A .model file, with tokenizer_config.json and friends when it sits in an HF directory."""
  spec = read_model_file(model_path)
  config = hf.read_json(os.path.join(directory, "tokenizer_config.json")) if directory else {}
  backend, named = build_sentencepiece(spec, bool(config.get("add_bos_token", False)),
                                       bool(config.get("add_eos_token", False)))
  special = named
  template = None
  if directory:
    special = {**named, **hf.named_special_tokens(config, hf.read_json(os.path.join(directory,
                                                                                     "special_tokens_map.json")))}
    ensure_special_added(backend, special.values())
    template = hf.config_chat_template(directory, config)
  return Tokenizer(backend, special_tokens=special, chat_template=template, source=model_path,
                   extra_stop_ids=hf.generation_stop_ids(directory) if directory else ())


def read_model_file(path: str) -> SentencePieceSpec:
  """A sentencepiece `.model` file (a serialized ModelProto) as a spec."""
  try:
    with open(path, "rb") as f:
      data = f.read()
  except OSError as err:
    raise TokenizerError(f"{path}: cannot read ({err}).") from err
  proto = _parse_model_proto(data, path)
  pieces = [p.piece for p in proto.pieces]
  if not pieces:
    raise TokenizerError(f"{path}: not a sentencepiece model (no pieces).")
  types = [int(p.type) for p in proto.pieces]
  trainer, normalizer = proto.trainer_spec, proto.normalizer_spec
  algorithm = _ALGORITHMS.get(int(trainer.model_type))
  if algorithm is None:
    raise TokenizerError(f"{path}: sentencepiece model type {int(trainer.model_type)} (word/char) is not "
                         "supported; only unigram and bpe models are.")
  if trainer.treat_whitespace_as_suffix:
    raise TokenizerError(f"{path}: treat_whitespace_as_suffix models are not supported.")

  def special_id(i):
    return i if 0 <= i < len(pieces) else None

  return SentencePieceSpec(
      pieces=pieces, scores=[float(p.score) for p in proto.pieces], types=types, algorithm=algorithm,
      byte_fallback=bool(trainer.byte_fallback), add_dummy_prefix=bool(normalizer.add_dummy_prefix),
      remove_extra_whitespaces=bool(normalizer.remove_extra_whitespaces),
      escape_whitespaces=bool(normalizer.escape_whitespaces), charsmap=normalizer.precompiled_charsmap or None,
      bos_id=special_id(trainer.bos_id), eos_id=special_id(trainer.eos_id), pad_id=special_id(trainer.pad_id),
      unk_id=types.index(UNKNOWN) if UNKNOWN in types else special_id(trainer.unk_id))


def _parse_model_proto(data: bytes, path: str):
  """`data` parsed with sentencepiece's generated ModelProto class (which runs on the `protobuf` package)."""
  try:
    from google.protobuf.message import DecodeError  # pylint: disable=import-outside-toplevel
    from sentencepiece import sentencepiece_model_pb2  # pylint: disable=import-outside-toplevel
  except Exception as err:  # ImportError, or protobuf's VersionError when it is older than sentencepiece needs.
    raise TokenizerError(f"{path}: reading sentencepiece .model files needs the `sentencepiece` and `protobuf` "
                         f"packages at compatible versions ({type(err).__name__}: {err}).") from err
  try:
    return sentencepiece_model_pb2.ModelProto.FromString(data)
  except DecodeError as err:
    raise TokenizerError(f"{path}: not a sentencepiece model (bad protobuf: {err}).") from err


# ----------------------------------------------------------------------------------------------------------------
# Spec -> tokenizers pipeline.
# ----------------------------------------------------------------------------------------------------------------


def build_sentencepiece(spec: SentencePieceSpec, add_bos: bool, add_eos: bool) -> tuple[tokenizers.Tokenizer,
                                                                                            dict[str, str]]:
  """A `tokenizers.Tokenizer` encoding like sentencepiece itself, and its named special tokens."""
  backend = tokenizers.Tokenizer(_model(spec))
  normalizer = _normalizer(spec)
  if normalizer is not None:
    backend.normalizer = normalizer
  backend.decoder = _decoder(spec)
  special = [AddedToken(p, special=True, normalized=False)
             for p, t in zip(spec.pieces, spec.types) if t in (CONTROL, UNKNOWN)]
  backend.add_special_tokens(special)
  user = [AddedToken(p, special=False, normalized=False) for p, t in zip(spec.pieces, spec.types) if t == USER_DEFINED]
  if user:
    backend.add_tokens(user)
  named = {name: spec.pieces[i] for name, i in (("bos_token", spec.bos_id), ("eos_token", spec.eos_id),
                                               ("unk_token", spec.unk_id), ("pad_token", spec.pad_id))
           if i is not None}
  backend.post_processor = bos_eos_post_processor(named.get("bos_token") if add_bos else None,
                                                  named.get("eos_token") if add_eos else None, backend)
  return backend, named


def _bpe_merges(spec: SentencePieceSpec) -> list[tuple[str, str]]:
  """Merges implied by a scored vocabulary: (left, right) for every split of a piece into two pieces.

  sentencepiece BPE repeatedly merges the adjacent pair whose union has the highest score, so ranking each
  merge by its result's score reproduces it.
  """
  mergeable = {p: i for i, (p, t) in enumerate(zip(spec.pieces, spec.types)) if t in (NORMAL, USER_DEFINED)}
  ranked = []
  for i, (piece, kind) in enumerate(zip(spec.pieces, spec.types)):
    if kind != NORMAL or len(piece) < 2:
      continue
    for cut in range(1, len(piece)):
      left, right = piece[:cut], piece[cut:]
      if left in mergeable and right in mergeable:
        ranked.append((-spec.scores[i], i, mergeable[left], left, right))
  ranked.sort(key=lambda r: r[:3])
  return [(left, right) for *_, left, right in ranked]


def _model(spec: SentencePieceSpec) -> models.Model:
  unk_piece = spec.pieces[spec.unk_id] if spec.unk_id is not None else None
  if spec.algorithm == "unigram":
    return models.Unigram(list(zip(spec.pieces, spec.scores)), unk_id=spec.unk_id, byte_fallback=spec.byte_fallback)
  vocab = {piece: i for i, piece in reversed(list(enumerate(spec.pieces)))}
  return models.BPE(vocab=vocab, merges=_bpe_merges(spec), unk_token=unk_piece, fuse_unk=True,
                    byte_fallback=spec.byte_fallback)


def _normalizer(spec: SentencePieceSpec) -> normalizers.Normalizer | None:
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


def _decoder(spec: SentencePieceSpec) -> decoders.Decoder:
  steps = [decoders.Replace("\u2581", " ")]
  if spec.byte_fallback:
    steps.append(decoders.ByteFallback())
  steps.append(decoders.Fuse())
  if spec.add_dummy_prefix:
    steps.append(decoders.Strip(" ", 1, 0))
  return decoders.Sequence(steps)
