"""Chat templates: choosing one, and rendering it in a sandboxed jinja2 environment set up like transformers'.

`render_chat` is what `Tokenizer.apply_chat_template` calls; its output matches transformers'
`apply_chat_template(tokenize=False)` for the same template and inputs (the tokenizer tests compare them).
Where templates come from (tokenizer_config.json, chat_template.jinja, GGUF metadata) is the format loaders'
business; this module only sees template strings.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import json
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

from rljax.errors import TokenizerError

# Names under which messages carry reasoning text; templates read either `reasoning_content` or `thinking`.
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def select_template(own: str | Mapping[str, str] | None, chat_template: str | None, tools: Any,
                    source: str) -> str:
  """The template to render: `chat_template` (a template or a name in `own`), else the tokenizer's own.

  With several named templates, `tool_use` wins when tools are given and it exists, else `default`.
  """
  if isinstance(own, Mapping):
    if chat_template is not None:
      return own.get(chat_template, chat_template)
    if tools is not None and "tool_use" in own:
      return own["tool_use"]
    if "default" in own:
      return own["default"]
    raise TokenizerError(f"{source}: the tokenizer has several chat templates ({sorted(own)}) and none "
                         "is named 'default'; pass chat_template=<name>.")
  if chat_template is not None:
    return chat_template
  if own is None:
    raise TokenizerError(f"{source}: the tokenizer has no chat template; pass chat_template=... or load "
                         "a tokenizer that ships one (tokenizer_config.json, chat_template.jinja or GGUF "
                         "tokenizer.chat_template).")
  return own


def render_chat(template: str, messages: Sequence[Mapping[str, Any]], tools: Any, documents: Any,
                add_generation_prompt: bool, variables: Mapping[str, Any], source: str) -> str:
  """One conversation through `template`; `variables` (special tokens, kwargs) join the template context."""
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


# ----------------------------------------------------------------------------------------------------------------
# The jinja2 environment: transformers' settings, extensions and globals.
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


# ----------------------------------------------------------------------------------------------------------------
# Template inputs.
# ----------------------------------------------------------------------------------------------------------------


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
