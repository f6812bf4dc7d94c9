"""`rljax train | eval | export | generate`."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Sequence

from rljax.errors import RljaxError

USAGE = """usage: rljax <command> [options]

commands:
  train     train a policy: rljax train [--config configs/NAME.py] [--config.FIELD=VALUE ...]
            (no --config: the embedded default, SmolLM2-135M-Instruct + GRPO on arithmetic)
  eval      rljax eval --model X --data Y --verifier Z [--samples K] [--out FILE] [--tools T,...]
  export    rljax export --checkpoint DIR --out HF_DIR [--step N] [--dtype bfloat16|float32]
  generate  rljax generate [--model X] --prompt TEXT [--max-new-tokens N] [--temperature T]
"""


def _default_config_path() -> str:
  return os.path.join(os.path.dirname(__file__), "configs", "default.py")


def resolve_config(argv: Sequence[str]):
  """Loads --config (or the default recipe), applies --config.x=y overrides. Returns (config, rest)."""
  from rljax import config as config_lib
  from rljax.config_overrides import apply_overrides, load_config_file, split_config_args
  path, overrides, rest = split_config_args(argv)
  cfg = load_config_file(path or _default_config_path())
  apply_overrides(cfg, overrides)
  config_lib.validate(cfg)
  return cfg, rest


def cmd_train(argv: Sequence[str]) -> int:
  cfg, rest = resolve_config(argv)
  parser = argparse.ArgumentParser(prog="rljax train")
  parser.add_argument("--dry-run", action="store_true", help="validate, build everything, run no step")
  args = parser.parse_args(rest)
  from rljax.trainer.loop import Trainer
  trainer = Trainer(cfg)
  if args.dry_run:
    print(f"config OK; model {cfg.model.path} ({trainer.policy.config.num_params / 1e6:.1f}M params); "
          f"run dir {cfg.output.dir}")
    trainer.pool.close()
    return 0
  summary = trainer.run()
  _print_summary(summary)
  return 0


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
  out = rljax.generate(policy, prompt, sp, jax.random.key(args.seed), prompt_mask=mask)
  tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
  for r in range(tokens.shape[0]):
    print(json.dumps({"prompt": args.prompt[r // args.samples],
                      "completion": tok.decode(tokens[r, :lengths[r]].tolist())}, ensure_ascii=False))
  return 0


COMMANDS = {"train": cmd_train, "eval": cmd_eval, "export": cmd_export, "generate": cmd_generate}


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
  for noisy in ("absl", "jax._src", "orbax"):
    logging.getLogger(noisy).setLevel(logging.WARNING)
  if not argv or argv[0] in ("-h", "--help"):
    print(USAGE)
    return 0 if argv else 2
  command, rest = argv[0], argv[1:]
  if command not in COMMANDS:
    print(f"rljax: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2
  try:
    return COMMANDS[command](rest)
  except RljaxError as e:
    print(f"rljax {command}: error: {e}", file=sys.stderr)
    return 1


if __name__ == "__main__":
  sys.exit(main())
