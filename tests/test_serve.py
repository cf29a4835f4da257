"""The OpenAI-compatible server on a tiny target with a chat tokenizer and a draft head, all made here:
completions and chat completions, streamed or not, through the ``openai`` package and raw HTTP, equal
the target's greedy tokens (``decode.reference``); sampled requests (their own temperature, top_p, top_k,
seed) beside greedy ones equal the engine's offline answers and repeat with their seed; concurrent streams
do not mix; a server compiled for one sampling setting refuses others; stop strings cut the text; a client that
leaves frees its slot; bad input gets a 4xx with an OpenAI-style body (written to
docs/serving_bad_input.md); SIGTERM drains the requests in flight and exits 0."""
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import jax
import numpy as np
import openai
import pytest

from jetspec_jax import convert, serve
from jetspec_jax.config import Qwen3Config
from jetspec_jax.decode.engine import Engine, EnginePlan, Request
from jetspec_jax.decode.reference import greedy
from jetspec_jax.decode.sampling import SamplingConfig
from jetspec_jax.decode.speculative import TreeConfig
from jetspec_jax.driver import Driver, Ticket
from jetspec_jax.models import draft_head, qwen3
from jetspec_jax.tokenizer import IM_END, chat_prompt_ids, load_tokenizer, train_chat_tokenizer
from jetspec_jax.train.pretrain import write_hf_directory

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "tiny"
WORDS = "the cat dog sat on a mat and ran to big small red blue house tree why how what is are you I we".split()
PROMPTS = ["the cat sat on", "why is the house red", "a big dog ran to the tree", "how are you"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  """A random target (vocabulary = the chat tokenizer's, EOS <|im_end|>) with its tokenizer, and a head."""
  root = tmp_path_factory.mktemp("serve_model")
  rng = np.random.default_rng(0)
  tok_dir = train_chat_tokenizer([" ".join(rng.choice(WORDS, 10)) for _ in range(300)], 320, str(root / "tok"))
  tok = load_tokenizer(tok_dir)
  cfg = Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10_000.0,
                    max_position_embeddings=1024, eos_token_ids=(tok.convert_tokens_to_ids(IM_END),))
  params = qwen3.init_target(cfg, jax.random.key(0))
  params = {k: np.asarray(v * 8 if v.ndim > 1 else v) for k, v in params.items()}   # varied continuations
  write_hf_directory(str(root / "target"), cfg, params, tokenizer_dir=tok_dir)
  head_cfg = draft_head.DraftConfig.for_target(cfg, num_layers=1, block_size=4)
  convert.save_head(str(root / "head"), head_cfg, draft_head.init_head(head_cfg, jax.random.key(1)))
  return str(root / "target"), str(root / "head")


REFERENCE_TOKENS = 120        # the most any test compares: one reference program per prompt width


@pytest.fixture(scope="module")
def reference(model_dir):
  """reference(prompt ids, max_tokens) -> the target's greedy tokens (``decode.reference``), ending at its EOS: the
  first max_tokens of one longer greedy run per prompt."""
  cfg, params, _ = convert.load_target(model_dir[0])
  run = functools.lru_cache(maxsize=None)(lambda ids: greedy(cfg, params, ids, REFERENCE_TOKENS, cfg.eos_token_ids))

  def tokens(ids, n):
    assert n <= REFERENCE_TOKENS
    return run(tuple(ids))[:n]
  return tokens


TREE = TreeConfig("best_nodes", 6, 2, 3)
PLAN = EnginePlan(slots=2, rows=2 * TREE.num_nodes(), lanes=1, prefill_rows=16, max_prompt=64, max_new_tokens=200,
                  queue=3, tree=TREE, per_request_sampling=True)


def speculative_engine(model_dir, plan=PLAN, **kw) -> Engine:
  cfg, params, _ = convert.load_target(model_dir[0])
  head_cfg, head_params = convert.load_head(model_dir[1], target_cfg=cfg)
  return Engine(cfg, params, plan, head_cfg=head_cfg, head_params=head_params, **kw)


@pytest.fixture(scope="module")
def server(model_dir):
  """A speculative server (2 slots, one round per segment, per-request sampling) in this process; yields
  (url, service, server)."""
  side = model_dir[0]
  engine = speculative_engine(model_dir)
  driver = Driver(engine, segment_rounds=1)
  driver.start()
  service = serve.Service(driver, load_tokenizer(side), MODEL)
  ready = threading.Event()
  urls = []
  srv = serve.make_server(service, "127.0.0.1", 0, drain_timeout=0.5,
                          on_ready=lambda url: (urls.append(url), ready.set()))
  thread = threading.Thread(target=srv.run, daemon=True)
  thread.start()
  assert ready.wait(60)
  yield urls[0], service, srv
  srv.should_exit = True
  driver.drain(0)
  thread.join(30)


def client(url):
  return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def expected(reference, tokenizer, ids, n):
  """(text, completion tokens, finish_reason) the server should answer with."""
  toks = reference(ids, n)
  eos = toks[-1] == tokenizer.convert_tokens_to_ids(IM_END)
  return tokenizer.decode(toks[:len(toks) - eos], skip_special_tokens=True), len(toks), "stop" if eos else "length"


def sse(lines) -> list[dict]:
  """The JSON events of a server-sent-event stream (ends at [DONE])."""
  out = []
  for line in lines:
    if line.startswith("data: "):
      if line == "data: [DONE]":
        return out
      out.append(json.loads(line[6:]))
  raise AssertionError("the stream ended without data: [DONE]")


def test_answers_equal_the_greedy_tokens(server, reference):
  url, service, _ = server
  tok = service.tokenizer
  api = client(url)
  assert [m.id for m in api.models.list().data] == [MODEL]
  for i, text in enumerate(PROMPTS[:2]):
    n = 12 + 3 * i
    want, count, finish = expected(reference, tok, tok.encode(text, add_special_tokens=False), n)
    r = api.completions.create(model=MODEL, prompt=text, max_tokens=n, temperature=0)
    assert (r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason) == (want, count, finish)
    chunks = list(api.completions.create(model=MODEL, prompt=text, max_tokens=n, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want and chunks[-1].choices[0].finish_reason == finish

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]
    want, count, finish = expected(reference, tok, chat_prompt_ids(tok, messages), n)
    r = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=n, seed=3)
    choice = r.choices[0]
    assert (choice.message.content, r.usage.completion_tokens, choice.finish_reason) == (want, count, finish)
    assert r.usage.prompt_tokens == len(chat_prompt_ids(tok, messages))
    chunks = list(api.chat.completions.create(model=MODEL, messages=messages, max_tokens=n, stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == count and chunks[-2].choices[0].finish_reason == finish

  ids = tok.encode(PROMPTS[2], add_special_tokens=False)          # raw HTTP, the prompt as token ids
  want, count, finish = expected(reference, tok, ids, 10)
  body = {"model": MODEL, "prompt": ids, "max_tokens": 10}
  r = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
  assert (r["choices"][0]["text"], r["usage"]["completion_tokens"]) == (want, count)
  with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as s:
    assert s.headers["content-type"].startswith("text/event-stream")
    events = sse(s.iter_lines())
  assert "".join(e["choices"][0]["text"] for e in events) == want
  assert httpx.get(f"{url}/health").json()["status"] == "ok"


def test_concurrent_streams_do_not_mix(server, reference):
  url, service, _ = server
  tok = service.tokenizer
  jobs = [(PROMPTS[i % 4] + " " + WORDS[i], 8 + 5 * i) for i in range(6)]   # 6 streams over 2 slots

  def stream(job):
    text, n = job
    with httpx.stream("POST", f"{url}/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": n,
                                                            "stream": True}, timeout=120) as s:
      timed = [(time.monotonic(), line) for line in s.iter_lines()]            # each line when it arrived
    return [(at, e["choices"][0]["text"]) for (at, _), e in zip([t for t in timed if t[1].startswith("data: {")],
                                                                 sse(line for _, line in timed))]

  with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
    got = list(pool.map(stream, jobs))
  for (text, n), events in zip(jobs, got):
    assert "".join(t for _, t in events) == expected(reference, tok, tok.encode(text, add_special_tokens=False), n)[0]
  spans = sorted((ev[0][0], ev[-1][0]) for ev in got)
  assert any(b[0] < a[1] for a, b in zip(spans, spans[1:]))             # some streams were open at once


def test_sampled_requests_follow_their_own_settings(server, model_dir, reference):
  """Greedy and sampled requests at once (streamed and not): each sampled answer equals the engine's offline
  tokens for its settings and key(seed), the same request again repeats it, and greedy equals the reference."""
  url, service, _ = server
  tok = service.tokenizer
  settings = [dict(temperature=1.5, top_p=0.9, seed=1), dict(temperature=2.0, top_k=5, seed=2),
              dict(temperature=1.5, top_p=0.9, seed=1), dict(temperature=0), dict(temperature=2.0, seed=3)]
  jobs = [(PROMPTS[i % 2], 24, kw, i % 2 == 1) for i, kw in enumerate(settings)]

  def ask(job):
    text, n, kw, stream = job
    api = client(url)
    kw = {k: v for k, v in kw.items() if k != "top_k"} | ({"extra_body": {"top_k": kw["top_k"]}} if "top_k" in kw else {})
    if not stream:
      return api.completions.create(model=MODEL, prompt=text, max_tokens=n, **kw).choices[0].text
    return "".join(c.choices[0].text for c in api.completions.create(model=MODEL, prompt=text, max_tokens=n,
                                                                      stream=True, **kw))

  with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
    got = list(pool.map(ask, jobs))
  ids = [tok.encode(text, add_special_tokens=False) for text, *_ in jobs]
  offline = speculative_engine(model_dir, dataclasses.replace(PLAN, queue=len(jobs))).run(
      [Request(i, n, jax.random.key(kw["seed"]), **{k: v for k, v in kw.items() if k != "seed"})
       for i, (_, n, kw, _) in zip(ids, jobs) if "seed" in kw]).results
  eos = tok.convert_tokens_to_ids(IM_END)
  sampled = [g for g, (_, _, kw, _) in zip(got, jobs) if "seed" in kw]
  assert sampled == [tok.decode([t for t in r.tokens if t != eos], skip_special_tokens=True) for r in offline]
  assert got[0] == got[2] and len(set(sampled)) == 3
  assert got[3] == expected(reference, tok, ids[3], 24)[0]


def test_a_server_compiled_for_one_setting_refuses_others(model_dir):
  """``serve --fixed-sampling``: a request may leave sampling out or send the server's values; others get 400."""
  fixed = dataclasses.replace(PLAN, per_request_sampling=False)
  engine = speculative_engine(model_dir, fixed, sampling_cfg=SamplingConfig(0.7, 0, 0.9))
  service = serve.Service(Driver(engine), load_tokenizer(model_dir[0]), MODEL)    # checks only: nothing runs
  for ok in ({}, {"temperature": 0.7}, {"temperature": 0.7, "top_p": 0.9, "top_k": 0}):
    assert service.job({**GOOD, **ok}, [1, 2], chat=False).sampling == {}
  for field, bad in (("temperature", 0.0), ("top_p", 0.5), ("top_k", 4)):
    with pytest.raises(serve.ApiError, match=f"{field} .* differs from this server's sampling") as e:
      service.job({**GOOD, field: bad}, [1, 2], chat=False)
    assert e.value.status == 400 and e.value.param == field


def test_stop_strings_cut_the_text(server, reference):
  url, service, _ = server
  tok = service.tokenizer
  ids = tok.encode(PROMPTS[3], add_special_tokens=False)
  full = expected(reference, tok, ids, 40)[0]
  stop = full[len(full) // 2:len(full) // 2 + 3]
  cut = full[:full.index(stop)]
  api = client(url)
  r = api.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=40, stop=[stop, "never seen"])
  assert (r.choices[0].text, r.choices[0].finish_reason) == (cut, "stop") and r.usage.completion_tokens < 40
  chunks = list(api.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=40, stop=stop, stream=True))
  assert "".join(c.choices[0].text for c in chunks) == cut and chunks[-1].choices[0].finish_reason == "stop"


def test_a_client_that_leaves_frees_its_slot(server, reference, monkeypatch):
  url, service, _ = server
  driver = service.driver
  # The non-streaming handler polls for a departed client; polled every 20 ms it notices long before 200 tokens
  # are done: each segment's dispatch is slowed by 20 ms, so that a busy machine (the event loop and the driver
  # thread share the interpreter) cannot finish the request first.
  monkeypatch.setattr(serve, "DISCONNECT_POLL_S", 0.02)
  dispatch = driver.engine.dispatch
  monkeypatch.setattr(driver.engine, "dispatch", lambda rounds: (time.sleep(0.02), dispatch(rounds))[1])

  def idle():
    deadline = time.monotonic() + 60
    while driver.outstanding() and time.monotonic() < deadline:
      time.sleep(0.05)
    return driver.cancelled

  before = idle()
  body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 200}
  with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as s:
    next(line for line in s.iter_lines() if line.startswith("data: "))           # one chunk, then hang up
  assert idle() == before + 1
  host, port = url.removeprefix("http://").split(":")
  with socket.create_connection((host, int(port))) as sock:                      # non-streaming: hang up waiting
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    deadline = time.monotonic() + 60
    while not driver.outstanding() and time.monotonic() < deadline:
      time.sleep(0.01)
  assert idle() == before + 2
  tok = service.tokenizer
  with concurrent.futures.ThreadPoolExecutor(2) as pool:                          # both slots serve again
    texts = list(pool.map(lambda p: client(url).completions.create(model=MODEL, prompt=p, max_tokens=6).choices[0].text,
                          PROMPTS[:2]))
  assert texts == [expected(reference, tok, tok.encode(p, add_special_tokens=False), 6)[0] for p in PROMPTS[:2]]


GOOD = {"model": MODEL, "prompt": "the cat", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BAD_INPUTS = [
    # (input, path, body (str: sent as is), status, param)
    ("malformed JSON", "/v1/completions", '{"model": "tiny", "prompt": ', 400, None),
    ("body not an object", "/v1/completions", "[1, 2]", 400, None),
    ("unknown model", "/v1/completions", {**GOOD, "model": "gpt-4"}, 404, "model"),
    ("no model", "/v1/chat/completions", {k: v for k, v in CHAT.items() if k != "model"}, 400, "model"),
    ("prompt longer than --max-prompt", "/v1/completions", {**GOOD, "prompt": list(range(1, 70))}, 400, "prompt"),
    ("max_tokens over --max-tokens", "/v1/completions", {**GOOD, "max_tokens": 201}, 400, "max_tokens"),
    ("max_tokens 0", "/v1/completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens -3", "/v1/chat/completions", {**CHAT, "max_tokens": -3}, 400, "max_tokens"),
    ("temperature 'hot'", "/v1/completions", {**GOOD, "temperature": "hot"}, 400, "temperature"),
    ("temperature -0.5", "/v1/completions", {**GOOD, "temperature": -0.5}, 400, "temperature"),
    ("top_p 0", "/v1/chat/completions", {**CHAT, "temperature": 0.5, "top_p": 0}, 400, "top_p"),
    ("top_k 2.5", "/v1/completions", {**GOOD, "temperature": 0.5, "top_k": 2.5}, 400, "top_k"),
    ("empty message list", "/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("message without a role", "/v1/chat/completions", {**CHAT, "messages": [{"content": "hi"}]}, 400, "messages[0]"),
    ("n = 2", "/v1/completions", {**GOOD, "n": 2}, 400, "n"),
    ("empty prompt", "/v1/completions", {**GOOD, "prompt": ""}, 400, "prompt"),
    ("token id outside the vocabulary", "/v1/completions", {**GOOD, "prompt": [1, 99999]}, 400, "prompt"),
    ("stop not a string", "/v1/completions", {**GOOD, "stop": 5}, 400, "stop"),
    ("seed not an integer", "/v1/completions", {**GOOD, "seed": "x"}, 400, "seed"),
    ("logprobs asked for", "/v1/completions", {**GOOD, "logprobs": 2}, 400, "logprobs"),
    ("frequency_penalty asked for", "/v1/completions", {**GOOD, "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ("unknown path", "/v1/embeddings", GOOD, 404, None),
    ("body over the size limit (1 MiB here)", "/v1/completions",
     json.dumps({**GOOD, "prompt": "a" * (1 << 20)}), 413, None),
]


def test_bad_input_gets_a_4xx_with_an_openai_error_body(server):
  url, service, _ = server
  rows = []
  for name, path, body, status, param in BAD_INPUTS:
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) else {"json": body}
    r = httpx.post(f"{url}{path}", timeout=30, **kw)
    err = r.json()["error"]
    assert r.status_code == status and err["param"] == param, (name, r.status_code, err)
    assert set(err) == {"message", "type", "param", "code"} and err["message"].strip(), name
    rows.append((name, path, status, json.dumps(r.json())))
  bound = service.driver.max_waiting
  service.driver.max_waiting = 0                            # the waiting list at its bound: every request is over it
  try:
    r = httpx.post(f"{url}/v1/completions", json=GOOD, timeout=30)
  finally:
    service.driver.max_waiting = bound
  assert r.status_code == 429 and r.headers["retry-after"] and r.json()["error"]["type"] == "rate_limit_error", r.text
  rows.append(("a request beyond --max-waiting waiting ones", "/v1/completions", 429, json.dumps(r.json())))
  r = client(url).completions.create(model=MODEL, prompt="the cat", max_tokens=3)          # nothing disturbed
  assert r.usage.completion_tokens == 3 and service.driver.outstanding() == 0
  table = ["| input | endpoint | status | body |", "| --- | --- | --- | --- |"]
  table += [f"| {n} | `{p}` | {s} | `{b.replace('|', '&#124;')}` |" for n, p, s, b in rows]
  text = ("Bad input to `jetspec-jax serve` (the speculative test server of tests/test_serve.py: greedy unless a "
          "request asks otherwise, --max-prompt 64, --max-tokens 200) and what it answers.\n\n" + "\n".join(table)
          + "\n")
  doc = os.path.join(REPO, "docs", "serving_bad_input.md")
  if os.environ.get("JETSPEC_WRITE_DOCS"):
    with open(doc, "w") as f:
      f.write(text)
  with open(doc) as f:
    assert f.read() == text, "docs/serving_bad_input.md is out of date: rerun this test with JETSPEC_WRITE_DOCS=1"


def test_overload_is_refused_with_429_and_retry_after(model_dir):
  """A driver at its waiting bound: the request gets 429 with Retry-After, before anything streams, and the
  refusal is counted in /metrics."""
  from fastapi.testclient import TestClient
  engine = speculative_engine(model_dir)
  service = serve.Service(Driver(engine, max_waiting=0), load_tokenizer(model_dir[0]), MODEL, retry_after=3)
  with TestClient(serve.create_app(service)) as http:
    for stream in (False, True):
      r = http.post("/v1/completions", json={**GOOD, "stream": stream})
      assert r.status_code == 429 and r.headers["retry-after"] == "3", r.text
      assert r.json()["error"]["code"] == "overloaded" and "serve --max-waiting" in r.json()["error"]["message"]
    metrics = http.get("/metrics").text
  assert 'jetspec_requests_total{outcome="refused"} 2.0' in metrics and service.driver.refused == 2


def test_a_request_past_the_timeout_gets_504_and_frees_its_slot(server):
  """A service with a 1 ms request timeout on the running server's driver: 504, and the request is cancelled."""
  from fastapi.testclient import TestClient
  _, service, _ = server
  quick = serve.Service(service.driver, service.tokenizer, MODEL, request_timeout=1e-3)
  with TestClient(serve.create_app(quick)) as http:
    r = http.post("/v1/completions", json={**GOOD, "max_tokens": 50})
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout", r.text
  deadline = time.monotonic() + 30
  while service.driver.outstanding() and time.monotonic() < deadline:
    time.sleep(0.05)
  assert service.driver.outstanding() == 0
  assert 'jetspec_requests_total{outcome="timeout"} 1.0' in quick.metrics.text().decode()


def test_metrics_in_prometheus_text_format(server):
  """GET /metrics after the requests above: outcomes, tokens, TTFT / TPOT histograms, occupancy, tau, KV pages,
  prefix-cached prompt rows (and the usage's cached_tokens), preemptions."""
  from prometheus_client.parser import text_string_to_metric_families
  url, service, _ = server
  client(url).completions.create(model=MODEL, prompt="the cat", max_tokens=5)
  # One prompt of more than a 16-row page twice: the second takes its first full pages from the prefix cache.
  prompt = [5 + i % 50 for i in range(40)]
  first, again = (client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=2) for _ in range(2))
  assert first.usage.prompt_tokens_details.cached_tokens == 0
  assert again.usage.prompt_tokens_details.cached_tokens == 32           # 2 of its (40 - 1) // 16 keyed pages
  families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text)}
  value = lambda family, sample, **labels: next(s.value for s in families[family].samples
                                                if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))
  assert value("jetspec_requests", "jetspec_requests_total", outcome="completed") >= 1
  assert value("jetspec_generated_tokens", "jetspec_generated_tokens_total") >= 5
  assert value("jetspec_time_to_first_token_seconds", "jetspec_time_to_first_token_seconds_count") >= 1
  assert value("jetspec_time_per_output_token_seconds", "jetspec_time_per_output_token_seconds_count") >= 1
  assert value("jetspec_requests_running", "jetspec_requests_running") == 0
  assert 0 <= value("jetspec_slot_occupancy", "jetspec_slot_occupancy") <= 1
  assert value("jetspec_tau", "jetspec_tau") >= 1.0          # committed tokens per decode round: at least the root's
  assert value("jetspec_kv_pages", "jetspec_kv_pages") == PLAN.pool_pages(service.driver.engine.head_cfg)
  assert value("jetspec_kv_pages_used", "jetspec_kv_pages_used") == 0 <= value("jetspec_kv_pages_cached",
                                                                                   "jetspec_kv_pages_cached")
  assert value("jetspec_prompt_tokens", "jetspec_prompt_tokens") >= 80
  assert value("jetspec_prefix_cached_tokens", "jetspec_prefix_cached_tokens") >= 32
  assert value("jetspec_preemptions", "jetspec_preemptions") == 0


def test_a_request_the_engine_cannot_run_is_told_and_touches_no_other(server):
  """A ticket handed to the driver directly (past the service's checks) with a prompt longer than a slot: it
  gets its own one-sentence error, the device loop goes on, a normal request beside it completes."""
  url, service, _ = server
  told = []
  bad = Ticket(Request(list(range(1, 80)), 4), lambda tokens, done, error: told.append((done, error)))
  service.driver.submit(bad)
  r = client(url).completions.create(model=MODEL, prompt="the cat", max_tokens=3)
  assert r.usage.completion_tokens == 3 and service.driver.error is None
  assert told and told[-1][0] and "does not fit a slot" in told[-1][1]


def test_serve_defaults_to_the_measured_best_tree():
  from jetspec_jax import cli
  args = cli.build_parser().parse_args(["serve", "--target", "x"])
  assert (args.tree, args.budget, args.max_waiting, args.request_timeout) == ("best_nodes", 16, None, 0.0)
  gen = cli.build_parser().parse_args(["generate", "--target", "x", "--prompt", "hi"])
  assert (gen.tree, gen.budget) == ("accum_logp", 64)


def test_drain_ends_what_does_not_finish_in_time(server):
  """Shutdown (``handle_exit``, as SIGTERM calls it) with a 0.5 s drain timeout and a slowed engine: new
  requests get 503, the request in flight ends with an error event and [DONE]. Runs last: it stops the driver."""
  url, service, srv = server
  engine, dispatch = service.driver.engine, service.driver.engine.dispatch
  engine.dispatch = lambda rounds: (time.sleep(0.05), dispatch(rounds))[1]
  with httpx.stream("POST", f"{url}/v1/completions", json={**GOOD, "max_tokens": 200, "stream": True},
                    timeout=60) as s:
    lines = s.iter_lines()
    next(line for line in lines if line.startswith("data: "))
    srv.handle_exit(signal.SIGTERM, None)
    r = httpx.post(f"{url}/v1/completions", json=GOOD, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    assert httpx.get(f"{url}/health").status_code == 503
    events = sse(lines)
  assert "shut down" in events[-1]["error"]["message"]


def test_sigterm_finishes_the_requests_in_flight_and_exits_0(model_dir, reference, tmp_path):
  target, _ = model_dir
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.Popen([sys.executable, "-m", "jetspec_jax.cli", "serve", "--target", target, "--port", "0",
                           "--model-name", MODEL, "--slots", "2", "--max-prompt", "64", "--max-tokens", "120",
                           "--segment-rounds", "1", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=env, cwd=REPO)
  try:
    line = proc.stderr.readline()
    while line and "serving" not in line:
      line = proc.stderr.readline()
    url = re.search(r"http://\S+:\d+", line).group(0)
    tok = load_tokenizer(target)
    # three requests on two slots: the drain lasts at least two requests' decoding, while the 503 below is
    # sent milliseconds after the signal (once /health reports the drain)
    prompts = [PROMPTS[1], PROMPTS[2], PROMPTS[3]]
    with contextlib.ExitStack() as streams:
      lines = [streams.enter_context(httpx.stream(
          "POST", f"{url}/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": 120, "stream": True},
          timeout=120)).iter_lines() for p in prompts]
      first = json.loads(next(line for line in lines[0] if line.startswith("data: "))[len("data: "):])
      proc.send_signal(signal.SIGTERM)
      deadline = time.monotonic() + 30
      while httpx.get(f"{url}/health", timeout=30).json()["status"] != "draining":
        assert time.monotonic() < deadline, "the server never reported the drain"
      r = httpx.post(f"{url}/v1/completions", json=GOOD, timeout=30)
      assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
      events = [[first] + sse(lines[0])] + [sse(ls) for ls in lines[1:]]
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert json.loads(out)["cancelled"] == 0
    for p, ev in zip(prompts, events):
      assert ev[-1]["choices"][0]["finish_reason"] in ("length", "stop")
      ids = tok.encode(p, add_special_tokens=False)
      assert "".join(e["choices"][0]["text"] for e in ev) == expected(reference, tok, ids, 120)[0]
  finally:
    if proc.poll() is None:
      proc.kill()
