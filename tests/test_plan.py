"""`rljax plan`: exact per-chip figures, the HLO accounting, verdicts and errors (rljax/plan).

CPU tests run on the conftest's 8 simulated devices; one test compiles for a deviceless v5p-8
through libtpu and is skipped where libtpu is not importable.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import os

import jax
import pytest

from rljax.errors import ConfigError
from rljax.plan import hlo, main, parse_topology
from rljax.plan.programs import kv_cache_bytes, parse_oom
from rljax.plan.report import render_text
from rljax.plan.topology import GIB, libtpu_available

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "rljax", "configs")

# Dimensions chosen to be told apart in HLO shapes: 8 prompts x 5 samples = 40 rows, 5 per device
# on 8 devices; 16 prompt + 7 completion = 23 tokens per row; none of the model's sizes is 5 or 40.
TINY = ["--config", os.path.join(CONFIGS, "smoke.py"), "--config.model.random.vocab_size=320",
        "--config.model.random.hidden_size=48", "--config.model.random.intermediate_size=96",
        "--config.model.random.num_heads=4", "--config.model.random.num_kv_heads=2",
        "--config.model.random.head_dim=12", "--config.train.prompts_per_step=8", "--config.sampling.num_samples=5",
        "--config.data.max_prompt_tokens=16", "--config.sampling.max_new_tokens=7", "--config.mesh.shape=(1,-1,1)"]
ROWS, SEQ = 40, 23


def run_main(argv):
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    status = main(argv)
  return status, out.getvalue()


def expected_param_bytes(mc, fsdp: int, part: str | None = None) -> int:
  """Per-device parameter bytes worked out by hand, in each leaf's dtype (mc.param_dtype; LoRA
  adapters float32): a dimension named `embed` is split over the fsdp axis when it divides it;
  nothing else is split (data and tensor are 1). part: "base" or "adapters" of a LoRA tree."""
  from rljax.models import lora
  from rljax.models.policy import init_params, param_logical_axes
  shapes = jax.eval_shape(lambda: init_params(mc, jax.random.key(0)))
  axes = param_logical_axes(mc)
  if part is not None:
    pick = {"base": 0, "adapters": 1}[part]
    shapes, axes = lora.split(shapes)[pick], lora.split(axes)[pick]
  total = 0
  for names, x in zip(jax.tree.leaves(axes, is_leaf=lambda t: isinstance(t, tuple)), jax.tree.leaves(shapes)):
    split = fsdp if "embed" in names and x.shape[names.index("embed")] % fsdp == 0 else 1
    total += math.prod(x.shape) * x.dtype.itemsize // split
  return total


def test_learner_plan_on_8_devices_exact_bytes_sharded_rows_and_no_fit_verdict():
  # A 1 MiB "chip": the learner cannot fit, so the verdict and the suggestions are exercised too.
  status, out = run_main(TINY + ["--topology", "cpu:8", "--program", "learner", "--json", "--hbm-gib", "0.001"])
  plan = json.loads(out)
  learner = plan["programs"]["learner"]
  assert plan["topology"]["chips"] == 8 and plan["topology"]["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}
  assert plan["run"]["rows"] == ROWS and plan["run"]["rows_per_chip"] == ROWS // 8

  from rljax.models.config import ModelConfig
  mc = ModelConfig(vocab_size=320, hidden_size=48, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=12, tie_word_embeddings=True)
  params = expected_param_bytes(mc, fsdp=8)
  assert learner["params_bytes"] == params
  # AdamW keeps two fp32 moments per parameter, split like the parameters; the rest is a few counters.
  assert 2 * params <= learner["opt_state_bytes"] <= 2 * params + 64
  # On CPU the peak is the sum of the memory analysis (the CPU compiler's own peak leaves temporaries out).
  assert learner["peak_source"] == "sum" and learner["peak_bytes"] == learner["sum_bytes"] == (
      learner["argument_bytes"] + learner["output_bytes"] - learner["alias_bytes"] + learner["temp_bytes"])
  # The donated state is aliased: arguments hold at least the state, and it is not counted twice.
  assert learner["argument_bytes"] >= params + learner["opt_state_bytes"]
  assert learner["alias_bytes"] >= params

  # Each device's activations hold 1/8 of the rows: the largest per-device tensor that spans the
  # sequence carries 5 rows, and none carries all 40.
  seq_tensors = [t for t in learner["largest_tensors"] if f",{SEQ}" in t["shape"] or f"[{SEQ}," in t["shape"]]
  assert seq_tensors, learner["largest_tensors"]
  dims = [int(d) for d in seq_tensors[0]["shape"].split("[")[1].rstrip("]").split(",")]
  assert ROWS // 8 in dims and ROWS not in dims, seq_tensors[0]
  assert learner["collectives"]["per_update_bytes"] > 0

  assert status == 3 and plan["fits"] is False and learner["fits"] is False
  assert any("remat=True" in s for s in learner["suggestions"])
  assert any("--topology cpu:16" in s for s in learner["suggestions"])
  text = render_text(plan)
  assert "learner does not fit; what to change:" in text and "verdict: does NOT fit" in text


def test_lora_plan_reports_frozen_base_adapters_and_no_reference_copy(tmp_path):
  # Rank 3 (none of TINY's sizes): the adapters' [rows, seq, rank] activations show in the HLO.
  # bf16 compute stores the frozen base in bf16; rl.kl_coef > 0 needs a reference, which under
  # LoRA is the base itself.
  lora_args = ["--config.model.dtype=bfloat16", "--config.rl.kl_coef=0.05", "--topology", "cpu:8", "--json"]
  status, out = run_main(TINY + lora_args + ["--config.model.lora.rank=3", "--dump-hlo", str(tmp_path)])
  plan = json.loads(out)
  assert status == 0
  sampler, learner = plan["programs"]["sampler"], plan["programs"]["learner"]

  from rljax.models.config import LoraConfig, ModelConfig
  base = ModelConfig(vocab_size=320, hidden_size=48, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=12, tie_word_embeddings=True, param_dtype="bfloat16")
  mc = base.replace(lora=LoraConfig(rank=3))
  frozen = expected_param_bytes(mc, fsdp=8, part="base")
  adapters = expected_param_bytes(mc, fsdp=8, part="adapters")
  assert frozen == expected_param_bytes(base, fsdp=8)   # the base alone, 2 bytes a parameter
  assert plan["model"]["param_dtype"] == "bfloat16" and plan["model"]["lora"]["rank"] == 3
  # Per layer r * (in + out) of q 48->48, k 48->24, v 48->24, o 48->48, gate/up 48->96, down 96->48.
  assert plan["model"]["trainable_params"] == 2 * 3 * (96 + 72 + 72 + 96 + 3 * 144)
  assert plan["model"]["params"] == base.num_params
  for p in (sampler, learner):
    assert p["frozen_params_bytes"] == frozen and p["params_bytes"] == adapters
  # AdamW's two moments are the adapters' (fp32), not the base's; the rest is a few counters.
  assert 2 * adapters <= learner["opt_state_bytes"] <= 2 * adapters + 64
  # No reference copy: the KL reference is the base with the adapters off.
  assert plan["run"]["reference_model"] is True and plan["run"]["reference_copy"] is False
  assert learner["ref_params_bytes"] == 0
  assert learner["state_bytes"] == frozen + adapters + learner["opt_state_bytes"]
  # The donated state (base included) is the learner's argument; the sampler is given base + adapters.
  assert learner["argument_bytes"] >= learner["state_bytes"] and learner["alias_bytes"] >= frozen + adapters
  assert sampler["argument_bytes"] >= frozen + adapters
  # Both programs traced the adapted model: x A per chip is [5 rows, 23 tokens, rank 3] in the
  # learner and [5 rows, rank 3] per decoded token in the sampler.
  for program, shape in (("learner", f"[5,{SEQ},3]"), ("sampler", "[5,3]")):
    assert shape in (tmp_path / f"{program}.L2.hlo.txt").read_text(), program
  assert "frozen base params" in render_text(plan)

  # The same model, fully fine-tuned: fp32 parameters, their moments and a reference copy.
  status, out = run_main(TINY + lora_args + ["--program", "learner"])
  full = json.loads(out)
  full_learner = full["programs"]["learner"]
  assert full["model"]["lora"] is None and full["run"]["reference_copy"] is True
  assert full_learner["frozen_params_bytes"] == 0
  assert full_learner["params_bytes"] == full_learner["ref_params_bytes"] == expected_param_bytes(
      base.replace(param_dtype="float32"), fsdp=8)
  assert learner["state_bytes"] < full_learner["state_bytes"]


def test_bad_topology_names_the_flag():
  for name in ("v5p-7", "h100:8", "v9-8", "cpu:0", ""):
    with pytest.raises(ConfigError, match="--topology"):
      parse_topology(name)
  with pytest.raises(ConfigError, match="--topology"):
    run_main(TINY + ["--topology", "tpu-v5p-8"])


def test_topology_names_follow_cloud_accelerator_types():
  # v4 and v5p count TensorCores (2 per chip); v5e and v6e count chips.
  assert (parse_topology("v5p-8").chips, parse_topology("v5p-8").shape) == (4, "2x2x1")
  assert (parse_topology("v5p-16").chips, parse_topology("v5p-32").chips) == (8, 16)
  assert parse_topology("v5p:2x2x2").chips == 8
  assert (parse_topology("v5e-8").chips, parse_topology("v5e-8").shape) == (8, "2x4")
  assert parse_topology("v4-8").chips == 4
  assert parse_topology("v5p-8").hbm_bytes == int(95.74 * GIB)
  assert parse_topology("cpu:8").hbm_bytes is None


def test_oom_messages_give_the_needed_bytes():
  assert parse_oom("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
                   "(240.00G) exceeds available HBM (95.74G).") == (240 * GIB, int(95.74 * GIB))
  assert parse_oom("Used 120.50G of 95.74G hbm. Exceeded hbm capacity by 24.76G.") == (
      int(120.5 * GIB), int(95.74 * GIB))
  assert parse_oom("something else") == (None, None)


def test_kv_cache_bytes_follow_the_sampler_layout():
  from rljax import sharding as shd
  from rljax.models.config import ModelConfig
  mc = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                   head_dim=8, dtype="bfloat16")
  mesh = shd.make_mesh((1, 4, 2), devices=jax.devices()[:8])
  # Rows over fsdp (4), KV heads over tensor (2): P * Lp and N * T slots, keys and values, bf16.
  assert kv_cache_bytes(mc, mesh, 4, 32, 16, 64) == 2 * 3 * (2 // 2) * 8 * (4 * 16 + 32 * 64) // 4 * 2
  # 2 prompts do not split over 4 devices: the prompt cache is replicated on the rows axis.
  assert kv_cache_bytes(mc, mesh, 2, 8, 16, 64) == 2 * 3 * 1 * 8 * (2 * 16 + 8 * 64 // 4) * 2


HLO = """HloModule m

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]{0}) parameter(0)
  %bound = s32[]{:T(128)} constant(6)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[] compare(%i, %bound), direction=LT
}

%body (p.1: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p.1 = (s32[], f32[8]{0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %two = s32[] constant(2)
  %next = s32[] add(%i.1, %two)
  %x.1 = f32[8]{0} get-tuple-element(%p.1), index=1
  %ag = f32[64]{0:T(256)} all-gather(%x.1), dimensions={0}
  %sl = f32[8]{0} slice(%ag), slice={[0:8]}
  ROOT %t = (s32[], f32[8]{0}) tuple(%next, %sl)
}

%dcond (q: (s32[], bf16[4,16])) -> pred[] {
  %q = (s32[], bf16[4,16]{1,0}) parameter(0)
  %y.0 = bf16[4,16]{1,0} get-tuple-element(%q), index=1
  %any = f32[] reduce(%y.0), dimensions={0,1}, to_apply=%add
  %ar = f32[] all-reduce(%any), to_apply=%add
  %zero = f32[] constant(0)
  ROOT %gt = pred[] compare(%ar, %zero), direction=GT
}

%dbody (q.1: (s32[], bf16[4,16])) -> (s32[], bf16[4,16]) {
  %q.1 = (s32[], bf16[4,16]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%q.1), index=0
  %y = bf16[4,16]{1,0} get-tuple-element(%q.1), index=1
  %cps = (bf16[4,16]{1,0}, bf16[4,16]{1,0}) collective-permute-start(%y), source_target_pairs={{0,1},{1,0}}
  %cpd = bf16[4,16]{1,0} collective-permute-done(%cps)
  %w3 = (s32[], f32[8]{0}) while(%init.2), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"2"}}
  ROOT %t.1 = (s32[], bf16[4,16]{1,0}) tuple(%j, %cpd)
}

ENTRY %main (a: f32[8], b: bf16[4,16]) -> (f32[8], bf16[4,16]) {
  %a = f32[8]{0} parameter(0)
  %b = bf16[4,16]{1,0} parameter(1)
  %z = s32[] constant(0)
  %init = (s32[], f32[8]{0}) tuple(%z, %a)
  %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body
  %big = f32[1024,2]{1,0} broadcast(%z), dimensions={}
  %ar2 = f32[8]{0} all-reduce(%a), to_apply=%add
  %dinit = (s32[], bf16[4,16]{1,0}) tuple(%z, %b)
  %dw = (s32[], bf16[4,16]{1,0}) while(%dinit), condition=%dcond, body=%dbody
  ROOT %out = (f32[8]{0}, bf16[4,16]{1,0}) tuple(%ar2, %b)
}
"""


def test_hlo_collectives_count_loop_trips_and_decode_iterations():
  mod = hlo.Module(HLO)
  # The condition `i < 6` with i stepping by 2 runs the body 3 times; known_trip_count is read too.
  loops = {i.name: mod.loop(i).trips for c in mod.comps.values() for i in c.instructions if i.opcode == "while"}
  assert loops == {"w": 3, "w3": 2, "dw": None}
  s = hlo.summarize(HLO, updates=3)
  assert s["decode_loops"] == 1
  # One decode iteration: the condition's f32 all-reduce (4 B), the permute (4*16 bf16 = 128 B)
  # and a nested 2-trip loop of 64-float all-gathers (2 * 256 B).
  assert s["per_decode_token"] == {"all-gather": 512, "all-reduce": 4, "collective-permute": 128}
  # Outside the decode loop: the 3-trip loop and one 8-float all-reduce; per update = / 3.
  assert s["outside_decode"] == {"all-gather": 768, "all-reduce": 32}
  assert s["per_update"] == {"all-gather": 256, "all-reduce": 10}
  assert s["largest_tensors"][0]["shape"] == "f32[1024,2]"


@pytest.mark.skipif(not libtpu_available(), reason="libtpu is not importable (pip install 'rljax[tpu]')")
def test_sampler_plan_for_a_deviceless_v5p_8():
  status, out = run_main(TINY + ["--topology", "v5p-8", "--program", "sampler", "--json",
                                 "--config.model.dtype=bfloat16"])
  plan = json.loads(out)
  sampler = plan["programs"]["sampler"]
  assert status == 0 and plan["fits"] is True and plan["topology"]["chips"] == 4
  assert sampler["hbm_bytes"] == int(95.74 * GIB) and 0 < sampler["peak_bytes"] < sampler["hbm_bytes"]
  # The TPU compiler's live-range peak: at least the parameters it reads, at most every buffer at once.
  assert sampler["peak_source"] == "compiler"
  assert sampler["argument_bytes"] <= sampler["peak_bytes"] <= sampler["sum_bytes"]
  # bf16 caches, 2 layers x 2 KV heads x 12 dims, 8 prompts x 16 slots + 40 rows x 7 slots, over 4 chips.
  assert sampler["kv_cache_bytes"] == 2 * 2 * 2 * 12 * (8 * 16 + 40 * 7) // 4 * 2
  assert sampler["collectives"]["decode_loops"] >= 1
  assert sampler["collectives"]["per_decode_token_bytes"] > 0


@pytest.mark.skipif(not libtpu_available(), reason="libtpu is not importable (pip install 'rljax[tpu]')")
def test_tpu_compiler_refusal_is_reported_as_not_fitting():
  # 64 rows per v5e chip of 4096 tokens with full [T, T] scores: about 83 GiB against 15.75.
  status, out = run_main(TINY + ["--topology", "v5e-8", "--program", "learner", "--json",
                                 "--config.model.attention=xla", "--config.train.prompts_per_step=64",
                                 "--config.sampling.num_samples=8", "--config.data.max_prompt_tokens=96",
                                 "--config.sampling.max_new_tokens=4000"])
  learner = json.loads(out)["programs"]["learner"]
  assert status == 3 and learner["fits"] is False and learner["compiler_refused"] is True
  assert learner["peak_bytes"] > learner["hbm_bytes"] == int(15.75 * GIB)
  assert "Ran out of memory" in learner["error"]
  assert any("attention='chunked'" in s for s in learner["suggestions"])
  assert any("--topology v5e-16" in s for s in learner["suggestions"])


@pytest.mark.skipif(not libtpu_available(), reason="libtpu is not importable (pip install 'rljax[tpu]')")
def test_auto_attention_resolves_for_the_compiled_topology_not_the_host():
  # A plan compiled from this CPU process for a TPU topology must trace what the TPU would run.
  from rljax import sharding as shd
  from rljax.models import attention as attn
  from rljax.plan.topology import tpu_devices
  mesh = shd.make_mesh((1, -1, 1), tpu_devices(parse_topology("v5p-8")))
  assert attn.target_platform() == "cpu" and attn.resolve("auto", 512) == "xla"
  with shd.activate(mesh):
    assert attn.target_platform() == "tpu" and attn.resolve("auto", 512) == "splash"


def test_async_plan_compiles_each_program_on_its_own_sub_mesh():
  """rollout.mode='async' splits the chips (issue 34): the learner is compiled on the learner's
  mesh (6 chips here, fsdp 6) and the sampler on the generators' (2 chips, data 2), each with its
  own per-chip bytes; the time estimate overlaps sampling and the update on their own chips."""
  status, out = run_main(TINY + ["--config.rollout.mode=async", "--config.rollout.generator_devices=2",
                                 "--config.train.prompts_per_step=6", "--topology", "cpu:8", "--json"])
  plan = json.loads(out)
  assert status == 0, out
  assert plan["topology"]["mesh"] == {"data": 1, "fsdp": 6, "tensor": 1}
  assert plan["topology"]["generator_mesh"] == {"data": 2, "fsdp": 1, "tensor": 1}
  from rljax.models.config import ModelConfig
  mc = ModelConfig(vocab_size=320, hidden_size=48, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=12, tie_word_embeddings=True)
  learner, sampler = plan["programs"]["learner"], plan["programs"]["sampler"]
  assert learner["params_bytes"] == expected_param_bytes(mc, fsdp=6)     # 48 = 6 x 8: embed split 6 ways
  # The generators hold only the decode copy (compute dtype float32 here, replicated on their mesh).
  assert sampler["params_bytes"] == expected_param_bytes(mc, fsdp=1)
  assert plan["decode"]["rows_per_chip"] == 15          # 6 prompts x 5 samples over the generators' 2 chips
  t = plan["time"]
  assert t["split"] == {"generator_chips": 2, "learner_chips": 6, "overlapped": True}
  assert t["step_s"] == pytest.approx(max(t["sample_s"], t["update"]["s"]))   # simulated chips: the publish is 0
  assert t["publish"]["bytes_per_generator_chip"] == sampler["params_bytes"] and t["publish"]["s"] == 0.0
  assert any("generators' mesh" in n for n in plan["notes"])
  assert "split meshes: sampling on 2 chips, the update on 6" in render_text(plan)
  assert "weight publish:" in render_text(plan)
  with pytest.raises(ConfigError, match="--program fused"):
    run_main(TINY + ["--config.rollout.mode=async", "--topology", "cpu:8", "--program", "fused"])
