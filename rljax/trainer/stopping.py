"""Stopping a run on a signal: a checkpoint at the next step boundary, not a traceback.

    with StopSignals(("SIGINT", "SIGTERM")) as stop:
      for step in ...:
        ...
        if stop.stop_after(step):    # the one place that decides "stop after step N"
          save(); raise Interrupted

The first of the signals asks the loop to stop after the step it is in (`stop_after` turns
true at the next step boundary; an evaluation in progress ends early through `check`); a second
one exits the process at once (128 + the signal's number, as a shell reports a death by signal).

The signals are seen at once even while the main thread is inside a long XLA call, where Python
runs no signal handler until the call returns: the handler installed here does nothing, and the
C-level handler's `signal.set_wakeup_fd` byte wakes a watcher thread, which prints what will
happen and counts the signals (so a second Ctrl-C during a 10-minute step really exits at once).

Several processes must stop after the same step, or the ones still stepping wait forever in a
collective. `agree(step, requested_here) -> bool` makes them decide together: the trainer passes
`any_process_requested`, an all-gather of every process's flag after each step (a few bytes), so
a preemption notice that reaches one process of a pod stops all of them after the same step,
with one checkpoint they all wrote. Work that may end early on one process (`check`, the
evaluation) is not cut short in a multi-process run: that would leave the others in a
collective. Without `agree` the handlers are installed only in single-process runs.

That all-gather goes through the coordinator's key-value store, not a device collective, and
waits at most `train.process_deadline_s` for the others' flags (`reached_step` is the same round
without a flag): a process that hangs or died is named in a `ProcessDeadline` error on the others,
instead of every process waiting in a collective forever.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Callable, Sequence

from rljax.errors import ConfigError, RljaxError

log = logging.getLogger(__name__)

DEFAULT_SIGNALS = ("SIGINT", "SIGTERM")
UNCATCHABLE = ("SIGKILL", "SIGSTOP")


class StopRequested(RljaxError):
  """A stop signal arrived during work that is abandoned rather than finished (an evaluation)."""


def parse_signals(names: Sequence[str], field: str = "train.stop_signals") -> tuple[int, ...]:
  """Signal numbers of `names` ("SIGTERM", "TERM", "SIGUSR1", ...); a ConfigError naming `field`
  for a name that is not a catchable signal."""
  out = []
  for name in names:
    text = str(name).strip().upper()
    full = text if text.startswith("SIG") else "SIG" + text
    num = signal.Signals.__members__.get(full)
    if num is None or full in UNCATCHABLE:
      why = "cannot be caught" if full in UNCATCHABLE else "is not a signal name"
      raise ConfigError(f"config.{field} holds {name!r}, which {why}; use names such as 'SIGINT', 'SIGTERM', "
                        "'SIGUSR1' (or [] to keep the default behaviour: the process dies at once).")
    out.append(int(num))
  return tuple(dict.fromkeys(out))


class StopSignals:
  """Turns the first of `signals` into a stop request and the second into an immediate exit.

  `agree(step, requested_here) -> bool`: makes the processes of a multi-process run decide
  together (see the module docstring); None in a single-process run. `on_first(signum)` returns
  the line printed when the first signal arrives.
  """

  def __init__(self, signals: Sequence[str] = DEFAULT_SIGNALS, *,
               agree: Callable[[int, bool], bool] | None = None, multi_process: bool = False,
               on_first: Callable[[int], str] | None = None, stream=None):
    self.signals = parse_signals(signals)
    self.agree = agree
    self.multi_process = multi_process
    self.on_first = on_first or (lambda signum: f"{signal.Signals(signum).name} received: stopping")
    self.stream = stream
    self.signum: int | None = None          # the first stop signal received, if any
    self._event = threading.Event()
    self._installed: dict[int, object] = {}
    self._old_wakeup = -1
    self._pipe: tuple[int, int] | None = None
    self._thread: threading.Thread | None = None

  # ---- installing ---------------------------------------------------------------------------

  def __enter__(self) -> "StopSignals":
    if not self.signals:
      return self
    if threading.current_thread() is not threading.main_thread():
      log.info("stop signals not handled: the run is not in the main thread")
      return self
    if self.multi_process and self.agree is None:
      log.info("stop signals not handled: a multi-process run needs its processes to agree on the stop step")
      return self
    r, w = os.pipe()
    os.set_blocking(w, False)
    self._pipe = (r, w)
    self._old_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    for signum in self.signals:
      self._installed[signum] = signal.signal(signum, _ignore)
    self._thread = threading.Thread(target=self._watch, name="rljax-stop-signals", daemon=True)
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    if self._pipe is None:
      return
    for signum, old in self._installed.items():
      signal.signal(signum, old if old is not None else signal.SIG_DFL)
    self._installed = {}
    signal.set_wakeup_fd(self._old_wakeup)
    r, w = self._pipe
    self._pipe = None
    try:
      os.write(w, b"\0")        # wakes the watcher, which closes the read end
    except OSError:
      pass
    if self._thread is not None:
      self._thread.join(timeout=5)
    os.close(w)

  def _watch(self) -> None:
    r = self._pipe[0]
    try:
      while True:
        data = os.read(r, 64)
        if not data or 0 in data:
          return
        for signum in data:
          if signum in self.signals:
            self._received(signum)
    finally:
      os.close(r)

  def _received(self, signum: int) -> None:
    out = self.stream or sys.stderr
    if self.signum is None:
      self.signum = signum
      self._event.set()
      print(f"\n{self.on_first(signum)}", file=out, flush=True)
      return
    print(f"\n{signal.Signals(signum).name} again: exiting now, without saving (the latest checkpoint is "
          "kept).", file=out, flush=True)
    try:
      sys.stdout.flush()
    finally:
      os._exit(128 + signum)

  # ---- asking -------------------------------------------------------------------------------

  @property
  def requested(self) -> bool:
    """A stop signal reached this process."""
    return self._event.is_set()

  def check(self) -> None:
    """Raises StopRequested once a stop signal arrived (for work that may end early); never in a
    multi-process run, whose processes may only stop together (`stop_after`)."""
    if self._event.is_set() and not self.multi_process:
      raise StopRequested(f"stopped by {signal.Signals(self.signum).name}")

  def stop_after(self, step: int) -> bool:
    """Whether the run stops after `step` (counting from 1): this is where every process must decide
    the same, through `agree`, in a multi-process run."""
    here = self._event.is_set()
    return bool(self.agree(step, here)) if self.agree is not None else here


class ProcessDeadline(RljaxError):
  """Some processes of a multi-process run did not finish a step within train.process_deadline_s."""


def reached_step(step: int, deadline_s: float) -> None:
  """Announces that this process finished `step` and waits, at most `deadline_s` seconds, until
  every process has; raises ProcessDeadline naming the processes that had not. A host all-gather
  through the `jax.distributed` coordinator's key-value store (no device collective, so it can time
  out)."""
  _step_round(step, True, deadline_s)


def any_process_requested(step: int, requested_here: bool, deadline_s: float = 0.0) -> bool:
  """The `agree` of a multi-process run: whether a stop signal reached any process by the end of
  `step`. Every process must call it after every step (it is an all-gather across processes);
  with deadline_s > 0 the all-gather waits at most that long for every process to finish the step
  (as `reached_step`)."""
  return any(_step_round(step, bool(requested_here), deadline_s))


def _step_round(step: int, value, deadline_s: float) -> list:
  """Every process's `value` at the end of `step` (one key-value store round: no device program to
  wait behind), within deadline_s seconds when it is > 0, else ProcessDeadline."""
  import jax

  from rljax.sharding import GatherTimeout, allgather_objects
  try:
    return allgather_objects(value, timeout_s=deadline_s)
  except GatherTimeout as e:
    if deadline_s <= 0:
      raise
    raise ProcessDeadline(
        f"process(es) {e.missing} of {jax.process_count()} did not finish step {step} within "
        f"train.process_deadline_s={deadline_s:g} s (this is process {jax.process_index()}). A process that hangs "
        "or died is the cause: read its own log. One that is only slower (work on it alone, a slow host) needs a "
        "larger --config.train.process_deadline_s (0: no deadline). This process stops without saving step "
        f"{step}; a restart resumes from the last complete checkpoint.") from None


def _ignore(signum, frame) -> None:
  """The Python-level handler: the watcher thread does the work (see the module docstring)."""
