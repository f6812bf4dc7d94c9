"""The mixture-of-experts feed-forward block: a top-k router and dropless SwiGLU experts computed
with a grouped matmul, split over the mesh by expert (expert parallelism).

Shapes: B rows, T tokens, N = B * T, D hidden, E experts, k experts per token, F each expert's
width, M = N * k token copies (one per chosen expert), f the mesh's fsdp size, E_l = E / f.

Routing (`route`): router logits [N, E] = x W_r in float32, softmax, the top k experts of each
token and their probabilities as gates (renormalised to sum to 1 with `norm_topk_prob`), as
transformers' Qwen3-MoE. With routing replay the experts are given (the ones the sampler chose)
and the gates are the learner's probabilities at those experts, so the router still learns.

Experts (`grouped_experts`): the M copies are sorted by expert, each expert's SwiGLU runs on its
contiguous rows as one grouped matmul (`jax.lax.ragged_dot`, or the Pallas megablox kernel on
TPU when asked for), and the outputs are unsorted and summed with their gates. Dropless: every
copy is computed, whatever the load; padding tokens are sorted past the last group and computed
by no expert.

Expert parallelism: the experts' kernels [E, D, F] are split over the mesh's fsdp axis on E
(logical axis "expert"; rljax/sharding.py), so a chip holds E_l whole experts, and the tokens go
to them, inside `shard_map`, one of two ways (`MoeConfig.dispatch`):
- "gather": the tokens of the fsdp group are all-gathered (N/f * D per chip in, ~N * D out),
  every chip runs its E_l experts on the copies routed to them, and the outputs are
  reduce-scattered back to the tokens' chips. Bytes per chip ~ 2 (f - 1) N/f D per layer.
- "all_to_all": each token copy goes to its expert's chip by `jax.lax.ragged_all_to_all` and
  comes back the same way. Bytes per chip ~ 2 k (f - 1)/f N/f D per layer: cheaper than
  gathering when f > k. (XLA:CPU has no ragged all-to-all: on CPU it is emulated with an
  all-gather of the send buffers, which moves more bytes but computes the same values.)
Without expert parallelism (no mesh, fsdp = 1, or E not divisible by f) every chip runs all E
experts on its own tokens; an expert's width F is split over `tensor` when it divides.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from rljax import sharding as shd
from rljax.models.config import ModelConfig
from rljax.models.layers import activation, param

# Routes that were not recorded (no replay for that token) hold an id >= E: the learner routes it itself.


def expert_id_dtype(num_experts: int):
  """The smallest integer dtype holding expert ids 0..E and the "not recorded" marker E."""
  if num_experts < 255:
    return jnp.uint8
  return jnp.int16 if num_experts < 32767 else jnp.int32


def route(logits: jax.Array, k: int, norm_topk_prob: bool, replay: jax.Array | None = None):
  """logits [..., E] float32 -> (ids [..., k] int32, gates [..., k] float32, probs [..., E] float32).

  replay: None, or ids [..., k] (any integer dtype) to use instead of the top k where they are
  recorded (< E); the gates are then the probabilities of those experts.
  """
  probs = jax.nn.softmax(logits, axis=-1)
  gates, ids = jax.lax.top_k(probs, k)
  if replay is not None:
    e = logits.shape[-1]
    replay = replay.astype(jnp.int32)
    recorded = jnp.all(replay < e, axis=-1, keepdims=True)
    ids = jnp.where(recorded, replay, ids)
    gates = jnp.take_along_axis(probs, ids, axis=-1)
  if norm_topk_prob:
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
  return ids, gates, probs


def router_stats(c: ModelConfig, logits, probs, ids, real):
  """(aux_losses, router statistics) of one layer over its real tokens.

  logits, probs: [N, E] float32; ids: [N, k]; real: [N] bool. Aux losses are divided by the MoE
  layer count, so their sum over layers is the layer average (transformers' load-balancing loss
  is one average over the layers too). Statistics: load [E] float32 (token copies per expert),
  entropy [] (router entropy summed over real tokens), tokens [] (real tokens).
  """
  m = c.moe
  e = m.num_experts
  w = real.astype(jnp.float32)
  tokens = jnp.sum(w)
  load = jnp.zeros((e,), jnp.float32).at[ids].add(jnp.broadcast_to(w[:, None], ids.shape))
  entropy = -jnp.sum(w * jnp.sum(probs * jnp.log(jnp.maximum(probs, 1e-30)), axis=-1))
  layers = max(sum(c.moe_layers), 1)
  aux = {}
  denom = jnp.maximum(tokens, 1.0)
  if m.aux_loss_coef > 0:   # Switch / transformers: E * sum_e (copies to e / N) * (mean prob of e)
    mean_prob = jnp.sum(probs * w[:, None], axis=0) / denom
    aux["load_balance"] = m.aux_loss_coef * e * jnp.sum(load / denom * mean_prob) / layers
  if m.z_loss_coef > 0:
    z = jax.nn.logsumexp(logits, axis=-1)
    aux["router_z"] = m.z_loss_coef * jnp.sum(w * z * z) / denom / layers
  return aux, {"load": load, "entropy": entropy, "tokens": tokens}


class MoeBlock(nn.Module):
  """The mixture-of-experts feed-forward block (the block protocol of rljax/models/layers.py,
  plus `replay`): parameters router_kernel [D, E], gate_kernel / up_kernel [E, D, F],
  down_kernel [E, F, D]. Returns (y [B, T, D], stats): aux losses as `router_stats`, and router
  statistics with `experts` [B, T, k] int32, each token's chosen experts (what the sampler records)."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x, token_mask=None, replay=None):
    c = self.config
    m = c.moe
    dt, pdt = c.compute_dtype, c.storage_dtype
    d, e, f = c.hidden_size, m.num_experts, m.intermediate_size
    init = nn.initializers.normal(0.02)
    router = param(self, "router_kernel", init, (d, e), ("embed", None), pdt)
    wg = param(self, "gate_kernel", init, (e, d, f), ("expert", "embed", "mlp"), pdt)
    wu = param(self, "up_kernel", init, (e, d, f), ("expert", "embed", "mlp"), pdt)
    wd = param(self, "down_kernel", init, (e, f, d), ("expert", "mlp", "embed"), pdt)
    b, t, _ = x.shape
    real = jnp.ones((b, t), bool) if token_mask is None else token_mask
    logits = jnp.einsum("btd,de->bte", x, router.astype(dt), preferred_element_type=jnp.float32)
    ids, gates, probs = route(logits, m.experts_per_token, m.norm_topk_prob, replay)
    y = grouped_experts(c, x, ids, gates, real, (wg.astype(dt), wu.astype(dt), wd.astype(dt)))
    flat = lambda a: a.reshape((b * t,) + a.shape[2:])
    aux, stats = router_stats(c, flat(logits), flat(probs), flat(ids), flat(real))
    return y, {"aux_losses": aux, "router": {**stats, "experts": ids}}


# ---- the experts ------------------------------------------------------------------------------


def grouped_experts(c: ModelConfig, x, ids, gates, real, kernels):
  """sum_j gates[..., j] * expert_{ids[..., j]}(x): x [B, T, D] (compute dtype), ids [B, T, k]
  int32, gates [B, T, k] float32, real [B, T] bool (other tokens are computed by no expert and
  give 0), kernels (gate, up [E, D, F], down [E, F, D]) in the compute dtype. Returns [B, T, D]
  in the compute dtype. Split over the active mesh as the module doc says."""
  mesh = shd.active_mesh()
  if mesh is None or mesh.devices.size == 1:
    return _local_experts(c, x, ids, gates, real, kernels, 0).astype(x.dtype)
  return _sharded_experts(c, mesh, x, ids, gates, real, kernels)


def _gmm(c: ModelConfig, rows, w, sizes):
  """rows [M, K] @ w[g] for the rows of each group g (sizes [G] int32; rows past the groups give 0)."""
  if resolve_kernel(c.moe.kernel) == "megablox":
    from jax.experimental.pallas.ops.tpu import megablox
    m = rows.shape[0]
    pad = -m % 128
    out = megablox.gmm(jnp.pad(rows, ((0, pad), (0, 0))), w, sizes, preferred_element_type=rows.dtype,
                       interpret=_target_platform() != "tpu")
    rows_in = jnp.arange(m + pad) < jnp.sum(sizes)
    return jnp.where(rows_in[:, None], out, 0)[:m]
  return jax.lax.ragged_dot(rows, w, sizes)


def resolve_kernel(kernel: str) -> str:
  """The grouped matmul `kernel` names ("auto" is ragged_dot on every platform: XLA's native
  ragged dot on TPU; megablox has not been measured faster there: docs/models.md)."""
  return "ragged_dot" if kernel == "auto" else kernel


def _local_experts(c: ModelConfig, x, ids, gates, real, kernels, first):
  """The contributions of experts [first, first + E_l) (the kernels given) to every token of x:
  [..., D] float32. Token copies routed elsewhere, and tokens not `real`, give 0."""
  wg, wu, wd = kernels
  el = wg.shape[0]
  d = x.shape[-1]
  k = ids.shape[-1]
  x2 = x.reshape(-1, d)
  flat = ids.reshape(-1)
  n, mm = x2.shape[0], flat.shape[0]
  mine = jnp.repeat(real.reshape(-1), k) & (flat >= first) & (flat < first + el)
  key = jnp.where(mine, flat - first, el)
  order = jnp.argsort(key, stable=True)
  sizes = jnp.zeros((el + 1,), jnp.int32).at[key].add(1)[:el]
  rows = jnp.take(x2, order // k, axis=0)
  act = activation(c)
  h = act(_gmm(c, rows, wg, sizes)) * _gmm(c, rows, wu, sizes)
  out = _gmm(c, h, wd, sizes).astype(jnp.float32)                           # [M, D], sorted
  g = jnp.where(mine, gates.reshape(-1), 0.0)[order]
  out = jnp.where((g != 0)[:, None], out * g[:, None], 0.0)
  inverse = jnp.zeros((mm,), jnp.int32).at[order].set(jnp.arange(mm, dtype=jnp.int32))
  y = jnp.take(out, inverse, axis=0).reshape(n, k, d).sum(axis=1)
  return y.reshape(x.shape[:-1] + (d,))


def expert_parallel(c: ModelConfig, mesh) -> bool:
  """Whether the experts are split over the mesh's fsdp axis (E divisible by it, the rules map
  "expert" to fsdp)."""
  f = mesh.shape.get("fsdp", 1)
  if f <= 1 or c.moe.num_experts % f:
    return False
  spec = shd.logical_to_spec(("expert",), (c.moe.num_experts,), mesh, _rules())
  return spec[0] == "fsdp"


def dispatch_mode(c: ModelConfig, fsdp: int) -> str:
  """The dispatch `MoeConfig.dispatch` resolves to on an fsdp axis of `fsdp` chips: "auto" moves
  the fewer bytes (all-to-all when fsdp > k: module doc)."""
  if c.moe.dispatch != "auto":
    return c.moe.dispatch
  return "all_to_all" if fsdp > c.moe.experts_per_token else "gather"


def _rules():
  from rljax.sharding import _ACTIVE
  active = _ACTIVE.get()
  return shd.DEFAULT_RULES if active is None else active[1]


def _target_platform() -> str:
  from rljax.models.attention import target_platform
  return target_platform()


def _sharded_experts(c: ModelConfig, mesh, x, ids, gates, real, kernels):
  """`grouped_experts` under shard_map on the active mesh (module doc)."""
  P = jax.sharding.PartitionSpec
  b, _, d = x.shape
  f_size = c.moe.intermediate_size
  rules = _rules()
  batch = shd.logical_to_spec(("batch",), (b,), mesh, rules)[0]
  batch_axes = () if batch is None else ((batch,) if isinstance(batch, str) else tuple(batch))
  ep = expert_parallel(c, mesh)
  tensor = mesh.shape.get("tensor", 1)
  f_ax = "tensor" if tensor > 1 and f_size % tensor == 0 else None
  e_ax = "fsdp" if ep else None
  row = lambda ndim: P(batch, *([None] * (ndim - 1)))
  in_specs = (row(3), row(3), row(3), row(2), (P(e_ax, None, f_ax), P(e_ax, None, f_ax), P(e_ax, f_ax, None)))
  gathered = ep and "fsdp" in batch_axes
  mode = dispatch_mode(c, mesh.shape["fsdp"]) if gathered else "gather"
  platform = _target_platform()

  def body(x, ids, gates, real, kernels):
    if ep and mode == "all_to_all":
      y = _all_to_all_experts(c, x, ids, gates, real, kernels, emulate=platform == "cpu")
    elif gathered:
      ag = lambda a: jax.lax.all_gather(a, "fsdp", axis=0, tiled=True)
      first = jax.lax.axis_index("fsdp") * kernels[0].shape[0]
      y = _local_experts(c, ag(x), ag(ids), ag(gates), ag(real), kernels, first)
      y = jax.lax.psum_scatter(y, "fsdp", scatter_dimension=0, tiled=True)
    elif ep:
      first = jax.lax.axis_index("fsdp") * kernels[0].shape[0]
      y = jax.lax.psum(_local_experts(c, x, ids, gates, real, kernels, first), "fsdp")
    else:
      y = _local_experts(c, x, ids, gates, real, kernels, 0)
    if f_ax is not None:
      y = jax.lax.psum(y, "tensor")
    return y.astype(x.dtype)

  fn = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=row(3), check_vma=False)
  return fn(x, ids, gates, real, kernels)


def _exclusive_cumsum(a, axis=-1):
  return jnp.cumsum(a, axis=axis) - a


def _all_to_all_experts(c: ModelConfig, x, ids, gates, real, kernels, emulate: bool):
  """Inside shard_map over fsdp (the batch split over it, the experts too): each token copy is
  sent to the chip of its expert with a ragged all-to-all, computed there, and sent back.

  Per chip: n local tokens, M = n * k copies, sorted by expert (so by destination chip). The
  receive buffer holds the worst case, f * M rows (every peer sends all its copies here)."""
  wg = kernels[0]
  el = wg.shape[0]
  fs = jax.lax.axis_size("fsdp")
  me = jax.lax.axis_index("fsdp")
  d = x.shape[-1]
  k = ids.shape[-1]
  x2 = x.reshape(-1, d)
  flat = ids.reshape(-1)
  valid = jnp.repeat(real.reshape(-1), k)
  mm = flat.shape[0]
  key = jnp.where(valid, flat, el * fs)
  order = jnp.argsort(key, stable=True)
  dest = jnp.where(valid, flat // el, fs)
  send = jnp.zeros((fs + 1,), jnp.int32).at[dest].add(1)[:fs]               # [f] copies to each chip
  sizes = jax.lax.all_gather(send, "fsdp")                                    # [sender, receiver]
  in_off = _exclusive_cumsum(send)
  out_off = _exclusive_cumsum(sizes, axis=0)[me]                              # my chunk's place at each receiver
  recv = sizes[:, me]
  rows = jnp.take(x2, order // k, axis=0)
  a2a = _emulated_ragged_all_to_all if emulate else _ragged_all_to_all
  buf = a2a(rows, jnp.zeros((fs * mm, d), x2.dtype), in_off, send, out_off, recv)
  got = a2a(jnp.take(flat, order)[:, None], jnp.full((fs * mm, 1), el * fs, jnp.int32), in_off, send, out_off, recv)
  # The received copies: chunks by sender, each sorted by expert; compute them with my experts.
  local_ids = got[:, 0] - me * el
  ones = jnp.ones((fs * mm,), jnp.float32)
  in_range = (local_ids >= 0) & (local_ids < el)
  out = _local_experts(c, buf[:, None, :], local_ids[:, None], ones[:, None], in_range, kernels, 0)[:, 0]
  # Back to the senders, into the slots their copies left from.
  back_off = _exclusive_cumsum(sizes, axis=1)[:, me]                          # where each sender's chunk started
  back = a2a(out.astype(x2.dtype), jnp.zeros((mm, d), x2.dtype), _exclusive_cumsum(recv), recv, back_off, send)
  g = jnp.where(valid, gates.reshape(-1), 0.0)[order]
  contrib = jnp.where((g != 0)[:, None], back.astype(jnp.float32) * g[:, None], 0.0)
  inverse = jnp.zeros((mm,), jnp.int32).at[order].set(jnp.arange(mm, dtype=jnp.int32))
  y = jnp.take(contrib, inverse, axis=0).reshape(-1, k, d).sum(axis=1)
  return y.reshape(x.shape[:-1] + (d,))


def _ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
  return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                   axis_name="fsdp")


def _emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
  """`jax.lax.ragged_all_to_all` over fsdp from an all-gather of every sender's buffer and offsets
  (XLA:CPU has no ragged all-to-all): the same values, more bytes."""
  del recv_sizes
  fs = jax.lax.axis_size("fsdp")
  me = jax.lax.axis_index("fsdp")
  ops = jax.lax.all_gather(operand, "fsdp")                                   # [f, M, ...]
  ins, sends, outs = (jax.lax.all_gather(a, "fsdp") for a in (input_offsets, send_sizes, output_offsets))
  m = operand.shape[0]
  r = jnp.arange(m)
  for s in range(fs):
    n = sends[s, me]
    src = jnp.clip(ins[s, me] + r, 0, m - 1)
    dst = jnp.where(r < n, outs[s, me] + r, output.shape[0])
    output = output.at[dst].set(ops[s][src], mode="drop")
  return output
