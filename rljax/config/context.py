"""The model's context against data.max_prompt_tokens + sampling.max_new_tokens.

`check_model_fits_early` reads the context from the model's files without loading weights
(an HF directory's config.json, a GGUF header), so the CLI refuses a prompt + completion longer
than the context in a second instead of after the weights have loaded; the trainer checks again
against the loaded ModelConfig (`check_model_fits`).
"""
from __future__ import annotations

import json
import os

import ml_collections

from rljax import gguf_file
from rljax.errors import ConfigError
from rljax.models import builtin

# The context of a random model (model.path="random"): the setup builds its ModelConfig with it.
RANDOM_MODEL_CONTEXT = 4096


def check_model_fits(c: ml_collections.ConfigDict, max_position_embeddings: int, model: str = "") -> None:
  """Contradiction between the data/sampling lengths and the model's context."""
  need = c.data.max_prompt_tokens + c.sampling.max_new_tokens
  if need > max_position_embeddings:
    raise ConfigError(
        f"config.data.max_prompt_tokens + config.sampling.max_new_tokens = {c.data.max_prompt_tokens} + "
        f"{c.sampling.max_new_tokens} = {need} exceeds the context of {model or 'the model'} "
        f"({max_position_embeddings} tokens); lower one of them.")


def model_context_length(model_cfg) -> int | None:
  """The model's context (max_position_embeddings) read without loading its weights, or None.

  An HF directory's config.json, a GGUF file's (or built-in name's) `<arch>.context_length`
  header entry, RANDOM_MODEL_CONTEXT for "random". Anything it cannot read cheaply is left to the
  check after loading.
  """
  path = model_cfg.path
  if path == "random":
    return RANDOM_MODEL_CONTEXT
  try:
    if os.path.isdir(path):
      with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        hf = json.load(f)
      return int(hf.get("max_position_embeddings", 2048))
    if not os.path.isfile(path):
      if not builtin.is_builtin(path):
        return None
      path = builtin.resolve_builtin(path)
    return gguf_file.context_length(path)
  except Exception:  # noqa: BLE001 - unreadable here; loading the model reports it properly
    return None


def check_model_fits_early(c: ml_collections.ConfigDict) -> None:
  """`check_model_fits` against the context read from the model's files (no weights loaded)."""
  context = model_context_length(c.model)
  if context is not None:
    check_model_fits(c, context, model=f"model.path={c.model.path!r}")
