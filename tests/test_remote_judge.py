"""The remote judge verifier against a real HTTP server on 127.0.0.1 started by the test (issue 35):
slow answers, 500s, dropped connections, a bad key, batching, the concurrency limit, the cache, and
the pool's deadlines when the server never answers. No other network, no mock client."""
import collections
import http.server
import json
import threading
import time

import numpy as np
import pytest

from rljax.errors import ConfigError
from rljax.rewards import RewardPool, RewardSpec

KEY = "sk-test-123"
TEMPLATE = "Q: {prompt}\nA: {completion}\nCorrect?"


class Judge(http.server.ThreadingHTTPServer):
  """An OpenAI-compatible judge whose behaviour the completion text picks (see `answer`)."""
  daemon_threads = True

  def __init__(self):
    super().__init__(("127.0.0.1", 0), Handler)
    self.lock = threading.Lock()
    self.requests = collections.Counter()     # completion marker -> requests
    self.paths = collections.Counter()
    self.inflight = self.max_inflight = 0

  def handle_error(self, request, client_address):
    pass   # a client that gave up (timed out) closed the socket we answer on: expected here

  @property
  def url(self):
    return f"http://127.0.0.1:{self.server_address[1]}/v1"


class Handler(http.server.BaseHTTPRequestHandler):
  def log_message(self, *args):
    pass

  def do_POST(self):
    srv = self.server
    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
    with srv.lock:
      srv.paths[self.path] += 1
      srv.inflight += 1
      srv.max_inflight = max(srv.max_inflight, srv.inflight)
    try:
      if self.headers.get("Authorization") != f"Bearer {KEY}":
        return self.reply(401, {"error": "bad key"})
      texts = ([m["content"] for m in body["messages"] if m["role"] == "user"] if "messages" in body
               else body["prompt"])
      markers = [t.split("A: ")[1].split("\n")[0] for t in texts]
      with srv.lock:
        counts = [srv.requests.__getitem__(m) for m in markers]
        srv.requests.update(markers)
      outs = []
      for m, seen in zip(markers, counts):
        if m == "hang":
          time.sleep(30)
        if m == "slow":
          time.sleep(2.0)
        if m == "err500" or (m == "flaky" and seen == 0):
          return self.reply(500, {"error": "overloaded"})
        if m == "dropall" or (m == "drop1" and seen == 0):
          self.close_connection = True
          self.connection.close()        # no status line at all
          return
        outs.append({"good": "Yes, it is.", "bad": "no", "garbage": "maybe"}.get(m.split("-")[0], "Yes"))
      time.sleep(0.15)                   # long enough for requests to overlap
      if "messages" in body:
        choices = [{"index": 0, "message": {"role": "assistant", "content": outs[0]}}]
      else:
        choices = [{"index": i, "text": " " + o} for i, o in enumerate(outs)][::-1]   # any order
      self.reply(200, {"choices": choices})
    finally:
      with srv.lock:
        srv.inflight -= 1

  def reply(self, status, obj):
    data = json.dumps(obj).encode()
    self.send_response(status)
    self.send_header("Content-Type", "application/json")
    self.send_header("Content-Length", str(len(data)))
    self.end_headers()
    self.wfile.write(data)


@pytest.fixture
def judge(monkeypatch):
  monkeypatch.setenv("JUDGE_KEY", KEY)
  srv = Judge()
  thread = threading.Thread(target=srv.serve_forever, daemon=True)
  thread.start()
  yield srv
  srv.shutdown()
  srv.server_close()


def _spec(judge, workers=1, pool_timeout=20.0, **kw):
  kwargs = dict(base_url=judge.url, model="judge-7b", template=TEMPLATE, api_key_env="JUDGE_KEY", timeout_s=0.5,
                max_retries=2, backoff_s=0.05, total_timeout_s=8.0, max_concurrency=3)
  kwargs.update(kw)
  return RewardSpec.from_dict({"components": [{"name": "judge", "verifier": "remote_judge", "kwargs": kwargs}],
                               "num_workers": workers, "timeout_s": pool_timeout, "batch_deadline_s": 60.0,
                               "fallback": -1.0})


def test_remote_judge_survives_a_misbehaving_server(judge):
  items = ["good-1", "bad-1", "flaky", "err500", "drop1", "dropall", "slow", "garbage", "good-2", "bad-2"]
  examples = [{"prompt": f"question {i}", "answer": "x"} for i in range(len(items))]
  with RewardPool(_spec(judge)) as pool:
    assert pool.containment is not None                      # scored in a worker process
    fast = pool.score([f"good-c{i}" for i in range(9)], examples[:9])
    assert fast.components["judge"].tolist() == [1.0] * 9
    assert 2 <= judge.max_inflight <= 3                       # concurrent, within max_concurrency=3
    out = pool.score(items, examples)
    again = pool.score(["good-1", "bad-1"], examples[:2])
  want = {"good-1": 1, "bad-1": 0, "flaky": 1, "drop1": 1, "good-2": 1, "bad-2": 0}
  got = dict(zip(items, out.components["judge"].tolist()))
  assert {k: got[k] for k in want} == want
  failed = dict(zip(items, out.failed["judge"].tolist()))
  assert [k for k, f in failed.items() if f] == ["err500", "dropall", "slow", "garbage"]
  assert all(got[k] == -1.0 for k in ("err500", "dropall", "slow", "garbage"))   # the fallback
  assert out.metrics["verifier/errors"] == 4 and out.metrics["verifier/failures"] == 4
  assert out.metrics["verifier/timeouts"] == 0 and out.metrics["verifier/crashes"] == 0
  infos = dict(zip(items, out.infos["judge"]))
  assert infos["flaky"]["attempts"] == 2 and infos["drop1"]["attempts"] == 2 and infos["good-1"]["attempts"] == 1
  assert "HTTP 500 (after 3 tries)" in infos["err500"]["message"]
  assert "does not start with yes or no" in infos["garbage"]["message"]
  # Retried up to max_retries=2 (3 tries) on 500s, drops and timeouts; not on a reply that does not parse.
  assert judge.requests["err500"] == 3 and judge.requests["dropall"] == 3 and judge.requests["garbage"] == 1
  assert judge.requests["slow"] == 3 and judge.requests["flaky"] == 2
  assert out.metrics["verifier/recycles"] == 0                # the judge leaves its worker as it found it
  # The second batch was answered from the cache: no new request.
  np.testing.assert_array_equal(again.components["judge"], [1.0, 0.0])
  assert [i["cached"] for i in again.infos["judge"]] == [1, 1] and judge.requests["good-1"] == 1


def test_batched_requests_disk_cache_and_a_bad_key(judge, tmp_path, monkeypatch):
  cache = str(tmp_path / "judge.sqlite")
  items = [f"good-{i}" if i % 2 else f"bad-{i}" for i in range(7)]
  examples = [{"prompt": "q"}] * len(items)
  spec = _spec(judge, endpoint="completions", batch_size=4, cache_path=cache)
  with RewardPool(spec) as pool:
    out = pool.score(items, examples)
  assert out.components["judge"].tolist() == [float(i % 2) for i in range(7)]
  assert judge.paths["/v1/completions"] == 2                  # 7 prompts, 4 per request
  with RewardPool(spec) as pool:                              # a new pool (new workers): the file cache answers
    again = pool.score(items, examples)
  assert again.components["judge"].tolist() == out.components["judge"].tolist()
  assert judge.paths["/v1/completions"] == 2
  monkeypatch.setenv("JUDGE_KEY", "wrong")
  with RewardPool(_spec(judge, max_retries=3)) as pool:
    bad = pool.score(["good-new"], [{"prompt": "q"}])
  assert bad.failed["judge"].tolist() == [True] and "HTTP 401" in bad.infos["judge"][0]["message"]
  assert judge.paths["/v1/chat/completions"] == 1             # a 4xx is not retried


def test_a_server_that_never_answers_cannot_hold_the_step(judge):
  """The judge's own limits set loose, the pool's per-item timeout ends the call: the batch
  returns with the fallback, counted as a timeout, and the pool still works."""
  spec = _spec(judge, pool_timeout=1.0, timeout_s=60.0, total_timeout_s=60.0)
  with RewardPool(spec) as pool:
    out = pool.score(["hang"], [{"prompt": "q"}])
    assert out.failed["judge"].tolist() == [True] and out.metrics["verifier/timeouts"] == 1
    ok = pool.score(["good-9"], [{"prompt": "q"}])
  assert ok.components["judge"].tolist() == [1.0]


@pytest.mark.parametrize("kwargs, match", [
    ({"base_url": "127.0.0.1:8000"}, r"base_url='127.0.0.1:8000' must be an http\(s\) URL"),
    ({"template": "{prompt}"}, r"template='{prompt}' must contain \{completion\}"),
    ({"api_key_env": "NO_SUCH_VARIABLE_RLJAX"}, r"api_key_env='NO_SUCH_VARIABLE_RLJAX': that environment variable"),
    ({"batch_size": 4}, r"batch_size > 1 needs endpoint='completions'"),
    ({"timeout_s": 10.0, "total_timeout_s": 5.0}, r"need 0 < timeout_s \(10.0\) <= total_timeout_s"),
    ({"parse": "json"}, r"parse='json' is not one of"),
])
def test_config_errors_name_the_option(judge, kwargs, match):
  with pytest.raises(ConfigError, match=r"components\[0\] \('judge'\).kwargs: " + match):
    _spec(judge, **kwargs)
