"""`remote_judge`: a judge model behind an OpenAI-compatible HTTP endpoint (vLLM, SGLang, TGI, a
hosted API), called from the verifier pool's workers (standard library only: http.client).

    {"name": "judge", "verifier": "remote_judge", "kwargs": {
        "base_url": "http://127.0.0.1:8000/v1", "model": "Qwen/Qwen2.5-7B-Instruct",
        "template": "Question: {prompt}\\nAnswer: {completion}\\nIs the answer correct? Reply yes or no.",
        "api_key_env": "OPENAI_API_KEY", "max_concurrency": 16, "timeout_s": 30, "total_timeout_s": 100}}

A `batch` verifier: it gets the rows of the host's batch at once and sends them concurrently (at
most `max_concurrency` requests in flight; `endpoint="completions"` with `batch_size > 1` sends
several prompts per request). Each call has a deadline (`timeout_s`, for the connection, the
request and every read); a call that times out, drops its connection, or gets a 5xx or 429 is
retried up to `max_retries` times, waiting `backoff_s * 2**attempt` (with jitter) between tries;
other 4xx answers and unparseable replies fail at once. An item whose calls all failed is an
`ItemFailure` (fallback score, counted in verifier/errors, the other items keep their scores);
`total_timeout_s` bounds the whole batch (items still unanswered then fail), and the pool's per-item
timeout and batch deadline still bound the worker: a judge never holds a step.

Replies are parsed as `parse="yes_no"` (1.0 when the reply starts with yes, 0.0 with no) or
`parse="number"` (the first number in the reply divided by `max_score`). Successful scores are
cached by the request (model, system, the templated prompt with the completion, sampling
settings): in the worker's memory, and in a SQLite file shared by the workers and by later runs
with `cache_path`.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import http.client
import json
import os
import random
import re
import sqlite3
import threading
import time
import urllib.parse
from typing import Any, Mapping, Sequence

from rljax.rewards.base import ItemFailure, RewardResult, register_verifier

_RETRY_STATUS = {429, 500, 502, 503, 504}
_CACHE: dict[str, float] = {}          # this worker's: the zygote starts it empty, each worker fills its own
_CACHE_MAX = 100_000
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
PARSERS = ("yes_no", "number")
ENDPOINTS = ("chat", "completions")


class _Retry(Exception):
  """A failure worth another try (timeout, dropped connection, 5xx, 429)."""


class _Fail(Exception):
  """A failure another try will not fix (4xx, a reply that does not parse)."""


def _fields(example: Any) -> dict[str, Any]:
  return {k: v for k, v in example.items() if isinstance(k, str)} if isinstance(example, Mapping) else {}


def _post(url: str, payload: dict, key: str | None, timeout_s: float) -> dict:
  """POSTs JSON and returns the decoded JSON reply; every socket operation (connect, send, each
  read) waits at most what is left of `timeout_s`."""
  deadline = time.monotonic() + timeout_s
  left = lambda: max(deadline - time.monotonic(), 0.001)   # noqa: E731
  u = urllib.parse.urlsplit(url)
  conn_cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
  conn = conn_cls(u.hostname, u.port, timeout=left())
  body = json.dumps(payload).encode()
  headers = {"Content-Type": "application/json", "Connection": "close"}
  if key:
    headers["Authorization"] = f"Bearer {key}"
  sock = resp = None
  try:
    conn.request("POST", u.path or "/", body, headers)
    sock = conn.sock          # the response takes it over (Connection: close): keep it to set its timeouts
    sock.settimeout(left())
    resp = conn.getresponse()
    data = bytearray()
    while True:
      if time.monotonic() >= deadline:
        raise _Retry(f"no complete reply within {timeout_s:g} s")
      sock.settimeout(left())
      chunk = resp.read1(65536)
      if not chunk:
        break
      data += chunk
    if resp.status in _RETRY_STATUS:
      raise _Retry(f"HTTP {resp.status}")
    if resp.status != 200:
      raise _Fail(f"HTTP {resp.status}: {bytes(data[:200]).decode('utf-8', 'replace')}")
    try:
      return json.loads(data)
    except ValueError:
      raise _Fail(f"the reply is not JSON: {bytes(data[:200])!r}") from None
  except (TimeoutError, OSError, http.client.HTTPException) as e:   # socket.timeout is TimeoutError
    raise _Retry(f"{type(e).__name__}: {e}") from None
  finally:   # every descriptor of the call is closed (the pool replaces a worker that leaks one)
    if resp is not None:
      resp.close()
    if sock is not None:
      sock.close()
    conn.close()


def _parse(text: str, parse: str, max_score: float) -> float:
  t = text.strip().lower()
  if parse == "yes_no":
    word = re.match(r"[a-z]+", t)
    if word and word.group(0) == "yes":
      return 1.0
    if word and word.group(0) == "no":
      return 0.0
    raise _Fail(f"the judge's reply does not start with yes or no: {text[:80]!r}")
  m = _NUMBER.search(t)
  if m is None:
    raise _Fail(f"the judge's reply holds no number: {text[:80]!r}")
  return float(m.group(0)) / max_score


class _SqliteCache:
  """A score cache in a SQLite file (opened per batch: no descriptor outlives the call)."""

  def __init__(self, path: str | None):
    self.path = path

  def get(self, keys: Sequence[str]) -> dict[str, float]:
    if not self.path or not keys or not os.path.exists(self.path):
      return {}
    with sqlite3.connect(self.path, timeout=5.0) as db:
      db.execute("CREATE TABLE IF NOT EXISTS judge (key TEXT PRIMARY KEY, score REAL)")
      out = {}
      for i in range(0, len(keys), 500):
        part = keys[i:i + 500]
        rows = db.execute(f"SELECT key, score FROM judge WHERE key IN ({','.join('?' * len(part))})", part)
        out.update(dict(rows.fetchall()))
    db.close()
    return out

  def put(self, scores: Mapping[str, float]) -> None:
    if not self.path or not scores:
      return
    with sqlite3.connect(self.path, timeout=5.0) as db:
      db.execute("CREATE TABLE IF NOT EXISTS judge (key TEXT PRIMARY KEY, score REAL)")
      db.executemany("INSERT OR REPLACE INTO judge VALUES (?, ?)", list(scores.items()))
    db.close()


def remote_judge(completions: list[str], examples: list[Any], *, base_url: str, model: str, template: str,
                 api_key_env: str | None = "OPENAI_API_KEY", system: str | None = None, parse: str = "yes_no",
                 max_score: float = 10.0, endpoint: str = "chat", batch_size: int = 1, max_concurrency: int = 8,
                 timeout_s: float = 30.0, max_retries: int = 3, backoff_s: float = 0.5,
                 total_timeout_s: float = 100.0, max_tokens: int = 8, temperature: float = 0.0,
                 cache_path: str | None = None) -> list[RewardResult | ItemFailure]:
  """Scores each completion with the judge behind `base_url` (module doc)."""
  start = time.monotonic()
  key = os.environ.get(api_key_env) if api_key_env else None
  texts = [template.format_map({**_fields(ex), "completion": c}) for c, ex in zip(completions, examples)]
  ids = [hashlib.sha256(json.dumps([base_url, model, endpoint, system, t, max_tokens, temperature, parse, max_score])
                        .encode()).hexdigest() for t in texts]
  results: list[Any] = [None] * len(texts)
  attempts = [0] * len(texts)
  disk = _SqliteCache(cache_path)
  known = {i: _CACHE[k] for i, k in enumerate(ids) if k in _CACHE}
  missing = [k for i, k in enumerate(ids) if i not in known]
  stored = disk.get(missing)
  for i, k in enumerate(ids):
    score = known.get(i, stored.get(k))
    if score is not None:
      results[i] = RewardResult(float(score), {"cached": 1, "attempts": 0})
  todo = [i for i, r in enumerate(results) if r is None]
  per = batch_size if endpoint == "completions" else 1
  chunks = [todo[j:j + per] for j in range(0, len(todo), per)]
  url = base_url.rstrip("/") + ("/chat/completions" if endpoint == "chat" else "/completions")
  stop = threading.Event()

  def call(items: list[int]) -> list[float]:
    if endpoint == "chat":
      messages = ([{"role": "system", "content": system}] if system else []) + \
          [{"role": "user", "content": texts[items[0]]}]
      payload = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature}
    else:
      prompts = [(system + "\n\n" if system else "") + texts[i] for i in items]
      payload = {"model": model, "prompt": prompts, "max_tokens": max_tokens, "temperature": temperature}
    for attempt in range(max_retries + 1):
      for i in items:
        attempts[i] = attempt + 1
      left = total_timeout_s - (time.monotonic() - start)
      if stop.is_set() or left <= 0:
        raise _Fail(f"total_timeout_s={total_timeout_s:g} reached")
      try:
        reply = _post(url, payload, key, min(timeout_s, left))
        choices = reply.get("choices") if isinstance(reply, dict) else None
        if not isinstance(choices, list) or len(choices) != len(items):
          raise _Fail(f"expected {len(items)} choices in the reply, got {reply!r:.200}")
        if endpoint == "chat":
          outs = [(c.get("message") or {}).get("content") for c in choices]
        else:
          outs = [c.get("text") for c in sorted(choices, key=lambda c: c.get("index", 0))]
        if not all(isinstance(o, str) for o in outs):
          raise _Fail(f"a choice has no text: {choices!r:.200}")
        return [_parse(o, parse, max_score) for o in outs]
      except _Retry as e:
        if attempt == max_retries:
          raise _Fail(f"{e} (after {attempt + 1} tries)") from None
        pause = backoff_s * (2 ** attempt) * (0.5 + random.random())
        if stop.wait(min(pause, max(total_timeout_s - (time.monotonic() - start), 0.0))):
          raise _Fail(f"total_timeout_s={total_timeout_s:g} reached") from None
    raise AssertionError("unreachable")

  fresh: dict[str, float] = {}
  pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(max_concurrency, len(chunks) or 1)))
  try:
    futures = {pool.submit(call, items): items for items in chunks}
    left = total_timeout_s - (time.monotonic() - start)
    done, pending = concurrent.futures.wait(futures, timeout=max(left, 0.0))
    stop.set()   # calls not finished by now stop at their next retry or read deadline
    for f, items in futures.items():
      if f in pending:
        for i in items:
          results[i] = ItemFailure(f"remote judge: no answer within total_timeout_s={total_timeout_s:g}")
        continue
      try:
        scores = f.result()
      except Exception as e:  # noqa: BLE001 - _Fail, or a reply of an unexpected shape
        for i in items:
          results[i] = ItemFailure(f"remote judge {url}: {e if isinstance(e, _Fail) else repr(e)}")
        continue
      for i, s in zip(items, scores):
        results[i] = RewardResult(s, {"cached": 0, "attempts": attempts[i]})
        fresh[ids[i]] = s
  finally:
    pool.shutdown(wait=True, cancel_futures=True)
  if len(_CACHE) + len(fresh) > _CACHE_MAX:
    _CACHE.clear()
  _CACHE.update(fresh)
  disk.put(fresh)
  return results


def _check(base_url: str = "", model: str = "", template: str = "", api_key_env: str | None = "OPENAI_API_KEY",
           parse: str = "yes_no", endpoint: str = "chat", batch_size: int = 1, max_concurrency: int = 8,
           timeout_s: float = 30.0, max_retries: int = 3, total_timeout_s: float = 100.0, max_score: float = 10.0,
           **_) -> None:
  u = urllib.parse.urlsplit(base_url or "")
  if u.scheme not in ("http", "https") or not u.hostname:
    raise ValueError(f"base_url={base_url!r} must be an http(s) URL of an OpenAI-compatible API, e.g. "
                     "'http://127.0.0.1:8000/v1'")
  if not model:
    raise ValueError("model= must name the judge model the endpoint serves")
  if "{completion}" not in (template or ""):
    raise ValueError(f"template={template!r} must contain {{completion}} (and may use {{prompt}}, {{answer}} or "
                     "other example fields)")
  if api_key_env and api_key_env not in os.environ:
    raise ValueError(f"api_key_env={api_key_env!r}: that environment variable is not set; export it, or pass "
                     "api_key_env=None for an endpoint without a key")
  if parse not in PARSERS:
    raise ValueError(f"parse={parse!r} is not one of {PARSERS}")
  if endpoint not in ENDPOINTS:
    raise ValueError(f"endpoint={endpoint!r} is not one of {ENDPOINTS}")
  if batch_size > 1 and endpoint != "completions":
    raise ValueError("batch_size > 1 needs endpoint='completions' (chat requests hold one conversation each)")
  for name, value in (("batch_size", batch_size), ("max_concurrency", max_concurrency),
                      ("max_retries", max_retries + 1)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{name} must be a positive integer, got {value!r}")
  if not 0 < timeout_s <= total_timeout_s:
    raise ValueError(f"need 0 < timeout_s ({timeout_s}) <= total_timeout_s ({total_timeout_s}); keep "
                     "total_timeout_s below rewards.batch_deadline_s so that a slow judge fails its items itself")
  if not max_score > 0:
    raise ValueError(f"max_score must be > 0, got {max_score!r}")


remote_judge.check_config = _check
register_verifier("remote_judge", remote_judge, kind="batch",
                  preload=("http.client", "json", "sqlite3", "concurrent.futures", "urllib.parse", "hashlib"))
