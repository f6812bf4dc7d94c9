"""Checkpointer: bitwise round trips, retention, cross-mesh restores, crash safety, errors."""
import functools
import os
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rljax.errors import RljaxError
from rljax.models.config import ModelConfig
from rljax.models.policy import init_params, param_shardings
from rljax.sharding import make_mesh
from rljax.trainer.checkpoint import Checkpointer, CheckpointError
from rljax.trainer.state import TrainState

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


OPT = optax.adamw(1e-3, weight_decay=0.1)


@functools.lru_cache(maxsize=None)
def _state_shapes(with_ref):
  def build():
    params = init_params(CFG, jax.random.key(0))
    return TrainState.create(params, OPT, seed=0, ref_params=params if with_ref else None)
  return jax.eval_shape(build)


def make_state(seed=0, with_ref=False, step=7):
  """A TrainState (model params, adamw state) with distinct random values in every leaf.

  Filled from numpy, not by running init/optax eagerly: every eager op compiles, which takes
  tens of seconds on a loaded CPU.
  """
  rng = np.random.default_rng(seed)

  def fill(s):
    if np.issubdtype(s.dtype, np.floating):
      return jnp.asarray(rng.standard_normal(s.shape).astype(s.dtype))
    return jnp.asarray(rng.integers(0, np.iinfo(s.dtype).max, s.shape, dtype=s.dtype))
  state = jax.tree.map(fill, _state_shapes(with_ref))
  return state.replace(step=jnp.asarray(step, jnp.int32))


def abstract(tree, sharding_of=None):
  """ShapeDtypeStructs; `sharding_of(path, leaf)` picks the sharding (default: device 0)."""
  dev0 = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree_util.tree_map_with_path(
      lambda p, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_of(p, x) if sharding_of else dev0), tree)


def assert_bitwise(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and x.shape == y.shape
    assert np.array_equal(np.asarray(x), np.asarray(y))


# ---- round trip ------------------------------------------------------------------------------


@pytest.mark.parametrize("with_ref", [False, True])
def test_round_trip_is_bitwise(tmp_path, with_ref):
  state = make_state(with_ref=with_ref)
  extras = {"data": {"epoch": 1, "cursor": [3, 4], "rng": np.uint32(7)}, "model_config": CFG.to_hf(),
            "tokenizer": "some/tokenizer", "metrics": [{"loss": np.float32(0.5)}]}
  with Checkpointer(tmp_path / "ck") as ck:
    assert ck.save(7, state, extras=extras, metrics={"eval/acc": 0.25})
    ck.wait()
    assert ck.all_steps() == [7] and ck.latest_step() == 7
    restored, got = ck.restore(abstract_state=abstract(state))
  assert type(restored) is TrainState
  assert_bitwise(restored, state)
  assert (restored.ref_params is None) == (not with_ref)
  assert got == {"data": {"epoch": 1, "cursor": [3, 4], "rng": 7}, "model_config": CFG.to_hf(),
                 "tokenizer": "some/tokenizer", "metrics": [{"loss": 0.5}]}
  with Checkpointer(tmp_path / "ck", read_only=True) as ck:   # a fresh process's view
    assert ck.restore_extras() == got
    assert ck.metrics(7) == {"eval/acc": 0.25}
    params = ck.restore_params()
  assert_bitwise(params, state.params)


def test_ref_params_dropped_or_missing(tmp_path):
  with Checkpointer(tmp_path / "with_ref", async_save=False) as ck:
    ck.save(1, make_state(with_ref=True))
    restored, _ = ck.restore(abstract_state=abstract(make_state(with_ref=False)))   # KL turned off on resume
  assert restored.ref_params is None
  assert_bitwise(restored.params, make_state().params)
  with Checkpointer(tmp_path / "no_ref", async_save=False) as ck:
    ck.save(1, make_state(with_ref=False))
    with pytest.raises(CheckpointError, match=r"ref_params=None"):
      ck.restore(abstract_state=abstract(make_state(with_ref=True)))


def test_mismatched_state_is_a_clear_error(tmp_path):
  with Checkpointer(tmp_path / "ck", async_save=False) as ck:
    ck.save(1, make_state())
    other = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=8)
    wrong = jax.eval_shape(lambda: TrainState.create(init_params(other, jax.random.key(0)), OPT, seed=0))
    with pytest.raises(CheckpointError, match=r"params\.layers\.mlp\.\w+_kernel: saved \(2, 32, 64\)"):
      ck.restore(abstract_state=abstract(wrong))
    sgd = jax.eval_shape(lambda p: TrainState.create(p, optax.sgd(1e-3), seed=0), _state_shapes(False).params)
    with pytest.raises(CheckpointError, match=r"opt_state"):
      ck.restore(abstract_state=abstract(sgd))


# ---- retention -------------------------------------------------------------------------------


def tiny(step):
  return {"w": jnp.asarray(np.full((4,), step, np.float32))}


def test_keep_last_and_best(tmp_path):
  d = tmp_path / "ck"
  with Checkpointer(d, keep_last=2, keep_best=1, best_metric="eval/acc", async_save=False) as ck:
    for step, acc in [(1, 0.2), (2, 0.9), (3, None), (4, 0.5), (5, None), (6, float("nan"))]:
      ck.save(step, tiny(step), metrics=None if acc is None else {"eval/acc": acc, "loss": 1.0})
    assert ck.all_steps() == [2, 5, 6]      # last two + best (2); 3/5/6 have no finite metric
    assert ck.best_step() == 2
  # Retention survives a restart: metrics are read back from disk.
  with Checkpointer(d, keep_last=2, keep_best=1, best_metric="eval/acc", async_save=False) as ck:
    ck.save(7, tiny(7), metrics={"eval/acc": 0.95})
    ck.save(8, tiny(8), metrics={"loss": 0.1})   # no eval/acc: never a candidate for best
    assert ck.all_steps() == [7, 8]
    assert ck.best_step() == 7
    restored, _ = ck.restore(abstract_state=abstract(tiny(0)))
    assert float(restored["w"][0]) == 8.0


def test_keep_best_min_mode_and_async(tmp_path):
  with Checkpointer(tmp_path / "ck", keep_last=1, keep_best=2, best_metric="eval/loss", best_mode="min") as ck:
    for step, loss in [(10, 3.0), (20, 1.0), (30, 2.0), (40, 0.5), (50, 4.0)]:
      ck.save(step, tiny(step), metrics={"eval/loss": loss})
    ck.wait()
    assert ck.all_steps() == [20, 40, 50]


def test_save_existing_step_skips_or_replaces(tmp_path):
  with Checkpointer(tmp_path / "ck", async_save=True) as ck:
    assert ck.save(5, tiny(5), extras={"v": 1})
    assert not ck.save(5, tiny(6), extras={"v": 2})          # exists: skipped
    assert not ck.save(3, tiny(3))                           # below the latest: skipped
    assert ck.save(5, tiny(6), extras={"v": 3}, force=True)  # replaced
    ck.wait()
    assert sorted(os.listdir(ck.directory)) == ["5"]         # the set-aside copy is gone
    restored, extras = ck.restore(abstract_state=tiny(0))       # arrays work as the target too
    assert float(restored["w"][0]) == 6.0 and extras == {"v": 3}
    assert ck.save(3, tiny(3), force=True)
    ck.wait()
    assert ck.all_steps() == [3, 5]


def test_interrupted_replace_is_rolled_back(tmp_path):
  d = tmp_path / "ck"
  with Checkpointer(d, async_save=False) as ck:
    ck.save(5, tiny(5), extras={"v": 1})
  os.rename(d / "5", d / "5.rljax-replaced")    # what a crash mid `save(5, force=True)` leaves
  with Checkpointer(d) as ck:
    assert ck.all_steps() == [5] and ck.restore_extras() == {"v": 1}


# ---- errors ----------------------------------------------------------------------------------


def test_clear_errors_for_non_checkpoints(tmp_path):
  with pytest.raises(CheckpointError, match="does not exist"):
    Checkpointer(tmp_path / "nope", read_only=True)
  assert not (tmp_path / "nope").exists()
  empty = tmp_path / "empty"
  empty.mkdir()
  with Checkpointer(empty) as ck:
    assert ck.latest_step() is None
    with pytest.raises(CheckpointError, match="is empty"):
      ck.restore(abstract_state=abstract(tiny(0)))
    with pytest.raises(CheckpointError, match="is empty"):
      ck.restore_extras()
  hf = tmp_path / "hf"
  hf.mkdir()
  (hf / "config.json").write_text("{}")
  with Checkpointer(hf, read_only=True) as ck, pytest.raises(CheckpointError, match="Hugging Face"):
    ck.restore_extras()
  run = tmp_path / "run"
  (run / "checkpoints").mkdir(parents=True)
  with Checkpointer(run, read_only=True) as ck, pytest.raises(CheckpointError, match="did you mean .*checkpoints"):
    ck.restore_extras()
  (tmp_path / "file").write_text("x")
  with pytest.raises(CheckpointError, match="is a file"):
    Checkpointer(tmp_path / "file")
  foreign = tmp_path / "foreign"
  (foreign / "7").mkdir(parents=True)
  (foreign / "7" / "notes.txt").write_text("not a checkpoint")
  with pytest.raises(CheckpointError, match="not an rljax checkpoint"):
    Checkpointer(foreign)                      # retention could delete it: refuse to write here
  with Checkpointer(foreign, read_only=True) as ck:
    assert ck.all_steps() == []
    with pytest.raises(CheckpointError, match="not rljax checkpoints"):
      ck.restore_extras()
  assert (foreign / "7" / "notes.txt").exists()
  with Checkpointer(tmp_path / "ck", async_save=False) as ck:
    ck.save(1, tiny(1))
    with pytest.raises(CheckpointError, match=r"step 2 does not exist.*\[1\]"):
      ck.restore(2, abstract_state=abstract(tiny(0)))
    with pytest.raises(CheckpointError, match=r"extras\['data'\]\['when'\] is a object"):
      ck.save(2, tiny(2), extras={"data": {"when": object()}})
    with pytest.raises(CheckpointError, match="keys must be strings"):
      ck.save(2, tiny(2), extras={"data": {3: 1}})
  with pytest.raises(RljaxError, match="keep_last"):
    Checkpointer(tmp_path / "x", keep_last=0)


# ---- cross-mesh ------------------------------------------------------------------------------


def _path_str(path):
  return ".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def state_shardings_fn(mesh):
  """Params, reference and adam moments by their logical axes; everything else replicated."""
  by_name = {_path_str(p): s for p, s in jax.tree_util.tree_flatten_with_path(param_shardings(CFG, mesh))[0]}
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def pick(path, leaf):
    name = _path_str(path)
    for prefix in ("params.", "ref_params.", "0.mu.", "0.nu."):
      idx = name.find(prefix)
      if idx >= 0 and name[idx + len(prefix):] in by_name and (idx == 0 or prefix.startswith("0.")):
        return by_name[name[idx + len(prefix):]]
    return replicated
  return pick


def test_cross_mesh_restore_8_to_1_and_1_to_8(tmp_path):
  assert jax.device_count() == 8
  mesh8 = make_mesh((2, 2, 2))
  mesh1 = make_mesh((1, 1, 1), devices=jax.devices()[:1])
  state = make_state(with_ref=True)
  sharded = jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), state,
                         abstract(state, state_shardings_fn(mesh8)))
  q = sharded.params["layers"]["attn"]["q_kernel"]
  assert len(q.sharding.device_set) == 8 and q.sharding.spec != jax.sharding.PartitionSpec()
  with Checkpointer(tmp_path / "from8") as ck:
    ck.save(1, sharded, extras={"mesh": [2, 2, 2]})
    ck.wait()
    on1, _ = ck.restore(abstract_state=abstract(state, state_shardings_fn(mesh1)))
  assert_bitwise(on1, state)
  assert all(x.sharding.device_set == {jax.devices()[0]} for x in jax.tree.leaves(on1))

  with Checkpointer(tmp_path / "from1") as ck:
    ck.save(1, on1)
    ck.wait()
    target = abstract(state, state_shardings_fn(mesh8))
    on8, _ = ck.restore(abstract_state=target)
  assert_bitwise(on8, state)
  for got, want in zip(jax.tree.leaves(on8), jax.tree.leaves(target)):
    assert got.sharding == want.sharding
  assert on8.opt_state[0].mu["layers"]["attn"]["q_kernel"].sharding.spec == q.sharding.spec


# ---- crash safety ----------------------------------------------------------------------------

_CRASH_CHILD = textwrap.dedent("""
    import os, sys, time
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.pop("XLA_FLAGS", None)
    sys.path.insert(0, {repo!r})
    import jax, jax.numpy as jnp, numpy as np
    from rljax.trainer.checkpoint import Checkpointer
    sys.path.insert(0, {here!r})
    from test_checkpoint import make_state
    ck = Checkpointer(sys.argv[1], keep_last=3)
    ck.save(1, make_state(seed=1, with_ref=True, step=1), extras={{"step": 1}})
    ck.wait()
    n = int(sys.argv[2])
    big = make_state(seed=2, step=2)
    rng = np.random.default_rng(0)
    big_arrays = [jnp.asarray(rng.standard_normal(n, np.float32)) for _ in range(4)]
    big = big.replace(params={{**big.params, "big": big_arrays}})
    ck.save(2, big, extras={{"step": 2}})
    print("SAVE2_STARTED", flush=True)
    ck.wait()
    print("SAVE2_DONE", flush=True)
    time.sleep(60)
""")


def test_killed_mid_save_keeps_previous_checkpoint(tmp_path):
  script = tmp_path / "child.py"
  script.write_text(_CRASH_CHILD.format(repo=REPO, here=os.path.dirname(os.path.abspath(__file__))))
  n = 4 * 1024 * 1024  # float32 elements per big array (4 arrays): grows until the kill lands mid-write
  for attempt in range(4):
    d = tmp_path / f"ck{attempt}"
    log = open(tmp_path / f"child{attempt}.log", "w")
    proc = subprocess.Popen([sys.executable, str(script), str(d), str(n)], stdout=subprocess.PIPE,
                            stderr=log, text=True)
    try:
      for line in proc.stdout:
        if line.startswith("SAVE2_STARTED"):
          break
      proc.send_signal(signal.SIGKILL)
    finally:
      proc.kill()
      proc.wait(timeout=30)
      proc.stdout.close()
      log.close()
    names = sorted(os.listdir(d)) if d.exists() else []
    assert "1" in names, (names, (tmp_path / f"child{attempt}.log").read_text()[-3000:])
    if "2" not in names and any(x.startswith("2.orbax-checkpoint-tmp") for x in names):
      print(f"killed mid-save on attempt {attempt + 1} ({4 * n * 4 >> 20} MiB being written)")
      break   # caught it mid-write
    n *= 2
  else:
    pytest.fail(f"never caught the save mid-write; last listing: {names}")

  want = make_state(seed=1, with_ref=True, step=1)
  with Checkpointer(d, read_only=True) as ck:     # read-only sees the complete step only
    assert ck.all_steps() == [1]
  with Checkpointer(d, keep_last=3) as ck:        # resuming: tmp dir is cleaned, step 1 is intact
    state, extras = ck.restore(abstract_state=abstract(want))
    assert_bitwise(state, want)
    assert extras == {"step": 1}
    assert ck.save(2, make_state(seed=2, step=2), extras={"step": 2})
    ck.wait()
    assert ck.all_steps() == [1, 2]
  assert sorted(os.listdir(d)) == ["1", "2"]


# ---- export ----------------------------------------------------------------------------------


def _word_level_tokenizer(directory, vocab_size):
  tokenizers = pytest.importorskip("tokenizers")
  vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.save(str(directory / "tokenizer.json"))


def _safetensors_dtypes(path):
  import json
  import struct
  with open(path, "rb") as f:
    header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
  return {v["dtype"] for k, v in header.items() if k != "__metadata__"}


def test_export_loads_in_transformers_with_same_logits(tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from rljax.models.io import load_pretrained
  from rljax.models.policy import Policy
  from rljax.trainer.export import export_checkpoint, export_main

  vocab = 96
  hf_cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                    max_position_embeddings=64, tie_word_embeddings=False, rms_norm_eps=1e-5,
                                    bos_token_id=1, eos_token_id=2)
  torch.manual_seed(0)
  src = tmp_path / "src"
  transformers.LlamaForCausalLM(hf_cfg).save_pretrained(src)
  _word_level_tokenizer(src, vocab)
  policy = load_pretrained(src)

  # "Training" moved the weights: the export must come from the checkpoint, not from `src`.
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda p: np.asarray(p) + 0.02 * rng.standard_normal(p.shape).astype(np.float32),
                        policy.params)
  opt_state = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), jax.eval_shape(OPT.init, params))
  state = TrainState(step=jnp.int32(3), params=params, opt_state=opt_state, rng=jnp.zeros(2, jnp.uint32),
                     ref_params=None)
  ck_dir = tmp_path / "ck"
  with Checkpointer(ck_dir) as ck:
    ck.save(3, state, extras={"model_config": policy.config.to_hf(), "tokenizer": str(src)})
    ck.save(4, state, extras={"model_config": policy.config.to_hf(), "tokenizer": "random"})
    ck.save(5, state, extras={})

  out = export_checkpoint(ck_dir, tmp_path / "hf32", step=3, dtype="float32")
  assert (tmp_path / "hf32" / "tokenizer.json").exists()
  assert _safetensors_dtypes(tmp_path / "hf32" / "model.safetensors") == {"F32"}
  model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
  ids = rng.integers(0, vocab, (2, 12))
  with torch.no_grad():
    got = model(torch.tensor(ids)).logits.numpy()
    before = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)(torch.tensor(ids)).logits
  want = np.asarray(Policy(policy.config, jax.tree.map(jnp.asarray, params))(ids))
  assert np.abs(got - want).max() <= 1e-4
  assert np.abs(got - before.numpy()).max() > 1e-3          # the trained weights, not the source's
  assert transformers.AutoTokenizer.from_pretrained(out).convert_tokens_to_ids("w7") == 7

  # The CLI entry point, bf16, a tokenizer source that no longer loads (a warning, no tokenizer files).
  with pytest.warns(UserWarning, match="without tokenizer files"):
    assert export_main(["--checkpoint", str(ck_dir), "--out", str(tmp_path / "hf16"), "--step", "4",
                        "--dtype", "bfloat16"]) == 0
  assert _safetensors_dtypes(tmp_path / "hf16" / "model.safetensors") == {"BF16"}
  assert not (tmp_path / "hf16" / "tokenizer.json").exists()

  with pytest.raises(RljaxError, match="model_config"):
    export_checkpoint(ck_dir, tmp_path / "bad")           # latest step (5) has no model config
  with pytest.raises(RljaxError, match="is empty"):
    (tmp_path / "empty").mkdir()
    export_checkpoint(tmp_path / "empty", tmp_path / "bad")
  with pytest.raises(SystemExit):
    export_main(["--checkpoint", str(ck_dir)])             # --out is required


def test_async_save_survives_donated_buffers(tmp_path):
  """`save` returns after the device-to-host copy: the train step may donate the state right away."""
  values = {"w": np.arange(1 << 16, dtype=np.float32), "b": np.full((8, 8), 3, np.int32)}
  live = jax.tree.map(jnp.asarray, values)
  with Checkpointer(tmp_path / "ck", async_save=True) as ck:
    ck.save(1, live)
    for leaf in jax.tree.leaves(live):
      leaf.delete()                            # what buffer donation does
    ck.wait()
    restored, _ = ck.restore(abstract_state=abstract(values))
  assert_bitwise(restored, values)


def _truncate_files(directory, keep=0.5):
  for root, _, files in os.walk(directory):
    for name in files:
      path = os.path.join(root, name)
      os.truncate(path, int(os.path.getsize(path) * keep))


def test_unreadable_latest_falls_back_to_the_previous_complete_one(tmp_path, caplog):
  # Step 6's arrays and step 4's extras are truncated after they were saved: resuming restores
  # step 2 (bitwise), says which steps it skipped and why, and sets them aside so that the next
  # saves work. An explicit step is never replaced by another.
  states = {s: make_state(seed=s, step=s) for s in (2, 4, 6)}
  with Checkpointer(tmp_path / "ck", keep_last=5, async_save=False) as ck:
    for s, state in states.items():
      ck.save(s, state, extras={"data": {"step": s}})
  _truncate_files(tmp_path / "ck" / "6" / "state" / "ocdbt.process_0" / "d")
  _truncate_files(tmp_path / "ck" / "4" / "extras", keep=0.3)
  with Checkpointer(tmp_path / "ck", keep_last=5, async_save=False) as ck:
    with pytest.raises(CheckpointError, match="could not read the arrays of .*/6"):
      ck.restore(6, abstract_state=abstract(states[6]))
    assert ck.restore_extras() == {"data": {"step": 6}}  # its extras are intact (only its arrays are not)
    with caplog.at_level("WARNING", logger="rljax.trainer.checkpoint"):
      restored, extras = ck.restore(abstract_state=abstract(states[6]))
    assert_bitwise(restored, states[2])
    assert extras == {"data": {"step": 2}}
    text = caplog.text
    assert "step 6" in text and "could not read the arrays" in text and "step 4" in text and "extras" in text
    assert "resuming from checkpoint step 2" in text and "skipped: 6, 4" in text
    assert ck.all_steps() == [2] and os.path.isdir(tmp_path / "ck" / "6.rljax-unreadable")
    assert ck.save(3, states[4].replace(step=jnp.asarray(3, jnp.int32)))
  with Checkpointer(tmp_path / "ck", read_only=True) as ck:
    assert ck.all_steps() == [2, 3]
