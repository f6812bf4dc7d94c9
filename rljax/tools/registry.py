"""Tools the model can call: their schemas, the name registry, and argument checks.

A tool is a Python function plus a JSON-schema description of its arguments:

    @register_tool("weather", description="Current weather of a city.",
                   parameters={"type": "object",
                               "properties": {"city": {"type": "string"}},
                               "required": ["city"]})
    def weather(city, *, api_url="http://localhost:8000"): ...

Which parameters are which:
  * the model's arguments: the names in `parameters["properties"]`;
  * `history`: when the function takes it, the executor passes the code/arguments of
    the trajectory's earlier calls to this tool (see rljax/tools/builtin.py: python);
  * everything else (keyword-only by convention): configuration, set per run with
    `tool_kwargs={"weather": {"api_url": ...}}` and never by the model.

`get_tool` resolves a registered name ("calculator", "search", "python") or an import
path "package.module:function" of a function decorated with `register_tool` or a plain
function, whose schema is then built from its signature (see `tool_from_function`).
"""
from __future__ import annotations

import copy
import dataclasses
import importlib
import inspect
import threading
import typing
from typing import Any, Callable, Mapping

from rljax.errors import ConfigError
from rljax.imports import import_object

_ATTR = "__rljax_tool__"
# Parameters that are never model arguments: filled in by the executor.
RESERVED_PARAMS = ("history",)
_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
               "array": (list,), "object": (dict,), "null": (type(None),)}


@dataclasses.dataclass(frozen=True)
class Tool:
  """A callable tool.

  Attributes:
    name: the name the model calls it by.
    fn: the function; called as fn(**arguments, **config) (plus history=[...] if it takes it).
    description: one or two sentences for the model.
    parameters: JSON schema of the arguments, {"type": "object", "properties": {...},
      "required": [...]}.
  """
  name: str
  fn: Callable[..., Any]
  description: str
  parameters: dict

  def schema(self) -> dict:
    """The OpenAI / Hugging Face function format, as `apply_chat_template(tools=[...])` takes it."""
    return {"type": "function",
            "function": {"name": self.name, "description": self.description,
                         "parameters": copy.deepcopy(self.parameters)}}

  @property
  def wants_history(self) -> bool:
    return "history" in _param_names(self.fn)

  def config_params(self) -> set[str] | None:
    """Names `tool_kwargs` may set (None: any, the function takes **kwargs)."""
    try:
      params = inspect.signature(self.fn).parameters
    except (TypeError, ValueError):
      return None
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
      return None
    model_args = set(self.parameters.get("properties", {}))
    return {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and n not in model_args and n not in RESERVED_PARAMS}


def _param_names(fn: Callable[..., Any]) -> set[str]:
  try:
    return set(inspect.signature(fn).parameters)
  except (TypeError, ValueError):
    return set()


def check_parameters(parameters: Any, where: str) -> dict:
  """Checks a JSON-schema argument object; returns a normalised copy (ConfigError if malformed)."""
  if not isinstance(parameters, Mapping):
    raise ConfigError(f"{where}: parameters must be a JSON-schema dict "
                      "{'type': 'object', 'properties': {...}, 'required': [...]}, "
                      f"got {type(parameters).__name__}.")
  out = copy.deepcopy(dict(parameters))
  out.setdefault("type", "object")
  out.setdefault("properties", {})
  out.setdefault("required", [])
  if out["type"] != "object":
    raise ConfigError(f"{where}: parameters['type'] must be 'object', got {out['type']!r}.")
  props = out["properties"]
  if not isinstance(props, Mapping) or not all(isinstance(k, str) and isinstance(v, Mapping)
                                               for k, v in props.items()):
    raise ConfigError(f"{where}: parameters['properties'] must map argument names to schema dicts "
                      "such as {'type': 'string', 'description': '...'}.")
  for key, prop in props.items():
    kind = prop.get("type")
    if kind is not None and kind not in _JSON_TYPES:
      raise ConfigError(f"{where}: argument '{key}' has type {kind!r}; use one of {sorted(_JSON_TYPES)}.")
  required = out["required"]
  if isinstance(required, str) or not all(isinstance(r, str) for r in required):
    raise ConfigError(f"{where}: parameters['required'] must be a list of argument names.")
  missing = [r for r in required if r not in props]
  if missing:
    raise ConfigError(f"{where}: required argument(s) {missing} are not in parameters['properties'].")
  for key in RESERVED_PARAMS:
    if key in props:
      raise ConfigError(f"{where}: '{key}' is reserved (the executor supplies it); rename the argument.")
  out["required"] = list(required)
  return out


_REGISTRY: dict[str, Tool] = {}
_LOCK = threading.Lock()


def _qualname(fn: Callable[..., Any]) -> str:
  return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def register_tool(name: str, *, description: str, parameters: Mapping[str, Any], overwrite: bool = False):
  """Decorator: registers the function as tool `name` (returns the function unchanged).

  Registering the same function again (e.g. on re-import) is allowed; a different one
  under a taken name needs overwrite=True.

  Raises:
    ConfigError: a malformed name, description or parameter schema, or a taken name.
  """
  if not isinstance(name, str) or not name or ":" in name or not name.replace("_", "a").replace("-", "a").isalnum():
    raise ConfigError(f"register_tool: invalid tool name {name!r}; use letters, digits, '_' and '-'.")
  if not isinstance(description, str) or not description.strip():
    raise ConfigError(f"register_tool('{name}'): description must be a non-empty string.")
  params = check_parameters(parameters, f"register_tool('{name}')")

  def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
    if not callable(fn):
      raise ConfigError(f"register_tool('{name}') must decorate a function, got {type(fn).__name__}.")
    tool = Tool(name=name, fn=fn, description=description.strip(), parameters=params)
    with _LOCK:
      old = _REGISTRY.get(name)
      if old is not None and not overwrite and _qualname(old.fn) != _qualname(fn):
        raise ConfigError(f"tool name '{name}' is already registered to {_qualname(old.fn)}; "
                          "pick another name or pass overwrite=True.")
      _REGISTRY[name] = tool
    try:
      setattr(fn, _ATTR, tool)
    except (AttributeError, TypeError):
      pass
    return fn

  return decorate


_BUILTINS_LOADED = False


def _load_builtins() -> None:
  global _BUILTINS_LOADED
  if not _BUILTINS_LOADED:
    _BUILTINS_LOADED = True
    importlib.import_module("rljax.tools.builtin")


def list_tools() -> list[str]:
  """Names of every registered tool (built-ins included)."""
  _load_builtins()
  with _LOCK:
    return sorted(_REGISTRY)


def get_tool(ref: str | Tool | Callable[..., Any]) -> Tool:
  """Resolves a registered name, an import path "package.module:function", a Tool or a function.

  Raises:
    ConfigError: the name is not registered, or the import path does not resolve.
  """
  _load_builtins()
  if isinstance(ref, Tool):
    return ref
  if callable(ref):
    return getattr(ref, _ATTR, None) or tool_from_function(ref)
  if not isinstance(ref, str) or not ref:
    raise ConfigError(f"a tool must be a registered name, 'package.module:function' or a function, got {ref!r}.")
  if ":" in ref:
    obj = import_object(ref, "tool")
    return getattr(obj, _ATTR, None) or tool_from_function(obj)
  with _LOCK:
    tool = _REGISTRY.get(ref)
  if tool is None:
    raise ConfigError(f"unknown tool '{ref}'; registered tools are {list_tools()}, "
                      "or give an import path 'package.module:function'.")
  return tool


_ANNOTATION_TYPES = {int: "integer", float: "number", bool: "boolean", str: "string",
                     "int": "integer", "float": "number", "bool": "boolean", "str": "string"}


def tool_from_function(fn: Callable[..., Any], name: str | None = None) -> Tool:
  """A Tool for a plain function, with the schema built from its signature.

  Positional-or-keyword parameters are the model's arguments: type "integer", "number" or
  "boolean" when annotated int, float or bool, else "string"; required when they have no
  default. Keyword-only parameters (and `history`) are configuration, not arguments. The
  description is the first line of the docstring.
  """
  name = name or getattr(fn, "__name__", None)
  if not name or not isinstance(name, str) or name == "<lambda>":
    raise ConfigError(f"cannot name the tool {fn!r}; use a named function or register_tool.")
  try:
    sig = inspect.signature(fn)
  except (TypeError, ValueError) as e:
    raise ConfigError(f"tool '{name}': cannot read the signature of {fn!r} ({e}); use register_tool.") from None
  try:
    hints = typing.get_type_hints(fn)
  except Exception:  # noqa: BLE001 - unresolvable string annotations: fall back to the raw ones
    hints = {}
  props: dict[str, dict] = {}
  required: list[str] = []
  for pname, p in sig.parameters.items():
    if p.kind is not p.POSITIONAL_OR_KEYWORD or pname in RESERVED_PARAMS:
      continue
    ann = hints.get(pname, p.annotation)
    kind = _ANNOTATION_TYPES.get(ann, "string") if isinstance(ann, (type, str)) else "string"
    props[pname] = {"type": kind}
    if p.default is p.empty:
      required.append(pname)
  doc = inspect.getdoc(fn) or ""
  description = doc.strip().splitlines()[0].strip() if doc.strip() else f"The function {name}."
  return Tool(name=name, fn=fn, description=description,
              parameters={"type": "object", "properties": props, "required": required})


def validate_arguments(tool: Tool, arguments: Any) -> str | None:
  """An error message for arguments that do not fit the tool's schema, else None.

  Checks: arguments is a dict; every required argument is present; no unknown argument;
  each value has its declared JSON type (string, integer, number, boolean, array, object;
  a bool is not an integer); numbers respect "minimum"/"maximum" and values "enum".
  """
  if not isinstance(arguments, dict):
    return f"arguments of tool '{tool.name}' must be a JSON object, got {type(arguments).__name__}"
  props = tool.parameters.get("properties", {})
  missing = [r for r in tool.parameters.get("required", []) if r not in arguments]
  if missing:
    return f"tool '{tool.name}' is missing required argument(s) {', '.join(repr(m) for m in missing)}"
  unknown = [k for k in arguments if k not in props]
  if unknown:
    return (f"tool '{tool.name}' has no argument(s) {', '.join(repr(u) for u in unknown)}; "
            f"its arguments are {', '.join(repr(p) for p in props) or 'none'}")
  for key, value in arguments.items():
    prop = props[key]
    kind = prop.get("type")
    if kind in _JSON_TYPES:
      ok = isinstance(value, _JSON_TYPES[kind]) and not (kind in ("integer", "number") and isinstance(value, bool))
      if kind == "number" and isinstance(value, float) and value != value:
        ok = False  # NaN
      if not ok:
        return f"argument '{key}' of tool '{tool.name}' must be of type {kind}, got {_json_type(value)}"
    if "enum" in prop and value not in prop["enum"]:
      return f"argument '{key}' of tool '{tool.name}' must be one of {prop['enum']}, got {value!r}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      if "minimum" in prop and value < prop["minimum"]:
        return f"argument '{key}' of tool '{tool.name}' must be >= {prop['minimum']}, got {value}"
      if "maximum" in prop and value > prop["maximum"]:
        return f"argument '{key}' of tool '{tool.name}' must be <= {prop['maximum']}, got {value}"
  return None


def _json_type(value: Any) -> str:
  if value is None:
    return "null"
  for name in ("boolean", "integer", "number", "string", "array", "object"):
    if isinstance(value, _JSON_TYPES[name]):
      return name
  return type(value).__name__
