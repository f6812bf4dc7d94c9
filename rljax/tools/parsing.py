"""Finding the tool call in a model's turn.

Two formats:

  hermes  (Qwen2.5/Qwen3, Hermes, and most HF chat templates with `tools=`)
            <tool_call>
            {"name": "calculator", "arguments": {"expression": "2 + 2"}}
            </tool_call>
          The LAST complete <tool_call>...</tool_call> block counts. "arguments" may also
          be a JSON string holding an object (some models emit that), be named
          "parameters", or be left out (= {}).
  python  a fenced code block is a call of the "python" tool:
            ```python
            print(2 + 2)
            ```
          The LAST complete block opened by ```python (or ```py, ```python3) counts.

`parse_tool_call` returns None when the turn holds no (complete) call, so the turn is a
final answer; a ToolCall with `error` set when a call was attempted but is malformed (its
message is shown to the model as the observation).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from rljax.errors import ConfigError

FORMATS = ("hermes", "python")
_MARKERS = {"hermes": ("<tool_call>", "</tool_call>"), "python": ("```python", "```")}
_PY_LANGS = ("python", "py", "python3")


@dataclasses.dataclass
class ToolCall:
  """One parsed call: the tool's name and its arguments, or the reason it could not be parsed.

  Attributes:
    name: the tool's name ("" when it could not be read).
    arguments: the arguments ({} when `error` is set).
    error: why the call is malformed, or None.
  """
  name: str
  arguments: dict
  error: str | None = None


def _check_format(fmt: str) -> None:
  if fmt not in FORMATS:
    raise ConfigError(f"unknown tool-call format {fmt!r}; use one of {FORMATS}.")


def end_markers(fmt: str) -> tuple[str, str]:
  """(start marker, end marker) of a call in format `fmt`: decoding can stop at the end
  marker once the start marker was generated."""
  _check_format(fmt)
  return _MARKERS[fmt]


def parse_tool_call(text: str, fmt: str) -> ToolCall | None:
  """The tool call in `text`, one assistant turn (what the model generated since the last
  tool response); None when there is none. See the module doc for the formats."""
  _check_format(fmt)
  if fmt == "hermes":
    return _parse_hermes(text)
  return _parse_python(text)


def _parse_hermes(text: str) -> ToolCall | None:
  start, end = _MARKERS["hermes"]
  close = text.rfind(end)
  if close < 0:
    return None
  open_ = text.rfind(start, 0, close)
  if open_ < 0:
    return ToolCall("", {}, error=f"found {end} without a preceding {start}; write "
                    f'{start}{{"name": ..., "arguments": {{...}}}}{end}')
  body = text[open_ + len(start):close].strip()
  if not body:
    return ToolCall("", {}, error=f"the {start} block is empty; it must hold "
                    '{"name": <tool name>, "arguments": {...}}')
  try:
    obj = json.loads(body)
  except json.JSONDecodeError as e:
    return ToolCall("", {}, error=f"the {start} block is not valid JSON ({e.msg} at line {e.lineno} "
                    f"column {e.colno}); it must hold {{\"name\": <tool name>, \"arguments\": {{...}}}}")
  except RecursionError:
    return ToolCall("", {}, error=f"the {start} block is nested too deeply to parse")
  if not isinstance(obj, dict):
    return ToolCall("", {}, error=f"the {start} block holds a JSON {_kind(obj)}; it must hold an object "
                    '{"name": <tool name>, "arguments": {...}}')
  name = obj.get("name")
  if not isinstance(name, str) or not name.strip():
    return ToolCall("", {}, error='the tool call has no "name" (a non-empty string naming the tool)')
  name = name.strip()
  key = "arguments" if "arguments" in obj else "parameters"
  args: Any = obj.get(key, {})
  if isinstance(args, str):
    try:
      args = json.loads(args) if args.strip() else {}
    except (json.JSONDecodeError, RecursionError):
      return ToolCall(name, {}, error=f'"{key}" of tool \'{name}\' is a string that is not a JSON object')
  if args is None:
    args = {}
  if not isinstance(args, dict):
    return ToolCall(name, {}, error=f'"{key}" of tool \'{name}\' must be a JSON object, got a JSON {_kind(args)}')
  return ToolCall(name, args)


def _kind(value: Any) -> str:
  if isinstance(value, list):
    return "array"
  if isinstance(value, str):
    return "string"
  if isinstance(value, bool):
    return "boolean"
  if isinstance(value, (int, float)):
    return "number"
  if value is None:
    return "null"
  return type(value).__name__


def _parse_python(text: str) -> ToolCall | None:
  fence = "```"
  last: str | None = None
  pos = 0
  while True:
    open_ = text.find(fence, pos)
    if open_ < 0:
      break
    info_end = text.find("\n", open_ + len(fence))
    close = text.find(fence, open_ + len(fence))
    if close < 0:
      break  # an unclosed block: the call is not complete
    if info_end < 0 or info_end > close:  # a one-line block: ```python print(1)```
      lang, _, body = text[open_ + len(fence):close].strip().partition(" ")
    else:
      lang, body = text[open_ + len(fence):info_end].strip(), text[info_end + 1:close]
    if lang.split(" ")[0].lower() in _PY_LANGS:
      last = body
    pos = close + len(fence)
  if last is None:
    return None
  return ToolCall("python", {"code": last})
