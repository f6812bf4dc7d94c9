"""Shared pieces of the device check's parts (scripts/device/gpu_check.py runs each part in its own process).

A part is `fn(rec: Recorder, ctx: Context)`. It records rows as it goes (one JSON line each, flushed),
so whatever finished before a timeout or a crash is kept. A row: part, check, status (ok | fail |
skipped | error), values (numbers or short strings), note.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import statistics
import string
import time
import traceback
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL_CONFIGS = os.path.join(ROOT, "scripts", "model_configs")
RECIPE = os.path.join(ROOT, "rljax", "configs", "qwen25_05b_gsm8k_grpo.py")
GIB = 2**30
CUDA_ONLY = "needs a CUDA GPU (run without --cpu on the GPU machine)"


@dataclasses.dataclass
class Context:
  """What a part is told: the mode, its options, and where the results so far are."""
  cpu: bool
  options: dict[str, Any]
  results_path: str        # results.json as written after the previous part (read by plan_memory)
  work_dir: str            # scratch space of this run (model directories, tokenizers)
  deadline: float          # time.time() by which the part is killed

  def seconds_left(self) -> float:
    return self.deadline - time.time()


class Recorder:
  """Appends rows to a JSON-lines file, one flushed line per row."""

  def __init__(self, part: str, path: str):
    self.part, self.path = part, path

  def row(self, check: str, status: str, values: dict | None = None, note: str = "") -> None:
    clean = {k: _jsonable(v) for k, v in (values or {}).items()}
    line = json.dumps({"part": self.part, "check": check, "status": status, "values": clean, "note": note})
    with open(self.path, "a", encoding="utf-8") as f:
      f.write(line + "\n")
    print(f"[{self.part}] {check}: {status} {clean} {note}", flush=True)

  def guarded(self, check: str, fn: Callable[[], None]) -> None:
    """Runs fn; an exception becomes an `error` row for `check` (the part goes on with its next check)."""
    try:
      fn()
    except Exception as e:  # noqa: BLE001 - one failed check must not lose the others
      traceback.print_exc()
      self.row(check, "error", note=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")


def _jsonable(v):
  if isinstance(v, (bool, int, str)) or v is None:
    return v
  try:
    f = float(v)
  except (TypeError, ValueError):
    return str(v)
  return f if math.isfinite(f) else str(f)


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, list[float], Any]:
  """(seconds of the first call, seconds of each of `repeats` further calls, the last result).
  fn must block until its work is done."""
  t = time.perf_counter()
  out = fn()
  first = time.perf_counter() - t
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - t)
  return first, times, out


def median(xs: list[float]) -> float:
  return statistics.median(xs) if xs else float("nan")


def device_summary() -> dict[str, Any]:
  """Platform, kind and count of jax's default devices, and their memory as XLA's allocator sees it."""
  import jax
  devs = jax.devices()
  stats = memory_stats(devs[0])
  return {"platform": devs[0].platform, "device_kind": devs[0].device_kind, "devices": len(devs),
          "bytes_limit_gib": stats["bytes_limit"] / GIB if "bytes_limit" in stats else None}


def memory_stats(device) -> dict:
  try:
    return device.memory_stats() or {}
  except Exception:  # noqa: BLE001 - CPU devices and old runtimes have none
    return {}


# ---- tokenizers that travel: written in-process, no download -------------------------------------


def letter_words(n: int, seed: int = 0) -> list[str]:
  """n distinct lower-case words: all 1-letter, then 2-letter, ... words in a seeded order."""
  words: list[str] = []
  length = 1
  rng = random.Random(seed)
  while len(words) < n:
    batch = ["".join(t) for t in _product(string.ascii_lowercase, length)]
    rng.shuffle(batch)
    words.extend(batch[:n - len(words)])
    length += 1
  return words


def _product(alphabet: str, length: int):
  import itertools
  return itertools.product(alphabet, repeat=length)


SPECIALS = ("<unk>", "<s>", "</s>", "<pad>")


def write_word_tokenizer(directory: str, vocab_size: int) -> str:
  """A word-level tokenizer of `vocab_size` ids (4 specials, then letter words) as an HF directory
  (tokenizer.json + tokenizer_config.json) that rljax and transformers both load. Words decode
  joined by spaces (the default decoder), so a completion is text of letters: the `vowels` reward scores it."""
  import tokenizers
  os.makedirs(directory, exist_ok=True)
  vocab = {tok: i for i, tok in enumerate(SPECIALS)}
  vocab.update({w: i + len(SPECIALS) for i, w in enumerate(letter_words(vocab_size - len(SPECIALS)))})
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.add_special_tokens(list(SPECIALS))
  tok.save(os.path.join(directory, "tokenizer.json"))
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>",
            "eos_token": "</s>", "pad_token": "<pad>", "model_max_length": 1 << 20,
            "clean_up_tokenization_spaces": False}
  with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump(config, f, indent=1)
  return directory


def word_prompts(count: int, words: int, vocab_size: int, seed: int = 0) -> list[str]:
  """`count` prompts of exactly `words` vocabulary words each (so each is `words` tokens long)."""
  rng = random.Random(seed)
  pool = letter_words(vocab_size - len(SPECIALS))
  return [" ".join(rng.choice(pool) for _ in range(words)) for _ in range(count)]


# ---- run configurations (the recipe, resized), shared by the speed, plan and TRL parts ---------------


def model_path(model: str) -> str:
  """scripts/model_configs/qwen2.5-<model> (a directory holding config.json only)."""
  path = os.path.join(MODEL_CONFIGS, f"qwen2.5-{model}")
  if not os.path.isfile(os.path.join(path, "config.json")):
    raise FileNotFoundError(f"{path}/config.json: no such model shape; known: {sorted(os.listdir(MODEL_CONFIGS))}")
  return path


# A tiny stand-in for --cpu runs: a random model (tied embeddings, GQA) at toy sizes.
TINY_RANDOM = {"model.path": "random", "model.random.vocab_size": 512, "model.random.hidden_size": 64,
               "model.random.intermediate_size": 128, "model.random.num_layers": 2, "model.random.num_heads": 4,
               "model.random.num_kv_heads": 2, "model.random.head_dim": 16}


def run_overrides(model: str, prompts: int, group: int, prompt_len: int, new_tokens: int, cpu: bool,
                  dtype: str = "bfloat16") -> dict[str, Any]:
  """Overrides of the Qwen2.5-0.5B GSM8K recipe for a throughput run of `model`'s shape with random
  weights: `prompts` x `group` rows, every completion `new_tokens` long (EOS ignored), no KL (no
  reference copy), one optimizer update per step, parameters fsdp over the devices."""
  out: dict[str, Any] = dict(TINY_RANDOM) if cpu else {"model.path": model_path(model)}
  out.update({"model.dtype": dtype, "model.remat": True, "model.attention": "auto", "rl.kl_coef": 0.0,
              "train.prompts_per_step": prompts, "sampling.num_samples": group, "train.mini_batches": 1,
              "train.micro_batches": 1, "data.max_prompt_tokens": prompt_len, "sampling.max_new_tokens": new_tokens,
              "sampling.ignore_eos": True, "sampling.temperature": 1.0, "mesh.shape": (1, -1, 1)})
  return out


def override_args(overrides: dict[str, Any]) -> list[str]:
  """{field: value} -> ["field=repr(value)", ...] for rljax.config_overrides.apply_overrides."""
  return [f"{k}={v!r}" for k, v in overrides.items()]


def load_run_config(overrides: dict[str, Any]):
  from rljax.config_overrides import apply_overrides, load_config_file
  cfg = load_config_file(RECIPE)
  apply_overrides(cfg, override_args(overrides))
  return cfg


# ---- concrete programs from `rljax plan`'s builders -------------------------------------------------


@dataclasses.dataclass
class Workload:
  """A run's sampler and learner, compiled for `mesh`, with a random-weight train state on it."""
  run: Any
  mesh: Any
  inputs: Any
  state: Any
  generate: Callable
  update: Callable


def build_workload(cfg, mesh=None, seed: int = 0, params=None) -> Workload:
  """The sampler and the learner exactly as `rljax plan` compiles them (rljax.plan.programs), jitted
  with the plan's shardings, and a train state of random weights (or `params`, host arrays)."""
  import jax

  from rljax import sharding as shd
  from rljax.models.policy import init_params, param_shardings
  from rljax.plan import programs as progs
  from rljax.trainer import setup as setup_lib
  run = progs.build_run(cfg)
  mesh = mesh if mesh is not None else shd.make_mesh(tuple(cfg.mesh.shape))
  inputs = progs.build_inputs(run, mesh)
  psh = param_shardings(run.model, mesh)
  if params is None:
    params = jax.jit(lambda k: init_params(run.model, k), out_shardings=psh)(jax.random.key(seed))
  state, state_sh = setup_lib.init_state(run.setup, params, mesh)
  generate = setup_lib.generate_program(run.setup, mesh)
  update = setup_lib.update_program(run.setup, mesh, state_sh)
  return Workload(run, mesh, inputs, state, generate, update)


def random_prompts(w: Workload, seed: int = 0, left_pad: bool = False):
  """(ids [P, Lp] int32, mask [P, Lp] bool) on the mesh: random tokens; with left_pad, prompt i
  has i % 4 padding slots on the left (otherwise every prompt is Lp tokens long)."""
  import jax
  import numpy as np
  p, lp = w.run.prompts, w.run.prompt_len
  rng = np.random.default_rng(seed)
  ids = rng.integers(4, w.run.model.vocab_size, (p, lp)).astype(np.int32)
  mask = np.ones((p, lp), bool)
  if left_pad:
    for i in range(p):
      mask[i, :min(i % 4, lp - 1)] = False
  ids[~mask] = 0
  return (jax.device_put(ids, w.inputs.prompt_ids.sharding), jax.device_put(mask, w.inputs.prompt_mask.sharding))


def replicated_key(w: Workload, seed: int):
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P
  return jax.device_put(jax.random.key(seed), NamedSharding(w.mesh, P()))


def step_flops(w: Workload) -> dict[str, float]:
  """Model FLOPs of one sample + update at the workload's shapes, as the trainer counts them for
  perf/mfu (rljax/flops.py: every completion max_new_tokens long, as with EOS ignored)."""
  from rljax import flops
  run = w.run
  extra = int(run.needs_reference) + int(run.spec.recompute_old_logprobs)
  return flops.rollout_step_flops(run.model, sample_prompts=run.prompts, update_prompts=run.prompts,
                                  group=run.group, prompt_len=run.prompt_len, decode_steps=run.completion_len,
                                  completion_len=run.completion_len, epochs=1, extra_forwards=extra)


def finite(x) -> bool:
  try:
    return math.isfinite(float(x))
  except (TypeError, ValueError):
    return False
