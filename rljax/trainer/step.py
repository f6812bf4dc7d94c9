"""The training step as one path: sample -> score -> advantages -> loss -> update.

    prompts [P*O, Lp] --generate--> Rollout (P*O*G rows) --score--> Rollout with rewards
          --select groups, advantages, lp_old--> TrainBatch --scan over epochs x mini-batches
          (each a scan over micro-batches)--> optax updates

The single-turn sampler (`rljax.rollout.sampler.make_generate_fn`) and the other producers
(multi-turn tools, the partial pool) make the same `Rollout`. `make_update_fn` is everything
after scoring and is the only update there is: every rollout mode calls it. `make_train_step`
fuses the sampler, the reward callback and the update into one program.

Keys: the sampling key of rollout step k and the LoRA dropout keys of its updates derive from the
run's base key `state.rng` and the step (`rljax.trainer.state.rollout_key` / `dropout_key`), never
from a key carried from step to step, so every rollout mode and a resumed run draw the same ones.

Rows are prompt-major everywhere: row r belongs to prompt r // G. Mini-batches and micro-batches
take whole groups, interleaved (group j goes to part j % n), so every part draws from every
device's shard of the rows and no device sits idle while another computes its part.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import optax

from rljax import sharding as shd
from rljax.models import lora
from rljax.models.config import ModelConfig
from rljax.models.policy import apply_model, output_kernel
from rljax.models.transformer import positions_from_mask
from rljax.objectives import CE_OBJECTIVES
from rljax.objectives.losses import ce_loss, distill_advantages, distill_metrics, rft_keep, rft_metrics
from rljax.rl import LossConfig, chunked_logprobs, compute_advantages, kl_penalty, make_denominators, policy_loss
from rljax.rl.metrics import Metrics
from rljax.rollout.draw import SamplingParams
from rljax.rollout.sampler import make_generate_fn, sampler_metrics
from rljax.rollout.types import Rollout
from rljax.trainer import packing
from rljax.trainer.optim import skip_counts
from rljax.trainer.state import TrainState, dropout_key, rollout_key


@dataclasses.dataclass(frozen=True)
class StepSpec:
  """Everything static about a train step (hashable; changing it recompiles)."""
  model: ModelConfig
  sampling: SamplingParams
  loss: LossConfig
  prompts: int                      # P after dynamic-sampling selection
  mini_batches: int = 1
  epochs: int = 1
  micro_batches: int = 1
  eos_ids: tuple[int, ...] = ()
  oversample: int = 1               # > 1 enables dynamic sampling (prompts sampled = prompts * oversample)
  recompute_old_logprobs: bool = False
  logprob_chunk: int = 8192
  gap_rows: int = 0                 # rows whose learner log-probs are compared with the sampler's (0: none)
  pack_tokens: int = 0              # > 0: packed update, blocks of this many tokens (trainer/packing.py)
  shared_prefix: bool = False       # each prompt computed once per chunk of its group (trainer/packing.py)
  pack_width: int = 0               # packed bins' width in tokens (0: one row's, Lp + T)
  objective: str = "rl"             # config.train.objective (rljax/objectives): rl | sft | rft | distill
  min_reward: float = 0.0           # rft: rows with reward >= min_reward are trained on
  teacher: ModelConfig | None = None   # distill: the teacher's model config (its params: TrainState.teacher)
  reward_weight: float = 0.0        # distill: + reward_weight * the group advantage of the rewards, per token

  @property
  def group(self) -> int:
    return self.sampling.num_samples

  @property
  def cross_entropy(self) -> bool:
    """sft / rft: the loss is the cross-entropy of the (kept) target tokens, at temperature 1."""
    return self.objective in CE_OBJECTIVES

  @property
  def temperature(self) -> float:
    """The temperature of the learner's log-probs: the sampler's (the policy-gradient objectives), or 1
    (cross-entropy: the model's own distribution is what supervised targets train)."""
    return 1.0 if self.cross_entropy else self.sampling.logprob_temperature


@flax.struct.dataclass
class TrainBatch:
  """What the optimizer updates consume: a scored rollout's training view.

  prompt_ids, prompt_mask: [N, Lp]; tokens, mask, context_mask: [N, T]; lp_old, lp_samp: [N, T]
  f32; truncated: [N] bool; adv: [N] f32, or [N, T] per-token (distill); lp_ref: [N, T] f32 or None (no
  reference model); routes: the sampler's experts [N, Lp + T, L_moe, k] to replay (`Rollout.routes`),
  or None. Under sft / rft `mask` holds the target tokens trained on (rft: of the kept rows only).
  """
  prompt_ids: jax.Array
  prompt_mask: jax.Array
  tokens: jax.Array
  mask: jax.Array
  context_mask: jax.Array
  lp_old: jax.Array
  lp_samp: jax.Array
  truncated: jax.Array
  adv: jax.Array
  lp_ref: Any = None
  routes: Any = None


def sequence_forward(spec: StepSpec, params, prompt_ids, prompt_mask, tokens, mask, dropout_rng=None, routes=None):
  """`sequence_logprobs` and the forward's `ModelOutput` (its auxiliary losses and router
  statistics, empty for dense models): (lp, ent, out). routes: [B, Lp + T, L_moe, k] experts to
  replay (routing replay: the sampler's, `Rollout.routes`), or None."""
  lp_len = prompt_ids.shape[1]
  seq = jnp.concatenate([prompt_ids, tokens], axis=1)
  seq_mask = jnp.concatenate([prompt_mask, mask], axis=1)
  out = apply_model(spec.model, params, seq, positions_from_mask(seq_mask), seq_mask, return_hidden=True,
                    dropout_rng=dropout_rng, routes=routes)
  hidden = jax.lax.dynamic_slice_in_dim(out.hidden, lp_len - 1, tokens.shape[1], axis=1)
  lp, ent = chunked_logprobs(hidden, output_kernel(spec.model, params), tokens,
                             temperature=spec.temperature, chunk_size=spec.logprob_chunk,
                             softcap=spec.model.final_logit_softcap)
  return lp, ent, out


def sequence_logprobs(spec: StepSpec, params, prompt_ids, prompt_mask, tokens, mask, dropout_rng=None, routes=None):
  """Teacher-forced log-probs and entropies of the completion tokens.

  prompt_ids/prompt_mask: [B, Lp] (left-padded); tokens/mask: [B, T], mask the completion
  tokens the model sees (a rollout's `context_mask`). Returns (lp, ent): [B, T] float32 each,
  under logits / temperature, without materialising [B, T, V] (chunked over the vocabulary).
  dropout_rng: the LoRA dropout key of a training forward (None: no dropout). routes: experts to
  replay (`sequence_forward`).
  """
  lp, ent, _ = sequence_forward(spec, params, prompt_ids, prompt_mask, tokens, mask, dropout_rng, routes)
  return lp, ent


def add_aux_losses(loss, metrics: Metrics, aux_losses: dict, share):
  """The model's auxiliary losses added to the policy loss: loss + share * sum(aux_losses), each
  also reported as metric `aux_<name>` (reduced by "sum" and share-weighted, so the micro-batches
  or packed blocks of an update sum to its token-weighted mean). share: [] this forward's fraction
  of the update's real tokens. Dense models have none: loss and metrics come back unchanged."""
  if not aux_losses:
    return loss, metrics
  metrics = metrics.with_values(**{f"aux_{name}": jax.lax.stop_gradient(share * value)
                                   for name, value in aux_losses.items()})
  return loss + share * sum(aux_losses.values()), metrics


def add_router_metrics(metrics: Metrics, router: dict, share) -> Metrics:
  """A mixture of experts' routing figures of one forward, from `ModelOutput.router` (load [L_moe, E],
  entropy and tokens [L_moe]); dense models: metrics unchanged.

  moe/expert_load_max, moe/expert_load_min: token copies of the busiest / idlest expert over the
    mean per expert (1 = balanced), the extreme over the MoE layers and the step's forwards.
  moe/router_entropy: the router's entropy per real token, averaged over the MoE layers
    (share-weighted "sum", so an update's parts add up to its token-weighted mean; ln E = uniform).
  """
  if "load" not in router:
    return metrics
  load, tokens = router["load"], router["tokens"]
  per_expert = jnp.maximum(jnp.sum(load, axis=-1, keepdims=True) / load.shape[-1], 1e-9)
  rel = jax.lax.stop_gradient(load / per_expert)
  seen = (tokens > 0)[:, None]
  out = metrics.with_values()
  out.add("moe/expert_load_max", jnp.max(jnp.where(seen, rel, -jnp.inf)), "max")
  out.add("moe/expert_load_min", jnp.min(jnp.where(seen, rel, jnp.inf)), "min")
  entropy = jnp.sum(router["entropy"]) / jnp.maximum(jnp.sum(tokens), 1.0)
  out.add("moe/router_entropy", jax.lax.stop_gradient(share * entropy))
  return out


def _real_tokens(prompt_mask, mask):
  """[] float32: the real tokens a forward over prompts and completions sees."""
  return (jnp.sum(prompt_mask) + jnp.sum(mask)).astype(jnp.float32)


def split_groups(x: jax.Array, parts: int, group: int) -> jax.Array:
  """[N, ...] prompt-major rows -> [parts, N / parts, ...]: whole groups, group j in part j % parts."""
  n = x.shape[0]
  groups = n // group
  y = x.reshape((groups // parts, parts, group) + x.shape[1:])
  y = jnp.swapaxes(y, 0, 1)
  return y.reshape((parts, n // parts) + x.shape[1:])


def _select_groups(spec: StepSpec, rollout: Rollout):
  """Dynamic sampling: keep P of the P*oversample groups, those with reward variance first.

  Groups kept without signal (a shortfall) get zero loss weight. Returns the selected rollout
  and metrics.
  """
  g = spec.group
  rewards_pg = rollout.rewards.reshape(-1, g)
  p_all = rewards_pg.shape[0]
  spread = rewards_pg.max(axis=1) - rewards_pg.min(axis=1)
  has_signal = spread > 1e-6
  order = jnp.argsort(~has_signal, stable=True)[:spec.prompts]
  keep_signal = has_signal[order]
  rows = (order[:, None] * g + jnp.arange(g)[None, :]).reshape(-1)
  picked = rollout.rows(rows)
  picked = picked.replace(mask=picked.mask & jnp.repeat(keep_signal, g)[:, None])
  metrics = {
      "dynamic/groups_sampled": jnp.asarray(p_all, jnp.float32),
      "dynamic/groups_with_signal": has_signal.sum().astype(jnp.float32),
      "dynamic/groups_dropped": (p_all - has_signal.sum()).astype(jnp.float32),
      "dynamic/shortfall": (spec.prompts - keep_signal.sum()).astype(jnp.float32),
  }
  return picked, metrics


def make_update_fn(spec: StepSpec, optimizer: optax.GradientTransformation,
                   learning_rate_fn: Callable[[jax.Array], jax.Array] | None = None, *,
                   mesh: jax.sharding.Mesh | None = None):
  """Builds `update(state, rollout: Rollout with rewards) -> (state, metrics)`.

  Everything after scoring: dynamic-sampling selection, the reference log-probs, advantages,
  lp_old, then epochs x mini-batches optimizer updates (a scan, each update a scan over
  micro-batches: one copy of forward + backward in the program whatever their numbers);
  `state.step` advances by one.

  Metrics: the loss metrics of one optimizer update combine over its micro-batches by the
  reduction each was declared with where it is made (`rljax.rl.metrics.Metrics`: sum of globally
  normalised parts, max, min), then over the step's updates (mean, max, min).
  """
  cfg = spec.loss
  g = spec.group
  updates_per_step = spec.epochs * spec.mini_batches

  lora_dropout = spec.model.lora is not None and spec.model.lora.dropout > 0

  def logprobs(params, b):
    """[N, T] log-probs and entropies of the rows of `b` (no gradient is taken of them): over the
    packed layout's blocks when the update packs, else over padded rows."""
    if spec.pack_tokens:
      return packed_logprobs(params, b)
    return sequence_logprobs(spec, params, b.prompt_ids, b.prompt_mask, b.tokens, b.context_mask, None, b.routes)

  # The update's own forward is the learner on the sampler's parameters when the step makes one optimizer
  # update without dropout: the sampler-vs-learner gap is then read from it, over every trained row, instead
  # of from a forward of its own (`_logprob_gap`).
  gap_in_loss = (spec.gap_rows > 0 and not spec.recompute_old_logprobs and updates_per_step == 1
                 and not lora_dropout and not spec.cross_entropy)

  def objective_loss(lp, ent, b: TrainBatch, mask, den, gap_tokens=None):
    """The loss of config.train.objective on these rows: cross-entropy of the target tokens (sft, rft), or
    the policy loss (rl; distill, whose advantages are per token). gap_tokens: [] the update's mask count,
    with `gap_in_loss` (the gap metrics' denominator)."""
    if spec.cross_entropy:
      return ce_loss(lp, mask, den, cfg, entropy=ent)
    loss, metrics = policy_loss(lp, b.lp_old, b.adv, mask, den, cfg, lp_ref=b.lp_ref, lp_samp=b.lp_samp,
                                entropy=ent, truncated=b.truncated)
    if gap_in_loss:
      metrics = _add_gap_metrics(metrics, lp, b.lp_samp, mask, gap_tokens)
    return loss, metrics

  def loss_fn(trainable, frozen, mb: TrainBatch, den, key, total_tokens, gap_tokens):
    # Under LoRA `trainable` is the adapters and the gradient is theirs alone; `frozen` is None otherwise.
    params = trainable if frozen is None else lora.join(frozen, trainable)
    lp, ent, out = sequence_forward(spec, params, mb.prompt_ids, mb.prompt_mask, mb.tokens, mb.context_mask,
                                    key if lora_dropout else None, mb.routes)
    loss, metrics = objective_loss(lp, ent, mb, mb.mask, den, gap_tokens)
    share = _real_tokens(mb.prompt_mask, mb.context_mask) / total_tokens
    return add_aux_losses(loss, add_router_metrics(metrics, out.router, share), out.aux_losses, share)

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def accumulate(params, frozen, batch: TrainBatch, key):
    """Loss, summed grads and combined metrics over micro-batches (whole groups each)."""
    den = make_denominators(batch.mask, g, cfg, truncated=batch.truncated)
    total_tokens = _real_tokens(batch.prompt_mask, batch.context_mask)
    micro = jax.tree.map(lambda x: split_groups(x, spec.micro_batches, g), batch)

    def body(carry, xs):
      loss_acc, grads_acc = carry
      mb, i = xs
      (loss, metrics), grads = grad_fn(params, frozen, mb, den, jax.random.fold_in(key, i), total_tokens,
                                       _count(batch.mask))
      return (loss_acc + loss, jax.tree.map(jnp.add, grads_acc, grads)), metrics

    zeros = jax.tree.map(jnp.zeros_like, params)
    (loss, grads), metrics = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros),
                                          (micro, jnp.arange(spec.micro_batches)))
    return loss, grads, metrics.reduce_stacked(over="micro_batches")

  def layout_of(batch: TrainBatch) -> tuple[packing.PackLayout, int]:
    """The update's packed layout and its bins per block (trainer/packing.py)."""
    args = (batch.prompt_ids, batch.prompt_mask, batch.tokens, batch.context_mask)
    if not spec.pack_tokens:   # shared prefix, unpacked: a bin per group, a block per micro-batch
      groups = batch.tokens.shape[0] // g
      return packing.pack_shared(*args, g, groups // spec.micro_batches, fit=False), groups // spec.micro_batches
    width = spec.pack_width or batch.prompt_ids.shape[1] + batch.tokens.shape[1]
    bins = max(1, spec.pack_tokens // width)
    if spec.shared_prefix:
      return packing.pack_shared(*args, g, bins, width=width), bins
    return packing.pack(*args, bins, width=width), bins

  logprobs_of = functools.partial(chunked_logprobs, temperature=spec.temperature, chunk_size=spec.logprob_chunk,
                                  softcap=spec.model.final_logit_softcap)

  def block_forward(params, b, layout: packing.PackLayout, bins: int, routes, k, dropout_rng=None):
    """Block k of `layout`: (lp, ent) [N, T] in row layout (0 on rows outside block k), the forward's
    ModelOutput and the block's segment ids [R, W]. routes: the packed experts to replay, or None."""
    tok, seg, pre, pos = (None if x is None else shd.constrain(x, ("batch", "length"))
                          for x in layout.block_inputs(k, bins))
    out = apply_model(spec.model, params, tok, pos, seg > 0, segment_ids=seg, prefix_ids=pre, return_hidden=True,
                      dropout_rng=dropout_rng, routes=None if routes is None else packing.block_values(routes, k, bins))
    kernel = output_kernel(spec.model, params)
    lp, ent = logprobs_of(out.hidden[:, :-1], kernel, tok[:, 1:])
    firsts = (None, None)
    if layout.shared:   # a prompt copy's last position predicts each of its completions' first tokens
      lp0, ent0 = logprobs_of(packing.gather_sources(out.hidden, layout, k, bins)[:, None], kernel, b.tokens[:, :1])
      firsts = (lp0[:, 0], ent0[:, 0])
    pad = lambda x: jnp.pad(x, ((0, 0), (0, 1)))
    t = b.tokens.shape[1]
    lp, ent = (packing.gather_completion(pad(x), layout, k, bins, t, first) for x, first in zip((lp, ent), firsts))
    return lp, ent, out, seg

  def packed_routes(b, layout):
    return None if b.routes is None else packing.pack_values(
        layout, b.prompt_mask, b.context_mask, b.routes, spec.model.moe.num_experts)

  def packed_logprobs(params, b):
    """`logprobs` over the packed layout's blocks (forward only): each row is in one block."""
    layout, bins = layout_of(b)
    routes = packed_routes(b, layout)

    def body(k, acc):
      lp, ent, _, _ = block_forward(params, b, layout, bins, routes, k)
      return acc[0] + lp, acc[1] + ent

    zeros = jnp.zeros(b.tokens.shape, jnp.float32)
    return jax.lax.fori_loop(0, layout.num_blocks, body, (zeros, zeros))

  def accumulate_packed(params, frozen, batch: TrainBatch, key):
    """`accumulate` over blocks of a packed layout (trainer/packing.py): as many blocks as the rows'
    real tokens fill (R bins of W each), or the micro-batches of a shared-prefix layout. Same loss,
    grads and metrics."""
    den = make_denominators(batch.mask, g, cfg, truncated=batch.truncated)
    layout, bins = layout_of(batch)
    width = layout.tokens.shape[1]
    total_tokens = jnp.sum(layout.segment_ids > 0).astype(jnp.float32)
    t = batch.tokens.shape[1]
    routes = packed_routes(batch, layout)

    def block_loss(trainable, k):
      params = trainable if frozen is None else lora.join(frozen, trainable)
      lp, ent, out, seg = block_forward(params, batch, layout, bins, routes, k,
                                        jax.random.fold_in(key, k) if lora_dropout else None)
      mask = batch.mask & (layout.block == k)[:, None]
      loss, metrics = objective_loss(lp, ent, batch, mask, den, _count(batch.mask))
      share = jnp.sum(seg > 0).astype(jnp.float32) / total_tokens
      return add_aux_losses(loss, add_router_metrics(metrics, out.router, share), out.aux_losses, share)

    block_grad = jax.value_and_grad(block_loss, has_aux=True)
    shapes = jax.eval_shape(block_loss, params, jnp.int32(0))[1]
    init = shapes.identity()

    def body(k, carry):
      loss_acc, grads_acc, metrics_acc = carry
      (loss, metrics), grads = block_grad(params, k)
      return loss_acc + loss, jax.tree.map(jnp.add, grads_acc, grads), metrics_acc.combine(metrics)

    zeros = jax.tree.map(jnp.zeros_like, params)
    loss, grads, metrics = jax.lax.fori_loop(0, layout.num_blocks, body, (jnp.zeros((), jnp.float32), zeros, init))
    # Lengths over every row of the update, not per block (a block's other rows are masked out).
    lengths = batch.mask.sum(-1).astype(jnp.float32)
    metrics = metrics.with_values(
        response_length_max=lengths.max(), response_length_min=lengths.min(),
        truncation_rate=batch.truncated.astype(jnp.float32).mean(), packed_blocks=layout.num_blocks.astype(jnp.float32),
        packed_tokens=(layout.num_blocks * bins * width).astype(jnp.float32), packed_real_tokens=total_tokens,
        padded_tokens=jnp.asarray(lengths.shape[0] * (batch.prompt_ids.shape[1] + t), jnp.float32))
    return loss, grads, metrics

  def optimizer_update(state: TrainState, mb: TrainBatch, index):
    key = jax.random.fold_in(dropout_key(state.rng, state.step), index)   # LoRA dropout only
    blocks = spec.pack_tokens or spec.shared_prefix
    loss, grads, metrics = (accumulate_packed if blocks else accumulate)(state.params, state.frozen, mb, key)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    skipped = skip_counts(opt_state)
    skipped_now = (skipped["total"] > skip_counts(state.opt_state)["total"]).astype(jnp.float32)
    metrics = metrics.with_values(loss=loss, grad_norm=optax.tree.norm(grads), skipped=skipped_now)
    if learning_rate_fn is not None:
      metrics = metrics.with_values(learning_rate=learning_rate_fn(state.step * updates_per_step + index))
    return state.replace(params=params, opt_state=opt_state), metrics

  def ce_batch(rollout: Rollout) -> tuple[TrainBatch, dict]:
    """sft: the data's target tokens; rft: the sampled tokens of the rows whose reward reaches min_reward."""
    metrics: dict[str, Any] = {}
    mask = rollout.mask
    if spec.objective == "rft":
      keep = rft_keep(rollout.rewards, spec.min_reward)
      metrics.update(rft_metrics(keep, rollout.mask))
      mask = mask & keep[:, None]
    zeros = jnp.zeros(rollout.tokens.shape[:1], jnp.float32)
    return TrainBatch(prompt_ids=rollout.prompt_ids, prompt_mask=rollout.prompt_mask, tokens=rollout.tokens,
                      mask=mask, context_mask=rollout.context_mask, lp_old=rollout.logprobs, lp_samp=rollout.logprobs,
                      truncated=rollout.truncated, adv=zeros, routes=rollout.routes), metrics

  def teacher_logprobs(state: TrainState, rollout: Rollout):
    """[N, T] the frozen teacher's log-probs of the sampled tokens (its own model config, same temperature)."""
    teacher_spec = dataclasses.replace(spec, model=spec.teacher)
    lp, _ = sequence_logprobs(teacher_spec, state.teacher, rollout.prompt_ids, rollout.prompt_mask, rollout.tokens,
                              rollout.context_mask)
    return jax.lax.stop_gradient(lp)

  def train_batch(state: TrainState, rollout: Rollout) -> tuple[TrainBatch, dict]:
    """Reference log-probs, advantages and lp_old for the scored rollout."""
    if spec.cross_entropy:
      return ce_batch(rollout)
    metrics: dict[str, Any] = {}
    lp_ref = None
    rewards_pg = rollout.rewards.reshape(-1, g)
    reference = state.ref_params if state.frozen is None or not cfg.needs_reference else state.reference_params()
    if reference is not None:   # the reference model routes its own tokens (no replay)
      lp_ref, _ = logprobs(reference, rollout_view(rollout).replace(routes=None))
      lp_ref = jax.lax.stop_gradient(lp_ref)
      if cfg.kl_in_reward:
        kl = (kl_penalty(rollout.logprobs, lp_ref, rollout.mask, cfg.kl_estimator) * rollout.mask).sum(-1)
        rewards_pg = rewards_pg - cfg.kl_coef * kl.reshape(rewards_pg.shape)
        metrics["kl/in_reward_mean"] = kl.mean()
    adv, adv_metrics = compute_advantages(rewards_pg, cfg)
    metrics.update({_advantage_metric_name(k): v for k, v in adv_metrics.items()})
    if spec.recompute_old_logprobs:
      # The proximal policy of decoupled PPO: the parameters before this update. Against it the
      # sampler's log-probs (the behaviour policy) enter through the truncated IS weight (tis_cap).
      lp_old, _ = logprobs(state.model_params(), rollout_view(rollout))
      lp_old = jax.lax.stop_gradient(lp_old)
      if spec.gap_rows:   # on-policy: lp_old is the learner's forward on the sampler's parameters
        metrics.update(_gap_metrics(lp_old[:spec.gap_rows], rollout, spec.gap_rows))
    else:
      # The sampler ran the same model code on the same parameters: its log-probs are lp_old
      # (exact in fp32; `sampler/logprob_gap_*` measures how far that holds in this dtype).
      lp_old = rollout.logprobs
      if spec.gap_rows and not gap_in_loss:
        metrics.update(_logprob_gap(logprobs, state.model_params(), rollout, spec.gap_rows))
    adv = adv.reshape(-1)
    if spec.objective == "distill":
      # Per-token advantage: minus the reverse KL of each sampled token to the teacher (lp_old is the
      # learner's own forward here, so a teacher equal to the student gives exactly 0).
      lp_teacher = teacher_logprobs(state, rollout)
      metrics.update(distill_metrics(lp_old, lp_teacher, rollout.mask))
      per_token = distill_advantages(lp_old, lp_teacher, rollout.mask)
      adv = per_token + spec.reward_weight * adv[:, None] if spec.reward_weight else per_token
    batch = TrainBatch(prompt_ids=rollout.prompt_ids, prompt_mask=rollout.prompt_mask, tokens=rollout.tokens,
                       mask=rollout.mask, context_mask=rollout.context_mask, lp_old=lp_old, lp_samp=rollout.logprobs,
                       truncated=rollout.truncated, adv=adv, lp_ref=lp_ref, routes=rollout.routes)
    return batch, metrics

  def update(state: TrainState, rollout: Rollout):
    with shd.activate(mesh):
      metrics = {"sampler/tokens": rollout.lengths.sum().astype(jnp.float32)}   # sft: the data's target tokens
      if spec.objective != "sft":
        metrics["sampler/entropy"] = _masked_mean(rollout.entropy, rollout.mask)
      if rollout.decode_step is not None:
        metrics.update(sampler_metrics(rollout, spec.sampling))
      if spec.oversample > 1:
        rollout, dyn = _select_groups(spec, rollout)
        metrics.update(dyn)
      batch, batch_metrics = train_batch(state, rollout)
      metrics.update(batch_metrics)
      minis = jax.tree.map(lambda x: split_groups(x, spec.mini_batches, g), batch)

      def one_update(state, index):
        mb = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, index % spec.mini_batches, keepdims=False),
                          minis)
        return optimizer_update(state, mb, index)

      state, per_update = jax.lax.scan(one_update, state, jnp.arange(updates_per_step))
      metrics.update(per_update.reduce_stacked(over="updates"))
      skipped = skip_counts(state.opt_state)
      metrics["skipped_consecutive"] = skipped["consecutive"].astype(jnp.float32)
      metrics["skipped_total"] = skipped["total"].astype(jnp.float32)
    return state.replace(step=state.step + 1), metrics

  return update


def rollout_view(rollout: Rollout):
  """The fields `sequence_logprobs` reads, under the names TrainBatch uses."""
  return _LogprobView(rollout.prompt_ids, rollout.prompt_mask, rollout.tokens, rollout.context_mask, rollout.routes)


@flax.struct.dataclass
class _LogprobView:
  prompt_ids: jax.Array
  prompt_mask: jax.Array
  tokens: jax.Array
  context_mask: jax.Array
  routes: Any = None


def _advantage_metric_name(name: str) -> str:
  """compute_advantages' reward_* figures are over the trained groups (after selection and KL
  shaping): `trained_reward/*`, apart from the host's `reward/*` over every scored row."""
  return "trained_reward/" + name[len("reward_"):] if name.startswith("reward_") else name


def _masked_mean(x, mask):
  mask = mask.astype(jnp.float32)
  return (x * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def _count(mask) -> jax.Array:
  """[] float32: the true entries of `mask`, at least 1 (a denominator)."""
  return jnp.maximum(jnp.sum(mask), 1).astype(jnp.float32)


def _add_gap_metrics(metrics: Metrics, lp, lp_samp, mask, tokens) -> Metrics:
  """`sampler/logprob_gap_*` (as `_gap_metrics`) of these rows of the update's own forward, as parts that
  sum (mean, fraction) or take the max over the update's micro-batches or blocks; tokens: [] the
  update's mask count."""
  diff = jnp.abs(jax.lax.stop_gradient(lp) - lp_samp)
  out = metrics.with_values()
  out.add("sampler/logprob_gap_mean", jnp.sum(jnp.where(mask, diff, 0.0)) / tokens)
  out.add("sampler/logprob_gap_max", jnp.max(jnp.where(mask, diff, 0.0)), "max")
  out.add("sampler/logprob_gap_frac_1pct", jnp.sum(mask & (diff > jnp.log(1.01))) / tokens)
  return out


def _logprob_gap(logprobs, params, rollout: Rollout, rows: int) -> dict[str, jax.Array]:
  """The sampler-vs-learner log-prob gap on the first `rows` rows (whole groups).

  In fp32 it is ~1e-6 (shared model code); in bf16 the sampler's cached decode and the learner's
  full forward round differently. Not structurally 0: the learner really recomputes these rows.
  """
  view = jax.tree.map(lambda x: x[:rows], rollout_view(rollout))
  lp, _ = logprobs(params, view)
  return _gap_metrics(lp, rollout, rows)


def _gap_metrics(lp, rollout: Rollout, rows: int) -> dict[str, jax.Array]:
  """`sampler/logprob_gap_*` of the learner's log-probs lp [rows, T] against the sampler's."""
  mask = rollout.mask[:rows]
  diff = jnp.abs(jax.lax.stop_gradient(lp) - rollout.logprobs[:rows])
  return {"sampler/logprob_gap_mean": _masked_mean(diff, mask),
          "sampler/logprob_gap_max": jnp.max(jnp.where(mask, diff, 0.0)),
          "sampler/logprob_gap_frac_1pct": _masked_mean(diff > jnp.log(1.01), mask)}


def make_train_step(spec: StepSpec, optimizer: optax.GradientTransformation,
                    reward_fn: Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]],
                    learning_rate_fn: Callable[[jax.Array], jax.Array] | None = None, *,
                    mesh: jax.sharding.Mesh | None = None, decode_layout=None):
  """Builds the fused `step(state, prompt_ids [P*O, Lp], prompt_mask [P*O, Lp][, reward_inputs]) -> (state, metrics)`.

  `reward_fn(tokens [N, T], lengths [N][, reward_inputs]) -> (rewards [N] f32, components [N, K] f32)` is the
  io_callback bridge of the reward pool; `reward_inputs` (`reward_fn.graph_inputs`: the reward models' and judges'
  parameters and prompt pieces) lets it score the rows with those models in this program first. The returned
  function is not jitted; the caller jits it with shardings and donation (see `jit_train_step`). decode_layout:
  the sampler's weight layout (`make_generate_fn`; default: chosen from the device's memory when traced).
  """
  generate = make_generate_fn(spec, mesh, decode_layout=decode_layout)
  update = make_update_fn(spec, optimizer, learning_rate_fn, mesh=mesh)

  def step(state: TrainState, prompt_ids, prompt_mask, reward_inputs=None):
    rollout = generate(state.model_params(), rollout_key(state.rng, state.step), prompt_ids, prompt_mask)
    with shd.activate(mesh):
      scores = reward_fn(rollout.tokens, rollout.lengths) if reward_inputs is None else \
          reward_fn(rollout.tokens, rollout.lengths, reward_inputs)
      rollout = rollout.with_rewards(*scores)
    return update(state, rollout)

  return step


def jit_train_step(step_fn, state_shardings=None, batch_sharding=None, inputs_shardings=None):
  """jit with the state donated (its buffers are reused for the new state); `inputs_shardings`: those
  of the reward inputs (the step then takes them as its fourth argument)."""
  kwargs = {}
  if state_shardings is not None:
    ins = (state_shardings, batch_sharding, batch_sharding)
    kwargs = dict(in_shardings=ins if inputs_shardings is None else ins + (inputs_shardings,),
                  out_shardings=(state_shardings, None))
  return jax.jit(step_fn, donate_argnums=(0,), **kwargs)
