"""Loading and saving policies: Hugging Face directories, GGUF files, built-in names.

    policy = load_pretrained("path/to/hf_dir")            # config.json + safetensors
    policy = load_pretrained("model.Q4_1.gguf")           # llama.cpp checkpoint
    policy = load_pretrained("smollm2-135m-instruct")     # weights shipped in a pip package
    save_pretrained(policy, "out_dir", dtype="bfloat16")  # loadable by transformers as is
    policy = load_pretrained("path/to/hf_dir", param_dtype="bfloat16", mesh=mesh)   # sharded load

With `mesh` (or `shardings`), each process reads from the safetensors files only the slices its
own devices hold, straight into the sharded layout and the storage dtype: no full copy of the
model exists on any device or in any host's memory (docs/models.md, "Sharded loading"). GGUF
files are quantized: they are dequantized one tensor at a time on the host and each parameter
(all its layers, in the storage dtype) is placed by slices.

Every problem with the input (missing file, corrupt file, unsupported architecture,
config/weights mismatch) raises one `WeightsError` naming the file and the problem.
"""
from __future__ import annotations

import json
import os
import re
from typing import Callable

import jax
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from rljax.errors import WeightsError
from rljax.models import builtin, families, layouts
from rljax.models.config import ModelConfig
from rljax.models.convert import expected_hf_shapes, hf_to_params, params_to_hf, tensors, tree_get, tree_set
from rljax.models.gguf_io import open_gguf
from rljax.models.policy import Policy, param_shardings

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
DEFAULT_MAX_SHARD_SIZE = "5GB"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved
_SHARD_FILE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


# ---- locating the checkpoint ------------------------------------------------------------------


def resolve(x: str | os.PathLike) -> tuple[str, str]:
  """(kind, path) for a load source: kind is "hf" (a directory) or "gguf" (a file)."""
  path = os.fspath(x)
  if os.path.isdir(path):
    return "hf", path
  if os.path.isfile(path):
    if path.lower().endswith(".gguf") or _has_gguf_magic(path):
      return "gguf", path
    if os.path.basename(path) == CONFIG_FILE:
      return "hf", os.path.dirname(path) or "."
    raise WeightsError(f"{path}: not a GGUF file (expected a .gguf file, or a Hugging Face directory with "
                       f"{CONFIG_FILE} and {SAFETENSORS_FILE}).")
  if builtin.is_builtin(path):
    return "gguf", builtin.resolve_builtin(path)
  if builtin.looks_like_hub_id(path):
    raise WeightsError(builtin.hub_id_message(path))
  if os.sep in path or "/" in path or path.lower().endswith((".gguf", ".safetensors", ".json")):
    raise WeightsError(f"{path}: no such file or directory.")
  builtin.resolve_builtin(path)  # raises the error listing the built-in names
  raise AssertionError("unreachable")


def _has_gguf_magic(path: str) -> bool:
  with open(path, "rb") as f:
    return f.read(4) == b"GGUF"


def _read_json(path: str) -> dict:
  if not os.path.isfile(path):
    raise WeightsError(f"{path}: file not found.")
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise WeightsError(f"{path}: not valid JSON ({e}).") from None
  if not isinstance(data, dict):
    raise WeightsError(f"{path}: expected a JSON object, found {type(data).__name__}.")
  return data


# ---- safetensors --------------------------------------------------------------------------------


class _SafetensorsCheckpoint:
  """HF-named tensors of a directory's `model.safetensors`, or its shards listed by the index."""

  def __init__(self, directory: str):
    single = os.path.join(directory, SAFETENSORS_FILE)
    index = os.path.join(directory, SAFETENSORS_INDEX)
    if os.path.isfile(single):
      files = {None: single}
      self.source = single
    elif os.path.isfile(index):
      weight_map = _read_json(index).get("weight_map")
      if not isinstance(weight_map, dict) or not weight_map:
        raise WeightsError(f"{index}: has no 'weight_map' (tensor name -> shard file).")
      files = {name: os.path.join(directory, fname) for name, fname in weight_map.items()}
      self.source = index
    else:
      others = sorted(f for f in os.listdir(directory) if f.endswith((".bin", ".pt", ".pth", ".safetensors")))
      hint = f" (found {', '.join(others)}; only safetensors is supported)" if others else ""
      raise WeightsError(f"{directory}: no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX}{hint}.")

    self._handles = {}
    self._file_of: dict[str, str] = {}
    for path in sorted(set(files.values())):
      if not os.path.isfile(path):
        raise WeightsError(f"{path}: shard listed in {SAFETENSORS_INDEX} is missing.")
      try:
        handle = safe_open(path, framework="numpy")
        keys = list(handle.keys())
      except Exception as e:  # SafetensorError, OSError, ...
        raise WeightsError(f"{path}: not a valid safetensors file ({e}).") from None
      self._handles[path] = handle
      for k in keys:
        self._file_of[k] = path
    for name, path in files.items():
      if name is not None and self._file_of.get(name) != path:
        raise WeightsError(f"{path}: tensor {name!r} listed in {SAFETENSORS_INDEX} is not in this shard.")
    self.names = set(self._file_of)

  def file_of(self, name: str) -> str:
    return self._file_of.get(name, self.source)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._handles[self._file_of[name]].get_slice(name).get_shape())

  def get(self, name: str) -> np.ndarray:
    path = self._file_of[name]
    try:
      return self._handles[path].get_tensor(name)
    except Exception as e:
      raise WeightsError(f"{path}: tensor {name!r} is unreadable ({e}).") from None

  def read(self, name: str, index: tuple) -> np.ndarray:
    """The block `index` (a tuple of slices) of a tensor, reading only that block from the file."""
    path = self._file_of.get(name)
    if path is None:
      raise WeightsError(f"{self.source}: tensor {name!r} is missing.")
    try:
      return np.asarray(self._handles[path].get_slice(name)[index])
    except Exception as e:
      raise WeightsError(f"{path}: tensor {name!r} is unreadable ({e}).") from None


def _check_shapes(config: ModelConfig, names, shape_of: Callable[[str], tuple], file_of: Callable[[str], str],
                  config_source: str) -> None:
  """Fails early, naming the file, if a tensor the config needs is missing or mis-shaped, or if the
  checkpoint holds a tensor the model would not use (a variant rljax does not implement)."""
  expected = expected_hf_shapes(config)
  family = families.get(config.architecture)
  extra = sorted(n for n in names if n not in expected and not family.ignored_hf_tensor(config, n))
  if extra:
    raise WeightsError(f"{file_of(extra[0])}: tensor {extra[0]!r} is not part of rljax's {config.architecture} model "
                       f"({len(extra)} such tensors); this checkpoint variant (e.g. mlp_bias, o_proj bias) is not "
                       "supported.")
  for name, want in expected.items():
    if name not in names:
      raise WeightsError(f"{file_of(name)}: tensor {name!r} is missing; the weights do not match {config_source} "
                         f"(architecture={config.architecture}, layers={config.num_layers}).")
    shape = tuple(shape_of(name))
    if shape != want:
      raise WeightsError(f"{file_of(name)}: tensor {name!r} has shape {shape} but {config_source} implies "
                         f"{want}; the config and the weights disagree.")


# ---- load ---------------------------------------------------------------------------------------


def load_pretrained(x: str | os.PathLike, *, dtype: str = "float32", param_dtype: str = "float32",
                    mesh=None, shardings=None, tokenizer: bool = True) -> Policy:
  """Loads a Policy from an HF directory, a `.gguf` file or a built-in name.

  dtype: compute dtype ("float32" | "bfloat16" | "float16"); param_dtype: storage dtype
  of the parameters. Without `mesh` and `shardings` the parameters go to the default device.
  With `mesh`, they are sharded by their logical axes (`param_shardings(config, mesh)`); or pass
  `shardings`, a pytree of Shardings matching the parameters. Either way each process reads only
  the slices of the checkpoint its devices hold, in the storage dtype (module doc).

  The tokenizer (`rljax.tokenizer.load_tokenizer` on the same source) is attached as
  `policy.tokenizer`; it is None when the source holds no tokenizer (an HF directory
  without tokenizer files, a GGUF without `tokenizer.ggml.tokens`) or `tokenizer=False`.
  A tokenizer that is present but broken raises its TokenizerError.
  """
  kind, path = resolve(x)
  if kind == "gguf":
    ckpt = open_gguf(path)
    config, source = ckpt.config, path
    has_tokenizer = ckpt.has("tokenizer.ggml.tokens")
    _check_shapes(config, ckpt.names, ckpt.shape, lambda _: path, "the GGUF metadata")
  else:
    config = ModelConfig.from_hf(_read_json(os.path.join(path, CONFIG_FILE)), os.path.join(path, CONFIG_FILE))
    ckpt = _SafetensorsCheckpoint(path)
    source = ckpt.source
    has_tokenizer = any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES)
    _check_shapes(config, ckpt.names, ckpt.shape, ckpt.file_of, CONFIG_FILE)
  config = config.replace(dtype=dtype, param_dtype=param_dtype)
  if mesh is None and shardings is None:
    params = jax.device_put(hf_to_params(config, ckpt.get, ckpt.names, source))
  else:
    if shardings is None:
      shardings = param_shardings(config, mesh)
    if kind == "gguf":
      params = _place_whole(config, ckpt.get, shardings)
    else:
      params = _place_slices(config, ckpt, shardings)
  policy = Policy(config=config, params=params, source=path)
  if tokenizer and has_tokenizer:
    policy.tokenizer = _load_tokenizer(path)
  return policy


# ---- sharded placement ---------------------------------------------------------------------------
#
# Each rljax parameter is a layout transform of HF tensors (layouts.py): its `Tensor` says how an
# index of the rljax array maps to a block of the HF tensor, so a device's shard is read as that
# block and transformed, never the whole tensor.


def _place_slices(c: ModelConfig, ckpt: "_SafetensorsCheckpoint", shardings) -> dict:
  """Every parameter as a sharded jax.Array whose local shards are read from the safetensors files.

  `jax.make_array_from_callback` asks only for the shards of this process's devices; each is
  read as HF blocks (`safe_open(...).get_slice(name)[block]`) and cast to the storage dtype.
  Peak host memory: about one device's shard of one parameter.
  """
  dtype = np.dtype(c.storage_dtype)
  params: dict = {}
  for spec in tensors(c):
    sharding = tree_get(shardings, spec.tree_path)

    def shard(index, spec=spec):
      if not spec.per_layer:
        return layouts.read_block(spec, ckpt.read, spec.hf_name(), tuple(index)).astype(dtype)
      first, *rest = index
      return np.stack([layouts.read_block(spec, ckpt.read, _names(spec, i), tuple(rest)).astype(dtype)
                       for i in spec.layer_ids(c.num_layers)[first]])

    shape = ((len(spec.layer_ids(c.num_layers)),) if spec.per_layer else ()) + spec.shape
    tree_set(params, spec.tree_path, jax.make_array_from_callback(shape, sharding, shard))
  return params


def _place_whole(c: ModelConfig, get, shardings) -> dict:
  """GGUF: each parameter built on the host (dequantized tensor by tensor, in the storage dtype)
  and placed by slices (jax.device_put copies each device only its shard); one at a time."""
  dtype = np.dtype(c.storage_dtype)
  params: dict = {}
  for spec in tensors(c):
    if spec.per_layer:
      value = np.stack([_to_rljax(spec, get, i).astype(dtype) for i in spec.layer_ids(c.num_layers)])
    else:
      value = layouts.to_rljax(spec, get(spec.hf_name())).astype(dtype)
    tree_set(params, spec.tree_path, jax.device_put(value, tree_get(shardings, spec.tree_path)))
    del value
  return params


def _names(spec: layouts.Tensor, layer: int):
  """The HF name of layer `layer`'s tensor, or the list of its experts' names ("experts" layout)."""
  names = spec.hf_names(layer)
  return names if spec.layout == "experts" else names[0]


def _to_rljax(spec: layouts.Tensor, get, layer: int) -> np.ndarray:
  ws = [get(name) for name in spec.hf_names(layer)]
  return layouts.to_rljax(spec, ws if spec.layout == "experts" else ws[0])


def _load_tokenizer(path: str):
  try:
    from rljax.tokenizer import load_tokenizer
  except ImportError:  # the tokenizer module is optional for weight I/O
    return None
  return load_tokenizer(path)


# ---- save ---------------------------------------------------------------------------------------


def parse_size(size: int | str) -> int:
  """Bytes from an int or a string like "5GB", "500MB", "2GiB"."""
  if isinstance(size, (int, np.integer)):
    return int(size)
  m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(size))
  if not m or m.group(2).upper() not in _SIZE_UNITS:
    raise WeightsError(f"max_shard_size={size!r} is not a size; use bytes or a string like '5GB' or '500MB'.")
  return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])


def _shard(tensors: dict[str, np.ndarray], max_bytes: int) -> list[dict[str, np.ndarray]]:
  """Splits tensors (in order) into groups of at most `max_bytes` (a larger tensor gets its own group)."""
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name, w in tensors.items():
    if shards[-1] and size + w.nbytes > max_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = w
    size += w.nbytes
  return shards


def save_pretrained(policy: Policy, out_dir: str | os.PathLike, dtype: str = "float32",
                    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> str:
  """Writes `policy` as a Hugging Face checkpoint directory; returns its path.

  Files: config.json, generation_config.json, model.safetensors (or
  model-0000i-of-0000n.safetensors + model.safetensors.index.json when the tensors
  exceed `max_shard_size`), and the tokenizer's files when `policy.tokenizer` has a
  `save(dir)` method. `dtype` ("float32" | "bfloat16" | "float16") is the tensor dtype
  on disk. `transformers.AutoModelForCausalLM.from_pretrained(out_dir)` loads it as is.
  """
  np_dtypes = {"float32": np.float32, "bfloat16": jax.numpy.bfloat16, "float16": np.float16}
  if dtype not in np_dtypes:
    raise WeightsError(f"save_pretrained dtype={dtype!r} is not supported; use one of {tuple(np_dtypes)}.")
  out_dir = os.fspath(out_dir)
  os.makedirs(out_dir, exist_ok=True)
  config = policy.config
  tensors = params_to_hf(config, jax.device_get(policy.params), dtype=np.dtype(np_dtypes[dtype]))

  # Remove weights a previous save left here, so the directory holds one checkpoint.
  for f in os.listdir(out_dir):
    if f in (SAFETENSORS_FILE, SAFETENSORS_INDEX) or _SHARD_FILE.match(f):
      os.remove(os.path.join(out_dir, f))
  shards = _shard(tensors, parse_size(max_shard_size))
  metadata = {"format": "pt"}
  if len(shards) == 1:
    save_file(tensors, os.path.join(out_dir, SAFETENSORS_FILE), metadata=metadata)
  else:
    weight_map = {}
    for i, shard in enumerate(shards):
      fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      save_file(shard, os.path.join(out_dir, fname), metadata=metadata)
      weight_map.update({name: fname for name in shard})
    index = {"metadata": {"total_size": int(sum(w.nbytes for w in tensors.values()))}, "weight_map": weight_map}
    _write_json(os.path.join(out_dir, SAFETENSORS_INDEX), index)

  _write_json(os.path.join(out_dir, CONFIG_FILE), config.to_hf(dtype))
  _write_json(os.path.join(out_dir, GENERATION_CONFIG_FILE), _generation_config(config))
  tokenizer = getattr(policy, "tokenizer", None)
  if tokenizer is not None and callable(getattr(tokenizer, "save", None)):
    tokenizer.save(out_dir)
  return out_dir


def _generation_config(c: ModelConfig) -> dict:
  eos = list(c.eos_token_ids)
  out = {"bos_token_id": c.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else (eos or None)}
  if c.pad_token_id is not None:
    out["pad_token_id"] = c.pad_token_id
  return out


def _write_json(path: str, data: dict) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(data, f, indent=2, sort_keys=False)
    f.write("\n")
