"""`rljax train | eval | export | generate | config | plan`, and `rljax --version`.

Each command imports what it needs when it runs (jax, the trainer, the planner), so `rljax --help`,
`rljax --version` and a command's `--help` start in a fraction of a second.
"""
from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import logging
import os
import sys
from typing import Sequence

import rljax
from rljax import config as config_lib  # the package resolves its names on first use: no jax here
from rljax.errors import ConfigError, RljaxError

USAGE = """usage: rljax <command> [options]        (rljax <command> --help for each command's options)

commands:
  train     train a policy: rljax train [--config configs/NAME.py] [--config.FIELD=VALUE ...] [--dry-run]
            (no --config: the embedded default, SmolLM2-135M-Instruct + GRPO on arithmetic)
  eval      rljax eval --model X --data Y --verifier Z [--samples K] [--out FILE] [--tools T,...]
  export    rljax export --checkpoint DIR --out HF_DIR [--step N] [--dtype bfloat16|float32] [--format merged|peft]
  generate  rljax generate [--model X] --prompt TEXT [--max-new-tokens N] [--temperature T]
  config    rljax config show [--config FILE] [--config.FIELD=VALUE ...]: every field, its value, default and help
  plan      rljax plan --config FILE --topology v5p-8: will the run fit on a TPU slice, and what will it cost

  rljax --version   prints the installed version
"""

TRAIN_DESCRIPTION = """\
Train a policy with the run config built from, in this order:
  1. --config FILE: a recipe, a Python file whose get_config() returns the config (configs/*.py),
     or a gin file (.gin, as --gin_file); without it, the embedded default (configs/default.py);
  2. --gin_file FILE.gin (repeatable): gin bindings such as `train.steps = 24`, on top of
     rljax.config.base_config() when no --config is given (configs/default.gin is an example);
  3. --gin_bindings 'section.field = value' (repeatable);
  4. --config.FIELD=VALUE overrides (repeatable), e.g. --config.train.steps=5
     --config.rl.preset=dr_grpo --config.data.sources='[{"kind": "gsm8k", "path": {...}}]'.
     VALUE is a Python literal (5, 0.28, True, None, "text", [1, 2]) or plain text, and must
     have the field's type; `--config.FIELD VALUE` (a space) works too.
The result is validated before anything loads: an unknown field, a wrong type or a contradiction
stops with a message naming the field."""

TRAIN_EPILOG = """\
every field, with its value, default and help:
  rljax config show [--config FILE] [--config.FIELD=VALUE ...]

the run directory (config.output.dir) remembers its resolved config (config.json):
  - with a checkpoint there and the same config, training resumes from the latest checkpoint;
  - with a different config it stops and lists the fields that differ: train in a new directory
    (--config.output.dir=runs/NEW) or start over with --overwrite;
  - a finished run (its checkpoint reached train.steps) says so; raise train.steps to extend it.
  Fields that may differ on resume: train.steps, output.*, eval.*, checkpoint cadence and
  retention, mesh.*, model.remat, model.attention, worker counts, optim.max_consecutive_skips,
  train.stop_signals.
  - a run stopped after its last checkpoint (killed during its final evaluation or export)
    completes what it had not done.
  - one run per directory: a second start into a directory in use stops at once.

stopping: Ctrl-C (SIGINT) or SIGTERM stops after the step in progress with a checkpoint and
prints the command that resumes; a second one exits at once (config.train.stop_signals).

examples:
  rljax train                                           # the embedded default (README: Default run results)
  rljax train --config configs/smoke.py --config.train.steps=5
  rljax train --config configs/default.py --config.rl.preset=dr_grpo --dry-run
  rljax train --gin_file configs/default.gin --gin_bindings 'train.steps = 4'"""


def _train_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="rljax train", description=TRAIN_DESCRIPTION, epilog=TRAIN_EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", metavar="FILE", help="the recipe (.py with get_config(), or .gin); default: the "
                 "embedded default, configs/default.py")
  p.add_argument("--config.FIELD=VALUE", dest="_override_doc", metavar="", help="set one config field (see above)")
  p.add_argument("--gin_file", metavar="FILE", action="append", help="gin bindings file (repeatable)")
  p.add_argument("--gin_bindings", metavar="BINDING", action="append",
                 help="one gin binding, e.g. 'train.steps = 5' (repeatable)")
  p.add_argument("--dry-run", action="store_true",
                 help="validate, load the model, build everything, run no step, write nothing into the run dir")
  p.add_argument("--overwrite", action="store_true",
                 help="start over in an output.dir that holds an earlier run: delete its checkpoints, metrics, "
                      "evaluations and export first (the same as --config.checkpoint.resume=False)")
  return p


def _preflight(cfg) -> None:
  """The checks that need files but no weights (rljax/config/preflight.py: model path, context,
  tokenizer and chat template, data rows and prompt lengths), before the model loads."""
  from rljax.config.preflight import check_files
  for note in check_files(cfg):
    print(f"note: {note}", flush=True)


def _primary_process() -> bool:
  """Whether this is process 0 of a multi-process launch (read from the environment: jax.distributed
  is not initialized yet when the run directory is prepared)."""
  for var in ("JAX_PROCESS_ID", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
    if os.environ.get(var, "0").strip() not in ("", "0"):
      return False
  return True


def _resume_command(argv: Sequence[str]) -> str:
  """`rljax train ARGS` as given, less what would not resume (--overwrite, checkpoint.resume=False)."""
  import shlex
  keep, skip = [], False
  for a in argv:
    if skip:
      skip = False
      continue
    if a in ("--overwrite", "--dry-run"):
      continue
    if a.startswith("--config.checkpoint.resume"):
      skip = "=" not in a
      continue
    keep.append(a)
  return shlex.join(["rljax", "train", *keep])


def _real_start(cfg, overwrite: bool) -> str:
  """What `rljax train` without --dry-run would do with config.output.dir, in one sentence (reads only)."""
  from rljax.trainer import rundir
  from rljax.trainer.runlock import holder
  out = cfg.output.dir
  owner = holder(out)
  if owner is not None:
    return (f"a real start would stop now: {out} is in use by process {owner.get('pid', '?')} "
            f"({owner.get('command', '')})")
  try:
    run = rundir.check_resume(cfg, overwrite=overwrite)
  except rundir.RunFinished as e:
    return f"a real start would do nothing: {e}"
  except ConfigError as e:
    return f"a real start would stop here: {e}"
  if run.start_over:
    outputs = ", ".join(os.path.basename(p) for p in rundir.run_outputs(out))
    return (f"a real start would delete the earlier run's outputs in {out} (latest checkpoint: step "
            f"{run.latest_step}): "
            f"{outputs}")
  if run.finishing:
    return f"a real start would complete the run in {out} (it reached step {run.latest_step}; its end is missing)"
  if run.resuming:
    return f"a real start would resume {out} from step {run.latest_step}"
  return f"a real start would write to {out}"


def _dry_run(cfg) -> int:
  """Validates and builds the whole run as a fresh start in a temporary directory: the run
  directory is only read, whatever it holds (the note says what a real start would do there)."""
  import copy
  import tempfile
  note = _real_start(cfg, overwrite=not cfg.checkpoint.resume)
  _preflight(cfg)
  print("dry run: loading the model and building the run (in a temporary directory) ...", flush=True)
  from rljax.trainer.loop import Trainer
  with tempfile.TemporaryDirectory(prefix="rljax-dry-run-") as tmp:
    dry = copy.deepcopy(cfg)
    with dry.unlocked():
      dry.output.dir, dry.checkpoint.resume = tmp, False
    from rljax import progress
    with progress.phase("loading the model and building the run (dry run)"):
      trainer = Trainer(dry)
    try:
      mc = trainer.model_config
      size = f" ({mc.num_params / 1e6:.1f}M params)"
      if mc.lora is not None:
        import jax
        trainable = sum(x.size for x in jax.tree.leaves(trainer.state.params))
        size = f" ({mc.num_params / 1e6:.1f}M params frozen, {trainable / 1e6:.2f}M LoRA parameters trained)"
    finally:
      trainer.close()
  print(f"config OK; model {cfg.model.path}{size}; run dir {cfg.output.dir} (dry run: nothing written there)")
  print(f"dry run: {note}")
  return 0


def cmd_train(argv: Sequence[str]) -> int:
  from rljax import config as config_lib
  given = list(argv)
  gin_files, gin_bindings, argv = config_lib.split_gin_args(argv)
  path, overrides, rest = config_lib.split_config_args(argv)
  args = _train_parser().parse_args(rest)   # --help ends here, before anything loads
  cfg = config_lib.build_config(path, gin_files, gin_bindings, overrides)
  from rljax.trainer import rundir
  from rljax.trainer.runlock import RunLock
  if args.overwrite and cfg.checkpoint.resume:
    with cfg.checkpoint.unlocked():
      cfg.checkpoint.resume = False
  if args.dry_run:
    return _dry_run(cfg)
  # Everything that can be checked without the weights, before anything in the run dir is touched.
  rundir.check_resume(cfg, overwrite=not cfg.checkpoint.resume)
  _preflight(cfg)
  out = cfg.output.dir
  primary = _primary_process()   # the other processes of a multi-process launch leave the run dir to process 0
  existed = os.path.isdir(out)
  with RunLock(out) if primary else contextlib.nullcontext():
    if primary and (back := rundir.recover_replaced(out)):
      print(f"{out}: put back the earlier run's {', '.join(back)} (a start over was stopped before it began)")
    run = rundir.check_resume(cfg, overwrite=not cfg.checkpoint.resume)
    if run.finishing:
      where = (f"completing the run in {out}: it reached its last step ({run.latest_step}) but stopped before its "
               "end (evaluation after training, export, summary)")
    elif run.resuming:
      where = f"resuming {out} from step {run.latest_step}"
    else:
      where = f"writing to {out}"
    source = path or (", ".join(gin_files) if gin_files else "the embedded default (configs/default.py)")
    print(f"rljax train: {source}; model {cfg.model.path}; "
          f"{cfg.train.steps} steps of {cfg.train.prompts_per_step} prompts x {cfg.sampling.num_samples} samples, "
          f"rl.preset={cfg.rl.preset}, rollout.mode={cfg.rollout.mode}"
          f"{f', LoRA rank {cfg.model.lora.rank}' if cfg.model.lora.rank else ''}; {where}", flush=True)
    replaced = rundir.StartOver(out) if run.start_over and primary else None
    outputs = ", ".join(replaced.set_aside()) if replaced else ""
    print("loading the model and building the run ...", flush=True)
    from rljax import progress
    from rljax.trainer.loop import Interrupted, Trainer
    try:
      with progress.phase("loading the model and building the run"):
        trainer = Trainer(cfg)
    except BaseException:
      if replaced:
        replaced.restore()
        print(f"the start failed; the earlier run's outputs in {out} are kept ({outputs})", file=sys.stderr)
      elif not existed:
        _remove_empty_tree(out)
      raise
    if replaced:
      replaced.commit()
      print(f"starting over in {out}: deleted the earlier run's {outputs} (it had reached step {run.latest_step})",
            flush=True)
    try:
      summary = trainer.run()
    except Interrupted as e:
      import signal
      print(f"\nrljax train: {e}\n  resume with: {_resume_command(given)}", flush=True)
      return 130 if e.signum == signal.SIGINT else 0
  _print_summary(summary)
  return 0


def _remove_empty_tree(path: str) -> None:
  """Removes `path` if it holds only empty directories (what a start that failed early left)."""
  for root, dirs, files in os.walk(path, topdown=False):
    if files:
      return
    for d in dirs:
      try:
        os.rmdir(os.path.join(root, d))
      except OSError:
        return
  try:
    os.rmdir(path)
  except OSError:
    pass


def _print_summary(summary) -> None:
  def acc(tag):
    e = summary.get(tag)
    return "n/a" if not e else f"{100 * e['accuracy']:.1f}% +- {100 * e['accuracy_stderr']:.1f}"
  print("\n== rljax run finished ==")
  if "eval_before" in summary or "eval_after" in summary:
    print(f"held-out accuracy before: {acc('eval_before')}   after: {acc('eval_after')}")
  for key, label in (("metrics_file", "metrics (JSONL)"), ("checkpoint_dir", "checkpoints"),
                     ("hf_dir", "Hugging Face export")):
    if summary.get(key):
      print(f"{label:>22}: {summary[key]}")
  if summary.get("tensorboard_dir"):
    print(f"{'TensorBoard':>22}: tensorboard --logdir {summary['tensorboard_dir']}")
  if summary.get("wandb_dir"):
    print(f"{'Weights & Biases':>22}: {summary['wandb_dir']} (offline runs: wandb sync "
          f"{summary['wandb_dir']}/offline-run-*)")


def cmd_config(argv: Sequence[str]) -> int:
  """`rljax config show [--config FILE] [--gin_file F] [--config.FIELD=VALUE ...]`."""
  gin_files, gin_bindings, argv = config_lib.split_gin_args(argv)
  path, overrides, rest = config_lib.split_config_args(argv)
  parser = argparse.ArgumentParser(
      prog="rljax config", formatter_class=argparse.RawDescriptionHelpFormatter,
      description="show: print every config field as `name = value  # help`, with its default where the recipe "
                  "changes it. Takes the same --config FILE, --gin_file, --gin_bindings and --config.FIELD=VALUE "
                  "arguments as `rljax train`; without --config it shows the embedded default recipe.")
  parser.add_argument("action", choices=("show",))
  parser.add_argument("--config", metavar="FILE", help="the recipe (.py or .gin)")
  parser.parse_args(rest)
  cfg = config_lib.build_config(path, gin_files, gin_bindings, overrides, validate=False)
  source = path or ("rljax.config.base_config() + gin" if gin_files else
                    "the embedded default, configs/default.py")
  print(f"# rljax config of {source}; `(default X)` marks a value that differs from rljax.config.base_config().")
  print("# Override any field with --config.FIELD=VALUE (or a gin binding `FIELD = VALUE`).\n")
  print(config_lib.describe_fields(cfg), end="")
  try:
    config_lib.validate(cfg)
    print("\n# validation: OK")
  except ConfigError as e:
    print(f"\n# validation: {e}")
    return 1
  return 0


def cmd_plan(argv: Sequence[str]) -> int:
  """`rljax plan ...` (rljax/plan): imported only when asked for; it needs the TPU compiler."""
  try:
    import rljax.plan as plan
  except ModuleNotFoundError as e:
    if e.name and e.name.startswith("rljax.plan"):
      raise RljaxError("`rljax plan` is not part of this installation (the module rljax.plan is missing); "
                       "install a version of rljax that has it.") from None
    raise
  from rljax import progress
  with progress.phase("rljax plan: building and compiling the run's programs for the topology"):
    return int(plan.main(list(argv)) or 0)


def cmd_eval(argv: Sequence[str]) -> int:
  from rljax.trainer.evaluate import eval_main
  return eval_main(argv)


def cmd_export(argv: Sequence[str]) -> int:
  from rljax.trainer.export import export_main
  return export_main(argv)


def cmd_generate(argv: Sequence[str]) -> int:
  parser = argparse.ArgumentParser(prog="rljax generate")
  parser.add_argument("--model", default="smollm2-135m-instruct")
  parser.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
  parser.add_argument("--max-new-tokens", type=int, default=64)
  parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
  parser.add_argument("--samples", type=int, default=1)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--no-chat-template", action="store_true")
  args = parser.parse_args(argv)
  import jax
  import numpy as np

  import rljax
  from rljax import progress
  print(f"rljax generate: loading {args.model} ...", file=sys.stderr, flush=True)
  with progress.phase(f"loading {args.model}"):
    policy = rljax.load_pretrained(args.model)
  tok = policy.tokenizer
  texts = [p if args.no_chat_template else tok.apply_chat_template([{"role": "user", "content": p}],
                                                                      add_generation_prompt=True)
           for p in args.prompt]
  ids = [tok.encode(t) for t in texts]
  width = max(len(i) for i in ids)
  prompt = np.full((len(ids), width), tok.pad_id, np.int32)
  mask = np.zeros((len(ids), width), bool)
  for r, row in enumerate(ids):
    prompt[r, width - len(row):] = row
    mask[r, width - len(row):] = True
  sp = rljax.SamplingParams(num_samples=args.samples, max_new_tokens=args.max_new_tokens,
                            temperature=args.temperature or 1.0, greedy=args.temperature == 0,
                            stop_token_ids=tuple(tok.stop_ids))
  print(f"rljax generate: compiling the sampler and generating {len(ids) * args.samples} completion(s) of up to "
        f"{args.max_new_tokens} tokens ...", file=sys.stderr, flush=True)
  with progress.phase("generating (the first call compiles the sampler)"):
    out = rljax.generate(policy, prompt, sp, jax.random.key(args.seed), prompt_mask=mask)
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
  for r in range(tokens.shape[0]):
    print(json.dumps({"prompt": args.prompt[r // args.samples],
                      "completion": tok.decode(tokens[r, :lengths[r]].tolist())}, ensure_ascii=False))
  return 0


COMMANDS = {"train": cmd_train, "eval": cmd_eval, "export": cmd_export, "generate": cmd_generate,
            "config": cmd_config, "plan": cmd_plan}


def version() -> str:
  return rljax.__version__


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
  for noisy in ("absl", "jax._src", "orbax"):
    logging.getLogger(noisy).setLevel(logging.WARNING)
  if argv and argv[0] in ("--version", "-V"):
    print(f"rljax {version()}")
    return 0
  if not argv or argv[0] in ("-h", "--help", "help"):
    print(USAGE)
    return 0 if argv else 2
  command, rest = argv[0], argv[1:]
  if command not in COMMANDS:
    close = difflib.get_close_matches(command, list(COMMANDS), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    print(f"rljax: unknown command {command!r}.{hint}\n\n{USAGE}", file=sys.stderr)
    return 2
  if command != "plan":   # plan compiles for TPUs through libtpu; the others need no TPU plugin without a TPU
    from rljax.platforms import quiet_without_tpu
    quiet_without_tpu()
  _working_directory_importable()
  from rljax.progress import Heartbeat
  from rljax.trainer.rundir import RunFinished
  try:
    with Heartbeat(enabled=command != "config" and "--quiet" not in rest):
      return COMMANDS[command](rest)
  except RunFinished as e:
    print(f"rljax {command}: {e}")
    return 0
  except RljaxError as e:
    from rljax.trainer.rundir import RunFinished  # here, not at start-up: the run dir's module imports jax
    if isinstance(e, RunFinished):
      print(f"rljax {command}: {e}")
      return 0
    print(f"rljax {command}: error: {e}", file=sys.stderr)
    return 1
  except KeyboardInterrupt:
    print(f"\nrljax {command}: interrupted", file=sys.stderr)
    return 130


def _working_directory_importable() -> None:
  """Puts the working directory on sys.path, as `python -m` does, so `--config.rewards...verifier=
  my_verifiers:score` finds my_verifiers.py there from the `rljax` console script too (whose
  sys.path starts at its own bin directory). Reward workers inherit sys.path."""
  cwd = os.getcwd()
  if not any(p in ("", cwd) for p in sys.path):
    sys.path.insert(0, cwd)


if __name__ == "__main__":
  sys.exit(main())
