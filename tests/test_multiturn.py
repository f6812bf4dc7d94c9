"""Multi-turn tool use (rljax/rollout/tools.py over rljax/rollout/segments.py): scripted tool calls
(tests/tools_testlib.py) on a tiny random model with the SmolLM2 tokenizer, real tools in the real
tool pool."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tools_testlib import ScriptedDraw, scripted_tool_rollout

from rljax.config import base_config
from rljax.rl import LossConfig
from rljax.rollout import SamplingParams, sample
from rljax.rollout.tools import ToolProducer, ToolRollout, marker_variants, response_template
from rljax.tools import ToolRunner
from rljax.trainer.loop import load_policy
from rljax.trainer.step import StepSpec, sequence_logprobs

PARITY_TOL = 1e-5     # fp32: sampler log-probs vs the learner's teacher-forced forward


@pytest.fixture(scope="module")
def policy():
  c = base_config()
  c.model.path = "random"
  c.model.random.num_layers = 2
  return load_policy(c.model, "smollm2-135m-instruct")


@pytest.fixture(scope="module")
def runner():
  with ToolRunner(["calculator", "python"], timeout_s=3.0, num_workers=2) as r:
    yield r


def _prompts(tok, texts):
  ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False)) for t in texts]
  width = max(len(i) for i in ids)
  out, mask = np.zeros((len(ids), width), np.int32), np.zeros((len(ids), width), bool)
  for r, i in enumerate(ids):
    out[r, width - len(i):], mask[r, width - len(i):] = i, True
  return out, mask


def _engine(policy, runner, script=None, *, g=2, t=96, fmt="hermes", prefill=False, **turn):
  """A tool rollout whose rows open turns with script[(row, turn)] (tools_testlib.ScriptedDraw)."""
  sp = SamplingParams(num_samples=g, max_new_tokens=t, temperature=1.0, stop_token_ids=tuple(policy.tokenizer.stop_ids))
  return scripted_tool_rollout(policy.config, policy.tokenizer, runner, sp, script or {}, fmt=fmt, prefill=prefill,
                               segment_tokens=turn.pop("segment_tokens", 8), **turn)


def _run(engine, policy, ids, mask, seed):
  """(rollout, trajectories, metrics) of one multi-turn rollout."""
  rollout, info = engine.run(policy.params, ids, mask, jax.random.key(seed))
  return rollout, info.trajectories, info.metrics


def _call(tok, body):
  return tok.encode(f"Let me check. <tool_call>{body}</tool_call>")


def _learner_logprobs(policy, engine, prompt_ids, prompt_mask, traj):
  g = engine.sp.num_samples
  spec = StepSpec(model=policy.config, sampling=engine.sp, loss=LossConfig(), prompts=prompt_ids.shape[0])
  lp, _ = jax.jit(lambda *a: sequence_logprobs(spec, *a))(
      policy.params, jnp.repeat(prompt_ids, g, 0), jnp.repeat(prompt_mask, g, 0), traj.tokens, traj.context_mask)
  return np.asarray(lp)


def test_markers_and_template(policy):
  tok = policy.tokenizer
  ends = marker_variants(tok, "</tool_call>")
  assert tuple(tok.encode("</tool_call>")) in ends
  for ids in ends:
    assert "</tool_call>" in tok.decode(list(ids), skip_special_tokens=False)
  prefix, suffix = response_template(tok, "hermes")
  # SmolLM2's template renders a tool message as its own turn, then opens the assistant's.
  assert prefix.startswith("<|im_end|>") and "tool" in prefix and suffix.endswith("<|im_start|>assistant\n")
  assert response_template(tok, "python") == ("\n<interpreter>\n", "\n</interpreter>\n")


def test_scripted_call_masks_resume_and_logprob_parity(policy, runner):
  """Row 0 calls the calculator, row 1 never calls: masks, response tokens and learner parity."""
  tok = policy.tokenizer
  ids, mask = _prompts(tok, ["What is 6*7?", "Say hi."])
  call = _call(tok, '{"name": "calculator", "arguments": {"expression": "6*7"}}')
  engine = _engine(policy, runner, {(0, 0): call}, g=1)
  _, traj, metrics = _run(engine, policy, ids, mask, 3)

  assert traj.turns.tolist() == [1, 0] and traj.tool_errors.tolist() == [0, 0]
  n0 = int(traj.lengths[0])
  assert traj.tokens[0, :len(call)].tolist() == call
  prefix, suffix = engine.wrap
  resp = tok.encode(prefix + "42" + suffix)
  assert traj.tokens[0, len(call):len(call) + len(resp)].tolist() == resp
  model, ctx = traj.model_mask[0], traj.context_mask[0]
  assert model[:len(call)].all() and not model[len(call):len(call) + len(resp)].any()
  assert model[len(call) + len(resp):n0].all(), "the model speaks again after the response"
  assert ctx[:n0].all() and not ctx[n0:].any()
  assert n0 > len(call) + len(resp)

  lp = _learner_logprobs(policy, engine, jnp.asarray(ids), jnp.asarray(mask), traj)
  diff = np.abs(np.where(traj.model_mask, lp - traj.logprobs, 0.0)).max()
  assert diff <= PARITY_TOL, diff
  assert metrics["tools/calls"] == 1.0 and metrics["tools/tool_token_fraction"] > 0


def test_cache_resume_equals_reprefill(policy, runner):
  """Feeding only the new tokens into the cache gives what prefilling the whole history gives
  (tools_testlib.PrefillingToolRollout, the baseline)."""
  tok = policy.tokenizer
  ids, mask = _prompts(tok, ["Compute 2+3.", "Compute 10/4."])
  script = {(0, 0): _call(tok, '{"name": "calculator", "arguments": {"expression": "2+3"}}'),
            (3, 0): _call(tok, '{"name": "calculator", "arguments": {"expression": "10/4"}}')}
  a, b = (_run(_engine(policy, runner, script, g=2, prefill=prefill), policy, ids, mask, 7)[1]
          for prefill in (False, True))
  assert a.turns.tolist() == [1, 0, 0, 1]
  np.testing.assert_array_equal(a.lengths, b.lengths)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.model_mask, b.model_mask)
  assert np.abs(a.logprobs - b.logprobs).max() <= PARITY_TOL


def test_rows_without_tools_match_the_single_turn_sampler(policy, runner):
  """Other rows' tool calls do not change a row's tokens: rows that never call a tool get exactly
  what `sampling.sample` gives with the same key."""
  tok = policy.tokenizer
  ids, mask = _prompts(tok, ["Compute 2+3.", "Tell me a story."])
  call = _call(tok, '{"name": "calculator", "arguments": {"expression": "2+3"}}')
  engine = _engine(policy, runner, {(0, 0): call}, g=2)
  _, traj, _ = _run(engine, policy, ids, mask, 11)
  ref = sample(policy.config, policy.params, jnp.asarray(ids), jnp.asarray(mask),
               dataclasses.replace(engine.sp), jax.random.key(11), eos_ids=engine.stop_ids)
  assert traj.turns.tolist() == [1, 0, 0, 0]
  for r in (1, 2, 3):
    n = int(traj.lengths[r])
    assert n == int(ref.lengths[r])
    np.testing.assert_array_equal(traj.tokens[r, :n], np.asarray(ref.tokens)[r, :n])
    np.testing.assert_allclose(traj.logprobs[r, :n], np.asarray(ref.logprobs)[r, :n], atol=PARITY_TOL)


def test_sampler_and_engine_make_the_same_choice(policy):
  """One choice function: from the same logits and keys, the single-turn loop (one column for all
  rows, key fold_in(rng, t)) and the multi-turn engine (each row at its trajectory end, key
  fold_in(rng, count)) build the same DecodeState, bit for bit: tokens, masks, log-probs,
  entropies, stops (the engine also marks full rows done; the sampler's loop just ends). Rows
  start done or stop mid-way; the vocabulary is wider than two draw blocks."""
  from rljax.rollout import decode, segments
  b, t, v = 6, 7, 1000
  sp = SamplingParams(num_samples=1, max_new_tokens=t, temperature=0.9, top_p=0.95)
  stop_ids = (11, 12)
  # Row 1 stops at step 2 and row 3 at step 4 (a stop id all but certain there).
  logits = jax.random.normal(jax.random.key(0), (t, b, v)).at[2, 1, 11].add(40.0).at[4, 3, 12].add(40.0)
  rng = jax.random.key(4)
  pad = decode.pad_token_id(policy.config)
  done = jnp.asarray([False, False, True, False, False, False])
  single = decode.DecodeState.empty(b, t, pad, done=done)
  seg = segments.SegmentParams(end_ids=((v + 1,),))                    # never pauses
  turns = segments.SegmentState.init(policy.config, b, t).replace(done=done)
  choose_turn = jax.jit(lambda s, x: segments.choose_next(policy.config, sp, seg, stop_ids, s, x, ~s.done, rng))
  choose_col = jax.jit(lambda s, x, k: decode.choose(s, x, k, sp, jax.random.fold_in(rng, k), stop_ids, pad)[0])
  for k in range(t):
    single = choose_col(single, logits[k], k)
    turns = choose_turn(turns, logits[k])
  for field in ("tokens", "mask", "logprobs", "entropy", "stopped"):
    np.testing.assert_array_equal(np.asarray(getattr(turns, field)), np.asarray(getattr(single, field)), field)
  stopped, lengths = np.asarray(single.stopped), np.asarray(single.mask.sum(-1))
  np.testing.assert_array_equal(lengths, [t, 3, 0, 5, t, t])
  np.testing.assert_array_equal(stopped, [False, True, False, True, False, False])
  np.testing.assert_array_equal(np.asarray(single.done), stopped | np.asarray(done))
  np.testing.assert_array_equal(np.asarray(turns.done), np.asarray(single.done) | (lengths == t))
  np.testing.assert_array_equal(np.asarray(turns.n), lengths)
  assert not np.asarray(turns.fed).any() and int(turns.count) == t


def test_call_spanning_another_rows_feed_round(policy, runner):
  """Row 1 is in the middle of its call's JSON when row 0's tool answer is fed (a round in which
  row 1 only feeds its pending token): its turn still starts where it started, so its call parses."""
  tok = policy.tokenizer
  ids, mask = _prompts(tok, ["Compute 2+3.", "Add 1 to 30."])
  short = _call(tok, '{"name": "calculator", "arguments": {"expression": "2+3"}}')
  expression = "+".join(str(i) for i in range(1, 31))      # sums to 465
  long = _call(tok, '{"name": "calculator", "arguments": {"expression": "%s"}}' % expression)
  assert len(long) > len(short) + 16
  engine = _engine(policy, runner, {(0, 0): short, (1, 0): long}, g=1, t=160)
  _, traj, metrics = _run(engine, policy, ids, mask, 2)
  assert traj.turns.tolist() == [1, 1] and traj.tool_errors.tolist() == [0, 0]
  assert metrics["tools/false_triggers"] == 0 and metrics["tools/feeds"] >= 2
  prefix, suffix = engine.wrap
  resp = tok.encode(prefix + "465" + suffix)
  # The call went out exactly as scripted (its forcing was not restarted by row 0's round) and
  # the answer follows it.
  assert traj.tokens[1, :len(long) + len(resp)].tolist() == long + resp


def test_hostile_calls_become_error_observations(policy, runner):
  tok = policy.tokenizer
  ids, mask = _prompts(tok, ["a", "b", "c", "d"])
  bodies = ['{"name": "calculator", "arguments": {"expression": "6*7"',        # malformed JSON
            '{"name": "rm_rf", "arguments": {}}',                               # unknown tool
            '{"name": "calculator", "arguments": {"expr": "1"}}',               # wrong argument
            '{"name": "python", "arguments": {"code": "while True: pass"}}']    # hangs past the timeout
  calls = {r: _call(tok, b) for r, b in enumerate(bodies)}
  engine = _engine(policy, runner, {(r, 0): c for r, c in calls.items()}, g=1, t=160)
  _, traj, _ = _run(engine, policy, ids, mask, 0)
  assert traj.turns.tolist() == [1, 1, 1, 1]
  assert traj.tool_errors.tolist() == [1, 1, 1, 1]
  for r in range(4):
    n = int(traj.lengths[r])
    text = tok.decode(traj.tokens[r, :n].tolist(), skip_special_tokens=False)
    assert "Error" in text[len(tok.decode(calls[r], skip_special_tokens=False)):], text
    assert traj.model_mask[r, :n].sum() > len(calls[r]), "decoding resumed after the error observation"
  assert "timed out" in tok.decode(traj.tokens[3, :traj.lengths[3]].tolist()).lower()


def test_python_format_keeps_interpreter_state_and_turn_limit(policy, runner):
  tok = policy.tokenizer
  ids, mask = _prompts(tok, ["x"])
  cells = [tok.encode("```python\nx = 21\n```"), tok.encode("```python\nprint(x * 2)\n```"),
           tok.encode("```python\nprint(1)\n```")]
  engine = _engine(policy, runner, {(0, t): c for t, c in enumerate(cells)}, g=1, t=200, fmt="python", max_turns=2)
  _, traj, _ = _run(engine, policy, ids, mask, 1)
  text = tok.decode(traj.tokens[0, :traj.lengths[0]].tolist(), skip_special_tokens=False)
  assert traj.turns.tolist() == [2]
  assert "<interpreter>\n42\n</interpreter>" in text, text
  assert traj.turn_limited.tolist() == [True] and not traj.truncated[0]
  assert text.rstrip().endswith("```"), "the third call ended the trajectory unanswered"


def test_bad_turn_params(policy, runner):
  with pytest.raises(Exception, match="max_turns"):
    _engine(policy, runner, max_turns=0)
  with pytest.raises(Exception, match="format"):
    _engine(policy, runner, fmt="xml")


def test_update_trains_on_model_tokens_and_recomputes_sampler_logprobs(policy, runner):
  """The compiled update on a multi-turn rollout: its recomputed lp_old (attending to tool tokens
  through context_mask) equals the sampler's on every model token; without the context the
  same tokens get other log-probs, and tool tokens carry no loss weight."""
  import optax

  from rljax.trainer.state import TrainState
  from rljax.trainer.step import make_update_fn
  tok = policy.tokenizer
  ids, mask = _prompts(tok, ["What is 6*7?", "Compute 2+3."])
  calls = {0: _call(tok, '{"name": "calculator", "arguments": {"expression": "6*7"}}'),
           2: _call(tok, '{"name": "calculator", "arguments": {"expression": "2+3"}}')}
  engine = _engine(policy, runner, {(r, 0): c for r, c in calls.items()}, g=2)
  rollout, traj, _ = _run(engine, policy, ids, mask, 5)
  assert traj.turns.tolist() == [1, 0, 1, 0]
  g = engine.sp.num_samples
  rewards = jnp.asarray([1.0, 0.0, 0.0, 1.0])
  rollout = rollout.with_rewards(rewards, rewards[:, None])
  np.testing.assert_array_equal(np.asarray(rollout.prompt_ids), np.repeat(ids, g, 0))
  np.testing.assert_array_equal(np.asarray(rollout.context_mask), traj.context_mask)
  assert rollout.group_size == g
  spec = StepSpec(model=policy.config, sampling=engine.sp, loss=LossConfig(), prompts=2,
                  eos_ids=engine.stop_ids, recompute_old_logprobs=True)
  opt = optax.apply_if_finite(optax.sgd(0.0), max_consecutive_errors=2**31 - 1)   # the update counts skips

  def diff(r):
    state = TrainState.create(policy.params, opt, 0)
    _, metrics = jax.jit(make_update_fn(spec, opt))(state, r)
    return float(metrics["sampler_logprob_diff_max"]), float(metrics["response_length_mean"])

  with_ctx, length = diff(rollout)
  without_ctx, _ = diff(rollout.replace(context_mask=rollout.mask))
  assert with_ctx <= PARITY_TOL, with_ctx
  assert without_ctx > 1e-3, "hiding the tool tokens changes the model tokens' log-probs"
  # The loss counts model tokens only: the mean trained length excludes tool-response tokens.
  assert length == pytest.approx(traj.model_mask.sum() / 4)
  assert traj.model_mask.sum() < traj.context_mask.sum()


def test_trainer_runs_multi_turn_steps(tmp_path):
  """The trainer's multi-turn step end to end (tiny random model, python format): the engine is
  given a script so that rows 0 and 2 run a code cell; the per-trajectory `tool_use` component
  sees their calls, and the update trains on the trajectories. The runner's step reports the
  trajectories it trained on (StepOutput.info)."""
  from models_testlib import tiny_retool_config

  from rljax.trainer.loop import Trainer
  c = tiny_retool_config(tmp_path)
  c.rewards.components = [dict(name="correct", verifier="arithmetic", weight=1.0),
                          dict(name="tools", verifier="tool_use", weight=0.5, kwargs=dict(per_call=1.0))]
  trainer = Trainer(c)
  try:
    producer = trainer.runner.producer
    engine = producer.tools
    cell = trainer.tokenizer.encode("```python\nprint(6*7)\n```")
    scripted = ToolRollout(engine.config, engine.tokenizer, engine.runner, engine.sp, engine.tp, fmt="python",
                           eos_ids=engine.stop_ids, draw=ScriptedDraw.of({(0, 0): cell, (2, 0): cell}))
    trainer.runner.producer = ToolProducer(scripted, trainer.mesh, trainer.batch_rows)
    trainer.state, out = trainer.runner.step(trainer.state, trainer.feed)
    m = trainer.host_metrics(out)
    traj = out.info.trajectories
  finally:
    trainer.close()
  assert traj.turns.tolist() == [1, 0, 1, 0]
  text = trainer.tokenizer.decode(traj.tokens[0, :traj.lengths[0]].tolist())
  assert "<interpreter>\n42\n</interpreter>" in text
  assert m["tools/calls"] == 2.0 and m["tools/errors"] == 0.0
  assert m["reward/tools_mean"] == pytest.approx(0.5)      # 2 of 4 trajectories made one call
  assert np.isfinite(m["loss"]) and m["tools/segments"] >= 2
  assert m["response_length_mean"] < traj.lengths.mean()   # the loss counts model tokens only


def test_evaluation_scores_trajectories_with_tool_output(policy, runner, tmp_path):
  """`evaluate_policy` (the trainer's eval and `rljax eval --tools`) with a scripted engine: the
  first completion of every example runs a cell, the verifier sees the interpreter's output in
  the completion, and the per-example tool counts add up to the printed rate."""
  from rljax.data import build_dataset
  from rljax.rewards import RewardPool, RewardSpec
  from rljax.trainer.evaluate import evaluate_policy
  tok = policy.tokenizer
  dataset = build_dataset({"sources": [{"kind": "arithmetic", "difficulty": 1}], "max_prompt_tokens": 64,
                           "shuffle": False}, split="test")
  cell = tok.encode("```python\nprint(6*7)\n```")

  def tool_rollout(sp):
    return scripted_tool_rollout(policy.config, tok, runner, sp, {(r, 0): cell for r in range(0, 4, 2)}, fmt="python",
                                 segment_tokens=8, max_turns=2)

  sp = SamplingParams(num_samples=2, max_new_tokens=40, temperature=1.0, stop_token_ids=tuple(tok.stop_ids))
  spec = RewardSpec.from_dict({"components": [{"name": "correct", "verifier": "arithmetic", "weight": 1.0}],
                               "num_workers": 1})
  with RewardPool(spec) as pool:
    m = evaluate_policy(policy.config, policy.params, tok, dataset, pool, num_examples=4, samples=2, sampling=sp,
                        max_prompt_tokens=64, batch_prompts=2, out_path=str(tmp_path / "eval.jsonl"),
                        tool_rollout=tool_rollout, prompt_tools=None)
  rows = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
  assert m["num_examples"] == 4.0 and len(rows) == 4
  for r in rows:
    assert r["tool_calls"] == [1, 0] and r["tool_errors"] == [0, 0]
    assert "<interpreter>\n42\n</interpreter>" in r["completions"][0]
    assert "<interpreter>" not in r["completions"][1]
  assert m["tool_calls_per_completion"] == pytest.approx(0.5) and m["tool_error_rate"] == 0.0


def test_tools_config_errors():
  from rljax.config import validate
  from rljax.errors import ConfigError
  c = base_config()
  c.tools.enabled = True
  c.tools.format = "python"
  c.tools.names = ["calculator"]
  with pytest.raises(ConfigError, match="format='python'"):
    validate(c)
  c.tools.format = "hermes"
  for mode in ("fused", "async", "partial"):   # multi-turn generation is the pipelined mode's producer
    c.rollout.mode = mode
    with pytest.raises(ConfigError, match="rollout.mode='pipelined'"):
      validate(c)
  c.rollout.mode = "pipelined"
  c.tools.max_turns = 0
  with pytest.raises(ConfigError, match="tools.max_turns"):
    validate(c)


def test_prompts_show_the_tools(policy):
  """Templates that render tools= get them; SmolLM2's ignores them, so a Hermes-style block goes into
  the system prompt instead."""
  from rljax.data.batching import render_prompt, template_renders_tools
  from rljax.tokenizer import Tokenizer
  tok = policy.tokenizer
  schemas = ToolRunner(["calculator"], num_workers=0).schemas()
  example = {"prompt_messages": [{"role": "user", "content": "2+2?"}]}
  assert not template_renders_tools(tok)
  text = render_prompt(example, tok, True, schemas)
  assert text.startswith("<|im_start|>system\nYou can call tools") and '"name": "calculator"' in text
  own = Tokenizer(tok.backend, chat_template="{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}"
                  "{% for m in messages %}{{ m.content }}{% endfor %}")
  assert template_renders_tools(own)
  assert render_prompt(example, own, True, schemas) == "TOOL calculator\n2+2?"
  assert "<tools>" in render_prompt(example, own, False, schemas)     # no chat template: the block
