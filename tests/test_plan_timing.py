"""`rljax plan`'s step-time estimate (rljax/plan/timing.py): the roofline in closed form, and the
figures the plan prints recomputed from the plan's own per-chip bytes."""
from __future__ import annotations

import json

import pytest
from test_plan import ROWS, SEQ, TINY, run_main

from rljax import flops
from rljax.errors import ConfigError
from rljax.models.config import ModelConfig
from rljax.plan import timing

MC = ModelConfig(vocab_size=320, hidden_size=48, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=12, tie_word_embeddings=True)


def test_roofline_phases_in_closed_form():
  rates = timing.ChipRates("test", flops=1e9, hbm=1e8, link=1e7, source="test")
  kw = dict(model=MC, rates=rates, chips=2, prompts=4, group=3, prompt_len=10, max_new=20, completion=8.0,
            epochs=1, extra_forwards=1, sampler_weights_bytes=1e6, kv_bytes=5e5, state_bytes=2e6, remat=True,
            decode_collective_bytes=1e4, update_collective_bytes=3e5, updates=2)
  t = timing.estimate(decode_rows=12, packed=False, **kw)
  # decode token: forward over the 12 rows at context 10 + 8/2, split over 2 chips, against
  # (weights + KV) / bandwidth, plus its collectives over the link
  tok = t["decode_token"]
  assert tok["compute_s"] == pytest.approx(flops.forward_flops(MC, 12, 14.0) / 2 / 1e9)
  assert tok["memory_s"] == pytest.approx(1.5e6 / 1e8)
  assert tok["s"] == pytest.approx(max(tok["compute_s"], tok["memory_s"]) + 1e4 / 1e7)
  assert t["decode_steps"] == 8 and t["decode_s"] == pytest.approx(8 * tok["s"])
  # update, unpacked: every row to max_new; 3 forwards (train) + 1 (remat) + 1 (extra) over 12 x 30
  up = t["update"]
  assert t["update_positions"] == 12 * 30
  assert up["compute_s"] == pytest.approx(5 * flops.forward_flops(MC, 360, 15.0) / 2 / 1e9)
  assert up["memory_s"] == pytest.approx(2 * 2e6 * 2 / 1e8)
  assert up["collective_s"] == pytest.approx(2 * 3e5 / 1e7)
  assert t["step_s"] == pytest.approx(t["prefill"]["s"] + t["decode_s"] + up["s"])
  assert t["tokens_per_s_per_chip"] == pytest.approx(12 * 8 / t["step_s"] / 2)
  # packed: the update computes prompt + average completion; 4 decode slots: 12 rows x 8 tokens / 4 steps
  p = timing.estimate(decode_rows=4, packed=True, **kw)
  assert p["update_positions"] == 12 * 18 and p["decode_steps"] == 24
  assert p["decode_token"]["compute_s"] == pytest.approx(flops.forward_flops(MC, 4, 14.0) / 2 / 1e9)


def test_spec_rates_and_unknown_chips():
  assert timing.spec_rates("v5p", "bfloat16").flops == 459e12
  assert timing.spec_rates("NVIDIA H100 80GB HBM3", "float32").flops == 989e12 / 2   # TF32 rate
  assert timing.spec_rates("TPU v5 lite", "bfloat16").name == "v5e"
  with pytest.raises(ConfigError, match="no rates known for chip 'b200'.*v5p"):
    timing.spec_rates("b200", "bfloat16")


def test_plan_prints_the_estimate_from_its_own_per_chip_figures():
  status, out = run_main(TINY + ["--topology", "cpu:8", "--chip", "v5p", "--json"])
  plan = json.loads(out)
  t, dec, sampler, learner = plan["time"], plan["decode"], plan["programs"]["sampler"], plan["programs"]["learner"]
  assert status == 0 and t["rates"]["name"] == "v5p"
  assert t["decode_token"]["memory_s"] == pytest.approx(
      (dec["weights_bytes_per_chip"] + sampler["kv_cache_bytes"]) / 2.765e12)
  assert t["decode_token"]["collective_s"] == pytest.approx(
      sampler["collectives"]["per_decode_token_bytes"] / 600e9)
  assert t["update"]["collective_s"] == pytest.approx(learner["collectives"]["per_update_bytes"] / 600e9)
  assert t["update"]["memory_s"] == pytest.approx(2 * learner["state_bytes"] / 2.765e12)
  assert t["completion_tokens"] == 3.5 and t["decode_steps"] == 4 and t["update_positions"] == ROWS * SEQ
  assert 0 < t["mfu"] <= 1 and t["step_s"] > 0
  status, text = run_main(TINY + ["--topology", "cpu:8", "--chip", "v5p", "--completion-tokens", "7",
                                  "--program", "sampler"])
  assert "time per step (roofline, a lower bound" in text and "x 7 steps" in text
  assert "left out: collectives per update (the learner was not compiled" in text and plan["time"]["left_out"] == []


def test_completion_tokens_outside_the_budget_is_refused():
  with pytest.raises(ConfigError, match=r"--completion-tokens=9.0.*\(0, 7\]"):
    run_main(TINY + ["--topology", "cpu:2", "--chip", "v5p", "--completion-tokens", "9", "--program", "sampler"])


def test_weight_publish_in_closed_form():
  """An async publish: each generator chip receives its copy, the learner chips send one copy per
  generator chip between them; the larger over one chip's link. No link (one host's memory): 0."""
  link = 1e7
  assert timing.publish(2e6, 4, 4, 1, link)["s"] == pytest.approx(2e6 / 1e7)       # receive = send
  assert timing.publish(2e6, 2, 6, 1, link)["s"] == pytest.approx(2e6 / 1e7)       # receiving bounds it
  p = timing.publish(2e6, 6, 2, 3, link)                                          # 2 senders, 6 copies
  assert p["bytes_per_learner_chip"] == pytest.approx(6e6) and p["s"] == pytest.approx(6e6 / 1e7)
  assert p["every"] == 3
  assert timing.publish(2e6, 4, 4, 1, None)["s"] == 0.0                           # one host's memory
