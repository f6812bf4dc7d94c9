"""The fused generate-score-update step: one jitted program per rollout batch.

    prompts [P, Lp] --sample--> P*G completions --io_callback--> rewards [P*G]
            --advantages--> [P, G] --(epochs x mini-batches x micro-batches)--> optax updates

Rows are prompt-major everywhere: row r belongs to prompt r // G, so splitting rows
into contiguous chunks splits by whole groups.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from rljax.models.config import ModelConfig
from rljax.models.policy import apply_model, output_kernel
from rljax.models.transformer import positions_from_mask
from rljax.rl import LossConfig, chunked_logprobs, compute_advantages, kl_penalty, make_denominators, policy_loss
from rljax.sampling import SamplingParams, sample
from rljax.trainer.state import TrainState


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

  @property
  def group(self) -> int:
    return self.sampling.num_samples


def sequence_logprobs(spec: StepSpec, params, prompt_ids, prompt_mask, tokens, mask):
  """Teacher-forced log-probs and entropies of the completion tokens.

  prompt_ids/prompt_mask: [B, Lp] (left-padded); tokens/mask: [B, T], mask the completion
  tokens the model sees (for multi-turn rollouts: model and tool tokens, `context_mask`).
  Returns (lp, ent): [B, T] float32 each, under logits / temperature, without
  materialising [B, T, V] (chunked over the vocabulary).
  """
  lp_len = prompt_ids.shape[1]
  seq = jnp.concatenate([prompt_ids, tokens], axis=1)
  seq_mask = jnp.concatenate([prompt_mask, mask], axis=1)
  hidden, _ = apply_model(spec.model, params, seq, positions_from_mask(seq_mask), seq_mask, return_hidden=True)
  hidden = jax.lax.dynamic_slice_in_dim(hidden, lp_len - 1, tokens.shape[1], axis=1)
  temperature = spec.sampling.temperature if spec.sampling.temperature > 0 else 1.0
  return chunked_logprobs(hidden, output_kernel(spec.model, params), tokens, temperature=temperature,
                          chunk_size=spec.logprob_chunk)


def _context(rollout: dict):
  """The completion tokens the model sees: `context_mask` (multi-turn: model and tool tokens) or
  `mask` (single turn: the trained tokens are all there is)."""
  return rollout.get("context_mask", rollout["mask"])


def _select_groups(spec: StepSpec, rollout: dict, rewards_pg: jax.Array):
  """Dynamic sampling: keep P of the P*oversample groups, those with reward variance first.

  Groups kept without signal (a shortfall) get zero loss weight. Returns the gathered
  rollout, rewards [P, G] and metrics.
  """
  p_all, g = rewards_pg.shape
  spread = rewards_pg.max(axis=1) - rewards_pg.min(axis=1)
  has_signal = spread > 1e-6
  order = jnp.argsort(~has_signal, stable=True)[:spec.prompts]
  keep_signal = has_signal[order]
  rows = (order[:, None] * g + jnp.arange(g)[None, :]).reshape(-1)
  picked = jax.tree.map(lambda x: x[rows], rollout)
  picked["mask"] = picked["mask"] & jnp.repeat(keep_signal, g)[:, None]
  metrics = {
      "dynamic/groups_sampled": jnp.asarray(p_all, jnp.float32),
      "dynamic/groups_with_signal": has_signal.sum().astype(jnp.float32),
      "dynamic/groups_dropped": (p_all - has_signal.sum()).astype(jnp.float32),
      "dynamic/shortfall": (spec.prompts - keep_signal.sum()).astype(jnp.float32),
  }
  return picked, rewards_pg[order], metrics


def make_generate_fn(spec: StepSpec):
  """Builds `generate(params, key, prompt_ids [P*O, Lp], prompt_mask [P*O, Lp]) -> rollout`.

  The rollout is a dict of device arrays, rows prompt-major (P*O*G of them): prompt_ids and
  prompt_mask [N, Lp]; tokens [N, T] int32, mask [N, T] bool, lp_samp and entropy_samp [N, T]
  f32 (the sampler's log-probs and entropies), lengths [N] int32 and truncated [N] bool.
  """

  def generate(params, key, prompt_ids, prompt_mask):
    out = sample(spec.model, params, prompt_ids, prompt_mask, spec.sampling, key, eos_ids=spec.eos_ids)
    return dict(prompt_ids=out.prompt_ids, prompt_mask=out.prompt_mask, tokens=out.tokens, mask=out.mask,
                lp_samp=out.logprobs, truncated=out.truncated, entropy_samp=out.entropy, lengths=out.lengths)

  return generate


def make_update_fn(spec: StepSpec, optimizer: optax.GradientTransformation,
                   learning_rate_fn: Callable[[jax.Array], jax.Array] | None = None, *, advance_rng: bool = False):
  """Builds `update(state, rollout, rewards [N] f32, components [N, K] f32) -> (state, metrics)`.

  Everything after scoring: dynamic-sampling selection, the reference log-probs, advantages,
  lp_old, then epochs x mini-batches optimizer updates (micro-batched); `state.step` advances
  by one. `advance_rng=True` also advances `state.rng` by the split the fused step makes, for
  the decoupled modes that draw their sampling keys outside the step (trainer/rollouts.py).
  """
  cfg = spec.loss
  g = spec.group
  updates_per_step = spec.epochs * spec.mini_batches

  def loss_fn(params, mb, den):
    lp, ent = sequence_logprobs(spec, params, mb["prompt_ids"], mb["prompt_mask"], mb["tokens"], _context(mb))
    return policy_loss(lp, mb["lp_old"], mb["adv"], mb["mask"], den, cfg, lp_ref=mb.get("lp_ref"),
                       lp_samp=mb["lp_samp"], entropy=ent, truncated=mb["truncated"])

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def accumulate(params, batch):
    """Loss, summed grads and mean metrics over micro-batches (split by whole groups)."""
    den = make_denominators(batch["mask"], g, cfg, truncated=batch["truncated"])
    n = spec.micro_batches
    micro = jax.tree.map(lambda x: x.reshape((n, x.shape[0] // n) + x.shape[1:]), batch)

    def body(carry, mb):
      loss_acc, grads_acc = carry
      (loss, metrics), grads = grad_fn(params, mb, den)
      return (loss_acc + loss, jax.tree.map(jnp.add, grads_acc, grads)), metrics

    zeros = jax.tree.map(jnp.zeros_like, params)
    (loss, grads), metrics = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), micro)
    return loss, grads, jax.tree.map(lambda m: m.mean(0), metrics)

  def update(state: TrainState, rollout: dict, rewards, components):
    if advance_rng:
      state, _ = state.next_rng()
    rollout = dict(rollout, rewards=rewards, components=components)
    metrics: dict[str, Any] = {}
    rewards_pg = rewards.reshape(-1, g)
    if spec.oversample > 1:
      rollout, rewards_pg, dyn = _select_groups(spec, rollout, rewards_pg)
      metrics.update(dyn)

    if state.ref_params is not None:
      lp_ref, _ = sequence_logprobs(spec, state.ref_params, rollout["prompt_ids"], rollout["prompt_mask"],
                                    rollout["tokens"], _context(rollout))
      rollout["lp_ref"] = jax.lax.stop_gradient(lp_ref)
      if cfg.kl_in_reward:
        kl = (kl_penalty(rollout["lp_samp"], lp_ref, rollout["mask"], cfg.kl_estimator) * rollout["mask"]).sum(-1)
        rewards_pg = rewards_pg - cfg.kl_coef * kl.reshape(rewards_pg.shape)
        metrics["kl/in_reward_mean"] = kl.mean()

    adv, adv_metrics = compute_advantages(rewards_pg, cfg)
    metrics.update(adv_metrics)
    rollout["adv"] = adv.reshape(-1)
    if spec.recompute_old_logprobs:
      # The proximal policy of decoupled PPO: the parameters before this update. Against it the
      # sampler's log-probs (the behaviour policy) enter through the truncated IS weight (tis_cap).
      lp_old, _ = sequence_logprobs(spec, state.params, rollout["prompt_ids"], rollout["prompt_mask"],
                                    rollout["tokens"], _context(rollout))
      rollout["lp_old"] = jax.lax.stop_gradient(lp_old)
    else:
      # The sampler ran the same model code on the same parameters: its log-probs are lp_old.
      rollout["lp_old"] = rollout["lp_samp"]

    train_keys = ("prompt_ids", "prompt_mask", "tokens", "mask", "lp_old", "lp_samp", "truncated", "adv") + tuple(
        k for k in ("lp_ref", "context_mask") if k in rollout)
    batch = {k: rollout[k] for k in train_keys}
    rows = batch["tokens"].shape[0] // spec.mini_batches
    update_metrics = []
    for epoch in range(spec.epochs):
      for m in range(spec.mini_batches):
        mb = jax.tree.map(lambda x: x[m * rows:(m + 1) * rows], batch)
        loss, grads, lm = accumulate(state.params, mb)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(grad_norm) & jnp.isfinite(loss)
        updates, new_opt = optimizer.update(grads, state.opt_state, state.params)
        new_params = optax.apply_updates(state.params, updates)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
        state = state.replace(
            params=keep(new_params, state.params), opt_state=keep(new_opt, state.opt_state),
            skipped_total=state.skipped_total + (~finite).astype(jnp.int32),
            skipped_consecutive=jnp.where(finite, 0, state.skipped_consecutive + 1))
        lm = dict(lm, loss=loss, grad_norm=grad_norm, skipped=(~finite).astype(jnp.float32))
        if learning_rate_fn is not None:
          lm["learning_rate"] = learning_rate_fn(state.step * updates_per_step + epoch * spec.mini_batches + m)
        update_metrics.append(lm)
    metrics.update(jax.tree.map(lambda *xs: jnp.stack(xs).mean(), *update_metrics))
    metrics.update(_rollout_metrics(spec, rollout, rewards_pg))
    metrics["skipped_consecutive"] = state.skipped_consecutive.astype(jnp.float32)
    metrics["skipped_total"] = state.skipped_total.astype(jnp.float32)
    return state.replace(step=state.step + 1), metrics

  return update


def make_train_step(spec: StepSpec, optimizer: optax.GradientTransformation,
                    reward_fn: Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]],
                    learning_rate_fn: Callable[[jax.Array], jax.Array] | None = None):
  """Builds the fused `step(state, prompt_ids [P*O, Lp], prompt_mask [P*O, Lp]) -> (state, metrics)`.

  `reward_fn(tokens [N, T], lengths [N]) -> (rewards [N] f32, components [N, K] f32)` is
  the io_callback bridge of the reward pool. The returned function is not jitted;
  the caller jits it with shardings and donation (see `jit_train_step`).
  """
  generate = make_generate_fn(spec)
  update = make_update_fn(spec, optimizer, learning_rate_fn)

  def step(state: TrainState, prompt_ids, prompt_mask):
    state, key = state.next_rng()
    rollout = generate(state.params, key, prompt_ids, prompt_mask)
    rewards, components = reward_fn(rollout["tokens"], rollout["lengths"])
    return update(state, rollout, rewards, components)

  return step


def _rollout_metrics(spec: StepSpec, rollout: dict, rewards_pg: jax.Array) -> dict[str, jax.Array]:
  mask = rollout["mask"]
  tokens = jnp.maximum(mask.sum(), 1)
  comps = rollout["components"]
  out = {
      "reward/mean": rewards_pg.mean(),
      "reward/std": rewards_pg.std(),
      "response/tokens": rollout["lengths"].sum().astype(jnp.float32),
      "sampler/entropy": (rollout["entropy_samp"] * mask).sum() / tokens,
      "reward/components": comps.mean(axis=0),
  }
  return out


def jit_train_step(step_fn, state_shardings=None, batch_sharding=None):
  """jit with the state donated (its buffers are reused for the new state)."""
  kwargs = {}
  if state_shardings is not None:
    kwargs = dict(in_shardings=(state_shardings, batch_sharding, batch_sharding),
                  out_shardings=(state_shardings, None))
  return jax.jit(step_fn, donate_argnums=(0,), **kwargs)
