"""The data config: its fields, their defaults, and validation.

`normalize_config` turns a user dict (or ml_collections ConfigDict) into a
plain dict with every field present, or raises `ConfigError` naming the first
bad field. Everything downstream reads only the normalized dict.
"""
from __future__ import annotations

import copy
import string
from typing import Any, Mapping

from rljax.data import procedural
from rljax.errors import ConfigError

SOURCE_KINDS = ("jsonl", "parquet", "json", "tfds", "gsm8k", "math", "arithmetic", "countdown")
PROCEDURAL_KINDS = ("arithmetic", "countdown")
FILE_KINDS = ("jsonl", "parquet", "json", "gsm8k", "math")
ANSWER_FORMATS = ("raw", "gsm8k", "boxed")

# Keys every Example has; a field mapping may not reuse them for extras.
RESERVED_KEYS = ("id", "source", "verifier", "prompt", "prompt_messages", "answer", "split", "response", "messages")

TOP_LEVEL_DEFAULTS: dict[str, Any] = {
    "sources": [],
    "system_prompt": None,
    "prompt_template": "{prompt}",
    "chat_template": True,
    "max_prompt_tokens": None,
    "pad_multiple": 16,
    "pad_buckets": "pow2",          # prompt widths: 16 x 2^k ("pow2": a handful of programs) or any multiple
    "pad_to_max_prompt_tokens": False,
    "on_malformed": "skip",
    "max_line_bytes": 16 << 20,     # a longer JSONL line is a malformed row (sources.DEFAULT_MAX_LINE_BYTES)
    "shuffle": True,
    "seed": 0,
    "num_epochs": None,
}

SOURCE_DEFAULTS: dict[str, Any] = {
    "kind": None,
    "label": None,
    "weight": 1.0,
    "verifier": None,
    "path": None,
    "name": None,
    "data_dir": None,
    "split": None,
    "fields": None,
    "answer_format": None,
    "system_prompt": None,
    "prompt_template": None,
    "num_examples": None,
    "difficulty": 1,
    "held_out_fraction": 1 / 16,
    "seed": None,
}

# Fields that only make sense for some kinds.
_KIND_ONLY = {
    "path": FILE_KINDS + ("tfds",),
    "name": ("tfds",),
    "data_dir": ("tfds",),
    "split": ("tfds",),
    "fields": FILE_KINDS + ("tfds",),
    "answer_format": FILE_KINDS + ("tfds",),
    "difficulty": PROCEDURAL_KINDS,
    "held_out_fraction": PROCEDURAL_KINDS,
    "seed": PROCEDURAL_KINDS,
}

DEFAULT_VERIFIER = {"gsm8k": "gsm8k", "math": "math", "arithmetic": "arithmetic", "countdown": "countdown"}
DEFAULT_ANSWER_FORMAT = {"gsm8k": "gsm8k", "math": "boxed"}
DEFAULT_FIELDS = {
    "gsm8k": {"prompt": "question", "answer": "answer"},
    "math": {"prompt": "problem", "answer": "solution"},
    "arithmetic": {"prompt": "question", "answer": "answer", "extra": ["expression"]},
    "countdown": {"prompt": "question", "answer": "answer", "extra": ["numbers", "target"]},
}
GENERIC_FIELDS = {"prompt": "prompt", "answer": "answer"}
MAX_DIFFICULTY = {"arithmetic": 8, "countdown": 4}


def default_config() -> dict[str, Any]:
  """The top-level data fields with their defaults (`sources` left empty)."""
  return copy.deepcopy(TOP_LEVEL_DEFAULTS)


def to_plain(value: Any) -> Any:
  """Converts ConfigDicts, tuples and other mappings into plain dicts/lists."""
  if hasattr(value, "to_dict"):
    value = value.to_dict()
  if isinstance(value, Mapping):
    return {str(k): to_plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [to_plain(v) for v in value]
  return value


def _is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _check_unknown(given: Mapping[str, Any], known: Mapping[str, Any], where: str) -> None:
  for key in given:
    if key not in known:
      raise ConfigError(f"{where}.{key}: unknown field; known fields are {sorted(known)}.")


def _check_int(value: Any, where: str, *, minimum: int, optional: bool = False) -> None:
  if value is None and optional:
    return
  if not _is_int(value) or value < minimum:
    extra = " or null" if optional else ""
    raise ConfigError(f"{where}={value!r}: expected an integer >= {minimum}{extra}.")


def _check_bool(value: Any, where: str) -> None:
  if not isinstance(value, bool):
    raise ConfigError(f"{where}={value!r}: expected true or false.")


def _check_str(value: Any, where: str, *, optional: bool = True) -> None:
  if value is None and optional:
    return
  if not isinstance(value, str) or (not optional and not value):
    raise ConfigError(f"{where}={value!r}: expected a string.")


def template_fields(template: str, where: str) -> set[str]:
  """Names used as `{placeholders}` in a prompt template."""
  try:
    parsed = list(string.Formatter().parse(template))
  except ValueError as e:
    raise ConfigError(f"{where}={template!r}: not a valid format string ({e}); write literal braces as "
                      f"'{{{{' and '}}}}'.") from e
  names = set()
  for _, name, _, _ in parsed:
    if name is None:
      continue
    if not name or not name.isidentifier():
      raise ConfigError(f"{where}={template!r}: placeholder {{{name}}} must be a field name such as {{prompt}}.")
    names.add(name)
  return names


def _normalize_fields(fields: Any, kind: str, where: str) -> dict[str, Any]:
  """Fills the field mapping {prompt, answer, id, extra} for one source."""
  base = DEFAULT_FIELDS.get(kind, GENERIC_FIELDS)
  if kind in PROCEDURAL_KINDS:
    out = copy.deepcopy(base)
    out.setdefault("id", None)
    extra = out.pop("extra", [])
    out["extra"] = {name: name for name in extra}
    return out
  if fields is None:
    fields = {}
  if not isinstance(fields, Mapping):
    raise ConfigError(f"{where}={fields!r}: expected a mapping like "
                      "{prompt: question, answer: answer, extra: [...]}.")
  # response: the target of train.objective='sft' (default column 'response', read when present);
  # messages: a column of chat messages [{role, content}, ...] (the prompt is the turns before the
  # first assistant turn, sft trains on the assistant turns). Left out of the result unless given,
  # so the data fingerprint of configs without them does not change.
  _check_unknown(fields, {"prompt": 0, "answer": 0, "id": 0, "extra": 0, "response": 0, "messages": 0}, where)
  for key in ("response", "messages"):
    if key in fields:
      _check_str(fields[key], f"{where}.{key}")
  out = {"prompt": base["prompt"], "answer": base["answer"], "id": None, "extra": {}}
  out.update({k: v for k, v in fields.items() if k != "extra"})
  _check_str(out["prompt"], f"{where}.prompt", optional=False)
  _check_str(out["answer"], f"{where}.answer")
  _check_str(out["id"], f"{where}.id")
  extra = fields.get("extra") or {}
  if isinstance(extra, (list, tuple)):
    extra = {name: name for name in extra}
  if not isinstance(extra, Mapping):
    raise ConfigError(f"{where}.extra={extra!r}: expected a list of field names or a mapping example_key -> row_field.")
  for key, column in extra.items():
    _check_str(column, f"{where}.extra.{key}", optional=False)
    if key in RESERVED_KEYS:
      raise ConfigError(f"{where}.extra.{key}: '{key}' is reserved for the Example itself; map it to another name, "
                        f"e.g. {{row_{key}: {column}}}.")
  out["extra"] = dict(extra)
  return out


def _normalize_source(src: Any, index: int, top: Mapping[str, Any]) -> dict[str, Any]:
  where = f"data.sources[{index}]"
  if not isinstance(src, Mapping):
    raise ConfigError(f"{where}={src!r}: expected a mapping with at least a 'kind' field.")
  _check_unknown(src, SOURCE_DEFAULTS, where)
  kind = src.get("kind")
  if kind not in SOURCE_KINDS:
    raise ConfigError(f"{where}.kind={kind!r}: expected one of {list(SOURCE_KINDS)}.")
  for key, kinds in _KIND_ONLY.items():
    if key in src and src[key] is not None and kind not in kinds:
      raise ConfigError(f"{where}.{key}: not used by kind '{kind}' (only by {list(kinds)}); remove it.")
  out = copy.deepcopy(SOURCE_DEFAULTS)
  out.update(copy.deepcopy(dict(src)))

  weight = out["weight"]
  if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
    raise ConfigError(f"{where}.weight={weight!r}: expected a number > 0.")
  out["weight"] = float(weight)
  _check_str(out["label"], f"{where}.label")
  _check_str(out["verifier"], f"{where}.verifier")
  if out["verifier"] is None:
    if kind not in DEFAULT_VERIFIER:
      raise ConfigError(f"{where}.verifier: required for kind '{kind}'; name the verifier that scores this source, "
                        f"e.g. verifier: math.")
    out["verifier"] = DEFAULT_VERIFIER[kind]
  _check_int(out["num_examples"], f"{where}.num_examples", minimum=1, optional=True)
  _check_str(out["system_prompt"], f"{where}.system_prompt")
  _check_str(out["prompt_template"], f"{where}.prompt_template")

  if kind in FILE_KINDS:
    path = out["path"]
    if path is None:
      raise ConfigError(f"{where}.path: required for kind '{kind}'; give a file, a directory, a glob, or a mapping "
                        f"split -> path.")
    if isinstance(path, Mapping):
      for split_name, p in path.items():
        _check_str(p, f"{where}.path.{split_name}", optional=False)
    else:
      _check_str(path, f"{where}.path", optional=False)
  if kind == "tfds":
    if (out["name"] is None) == (out["path"] is None):
      raise ConfigError(f"{where}: kind 'tfds' needs exactly one of 'name' (a registered or prepared dataset, with "
                        f"data_dir) or 'path' (a prepared dataset version directory).")
    _check_str(out["name"], f"{where}.name")
    _check_str(out["path"], f"{where}.path")
    _check_str(out["data_dir"], f"{where}.data_dir")
    split = out["split"]
    if isinstance(split, Mapping):
      for split_name, s in split.items():
        _check_str(s, f"{where}.split.{split_name}", optional=False)
    else:
      _check_str(split, f"{where}.split")
  if kind in PROCEDURAL_KINDS:
    difficulty = out["difficulty"]
    if not _is_int(difficulty) or not 1 <= difficulty <= MAX_DIFFICULTY[kind]:
      raise ConfigError(f"{where}.difficulty={difficulty!r}: expected an integer from 1 to {MAX_DIFFICULTY[kind]} "
                        f"for '{kind}'.")
    share = out["held_out_fraction"]
    is_number = isinstance(share, (int, float)) and not isinstance(share, bool)
    buckets = share * procedural.HELD_OUT_BUCKETS if is_number else None
    if buckets is None or buckets != round(buckets) or not 1 <= buckets < procedural.HELD_OUT_BUCKETS:
      raise ConfigError(f"{where}.held_out_fraction={share!r}: expected a multiple of 1/{procedural.HELD_OUT_BUCKETS} "
                        f"from {1 / procedural.HELD_OUT_BUCKETS} to {1 - 1 / procedural.HELD_OUT_BUCKETS} "
                        "(the share of distinct problems kept for the held-out split).")
    if out["seed"] is None:
      out["seed"] = top["seed"]
    _check_int(out["seed"], f"{where}.seed", minimum=0)

  fmt = out["answer_format"]
  if fmt is None:
    fmt = DEFAULT_ANSWER_FORMAT.get(kind, "raw")
  if fmt not in ANSWER_FORMATS:
    raise ConfigError(f"{where}.answer_format={fmt!r}: expected one of {list(ANSWER_FORMATS)}.")
  out["answer_format"] = fmt
  out["fields"] = _normalize_fields(out["fields"], kind, f"{where}.fields")

  template = out["prompt_template"] if out["prompt_template"] is not None else top["prompt_template"]
  allowed = {"prompt"} | set(out["fields"]["extra"])
  for name in template_fields(template, f"{where}.prompt_template"):
    if name not in allowed:
      raise ConfigError(
          f"{where}.prompt_template={template!r}: placeholder {{{name}}} is not a field of this source "
          f"(available: {sorted(allowed)}); add it to fields.extra or write literal braces as '{{{{' and '}}}}'.")
  return out


def normalize_config(cfg: Any) -> dict[str, Any]:
  """Validates a data config and returns a plain dict with all defaults filled.

  Raises:
    ConfigError: naming the first unknown or invalid field.
  """
  cfg = to_plain(cfg)
  if not isinstance(cfg, Mapping):
    raise ConfigError(f"data config {cfg!r}: expected a mapping with a 'sources' list.")
  _check_unknown(cfg, TOP_LEVEL_DEFAULTS, "data")
  out = default_config()
  out.update(copy.deepcopy(dict(cfg)))

  _check_str(out["system_prompt"], "data.system_prompt")
  _check_str(out["prompt_template"], "data.prompt_template", optional=False)
  _check_bool(out["chat_template"], "data.chat_template")
  _check_int(out["max_prompt_tokens"], "data.max_prompt_tokens", minimum=1, optional=True)
  _check_int(out["pad_multiple"], "data.pad_multiple", minimum=1)
  _check_bool(out["pad_to_max_prompt_tokens"], "data.pad_to_max_prompt_tokens")
  if out["pad_buckets"] not in ("pow2", "multiple"):   # = rljax.data.batching.PAD_BUCKETS
    raise ConfigError(f"data.pad_buckets={out['pad_buckets']!r} is not one of ('pow2', 'multiple').")
  if out["pad_to_max_prompt_tokens"] and out["max_prompt_tokens"] is None:
    raise ConfigError("data.pad_to_max_prompt_tokens=true needs data.max_prompt_tokens to be set.")
  if out["on_malformed"] not in ("skip", "raise"):
    raise ConfigError(f"data.on_malformed={out['on_malformed']!r}: expected 'skip' or 'raise'.")
  _check_int(out["max_line_bytes"], "data.max_line_bytes", minimum=1024)
  _check_bool(out["shuffle"], "data.shuffle")
  _check_int(out["seed"], "data.seed", minimum=0)
  _check_int(out["num_epochs"], "data.num_epochs", minimum=1, optional=True)

  sources = out["sources"]
  if isinstance(sources, Mapping):
    # {label: source} form (FrozenConfigDict cannot hold a list of dicts).
    as_list = []
    for label, src in sources.items():
      if isinstance(src, Mapping) and src.get("label", label) != label:
        raise ConfigError(f"data.sources.{label}.label={src['label']!r}: differs from its key; drop 'label' or make "
                          f"them equal.")
      as_list.append({**src, "label": label} if isinstance(src, Mapping) else src)
    sources = as_list
  if not isinstance(sources, list) or not sources:
    raise ConfigError("data.sources: expected a non-empty list of sources, e.g. [{kind: gsm8k, path: train.jsonl}], "
                      "or a mapping label -> source.")
  out["sources"] = [_normalize_source(s, i, out) for i, s in enumerate(sources)]

  kinds = [s["kind"] for s in out["sources"]]
  labels = []
  for i, s in enumerate(out["sources"]):
    if s["label"] is None:
      s["label"] = s["kind"] if kinds.count(s["kind"]) == 1 else f"{s['kind']}{i}"
    labels.append(s["label"])
  for label in labels:
    if labels.count(label) > 1:
      raise ConfigError(f"data.sources: label {label!r} is used by more than one source; give each source a distinct "
                        f"'label'.")
  return out


def eval_reads_training_data(cfg: Any, split: str = "test", train_split: str = "train") -> list[str]:
  """The sources whose `split` examples would be read from the same place as their training ones.

  A file source with one `path` (not a mapping split -> path) reads that file for every split,
  and so does a tfds source with one `split`; procedural sources hold out a share of their
  problems and never overlap. Returns "data.sources[i].path=..." descriptions, empty if none.
  """
  import os
  out = []
  for i, src in enumerate(normalize_config(cfg)["sources"]):
    where = f"data.sources[{i}]"
    key = "path" if src["kind"] in FILE_KINDS else "split" if src["kind"] == "tfds" else None
    if key is None:
      continue
    value = src[key]
    if isinstance(value, Mapping):
      same = (split in value and train_split in value and value[split] is not None and
              os.path.normpath(str(value[split])) == os.path.normpath(str(value[train_split])))
      if same:
        out.append(f"{where}.{key}={value!r} (the same for '{train_split}' and '{split}')")
    elif src["kind"] in FILE_KINDS or value is not None:
      out.append(f"{where}.{key}={value!r} " + ("(one path for every split)" if key == "path" else
                                                "(the same tfds split for training and evaluation)"))
  return out
