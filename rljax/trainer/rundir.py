"""Run-directory bookkeeping: what a run directory holds, and whether a new start may use it.

A run directory (`config.output.dir`) remembers the resolved config of the run that trains in
it (`config.json`, written when training starts; the latest checkpoint's copy stands in when it
is missing). Before anything is written, `check_resume` compares a new config with it:

  * no checkpoint yet: a fresh run (whatever an earlier, crashed attempt left is replaced);
  * a checkpoint and the same config: the run resumes from the latest checkpoint;
  * a checkpoint and a config that differs outside `RESUME_MAY_DIFFER`: a ConfigError listing the
    differing fields and the ways out (a new output.dir, or starting over);
  * a checkpoint at train.steps and `summary.json` (written when a run has done everything: its
    evaluation after training, the export, the summary): `RunFinished`, saying how to extend it;
  * a checkpoint at train.steps without `summary.json`: the run was stopped after its last
    checkpoint (killed during its final evaluation or export), and a new start completes it
    (`RunDir.finishing`).

Fields that may differ on resume (`RESUME_MAY_DIFFER`) change how a run is watched, kept or laid
out on devices, not what it trains: train.steps (to extend a run; a cosine or linear learning
rate schedule stretches to the new length), output.*, eval.*, the checkpoint cadence and
retention, mesh.* (checkpoints restore onto any mesh), model.remat and model.attention (memory
and kernels, same numbers), worker counts, optim.max_consecutive_skips and train.stop_signals.

Starting over (`checkpoint.resume=False`, or `rljax train --overwrite`) deletes the earlier run's
outputs by name (`RUN_OUTPUTS`), never the directory itself, and only once the new run is built:
`StartOver` first moves them aside into `.rljax-replaced/`, puts them back if the new start
fails (or is killed: `recover_replaced` on the next start), and deletes them only then.
Metrics of a resumed run are written once per step: `metrics_purge_step` and `purge_metrics`
drop the rows the resumed run will write again.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
import re
import shutil
from typing import Any, Mapping

from rljax.config.schema import base_config, flatten, to_json
from rljax.errors import ConfigError, RljaxError

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
CHECKPOINT_DIR = "checkpoints"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"        # written last: a run with it has done everything
REPLACED_DIR = ".rljax-replaced"     # an earlier run's outputs while a start over is being built
# What a run writes into its directory (globs); starting over deletes exactly these.
RUN_OUTPUTS = (CONFIG_FILE, CHECKPOINT_DIR, METRICS_FILE, "tb", "hf", "peft", "eval_*.jsonl", SUMMARY_FILE, "wandb",
               "wandb_run_id")

# Dotted field names (or section prefixes) that may change between a run and its resumption.
RESUME_MAY_DIFFER = (
    "train.steps",
    "output",
    "eval",
    "checkpoint.every", "checkpoint.keep_last", "checkpoint.keep_best", "checkpoint.async_save",
    "checkpoint.resume",
    "mesh",
    "model.remat", "model.attention",
    "rewards.num_workers", "tools.num_workers",
    "optim.max_consecutive_skips",
    "train.stop_signals",
)

_STEP_RE = re.compile(r"^(0|[1-9]\d*)$")


class RunFinished(RljaxError):
  """The run directory holds a run that already reached train.steps; the message says how to extend it."""


@dataclasses.dataclass(frozen=True)
class RunDir:
  """What `check_resume` found.

  out_dir: the run directory. latest_step: its latest complete checkpoint (None: none).
  resuming: training continues from latest_step. start_over: an earlier run's outputs are there
  and this start replaces them (checkpoint.resume=False or overwrite). previous: the earlier run's
  saved config (a dict), or None. finishing: the run reached train.steps but was stopped before
  it had done everything after its last step (no summary.json); resuming it completes that.
  """
  out_dir: str
  latest_step: int | None
  resuming: bool
  start_over: bool
  previous: dict | None
  finishing: bool = False


# ---- reading a run directory ------------------------------------------------------------------


def checkpoint_steps(out_dir: str) -> list[int]:
  """The steps with a complete checkpoint under `<out_dir>/checkpoints`, ascending (no orbax needed:
  a step is complete once orbax has written its `_CHECKPOINT_METADATA`)."""
  directory = os.path.join(out_dir, CHECKPOINT_DIR)
  try:
    names = os.listdir(directory)
  except (FileNotFoundError, NotADirectoryError):
    return []
  return sorted(int(n) for n in names if _STEP_RE.match(n)
                and os.path.isfile(os.path.join(directory, n, "_CHECKPOINT_METADATA")))


def latest_checkpoint_step(out_dir: str) -> int | None:
  steps = checkpoint_steps(out_dir)
  return steps[-1] if steps else None


def saved_config(out_dir: str) -> dict | None:
  """The resolved config the run in `out_dir` trained with: `config.json`, else the copy in the
  latest checkpoint's extras, else None."""
  candidates = [os.path.join(out_dir, CONFIG_FILE)]
  latest = latest_checkpoint_step(out_dir)
  if latest is not None:
    candidates.append(os.path.join(out_dir, CHECKPOINT_DIR, str(latest), "extras", "metadata"))
  for i, path in enumerate(candidates):
    try:
      with open(path, encoding="utf-8") as f:
        data = json.load(f)
    except (OSError, ValueError):
      continue
    data = data.get("config") if i > 0 and isinstance(data, dict) else data
    if isinstance(data, dict):
      return data
  return None


def config_dict(config) -> dict:
  """A config as the plain JSON dict that `config.json` holds."""
  return json.loads(to_json(config))


def write_config(config, out_dir: str | None = None) -> str:
  """Writes the resolved config to `<out_dir>/config.json` (call it when training starts, from the
  writing process only). Returns the path."""
  out_dir = out_dir or config.output.dir
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, CONFIG_FILE)
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(to_json(config))
  os.replace(tmp, path)
  return path


# ---- comparing configs -------------------------------------------------------------------------


def may_differ(field: str) -> bool:
  return any(field == f or field.startswith(f + ".") for f in RESUME_MAY_DIFFER)


def config_diff(old: Mapping, new: Mapping) -> list[tuple[str, Any, Any]]:
  """(field, old value, new value) for every field that differs and may not (RESUME_MAY_DIFFER).

  A field the old config lacks (added to rljax since) counts as its current default; a field
  the new schema lacks (removed since) is ignored.
  """
  defaults = flatten(config_dict(base_config()))
  before = {**defaults, **flatten(old)}
  after = flatten(new)
  return [(k, before.get(k), after[k]) for k in sorted(after)
          if not may_differ(k) and before.get(k, after[k]) != after[k]]


def _show(value: Any) -> str:
  text = json.dumps(value, sort_keys=True, default=str)
  return text if len(text) <= 120 else text[:117] + "..."


# ---- the checks before a start ------------------------------------------------------------------


def check_output_dir(out_dir: str) -> None:
  """A ConfigError naming config.output.dir when the directory cannot be created or written."""
  if not out_dir:
    raise ConfigError("config.output.dir is empty; set it to the directory the run writes to, e.g. runs/my-run.")
  path = os.path.abspath(out_dir)
  if os.path.exists(path) and not os.path.isdir(path):
    raise ConfigError(f"config.output.dir={out_dir!r} is a file, not a directory; point output.dir at a new "
                      "or existing directory, e.g. --config.output.dir=runs/my-run.")
  parent = path
  while not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    raise ConfigError(f"config.output.dir={out_dir!r} cannot be created: {parent} is a file, not a directory. "
                      "Choose another output.dir.")
  if not os.access(parent, os.W_OK | os.X_OK):
    raise ConfigError(f"config.output.dir={out_dir!r} cannot be written: no write permission on {parent}. "
                      "Choose another output.dir.")


def check_resume(config, out_dir: str | None = None, *, overwrite: bool = False,
                 allow_finished: bool = False) -> RunDir:
  """Decides how a run with `config` may start in its output directory; writes nothing.

  Raises:
    ConfigError: output.dir cannot be created; or it holds a run with another config (the message
      lists the differing fields); or checkpoint.resume=False without `overwrite` where a run's
      checkpoints are (with overwrite=False the caller may not delete them).
    RunFinished: the run there reached train.steps already (unless `allow_finished`).
  """
  out_dir = out_dir or config.output.dir
  check_output_dir(out_dir)
  latest = latest_checkpoint_step(out_dir)
  previous = saved_config(out_dir) if latest is not None else None
  if latest is None:
    return RunDir(out_dir, None, resuming=False, start_over=False, previous=previous)
  if overwrite:
    return RunDir(out_dir, latest, resuming=False, start_over=True, previous=previous)
  if not config.checkpoint.resume:
    raise ConfigError(
        f"config.checkpoint.resume=False, but {out_dir} holds the checkpoints of an earlier run (up to step "
        f"{latest}); new checkpoints would mix with them. Delete that run's outputs first ({_outputs_text()}; "
        f"`rljax train` does it with --overwrite or --config.checkpoint.resume=False), or pick a new "
        "output.dir.")
  if previous is not None:
    diff = config_diff(previous, config_dict(config))
    if diff:
      lines = "\n".join(f"  {k}: {_show(a)} -> {_show(b)}" for k, a, b in diff)
      raise ConfigError(
          f"{out_dir} holds a run (checkpoint at step {latest}) with a different config; resuming would "
          f"continue it with changed settings. The fields that differ (saved -> now):\n{lines}\n"
          f"Either train in a new directory (--config.output.dir=runs/NEW), or start over in this one, deleting "
          f"the earlier run (--overwrite, or --config.checkpoint.resume=False). Fields that may change on "
          f"resume: {', '.join(RESUME_MAY_DIFFER)}.")
  else:
    log.warning("%s has checkpoints but no saved config (%s); resuming without comparing configs.",
                out_dir, CONFIG_FILE)
  steps = config.train.steps
  finishing = latest == steps and finished_summary(out_dir, latest) is None
  if latest >= steps and not finishing and not allow_finished:
    raise RunFinished(
        f"the run in {out_dir} is finished: its latest checkpoint is step {latest} and train.steps={steps}, "
        f"so there is nothing to train. To train it further, raise train.steps (e.g. "
        f"--config.train.steps={latest + max(steps, 1)}); to train again from the start, add --overwrite; or "
        "pick a new output.dir.")
  return RunDir(out_dir, latest, resuming=True, start_over=False, previous=previous, finishing=finishing)


# ---- the end of a run ----------------------------------------------------------------------------


def finished_summary(out_dir: str, step: int | None = None) -> dict | None:
  """The summary a run wrote when it had done everything (`summary.json`), or None: none there, or
  one written before the run's checkpoint `step` (an earlier, shorter attempt's)."""
  try:
    with open(os.path.join(out_dir, SUMMARY_FILE), encoding="utf-8") as f:
      data = json.load(f)
  except (OSError, ValueError):
    return None
  if not isinstance(data, dict) or (step is not None and not data.get("step", -1) >= step):
    return None
  return data


def write_summary(out_dir: str, step: int, summary: Mapping[str, Any]) -> str:
  """Writes `summary.json` (the run's end: its step, the evaluations, where its outputs are), last of
  all a run writes: its presence marks a finished run. Returns the path."""
  path = os.path.join(out_dir, SUMMARY_FILE)
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump({"step": int(step), **summary}, f, indent=1, sort_keys=True, default=str)
  os.replace(tmp, path)
  return path


def logged_eval(metrics_path: str, step: int) -> dict[str, float] | None:
  """The evaluation logged at `step` in metrics.jsonl (`eval/x` -> `x`), or None: how a resumed run
  recovers its evaluation before training (step 0) for the summary."""
  try:
    with open(metrics_path, encoding="utf-8") as f:
      rows = [json.loads(line) for line in f if line.strip()]
  except (OSError, ValueError):
    return None
  found = {}
  for row in rows:
    if isinstance(row, dict) and row.get("step") == step:
      found.update({k[5:]: v for k, v in row.items() if k.startswith("eval/") and isinstance(v, (int, float))})
  return found or None


def _outputs_text() -> str:
  return ", ".join(RUN_OUTPUTS)


def run_outputs(out_dir: str) -> list[str]:
  """The paths of an earlier run's outputs in `out_dir` (see RUN_OUTPUTS)."""
  found = []
  for pattern in RUN_OUTPUTS:
    found += sorted(glob.glob(os.path.join(glob.escape(out_dir), pattern)))
  return found


class StartOver:
  """Replaces an earlier run's outputs without losing them to a start that fails.

  `set_aside()` moves the outputs (RUN_OUTPUTS) into `<out_dir>/.rljax-replaced/` (renames: no
  copy); `restore()` puts them back (the new start failed); `commit()` deletes them (the new run
  is built and about to write). A process killed in between leaves them set aside, and the next
  start puts them back (`recover_replaced`).
  """

  def __init__(self, out_dir: str):
    self.out_dir = out_dir
    self.aside = os.path.join(out_dir, REPLACED_DIR)
    self.moved: list[str] = []

  def set_aside(self) -> list[str]:
    """Moves the outputs aside; returns their names."""
    os.makedirs(self.aside, exist_ok=True)
    for path in run_outputs(self.out_dir):
      name = os.path.basename(path)
      os.replace(path, os.path.join(self.aside, name))
      self.moved.append(name)
    return list(self.moved)

  def restore(self) -> None:
    _restore_aside(self.out_dir)
    self.moved = []

  def commit(self) -> None:
    shutil.rmtree(self.aside, ignore_errors=True)
    self.moved = []


def _restore_aside(out_dir: str) -> list[str]:
  aside = os.path.join(out_dir, REPLACED_DIR)
  try:
    names = sorted(os.listdir(aside))
  except FileNotFoundError:
    return []
  restored = []
  for name in names:
    src, dst = os.path.join(aside, name), os.path.join(out_dir, name)
    if os.path.isdir(dst) and not os.path.islink(dst) and not os.listdir(dst):
      os.rmdir(dst)    # an empty directory the failed start made (e.g. checkpoints/)
    if not os.path.lexists(dst):
      os.replace(src, dst)
      restored.append(name)
  left = os.listdir(aside)
  if left:   # a name the failed start wrote again: keep both, and say where the earlier one is
    log.warning("%s: the earlier run's %s stay in %s (the same names exist in the run directory)", out_dir,
                ", ".join(sorted(left)), aside)
  else:
    os.rmdir(aside)
  return restored


def recover_replaced(out_dir: str) -> list[str]:
  """Puts back the outputs of an earlier run that a killed start-over had set aside (see
  `StartOver`); returns their names (empty: nothing was set aside)."""
  if not os.path.isdir(os.path.join(out_dir, REPLACED_DIR)):
    return []
  return _restore_aside(out_dir)


def clear_run(out_dir: str) -> list[str]:
  """Deletes an earlier run's outputs (RUN_OUTPUTS) from `out_dir`; other files stay. Returns them."""
  removed = run_outputs(out_dir)
  for path in removed:
    if os.path.isdir(path) and not os.path.islink(path):
      shutil.rmtree(path)
    else:
      os.remove(path)
  return removed


# ---- metrics written once per step --------------------------------------------------------------


def metrics_purge_step(start_step: int) -> int:
  """The first step whose metrics rows a run starting at `start_step` writes again.

  A fresh run (0) rewrites everything, the evaluation before training (step 0) included; a run
  resumed from the checkpoint of step N keeps rows up to N (that step and its evaluation were
  complete when the checkpoint was saved) and writes N+1 onwards.
  """
  return start_step + 1 if start_step > 0 else 0


def purge_metrics(path: str, purge_step: int) -> int:
  """Drops the rows of a metrics JSONL file with step >= purge_step (and unreadable lines, e.g. a
  line cut off by a crash). Returns how many rows were dropped."""
  if not os.path.isfile(path):
    return 0
  kept, dropped = [], 0
  with open(path, encoding="utf-8") as f:
    for line in f:
      if not line.strip():
        continue
      try:
        step = json.loads(line).get("step")
      except (ValueError, AttributeError):
        dropped += 1
        continue
      if isinstance(step, (int, float)) and step < purge_step:
        kept.append(line if line.endswith("\n") else line + "\n")
      else:
        dropped += 1
  if dropped:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      f.writelines(kept)
    os.replace(tmp, path)
  return dropped


def drop_eval_rows(path: str, step: int) -> int:
  """Drops the rows of metrics.jsonl at `step` that hold only evaluation figures (`eval/*`): a run
  completing its end logs its evaluation after training again. Returns how many were dropped."""
  if not os.path.isfile(path):
    return 0
  with open(path, encoding="utf-8") as f:
    lines = [line for line in f if line.strip()]
  kept = []
  for line in lines:
    try:
      row = json.loads(line)
    except ValueError:
      kept.append(line)
      continue
    if not (isinstance(row, dict) and row.get("step") == step and len(row) > 1
            and all(k == "step" or k.startswith("eval/") for k in row)):
      kept.append(line if line.endswith("\n") else line + "\n")
  if len(kept) != len(lines):
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      f.writelines(kept)
    os.replace(tmp, path)
  return len(lines) - len(kept)
