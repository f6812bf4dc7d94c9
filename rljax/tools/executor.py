"""Running tool calls: isolated in the reward pool's worker processes.

    with ToolRunner(["calculator", "python", "search"],
                    tool_kwargs={"search": {"corpus_path": "wiki.jsonl"}}) as runner:
      prompt = tokenizer.apply_chat_template(messages, tools=runner.schemas(), ...)
      ...
      observations = runner.run([parse_tool_call(turn, "hermes") for turn in turns],
                                histories=python_cells_per_trajectory)

A tool call is scored like a completion by `execute_tool`, a verifier of the reward pool
(rljax/rewards/pool.py), so it gets the pool's guarantees: a worker process per call
stream, a per-call timeout (the worker is killed and replaced), crash isolation, a memory
limit, and a deadline for the whole batch. The tool's answer travels back in the result's
info dict (RewardBatch.infos).

Work done once, before the pool forks its workers: the tool modules are imported and each
tool's `warmup(**tool_kwargs)` hook runs (the search tool builds its BM25 index there), so
workers share it and a replaced worker does not redo it. This happens while the pool's
zygote unpickles the `preload` kwarg (see `_Preload`).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from typing import Any, Mapping, Sequence

from rljax.errors import ConfigError
from rljax.rewards import sandbox
from rljax.rewards.base import RewardResult, register_verifier
from rljax.tools.builtin import python as _builtin_python
from rljax.tools.parsing import ToolCall
from rljax.tools.registry import Tool, get_tool, validate_arguments

log = logging.getLogger("rljax.tools")

COMPONENT = "tool"
_TOOLSETS: dict[tuple[str, ...], dict[str, Tool]] = {}
_TOOLSETS_LOCK = threading.Lock()


def resolve_tools(tools: Sequence[Any]) -> dict[str, Tool]:
  """name -> Tool for a list of tool refs (cached per process for string refs).

  Raises:
    ConfigError: an unknown tool, or two tools with the same name.
  """
  if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
    raise ConfigError(f"tools must be a list of tool names or 'package.module:function' paths, got {tools!r}.")
  key = tuple(tools) if all(isinstance(t, str) for t in tools) else None
  if key is not None:
    with _TOOLSETS_LOCK:
      if key in _TOOLSETS:
        return _TOOLSETS[key]
  out: dict[str, Tool] = {}
  for ref in tools:
    tool = get_tool(ref)
    if tool.name in out:
      raise ConfigError(f"tools: two tools are named '{tool.name}' ({ref!r} and an earlier one); "
                        "tool names must be unique.")
    out[tool.name] = tool
  if key is not None:
    with _TOOLSETS_LOCK:
      _TOOLSETS[key] = out
  return out


def _to_text(value: Any) -> str:
  if isinstance(value, str):
    return value
  try:
    return json.dumps(value, ensure_ascii=False)
  except (TypeError, ValueError):
    return str(value)


def _describe(e: BaseException) -> str:
  msg = str(e)
  if isinstance(e, (ValueError, TimeoutError)) and msg:
    return msg
  return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def _cut(text: str, limit: int) -> str:
  if len(text) <= limit:
    return text
  return text[:limit] + f"\n... [observation truncated: {len(text) - limit} more characters]"


def _failure(message: str, start: float, max_chars: int, **extra: Any) -> RewardResult:
  return RewardResult(0.0, {"observation": _cut(f"Error: {message}", max_chars), "error": True,
                            "seconds": time.monotonic() - start, **extra})


def execute_tool(completion: str, example: Mapping[str, Any], *, tools: Sequence[str] = (),
                 tool_kwargs: Mapping[str, Mapping[str, Any]] | None = None, max_chars: int = 4000,
                 preload: Any = None) -> RewardResult:
  """Runs one tool call (an item verifier for the reward pool).

  Args:
    completion: JSON {"name": str, "arguments": {...}, "history": [str, ...]}; history
      (optional) is passed to tools that take a `history` parameter.
    example: unused (may be empty).
    tools: the allowed tools (refs for get_tool); a call of any other name fails.
    tool_kwargs: tool name -> configuration keyword arguments of that tool.
    max_chars: observations are cut to this many characters.
    preload: ignored here (see the module doc).
  Returns:
    RewardResult(1.0, {"observation": text, "error": False, "seconds": s}) on success;
    RewardResult(0.0, {"observation": "Error: ...", "error": True, "seconds": s,
    "timeout": bool}) when the call is malformed, names an unknown tool, has bad
    arguments, or the tool raised (TimeoutError sets "timeout").
  """
  del example, preload
  start = time.monotonic()
  try:
    call = json.loads(completion)
  except (json.JSONDecodeError, TypeError, RecursionError):
    return _failure("the tool call is not valid JSON", start, max_chars)
  if not isinstance(call, dict) or not isinstance(call.get("name"), str):
    return _failure('the tool call must be a JSON object with a "name"', start, max_chars)
  name, arguments, history = call["name"], call.get("arguments", {}), call.get("history") or []
  available = resolve_tools(list(tools))
  tool = available.get(name)
  if tool is None:
    return _failure(f"unknown tool '{name}'; available tools: {', '.join(sorted(available)) or 'none'}",
                    start, max_chars)
  problem = validate_arguments(tool, arguments)
  if problem is not None:
    return _failure(problem, start, max_chars)
  extra = dict((tool_kwargs or {}).get(tool.name) or {})
  if tool.wants_history:
    extra["history"] = list(history)
  try:
    value = tool.fn(**arguments, **extra)
  except TimeoutError as e:
    return _failure(_describe(e), start, max_chars, timeout=True)
  except Exception as e:  # noqa: BLE001 - any tool failure becomes an observation
    return _failure(_describe(e), start, max_chars)
  return RewardResult(1.0, {"observation": _cut(_to_text(value), max_chars), "error": False,
                            "seconds": time.monotonic() - start})


register_verifier("tool_executor", execute_tool, warmup=sandbox.isolation)


def _preload(tools: list[str], tool_kwargs: dict[str, dict[str, Any]]) -> _Preload:
  """Runs in the pool's zygote while it unpickles the component kwargs: imports the tools
  and runs their warm-up hooks, before any worker is forked."""
  for name, tool in resolve_tools(tools).items():
    warmup = getattr(tool.fn, "warmup", None)
    if callable(warmup):
      warmup(**dict(tool_kwargs.get(name) or {}))
  return _Preload(tools, tool_kwargs)


class _Preload:
  """A kwarg whose unpickling (in the pool's zygote) preloads the tools (see `_preload`)."""

  def __init__(self, tools: list[str], tool_kwargs: dict[str, dict[str, Any]]):
    self.tools, self.tool_kwargs = list(tools), dict(tool_kwargs)

  def __reduce__(self):
    return _preload, (self.tools, self.tool_kwargs)

  def __copy__(self) -> _Preload:  # copying must not preload (only unpickling in the zygote does)
    return self

  def __deepcopy__(self, memo) -> _Preload:
    return self


def _ref(tool: Any) -> str:
  """The import reference of a tool (workers resolve tools by reference)."""
  if isinstance(tool, str):
    return tool
  fn = tool.fn if isinstance(tool, Tool) else tool
  module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
  if not callable(fn) or not module or module == "__main__" or "<" in qualname:
    raise ConfigError(f"ToolRunner: tool {tool!r} cannot be sent to worker processes; give a registered name "
                      "or an import path 'package.module:function' of a module-level function.")
  return f"{module}:{qualname}"


@dataclasses.dataclass
class Observation:
  """What a tool call returned, as shown to the model.

  Attributes:
    text: the tool's output, or "Error: ..." when the call failed.
    error: whether the call failed (malformed call, unknown tool, bad arguments, the tool
      raised, timed out or crashed). An exception inside the model's own code run by the
      python tool is a normal output, not an error.
    seconds: how long the call ran.
  """
  text: str
  error: bool
  seconds: float


class ToolRunner:
  """Runs batches of tool calls in isolated worker processes.

  Args:
    tools: the tools the model may call: registered names ("calculator", "python",
      "search") or import paths "package.module:function".
    timeout_s: per-call limit; a call running longer is killed with its worker. The
      python tool's own (sandbox) timeout_s defaults to min(5, 0.8 * timeout_s).
    num_workers: worker processes; 0 runs the tools in this process (no isolation and no
      timeouts: only for trusted, pure tools such as the calculator).
    max_memory_mb: address-space limit of each worker.
    tool_kwargs: tool name -> configuration keyword arguments, e.g.
      {"search": {"corpus_path": "corpus.jsonl"}, "python": {"timeout_s": 3.0}}.
    batch_deadline_s: limit of one `run`; calls left unfinished get an error observation.
    max_observation_chars: observations are cut to this many characters.
  Raises:
    ConfigError: an unknown tool, tool_kwargs for a tool not in `tools` or with a keyword
      the tool does not take, or a tool's configuration check failed (e.g. a missing corpus).
  """

  def __init__(self, tools: Sequence[str], *, timeout_s: float = 10.0, num_workers: int = 2,
               max_memory_mb: int = 2048, tool_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
               batch_deadline_s: float = 60.0, max_observation_chars: int = 4000):
    from rljax.rewards.pool import RewardPool  # noqa: PLC0415 - keeps `import rljax.tools` light
    if isinstance(tools, str) or not isinstance(tools, Sequence) or not tools:
      raise ConfigError(f"ToolRunner: tools must be a non-empty list of tool names, got {tools!r}; "
                        f"e.g. ['calculator', 'python'].")
    for key, value, low in (("timeout_s", timeout_s, 0.0), ("batch_deadline_s", batch_deadline_s, 0.0)):
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > low:
        raise ConfigError(f"ToolRunner: {key} must be a positive number of seconds, got {value!r}.")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
      raise ConfigError(f"ToolRunner: num_workers must be an int >= 0 (0 runs tools in this process), "
                        f"got {num_workers!r}.")
    if isinstance(max_memory_mb, bool) or not isinstance(max_memory_mb, int) or max_memory_mb < 256:
      raise ConfigError(f"ToolRunner: max_memory_mb must be an int >= 256, got {max_memory_mb!r}.")
    refs = [_ref(t) for t in tools]
    self.tools = resolve_tools(refs)
    self.tool_kwargs = self._check_kwargs(tool_kwargs)
    python_tool = self.tools.get("python")
    if python_tool is not None and python_tool.fn is _builtin_python:
      # The sandbox's own limit ends a runaway cell before the pool kills the worker.
      self.tool_kwargs.setdefault("python", {}).setdefault("timeout_s", min(5.0, 0.8 * float(timeout_s)))
    if isinstance(max_observation_chars, bool) or not isinstance(max_observation_chars, int) \
        or max_observation_chars < 16:
      raise ConfigError(f"ToolRunner: max_observation_chars must be an int >= 16, got {max_observation_chars!r}.")
    self.timeout_s = float(timeout_s)
    self.metrics: dict[str, float] = {"calls": 0.0, "errors": 0.0, "parse_errors": 0.0, "timeouts": 0.0,
                                      "crashes": 0.0, "seconds": 0.0}
    self._lock = threading.Lock()
    self._closed = False
    kwargs = {"tools": refs, "tool_kwargs": self.tool_kwargs, "max_chars": max_observation_chars}
    if num_workers > 0:
      kwargs["preload"] = _Preload(kwargs["tools"], self.tool_kwargs)
    self.pool = RewardPool({
        "components": [{"name": COMPONENT, "verifier": "rljax.tools.executor:execute_tool", "kwargs": kwargs}],
        "timeout_s": timeout_s, "batch_deadline_s": batch_deadline_s, "num_workers": num_workers,
        "max_memory_mb": max_memory_mb, "fallback": 0.0})

  def _check_kwargs(self, tool_kwargs: Mapping[str, Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
    if tool_kwargs is None:
      tool_kwargs = {}
    if not isinstance(tool_kwargs, Mapping):
      raise ConfigError(f"ToolRunner: tool_kwargs must map tool names to dicts of keyword arguments, "
                        f"got {type(tool_kwargs).__name__}.")
    out: dict[str, dict[str, Any]] = {}
    for name, kw in tool_kwargs.items():
      if name not in self.tools:
        raise ConfigError(f"ToolRunner: tool_kwargs names '{name}', which is not among the tools "
                          f"{sorted(self.tools)}; add it to tools or remove its kwargs.")
      if not isinstance(kw, Mapping):
        raise ConfigError(f"ToolRunner: tool_kwargs['{name}'] must be a dict, got {type(kw).__name__}.")
      accepted = self.tools[name].config_params()
      if accepted is not None:
        unknown = sorted(set(kw) - accepted)
        if unknown:
          raise ConfigError(f"ToolRunner: tool '{name}' takes no configuration keyword(s) {unknown}; "
                            f"it accepts {sorted(accepted) or 'none'}.")
      out[name] = dict(kw)
    for name, tool in self.tools.items():
      check = getattr(tool.fn, "check_config", None)
      if callable(check):
        try:
          check(**out.get(name, {}))
        except (TypeError, ValueError) as e:
          raise ConfigError(f"ToolRunner: tool '{name}': {e}") from None
    return out

  def schemas(self) -> list[dict]:
    """The tools' function schemas, for `tokenizer.apply_chat_template(..., tools=...)`."""
    return [t.schema() for t in self.tools.values()]

  def run(self, calls: Sequence[ToolCall], histories: Sequence[Sequence[str]] | None = None) -> list[Observation]:
    """One Observation per call, in order; never raises for a malformed or hostile call.

    Args:
      calls: parsed calls (see parse_tool_call); those with `error` set are answered with
        the parse error without running anything.
      histories: per call, the code (the "code" argument) of the trajectory's earlier
        python calls, for the python tool's state; None: no history.
    """
    if histories is not None and len(histories) != len(calls):
      raise ValueError(f"got {len(calls)} calls but {len(histories)} histories; pass one history per call.")
    if self._closed:
      raise RuntimeError("ToolRunner.run called after close().")
    with self._lock:
      out: list[Observation | None] = [None] * len(calls)
      payloads, where = [], []
      for i, call in enumerate(calls):
        if call.error is not None:
          out[i] = Observation(f"Error: {call.error}", True, 0.0)
          self.metrics["parse_errors"] += 1
          continue
        history = list(histories[i]) if histories is not None else []
        try:
          payload = json.dumps({"name": call.name, "arguments": call.arguments, "history": history})
        except (TypeError, ValueError) as e:
          out[i] = Observation(f"Error: the arguments of tool '{call.name}' are not JSON data ({e})", True, 0.0)
          continue
        payloads.append(payload)
        where.append(i)
      if payloads:
        start = time.monotonic()
        try:
          batch = self.pool.score(payloads, [{}] * len(payloads))
          infos = batch.infos[COMPONENT]
        except (RuntimeError, OSError, ValueError) as e:
          log.error("tool runtime failure: %s", e)
          infos = [{"failure": "error", "message": f"the tool runtime failed ({e})"}] * len(payloads)
        elapsed = time.monotonic() - start
        for j, i in enumerate(where):
          out[i] = self._observation(calls[i].name, infos[j], elapsed)
      obs = [o for o in out if o is not None]
      self.metrics["calls"] += len(obs)
      self.metrics["errors"] += sum(o.error for o in obs)
      self.metrics["seconds"] += sum(o.seconds for o in obs)
      return obs

  def _observation(self, name: str, info: Mapping[str, Any] | None, elapsed: float) -> Observation:
    info = info or {}
    if "observation" in info:
      if info.get("timeout"):
        self.metrics["timeouts"] += 1
      return Observation(str(info["observation"]), bool(info.get("error")), float(info.get("seconds", 0.0)))
    failure = info.get("failure", "error")
    if failure == "timeout":
      self.metrics["timeouts"] += 1
      return Observation(f"Error: tool '{name}' timed out after {self.timeout_s:g} s", True, self.timeout_s)
    if failure == "crash":
      self.metrics["crashes"] += 1
      return Observation(f"Error: tool '{name}' crashed", True, elapsed)
    if failure == "deadline":
      self.metrics["timeouts"] += 1
      return Observation(f"Error: tool '{name}' did not run: the batch of tool calls ran out of time",
                         True, elapsed)
    return Observation(f"Error: tool '{name}' failed: {info.get('message', 'unknown error')}", True, elapsed)

  def close(self) -> None:
    """Stops the worker processes. Idempotent."""
    self._closed = True
    self.pool.close()

  def __enter__(self) -> ToolRunner:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
