"""LoRA adapters as PEFT checkpoints, which `peft.PeftModel.from_pretrained(hf_model, dir)` loads.

    save_pretrained(Policy(config.replace(lora=None), base), "base_dir")   # the frozen base, HF layout
    save_peft_adapter(config, adapters, "adapter_dir", base_model_name_or_path="base_dir")
    adapters = load_peft_adapter(config, "adapter_dir")                     # and back

A directory holds `adapter_config.json` (PEFT's LoraConfig: r, lora_alpha, target_modules, ...)
and `adapter_model.safetensors` (float32). Projection `<name>` of layer i is the HF module
`model.layers.{i}.self_attn.<name>_proj` (q, k, v, o) or `model.layers.{i}.mlp.<name>_proj` (gate,
up, down), as in convert.py; its adapter is stored as

    base_model.model.model.layers.{i}.<module>.lora_A.weight   [r, in]  = A^T
    base_model.model.model.layers.{i}.<module>.lora_B.weight   [out, r] = B^T

where rljax's A [*in, r] and B [r, *out] have their kernel's input / output axes flattened in
order (heads before head_dim: HF's [H * Dh] rows, the flattening convert.py uses for the kernels).
PEFT computes W x + (lora_alpha / r) B A x (`fan_in_fan_out=False`, `use_rslora=False`), rljax
x W + (alpha / r) (x A) B: the same numbers.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from rljax.errors import ConfigError, WeightsError
from rljax.models import convert, families, lora
from rljax.models.config import ModelConfig
from rljax.models.io import _read_json, _write_json
from rljax.models.policy import init_params

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."   # PeftModel -> LoraModel -> the transformers model


def hf_modules(config: ModelConfig) -> dict[str, tuple[str, str]]:
  """Projection name -> (its module in a layer's rljax tree, its HF module within a layer), read
  from the family's tensor list: e.g. "q" -> ("attn", "self_attn.q_proj"), "down" -> ("mlp", "mlp.down_proj")."""
  out = {}
  for spec in convert.tensors(config):
    if spec.per_layer and spec.path[-1].endswith("_kernel"):
      out[spec.path[-1][:-len("_kernel")]] = (spec.path[0], spec.hf[:-len(".weight")])
  return out


def _targets(config: ModelConfig) -> tuple[str, ...]:
  """The family's adaptable projections, in its order (adapter_config.json lists them so)."""
  return families.get(config.architecture).lora_targets


def _int_if_whole(x: float) -> int | float:
  return int(x) if float(x).is_integer() else float(x)


def adapter_shapes(config: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
  """Target -> (A's shape [L, *in, r], B's shape [L, r, *out]) for `config.lora`: the model's own
  parameter definition, traced (nothing is allocated)."""
  _require_lora(config)
  tree = jax.eval_shape(lambda: lora.split(init_params(config, jax.random.key(0)))[1])
  mods = hf_modules(config)
  return {t: (tuple(tree["layers"][mods[t][0]][f"{t}_lora_a"].shape),
              tuple(tree["layers"][mods[t][0]][f"{t}_lora_b"].shape)) for t in config.lora.targets}


def peft_key(layer: int, module: str, which: str) -> str:
  """The safetensors key of one adapter matrix: which is "A" or "B"; module e.g. "self_attn.q_proj"."""
  return f"{PEFT_PREFIX}model.layers.{layer}.{module}.lora_{which}.weight"


# ---- adapter tree <-> PEFT-named tensors ------------------------------------------------------


def lora_to_hf(config: ModelConfig, adapters) -> dict[str, np.ndarray]:
  """The adapter tree -> PEFT-named float32 tensors (the keys of adapter_model.safetensors).

  Per layer i and target: lora_A.weight = A[i] as [in, r], transposed to [r, in]; lora_B.weight =
  B[i] as [r, out], transposed to [out, r]. Raises WeightsError if the tree does not hold exactly
  the adapters of `config.lora` with their shapes.
  """
  shapes = adapter_shapes(config)
  _check_tree(config, adapters, shapes)
  mods, r = hf_modules(config), config.lora.rank
  out: dict[str, np.ndarray] = {}
  for layer in range(config.num_layers):
    for t in config.lora.targets:
      group, module = mods[t]
      node = adapters["layers"][group]
      a = np.asarray(jax.device_get(node[f"{t}_lora_a"][layer]), np.float32)   # [*in, r]
      b = np.asarray(jax.device_get(node[f"{t}_lora_b"][layer]), np.float32)   # [r, *out]
      out[peft_key(layer, module, "A")] = np.ascontiguousarray(a.reshape(-1, r).T)
      out[peft_key(layer, module, "B")] = np.ascontiguousarray(b.reshape(r, -1).T)
  return out


def hf_to_lora(config: ModelConfig, tensors: Mapping[str, np.ndarray], source: str = "adapter") -> dict:
  """PEFT-named tensors -> the adapter tree of `config.lora` (float32 numpy leaves, layers stacked).

  The inverse of `lora_to_hf`. Raises WeightsError, naming `source` and the tensor, when a tensor
  is missing, left over (a target `config.lora.targets` lacks, a DoRA magnitude, ...) or mis-shaped.
  """
  shapes = adapter_shapes(config)
  mods, r = hf_modules(config), config.lora.rank
  known = {peft_key(i, mods[t][1], w): (t, w) for t in config.lora.targets for i in range(config.num_layers)
           for w in "AB"}
  extra = sorted(set(tensors) - set(known))
  if extra:
    raise WeightsError(f"{source}: tensor {extra[0]!r} ({len(extra)} such) is not an adapter of config.lora "
                       f"(targets={list(config.lora.targets)}, layers={config.num_layers}); the adapter was "
                       "trained for other targets or another model.")
  adapters: dict = {}
  for t in config.lora.targets:
    (_, *in_shape, _), (_, _, *out_shape) = shapes[t]
    n_in, n_out = int(np.prod(in_shape)), int(np.prod(out_shape))
    want = {"A": (r, n_in), "B": (n_out, r)}
    group, module = mods[t]
    per_layer = {"A": [], "B": []}
    for i in range(config.num_layers):
      for w in "AB":
        name = peft_key(i, module, w)
        if name not in tensors:
          raise WeightsError(f"{source}: tensor {name!r} is missing; the adapter does not cover target {t!r} "
                             f"of layer {i} (config.lora.targets={list(config.lora.targets)}, "
                             f"layers={config.num_layers}).")
        x = np.asarray(tensors[name])
        if tuple(x.shape) != want[w]:
          raise WeightsError(f"{source}: tensor {name!r} has shape {tuple(x.shape)}, expected {want[w]} "
                             f"(rank {r}, {t} projection of {n_in} -> {n_out}); the adapter's rank or the "
                             "model config differ.")
        per_layer[w].append(x.astype(np.float32))
    node = adapters.setdefault("layers", {}).setdefault(group, {})
    node[f"{t}_lora_a"] = np.stack([a.T.reshape(*in_shape, r) for a in per_layer["A"]])
    node[f"{t}_lora_b"] = np.stack([b.T.reshape(r, *out_shape) for b in per_layer["B"]])
  return adapters


# ---- adapter_config.json -----------------------------------------------------------------------


def peft_config(config: ModelConfig, base_model_name_or_path: str | None = None) -> dict[str, Any]:
  """The adapter_config.json of `config.lora`: a PEFT LoraConfig (plain LoRA, no bias, no rsLoRA,
  no DoRA, every layer) that peft >= 0.10 reads; unset fields take peft's defaults."""
  _require_lora(config)
  mods = hf_modules(config)
  lc = config.lora
  return {
      "peft_type": "LORA",
      "task_type": "CAUSAL_LM",
      "base_model_name_or_path": base_model_name_or_path,
      "revision": None,
      "r": int(lc.rank),
      "lora_alpha": _int_if_whole(float(lc.alpha)),
      "lora_dropout": float(lc.dropout),
      "target_modules": [mods[t][1].split(".")[-1] for t in _targets(config) if t in lc.targets],
      "exclude_modules": None,
      "bias": "none",
      "lora_bias": False,
      "fan_in_fan_out": False,
      "use_rslora": False,
      "use_dora": False,
      "init_lora_weights": True,
      "inference_mode": True,
      "modules_to_save": None,
      "layers_to_transform": None,
      "layers_pattern": None,
      "rank_pattern": {},
      "alpha_pattern": {},
  }


def check_peft_config(config: ModelConfig, data: Mapping[str, Any], source: str = ADAPTER_CONFIG_FILE) -> None:
  """Raises WeightsError if adapter_config.json describes an adapter rljax cannot run as `config.lora`:
  another rank, alpha or target list, or a PEFT variant with other arithmetic (rsLoRA, DoRA,
  fan_in_fan_out, biases, per-module ranks, a subset of layers, fully trained extra modules).
  lora_dropout is not compared (it only acts in training). A regex `target_modules` is not
  compared here; the tensors are (`hf_to_lora`)."""
  _require_lora(config)
  lc = config.lora
  if data.get("peft_type") != "LORA":
    raise WeightsError(f"{source}: peft_type={data.get('peft_type')!r}; only LoRA adapters (peft_type 'LORA') "
                       "are supported.")
  if data.get("r") != lc.rank:
    raise WeightsError(f"{source}: the adapter has rank r={data.get('r')!r} but config.lora.rank={lc.rank}; set "
                       "model.lora.rank to the adapter's rank.")
  alpha = data.get("lora_alpha")
  if not isinstance(alpha, (int, float)) or not np.isclose(float(alpha), float(lc.alpha), rtol=1e-6, atol=0):
    raise WeightsError(f"{source}: the adapter has lora_alpha={alpha!r} but config.lora.alpha={lc.alpha}; set "
                       "model.lora.alpha to the adapter's (the scale is alpha / r).")
  unsupported = [
      ("use_rslora", bool(data.get("use_rslora")), "rsLoRA scales by alpha / sqrt(r)"),
      ("use_dora", bool(data.get("use_dora")), "DoRA adds magnitude vectors"),
      ("fan_in_fan_out", bool(data.get("fan_in_fan_out")), "the base layers are Conv1D-style [in, out]"),
      ("bias", data.get("bias", "none") != "none", "the adapter trains biases"),
      ("lora_bias", bool(data.get("lora_bias")), "lora_B has a bias"),
      ("rank_pattern", bool(data.get("rank_pattern")), "ranks differ per module"),
      ("alpha_pattern", bool(data.get("alpha_pattern")), "alphas differ per module"),
      ("layers_to_transform", data.get("layers_to_transform") is not None, "only some layers are adapted"),
      ("modules_to_save", bool(data.get("modules_to_save")), "whole modules are saved beside the adapter"),
  ]
  for field, bad, why in unsupported:
    if bad:
      raise WeightsError(f"{source}: {field}={data.get(field)!r} is not supported ({why}); rljax runs plain LoRA "
                         "adapters only.")
  targets = data.get("target_modules")
  if isinstance(targets, (list, tuple)):
    by_name = {module.split(".")[-1]: t for t, (_, module) in hf_modules(config).items()}
    unknown = sorted(str(m) for m in targets if m not in by_name)
    if unknown:
      raise WeightsError(f"{source}: target_modules {unknown} are not projections rljax adapts; supported: "
                         f"{sorted(by_name)}.")
    got = {by_name[m] for m in targets}
    if got != set(lc.targets):
      raise WeightsError(f"{source}: the adapter targets {[t for t in _targets(config) if t in got]} but "
                         f"config.lora.targets={list(lc.targets)}; set model.lora.targets to the adapter's.")


# ---- files -------------------------------------------------------------------------------------


def save_peft_adapter(config: ModelConfig, adapters, out_dir: str | os.PathLike,
                      base_model_name_or_path: str | None = None) -> str:
  """Writes `adapters` (the tree of `config.lora`) as a PEFT LoRA directory; returns its path.

  Files: adapter_config.json and adapter_model.safetensors (float32). With the base saved by
  `save_pretrained`, `peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base),
  out_dir)` computes the adapted model. `base_model_name_or_path` is recorded in the config (PEFT
  uses it when the base is not given).
  """
  tensors = lora_to_hf(config, adapters)
  out_dir = os.fspath(out_dir)
  os.makedirs(out_dir, exist_ok=True)
  stale = os.path.join(out_dir, "adapter_model.bin")   # PEFT would read it rather than ours
  if os.path.isfile(stale):
    os.remove(stale)
  save_file(tensors, os.path.join(out_dir, ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
  _write_json(os.path.join(out_dir, ADAPTER_CONFIG_FILE), peft_config(config, base_model_name_or_path))
  return out_dir


def load_peft_adapter(config: ModelConfig, path: str | os.PathLike):
  """Reads a PEFT LoRA directory (`path`, or a file in it) as the adapter tree of `config.lora`
  (float32 arrays on the default device): `lora.join(base, adapters)` runs it.

  Raises WeightsError naming the file on a missing or corrupt file, or an adapter that differs
  from `config.lora` (rank, alpha, targets, layers, shapes) or is not plain LoRA (`check_peft_config`).
  """
  path = os.fspath(path)
  directory = os.path.dirname(path) if os.path.isfile(path) else path
  if not os.path.isdir(directory):
    raise WeightsError(f"{path}: no such adapter directory.")
  config_file = os.path.join(directory, ADAPTER_CONFIG_FILE)
  weights_file = os.path.join(directory, ADAPTER_WEIGHTS_FILE)
  check_peft_config(config, _read_json(config_file), config_file)
  if not os.path.isfile(weights_file):
    hint = " (found adapter_model.bin; only safetensors is supported)" if os.path.isfile(
        os.path.join(directory, "adapter_model.bin")) else ""
    raise WeightsError(f"{weights_file}: file not found{hint}.")
  tensors = _read_safetensors(weights_file)
  return jax.device_put(hf_to_lora(config, tensors, weights_file))


def _read_safetensors(path: str) -> dict[str, np.ndarray]:
  try:
    with safe_open(path, framework="numpy") as f:
      return {k: f.get_tensor(k) for k in list(f.keys())}
  except Exception as e:  # noqa: BLE001  (SafetensorError, OSError, ...)
    raise WeightsError(f"{path}: not a valid safetensors file ({e}).") from None


def _require_lora(config: ModelConfig) -> None:
  if config.lora is None:
    raise ConfigError("config.lora is None: the model has no adapters; pass the config the adapters were "
                      "trained with (model.lora set).")


def _check_tree(config: ModelConfig, adapters, shapes) -> None:
  """Raises WeightsError unless `adapters` holds exactly the leaves of `config.lora`, shaped as `shapes`."""
  mods = hf_modules(config)
  want = {}
  for t, (a, b) in shapes.items():
    group = mods[t][0]
    want[("layers", group, f"{t}_lora_a")] = a
    want[("layers", group, f"{t}_lora_b")] = b
  leaves = jax.tree_util.tree_flatten_with_path(adapters)[0]
  got = {tuple(k.key for k in path): tuple(np.shape(x)) for path, x in leaves}
  for path, shape in want.items():
    if path not in got:
      raise WeightsError(f"adapters: leaf {'/'.join(path)} is missing (config.lora.targets="
                         f"{list(config.lora.targets)}).")
    if got[path] != shape:
      raise WeightsError(f"adapters: leaf {'/'.join(path)} has shape {got[path]}, expected {shape} "
                         f"(rank {config.lora.rank}).")
  extra = sorted(set(got) - set(want))
  if extra:
    raise WeightsError(f"adapters: leaf {'/'.join(map(str, extra[0]))} is not an adapter of config.lora "
                       f"(targets={list(config.lora.targets)}).")
