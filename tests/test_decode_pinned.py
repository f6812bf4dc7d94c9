"""Sampled tokens pinned for fixed seeds: the decode core must not change what it draws.

Recorded with the code before the rollout package was restructured (issue 30), on tiny models
whose weights come from seeded transformers models (so a change of rljax's own initialiser does
not move them): a Qwen3-style model and a Gemma 3 one (sliding windows across the shared prompt
cache and a two-stage completion cache), and a multi-turn trajectory with a scripted tool call.
Any change to the draw, the cache or the order of keys shows up here as different tokens.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models_testlib import hf_config, hf_model, left_padded_prompts

from rljax.models.config import ModelConfig
from rljax.models.convert import hf_to_params
from rljax.rollout import SamplingParams, sample


def _gemma3():
  import torch
  import transformers
  cfg = transformers.Gemma3TextConfig(
      vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
      num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, query_pre_attn_scalar=24,
      sliding_window=8, bos_token_id=2, eos_token_id=None, pad_token_id=0, tie_word_embeddings=True,
      layer_types=["sliding_attention", "full_attention", "sliding_attention"],
      rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                       "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})
  torch.manual_seed(0)
  model = transformers.Gemma3ForCausalLM(cfg).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_((0.3 if "norm" in name else 0.15) * torch.randn_like(p))
  return model


def _convert(model):
  config = ModelConfig.from_hf(model.config.to_dict())
  sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
  return config, hf_to_params(config, sd.__getitem__, set(sd))


PINNED = {
    "qwen3": dict(
        lengths=[1, 21, 64, 64, 11, 13],
        head=[[8, 0, 0, 0, 0, 0, 0, 0, 0, 0], [27, 97, 43, 32, 159, 103, 66, 168, 199, 176],
              [252, 239, 192, 66, 244, 16, 87, 46, 38, 210], [106, 119, 2, 77, 56, 27, 194, 219, 79, 204],
              [141, 136, 78, 25, 116, 230, 243, 219, 18, 217], [33, 232, 66, 24, 223, 68, 116, 244, 54, 133]],
        token_sum=22123, logprob_sum=-923.4527587890625, entropy_sum=940.6447143554688),
    "gemma3": dict(
        lengths=[17, 64, 28, 64, 30, 64],
        head=[[103, 103, 103, 103, 30, 54, 54, 54, 54, 54], [125, 125, 47, 101, 72, 72, 72, 72, 72, 72],
              [59, 59, 59, 59, 59, 59, 59, 59, 59, 115], [40, 90, 90, 90, 90, 90, 90, 59, 59, 75],
              [124, 98, 98, 98, 98, 119, 119, 119, 38, 61], [124, 111, 2, 2, 75, 22, 22, 22, 22, 22]],
        token_sum=13313, logprob_sum=-351.3111267089844, entropy_sum=484.0216064453125),
}


@pytest.mark.parametrize("family", sorted(PINNED))
def test_sampled_tokens_are_pinned(family):
  """Three ragged prompts, G = 2, 64 new tokens (two cache stages), top-p 0.9, six stop ids."""
  config, params = _convert(hf_model("qwen3") if family == "qwen3" else _gemma3())
  ids, mask = left_padded_prompts((9, 4, 6), config.vocab_size, low=3, seed=5)
  sp = SamplingParams(num_samples=2, max_new_tokens=64, temperature=0.8, top_p=0.9)
  out = jax.jit(sample, static_argnames=("config", "sp", "eos_ids"))(
      config, params, jnp.asarray(ids), jnp.asarray(mask), sp, jax.random.key(42), eos_ids=tuple(range(3, 9)))
  want = PINNED[family]
  tokens = np.asarray(out.tokens)
  assert np.asarray(out.lengths).tolist() == want["lengths"]
  assert tokens[:, :10].tolist() == want["head"]
  assert int(tokens.sum()) == want["token_sum"]
  assert float(np.asarray(out.logprobs).sum()) == pytest.approx(want["logprob_sum"], rel=1e-5)
  assert float(np.asarray(out.entropy).sum()) == pytest.approx(want["entropy_sum"], rel=1e-5)


def test_multi_turn_trajectory_is_pinned():
  """A tool call forced at row 0's first turn, the calculator's answer fed back, decoding resumed."""
  import torch
  import transformers
  from tools_testlib import scripted_tool_rollout

  from rljax.tokenizer import load_tokenizer
  from rljax.tools import ToolRunner
  tok = load_tokenizer("smollm2-135m-instruct")
  cfg = hf_config("qwen2")
  cfg.vocab_size = tok.vocab_size
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(torch.rand_like(p) + 0.5 if "norm" in name else 0.05 * torch.randn_like(p))
  config, params = _convert(model)
  rows = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False))
          for t in ("Compute 2+3.", "Say hi.")]
  width = max(map(len, rows))
  ids, mask = np.zeros((2, width), np.int32), np.zeros((2, width), bool)
  for i, r in enumerate(rows):
    ids[i, width - len(r):], mask[i, width - len(r):] = r, True
  call = tok.encode('Let me check. <tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>')
  sp = SamplingParams(num_samples=2, max_new_tokens=96, temperature=1.0,
                      stop_token_ids=tuple(tok.stop_ids) + tuple(range(30000, 32500)))
  with ToolRunner(["calculator"], timeout_s=3.0, num_workers=1) as runner:
    rollout = scripted_tool_rollout(config, tok, runner, sp, {(0, 0): call}, segment_tokens=8)
    _, info = rollout.run(params, ids, mask, jax.random.key(9))
  traj = info.trajectories
  assert traj.turns.tolist() == [1, 0, 0, 0] and traj.lengths.tolist() == [84, 7, 10, 11]
  assert traj.tokens[0, :len(call)].tolist() == call
  assert [traj.tokens[r, :12].tolist() for r in range(1, 4)] == [
      [46911, 8971, 6355, 44144, 43358, 23322, 31667, 0, 0, 0, 0, 0],
      [23816, 25521, 2835, 29946, 41191, 35413, 7899, 16702, 424, 31627, 0, 0],
      [3961, 10614, 29756, 7457, 8016, 33387, 28153, 36070, 17843, 44947, 32317, 0]]
  assert traj.tokens[0, len(call):len(call) + 40].tolist() == [
      2, 198, 1, 19324, 198, 37, 2, 198, 1, 520, 9531, 198, 26206, 40946, 455, 29741, 42718, 25497, 34790, 38593,
      22390, 18919, 15468, 25167, 36930, 58, 28244, 5434, 1564, 48532, 17439, 44305, 38274, 13928, 38812, 13399,
      4422, 7050, 10004, 25782]
  assert int(traj.tokens.sum()) == 1859147
  assert int(traj.model_mask.sum()) == 100 and int(traj.context_mask.sum()) == 112
  assert float(traj.logprobs.sum()) == pytest.approx(-1091.0634765625, rel=1e-5)
