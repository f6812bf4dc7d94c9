"""rljax.tokenizer on sentencepiece vocabularies (.model files, HF dirs with tokenizer.model, `llama` GGUFs).

The reference is sentencepiece itself, on tiny models trained here in-process.
"""
import json
import random

import pytest
from test_tokenizer_corpus import corpus

from rljax.errors import TokenizerError
from rljax.tokenizer import load_tokenizer

spm = pytest.importorskip("sentencepiece")

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world", "tokenizer", "numbers",
         "日本語", "テキスト", "中文", "测试", "😀", "ünïcödé", "café", "naïve", "Привет", "мир",
         "x", "=", "+", "(", ")"]
CHAT_TEMPLATE = "{% for m in messages %}{{ bos_token }}[{{ m.role }}] {{ m.content }}{{ eos_token }}{% endfor %}"


def _training_lines():
  rng = random.Random(1)
  lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 15))) + f" {rng.randint(0, 99999)}"
           for _ in range(3000)]
  lines += [s.replace("\n", " ") for s in corpus(300, seed=5, specials=False)]
  return [line for line in lines if line.strip()]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  """Two tiny models: llama-like BPE (byte fallback, no normalization) and a default unigram (NFKC, unks)."""
  directory = tmp_path_factory.mktemp("spm")
  lines = _training_lines()
  common = dict(minloglevel=2, num_threads=1)
  spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(directory / "bpe"), vocab_size=400,
                                 model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
                                 remove_extra_whitespaces=False, split_digits=True, user_defined_symbols=["<tool>"],
                                 character_coverage=0.9995, **common)
  spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(directory / "uni"), vocab_size=300,
                                 model_type="unigram", character_coverage=0.98, **common)
  return {name: str(directory / f"{name}.model") for name in ("bpe", "uni")}


def _processor(path):
  return spm.SentencePieceProcessor(model_file=path)


def _path_score(processor, ids):
  return sum(processor.get_score(i) for i in ids)


def _equal_scores(processor, ids, other_ids):
  """Two unigram segmentations of the same text that score the same (a Viterbi tie)."""
  same_text = processor.decode(ids) == processor.decode(other_ids)
  return same_text and abs(_path_score(processor, ids) - _path_score(processor, other_ids)) < 1e-4


def test_bpe_matches_sentencepiece(models):
  processor, tok = _processor(models["bpe"]), load_tokenizer(models["bpe"])
  assert tok.vocab_size == processor.get_piece_size()
  for text in corpus(400, seed=3, specials=False):
    ids = processor.encode(text)
    assert tok.encode(text) == ids, text
    assert tok.decode(ids) == processor.decode(ids) == text, text  # identity normalization + byte fallback


def test_unigram_matches_sentencepiece(models):
  """Same ids, except where two segmentations score exactly the same (Viterbi ties may break either way)."""
  processor, tok = _processor(models["uni"]), load_tokenizer(models["uni"])
  ties = 0
  for text in corpus(400, seed=3, specials=False) + ["\u3000ideo\u3000space", "ＡＢＣ１２３ ﬁ", "  two  spaces  "]:
    expected, got = processor.encode(text), tok.encode(text)
    if got != expected:
      ties += 1
      assert _equal_scores(processor, got, expected), text
      continue
    if processor.unk_id() not in expected:
      assert tok.decode(got) == processor.decode(expected), text
  assert ties <= 3


def test_special_ids_and_pad_fallback(models):
  processor, tok = _processor(models["bpe"]), load_tokenizer(models["bpe"])
  assert (tok.bos_id, tok.eos_id, tok.unk_id) == (processor.bos_id(), processor.eos_id(), processor.unk_id())
  assert tok.pad_id == tok.eos_id  # the model defines no pad piece
  assert tok.stop_ids == [tok.eos_id]
  assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")  # a bare .model adds no BOS
  # Added tokens (user-defined and control) stay whole, and each text segment around them is encoded as if on
  # its own, dummy prefix included: llama.cpp's SPM rule and HF's Llama tokenizer.json ("legacy") rule.
  tool = tok.token_to_id("<tool>")
  assert tok.encode("call<tool> now") == tok.encode("call") + [tool] + tok.encode(" now")
  assert tok.encode("</s>") == [tok.eos_id]  # control tokens written in text map to their ids (transformers' way)


def test_hf_directory_with_tokenizer_model(models, tmp_path):
  (tmp_path / "tokenizer.model").write_bytes(open(models["bpe"], "rb").read())
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({
      "add_bos_token": True, "bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>",
      "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE}))
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
  tok = load_tokenizer(tmp_path)
  processor = _processor(models["bpe"])
  assert tok.encode("hi there", add_special_tokens=True) == [processor.bos_id()] + processor.encode("hi there")
  assert tok.pad_id == tok.vocab_size - 1  # "<pad>" was not in the model: added, like transformers does
  assert tok.stop_ids == [2, 3]
  rendered = tok.apply_chat_template([{"role": "user", "content": "yo"}], tokenize=False)
  assert rendered == "<s>[user] yo</s>"


def _write_llama_gguf(path, model_path):
  gguf = pytest.importorskip("gguf")
  processor = _processor(model_path)
  size = processor.get_piece_size()

  def kind(i):
    checks = [(processor.is_unknown, 2), (processor.is_control, 3), (processor.is_byte, 6), (processor.is_unused, 5)]
    return next((k for check, k in checks if check(i)), 4 if processor.id_to_piece(i) == "<tool>" else 1)

  writer = gguf.GGUFWriter(str(path), "llama")
  writer.add_tokenizer_model("llama")
  writer.add_token_list([processor.id_to_piece(i) for i in range(size)])
  writer.add_token_scores([processor.get_score(i) for i in range(size)])
  writer.add_token_types([kind(i) for i in range(size)])
  writer.add_bos_token_id(processor.bos_id())
  writer.add_eos_token_id(processor.eos_id())
  writer.add_unk_token_id(processor.unk_id())
  writer.add_chat_template(CHAT_TEMPLATE)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_ti_data_to_file()
  writer.close()


def test_llama_gguf_matches_sentencepiece(models, tmp_path):
  _write_llama_gguf(tmp_path / "spm.gguf", models["bpe"])
  processor, tok = _processor(models["bpe"]), load_tokenizer(tmp_path / "spm.gguf")
  for text in corpus(300, seed=6, specials=False):
    ids = processor.encode(text)
    assert tok.encode(text) == ids, text
    assert tok.decode(ids) == processor.decode(ids), text
  assert tok.encode("hi", add_special_tokens=True) == [processor.bos_id()] + processor.encode("hi")  # GGUF default
  assert tok.apply_chat_template([{"role": "user", "content": "a"}]) == "<s>[user] a</s>"


def test_save_loads_in_transformers(models, tmp_path):
  transformers = pytest.importorskip("transformers")
  for name, path in models.items():
    tok = load_tokenizer(path)
    directory = tok.save(tmp_path / name)
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    again = load_tokenizer(directory)
    processor = _processor(path)
    for text in corpus(200, seed=7):
      ids = tok.encode(text)
      for other in (theirs.encode(text, add_special_tokens=False), again.encode(text)):
        assert other == ids or (name == "uni" and _equal_scores(processor, other, ids)), (name, text)
      for skip in (True, False):
        expected = theirs.decode(ids, skip_special_tokens=skip)
        assert tok.decode(ids, skip) == again.decode(ids, skip) == expected, (name, text)


def test_bad_sentencepiece_files(models, tmp_path):
  (tmp_path / "junk.model").write_bytes(b"not a sentencepiece model at all")
  with pytest.raises(TokenizerError, match="junk.model: not a sentencepiece model"):
    load_tokenizer(tmp_path / "junk.model")
  data = open(models["bpe"], "rb").read()
  (tmp_path / "cut.model").write_bytes(data[:len(data) // 2])
  with pytest.raises(TokenizerError, match="cut.model"):
    load_tokenizer(tmp_path / "cut.model")
  spm.SentencePieceTrainer.train(sentence_iterator=iter(_training_lines()[:200]), model_prefix=str(tmp_path / "word"),
                                 vocab_size=100, model_type="word", minloglevel=2, num_threads=1)
  with pytest.raises(TokenizerError, match="word.model: sentencepiece model type 3"):
    load_tokenizer(tmp_path / "word.model")
