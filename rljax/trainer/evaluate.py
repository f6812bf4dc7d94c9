"""Held-out evaluation: sample K completions per prompt, score them, report accuracy and pass@k.

Used by the trainer (before/after training and every `eval.every` steps) and by `rljax eval`.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import re
import sys
import time
from typing import Any, Callable

import jax
import numpy as np

from rljax import evaluation
from rljax.data import PromptBatcher
from rljax.errors import ConfigError, DataError
from rljax.rollout.sampler import records_routes, sample, shared_prefix_layout

DEFAULT_BATCH_ROWS = 128   # `rljax eval --batch-size`: completions decoded at once


# Prompts sharing fewer leading tokens than this are prefilled as they are (not worth a program).
MIN_SHARED_PREFIX = 8


def drop_common_padding(ids: np.ndarray, mask: np.ndarray, keep: int, width: int | None = None
                        ) -> tuple[np.ndarray, np.ndarray]:
  """Prompts [P, Lp] (left-padded after their first `keep` columns, which stay) without the columns
  after `keep` that are padding in every row: [P, width] when the rows fit in `width` (one compiled
  program for every batch of an evaluation), else [P, Lp] as given; the narrowest that holds the
  rows when `width` is None. A prompt's tokens keep their order and positions (positions count
  real tokens), so the completions are those of the padded prompts up to float32 reordering."""
  tail = int(mask[:, keep:].sum(1).max()) if mask.shape[1] > keep else 0
  want = keep + tail if width is None else width
  drop = ids.shape[1] - want
  if want < keep + tail or drop <= 0 or mask[:, keep:keep + drop].any():   # (right-padded rows: as given)
    return ids, mask
  return (np.concatenate([ids[:, :keep], ids[:, keep + drop:]], 1),
          np.concatenate([mask[:, :keep], mask[:, keep + drop:]], 1))


@functools.lru_cache(maxsize=8)
def _sample_fn(config, sp, shared_prefix: int = 0):
  """The jitted sampler of one model config and SamplingParams, kept: the trainer's evaluations
  (before, every eval.every steps, after) reuse its compiled programs instead of compiling anew.
  shared_prefix: the prompts' shared leading tokens, prefilled once (`rollout.sampler.sample`)."""
  def eval_sample(params, ids, mask, key):
    return sample(config, params, ids, mask, sp, key, eos_ids=tuple(sp.stop_token_ids), shared_prefix=shared_prefix)
  return jax.jit(eval_sample)


def prompts_per_batch(batch_rows: int, samples: int, num_examples: int) -> int:
  """Prompts decoded at once: `batch_rows` completions' worth (at least one prompt), no more than
  the examples asked for."""
  return max(1, min(batch_rows // max(samples, 1), num_examples))


def evaluate_policy(model_config, params, tokenizer, dataset, pool, *, num_examples: int, samples: int, sampling,
                    max_prompt_tokens: int, batch_prompts: int = 8, out_path: str | None = None,
                    seed: int = 0, distinct: bool = True, tool_rollout=None, prompt_tools=None,
                    label: str | None = None, progress: bool = False,
                    stop: Callable[[], None] | None = None, shared_prefix: bool = True) -> dict[str, Any]:
  """Scores `samples` completions for each of the first `num_examples` examples of `dataset`.

  Returns accuracy (mean score>0.5 of the first reward component over all samples) with its
  standard error over examples, mean@k, pass@k (unbiased estimator) and maj@k for k = samples,
  plus pass@1. Writes one JSON line per example to `out_path`. With `distinct`, repeated prompts
  are skipped, so a small procedural problem space is not scored twice on the same problem.
  With `tool_rollout(sampling) -> ToolRollout`, completions are multi-turn trajectories (tool
  calls answered mid-generation, the responses included in the text the verifier sees), the
  prompts carry `prompt_tools` schemas, and each example records `tool_calls` and `tool_errors`
  per completion (summarized as `tool_calls_per_completion` and `tool_error_rate`).

  `batch_prompts` prompts are decoded at once (the last batch padded to that shape). Greedy
  results do not depend on it (each row's computation is its own); sampled ones do, as each
  batch draws from its own key. The metrics include `tokens_per_s`: generated tokens over the
  time spent generating, compilation excluded. `stop()` is called between batches; what it
  raises (trainer/stopping.py's StopRequested) ends the evaluation early.

  With `shared_prefix` (the default), the leading tokens that every prompt of a batch shares (a
  chat template's system prompt, few-shot examples; at least MIN_SHARED_PREFIX of them) are
  prefilled once for the batch instead of once per prompt; the completions are those of the plain
  prefill up to float32 reordering. Not with tools or routing replay.

  With `progress`, a line says what is evaluated (under `label`, e.g. "eval before training"), a
  progress bar counts the examples, and the result is printed when it ends (all on stderr), so a
  long evaluation is never a silent one.
  """
  from rljax import compile_stats, progress as heartbeat
  label = label or "eval"
  batch_prompts = max(1, min(batch_prompts, num_examples))
  bar = _Progress(label, num_examples, samples, enabled=progress)
  compile_stats.install()
  batcher = PromptBatcher(dataset, tokenizer, prompts_per_batch=batch_prompts, max_prompt_tokens=max_prompt_tokens,
                          pad_to_max_prompt_tokens=True, drop_remainder=False, distinct=distinct, tools=prompt_tools)
  # The prompts' common leading tokens (a system prompt, few-shot examples) are prefilled once. The
  # first batch's count is kept for every batch (one compiled program); a batch sharing fewer goes plain.
  share = shared_prefix and tool_rollout is None and not records_routes(model_config)
  shared_len, trimmed_width = None, None
  if tool_rollout is None:
    run = lambda params, ids, mask, key, s: _sample_fn(model_config, sampling, s)(params, ids, mask, key)
  else:
    engine = tool_rollout(sampling)
    run = lambda params, ids, mask, key, s: engine.run(params, ids, mask, key)[1].trajectories
  key = jax.random.key(seed)
  per_example: list[dict[str, Any]] = []
  tokens_made, seconds = 0, 0.0
  compiled_before = compile_stats.counts()["compile_seconds"]
  for batch in batcher:
    if stop is not None:
      stop()
    n = batch.prompt_ids.shape[0]
    ids, mask = batch.prompt_ids, batch.prompt_mask
    if n < batch_prompts:  # pad the last batch to the compiled shape
      ids = np.concatenate([ids, np.repeat(ids[-1:], batch_prompts - n, 0)])
      mask = np.concatenate([mask, np.repeat(mask[-1:], batch_prompts - n, 0)])
    s = 0
    if share:
      laid_ids, laid_mask, s = shared_prefix_layout(ids, mask, MIN_SHARED_PREFIX, shared_len)
      shared_len = s if shared_len is None else shared_len
      if s:
        ids, mask = laid_ids, laid_mask
    if tool_rollout is None:   # no prefill over columns that are padding in every row
      ids, mask = drop_common_padding(ids, mask, s, trimmed_width)
      trimmed_width = trimmed_width or ids.shape[1]
    key, sub = jax.random.split(key)
    start = time.perf_counter()
    with heartbeat.phase(f"{label}: generating {n * samples} completions"):
      out = jax.device_get(run(params, ids, mask, sub, s))
    seconds += time.perf_counter() - start
    rows = n * samples
    tokens, lengths = np.asarray(out.tokens)[:rows], np.asarray(out.lengths)[:rows]
    tokens_made += int(np.asarray(out.lengths).sum())    # the padding rows were generated too
    texts = tokenizer.batch_decode([tokens[r, :lengths[r]].tolist() for r in range(rows)])
    examples = [batch.examples[r // samples] for r in range(rows)]
    scored = pool.score(texts, examples, num_tokens=lengths.tolist(), group_size=samples)
    first = next(iter(scored.components))
    correct = np.asarray(scored.components[first]) > 0.5
    answers = scored.answers if getattr(scored, "answers", None) is not None else [t.strip() for t in texts]
    for i in range(n):
      sl = slice(i * samples, (i + 1) * samples)
      ex = batch.examples[i]
      per_example.append({
          "id": ex.get("id"), "prompt": ex.get("prompt"), "answer": ex.get("answer"),
          "completions": texts[sl], "rewards": np.asarray(scored.rewards)[sl].tolist(),
          "correct": correct[sl].tolist(), "answers": list(answers[sl]),
      })
      if tool_rollout is not None:
        per_example[-1].update(tool_calls=np.asarray(out.turns)[sl].tolist(),
                               tool_errors=np.asarray(out.tool_errors)[sl].tolist())
      if len(per_example) >= num_examples:
        break
    bar.update(min(n, num_examples - bar.done))
    if len(per_example) >= num_examples:
      break
  metrics = summarize(per_example, samples, out_path)
  generating = seconds - (compile_stats.counts()["compile_seconds"] - compiled_before)
  if per_example:
    metrics["tokens_per_s"] = float(tokens_made / max(generating, 1e-9))
    metrics["generate_seconds"] = float(seconds)
    metrics["shared_prefix_tokens"] = int(shared_len or 0)   # prefilled once per batch (0: none)
  bar.close(metrics, out_path)
  return metrics


def format_result(metrics: dict[str, Any]) -> str:
  """One line of an evaluation's figures: accuracy +- its standard error, and pass@k / maj@k."""
  n = int(metrics.get("num_examples", 0))
  if not n:
    return "no examples evaluated"
  parts = [f"accuracy {100 * metrics['accuracy']:.1f}% +- {100 * metrics['accuracy_stderr']:.1f} over {n} examples"]
  parts += [f"{k} {100 * v:.1f}%" for k, v in metrics.items() if k.startswith(("pass@", "maj@")) and k != "pass@1"]
  if "tokens_per_s" in metrics:
    parts.append(f"{metrics['tokens_per_s']:.0f} generated tokens/s")
  return ", ".join(parts)


class _Progress:
  """The evaluation's announcement, progress bar and result line, on stderr (a no-op when disabled)."""

  def __init__(self, label: str, num_examples: int, samples: int, enabled: bool):
    self.label, self.done, self._bar = label, 0, None
    if not enabled:
      return
    from tqdm.auto import tqdm
    print(f"{label}: scoring {samples} completion{'s' if samples > 1 else ''} for each of up to {num_examples} "
          "held-out examples ...", file=sys.stderr, flush=True)
    from rljax import progress
    self._bar = progress.track(tqdm(total=num_examples, desc=label, unit="example", file=sys.stderr,
                                    dynamic_ncols=True))

  def update(self, n: int) -> None:
    self.done += n
    if self._bar is not None:
      self._bar.update(n)

  def close(self, metrics: dict[str, Any], out_path: str | None) -> None:
    if self._bar is None:
      return
    from rljax import progress
    progress.untrack(self._bar)
    self._bar.close()
    where = f" (per example: {out_path})" if out_path else ""
    print(f"{self.label}: {format_result(metrics)}{where}", file=sys.stderr, flush=True)


def summarize(per_example: list[dict[str, Any]], samples: int, out_path: str | None = None) -> dict[str, Any]:
  """Aggregate metrics of per-example results (see `evaluate_policy`)."""
  n = len(per_example)
  if n == 0:
    return {"num_examples": 0.0}
  frac = np.asarray([np.mean(e["correct"]) for e in per_example], np.float64)
  counts = [int(np.sum(e["correct"])) for e in per_example]
  metrics: dict[str, Any] = {
      "num_examples": float(n),
      "accuracy": float(frac.mean()),
      "accuracy_stderr": float(frac.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0,
      f"mean@{samples}": float(frac.mean()),
      "pass@1": float(np.mean([evaluation.pass_at_k(samples, c, 1) for c in counts])),
  }
  if samples > 1:
    metrics[f"pass@{samples}"] = float(np.mean([evaluation.pass_at_k(samples, c, samples) for c in counts]))
    metrics[f"maj@{samples}"] = float(np.mean([evaluation.maj_at_k(e["answers"], e["correct"]) for e in per_example]))
  if "tool_calls" in per_example[0]:
    calls = np.concatenate([e["tool_calls"] for e in per_example])
    errors = np.concatenate([e["tool_errors"] for e in per_example])
    metrics["tool_calls_per_completion"] = float(calls.mean())
    metrics["tool_error_rate"] = float(errors.sum() / max(calls.sum(), 1))
  if out_path:
    os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
    with open(out_path, "w", encoding="utf-8") as f:
      for e in per_example:
        f.write(json.dumps(e, ensure_ascii=False, default=str) + "\n")
  return metrics


def eval_main(argv) -> int:
  """`rljax eval --model X --data Y --verifier Z --samples K`."""
  parser = argparse.ArgumentParser(prog="rljax eval")
  parser.add_argument("--model", default="smollm2-135m-instruct", help="HF dir, .gguf, or built-in name")
  parser.add_argument("--data", required=True,
                      help="a data source: a .jsonl/.parquet file, or a procedural task name (arithmetic, countdown)")
  parser.add_argument("--kind", default=None, help="source kind (jsonl, parquet, gsm8k, math, ...); "
                      "default: from the file extension or the task name")
  parser.add_argument("--fields", default=None, metavar="JSON",
                      help="which columns of a file hold what, e.g. '{\"prompt\": \"question\", \"answer\": "
                           "\"solution\"}' (keys: prompt, answer, id, extra); default: prompt <- 'prompt', answer <- "
                           "'answer'")
  parser.add_argument("--split", default="test")
  parser.add_argument("--difficulty", type=int, default=None, help="difficulty of a procedural task")
  parser.add_argument("--held-out-fraction", type=float, default=None,
                      help="share of a procedural task's problems held out (a multiple of 1/16)")
  parser.add_argument("--verifier", default=None, help="verifier name or module:function (default: the source's)")
  parser.add_argument("--samples", type=int, default=1)
  parser.add_argument("--num-examples", type=int, default=64)
  parser.add_argument("--temperature", type=float, default=None, help="default: 0 (greedy) for 1 sample, else 1.0")
  parser.add_argument("--max-new-tokens", type=int, default=256)
  parser.add_argument("--max-prompt-tokens", type=int, default=512)
  parser.add_argument("--prompt-template", default="{prompt}")
  parser.add_argument("--system-prompt", default=None)
  parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_ROWS,
                      help="completions decoded at once (prompts per batch: this over --samples); larger is faster "
                           "until memory runs out; greedy results do not depend on it")
  parser.add_argument("--batch-prompts", type=int, default=None, help=argparse.SUPPRESS)   # before --batch-size
  parser.add_argument("--no-shared-prefix", dest="shared_prefix", action="store_false",
                      help="prefill every prompt whole (by default the leading tokens all prompts of a batch share, "
                           "such as a system prompt or few-shot examples, are prefilled once per batch)")
  parser.add_argument("--workers", type=int, default=2)
  parser.add_argument("--timeout", type=float, default=10.0)
  parser.add_argument("--out", default="eval_results.jsonl")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--quiet", action="store_true", help="no status lines or progress bar on stderr")
  parser.add_argument("--tools", default=None,
                      help="comma-separated tools the model may call mid-generation (calculator, search, python, "
                           "or module:function); default: none (single-turn)")
  parser.add_argument("--tool-format", default="hermes", choices=("hermes", "python"),
                      help="how the model calls tools: <tool_call>{json}</tool_call> or ```python blocks")
  parser.add_argument("--max-turns", type=int, default=4, help="tool calls per completion")
  parser.add_argument("--tool-timeout", type=float, default=10.0, help="seconds per tool call")
  parser.add_argument("--tool-kwargs", default=None,
                      help='JSON keyword arguments per tool, e.g. \'{"search": {"corpus_path": "corpus.jsonl"}}\'')
  args = parser.parse_args(argv)

  import rljax
  from rljax.data import build_dataset
  from rljax.rewards import RewardPool, RewardSpec
  from rljax.rollout.draw import SamplingParams, effective_temperature

  kind = args.kind
  source: dict[str, Any] = {}
  if kind is None:
    if args.data in ("arithmetic", "countdown"):
      kind = args.data
    else:
      kind = {".jsonl": "jsonl", ".parquet": "parquet", ".json": "json"}.get(os.path.splitext(args.data)[1], "jsonl")
  if kind not in ("arithmetic", "countdown"):
    source["path"] = args.data
    if args.fields:
      source["fields"] = _parse_fields(args.fields)
  else:
    if args.difficulty is not None:
      source["difficulty"] = args.difficulty
    if args.held_out_fraction is not None:
      source["held_out_fraction"] = args.held_out_fraction
  source.update(kind=kind)
  if args.verifier:
    source["verifier"] = args.verifier
  data_cfg = {"sources": [source], "prompt_template": args.prompt_template, "system_prompt": args.system_prompt,
              "max_prompt_tokens": args.max_prompt_tokens, "shuffle": False}
  try:
    dataset = build_dataset(data_cfg, split=args.split)
  except (ConfigError, DataError) as e:
    raise type(e)(_as_eval_flags(str(e), args.data)) from None
  verifier = args.verifier or dataset.config["sources"][0]["verifier"]
  # The verifier is checked before the model loads (a typo costs no model load).
  try:
    spec = RewardSpec.from_dict({"components": [{"name": "correct", "verifier": verifier, "weight": 1.0}],
                                 "timeout_s": args.timeout, "num_workers": args.workers})
    spec.routes()
  except ConfigError as e:
    raise ConfigError(str(e).replace("rewards.components[0] ('correct')", f"--verifier {verifier}")) from None
  if not args.quiet:
    print(f"rljax eval: loading {args.model} ...", file=sys.stderr, flush=True)
  from rljax import progress
  with progress.phase(f"loading {args.model}"):
    policy = rljax.load_pretrained(args.model)
  tok = policy.tokenizer
  temperature = args.temperature if args.temperature is not None else (0.0 if args.samples == 1 else 1.0)
  sp = SamplingParams(num_samples=args.samples, max_new_tokens=args.max_new_tokens,
                      temperature=effective_temperature(temperature), greedy=temperature == 0,
                      stop_token_ids=tuple(sorted(set(tok.stop_ids))))
  with RewardPool(spec) as pool, _tool_runner(args) as runner:
    tool_rollout = prompt_tools = None
    if runner is not None:
      from rljax.rollout.tools import ToolRollout, TurnParams
      tool_rollout = lambda sp: ToolRollout(policy.config, tok, runner, sp, TurnParams(max_turns=args.max_turns),
                                            fmt=args.tool_format, eos_ids=sp.stop_token_ids)
      prompt_tools = runner.schemas() if args.tool_format == "hermes" else None
    metrics = evaluate_policy(policy.config, policy.params, tok, dataset, pool, num_examples=args.num_examples,
                              samples=args.samples, sampling=sp, max_prompt_tokens=args.max_prompt_tokens,
                              batch_prompts=args.batch_prompts or prompts_per_batch(
                                  args.batch_size, args.samples, args.num_examples),
                              out_path=args.out, seed=args.seed,
                              tool_rollout=tool_rollout, prompt_tools=prompt_tools,
                              label=f"eval {args.data} ({args.split})", progress=not args.quiet,
                              shared_prefix=args.shared_prefix)
  print(json.dumps(metrics, indent=2))
  print(f"{format_result(metrics)}\nper-example results: {args.out}")
  return 0


def _parse_fields(text: str) -> dict:
  try:
    fields = json.loads(text)
  except json.JSONDecodeError as e:
    raise ConfigError(f"--fields is not valid JSON ({e}); pass an object of role -> column, e.g. "
                      '\'{"prompt": "question", "answer": "solution"}\'.') from None
  if not isinstance(fields, dict):
    raise ConfigError('--fields must be a JSON object, e.g. \'{"prompt": "question", "answer": "solution"}\'.')
  return fields


def _as_eval_flags(message: str, data: str) -> str:
  """A data error in `rljax eval`'s own terms: its flags, not the trainer's config fields."""
  message = message.replace("data.sources[0].fields", "--fields").replace("data.sources[0]", f"--data {data}")
  example = """--fields '{"prompt": "question", "answer": "answer"}'"""
  message = re.sub(r"the source's 'fields' \(now ([^)]*)\), e\.g\. fields=\{[^}]*\}",
                   lambda m: f"--fields (now {m.group(1)}), e.g. {example}", message)
  message = message.replace("Fix the source's 'fields' mapping", "Map the columns with --fields")
  return message.replace("correct the source's 'fields' mapping", "map the columns with --fields").replace(
      ", or set data.on_malformed: skip to skip and count such rows", "")


def _tool_runner(args):
  """The ToolRunner for `--tools` (a context manager), or a null context without tools."""
  if not args.tools:
    return contextlib.nullcontext()
  from rljax.tools import ToolRunner
  try:
    kwargs = json.loads(args.tool_kwargs) if args.tool_kwargs else None
  except json.JSONDecodeError as e:
    raise ConfigError(f"--tool-kwargs is not valid JSON ({e}); pass an object of tool name -> keyword "
                      "arguments, e.g. '{\"search\": {\"corpus_path\": \"corpus.jsonl\"}}'.") from None
  names = [n.strip() for n in args.tools.split(",") if n.strip()]
  return ToolRunner(names, timeout_s=args.tool_timeout, num_workers=args.workers, tool_kwargs=kwargs)
