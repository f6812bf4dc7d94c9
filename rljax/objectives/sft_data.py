"""Supervised targets from the data (train.objective='sft'): each example's prompt as at RL time, and
after it the target completion with the tokens trained on.

    example --render_prompt--> prompt text (the chat template with the generation prompt, as RL renders it)
            --target_segments--> the completion as text segments, each trained on or only seen:
               a response (sft.response_template: "{response}", "{answer}", ...): the assistant turn the
                 chat template writes after the prompt, trained up to and including its first stop token
                 (the turn's end, what the sampler stops at); without a chat template the response and EOS;
               chat messages (fields.messages): every turn after the prompt, assistant turns trained on,
                 the others (user, tool) seen only
            --SftBatcher--> prompt_ids / prompt_mask [P, Lp] left-padded (the prompt batcher's), and tokens,
               mask (trained), context_mask (seen) [P, T] right-padded to T = sampling.max_new_tokens

Segments are encoded one by one (the tokens are those of each segment), so a trained token never
straddles a segment boundary. A target longer than T tokens is skipped and counted
(`response_too_long`); an example with no target stops the run with a message naming the field.
"""
from __future__ import annotations

import dataclasses
import string
from typing import Any

import numpy as np

from rljax.data.batching import _MAX_CONSECUTIVE_SKIPS, PromptBatch, PromptBatcher
from rljax.errors import DataError


@dataclasses.dataclass
class SftBatch(PromptBatch):
  """A PromptBatch with its targets: tokens [P, T] int32, mask [P, T] bool (trained), context_mask
  [P, T] bool (seen: mask plus the non-assistant turns of a conversation), right-padded."""
  tokens: np.ndarray = None
  mask: np.ndarray = None
  context_mask: np.ndarray = None


def _missing_response(example: dict, name: str) -> DataError:
  return DataError(
      f"data source '{example.get('source')}' example {example.get('id')!r} has no {name!r} to train on "
      f"(train.objective='sft', sft.response_template needs {{{name}}}): give the rows a response column and name "
      "it with data.sources[i].fields.response (default 'response'), or give chat messages with assistant turns "
      "(data.sources[i].fields.messages), or set sft.response_template to fields the rows have, e.g. '{answer}'.")


def response_text(example: dict, template: str) -> str:
  """The target text of a response example: `template` filled from the example's fields."""
  names = {n for _, n, _, _ in string.Formatter().parse(template) if n}
  values = {}
  for name in names:
    value = example.get(name)
    if value is None or (isinstance(value, str) and not value.strip()):
      raise _missing_response(example, name)
    values[name] = value
  return template.format_map(values)


def target_segments(example: dict, tokenizer: Any, prompt_text: str, chat_template: bool,
                    template: str) -> list[tuple[str, bool]]:
  """The completion after `prompt_text` as (text, is_assistant) segments (module docstring)."""
  messages = example.get("messages")
  if messages is not None:
    if not any(m["role"] == "assistant" for m in messages):
      raise _missing_response(example, "messages' assistant turns")
    if not chat_template:
      raise DataError(f"data source '{example.get('source')}': chat messages (fields.messages) need "
                      "data.chat_template=True (the template renders their turns).")
    start = len(example["prompt_messages"])
    segments, before = [], prompt_text
    for k in range(start, len(messages)):
      is_assistant = messages[k]["role"] == "assistant"
      following = k + 1 < len(messages) and messages[k + 1]["role"] == "assistant"
      text = tokenizer.apply_chat_template(messages[:k + 1], add_generation_prompt=following, tokenize=False)
      if not text.startswith(before):
        raise DataError(f"data source '{example.get('source')}' example {example.get('id')!r}: the chat template "
                        "does not render this conversation turn by turn (a turn changes the text before it); "
                        "give the rows a prompt and one response instead.")
      segments.append((text[len(before):], is_assistant))
      before = text
    return segments
  response = response_text(example, template)
  if chat_template:
    full = tokenizer.apply_chat_template(example["prompt_messages"] + [{"role": "assistant", "content": response}],
                                         add_generation_prompt=False, tokenize=False)
    if full.startswith(prompt_text):
      return [(full[len(prompt_text):], True)]
  return [(response, True)]


def encode_target(segments: list[tuple[str, bool]], tokenizer: Any) -> tuple[list[int], list[bool], list[bool]]:
  """(tokens, trained, seen) of the segments: an assistant segment is trained up to and including its first
  stop token (the tokens after it, such as a newline the template adds, are seen only); an assistant
  segment without one (no chat template) gets EOS appended."""
  stops = set(tokenizer.stop_ids)
  tokens, trained = [], []
  for text, is_assistant in segments:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not is_assistant:
      tokens += ids
      trained += [False] * len(ids)
      continue
    end = next((i for i, t in enumerate(ids) if t in stops), None)
    if end is None:
      ids = ids + [tokenizer.eos_id]
      end = len(ids) - 1
    tokens += ids
    trained += [i <= end for i in range(len(ids))]
  return tokens, trained, [True] * len(tokens)


class SftBatcher(PromptBatcher):
  """The prompt batcher (same positions, state and resume) whose batches carry their targets.

  max_target_tokens: T, the completion width (sampling.max_new_tokens); longer targets are skipped and
  counted as `response_too_long`. response_template: sft.response_template.
  """

  def __init__(self, *args, max_target_tokens: int, response_template: str = "{response}", **kwargs):
    super().__init__(*args, **kwargs)
    self.max_target_tokens = max_target_tokens
    self.response_template = response_template

  def _next_example(self):
    for _ in range(_MAX_CONSECUTIVE_SKIPS):
      example = super()._next_example()
      if example is None:
        return None
      segments = target_segments(example, self.tokenizer, example["prompt_text"], self._chat_template,
                                 self.response_template)
      tokens, trained, seen = encode_target(segments, self.tokenizer)
      if len(tokens) <= self.max_target_tokens:
        example["target"] = (tokens, trained, seen)
        return example
      self._count("response_too_long", example["source"])
    raise DataError(f"data: {_MAX_CONSECUTIVE_SKIPS} targets in a row are longer than sampling.max_new_tokens="
                    f"{self.max_target_tokens} tokens (the sft completion width); raise it.")

  def __next__(self) -> SftBatch:
    batch = super().__next__()
    p, t = len(batch.examples), self.max_target_tokens
    tokens = np.full((p, t), self.tokenizer.pad_id or 0, np.int32)
    mask, context = np.zeros((p, t), bool), np.zeros((p, t), bool)
    for i, example in enumerate(batch.examples):
      ids, trained, seen = example.pop("target")
      tokens[i, :len(ids)], mask[i, :len(ids)], context[i, :len(ids)] = ids, trained, seen
    return SftBatch(batch.prompt_ids, batch.prompt_mask, batch.examples, tokens=tokens, mask=mask, context_mask=context)
