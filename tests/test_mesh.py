"""Meshes that scale: every mesh trains like one device; meshes never leave devices idle; the
chunked log-prob loop holds no collective; the sampler's parameter layout.

The fused-step runs are subprocesses: each gets exactly the devices its mesh uses (a mesh that
leaves devices idle is an error), and a run that deadlocks fails its own test instead of
aborting pytest (XLA:CPU ends a process whose collective waited 40 s).
"""
import json
import math
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import sharding as shd
from rljax.compile_stats import loop_collectives
from rljax.errors import ConfigError

ROOT = os.path.join(os.path.dirname(__file__), "..")
STEPS = 2
LR, EPS = 0.1, 1e-3

_RUNNER = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    from rljax.config_overrides import apply_overrides, load_config_file
    from rljax.trainer.loop import Trainer
    out, steps, overrides = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    cfg = load_config_file("rljax/configs/smoke.py")
    apply_overrides(cfg, [f"output.dir={out!r}", *overrides])
    trainer = Trainer(cfg)
    def save(name):
      flat = jax.tree_util.tree_flatten_with_path(jax.device_get(trainer.state.params))[0]
      np.savez(out + name, **{jax.tree_util.keystr(k): np.asarray(v) for k, v in flat})
    save("/params0.npz")
    metrics = [trainer.run_step() for _ in range(steps)]
    save("/params.npz")
    with open(out + "/steps.json", "w") as f:
      json.dump(metrics, f)
    trainer.close()
""")


def _train(tmp_path, shape, devices, *overrides):
  out = str(tmp_path / "x".join(str(s) for s in shape))
  os.makedirs(out, exist_ok=True)
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  args = [sys.executable, "-c", _RUNNER, out, str(STEPS), f"mesh.shape={tuple(shape)}",
          f"optim.learning_rate={LR}", f"optim.eps={EPS}", *overrides]
  proc = subprocess.run(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                        timeout=900)
  assert proc.returncode == 0, proc.stdout[-4000:]
  with open(os.path.join(out, "steps.json")) as f:
    metrics = json.load(f)
  params = dict(np.load(os.path.join(out, "params.npz")))
  params0 = dict(np.load(os.path.join(out, "params0.npz")))
  return metrics, params, params0


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
  return _train(tmp_path_factory.mktemp("one"), (1, 1, 1), 1)


MESHES = [(1, 8, 1), (2, 2, 2), (1, 2, 4)]
_ids = ["x".join(map(str, s)) for s in MESHES]


@pytest.mark.parametrize("shape", MESHES, ids=_ids)
def test_fused_step_on_a_mesh_matches_one_device(tmp_path, one_device, shape):
  """2 fused steps on `shape` (8 devices) give the tokens, rewards, losses and parameters of 1 device.

  Tolerances, from float32 arithmetic (unit roundoff u = 2**-24 = 6e-8). Meshes change the
  order of the long reductions: the softmax over V = 49152 vocabulary entries (split over
  `tensor` and recombined), the sums over the 512 trained tokens (split over the batch axes).
  Summed in another order, n float32 terms differ by about u * sqrt(n) of their magnitude:
  u * (sqrt(49152) + sqrt(512)) = 1.5e-5, so gradients agree to rho = 2e-5 of the gradient norm.
  - Tokens and rewards: equal (the sampler's Gumbel-max draw only flips on an exact tie).
  - loss, grad_norm: relative rho (atol 1e-6: the GRPO loss is a sum of advantage-weighted terms
    of magnitude about 1 that cancels to about 1e-7 at the first step).
  - Parameters: Adam's step is lr * m/(sqrt(v) + eps), elementwise. Its derivative with respect
    to the gradient is at most lr/eps at the first step, and at most about 2 lr/eps at the second
    (the moments mix both steps' gradients), so gradients that differ by rho * ||g|| (L2) move
    the parameters apart by at most 3 * (lr/eps) * rho * max ||g|| in L2 over 2 steps (about
    2e-3 here; the 2 steps move the parameters by more than 100 times that). With Adam's default eps = 1e-8 that bound
    is useless (elements whose gradient is near eps turn a last-bit difference into an lr-sized
    step: why "99.99% of parameters close" failed on a fresh machine), so these runs use
    eps = 1e-3 and lr = 0.1.
  """
  ref_metrics, ref_params, start = one_device
  metrics, params, start8 = _train(tmp_path, shape, 8)
  rho = 2e-5
  for a, b in zip(ref_metrics, metrics):
    assert a["verifier/failures"] == b["verifier/failures"] == 0   # else rewards hold fallbacks
    assert a["sampler/tokens"] == b["sampler/tokens"]
    assert a["reward/mean"] == b["reward/mean"]
    assert b["loss"] == pytest.approx(a["loss"], rel=rho, abs=1e-6)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=rho)
  grad = max(m["grad_norm"] for m in ref_metrics)
  bound = 3 * (LR / EPS) * rho * grad
  assert ref_params.keys() == params.keys()
  norm = lambda a, b: math.sqrt(sum(float(np.sum((a[k] - b[k]).astype(np.float64) ** 2)) for k in a))
  assert norm(start8, start) == 0.0                   # same initial parameters
  assert norm(params, ref_params) <= bound, (norm(params, ref_params), bound)
  assert norm(ref_params, start) > 100 * bound        # the runs did move the parameters


def test_mesh_that_leaves_devices_idle_is_an_error():
  with pytest.raises(ConfigError, match=r"mesh.shape=\(3, 1, 1\) uses 3 devices but 8"):
    shd.make_mesh((3, 1, 1))
  with pytest.raises(ConfigError, match=r"mesh.shape=\(1, 1, 1\)"):
    shd.make_mesh((1, 1, 1))
  with pytest.raises(ConfigError, match="mesh.shape"):
    shd.make_mesh((16, 1, 1))
  with pytest.raises(ConfigError, match="not divisible"):
    shd.make_mesh((3, -1, 1))
  assert shd.make_mesh((2, -1, 2)).shape == {"data": 2, "fsdp": 2, "tensor": 2}
  assert shd.make_mesh(None).shape["data"] == 8
  # An explicit device list (the async mode's learner / generator split) is the way to use a subset.
  assert shd.make_mesh((1, 1, 1), devices=jax.devices()[:1]).size == 1
  assert shd.make_mesh((-1, 1, 1), devices=jax.devices()[2:]).shape["data"] == 6
  with pytest.raises(ConfigError, match="mesh.shape"):
    shd.make_mesh((2, 1, 1), devices=jax.devices()[2:])


@pytest.mark.parametrize("shape", MESHES, ids=_ids)
def test_chunked_logprobs_loop_holds_no_collective(shape):
  """On a mesh, chunked_logprobs' vocabulary loops (forward and backward) contain no collective,
  and values and gradients equal one device's to float32 rounding."""
  from rljax.rl import chunked_logprobs
  rng = np.random.default_rng(0)
  b, t, d, v = 8, 6, 16, 96
  h = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(d, v)), jnp.float32)
  y = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
  coef = jnp.asarray(rng.normal(size=(2, b, t)), jnp.float32)

  def loss(h, w, mesh):
    lp, ent = chunked_logprobs(h, w, y, 0.7, chunk_size=10, mesh=mesh)
    return (lp * coef[0]).sum() + (ent * coef[1]).sum()

  mesh = shd.make_mesh(shape)
  fn = jax.jit(jax.value_and_grad(lambda h, w: loss(h, w, mesh), argnums=(0, 1)))
  assert loop_collectives(fn.lower(h, w).compile().as_text()) == []
  (l8, (dh8, dw8)) = fn(h, w)
  (l1, (dh1, dw1)) = jax.jit(jax.value_and_grad(lambda h, w: loss(h, w, None), argnums=(0, 1)))(h, w)
  # 96 vocabulary columns in 10-column chunks: reduction orders differ; u * sqrt(96) = 6e-7.
  np.testing.assert_allclose(l8, l1, rtol=2e-6)
  np.testing.assert_allclose(dh8, dh1, rtol=0, atol=2e-6 * float(jnp.max(jnp.abs(dh1))))
  np.testing.assert_allclose(dw8, dw1, rtol=0, atol=2e-6 * float(jnp.max(jnp.abs(dw1))))


def test_decode_param_shardings():
  """The sampler's layout: embed replicated, heads / kv_heads / mlp / vocab on tensor, no fsdp."""
  from rljax.models.config import ModelConfig
  from rljax.models.policy import init_params, param_logical_axes
  config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8)
  shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
  mesh = shd.make_mesh((2, 2, 2))
  out = shd.decode_param_shardings(param_logical_axes(config), shapes, mesh)
  specs = {jax.tree_util.keystr(k): tuple(s.spec) for k, s in jax.tree_util.tree_flatten_with_path(out)[0]}
  assert all("fsdp" not in str(s) and "data" not in str(s) for s in specs.values()), specs
  assert specs["['embedding']"] in ((("tensor",), None), ("tensor", None))
  q = specs["['layers']['attn']['q_kernel']"]
  assert "tensor" in q and q[1] is None                 # [L, D, H, Dh]: heads on tensor, embed whole
  assert "tensor" in specs["['layers']['mlp']['up_kernel']"]
  # A budget the replicated layout exceeds falls back to fsdp on embed.
  small = shd.decode_param_shardings(param_logical_axes(config), shapes, mesh, max_bytes_per_device=1)
  assert "fsdp" in str(jax.tree.leaves(small)[0].spec) or any(
      "fsdp" in str(s.spec) for s in jax.tree.leaves(small))
  total = sum(math.prod(x.shape) * 4 for x in jax.tree.leaves(shapes))
  per_device = shd.bytes_per_device(out, shapes)
  assert total / 2 - 1 <= per_device < total            # about half the model per device on tensor=2


def test_prompt_widths_compile_a_handful_of_programs():
  """Prompt widths come in power-of-two buckets (16 .. max_prompt_tokens): a step jitted over the
  prompt batch compiles once per bucket, and compile_stats counts it."""
  from rljax import compile_stats
  from rljax.data.batching import bucket_width
  compile_stats.install()
  widths = sorted({bucket_width(n, 16, 300) for n in range(1, 301)})
  assert widths == [16, 32, 64, 128, 256, 300]
  assert bucket_width(49, 16, None, "multiple") == 64 and bucket_width(33, 16, None, "multiple") == 48
  with pytest.raises(ConfigError, match="data.pad_buckets"):
    bucket_width(3, 16, None, "fibonacci")
  step = jax.jit(lambda ids: (ids * 2).sum(axis=1))
  before = compile_stats.counts()["compiles"]
  for n in range(1, 301, 7):                          # 43 batches of different longest prompts
    step(np.zeros((4, bucket_width(n, 16, 300)), np.int32))
  assert compile_stats.num_programs(step) == len(widths)
  assert compile_stats.counts()["compiles"] - before == len(widths)
