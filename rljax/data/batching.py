"""PromptBatcher: tokenizes examples, drops over-long prompts, left-pads batches.

The batcher walks its dataset by position. Its whole state is that position
plus the running counters, so `state()` is a small JSON-able dict and
`restore(state)` resumes with exactly the batches an uninterrupted run would
have produced next.

Padding: a batch is padded on the left with `tokenizer.pad_id` to the smallest
width bucket that holds its longest prompt: `pad_multiple` (default 16) times a
power of two, capped at `max_prompt_tokens` (`bucket_width`); with
`pad_to_max_prompt_tokens` every batch has width `max_prompt_tokens`. Either
way the jitted step sees few distinct shapes: each width compiles it once.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import numpy as np

from rljax.data.formats import Example
from rljax.data.pipeline import Malformed, PromptDataset
from rljax.errors import ConfigError, DataError
from rljax.models import families
from rljax.padding import left_pad

STATE_VERSION = 1
# Give up after this many consecutive unusable rows: an endless stream of
# them would otherwise hang the trainer without a message.
_MAX_CONSECUTIVE_SKIPS = 10_000
_MAX_LOGGED_SKIPS = 5

log = logging.getLogger(__name__)


@dataclasses.dataclass
class PromptBatch:
  """One batch of prompts.

  Attributes:
    prompt_ids: int32 [P, Lp], left-padded with the tokenizer's pad id.
    prompt_mask: bool [P, Lp], True on real tokens.
    examples: the P Examples, in row order (each has `prompt_text`, the
      rendered prompt that was tokenized).
  """
  prompt_ids: np.ndarray
  prompt_mask: np.ndarray
  examples: list[Example]

  @property
  def prompt_lengths(self) -> np.ndarray:
    return self.prompt_mask.sum(axis=1).astype(np.int32)


def render_prompt(example: Example, tokenizer: Any, chat_template: bool, tools: list[dict] | None = None, *,
                  tools_in_template: bool | None = None) -> str:
  """The prompt text the model sees: the chat template applied to the messages, or
  (chat_template=False) the system prompt and prompt joined by a blank line.

  With `tools` (schemas, {"type": "function", "function": {...}}): templates that render tools
  themselves (Qwen, Llama 3) get them as `tools=`; for the others (SmolLM2) and without a chat
  template, a Hermes-style tool block (`tool_instructions`) is added to the system prompt.
  `tools_in_template`: `template_renders_tools(tokenizer)` when the caller already knows it.
  """
  messages = example["prompt_messages"]
  if tools and tools_in_template is None:
    tools_in_template = chat_template and template_renders_tools(tokenizer)
  if tools and not (chat_template and tools_in_template):
    messages = with_tool_instructions(messages, tools)
    tools = None
  if chat_template:
    if tools:
      return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, tools=tools)
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
  return "\n\n".join(m["content"] for m in messages)


def check_bos(architecture: str, tokenizer: Any, chat_template: bool) -> None:
  """The prompts of a family with `bos_first` (Gemma) must start with its BOS token (the model is
  trained with it first; its chat template writes `{{ bos_token }}`, and prompts are encoded
  without adding special tokens). Raises ConfigError, naming the field to change, when the prompts
  rljax renders for a model of `architecture` would lack it. Other families: nothing to check."""
  if not families.get(architecture).bos_first:
    return
  bos = getattr(tokenizer, "bos_id", None)
  if bos is None:
    raise ConfigError(f"config.tokenizer: the tokenizer names no bos_token, but {architecture} prompts must start "
                      "with <bos>; use the model's own tokenizer (tokenizer_config.json with bos_token).")
  if not chat_template:
    raise ConfigError(f"config.data.chat_template=False renders prompts without <bos>, which {architecture} needs "
                      "first; set config.data.chat_template=True (Gemma's chat template starts with <bos>).")
  text = tokenizer.apply_chat_template([{"role": "user", "content": "1 + 1?"}], add_generation_prompt=True,
                                       tokenize=False)
  ids = tokenizer.encode(text, add_special_tokens=False)
  if not ids or ids[0] != bos:
    raise ConfigError(f"config.tokenizer: the chat template renders prompts that do not start with <bos> (id {bos}), "
                      f"which {architecture} needs; use a chat template that begins with '{{{{ bos_token }}}}' "
                      "(the model's own tokenizer_config.json / chat_template.jinja).")


def template_renders_tools(tokenizer: Any) -> bool:
  """Whether the tokenizer's chat template shows `tools=` to the model (it changes the text)."""
  messages = [{"role": "user", "content": "hi"}]
  probe = [{"type": "function", "function": {"name": "probe_tool_x", "description": "", "parameters": {
      "type": "object", "properties": {}}}}]
  try:
    return "probe_tool_x" in tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                           tools=probe)
  except Exception:  # noqa: BLE001 - a template that fails on tools does not render them
    return False


def tool_instructions(tools: list[dict]) -> str:
  """The Hermes-style description of `tools` for templates that do not render them."""
  lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
  return ("You can call tools. The available tools, as JSON schemas:\n<tools>\n" + lines + "\n</tools>\n"
          'To call one, write <tool_call>{"name": <tool name>, "arguments": <JSON object>}</tool_call> and stop; '
          "its result comes back in the next message.")


def with_tool_instructions(messages: list[dict], tools: list[dict]) -> list[dict]:
  """`messages` with the tool block appended to the system message (or as a new one)."""
  block = tool_instructions(tools)
  if messages and messages[0].get("role") == "system":
    first = dict(messages[0], content=messages[0]["content"] + "\n\n" + block)
    return [first] + list(messages[1:])
  return [{"role": "system", "content": block}] + list(messages)


PAD_BUCKETS = ("pow2", "multiple")


def bucket_width(longest: int, pad_multiple: int = 16, max_prompt_tokens: int | None = None,
                 buckets: str = "pow2") -> int:
  """The padded width of a batch whose longest prompt has `longest` tokens.

  buckets="pow2": the smallest of pad_multiple * (1, 2, 4, 8, ...) that holds it, so a run sees
  about log2(max_prompt_tokens / pad_multiple) + 1 widths and compiles its step that many times
  (16, 32, 64, ..., 1024, 2048 for 2048 tokens: 8 programs instead of 128);
  "multiple": rounded up to a multiple of pad_multiple (one program per multiple). Either way
  capped at max_prompt_tokens, which is itself the last width.
  """
  if buckets not in PAD_BUCKETS:
    raise ConfigError(f"data.pad_buckets={buckets!r} is not one of {PAD_BUCKETS}.")
  units = -(-max(int(longest), 1) // pad_multiple)
  if buckets == "pow2":
    units = 1 << (units - 1).bit_length()
  width = units * pad_multiple
  return width if max_prompt_tokens is None else min(width, max_prompt_tokens)


class PromptBatcher:
  """Iterates over `PromptBatch`es of a `PromptDataset`.

  Args:
    dataset: from `build_dataset`.
    tokenizer: `encode(text, add_special_tokens=False) -> list[int]`,
      `apply_chat_template(messages, add_generation_prompt=True, tokenize=False) -> str`
      and `pad_id`.
    prompts_per_batch: P, the number of prompts per batch.
    max_prompt_tokens: longer prompts are skipped and counted; defaults to the
      data config's `max_prompt_tokens` (None: no limit).
    pad_multiple, pad_to_max_prompt_tokens, pad_buckets: padding policy (module docstring,
      `bucket_width`); default to the data config's values ("pow2" buckets when it has none).
    drop_remainder: at the end of a finite dataset, drop a last batch with
      fewer than P prompts (default) or yield it.
    distinct: skip (and count as "duplicates") an example whose rendered prompt
      was already yielded; the data ends after _MAX_CONSECUTIVE_SKIPS duplicates
      in a row. For held-out evaluation on small procedural problem spaces.
    tools: tool schemas ({"type": "function", "function": {...}}) rendered into every prompt
      by the chat template (multi-turn tool use, docs/tools.md).
  """

  def __init__(self, dataset: PromptDataset, tokenizer: Any, prompts_per_batch: int, *,
               max_prompt_tokens: int | None = None, pad_multiple: int | None = None,
               pad_to_max_prompt_tokens: bool | None = None, drop_remainder: bool = True, distinct: bool = False,
               tools: list[dict] | None = None, pad_buckets: str | None = None):
    cfg = dataset.config
    if not isinstance(prompts_per_batch, int) or prompts_per_batch < 1:
      raise ConfigError(f"PromptBatcher(prompts_per_batch={prompts_per_batch!r}): expected an integer >= 1.")
    self.dataset = dataset
    self.tokenizer = tokenizer
    self.prompts_per_batch = prompts_per_batch
    self.max_prompt_tokens = cfg["max_prompt_tokens"] if max_prompt_tokens is None else max_prompt_tokens
    self.pad_multiple = cfg["pad_multiple"] if pad_multiple is None else pad_multiple
    self.pad_to_max = cfg["pad_to_max_prompt_tokens"] if pad_to_max_prompt_tokens is None else pad_to_max_prompt_tokens
    if self.pad_to_max and self.max_prompt_tokens is None:
      raise ConfigError("PromptBatcher: pad_to_max_prompt_tokens needs max_prompt_tokens to be set.")
    if self.pad_multiple < 1:
      raise ConfigError(f"PromptBatcher(pad_multiple={self.pad_multiple}): expected an integer >= 1.")
    self.pad_buckets = cfg.get("pad_buckets", "pow2") if pad_buckets is None else pad_buckets
    bucket_width(1, self.pad_multiple, None, self.pad_buckets)   # validates pad_buckets
    self.drop_remainder = drop_remainder
    self._seen: set[str] | None = set() if distinct else None
    self._chat_template = cfg["chat_template"]
    self._tools = list(tools) if tools else None
    self._tools_in_template = bool(self._tools and self._chat_template and template_renders_tools(tokenizer))
    self._position = 0
    self._stats = {"rows_read": 0, "examples": 0, "batches": 0, "malformed": 0, "filtered_too_long": 0}

  # -- checkpointing ---------------------------------------------------------

  def state(self) -> dict[str, Any]:
    """A JSON-able snapshot; `restore` of it continues with the same batches."""
    return {"version": STATE_VERSION, "position": self._position, "fingerprint": self.dataset.fingerprint,
            "prompts_per_batch": self.prompts_per_batch, "stats": dict(self._stats)}

  def restore(self, state: dict[str, Any], *, strict: bool = True) -> None:
    """Resumes from `state()` of a batcher over the same data config and shard.

    Args:
      state: a dict from `state()` (possibly via JSON).
      strict: refuse a state saved for a different data config (fingerprint)
        or batch size. With strict=False the position is reused anyway, e.g.
        after moving the data files or changing the batch size; the stream
        continues from the same row, but batches are only identical to an
        uninterrupted run if the rows and batch size did not change.

    Raises:
      DataError: the state is from another data config, split, shard or batch
        size, or from an unknown version.
    """
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
      raise DataError(f"data iterator state {state!r}: not a version-{STATE_VERSION} PromptBatcher state.")
    problems = []
    if state["fingerprint"] != self.dataset.fingerprint:
      problems.append(f"it was saved for a different data config, split or process shard (fingerprint "
                      f"{state['fingerprint']} != {self.dataset.fingerprint})")
    if state["prompts_per_batch"] != self.prompts_per_batch:
      problems.append(f"it was saved with prompts_per_batch={state['prompts_per_batch']}, "
                      f"this run uses {self.prompts_per_batch}")
    if problems and strict:
      raise DataError(
          f"cannot resume the data iterator exactly: {'; '.join(problems)}. Resume with the same data config, "
          "process count and batch size, pass strict=False to continue from the saved position anyway, "
          "or start the data stream fresh by not restoring its state.")
    for problem in problems:
      log.warning("restoring data iterator state although %s (strict=False).", problem)
    self._position = int(state["position"])
    self._stats = {k: int(v) for k, v in state["stats"].items()}

  def stats(self) -> dict[str, int]:
    """Counters since the start of the run (restored with the state)."""
    return dict(self._stats)

  # -- iteration -------------------------------------------------------------

  def __iter__(self) -> PromptBatcher:
    return self

  def _count(self, key: str, source: str) -> None:
    self._stats[key] = self._stats.get(key, 0) + 1
    per_source = f"{key}/{source}"
    self._stats[per_source] = self._stats.get(per_source, 0) + 1

  def _next_example(self) -> Example | None:
    """The next usable example (tokenized), or None at the end of the data."""
    skipped = duplicates = 0
    while self._position < len(self.dataset):
      item = self.dataset[self._position]
      self._position += 1
      self._stats["rows_read"] += 1
      if isinstance(item, Malformed):
        self._count("malformed", item.source)
        if self._stats["malformed"] <= _MAX_LOGGED_SKIPS:
          log.warning("skipping malformed row %s: %s", item.where, item.reason)
      else:
        text = render_prompt(item, self.tokenizer, self._chat_template, self._tools,
                             tools_in_template=self._tools_in_template)
        if self._seen is not None and text in self._seen:
          self._count("duplicates", item["source"])
          duplicates += 1
          if duplicates >= _MAX_CONSECUTIVE_SKIPS:
            return None  # every distinct prompt has been seen (or nearly): the data ends here
          continue
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if self.max_prompt_tokens is None or len(ids) <= self.max_prompt_tokens:
          item["prompt_text"] = text
          item["prompt_ids"] = ids
          if self._seen is not None:
            self._seen.add(text)
          return item
        self._count("filtered_too_long", item["source"])
      duplicates = 0
      skipped += 1
      if skipped >= _MAX_CONSECUTIVE_SKIPS:
        raise DataError(
            f"data: {skipped} consecutive rows were malformed or longer than max_prompt_tokens="
            f"{self.max_prompt_tokens} (stats {self._stats}); check the sources' fields and the token limit.")
    return None

  def _width(self, longest: int) -> int:
    if self.pad_to_max:
      return self.max_prompt_tokens
    return bucket_width(longest, self.pad_multiple, self.max_prompt_tokens, self.pad_buckets)

  def __next__(self) -> PromptBatch:
    examples = []
    while len(examples) < self.prompts_per_batch:
      example = self._next_example()
      if example is None:
        break
      examples.append(example)
    if not examples or (len(examples) < self.prompts_per_batch and self.drop_remainder):
      raise StopIteration
    width = self._width(max(len(e["prompt_ids"]) for e in examples))
    ids, mask = left_pad([e.pop("prompt_ids") for e in examples], self.tokenizer.pad_id, width)
    for example in examples:
      self._count("examples", example["source"])
    self._stats["batches"] += 1
    return PromptBatch(prompt_ids=ids, prompt_mask=mask, examples=examples)
