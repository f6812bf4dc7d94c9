"""No silent phases: what a long-running command is doing, said every few seconds.

    with progress.Heartbeat():                        # the CLI, around a whole command
      with progress.phase("loading the model"):      # anywhere below it
        ...

The heartbeat is a daemon thread. While a phase (or an XLA compilation inside it) has run
longer than `quiet_s` seconds, it prints one line every `every_s` seconds on stderr, above any
progress bar: "rljax: compiling jit(step) (inside: step 1 of 24): 42 s so far". Compilations are
seen through JAX's own compile log (`jax_log_compiles`, whose lines it consumes instead of
printing them), so the line names the program being compiled. Progress bars registered with
`track` are redrawn on every tick when they draw on a terminal, so their elapsed time keeps
moving during a long step.
Without an active Heartbeat, `phase` and `track` do nothing.
"""
from __future__ import annotations

import contextlib
import logging
import re
import sys
import threading
import time

_ACTIVE: "Heartbeat | None" = None
_COMPILE_LOGGERS = ("jax._src.interpreters.pxla", "jax._src.dispatch")
_STARTED = re.compile(r"^Compiling (\S+)")
_FINISHED = re.compile(r"^Finished XLA compilation of (\S+)")
_CHATTER = ("Finished tracing", "Finished jaxpr to MLIR", "Compiling ", "Finished XLA compilation",
            "Persistent compilation cache hit", "Not writing persistent cache entry", "Writing ")


class _CompileLog(logging.Filter):
  """Reads JAX's compile log: which program is compiling since when; drops the lines it read."""

  def __init__(self, beat: "Heartbeat"):
    super().__init__()
    self.beat = beat

  def filter(self, record: logging.LogRecord) -> bool:
    if record.levelno != logging.WARNING:
      return True
    msg = record.getMessage()
    if (m := _STARTED.match(msg)) is not None:
      self.beat._compiling = (m.group(1), time.monotonic())
    elif _FINISHED.match(msg) is not None:
      self.beat._compiling = None
    return not msg.startswith(_CHATTER)


class Heartbeat:
  """Says what the process is doing while a phase takes long (see the module docstring)."""

  def __init__(self, enabled: bool = True, quiet_s: float = 10.0, every_s: float = 15.0, stream=None,
               compile_s: float = 2.0, tick_s: float = 1.0):
    self.enabled, self.tick_s = enabled, tick_s
    self.quiet_s, self.every_s, self.compile_s = quiet_s, every_s, compile_s
    self.stream = stream
    self._phases: list[tuple[str, float]] = []
    self._compiling: tuple[str, float] | None = None
    self._bars: list = []
    self._last_line = 0.0
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._filter = _CompileLog(self)
    self._log_compiles_before = None
    self._outer = None

  def __enter__(self) -> "Heartbeat":
    global _ACTIVE
    if not self.enabled:
      return self
    self._outer, _ACTIVE = _ACTIVE, self
    self._thread = threading.Thread(target=self._run, name="rljax-heartbeat", daemon=True)
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    global _ACTIVE
    if not self.enabled or self._thread is None:
      return
    self._stop.set()
    self._thread.join(timeout=5)
    if self._log_compiles_before is not None:
      for name in _COMPILE_LOGGERS:
        logging.getLogger(name).removeFilter(self._filter)
      import jax
      jax.config.update("jax_log_compiles", self._log_compiles_before)
    _ACTIVE = self._outer

  def _watch_compiles(self) -> None:
    """Turns on JAX's compile log and reads it (once, on the first phase: only code that uses JAX
    marks phases, so `--help` does not import it)."""
    if self._log_compiles_before is not None:
      return
    import jax
    self._log_compiles_before = bool(jax.config.jax_log_compiles)
    jax.config.update("jax_log_compiles", True)
    for name in _COMPILE_LOGGERS:
      logging.getLogger(name).addFilter(self._filter)

  # ---- what the process is doing ----------------------------------------------------------------

  @contextlib.contextmanager
  def phase(self, label: str):
    self._watch_compiles()
    entry = (label, time.monotonic())
    self._phases.append(entry)
    try:
      yield
    finally:
      if entry in self._phases:
        self._phases.remove(entry)

  def track(self, bar) -> None:
    self._bars.append(bar)

  def untrack(self, bar) -> None:
    if bar in self._bars:
      self._bars.remove(bar)

  def status(self, now: float | None = None) -> tuple[str, float] | None:
    """(what the process is doing, since when), or None outside any phase."""
    now = time.monotonic() if now is None else now
    phases, compiling = list(self._phases), self._compiling
    inside = f" (inside: {phases[-1][0]})" if phases else ""
    if compiling is not None and now - compiling[1] >= self.compile_s:
      return f"compiling {compiling[0]}{inside}", compiling[1]
    return phases[-1] if phases else None

  def _run(self) -> None:
    while not self._stop.wait(self.tick_s):
      now = time.monotonic()
      state = self.status(now)
      if state is not None and now - state[1] >= self.quiet_s and now - self._last_line >= self.every_s:
        self._last_line = now
        self._say(f"rljax: {state[0]}: {now - state[1]:.0f} s so far")
      for bar in list(self._bars):   # on a terminal only: in a log file every redraw would be a line
        try:
          if bar.fp.isatty():
            bar.refresh()
        except Exception:   # noqa: BLE001 - a bar closed between the copy and the call, or no isatty
          pass

  def _say(self, line: str) -> None:
    try:
      from tqdm.auto import tqdm
      tqdm.write(line, file=self.stream or sys.stderr)
    except Exception:   # noqa: BLE001 - never let the heartbeat break the run
      print(line, file=self.stream or sys.stderr, flush=True)


@contextlib.contextmanager
def phase(label: str):
  """Marks a phase for the active Heartbeat (a no-op without one)."""
  beat = _ACTIVE
  if beat is None:
    yield
    return
  with beat.phase(label):
    yield


def track(bar):
  """Registers a tqdm bar to be redrawn by the active Heartbeat; returns the bar."""
  if _ACTIVE is not None:
    _ACTIVE.track(bar)
  return bar


def untrack(bar) -> None:
  if _ACTIVE is not None:
    _ACTIVE.untrack(bar)
