"""RoPE scaling (rljax/models/rope.py) against transformers: YaRN (Qwen2.5 / Qwen3 long context),
linear (Llama, Gemma 3 4B+'s global layers), on tiny random models in float32, within 1e-4.

The tiny configs put the YaRN ramp inside the frequencies (head_dim 16 or 32, original context
64: some frequencies kept, some interpolated, some in between), and the batches run at positions
past the original context as well as from 0. Also: the transformers 4.x spelling, the export
round trip, the scaled context the config checks use, and unknown rope types refused by name.
"""
import json

import numpy as np
import pytest
from models_testlib import hf_model_from_config, max_diff_on_tokens, positions, ragged_batch

import rljax
from rljax import config as config_lib
from rljax.errors import ConfigError, WeightsError
from rljax.models import rope
from rljax.models.config import ModelConfig

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

TOL = 1e-4
OFFSET = 200   # a second run at positions past original_max_position_embeddings (64)
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
CASES = {
    "qwen2_yarn": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=True,
                                                   rope_parameters={**YARN, "rope_theta": 10000.0}),
    "qwen3_yarn": lambda: transformers.Qwen3Config(**COMMON, head_dim=32, rope_parameters={
        **YARN, "factor": 8.0, "rope_theta": 1e6}),
    # Every YaRN field given: attention factor, ramp ends, no truncation.
    "llama_yarn_fields": lambda: transformers.LlamaConfig(**COMMON, rope_parameters={
        **YARN, "rope_theta": 10000.0, "attention_factor": 1.3, "beta_fast": 16.0, "beta_slow": 2.0,
        "truncate": False}),
    "llama_linear": lambda: transformers.LlamaConfig(**COMMON, rope_parameters={
        "rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
}


def _gemma3_linear():
  """A tiny Gemma 3 whose global layers scale RoPE linearly (as gemma-3-4b+ does), local base 100."""
  return transformers.Gemma3TextConfig(
      vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
      num_key_value_heads=2, head_dim=16, max_position_embeddings=512, query_pre_attn_scalar=24, sliding_window=4,
      bos_token_id=2, eos_token_id=1, pad_token_id=0,
      layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
      rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0},
                       "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})


CASES["gemma3_linear"] = _gemma3_linear


def _hf_logits(model, ids, mask, offset):
  with torch.no_grad():
    out = model(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask.astype(np.int64)),
                position_ids=torch.as_tensor(positions(mask) + offset))
  return out.logits.float().numpy()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """case -> (transformers model, its save_pretrained directory)."""
  out = {}
  for case, make in CASES.items():
    model = hf_model_from_config(make(), seed=3)
    d = tmp_path_factory.mktemp(case)
    model.save_pretrained(d)
    out[case] = (model, d)
  return out


@pytest.mark.parametrize("case", list(CASES))
def test_scaled_rope_matches_transformers(case, saved):
  model, d = saved[case]
  policy = rljax.load_pretrained(d)
  kind = case.split("_")[1]
  assert policy.config.rope_scaling is not None and policy.config.rope_scaling.rope_type == kind
  ids, mask = ragged_batch()
  for offset in (0, OFFSET):
    got = policy(ids, mask, positions=positions(mask) + offset)
    assert max_diff_on_tokens(got, _hf_logits(model, ids, mask, offset), mask) <= TOL, offset


def test_yarn_attention_factor_and_frequencies_equal_transformers():
  """The two numbers YaRN changes, straight from transformers' rope init functions."""
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  for case in ("qwen2_yarn", "qwen3_yarn", "llama_yarn_fields"):
    hf = CASES[case]()
    want_inv, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    c = ModelConfig.from_hf(hf.to_dict())
    assert c.rope_scaling.attention_factor == pytest.approx(want_factor, rel=1e-6), case
    got = rope.inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
    np.testing.assert_allclose(np.asarray(got), want_inv.numpy(), rtol=1e-6, err_msg=case)
  assert ModelConfig.from_hf(CASES["llama_yarn_fields"]().to_dict()).rope_scaling.attention_factor == 1.3


def test_export_round_trip_and_transformers_4x_spelling(saved, tmp_path):
  model, d = saved["qwen2_yarn"]
  policy = rljax.load_pretrained(d)
  out = rljax.save_pretrained(policy, tmp_path / "export")
  written = json.loads(open(f"{out}/config.json").read())
  assert written["rope_parameters"]["rope_type"] == written["rope_scaling"]["rope_type"] == "yarn"
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
  ids, mask = ragged_batch()
  want = _hf_logits(model, ids, mask, OFFSET)
  assert max_diff_on_tokens(_hf_logits(reloaded, ids, mask, OFFSET), want, mask) <= TOL
  assert rljax.load_pretrained(out).config == policy.config
  # transformers 4.x: rope_theta beside a rope_scaling dict with "type" (Qwen's long-context instructions).
  cfg5 = json.loads(open(f"{d}/config.json").read())
  cfg4 = {k: v for k, v in cfg5.items() if k not in ("rope_parameters", "dtype")}
  cfg4.update(rope_theta=10000.0, torch_dtype="float32",
              rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
  assert ModelConfig.from_hf(cfg4) == ModelConfig.from_hf(cfg5) == policy.config


def test_context_length_is_the_scaled_one(tmp_path):
  """Qwen3-8B's config.json with Qwen's YaRN instructions: 40960 positions, YaRN x4 over 32768 =
  131072 tokens, which the trainer's and the CLI's context checks use."""
  hf = dict(COMMON, model_type="qwen3", head_dim=32, max_position_embeddings=40960, rope_theta=1e6,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
  c = ModelConfig.from_hf(hf)
  assert (c.max_position_embeddings, c.context_length) == (40960, 131072)
  assert rope.hf_context_length(hf) == 131072
  assert ModelConfig.from_hf(dict(hf, rope_scaling=None)).context_length == 40960
  (tmp_path / "config.json").write_text(json.dumps(hf))
  cfg = config_lib.base_config()
  cfg.model.path = str(tmp_path)
  assert config_lib.model_context_length(cfg.model) == 131072
  cfg.data.max_prompt_tokens, cfg.sampling.max_new_tokens = 1024, 64000   # past 40960, within 131072
  config_lib.check_model_fits_early(cfg)
  cfg.sampling.max_new_tokens = 131000
  with pytest.raises(ConfigError, match=r"exceeds the context .*\(131072 tokens\)"):
    config_lib.check_model_fits_early(cfg)


@pytest.mark.parametrize("rope_parameters,needle", [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_type='dynamic'"),
    ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}, "rope_type='longrope'"),
    ({"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"rope_type": "llama3", "factor": 8.0}, "lacks the field 'low_freq_factor'"),
])
def test_unsupported_rope_is_refused_by_name(rope_parameters, needle):
  hf = dict(COMMON, model_type="llama", rope_parameters={"rope_theta": 1e4, **rope_parameters})
  with pytest.raises(WeightsError, match=needle.replace("(", r"\(").replace("[", r"\[")) as info:
    ModelConfig.from_hf(hf, source="x/config.json")
  assert str(info.value).startswith("x/config.json: ")
