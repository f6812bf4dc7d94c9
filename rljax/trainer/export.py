"""Checkpoint -> Hugging Face directory: `rljax export --checkpoint DIR --out HF_DIR`.

Reads only the parameters of one checkpoint step (no optimizer state) onto one device, plus
the model config and tokenizer source the trainer stored in the step's extras, and writes a
directory that `transformers.AutoModelForCausalLM.from_pretrained` loads as is. A LoRA run's
checkpoint (adapters only) is merged onto its base, or written in PEFT's layout (`--format peft`).
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import warnings
from typing import Sequence

import jax
import numpy as np

from rljax.errors import ConfigError, RljaxError, WeightsError
from rljax.models.config import ModelConfig
from rljax.models.policy import Policy, init_params
from rljax.trainer.checkpoint import EXTRAS_MODEL_CONFIG, EXTRAS_TOKENIZER, Checkpointer

log = logging.getLogger(__name__)

EXPORT_DTYPES = ("bfloat16", "float32")


def _model_config(extras: dict, where: str) -> ModelConfig:
  hf = extras.get(EXTRAS_MODEL_CONFIG)
  if not isinstance(hf, dict):
    raise WeightsError(f"{where}: the checkpoint's extras have no '{EXTRAS_MODEL_CONFIG}' (the model's HF config "
                       "dict); it was not saved by the rljax trainer, so the architecture is unknown. Save with "
                       f"extras['{EXTRAS_MODEL_CONFIG}'] = policy.config.to_hf().")
  return ModelConfig.from_hf(hf, f"{where} extras['{EXTRAS_MODEL_CONFIG}']")


def _check_params(config: ModelConfig, params, where: str) -> None:
  """The restored tree must be exactly what `config` builds (names and shapes)."""
  expected = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
  want = {jax.tree_util.keystr(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(expected)[0]}
  got = {jax.tree_util.keystr(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
  bad = sorted(set(want) ^ set(got)) + sorted(k for k in want.keys() & got.keys() if want[k] != got[k])
  if bad:
    detail = ", ".join(f"params{k}: saved {got.get(k)}, config implies {want.get(k)}" for k in bad[:4])
    raise WeightsError(f"{where}: the saved parameters do not match the model config stored with them ({detail}).")


def _tokenizer(extras: dict, where: str):
  """The tokenizer named by the checkpoint, or None (with a warning saying why)."""
  source = extras.get(EXTRAS_TOKENIZER)
  if not source:
    return None
  try:
    from rljax.tokenizer import load_tokenizer
    return load_tokenizer(source)
  except (ImportError, RljaxError, OSError) as e:
    warnings.warn(f"{where}: exporting without tokenizer files: the tokenizer source {source!r} saved with the "
                  f"checkpoint could not be loaded ({e}). Copy the tokenizer files into the output directory by "
                  "hand, or run the export from the directory the run was started in.", stacklevel=3)
    return None


EXPORT_FORMATS = ("merged", "peft")


_MODEL_FILES = ("config.json", "adapter_config.json")


def check_out_dir(out_dir: str | os.PathLike, overwrite: bool = False, flag: str = "--out") -> None:
  """An export's destination must be a new or empty directory, or, with `overwrite`, an earlier
  export (a directory with config.json or adapter_config.json): never a file, never a directory
  of other things. ConfigError naming `flag` and the way out otherwise."""
  out = os.fspath(out_dir)
  if os.path.exists(out) and not os.path.isdir(out):
    raise ConfigError(f"{flag} {out} is a file; an export is a directory (config.json, model.safetensors, "
                      "tokenizer files). Pass a new directory name.")
  parent = os.path.abspath(out)
  while not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    raise ConfigError(f"{flag} {out} cannot be created: {parent} is a file. Pass another directory.")
  if not os.access(parent, os.W_OK | os.X_OK):
    raise ConfigError(f"{flag} {out} cannot be written: no write permission on {parent}.")
  entries = sorted(os.listdir(out)) if os.path.isdir(out) else []
  if not entries:
    return
  shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
  if not overwrite:
    raise ConfigError(f"{flag} {out} already holds files ({shown}); exporting there would overwrite them. Pass a "
                      "new directory, or add --overwrite to replace the model exported there.")
  if not any(name in entries for name in _MODEL_FILES):
    raise ConfigError(f"{flag} {out} holds files ({shown}) but no exported model ({' or '.join(_MODEL_FILES)}); "
                      "--overwrite replaces only an earlier export. Pass a new directory.")


def _replace_dir(build, out_dir: str) -> str:
  """Writes a directory with `build(tmp)` next to `out_dir`, then puts it in place of `out_dir`
  (so an export that fails leaves an earlier one intact)."""
  out = os.path.abspath(os.fspath(out_dir))
  tmp, old = out + ".rljax-tmp", out + ".rljax-old"
  for leftover in (tmp, old):
    shutil.rmtree(leftover, ignore_errors=True)
  try:
    build(tmp)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  if os.path.isdir(out):
    os.replace(out, old)
  os.replace(tmp, out)
  shutil.rmtree(old, ignore_errors=True)
  return os.fspath(out_dir)


def export_checkpoint(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, *, step: int | None = None,
                      dtype: str = "bfloat16", fmt: str = "merged", overwrite: bool = False) -> str:
  """Writes checkpoint `step` (default: the latest) of `checkpoint_dir` as an HF directory; returns `out_dir`.

  `dtype` is the tensor dtype on disk ("bfloat16" or "float32"). Tokenizer files are written
  when the tokenizer source recorded in the checkpoint can be loaded. A LoRA run's checkpoint
  holds adapters only: the base is loaded from the run's config.model (and must have the
  checksum recorded with the adapters); `fmt="merged"` writes base + adapters folded into one
  model, `fmt="peft"` the adapters alone in PEFT's layout (float32, loadable with
  `peft.PeftModel.from_pretrained(base, out_dir)`).

  `out_dir` must be new or empty; with `overwrite`, an earlier export there is replaced once the
  new one is written (`check_out_dir`).
  """
  if dtype not in EXPORT_DTYPES:
    raise ConfigError(f"export dtype={dtype!r} is not supported; use one of {EXPORT_DTYPES}.")
  if fmt not in EXPORT_FORMATS:
    raise ConfigError(f"export format={fmt!r} is not supported; use one of {EXPORT_FORMATS}.")
  check_out_dir(out_dir, overwrite)
  return _replace_dir(lambda tmp: _export(checkpoint_dir, tmp, step, dtype, fmt), out_dir)


def _export(checkpoint_dir, out_dir: str, step: int | None, dtype: str, fmt: str) -> str:
  with Checkpointer(checkpoint_dir, read_only=True) as ckpt:
    step = ckpt.latest_step() if step is None else int(step)
    if step is None:
      ckpt.restore_extras()  # raises the "no checkpoint in ..." error
    where = os.path.join(ckpt.directory, str(step))
    extras = ckpt.restore_extras(step)
    config = _model_config(extras, where)
    params = ckpt.restore_params(step, shardings=jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
  from rljax.models.io import save_pretrained
  from rljax.trainer.loop import EXTRAS_BASE_FINGERPRINT
  if EXTRAS_BASE_FINGERPRINT in extras:
    return _export_lora(extras, config, params, where, out_dir, dtype, fmt)
  if fmt == "peft":
    raise ConfigError(f"{where} is a full fine-tuning checkpoint (no LoRA adapters): export it with "
                      "--format merged (the default).")
  _check_params(config, params, where)
  params = jax.tree.map(np.asarray, params)
  policy = Policy(config=config, params=params, tokenizer=_tokenizer(extras, where), source=where)
  out = save_pretrained(policy, out_dir, dtype=dtype)
  log.info("exported %s (%s)", where, dtype)
  return os.fspath(out)


def _export_lora(extras: dict, config: ModelConfig, adapters, where: str, out_dir, dtype: str, fmt: str) -> str:
  """A LoRA checkpoint's adapters, alone in PEFT's layout or merged into the run's base model."""
  import ml_collections

  from rljax.config import lora_config
  from rljax.models import lora
  from rljax.models.builtin import peft_base_name
  from rljax.models.io import save_pretrained
  from rljax.models.lora_io import save_peft_adapter
  from rljax.trainer.loop import EXTRAS_BASE_FINGERPRINT, load_policy
  run = ml_collections.ConfigDict(extras.get("config") or {})
  if "model" not in run:
    raise WeightsError(f"{where}: a LoRA checkpoint without its run config in the extras; the base model is unknown.")
  adapters = jax.tree.map(np.asarray, adapters)
  if fmt == "peft":
    out = save_peft_adapter(config.replace(lora=lora_config(run)), adapters, out_dir,
                            base_model_name_or_path=peft_base_name(run.model.path))
    log.info("exported the LoRA adapters of %s (PEFT layout)", where)
    return os.fspath(out)
  base = load_policy(run.model, run.get("tokenizer", ""))
  saved, now = float(extras[EXTRAS_BASE_FINGERPRINT]), lora.fingerprint(base.params)
  if abs(saved - now) > 1e-4 * max(abs(saved), 1.0):
    raise WeightsError(f"{where}: its adapters were trained on other weights than config.model.path="
                       f"{run.model.path!r} holds now (checksum {saved:.6g} saved, {now:.6g} now); merge them "
                       "onto the run's own base model.")
  merged = lora.merge(base.config, jax.device_get(base.params), adapters)
  policy = Policy(config=base.config.replace(lora=None), params=jax.tree.map(np.asarray, merged),
                  tokenizer=base.tokenizer, source=where)
  out = save_pretrained(policy, out_dir, dtype=dtype)
  log.info("exported %s merged with its base %s (%s)", where, run.model.path, dtype)
  return os.fspath(out)


def export_main(argv: Sequence[str] | None = None) -> int:
  """`rljax export --checkpoint DIR --out HF_DIR [--step N] [--dtype bfloat16|float32] [--format merged|peft]`."""
  parser = argparse.ArgumentParser(prog="rljax export",
                                   description="Write a training checkpoint as a Hugging Face model directory.")
  parser.add_argument("--checkpoint", required=True,
                      help="the run's checkpoint directory (holding numbered step folders), e.g. runs/x/checkpoints")
  parser.add_argument("--out", required=True, help="output directory (config.json, model.safetensors, tokenizer)")
  parser.add_argument("--overwrite", action="store_true",
                      help="replace an earlier export in --out (without it, a non-empty --out is refused)")
  parser.add_argument("--step", type=int, default=None, help="step to export (default: the latest)")
  parser.add_argument("--dtype", choices=EXPORT_DTYPES, default="bfloat16", help="tensor dtype on disk")
  parser.add_argument("--format", choices=EXPORT_FORMATS, default="merged",
                      help="LoRA runs: merged (adapters folded into the base, a plain HF model) or peft (the "
                           "adapters alone: adapter_config.json + adapter_model.safetensors)")
  args = parser.parse_args(argv)
  from rljax import progress
  print(f"rljax export: {args.checkpoint} -> {args.out} ({args.format}, {args.dtype}) ...", file=sys.stderr, flush=True)
  with progress.phase(f"exporting {args.checkpoint} to {args.out}"):
    out = export_checkpoint(args.checkpoint, args.out, step=args.step, dtype=args.dtype, fmt=args.format,
                            overwrite=args.overwrite)
  print(out)
  return 0
