"""The checks that read files but load no weights, run before any model is built.

`validate` (validation.py) checks what the config alone says; `check_files` goes on to the files
the config names, each in about a second, so a mistake costs no model load or compile:

  * model.path exists (a local directory, a GGUF file or a built-in name; a Hugging Face Hub id
    gets the download command), and its context fits data.max_prompt_tokens +
    sampling.max_new_tokens (context.py);
  * the tokenizer loads, and has a chat template when data.chat_template=True;
  * each data source opens and yields examples; the rows of a file source are read (the first
    `ROWS_SCANNED`) and the malformed ones counted: a source with more malformed rows than good
    ones is an error ("2 of 3 rows malformed", with the first errors), fewer is a note; and the
    first `PROMPTS_MEASURED` prompts, rendered as training renders them, must fit
    data.max_prompt_tokens (none fitting is an error, some is a note).

`rljax train` (and `--dry-run`) runs it; it returns the notes to print.
"""
from __future__ import annotations

import ml_collections

from rljax.errors import ConfigError, RljaxError

ROWS_SCANNED = 20_000
PROMPTS_MEASURED = 256
_ERRORS_QUOTED = 3


def check_files(c: ml_collections.ConfigDict) -> list[str]:
  """Raises ConfigError (or the data's DataError) naming the field or file and the fix; returns
  notes about what is usable but worth knowing (a few malformed rows, a few over-long prompts)."""
  from rljax.config.context import check_model_fits_early
  _check_model_path(c)
  check_model_fits_early(c)
  tokenizer = _tokenizer(c)
  notes = []
  splits = ["train"] + (["test"] if c.eval.every or c.eval.before_and_after else [])
  for split in splits:
    notes += _check_data(c, split, tokenizer)
  return notes


def _check_model_path(c) -> None:
  if c.model.path == "random":
    return
  from rljax.errors import WeightsError
  from rljax.models.io import resolve
  try:
    resolve(c.model.path)
  except WeightsError as e:
    raise ConfigError(f"config.model.path={c.model.path!r}: {e}") from None


def _tokenizer(c):
  """The run's tokenizer (config.tokenizer, else the model's), with its chat template checked; None
  for a random model without config.tokenizer."""
  source = c.tokenizer or (c.model.path if c.model.path != "random" else "")
  if not source:
    return None
  from rljax.tokenizer import load_tokenizer
  field = "config.tokenizer" if c.tokenizer else "config.model.path"
  try:
    tok = load_tokenizer(source)
  except RljaxError as e:
    raise ConfigError(f"{field}={source!r}: the tokenizer does not load: {e}") from None
  if c.data.chat_template:
    try:
      tok.apply_chat_template([{"role": "user", "content": "1 + 1?"}], add_generation_prompt=True, tokenize=False)
    except RljaxError as e:
      raise ConfigError(f"config.data.chat_template=True, but the tokenizer of {field}={source!r} cannot render a "
                        f"chat: {e} Set config.data.chat_template=False (prompts rendered as plain text), or "
                        "config.tokenizer to a tokenizer that ships a chat template.") from None
  return tok


def _check_data(c, split: str, tokenizer) -> list[str]:
  from rljax.data.config import PROCEDURAL_KINDS, normalize_config
  from rljax.data.pipeline import Malformed, open_source
  data = normalize_config(c.data.to_dict())
  notes = []
  for index, src in enumerate(data["sources"]):
    source = open_source(src, data, index, split)   # raises for a missing file or a source with no valid row
    where = f"data.sources[{index}] ({_describe(src, split)}, split '{split}')"
    rows = min(len(source), ROWS_SCANNED) if src["kind"] not in PROCEDURAL_KINDS else PROMPTS_MEASURED
    examples, bad = [], []
    for i in range(rows):
      item = source[i]   # with data.on_malformed='raise' a malformed row raises here, naming it
      if isinstance(item, Malformed):
        bad.append(f"{item.where}: {item.reason}")
      elif len(examples) < PROMPTS_MEASURED:
        examples.append(item)
    if bad:
      scanned = f"of the first {rows}" if rows < len(source) else f"of {rows}"
      summary = (f"{where}: {len(bad)} {scanned} rows malformed (first: {'; '.join(bad[:_ERRORS_QUOTED])})")
      if len(bad) > rows - len(bad):
        raise ConfigError(f"{summary}. Most rows are unusable: fix the file, or map its columns with the source's "
                          "'fields', e.g. fields={'prompt': 'question', 'answer': 'answer'}.")
      notes.append(f"{summary}; they are skipped and counted (data/malformed).")
    if tokenizer is not None and examples and not c.tools.enabled:   # tool schemas lengthen prompts: left to the run
      notes += _check_prompt_lengths(c, where, examples, tokenizer)
  return notes


def _check_prompt_lengths(c, where: str, examples, tokenizer) -> list[str]:
  from rljax.data.batching import render_prompt
  limit = c.data.max_prompt_tokens
  lengths = [len(tokenizer.encode(render_prompt(ex, tokenizer, c.data.chat_template))) for ex in examples]
  over = [n for n in lengths if n > limit]
  if not over:
    return []
  text = (f"{where}: {len(over)} of the first {len(lengths)} prompts are longer than data.max_prompt_tokens={limit} "
          f"tokens as rendered{' with the chat template' if c.data.chat_template else ''} (longest {max(lengths)})")
  if len(over) == len(lengths):
    raise ConfigError(f"{text}: every prompt would be filtered out. Raise data.max_prompt_tokens (e.g. "
                      f"--config.data.max_prompt_tokens={max(lengths)}).")
  return [f"{text}; those are skipped (data/filtered_too_long)."]


def _describe(src: dict, split: str) -> str:
  path = src.get("path")
  if isinstance(path, dict):
    path = path.get(split)
  return f"{src['kind']} {path}" if path else src["kind"]
