"""The built-in tools: "calculator", "search" (BM25 over a local JSONL corpus) and "python".

Each returns the observation text, or raises ValueError / TimeoutError with a message
for the model (the executor turns exceptions into "Error: ..." observations).
"""
from __future__ import annotations

import ast
import json
import math
import operator
import os
import re
import secrets
import threading
from typing import Any, Callable, Sequence

import numpy as np

from rljax.rewards import sandbox
from rljax.tools.registry import register_tool

# ---- calculator ---------------------------------------------------------------------------------

MAX_EXPRESSION_CHARS = 500
MAX_RESULT_DIGITS = 1000
MAX_EXPONENT = 10_000
_MAX_BITS = int(MAX_RESULT_DIGITS * math.log2(10)) + 1

_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _log(x, base=None):
  return math.log(x) if base is None else math.log(x, base)


_FUNCS: dict[str, Callable[..., Any]] = {
    "sqrt": math.sqrt, "log": _log, "exp": math.exp, "sin": math.sin, "cos": math.cos, "tan": math.tan,
    "abs": abs, "round": round, "min": min, "max": max,
}
_CONSTS = {"pi": math.pi, "e": math.e}


def _check_size(value: Any) -> Any:
  if isinstance(value, complex):
    raise ValueError("the result is a complex number (e.g. a fractional power of a negative number)")
  if isinstance(value, int) and value.bit_length() > _MAX_BITS:
    raise ValueError(f"the result has more than {MAX_RESULT_DIGITS} digits")
  if isinstance(value, float) and not math.isfinite(value):
    raise ValueError("the result is not a finite number")
  return value


def _pow(base: Any, exp: Any) -> Any:
  if abs(exp) > MAX_EXPONENT:
    raise ValueError(f"the exponent {exp} is too large (at most {MAX_EXPONENT} in absolute value)")
  if isinstance(base, int) and isinstance(exp, int) and exp > 0 and abs(base) > 1:
    if exp * math.log10(abs(base)) > MAX_RESULT_DIGITS:
      raise ValueError(f"the result of {base}**{exp} would have more than {MAX_RESULT_DIGITS} digits")
  return base ** exp


def _eval_node(node: ast.AST) -> Any:
  if isinstance(node, ast.Expression):
    return _eval_node(node.body)
  if isinstance(node, ast.Constant):
    if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
      raise ValueError(f"only numbers are allowed, got {node.value!r}")
    return node.value
  if isinstance(node, ast.Name):
    if node.id in _CONSTS:
      return _CONSTS[node.id]
    raise ValueError(f"unknown name '{node.id}'; known constants are {sorted(_CONSTS)}")
  if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
    return _check_size(_UNARY[type(node.op)](_eval_node(node.operand)))
  if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
    left, right = _eval_node(node.left), _eval_node(node.right)
    if isinstance(node.op, ast.Pow):
      return _check_size(_pow(left, right))
    if isinstance(node.op, ast.Mult) and isinstance(left, int) and isinstance(right, int):
      if left.bit_length() + right.bit_length() > _MAX_BITS + 1:
        raise ValueError(f"the result would have more than {MAX_RESULT_DIGITS} digits")
    return _check_size(_BINOPS[type(node.op)](left, right))
  if isinstance(node, ast.Call):
    if not isinstance(node.func, ast.Name) or node.func.id not in _FUNCS:
      what = node.func.id if isinstance(node.func, ast.Name) else ast.dump(node.func)[:40]
      raise ValueError(f"unknown function '{what}'; allowed functions are {sorted(_FUNCS)}")
    if node.keywords:
      raise ValueError(f"{node.func.id}() takes positional arguments only")
    args = [_eval_node(a) for a in node.args]
    if node.func.id == "round" and len(args) == 2:
      if not isinstance(args[1], int) or abs(args[1]) > MAX_RESULT_DIGITS:
        raise ValueError(f"round(x, n) needs an integer n with |n| <= {MAX_RESULT_DIGITS}")
    return _check_size(_FUNCS[node.func.id](*args))
  kind = type(node).__name__
  raise ValueError(f"'{kind}' is not allowed; use numbers, + - * / // % **, parentheses, "
                   f"{', '.join(sorted(_FUNCS))}, pi and e")


def _format_number(value: Any) -> str:
  if isinstance(value, int):
    return str(value)
  if value.is_integer() and abs(value) < 1e15:
    return str(int(value))
  return f"{value:.15g}"


@register_tool(
    "calculator",
    description="Evaluates an arithmetic expression: numbers, + - * / // % ** and parentheses, the functions "
                "sqrt, log, exp, sin, cos, tan, abs, round, min, max, and the constants pi and e.",
    parameters={"type": "object",
                "properties": {"expression": {"type": "string",
                                              "description": "The expression, e.g. \"2**10 + sqrt(16)\"."}},
                "required": ["expression"]})
def calculator(expression: str) -> str:
  """The value of an arithmetic expression, as text.

  Only the `ast` node types listed in the description are evaluated (no eval/exec, no
  names besides pi and e); "^" is read as "**". Integer results are exact; floats are
  shown with 15 significant digits (an integral float without its ".0").

  Raises:
    ValueError: the expression is longer than MAX_EXPRESSION_CHARS, does not parse,
      uses anything else, divides by zero, or its result (or a power's exponent) is
      too large (more than MAX_RESULT_DIGITS digits, |exponent| > MAX_EXPONENT).
  """
  if not isinstance(expression, str):
    raise ValueError("the expression must be a string")
  if len(expression) > MAX_EXPRESSION_CHARS:
    raise ValueError(f"the expression is {len(expression)} characters long; at most {MAX_EXPRESSION_CHARS} "
                     "are allowed")
  text = expression.strip().replace("^", "**") if "^" in expression else expression.strip()
  if not text:
    raise ValueError("the expression is empty")
  try:
    tree = ast.parse(text, mode="eval")
  except SyntaxError as e:
    raise ValueError(f"the expression does not parse ({e.msg})") from None
  try:
    return _format_number(_eval_node(tree))
  except ZeroDivisionError:
    raise ValueError("division by zero") from None
  except OverflowError:
    raise ValueError("a number is too large to compute with") from None
  except RecursionError:
    raise ValueError("the expression is nested too deeply") from None
  except TypeError as e:
    raise ValueError(str(e)) from None


# ---- search (BM25) ------------------------------------------------------------------------------

_WORD = re.compile(r"\w+")


def tokenize(text: str) -> list[str]:
  """Lowercased word tokens (runs of letters, digits and '_')."""
  return _WORD.findall(text.lower())


class BM25Index:
  """Okapi BM25 over a list of texts.

      score(q, d) = sum over distinct terms t of q present in d of
                    idf(t) * tf(t, d) * (k1 + 1) / (tf(t, d) + k1 * (1 - b + b * |d| / avgdl))
      idf(t) = log((N - n(t) + 0.5) / (n(t) + 0.5) + 1)

  with N documents, n(t) of them containing t, |d| the token count of d and avgdl the
  mean |d|.
  """

  def __init__(self, texts: Sequence[str], k1: float = 1.5, b: float = 0.75):
    self.k1, self.b = float(k1), float(b)
    self.num_docs = len(texts)
    postings: dict[str, tuple[list[int], list[int]]] = {}
    lengths = np.zeros(self.num_docs, np.float64)
    for doc, text in enumerate(texts):
      tokens = tokenize(text)
      lengths[doc] = len(tokens)
      counts: dict[str, int] = {}
      for tok in tokens:
        counts[tok] = counts.get(tok, 0) + 1
      for tok, tf in counts.items():
        ids, tfs = postings.setdefault(tok, ([], []))
        ids.append(doc)
        tfs.append(tf)
    self.avgdl = float(lengths.mean()) if self.num_docs and lengths.mean() > 0 else 1.0
    self._norm = self.k1 * (1.0 - self.b + self.b * lengths / self.avgdl)
    self._postings = {t: (np.asarray(ids, np.int64), np.asarray(tfs, np.float64))
                      for t, (ids, tfs) in postings.items()}

  def idf(self, term: str) -> float:
    n = len(self._postings[term][0]) if term in self._postings else 0
    return math.log((self.num_docs - n + 0.5) / (n + 0.5) + 1.0)

  def scores(self, query: str) -> np.ndarray:
    """[N] BM25 score of every document for `query`."""
    out = np.zeros(self.num_docs, np.float64)
    for term in dict.fromkeys(tokenize(query)):
      if term not in self._postings:
        continue
      ids, tfs = self._postings[term]
      out[ids] += self.idf(term) * tfs * (self.k1 + 1.0) / (tfs + self._norm[ids])
    return out

  def top(self, query: str, k: int) -> list[tuple[int, float]]:
    """The (document index, score) of the best k documents with a score > 0, best first
    (ties: lower index first)."""
    s = self.scores(query)
    hits = np.flatnonzero(s > 0)
    order = hits[np.lexsort((hits, -s[hits]))][:k]
    return [(int(i), float(s[i])) for i in order]


class Corpus:
  """Documents of a JSONL file (one object per line) and their BM25 index over title + text."""

  def __init__(self, path: str, text_field: str = "text", title_field: str = "title"):
    self.path = path
    self.titles: list[str] = []
    self.texts: list[str] = []
    with open(path, encoding="utf-8") as f:
      for lineno, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          obj = json.loads(line)
        except json.JSONDecodeError as e:
          raise ValueError(f"search corpus {path}: line {lineno} is not valid JSON ({e.msg}).") from None
        if not isinstance(obj, dict) or not isinstance(obj.get(text_field), str):
          raise ValueError(f"search corpus {path}: line {lineno} has no string field '{text_field}'; set "
                           "text_field to the field that holds the document text.")
        title = obj.get(title_field)
        self.titles.append(title if isinstance(title, str) else "")
        self.texts.append(obj[text_field])
    if not self.texts:
      raise ValueError(f"search corpus {path} holds no documents.")
    self.index = BM25Index([f"{t} {x}" if t else x for t, x in zip(self.titles, self.texts)])


_CORPORA: dict[tuple[str, str, str], tuple[tuple[int, int], Corpus]] = {}
_CORPORA_LOCK = threading.Lock()


def load_corpus(corpus_path: str, text_field: str = "text", title_field: str = "title") -> Corpus:
  """The Corpus of a file, built once per process (rebuilt when the file changes)."""
  if not corpus_path or not isinstance(corpus_path, str):
    raise ValueError("the search tool has no corpus; set tool_kwargs={'search': {'corpus_path': "
                     "'path/to/corpus.jsonl'}}.")
  path = os.path.realpath(corpus_path)
  try:
    st = os.stat(path)
  except OSError:
    raise ValueError(f"search corpus {corpus_path} does not exist; set tool_kwargs['search']['corpus_path'] "
                     "to a JSONL file with one {\"title\": ..., \"text\": ...} object per line.") from None
  key, stamp = (path, text_field, title_field), (st.st_mtime_ns, st.st_size)
  with _CORPORA_LOCK:
    cached = _CORPORA.get(key)
    if cached is not None and cached[0] == stamp:
      return cached[1]
    corpus = Corpus(path, text_field, title_field)
    _CORPORA[key] = (stamp, corpus)
    return corpus


def _shorten(text: str, limit: int) -> str:
  text = " ".join(text.split())
  return text if len(text) <= limit else text[:limit].rstrip() + "..."


MAX_K = 10


def make_search(corpus_path: str, text_field: str = "text", title_field: str = "title",
                snippet_chars: int = 300) -> Callable[..., str]:
  """A search(query, k=3) -> str function over a JSONL corpus (loaded now, cached per process).

  The result lists the top k documents as numbered lines "1. <title>: <text>", the text
  whitespace-collapsed and cut to `snippet_chars`; or a line saying nothing matched.

  Raises:
    ValueError: the file is missing, empty, or a line is not a JSON object with `text_field`.
  """
  corpus = load_corpus(corpus_path, text_field, title_field)

  def search_corpus(query: str, k: int = 3) -> str:
    if not tokenize(query):
      raise ValueError("the query has no words to search for")
    k = max(1, min(int(k), MAX_K))
    hits = corpus.index.top(query, k)
    if not hits:
      return f"No results for {query!r}."
    lines = []
    for rank, (doc, _) in enumerate(hits, 1):
      title, text = corpus.titles[doc], _shorten(corpus.texts[doc], snippet_chars)
      lines.append(f"{rank}. {_shorten(title, 100)}: {text}" if title else f"{rank}. {text}")
    return "\n".join(lines)

  return search_corpus


@register_tool(
    "search",
    description="Searches a document collection and returns the best matching documents.",
    parameters={"type": "object",
                "properties": {"query": {"type": "string", "description": "Keywords to search for."},
                               "k": {"type": "integer", "description": "How many documents to return.",
                                     "minimum": 1, "maximum": MAX_K}},
                "required": ["query"]})
def search(query: str, k: int = 3, *, corpus_path: str | None = None, text_field: str = "text",
           title_field: str = "title") -> str:
  """The top k documents of the configured corpus for `query` (see make_search).

  `corpus_path`, `text_field` and `title_field` come from the run's tool_kwargs["search"].
  """
  return make_search(corpus_path, text_field, title_field)(query, k)


def _search_check(corpus_path: str | None = None, text_field: str = "text", title_field: str = "title") -> None:
  if not corpus_path:
    raise ValueError("the search tool needs a corpus: set tool_kwargs={'search': {'corpus_path': "
                     "'path/to/corpus.jsonl'}}.")
  if not os.path.isfile(corpus_path):
    raise ValueError(f"search corpus {corpus_path} does not exist or is not a file.")


search.check_config = _search_check  # type: ignore[attr-defined]
search.warmup = load_corpus  # type: ignore[attr-defined]  # builds the index once, before workers fork


# ---- python -------------------------------------------------------------------------------------

_HARNESS = r'''
import ast as _ast, builtins as _builtins, random as _random, sys as _sys, traceback as _tb


class _Null:
  def write(self, s):
    return len(s)

  def flush(self):
    pass


def _rljax_main(cells, cell, nonce):
  ns = {"__name__": "__main__", "__builtins__": _builtins}
  _random.seed(0)
  out, err = _sys.stdout, _sys.stderr
  for src in cells:
    _sys.stdout = _sys.stderr = _Null()
    try:
      exec(compile(src, "<cell>", "exec"), ns)
    except BaseException:
      pass
    finally:
      _sys.stdout, _sys.stderr = out, err
  _sys.stderr = out
  try:
    tree = _ast.parse(cell, "<cell>", "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], _ast.Expr):
      last = _ast.Expression(tree.body.pop().value)
    exec(compile(tree, "<cell>", "exec"), ns)
    if last is not None:
      value = eval(compile(last, "<cell>", "eval"), ns)
      if value is not None:
        print(repr(value))
  except BaseException as e:
    line = _tb.format_exception_only(type(e), e)[-1].strip()
    try:
      _sys.stdout.flush()
    except BaseException:
      pass
    err.write("\n" + nonce + " " + line + "\n")
    err.flush()
  finally:
    _sys.stderr = err
    out.flush()
'''


def _truncate(text: str, limit: int, more_unknown: bool = False) -> str:
  if len(text) <= limit and not more_unknown:
    return text
  extra = "" if more_unknown else f": {len(text) - limit} more characters"
  return text[:limit] + f"\n... [output truncated{extra}]"


@register_tool(
    "python",
    description="Runs Python code in a sandboxed interpreter without network access. Variables, functions and "
                "imports persist across calls. Returns what the code prints and the value of its last expression.",
    parameters={"type": "object",
                "properties": {"code": {"type": "string", "description": "Python code to run."}},
                "required": ["code"]})
def python(code: str, history: Sequence[str] | None = None, *, timeout_s: float = 5.0, memory_mb: int = 512,
           max_output_chars: int = 2000) -> str:
  """Runs one notebook-like cell in the subprocess sandbox (rljax/rewards/sandbox.py).

  State is kept by REPLAY: there is no long-lived interpreter; each call starts a fresh
  one that first re-runs the trajectory's earlier cells (`history`, supplied by the
  executor) in order with their output discarded and their exceptions ignored, then runs
  `code`. So earlier cells' side effects happen again on every call (files written again,
  their time counts against timeout_s), and a cell that timed out should be left out of
  the history (it would time out again). `random` is seeded with 0 at the start of every
  run, so random values drawn in earlier cells are the same on replay.

  Returns:
    What `code` prints (stdout and stderr together), then repr() of the value of its last
    statement when that is an expression other than None (as in a notebook), then, if it
    raised, the last line of the traceback ("NameError: name 'x' is not defined").
    Cut to max_output_chars with a marker; "(no output)" when there is nothing.
  Raises:
    TimeoutError: the run (replay included) took longer than timeout_s.
    ValueError: `code` or `history` is not text.
  """
  if not isinstance(code, str):
    raise ValueError("code must be a string")
  cells = list(history or [])
  if not all(isinstance(c, str) for c in cells):
    raise ValueError("history must be a list of code strings")
  nonce = secrets.token_hex(8)
  program = _HARNESS + f"\n_rljax_main({cells!r}, {code!r}, {nonce!r})\n"
  limits = sandbox.SandboxLimits(timeout_s=float(timeout_s), memory_mb=int(memory_mb))
  res = sandbox.run_python(program, limits=limits)
  if res.timed_out:
    raise TimeoutError(f"timed out after {timeout_s:g} s")
  text = _truncate(res.stdout.rstrip("\n"), int(max_output_chars), more_unknown=res.truncated)
  error = None
  for line in res.stderr.splitlines():
    if line.startswith(nonce + " "):
      error = line[len(nonce) + 1:]
  if error is None and res.returncode != 0:
    if res.signal is not None:
      error = f"the interpreter was killed by signal {res.signal} (a CPU, memory or file size limit)"
    else:
      lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
      error = lines[-1].strip() if lines else f"the interpreter exited with code {res.returncode}"
  if error is not None:
    text = f"{text}\n{error}" if text else error
  return text if text else "(no output)"


def _python_check(timeout_s: float = 5.0, memory_mb: int = 512, max_output_chars: int = 2000) -> None:
  if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
    raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
  if isinstance(memory_mb, bool) or not isinstance(memory_mb, int) or memory_mb < 64:
    raise ValueError(f"memory_mb must be an int >= 64, got {memory_mb!r}")
  if isinstance(max_output_chars, bool) or not isinstance(max_output_chars, int) or max_output_chars < 1:
    raise ValueError(f"max_output_chars must be a positive int, got {max_output_chars!r}")


python.check_config = _python_check  # type: ignore[attr-defined]
python.warmup = lambda **_: sandbox.isolation()  # type: ignore[attr-defined]
