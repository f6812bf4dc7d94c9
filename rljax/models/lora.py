"""LoRA adapters as their own parameter tree, beside a frozen base.

With `ModelConfig.lora` set, the model's parameter tree holds, next to each adapted kernel
`<name>_kernel`, the leaves `<name>_lora_a` [..., *in, r] and `<name>_lora_b` [..., r, *out]
(float32; `...` is the stacked layers axis). The model adds (alpha / r) * (x A) B to that
projection when the leaves are there and runs the base model when they are not, so:

- `split(params) -> (base, adapters)`: two trees of the same nesting, disjoint leaves; the trainer
  keeps the base frozen (in the storage dtype) and trains and checkpoints only the adapters;
- `join(base, adapters)`: the tree the model runs (sampler and learner alike);
- the base alone is the reference policy of the KL penalty: no second copy of the model.

`merge` folds the adapters into the kernels (W + (alpha / r) A B) for a plain HF export.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from rljax.models.config import ModelConfig
from rljax.models.policy import init_params
from rljax.sharding import global_values

_A, _B = "_lora_a", "_lora_b"


def is_adapter(name: str) -> bool:
  return name.endswith((_A, _B))


def _partition(tree, keep_adapters: bool):
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      sub = _partition(v, keep_adapters)
      if sub:
        out[k] = sub
    elif is_adapter(k) == keep_adapters:
      out[k] = v
  return out


def split(params) -> tuple[Any, Any]:
  """A model tree -> (base, adapters): the same nesting, the adapter leaves in the second."""
  return _partition(params, False), _partition(params, True)


def join(base, adapters):
  """(base, adapters) -> the tree the model runs; `adapters=None` gives the base model."""
  if adapters is None:
    return base
  out = dict(base)
  for k, v in adapters.items():
    out[k] = join(base[k], v) if isinstance(v, dict) else v
  return out


def adapted_kernels(adapters) -> list[tuple[tuple[str, ...], str]]:
  """(path of the module, projection name) of every adapter in the tree, e.g. (("layers", "attn"), "q")."""
  found = []

  def walk(node, path):
    for k, v in node.items():
      if isinstance(v, dict):
        walk(v, path + (k,))
      elif k.endswith(_A):
        found.append((path, k[:-len(_A)]))

  walk(adapters, ())
  return found


def delta(a: jax.Array, b: jax.Array, scale: float, stacked: bool = True) -> jax.Array:
  """(alpha / r) A B in the kernel's shape: a [L, *in, r], b [L, r, *out] -> [L, *in, *out] float32."""
  one = lambda a, b: jnp.tensordot(a.astype(jnp.float32), b.astype(jnp.float32), axes=1) * scale
  return jax.vmap(one)(a, b) if stacked else one(a, b)


def merge(config: ModelConfig, base, adapters):
  """The base tree with every adapter folded into its kernel: a plain model equal to the adapted
  one, for export. Adapted kernels come back in float32 (a bf16 base plus a small delta rounded
  to bf16 would lose most of the delta; the export rounds once, to its own dtype)."""
  scale = config.lora.scale
  out = jax.tree.map(lambda x: x, base)
  for path, name in adapted_kernels(adapters):
    node_a, node_o = adapters, out
    for p in path:
      node_a, node_o = node_a[p], node_o[p]
    w = node_o[f"{name}_kernel"]
    d = delta(node_a[name + _A], node_a[name + _B], scale, stacked="layers" in path)
    node_o[f"{name}_kernel"] = jnp.asarray(w, jnp.float32) + d
  return out


def init_adapters(config: ModelConfig, rng: jax.Array, shardings=None):
  """Fresh adapters (A random, B zero) for `config.lora`, without materialising the base: the
  base's initialisers are traced and dropped. `shardings`: the adapters' NamedShardings or None."""
  fn = lambda key: split(init_params(config, key))[1]
  return jax.jit(fn, out_shardings=shardings)(rng) if shardings is not None else jax.jit(fn)(rng)


def fingerprint(base) -> float:
  """A cheap identity of the base weights (sum of |w| over every leaf, float32 on device): a
  checkpoint of adapters records it so that resuming or exporting onto another base is refused."""
  total = jax.jit(lambda t: sum(jnp.sum(jnp.abs(x.astype(jnp.float32))) for x in jax.tree.leaves(t)))(base)
  return float(global_values(total))   # also on a process that holds none of the base (async across processes)
