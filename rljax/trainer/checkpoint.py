"""Checkpoints of a run: the `TrainState` arrays plus JSON extras, over orbax.

Layout of a checkpoint directory (one sub-directory per saved step)::

  <dir>/<step>/state/     TrainState arrays (orbax PyTree, OCDBT; sharding-agnostic)
  <dir>/<step>/extras/    the caller's JSON extras (data iterator state, config, ...)
  <dir>/<step>/format/    {"format": "rljax-checkpoint", "version": 1, ...}
  <dir>/<step>/metrics/   the metrics passed to `save` (used to keep the best step)

Orbax writes each step into `<step>.orbax-checkpoint-tmp-*` and renames it when
complete, so a save interrupted at any point leaves the earlier steps intact; the
leftover temporary directory is removed the next time a `Checkpointer` opens the
directory for writing. Restores read the arrays onto whatever shardings the caller
asks for, so a checkpoint saved on 8 devices restores on 1, and the reverse. A latest
checkpoint whose files were damaged afterwards (truncated arrays, corrupt metadata or
extras) is skipped on resume with a warning, and set aside as `<step>.rljax-unreadable`.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import time
from typing import Any, Mapping, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp

from rljax.errors import ConfigError
from rljax.trainer.checkpoint_parts import (
  CheckpointError,
  CheckpointUnreadable,
  KeepLastAndBest,
  as_abstract,
  first_line,
  leaves_by_path,
  metric_value,
  sample_names,
  to_json,
)

log = logging.getLogger(__name__)

FORMAT_NAME = "rljax-checkpoint"
FORMAT_VERSION = 1
# Keys of `extras` that the trainer writes and `export_checkpoint` reads.
EXTRAS_MODEL_CONFIG = "model_config"   # ModelConfig.to_hf() dict
EXTRAS_TOKENIZER = "tokenizer"         # what rljax.tokenizer.load_tokenizer accepts

_STATE, _EXTRAS, _FORMAT = "state", "extras", "format"
_STEP_RE = re.compile(r"^(0|[1-9]\d*)$")   # orbax's default step directory names
_REPLACED_SUFFIX = ".rljax-replaced"       # a step set aside while `save(force=True)` rewrites it
_UNREADABLE_SUFFIX = ".rljax-unreadable"   # a step set aside because its files cannot be read
_TMP_MARKER = ".orbax-checkpoint-tmp"


# ---- the checkpointer ------------------------------------------------------------------------


class Checkpointer:
  """Saves and restores a run's `TrainState` plus JSON extras in `directory`.

  Keeps the `keep_last` most recent steps and the `keep_best` best by `metrics[best_metric]`
  (`best_mode` "max" or "min"; steps saved without a finite value of that metric are not
  candidates). With `async_save`, `save` returns once the arrays are copied to host memory
  and the files are written in the background; `wait()` blocks until they are complete.
  `read_only=True` opens an existing directory for restoring only (nothing is created or
  cleaned up).
  """

  def __init__(self, directory: str | os.PathLike, *, keep_last: int = 3, keep_best: int = 1,
               best_metric: str | None = None, best_mode: str = "max", async_save: bool = True,
               read_only: bool = False):
    if int(keep_last) < 1:
      raise ConfigError(f"checkpoint.keep_last={keep_last!r} must be >= 1: the latest checkpoint is the one a run "
                        "resumes from.")
    if int(keep_best) < 0:
      raise ConfigError(f"checkpoint.keep_best={keep_best!r} must be >= 0 (0 keeps no extra best checkpoint).")
    if best_mode not in ("max", "min"):
      raise ConfigError(f"checkpoint.best_mode={best_mode!r} must be 'max' (higher is better) or 'min'.")
    self.directory = os.path.abspath(os.fspath(directory))
    self.read_only = read_only
    self.best_metric = best_metric or None
    if os.path.exists(self.directory) and not os.path.isdir(self.directory):
      raise CheckpointError(f"{self.directory} is a file, not a checkpoint directory; pass the directory that holds "
                            "the numbered step folders (e.g. <run dir>/checkpoints).")
    if read_only and not os.path.isdir(self.directory):
      raise CheckpointError(self._no_checkpoint_message())
    if not read_only:
      self._recover_replaced()
      self._refuse_foreign_steps()
    self._policy = KeepLastAndBest(int(keep_last), int(keep_best), self.best_metric, best_mode)
    options = ocp.CheckpointManagerOptions(
        preservation_policy=self._policy,
        # Orbax writes `metrics` only when a best_fn is set; retention itself is `_policy`'s.
        best_fn=lambda m: metric_value(m, self.best_metric) or 0.0,
        best_mode=best_mode,
        enable_async_checkpointing=async_save,
        create=not read_only,
        cleanup_tmp_directories=not read_only,
        read_only=read_only,
    )
    self._mgr = ocp.CheckpointManager(
        self.directory, item_names=(_STATE, _EXTRAS, _FORMAT),
        item_handlers={_STATE: ocp.PyTreeCheckpointHandler(), _EXTRAS: ocp.JsonCheckpointHandler(),
                       _FORMAT: ocp.JsonCheckpointHandler()},
        options=options)
    self._replaced: list[int] = []
    self._barriers = 0
    self._closed = False

  # ---- context manager ----

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __repr__(self) -> str:
    return f"Checkpointer({self.directory!r}, steps={self.all_steps()})"

  # ---- queries ----

  def _step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(int(step)))

  def _is_checkpoint(self, step: int) -> bool:
    d = self._step_dir(step)
    return (os.path.isfile(os.path.join(d, "_CHECKPOINT_METADATA")) and os.path.isdir(os.path.join(d, _STATE))
            and os.path.isdir(os.path.join(d, _FORMAT)))

  def _step_names(self) -> list[str]:
    try:
      return [n for n in os.listdir(self.directory) if _STEP_RE.match(n)]
    except FileNotFoundError:
      return []

  def all_steps(self) -> list[int]:
    """The steps with a complete checkpoint on disk, ascending (saves still in flight excluded)."""
    return sorted(int(n) for n in self._step_names() if self._is_checkpoint(int(n)))

  def latest_step(self) -> int | None:
    """The highest step with a complete checkpoint, or None when there is none."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def best_step(self) -> int | None:
    """The complete step with the best `best_metric`, or None (no metric configured or recorded)."""
    return self._policy.best_step({step: self._mgr.metrics(step) for step in self.all_steps()})

  def metrics(self, step: int) -> dict:
    """The metrics saved with `step` ({} when it was saved without)."""
    return dict(self._mgr.metrics(self._resolve_step(step)) or {})

  # ---- save ----

  def save(self, step: int, state: Any, *, extras: Mapping[str, Any] | None = None,
           metrics: Mapping[str, Any] | None = None, force: bool = False) -> bool:
    """Starts saving `state` (a TrainState or any pytree of jax arrays) as `step`.

    `extras` must be JSON-able; `metrics` (JSON-able, numbers for the best metric) decide which
    checkpoint is best. Returns False, saving nothing, when `step` already has a checkpoint or is
    below the latest one, unless `force`: then the step is saved anyway, and an existing checkpoint
    of that step is replaced (it is set aside until the new one is complete, so a crash never
    leaves the step missing).
    """
    if self.read_only:
      raise CheckpointError(f"{self.directory} was opened read-only; open it with Checkpointer(..., "
                            "read_only=False) to save.")
    step = int(step)
    extras = to_json({} if extras is None else extras, "extras")
    # Always a dict: orbax warns on every save without metrics once a best_fn is set.
    metrics = {} if metrics is None else to_json(metrics, "metrics")
    # Orbax waits for the previous save at the start of every save anyway; waiting here first
    # makes the on-disk step list below exact.
    self.wait()
    latest = self.latest_step()
    if self._is_checkpoint(step):
      if not force:
        log.info("checkpoint step %d already exists in %s; not saving it again (pass force=True to replace it)",
                 step, self.directory)
        return False
      self._set_aside(step)
    elif not force and latest is not None and step < latest:
      log.info("not saving step %d: %s already holds the later step %d (pass force=True to save anyway)",
               step, self.directory, latest)
      return False
    fmt = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "step": step, "saved_at_unix": time.time(),
           "has_ref_params": getattr(state, "ref_params", None) is not None}
    args = ocp.args.Composite(**{_STATE: ocp.args.PyTreeSave(state), _EXTRAS: ocp.args.JsonSave(extras),
                                 _FORMAT: ocp.args.JsonSave(fmt)})
    saved = self._mgr.save(step, args=args, metrics=metrics, force=True)
    log.info("checkpoint step %d %s in %s", step, "saving" if saved else "skipped", self.directory)
    return bool(saved)

  def _set_aside(self, step: int) -> None:
    src = self._step_dir(step)
    dst = src + _REPLACED_SUFFIX
    if jax.process_index() == 0:
      if os.path.exists(dst):
        shutil.rmtree(dst)
      os.rename(src, dst)
    self._barriers += 1  # orbax barrier names must be unique
    ocp.multihost.sync_global_processes(f"rljax_checkpoint_set_aside_{step}_{self._barriers}")
    self._mgr.reload()
    self._replaced.append(step)

  def _finish_replaced(self) -> None:
    """Removes set-aside copies whose replacement is complete."""
    pending = []
    for step in self._replaced:
      if self._is_checkpoint(step):
        if jax.process_index() == 0:
          shutil.rmtree(self._step_dir(step) + _REPLACED_SUFFIX, ignore_errors=True)
      else:
        pending.append(step)
    self._replaced = pending

  def _recover_replaced(self) -> None:
    """After a crash during `save(force=True)`: restore the set-aside copy if its replacement never completed."""
    if not os.path.isdir(self.directory) or jax.process_index() != 0:
      return
    for name in os.listdir(self.directory):
      if not (name.endswith(_REPLACED_SUFFIX) and _STEP_RE.match(name[:-len(_REPLACED_SUFFIX)])):
        continue
      step = int(name[:-len(_REPLACED_SUFFIX)])
      aside = os.path.join(self.directory, name)
      if self._is_checkpoint(step):
        shutil.rmtree(aside, ignore_errors=True)
      elif not os.path.exists(self._step_dir(step)):
        log.warning("restoring %s: the save that was replacing it did not complete", self._step_dir(step))
        os.rename(aside, self._step_dir(step))

  def _refuse_foreign_steps(self) -> None:
    """Step-named folders that are not checkpoints would be counted (and deleted) by orbax's retention."""
    foreign = [n for n in self._step_names() if not self._is_checkpoint(int(n))]
    if foreign:
      raise CheckpointError(
          f"{self.directory} holds {sample_names([os.path.join(self.directory, n) for n in foreign], 3)}, named like a "
          "checkpoint step but not an rljax checkpoint (no _CHECKPOINT_METADATA, state/ and format/). Checkpoint "
          "retention could delete it: move it out of the directory, or choose another checkpoint directory.")

  # ---- restore ----

  def _no_checkpoint_message(self) -> str:
    d = self.directory
    if not os.path.exists(d):
      return f"no checkpoint: {d} does not exist. Pass the run's checkpoint directory (e.g. <run dir>/checkpoints)."
    entries = sorted(os.listdir(d))
    if not entries:
      return f"no checkpoint: {d} is empty. Save one first, or pass the run's checkpoint directory."
    hints = []
    if os.path.isdir(os.path.join(d, "checkpoints")):
      hints.append(f"this looks like a run directory: did you mean {os.path.join(d, 'checkpoints')}?")
    if os.path.isfile(os.path.join(d, "config.json")):
      hints.append("this looks like a Hugging Face model directory, not an rljax checkpoint directory.")
    if any(_TMP_MARKER in e for e in entries):
      hints.append("it holds only interrupted (incomplete) saves.")
    foreign = [n for n in entries if _STEP_RE.match(n)]
    if foreign:
      hints.append(f"{sample_names(foreign, 3)} are named like steps but are not rljax checkpoints "
                   "(no _CHECKPOINT_METADATA, state/ and format/).")
    return (f"no checkpoint in {d} (it holds {sample_names(entries, 5)}). " + " ".join(hints)).strip()

  def _resolve_step(self, step: int | None) -> int:
    if step is None:
      latest = self.latest_step()
      if latest is None:
        raise CheckpointError(self._no_checkpoint_message())
      return latest
    step = int(step)
    if not self._is_checkpoint(step):
      steps = self.all_steps()
      if not steps:
        raise CheckpointError(self._no_checkpoint_message())
      what = "is not an rljax checkpoint" if os.path.exists(self._step_dir(step)) else "does not exist"
      raise CheckpointError(f"checkpoint step {step} {what} ({self._step_dir(step)}); the steps in "
                            f"{self.directory} are {steps}.")
    return step

  def _saved_leaves(self, step: int) -> dict[str, Any]:
    """{dotted name: orbax ArrayMetadata} of the arrays saved in `step`."""
    try:
      meta = self._mgr.item_metadata(step)[_STATE]
    except Exception as e:  # orbax raises several types for a corrupt metadata file; name the checkpoint.
      raise CheckpointUnreadable(f"could not read the array metadata of {self._step_dir(step)}: "
                                 f"{type(e).__name__}: {e}") from e
    if meta is None:
      raise CheckpointUnreadable(f"{self._step_dir(step)} has no readable array metadata")
    return leaves_by_path(getattr(meta, "tree", meta))

  def _check_target(self, step: int, target, *, allow_unused: Sequence[str] = ()) -> bool:
    """Checks `target` against what `step` holds; returns whether the checkpoint has leaves `target` drops."""
    saved = self._saved_leaves(step)
    want = leaves_by_path(target)
    where = self._step_dir(step)
    missing = [k for k in want if k not in saved]
    if missing:
      fix = ""
      if any(k.startswith("ref_params.") for k in missing):
        fix = (" The checkpoint was saved without reference parameters (KL coefficient 0): restore with "
               "abstract_state.replace(ref_params=None) and rebuild the reference from the base model.")
      raise CheckpointError(f"{where} has no {sample_names(missing)}; the state to restore does not match the saved "
                            f"one "
                            f"(different model, optimizer or settings?).{fix}")
    unused = [k for k in saved if k not in want]
    bad_unused = [k for k in unused if not any(k.startswith(p) for p in allow_unused)]
    if bad_unused:
      raise CheckpointError(f"{where} holds {sample_names(bad_unused)}, which the state to restore lacks (different "
                            "model or optimizer?). Restore with the abstract state of the run that saved it.")
    mismatched = [f"{k}: saved {tuple(saved[k].shape)} {np.dtype(saved[k].dtype).name}, expected "
                  f"{tuple(want[k].shape)} {np.dtype(want[k].dtype).name}"
                  for k in want if tuple(saved[k].shape) != tuple(want[k].shape)
                  or np.dtype(saved[k].dtype) != np.dtype(want[k].dtype)]
    if mismatched:
      raise CheckpointError(f"{where} does not match the state to restore: {'; '.join(mismatched[:4])}"
                            f"{' ...' if len(mismatched) > 4 else ''}. Restore with the model config and "
                            "optimizer of the run that saved it, or start a new run: a new config.output.dir, or "
                            "`rljax train ... --overwrite` to replace this one.")
    return bool(unused)

  def _restore_state_item(self, step: int, target, partial: bool, as_numpy: bool = False):
    restore_args = (jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target) if as_numpy
                    else ocp.checkpoint_utils.construct_restore_args(target))
    args = ocp.args.PyTreeRestore(target, restore_args=restore_args, partial_restore=partial)
    try:
      return self._mgr.restore(step, args=ocp.args.Composite(**{_STATE: args}))[_STATE]
    except Exception as e:  # orbax/tensorstore errors vary by version; name the checkpoint.
      raise CheckpointUnreadable(f"could not read the arrays of {self._step_dir(step)}: {type(e).__name__}: "
                                 f"{first_line(e)}") from e

  def restore(self, step: int | None = None, *, abstract_state, as_numpy: bool = False) -> tuple[Any, dict]:
    """Restores (state, extras) of `step` (default: the latest readable one).

    `abstract_state` is the state's pytree of `jax.ShapeDtypeStruct`s (or arrays) whose `.sharding`
    says where each array goes: the current mesh, whatever mesh saved it. A checkpoint holding
    reference parameters restores into a state whose `ref_params` is None (they are dropped).

    Without `step`, a latest checkpoint whose files cannot be read (truncated or corrupt arrays,
    metadata or extras) is skipped with a warning naming it and why, and the previous complete one
    is restored; in a writable directory the skipped steps are moved to `<step>.rljax-unreadable`
    so that the run saves its next steps normally. An explicit `step` is never replaced by another.
    `as_numpy`: host arrays instead (every process reads every array; the caller places them).
    """
    self.wait()
    target = as_abstract(abstract_state)
    if step is not None:
      return self._restore_step(self._resolve_step(step), target, as_numpy)
    steps = self.all_steps()
    if not steps:
      raise CheckpointError(self._no_checkpoint_message())
    skipped: list[tuple[int, CheckpointUnreadable]] = []
    for candidate in reversed(steps):
      try:
        out = self._restore_step(candidate, target, as_numpy)
      except CheckpointUnreadable as e:
        skipped.append((candidate, e))
        continue
      if skipped:
        self._skip_unreadable(skipped, candidate)
      return out
    raise CheckpointError(f"no checkpoint in {self.directory} can be read: "
                          + "; ".join(f"step {s}: {e}" for s, e in skipped)
                          + ". Start over (a new config.output.dir, or --overwrite), or restore the files.")

  def _restore_step(self, step: int, target, as_numpy: bool = False) -> tuple[Any, dict]:
    partial = self._check_target(step, target, allow_unused=("ref_params.",))
    state = self._restore_state_item(step, target, partial, as_numpy)
    return state, self._read_extras(step)

  def _skip_unreadable(self, skipped: list[tuple[int, CheckpointUnreadable]], used: int) -> None:
    """Warns about the unreadable steps above `used` and, when writable, sets them aside."""
    moved = not self.read_only
    if moved:
      if jax.process_index() == 0:
        for step, _ in skipped:
          dst = self._step_dir(step) + _UNREADABLE_SUFFIX
          if os.path.exists(dst):
            shutil.rmtree(dst)
          os.rename(self._step_dir(step), dst)
      self._barriers += 1
      ocp.multihost.sync_global_processes(f"rljax_checkpoint_unreadable_{used}_{self._barriers}")
      self._mgr.reload()
    for step, e in skipped:
      log.warning("checkpoint step %d in %s cannot be read, skipped%s: %s", step, self.directory,
                  f" (moved to {self._step_dir(step) + _UNREADABLE_SUFFIX})" if moved else "", e)
    log.warning("resuming from checkpoint step %d, the latest readable one in %s (skipped: %s)", used,
                self.directory, ", ".join(str(s) for s, _ in skipped))

  def restore_params(self, step: int | None = None, *, shardings=None):
    """Only the `params` subtree of `step`, as saved (dtype and shapes from the checkpoint).

    `shardings`: a pytree of shardings matching the params, one sharding for all, or None (the
    first local device). Reads no optimizer state.
    """
    self.wait()
    step = self._resolve_step(step)
    saved = self._mgr.item_metadata(step)[_STATE]
    tree = getattr(saved, "tree", saved)
    if not isinstance(tree, Mapping) or "params" not in tree:
      raise CheckpointError(f"{self._step_dir(step)} holds no 'params' subtree; it was not saved from a TrainState.")
    shapes = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), tree["params"])
    if shardings is None:
      shardings = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    if isinstance(shardings, jax.sharding.Sharding):
      target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shardings), shapes)
    else:
      target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)
    return self._restore_state_item(step, {"params": target}, partial=True)["params"]

  def restore_extras(self, step: int | None = None) -> dict:
    """The JSON extras of `step` (default: the latest step whose extras can be read); reads no arrays."""
    if step is None:
      steps = self.all_steps()
      if not steps:
        raise CheckpointError(self._no_checkpoint_message())
      for candidate in reversed(steps[1:]):
        try:
          return self._read_extras(candidate)
        except CheckpointUnreadable:
          continue  # restore() warns about it and falls back the same way
      return self._read_extras(steps[0])
    return self._read_extras(self._resolve_step(step))

  def _read_extras(self, step: int) -> dict:
    try:
      out = self._mgr.restore(step, args=ocp.args.Composite(**{_EXTRAS: ocp.args.JsonRestore()}))[_EXTRAS]
    except Exception as e:
      raise CheckpointUnreadable(f"could not read the extras of {self._step_dir(step)}: {type(e).__name__}: "
                                 f"{first_line(e)}") from e
    if out is not None and not isinstance(out, Mapping):
      raise CheckpointUnreadable(f"the extras of {self._step_dir(step)} are a {type(out).__name__}, not a dict")
    return dict(out or {})

  # ---- lifecycle ----

  def wait(self) -> None:
    """Blocks until every started save is complete (re-raises a failed background save)."""
    if self._closed:
      return
    self._mgr.wait_until_finished()
    self._finish_replaced()

  def close(self) -> None:
    """Waits for pending saves and releases orbax's threads. Idempotent."""
    if self._closed:
      return
    try:
      self.wait()
    finally:
      self._closed = True
      self._mgr.close()
