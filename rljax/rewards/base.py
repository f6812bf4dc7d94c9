"""Verifier protocol, results and the name registry.

A verifier is a plain Python callable. Three kinds exist:

  item   fn(completion: str, example: Mapping, **kwargs) -> float | RewardResult
  group  fn(completions: list[str], example: Mapping, **kwargs) -> list[float | RewardResult]
         (the G completions of one prompt, for consensus or similarity rewards)
  batch  fn(completions: list[str], examples: list[Mapping], **kwargs) -> list[float | RewardResult]

`kwargs` are the component's configured kwargs. A verifier that names a parameter
`num_tokens` receives the completion's token count (a list for group/batch kinds),
and one that names `step` receives the training step.

Verifiers are registered by name with `register_verifier`, or referenced by an
import path "package.module:function" (which needs no registration).
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import numbers
import threading
from typing import Any, Callable, Mapping

from rljax.errors import ConfigError
from rljax.imports import import_object

KINDS = ("item", "group", "batch")
_ATTR = "__rljax_verifier__"
FLOAT32_MAX = 3.4028234663852886e38  # scores become float32: anything larger would turn into inf
_INT64 = (-(1 << 63), 1 << 63)


@dataclasses.dataclass(frozen=True)
class RewardResult:
  """A verifier's score with optional details.

  `info` values that are numbers (or bools) are averaged into the batch metrics as
  `info/<component>/<key>`; an `answer` string is reported as the extracted answer
  (`RewardBatch.answers`) for majority-vote evaluation.
  """
  score: float
  info: Mapping[str, Any] | None = None


@dataclasses.dataclass(frozen=True)
class ItemFailure:
  """What a verifier returns for an item it could not score (a group or batch verifier whose
  other items did score: a remote judge whose call for one item failed). The item gets the
  fallback and counts in `verifier/errors`, like an item whose verifier raised."""
  message: str


@dataclasses.dataclass(frozen=True)
class Verifier:
  """A resolved verifier: the callable plus how the runtime must call it."""
  name: str
  fn: Callable[..., Any]
  kind: str = "item"
  # Run in the calling process instead of a worker: only for cheap code that cannot hang.
  inline: bool = False
  # Modules a worker imports (and `warmup` it runs) once, before the pool forks workers.
  preload: tuple[str, ...] = ()
  warmup: Callable[[], Any] | None = None

  @property
  def wants_num_tokens(self) -> bool:
    return "num_tokens" in _param_names(self.fn)

  @property
  def wants_step(self) -> bool:
    return "step" in _param_names(self.fn)

  def check_kwargs(self, kwargs: Mapping[str, Any], where: str) -> None:
    """Raises ConfigError when `kwargs` names a parameter that the verifier does not take."""
    try:
      sig = inspect.signature(self.fn)
    except (TypeError, ValueError):
      return
    params = sig.parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
      return
    positional = list(params)[:2]
    reserved = {"num_tokens", "step"}
    accepted = {n for n, p in params.items()
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in positional and n not in reserved}
    for key in kwargs:
      if key not in accepted:
        raise ConfigError(f"{where}: verifier '{self.name}' takes no keyword argument '{key}'; "
                          f"it accepts {sorted(accepted) or 'none'}.")


  def check_signature(self, kwargs: Mapping[str, Any], where: str) -> None:
    """Raises ConfigError when the verifier cannot be called the way the pool calls it:
    fn(completion(s), example(s), **kwargs) plus num_tokens/step when it names them."""
    try:
      sig = inspect.signature(self.fn)
    except (TypeError, ValueError):
      return  # a builtin or extension without a signature: its first call tells
    extra = dict(kwargs)
    for name in ("num_tokens", "step"):
      if name in sig.parameters:
        extra[name] = None
    first, second = {"item": ("completion", "example"), "group": ("completions", "example"),
                     "batch": ("completions", "examples")}[self.kind]
    try:
      sig.bind(first, second, **extra)
    except TypeError as e:
      raise ConfigError(
          f"{where}: verifier '{self.name}' cannot be called as {getattr(self.fn, '__name__', 'fn')}({first}, "
          f"{second}{', **kwargs' if kwargs else ''}) ({e}); the signature is {self.fn.__name__}{sig}. A "
          f"{self.kind} verifier takes the {first} and the {second} as its first two positional parameters, e.g. "
          f"def my_check({first}, {second}, **kwargs).") from None


def _param_names(fn: Callable[..., Any]) -> set[str]:
  try:
    return set(inspect.signature(fn).parameters)
  except (TypeError, ValueError):
    return set()


_REGISTRY: dict[str, Verifier] = {}
_LOCK = threading.Lock()


def register_verifier(name: str | Callable[..., Any] | None = None, fn: Callable[..., Any] | None = None, *,
                      kind: str = "item", inline: bool = False, preload: tuple[str, ...] = (),
                      warmup: Callable[[], Any] | None = None, overwrite: bool = False):
  """Registers a verifier under `name`; usable as a decorator or a call.

      @register_verifier("my_check")
      def my_check(completion, example): ...

      @register_verifier(kind="group")       # name defaults to the function's name
      def agree(completions, example): ...

      register_verifier("other", some_function)

  Registering the same function twice (e.g. on re-import) is allowed; registering a
  different one under a taken name needs overwrite=True.
  """
  if kind not in KINDS:
    raise ConfigError(f"register_verifier: kind={kind!r} is not one of {KINDS}.")

  def decorate(f: Callable[..., Any], reg_name: str | None) -> Callable[..., Any]:
    reg_name = reg_name or getattr(f, "__name__", None)
    if not reg_name or ":" in reg_name:
      raise ConfigError(f"register_verifier: invalid verifier name {reg_name!r} (no ':' allowed).")
    v = Verifier(name=reg_name, fn=f, kind=kind, inline=inline, preload=tuple(preload), warmup=warmup)
    with _LOCK:
      old = _REGISTRY.get(reg_name)
      if old is not None and not overwrite and _qualname(old.fn) != _qualname(f):
        raise ConfigError(f"verifier name '{reg_name}' is already registered to {_qualname(old.fn)}; "
                          "pick another name or pass overwrite=True.")
      _REGISTRY[reg_name] = v
    try:
      setattr(f, _ATTR, dict(kind=kind, inline=inline, preload=tuple(preload), warmup=warmup))
    except (AttributeError, TypeError):
      pass  # e.g. a builtin or functools.partial without a __dict__
    return f

  if callable(name) and fn is None:  # bare @register_verifier
    return decorate(name, None)
  if fn is not None:
    return decorate(fn, name)  # type: ignore[arg-type]
  return lambda f: decorate(f, name)  # type: ignore[arg-type]


def _qualname(fn: Callable[..., Any]) -> str:
  return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def list_verifiers() -> list[str]:
  """Names of every registered verifier (built-ins included)."""
  _load_builtins()
  return sorted(_REGISTRY)


def get_verifier(ref: str | Callable[..., Any]) -> Verifier:
  """Resolves a registered name, an import path "module:function", or a callable.

  Raises:
    ConfigError: the name is not registered, or the import path does not resolve.
  """
  _load_builtins()
  if callable(ref):
    return _from_callable(getattr(ref, "__name__", repr(ref)), ref)
  if not isinstance(ref, str) or not ref:
    raise ConfigError(f"verifier must be a registered name, 'module:function' or a callable, got {ref!r}.")
  if ":" in ref:
    obj = import_object(ref, "verifier")
    return _from_callable(ref, obj)
  with _LOCK:
    v = _REGISTRY.get(ref)
  if v is None:
    raise ConfigError(f"unknown verifier '{ref}'; registered verifiers are {list_verifiers()}, "
                      "or give an import path 'package.module:function'.")
  return v


resolve = get_verifier


def _from_callable(name: str, fn: Callable[..., Any]) -> Verifier:
  meta = getattr(fn, _ATTR, None) or {}
  return Verifier(name=name, fn=fn, kind=meta.get("kind", "item"), inline=meta.get("inline", False),
                  preload=tuple(meta.get("preload", ())), warmup=meta.get("warmup"))


_BUILTINS_LOADED = False


def _load_builtins() -> None:
  global _BUILTINS_LOADED
  if not _BUILTINS_LOADED:
    _BUILTINS_LOADED = True
    importlib.import_module("rljax.rewards.verifiers")


def normalize_result(value: Any) -> tuple[float | None, dict[str, Any] | None]:
  """(score, info) from a verifier's return value; (None, {"error": message}) for an ItemFailure.

  Raises:
    TypeError: the value is not a number, bool or RewardResult, or its info is not a dict
      with string keys and representable numbers (see check_info).
    ValueError: the score is not finite in float32 (it is stored as float32).
  """
  info = None
  if isinstance(value, ItemFailure):
    return None, {"error": str(value.message)[:2000]}
  if isinstance(value, RewardResult):
    value, info = value.score, value.info
  elif isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], Mapping):
    value, info = value
  if isinstance(value, (str, bytes)) or value is None:
    raise TypeError(f"verifier returned {type(value).__name__}; expected a float or RewardResult")
  if isinstance(value, bool):
    score = float(value)
  else:
    try:
      score = float(value)
    except (TypeError, ValueError):
      raise TypeError(f"verifier returned {type(value).__name__}; expected a float or RewardResult") from None
    except OverflowError:
      raise ValueError(f"verifier returned a score too large for a float: {value}") from None
  if not math.isfinite(score) or abs(score) > FLOAT32_MAX:
    raise ValueError(f"verifier returned a score that is not finite in float32: {score}")
  return score, check_info(info)


def check_info(info: Mapping[str, Any] | None) -> dict[str, Any] | None:
  """A copy of a verifier's info dict, checked so that metrics can average its numbers.

  Numbers must be bools, ints in the int64 range or real numbers that convert to a float
  (NaN and inf are kept, and left out of the averages); other values (strings, lists, ...)
  are kept as they are and not averaged.

  Raises:
    TypeError: info is not a mapping, a key is not a string, or a number is not representable.
  """
  if info is None:
    return None
  if not isinstance(info, Mapping):
    raise TypeError(f"RewardResult.info must be a dict, got {type(info).__name__}")
  out = dict(info)
  for key, value in out.items():
    if not isinstance(key, str):
      raise TypeError(f"RewardResult.info keys must be strings, got {key!r}")
    if isinstance(value, bool) or not isinstance(value, numbers.Number):
      continue
    if isinstance(value, numbers.Integral):
      if not _INT64[0] <= int(value) < _INT64[1]:
        raise TypeError(f"RewardResult.info[{key!r}] = {value} is outside the int64 range")
      continue
    if not isinstance(value, numbers.Real):
      raise TypeError(f"RewardResult.info[{key!r}] is a {type(value).__name__}, not a real number")
    try:
      float(value)
    except (TypeError, ValueError, OverflowError):
      raise TypeError(f"RewardResult.info[{key!r}] = {value!r} does not convert to a float") from None
  return out
