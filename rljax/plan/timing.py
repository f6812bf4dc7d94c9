"""How long a step will take: a roofline estimate per phase, from rljax's analytic FLOP counts.

Each phase is as slow as its slower side, compute (FLOPs / the chip's peak) or memory (bytes that
must stream from HBM / the chip's bandwidth), plus the collectives the compiled program does
(bytes per chip / the chip's interconnect bandwidth, not overlapped):

    prefill          forward over prompts x Lp tokens;   reads the sampler's weights once
    decode token     forward over the decode rows;        reads the weights and the whole KV cache
    decode           decode token x decode steps (L per row; rows x L / slots with sampling.slots)
    update           forward + backward (+ remat's recompute, + reference / old log-prob forwards)
                     over the rows' computed positions;   reads and writes the train state

FLOPs come from rljax/flops.py (the model's matmuls and attention, the count behind perf/mfu), not
from XLA's cost analysis, which counts a while loop's body once (the 7B learner: 9.18e11 FLOPs per
chip there against 4.41e13 counted here). A roofline is a lower bound: kernels reach a fraction of
the peak, and small decode steps pay launch overhead; docs/plan.md gives how far off the estimate
was where a step could be measured.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from rljax import flops
from rljax.errors import ConfigError

# Per chip, from the vendors' spec sheets: HBM bytes/s and interconnect bytes/s (TPU ICI: Google's
# per-chip Gbps / 8; GPU: NVLink per direction). The peak FLOP/s are rljax/flops.py's.
_MEMORY = {
    "v4": (1.2e12, 300e9),
    "v5e": (819e9, 200e9),
    "v5p": (2.765e12, 600e9),
    "v6e": (1.64e12, 448e9),
    "h200": (4.8e12, 450e9),
    "h100": (3.35e12, 450e9),
    "a100": (2.039e12, 300e9),
}
KNOWN_CHIPS = tuple(_MEMORY)
_FLOPS_NAMES = {"v6": "v6e", "v5 lite": "v5e"}   # flops.py's table names -> these


@dataclasses.dataclass(frozen=True)
class ChipRates:
  """One chip's rates. flops: for the run's compute dtype (GPUs run float32 through TF32 at half
  the bf16 rate); link: None where the chips share a host's memory (simulated CPU devices)."""
  name: str
  flops: float
  hbm: float
  link: float | None
  source: str


def spec_rates(chip: str, dtype: str) -> ChipRates:
  """The spec-sheet rates of `chip` (a name of KNOWN_CHIPS, or a device kind containing one)."""
  known = flops.spec_peak(chip, dtype)
  key = _FLOPS_NAMES.get(known[0], known[0]) if known else None
  if key not in _MEMORY:
    raise ConfigError(f"no rates known for chip {chip!r}; known: {', '.join(KNOWN_CHIPS)}.")
  hbm, link = _MEMORY[key]
  return ChipRates(key, known[1], hbm, link, f"spec sheet ({key})")


@functools.lru_cache(maxsize=None)
def _host_bandwidth() -> float:
  """Bytes/s of a 256 MiB copy on one CPU device (read + write counted), best of 5."""
  x = jnp.zeros((64 << 20,), jnp.float32)
  copy = jax.jit(lambda a: a + 1.0)
  best = flops.timed(lambda: jax.block_until_ready(copy(x)), 5, reduce=min)
  return 2 * x.nbytes / best


def host_rates(devices: int, dtype: str) -> ChipRates:
  """This machine's CPU, measured (matmul peak as perf/mfu takes it, a copy's bandwidth), split
  evenly over `devices` simulated devices, which share the host's cores and memory."""
  peak, _ = flops.device_peak_flops(dtype)
  bw = _host_bandwidth()
  return ChipRates("cpu", peak / devices, bw / devices, None,
                   f"this CPU, measured: {peak / 1e9:.0f} GFLOP/s {dtype} matmul, {bw / 1e9:.1f} GB/s copy, "
                   f"over {devices} device(s)")


def _phase(flop: float, bytes_: float, coll: float, rates: ChipRates) -> dict:
  compute, memory = flop / rates.flops, bytes_ / rates.hbm
  comm = coll / rates.link if rates.link and coll else 0.0
  return {"s": max(compute, memory) + comm, "compute_s": compute, "memory_s": memory, "collective_s": comm,
          "bound": "compute" if compute >= memory else "memory"}


def estimate(*, model, rates: ChipRates, chips: int, prompts: int, group: int, prompt_len: int, max_new: int,
             completion: float, decode_rows: int, packed: bool, epochs: int, extra_forwards: int,
             sampler_weights_bytes: float, kv_bytes: float, state_bytes: float, remat: bool,
             decode_collective_bytes: float = 0.0, update_collective_bytes: float = 0.0, updates: int = 1,
             shared_prefix: bool = False) -> dict:
  """Seconds per phase and per step, per chip (every chip does 1/chips of the work).

  model: a ModelConfig; prompts x group rows, prompts of prompt_len tokens (padded: the device
  computes them), completions of `completion` tokens on average out of max_new; decode_rows: the
  sampler's decode slots; packed: the update computes real positions (train.pack_tokens) rather
  than every row to max_new, its reference and old-log-prob forwards too; shared_prefix: the update
  computes each prompt once per group rather than once per row (train.shared_prefix; one prompt copy
  per group assumed, the fewest the packer makes; unpacked, the extra forwards stay per row);
  *_bytes: per chip (the plan's figures: sampler weights as the decode layout holds them, KV cache,
  learner train state, collectives per decode token and per update).
  """
  rows = prompts * group
  ctx = prompt_len + completion / 2
  prefill = _phase(flops.forward_flops(model, prompts * prompt_len, prompt_len / 2) / chips,
                   sampler_weights_bytes, 0.0, rates)
  token = _phase(flops.forward_flops(model, decode_rows, ctx) / chips, sampler_weights_bytes + kv_bytes,
                 decode_collective_bytes, rates)
  steps = math.ceil(rows * completion / decode_rows) if decode_rows < rows else math.ceil(completion)
  seq = prompt_len + (completion if packed else max_new)
  tokens = rows * seq
  trained = prompts * prompt_len + rows * (seq - prompt_len) if shared_prefix else tokens
  model_update = (epochs * flops.train_flops(model, trained, seq / 2)
                  + extra_forwards * flops.forward_flops(model, trained if packed else tokens, seq / 2))
  recompute = epochs * flops.forward_flops(model, trained, seq / 2) if remat else 0.0
  update = _phase((model_update + recompute) / chips, 2 * state_bytes * updates,
                  update_collective_bytes * updates, rates)
  sample_s = prefill["s"] + steps * token["s"]
  step_s = sample_s + update["s"]
  work = flops.rollout_step_flops(model, sample_prompts=prompts, update_prompts=prompts, group=group,
                                  prompt_len=prompt_len, decode_steps=steps, completion_len=int(seq - prompt_len),
                                  epochs=epochs, extra_forwards=extra_forwards, decode_rows=decode_rows)
  return {
      "rates": dataclasses.asdict(rates),
      "completion_tokens": completion, "decode_steps": steps, "decode_rows": decode_rows,
      "update_positions": trained,
      "prefill": prefill, "decode_token": token, "decode_s": steps * token["s"], "sample_s": sample_s,
      "update": update, "step_s": step_s,
      "tokens_per_s_per_chip": rows * completion / step_s / chips,
      "mfu": (work["sample"] + work["update"]) / (step_s * chips * rates.flops),
  }


def publish(bytes_per_generator_chip: float, generator_chips: int, learner_chips: int, every: int,
            link: float | None) -> dict:
  """An async weight publish (the learner's copy to every generator chip's decode layout) over the
  interconnect: each generator chip receives its whole copy and the learner chips send
  generator_chips copies between them, so it takes the larger of the two over one chip's link (a
  lower bound, as the rest of the roofline). link: one chip's interconnect bytes/s (ChipRates.link);
  s = 0 where the chips share memory (None); the learner waits for it every `every` updates
  (rollout.sync_every)."""
  sent = bytes_per_generator_chip * generator_chips / learner_chips
  s = max(bytes_per_generator_chip, sent) / link if link else 0.0
  return {"bytes_per_generator_chip": bytes_per_generator_chip, "bytes_per_learner_chip": sent, "s": s,
          "every": every}


def render(t: dict) -> list[str]:
  """Lines for `rljax plan`'s text report."""
  def ph(p):
    return (f"{p['s'] * 1e3:,.2f} ms ({p['bound']}-bound" +
            (f", collectives {p['collective_s'] * 1e3:,.2f} ms" if p["collective_s"] else "") + ")")
  r = t["rates"]
  return [
      f"time per step (roofline, a lower bound; docs/plan.md): {r['source']}: {r['flops'] / 1e12:,.3g} TFLOP/s, "
      f"{r['hbm'] / 1e9:,.0f} GB/s per chip; completions {t['completion_tokens']:g} tokens on average",
      f"  prefill {ph(t['prefill'])}; decode token {ph(t['decode_token'])} x {t['decode_steps']} steps "
      f"({t['decode_rows']} decode rows) = {t['decode_s']:,.2f} s",
      f"  update {ph(t['update'])} over {t['update_positions']:,} positions",
      f"  step {t['step_s']:,.2f} s: {t['tokens_per_s_per_chip']:,.0f} generated tokens/s per chip, "
      f"MFU {100 * t['mfu']:.1f}%",
  ] + ([f"  split meshes: sampling on {t['split']['generator_chips']} chips, the update on "
        f"{t['split']['learner_chips']}, overlapped: a step takes the longer of the two"] if t.get("split") else []) + (
      [_publish_line(t["publish"])] if t.get("publish") else []) + [
      f"  left out: {what}" for what in t.get("left_out", [])]


def _publish_line(p: dict) -> str:
  what = f"  weight publish: {p['bytes_per_generator_chip'] / 2**30:,.2f} GiB to each generator chip"
  if not p["s"]:
    return what + " (chips sharing one host's memory: not timed)"
  return what + f", {p['s'] * 1e3:,.2f} ms over the interconnect, every {p['every']} update(s), on the learner's side"
