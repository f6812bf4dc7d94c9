"""Tools for multi-turn RL: the built-in tools, call parsing, schemas, and the ToolRunner under
hostile calls (hangs, crashes, malformed calls) in real worker processes."""
import json
import math
import os
import signal
import time

import pytest

from rljax.errors import ConfigError
from rljax.tools import (
  FORMATS,
  Observation,
  Tool,
  ToolCall,
  ToolRunner,
  end_markers,
  get_tool,
  list_tools,
  parse_tool_call,
  register_tool,
  validate_arguments,
)
from rljax.tools.builtin import BM25Index, calculator, load_corpus, make_search, python

# ---- test tools (module level: workers import them as "test_tools:<name>") ---------------------


def hang(seconds: float = 1e6):
  """Sleeps for a long time."""
  time.sleep(seconds)
  return "woke up"


def crash():
  """Kills the process it runs in."""
  os.kill(os.getpid(), signal.SIGKILL)


def echo(text, times: int = 1):
  """Repeats a text.

  More words that are not the description.
  """
  return " ".join([text] * times)


@register_tool("add_numbers", description="Adds two integers.",
               parameters={"type": "object",
                           "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "required": ["a", "b"]})
def add_numbers(a, b, *, offset=0):
  return a + b + offset


CORPUS = [
    {"title": "Paris", "text": "Paris is the capital of France, on the river Seine."},
    {"title": "Berlin", "text": "Berlin is the capital of Germany and its largest city."},
    {"title": "Tokyo", "text": "Tokyo is the capital of Japan. " + "It is very large. " * 40},
    {"title": "Seine", "text": "The Seine is a river in northern France."},
]


@pytest.fixture(scope="module")
def corpus_path(tmp_path_factory):
  path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
  path.write_text("\n".join(json.dumps(d) for d in CORPUS) + "\n")
  return str(path)


# ---- calculator -----------------------------------------------------------------------------------


def test_calculator_values():
  assert calculator("2**10 + sqrt(16)") == "1028"
  assert calculator("(3 + 4) * -2 // 3") == "-5"
  assert calculator("7 % 4 + max(1, 2, 3) - abs(-1)") == "5"
  assert float(calculator("2 * pi")) == pytest.approx(2 * math.pi)
  assert calculator("round(log(e**2), 6)") == "2"
  assert calculator("2^8") == "256"  # "^" is read as a power
  assert calculator("10**999") == "1" + "0" * 999


@pytest.mark.parametrize("expression, message", [
    ("1/0", "division by zero"),
    ("5 // (2 - 2)", "division by zero"),
    ("__import__('os')", "unknown function '__import__'"),
    ("(1).__class__", "not allowed"),
    ("x + 1", "unknown name 'x'"),
    ("'a' * 3", "only numbers"),
    ("9**9**9", "too large"),
    ("2**20000", "too large"),
    ("7**5000", "more than 1000 digits"),
    ("10**600 * 10**600", "more than 1000 digits"),
    ("(-8)**0.5", "complex"),
    ("round(5, -10**9)", "needs an integer n"),
    ("1 +", "does not parse"),
    ("1+" * 300 + "1", "at most 500"),
])
def test_calculator_refuses(expression, message):
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("*", r"\*")):
    calculator(expression)


# ---- search (BM25) ------------------------------------------------------------------------------


def test_bm25_matches_closed_form():
  texts = ["cat dog", "cat cat mouse", "bird", "dog dog dog dog"]
  index = BM25Index(texts, k1=1.5, b=0.75)
  n_docs, avgdl, k1, b = 4, (2 + 3 + 1 + 4) / 4, 1.5, 0.75

  def term(n, tf, dl):
    idf = math.log((n_docs - n + 0.5) / (n + 0.5) + 1)
    return idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * dl / avgdl))

  got = index.scores("Cat, DOG!")
  want = [term(2, 1, 2) + term(2, 1, 2), term(2, 2, 3), 0.0, term(2, 4, 4)]
  assert got == pytest.approx(want, rel=1e-12)
  top = index.top("cat dog", 10)
  assert [i for i, _ in top] == sorted([0, 1, 3], key=lambda i: -want[i])  # doc 2 has no query word
  assert [s for _, s in top] == pytest.approx(sorted([want[0], want[1], want[3]], reverse=True))
  assert len(index.top("cat dog", 2)) == 2
  assert index.top("zebra", 5) == []


def test_search_ranks_relevant_document_first(corpus_path):
  search = make_search(corpus_path)
  lines = search("capital of Germany", k=2).splitlines()
  assert len(lines) == 2
  assert lines[0].startswith("1. Berlin: Berlin is the capital of Germany")
  assert lines[1].startswith("2. ")
  assert len(search("river France", k=10).splitlines()) == 2  # only documents with a query word are listed
  top = search("river Seine", k=1)
  assert top.startswith("1. Seine:") and "\n" not in top
  tokyo = search("Tokyo Japan", k=1)
  assert tokyo.endswith("...") and len(tokyo) < 330  # the long text is cut to ~300 characters
  assert search("zebra", k=3) == "No results for 'zebra'."
  with pytest.raises(ValueError, match="no words"):
    search("?!", k=1)
  # The registered tool reads the corpus from its configuration; the index is built once per file version.
  assert get_tool("search").fn("capital of Germany", 1, corpus_path=corpus_path).startswith("1. Berlin")
  assert load_corpus(corpus_path) is load_corpus(corpus_path)


def test_search_index_follows_file_changes(tmp_path):
  path = tmp_path / "c.jsonl"
  path.write_text(json.dumps({"text": "apples"}) + "\n")
  first = load_corpus(str(path))
  path.write_text(json.dumps({"text": "apples"}) + "\n" + json.dumps({"title": "B", "text": "bananas"}) + "\n")
  assert load_corpus(str(path)) is not first
  assert make_search(str(path))("bananas") == "1. B: bananas"


def test_search_corpus_errors(tmp_path):
  with pytest.raises(ValueError, match="does not exist"):
    make_search(str(tmp_path / "missing.jsonl"))
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"text": "ok"}\n{"body": "no text field"}\n')
  with pytest.raises(ValueError, match="line 2 has no string field 'text'"):
    make_search(str(bad))
  with pytest.raises(ConfigError, match="corpus_path"):
    ToolRunner(["search"], num_workers=0)


# ---- python ---------------------------------------------------------------------------------------


def test_python_state_output_and_errors():
  assert python("x = 21") == "(no output)"
  assert python("print(x * 2)", history=["x = 21"]) == "42"
  # Replay: earlier cells' output is hidden, their errors ignored, their state kept.
  assert python("x + y", history=["print('hidden'); x = 20", "1/0", "y = 2"]) == "22"
  assert python("def f(n):\n  return n * n\nf(12)") == "144"
  assert python("None") == "(no output)"
  out = python("print('before')\n1 / 0")
  assert out == "before\nZeroDivisionError: division by zero"
  assert python("print(x)") == "NameError: name 'x' is not defined"
  # `random` is seeded per run, so a value drawn in an earlier cell is the same on replay.
  first = python("import random\nr = random.random()\nr")
  assert python("r", history=["import random\nr = random.random()"]) == first
  long = python("print('a' * 5000)")
  assert long.startswith("a" * 2000) and "output truncated: 3000 more characters" in long


def test_python_timeout():
  start = time.monotonic()
  with pytest.raises(TimeoutError, match="timed out after 1 s"):
    python("while True:\n  pass", timeout_s=1.0)
  assert time.monotonic() - start < 5


# ---- parsing --------------------------------------------------------------------------------------


def test_parse_hermes():
  text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>'
  assert parse_tool_call(text, "hermes") == ToolCall("calculator", {"expression": "1+1"})
  as_string = '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"x\\", \\"k\\": 2}"}</tool_call>'
  assert parse_tool_call(as_string, "hermes") == ToolCall("search", {"query": "x", "k": 2})
  two = ('<tool_call>{"name": "a", "arguments": {}}</tool_call> then '
         '<tool_call>{"name": "b", "arguments": {"v": 1}}</tool_call>')
  assert parse_tool_call(two, "hermes") == ToolCall("b", {"v": 1})
  assert parse_tool_call("The answer is 4.", "hermes") is None
  assert parse_tool_call('<tool_call>{"name": "a", "argu', "hermes") is None  # still generating
  bad = parse_tool_call('<tool_call>{"name": "calculator", "arguments": {"expression": }</tool_call>', "hermes")
  assert bad.error is not None and "not valid JSON" in bad.error and bad.arguments == {}
  no_name = parse_tool_call('<tool_call>{"arguments": {}}</tool_call>', "hermes")
  assert no_name.name == "" and "name" in no_name.error
  not_obj = parse_tool_call('<tool_call>{"name": "calc", "arguments": [1, 2]}</tool_call>', "hermes")
  assert not_obj.name == "calc" and "must be a JSON object" in not_obj.error
  bad_string = parse_tool_call('<tool_call>{"name": "calc", "arguments": "{oops"}</tool_call>', "hermes")
  assert bad_string.name == "calc" and bad_string.error is not None
  assert parse_tool_call("<tool_call>[1]</tool_call>", "hermes").error is not None
  assert parse_tool_call("oops</tool_call>", "hermes").error is not None


def test_parse_python_and_markers():
  text = "First:\n```python\nx = 1\n```\nthen\n```bash\nls\n```\n```py\nprint(x)\n```\nDone."
  assert parse_tool_call(text, "python") == ToolCall("python", {"code": "print(x)\n"})
  assert parse_tool_call("Here:\n```python\nprint(1)\n", "python") is None
  assert parse_tool_call("```bash\nls\n```", "python") is None
  assert parse_tool_call("no code", "python") is None
  assert end_markers("hermes") == ("<tool_call>", "</tool_call>")
  assert end_markers("python") == ("```python", "```")
  assert FORMATS == ("hermes", "python")
  with pytest.raises(ConfigError, match="hermes"):
    parse_tool_call("x", "json")


# ---- registry and schemas -------------------------------------------------------------------------


def test_registry_and_schemas():
  assert {"calculator", "python", "search", "add_numbers"} <= set(list_tools())
  schema = get_tool("calculator").schema()
  assert schema["type"] == "function" and schema["function"]["name"] == "calculator"
  assert schema["function"]["parameters"]["required"] == ["expression"]
  tool = get_tool("test_tools:echo")
  assert tool.name == "echo" and tool.description == "Repeats a text."
  assert tool.parameters == {"type": "object",
                             "properties": {"text": {"type": "string"}, "times": {"type": "integer"}},
                             "required": ["text"]}
  assert get_tool("test_tools:add_numbers").name == "add_numbers"
  assert isinstance(get_tool("add_numbers"), Tool)
  with pytest.raises(ConfigError, match="registered tools are .*calculator"):
    get_tool("calculater")
  with pytest.raises(ConfigError, match="cannot import"):
    get_tool("no_such_module_xyz:f")
  with pytest.raises(ConfigError, match="already registered"):
    register_tool("calculator", description="x", parameters={"type": "object", "properties": {}})(echo)
  with pytest.raises(ConfigError, match="not in parameters"):
    register_tool("t2", description="x", parameters={"type": "object", "properties": {}, "required": ["a"]})


def test_validate_arguments():
  tool = get_tool("add_numbers")
  assert validate_arguments(tool, {"a": 1, "b": 2}) is None
  assert "missing required argument(s) 'b'" in validate_arguments(tool, {"a": 1})
  assert "no argument(s) 'c'" in validate_arguments(tool, {"a": 1, "b": 2, "c": 3})
  assert "must be of type integer, got string" in validate_arguments(tool, {"a": "1", "b": 2})
  assert "must be of type integer, got boolean" in validate_arguments(tool, {"a": True, "b": 2})
  assert "must be a JSON object" in validate_arguments(tool, [1, 2])
  search = get_tool("search")
  assert "must be <= 10" in validate_arguments(search, {"query": "x", "k": 50})
  assert "must be of type string" in validate_arguments(search, {"query": 3})


# ---- ToolRunner -----------------------------------------------------------------------------------


def test_runner_inline_config_and_timeout():
  with pytest.raises(ConfigError, match="unknown tool 'nope'"):
    ToolRunner(["calculator", "nope"], num_workers=0)
  with pytest.raises(ConfigError, match="not among the tools"):
    ToolRunner(["calculator"], num_workers=0, tool_kwargs={"python": {}})
  with pytest.raises(ConfigError, match="takes no configuration keyword"):
    ToolRunner(["add_numbers"], num_workers=0, tool_kwargs={"add_numbers": {"offst": 1}})
  with pytest.raises(ConfigError, match="timeout_s must be a positive"):
    ToolRunner(["python"], num_workers=0, tool_kwargs={"python": {"timeout_s": -1}})
  with pytest.raises(ConfigError, match="ToolRunner: timeout_s must be a positive"):
    ToolRunner(["calculator"], num_workers=0, timeout_s=0)
  with ToolRunner(["calculator", "add_numbers", "python"], num_workers=0,
                  tool_kwargs={"add_numbers": {"offset": 100}, "python": {"timeout_s": 1.0}}) as runner:
    assert [s["function"]["name"] for s in runner.schemas()] == ["calculator", "add_numbers", "python"]
    obs = runner.run([ToolCall("add_numbers", {"a": 1, "b": 2}), ToolCall("calculator", {"expression": "1/0"}),
                      ToolCall("python", {"code": "while True: pass"})])
    assert obs[0] == Observation("103", False, obs[0].seconds)
    assert obs[1].error and obs[1].text == "Error: division by zero"
    assert obs[2].error and obs[2].text == "Error: timed out after 1 s" and obs[2].seconds >= 1.0
    assert runner.metrics["calls"] == 3 and runner.metrics["errors"] == 2 and runner.metrics["timeouts"] == 1
    assert runner.run([]) == []
  with pytest.raises(RuntimeError, match="after close"):
    runner.run([ToolCall("calculator", {"expression": "1"})])


def test_runner_hostile_calls_in_workers(corpus_path):
  tools = ["calculator", "python", "search", "test_tools:hang", "test_tools:crash", "test_tools:echo"]
  runner = ToolRunner(tools, timeout_s=3.0, num_workers=2, max_memory_mb=2048,
                      tool_kwargs={"search": {"corpus_path": corpus_path}})
  try:
    zygote = runner.pool._zygote.proc
    calls = [
        parse_tool_call('<tool_call>{"name": "calculator", "arguments": {"expression": }</tool_call>', "hermes"),
        ToolCall("rm_rf", {"path": "/"}),
        ToolCall("calculator", {}),
        ToolCall("hang", {}),
        ToolCall("crash", {}),
        ToolCall("calculator", {"expression": "6 * 7"}),
        ToolCall("echo", {"text": "hi", "times": 3}),
        ToolCall("python", {"code": "print(x * 2)"}),
        ToolCall("search", {"query": "capital of Germany", "k": 1}),
    ]
    histories = [[] for _ in calls]
    histories[7] = ["x = 21"]
    start = time.monotonic()
    obs = runner.run(calls, histories)
    elapsed = time.monotonic() - start
    assert len(obs) == len(calls)
    assert obs[0].error and obs[0].text.startswith("Error: the <tool_call> block is not valid JSON")
    assert obs[1].error and obs[1].text.startswith("Error: unknown tool 'rm_rf'; available tools: calculator, crash")
    assert obs[2].error and "missing required argument(s) 'expression'" in obs[2].text
    assert obs[3].error and obs[3].text == "Error: tool 'hang' timed out after 3 s"
    assert obs[4].error and obs[4].text == "Error: tool 'crash' crashed"
    assert [o.text for o in obs[5:]] == ["42", "hi hi hi", "42", obs[8].text]
    assert obs[8].text.startswith("1. Berlin: Berlin is the capital of Germany")
    assert not any(o.error for o in obs[5:])
    assert elapsed < 20
    m = runner.metrics
    assert (m["calls"], m["errors"], m["parse_errors"], m["timeouts"], m["crashes"]) == (9, 5, 1, 1, 1)
    # The workers were replaced: the runner still works.
    again = runner.run([ToolCall("echo", {"text": "ok"}), ToolCall("calculator", {"expression": "2**5"}),
                        ToolCall("python", {"code": "x"})], [[], [], ["x = 'still here'"]])
    assert [(o.text, o.error) for o in again] == [("ok", False), ("32", False), ("'still here'", False)]
  finally:
    runner.close()
  assert zygote.poll() is not None


def test_runner_reports_broken_corpus_at_start(tmp_path):
  bad = tmp_path / "bad.jsonl"
  bad.write_text("not json\n")
  with pytest.raises(ConfigError, match="line 1 is not valid JSON"):
    ToolRunner(["search"], num_workers=1, tool_kwargs={"search": {"corpus_path": str(bad)}})
