"""Hugging Face tokenizer directories: tokenizer.json (via the `tokenizers` package) and the configs beside it.

The config readers here (special tokens, chat templates, generation_config.json's eos ids) also serve
sentencepiece `.model` files that sit in an HF directory without a tokenizer.json.
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping

import tokenizers

from rljax.errors import TokenizerError
from rljax.tokenizer.base import SPECIAL_TOKEN_NAMES, Tokenizer, ensure_special_added


def load_hf(directory: str, tokenizer_json: str) -> Tokenizer:
  """tokenizer.json plus the configs beside it."""
  try:
    backend = tokenizers.Tokenizer.from_file(tokenizer_json)
  except Exception as err:  # tokenizers raises plain Exception subclasses for parse errors.
    raise TokenizerError(f"{tokenizer_json}: cannot parse tokenizer.json ({err}).") from err
  config = read_json(os.path.join(directory, "tokenizer_config.json"))
  special = named_special_tokens(config, read_json(os.path.join(directory, "special_tokens_map.json")))
  ensure_special_added(backend, special.values())
  return Tokenizer(backend, special_tokens=special, chat_template=config_chat_template(directory, config),
                   source=tokenizer_json, extra_stop_ids=generation_stop_ids(directory),
                   clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)))


def read_json(path: str, required: bool = False) -> dict[str, Any]:
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


def named_special_tokens(*configs: Mapping[str, Any]) -> dict[str, str]:
  """Named special tokens; earlier configs win."""
  out: dict[str, str] = {}
  for config in configs:
    for name in SPECIAL_TOKEN_NAMES:
      token = _token_content(config.get(name))
      if token is not None and name not in out:
        out[name] = token
  return out


def _token_content(value: Any) -> str | None:
  """A special token from a config: a string, or an AddedToken dict with "content"."""
  if isinstance(value, str):
    return value
  if isinstance(value, Mapping) and isinstance(value.get("content"), str):
    return value["content"]
  return None


def config_chat_template(directory: str, config: Mapping[str, Any]) -> str | dict[str, str] | None:
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
    json_template = read_json(os.path.join(directory, "chat_template.json")).get("chat_template")
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


def generation_stop_ids(directory: str) -> list[int]:
  """eos ids from generation_config.json (an int or a list), if the directory has one."""
  eos = read_json(os.path.join(directory, "generation_config.json")).get("eos_token_id")
  if isinstance(eos, int):
    return [eos]
  if isinstance(eos, list):
    return [i for i in eos if isinstance(i, int)]
  return []
