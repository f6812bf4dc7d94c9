"""`rljax export`, `rljax eval` and `rljax generate` as a new user meets them (issue 39, items 8 and
10): an export never overwrites silently, Hub ids get a way out, PEFT exports name a base peft can
load, `rljax eval` maps columns with its own flag, evaluates many prompts at once with the same
greedy results whatever the batch size, and reports tokens/s."""
import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from rljax import cli
from rljax.models.builtin import peft_base_name
from rljax.models.io import save_pretrained
from rljax.trainer.checkpoint import Checkpointer
from rljax.trainer.loop import load_policy
from rljax.trainer.state import TrainState

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """(a tiny random Llama as an HF directory with SmolLM2's tokenizer, a checkpoint of it)."""
  root = tmp_path_factory.mktemp("tiny")
  model = ml_collections.ConfigDict(dict(
      path="random", dtype="float32", remat=False, attention="xla", lora=dict(rank=0, alpha=16.0, targets=["q"]),
      random=dict(vocab_size=0, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, architecture="llama", tie_word_embeddings=True, seed=0)))
  policy = load_policy(model, "smollm2-135m-instruct")
  hf = str(root / "hf")
  save_pretrained(policy, hf, dtype="float32")
  params = jax.tree.map(np.asarray, policy.params)
  state = TrainState(step=jnp.int32(3), params=params, opt_state=(), rng=jnp.zeros(2, jnp.uint32), ref_params=None)
  ckpt = str(root / "ckpt")
  with Checkpointer(ckpt) as ck:
    ck.save(3, state, extras={"model_config": policy.config.to_hf(), "tokenizer": "smollm2-135m-instruct"})
  return hf, ckpt


def run(capsys, *argv):
  rc = cli.main(list(argv))
  out = capsys.readouterr()
  return rc, out.out, out.err


def test_export_refuses_files_and_used_directories_and_replaces_only_an_export(tiny, tmp_path, capsys):
  _, ckpt = tiny
  (tmp_path / "afile").write_text("x")
  rc, _, err = run(capsys, "export", "--checkpoint", ckpt, "--out", str(tmp_path / "afile"))
  assert rc == 1 and "--out" in err and "is a file" in err and "Traceback" not in err
  mine = tmp_path / "mine"
  mine.mkdir()
  (mine / "notes.txt").write_text("keep me")
  rc, _, err = run(capsys, "export", "--checkpoint", ckpt, "--out", str(mine))
  assert rc == 1 and "already holds files (notes.txt)" in err and "--overwrite" in err
  rc, _, err = run(capsys, "export", "--checkpoint", ckpt, "--out", str(mine), "--overwrite")
  assert rc == 1 and "no exported model" in err and (mine / "notes.txt").read_text() == "keep me"

  out = tmp_path / "model"
  assert run(capsys, "export", "--checkpoint", ckpt, "--out", str(out), "--dtype", "float32")[0] == 0
  (out / "marker").write_text("from the first export")
  rc, _, err = run(capsys, "export", "--checkpoint", ckpt, "--out", str(out))
  assert rc == 1 and "already holds files" in err
  rc, stdout, _ = run(capsys, "export", "--checkpoint", ckpt, "--out", str(out), "--overwrite")
  assert rc == 0 and stdout.strip() == str(out)
  assert sorted(os.listdir(out)) == sorted(set(os.listdir(out)) - {"marker"})   # replaced, not merged into
  assert (out / "config.json").exists() and not (out / "marker").exists()
  assert not any(p.name.endswith((".rljax-tmp", ".rljax-old")) for p in tmp_path.iterdir())


def test_hub_ids_and_peft_base_names(tmp_path, capsys, monkeypatch):
  rc, _, err = run(capsys, "generate", "--model", HUB_ID, "--prompt", "hi")
  assert rc == 1 and "looks like a Hugging Face Hub id" in err and f"huggingface-cli download {HUB_ID}" in err
  rc, _, err = run(capsys, "train", "--config", os.path.join(os.path.dirname(cli.__file__), "configs", "smoke.py"),
                   f"--config.model.path={HUB_ID}", f"--config.output.dir={tmp_path / 'run'}")
  assert rc == 1 and f"config.model.path='{HUB_ID}'" in err and "Hub id" in err and not (tmp_path / "run").exists()
  # What peft's AutoPeftModel loads the base from: the Hub id of a built-in, an absolute local path.
  assert peft_base_name("smollm2-135m-instruct") == HUB_ID
  (tmp_path / "base").mkdir()
  monkeypatch.chdir(tmp_path)
  assert peft_base_name("base") == str(tmp_path / "base")


def test_eval_maps_columns_with_its_own_flag_and_batch_size_changes_nothing(tiny, tmp_path, capsys):
  """Item 8: greedy results are the same for any --batch-size (1 prompt, 5, all at once), and the
  result line reports generated tokens/s; item 10: --fields maps the columns, and a file without
  the default columns says so in `rljax eval`'s terms."""
  hf, _ = tiny
  data = tmp_path / "qa.jsonl"
  data.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "solution": str(2 * i)}) + "\n"
                          for i in range(12)))
  base = ["eval", "--model", hf, "--data", str(data), "--verifier", "arithmetic", "--num-examples", "12",
          "--max-new-tokens", "6", "--max-prompt-tokens", "64", "--quiet"]
  rc, _, err = run(capsys, *base[:-1], "--verifier", "exactt", "--fields", '{"prompt": "question", "answer": '
                                                                           '"solution"}')
  assert rc == 1 and "--verifier exactt: unknown verifier" in err   # before the model loads
  rc, _, err = run(capsys, *base, "--out", str(tmp_path / "e.jsonl"))
  assert rc == 1 and f"--data {data}" in err and "--fields" in err and "data.sources[0]" not in err, err
  assert "fields={" not in err and """e.g. --fields '{"prompt": "question", "answer": "answer"}'""" in err
  results = {}
  for size in (1, 5, 64):
    out = tmp_path / f"e{size}.jsonl"
    rc, stdout, err = run(capsys, *base, "--fields", '{"prompt": "question", "answer": "solution"}',
                          "--batch-size", str(size), "--out", str(out))
    assert rc == 0, err
    assert "scoring" not in err                            # --quiet: no status lines, no bar
    assert "generated tokens/s" in stdout
    metrics = json.loads(stdout[:stdout.rindex("}") + 1])
    assert metrics["tokens_per_s"] > 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["answer"] for r in rows] == [str(2 * i) for i in range(12)]
    results[size] = ([r["completions"] for r in rows], {k: v for k, v in metrics.items()
                                                        if k not in ("tokens_per_s", "generate_seconds",
                                                                     "shared_prefix_tokens")})
    assert metrics["shared_prefix_tokens"] == (0 if size == 1 else 27)   # the chat template's system prompt
  assert results[1] == results[5] == results[64]
  assert any(c[0] for c in results[1][0])                  # the tiny model wrote something
