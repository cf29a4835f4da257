"""An OpenAI-compatible HTTP server on the continuous-batching engine (FastAPI + uvicorn).

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (the tokenizer's chat template,
thinking off, as ``generate --chat``), each streamed as server-sent events (``data: {...}`` chunks, then
``data: [DONE]``) or not; ``GET /v1/models``; ``GET /health``; ``GET /metrics`` (Prometheus text format).

Overload: at most ``serve --max-waiting`` requests wait for the engine's queue; beyond it a request gets 429 with
``Retry-After``; while draining, 503; a request running past ``--request-timeout`` is cancelled with a 504.

Threads: uvicorn's event loop runs the handlers; one ``driver.Driver`` thread owns the engine and runs
it segment by segment. A handler parses and checks its request, hands a ``Ticket`` to the driver and
awaits the updates the driver posts to the loop (``call_soon_threadsafe``): neither side waits on the
other. Text comes from the tokens host-side (``TextStream``): decoded incrementally, cut at the first
stop string (the request is then cancelled in the engine), EOS ids ending the request in the engine.
A client that disconnects cancels its request. SIGTERM: new requests get 503, the ones in flight finish
(at most ``drain_timeout`` seconds; the rest end with an error event), then the process exits 0.

Sampling: each request's temperature, top_p, top_k (vLLM's extension; -1 or 0: off) and seed, the
server's settings (``serve --temperature/--top-p/--top-k``, or the checkpoint's generation_config.json)
filling what it leaves out; greedy and sampled requests share the engine's rounds. A server started
with ``--fixed-sampling`` compiles its one setting instead and answers other values with a 400 naming them.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import threading
import time
import uuid
from typing import AsyncIterator, Callable

import uvicorn
from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from jetspec_jax.decode.engine import Request, check_requests
from jetspec_jax.driver import Driver, Overloaded, Ticket
from jetspec_jax.errors import JetSpecError
from jetspec_jax.tokenizer import chat_prompt_ids

MAX_STOP = 4                   # stop strings per request, as OpenAI allows
DISCONNECT_POLL_S = 0.5        # a non-streaming handler checks this often whether its client left
# Fields this server does not implement, with the values that ask for nothing (accepted).
UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None, 0), "best_of": (None, 1), "echo": (None, False),
               "suffix": (None, ""), "tools": (None, []), "logit_bias": (None, {}),
               "frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0)}


class ApiError(JetSpecError):
  """A request the server refuses: HTTP ``status`` and an OpenAI-style error body."""

  def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None, headers: dict[str, str] | None = None):
    super().__init__(message)
    self.status, self.type, self.param, self.code, self.headers = status, type, param, code, headers

  def body(self) -> dict:
    return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


class TextStream:
  """Tokens -> text, incrementally: ``feed`` returns the text that is safe to send (no partial UTF-8
  character, nothing that may begin a stop string); after the first stop string the text ends before it,
  ``stopped`` is set and ``used`` counts the tokens that produced it. ``flush`` returns the rest.

  Constant work per token whatever the completion's length: a step decodes only the tokens since the last
  complete piece of text plus that piece's tokens (``_prefix`` .. end: the context a tokenizer needs to place
  spaces), and stop strings are searched in ``pending`` only: the text not sent yet, which is the new piece
  plus what was held back (less than a stop string). A stop string never begins in sent text: a suffix that
  may begin one is held back."""

  def __init__(self, tokenizer, stop: list[str]):
    self.tokenizer, self.stop = tokenizer, stop
    self.tokens: list[int] = []
    self.pending = ""
    self.stopped = False
    self.used = 0
    self._prefix = 0           # tokens[_prefix:_read]: the last piece of decoded text (context for the next)
    self._read = 0             # tokens before _read are decoded

  def feed(self, tokens: list[int]) -> str:
    if not self.stop:          # no stop string to place: one decode for the whole update
      self.tokens.extend(tokens)
      self._decode()
    for t in tokens if self.stop else ():
      if self.stopped:
        break
      self.tokens.append(t)
      self._decode()
    return self._take(self._held())

  def flush(self) -> str:
    """The text not sent yet, a trailing partial character included (the tokens are final)."""
    if not self.stopped:
      self._decode(final=True)
    return self._take(0)

  def _decode(self, final: bool = False) -> None:
    decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)
    before = decode(self.tokens[self._prefix:self._read])
    after = decode(self.tokens[self._prefix:])
    if after.endswith("\ufffd") and not final:   # a character split over tokens: wait for the rest
      return
    self.pending += after[len(before):]
    self._prefix, self._read = self._read, len(self.tokens)
    cut = min((i for i in (self.pending.find(s) for s in self.stop) if i >= 0), default=-1)
    if cut >= 0:
      self.pending, self.stopped, self.used = self.pending[:cut], True, len(self.tokens)

  def _held(self) -> int:
    """Characters at the end that may begin a stop string (kept back until the next tokens decide)."""
    if self.stopped:
      return 0
    tail = self.pending
    return max((k for s in self.stop for k in range(min(len(s) - 1, len(tail)), 0, -1) if tail.endswith(s[:k])),
               default=0)

  def _take(self, held: int) -> str:
    end = len(self.pending) - held
    out, self.pending = self.pending[:end], self.pending[end:]
    return out


@dataclasses.dataclass(frozen=True)
class Job:
  """A checked request: prompt ids and how to run and answer it."""
  prompt: list[int]
  max_tokens: int
  seed: int | None
  sampling: dict            # the request's own temperature / top_k / top_p (the engine fills the rest)
  stop: list[str]
  stream: bool
  include_usage: bool


@dataclasses.dataclass(frozen=True)
class Event:
  """One update of a running job: new text, and at the end the finish reason and completion tokens."""
  text: str
  finish_reason: str | None = None
  completion_tokens: int = 0
  cached_tokens: int = 0


class Service:
  """What the endpoints serve: the driver (started), tokenizer, model name, the engine's sampling and
  EOS ids. ``draining``: set on SIGTERM, new requests get 503. ``request_timeout`` (seconds, None: none): a request
  running longer is cancelled with a 504; a request refused at the driver's bound gets 429 with ``retry_after``.
  ``max_body``: the largest request body in bytes (None: 1 MiB or 64 bytes per prompt token of a slot, whichever
  is more); a larger one gets 413 without being read further."""

  def __init__(self, driver: Driver, tokenizer, model_name: str, *, completion_default_tokens: int = 16,
               request_timeout: float | None = None, retry_after: int = 1, max_body: int | None = None):
    engine = driver.engine
    self.driver, self.tokenizer, self.model_name = driver, tokenizer, model_name
    self.cfg, self.plan, self.sampling, self.eos = engine.cfg, engine.plan, engine.sampling, set(engine.eos)
    self.max_body = max_body or max(1 << 20, 64 * engine.plan.max_prompt)
    self.completion_default_tokens = completion_default_tokens
    self.request_timeout, self.retry_after = request_timeout, retry_after
    self.metrics = Metrics(driver, engine.plan.slots)
    self.draining = False
    self.created = int(time.time())

  # ----- request checks -----------------------------------------------------------------------------

  def check_model(self, body: dict) -> None:
    model = body.get("model")
    if model is None:
      raise ApiError(400, "the request needs a model field; this server serves "
                          f"{self.model_name!r}", param="model", code="missing_required_parameter")
    if model != self.model_name:
      raise ApiError(404, f"the model {model!r} does not exist on this server; use {self.model_name!r} "
                          f"(GET /v1/models)", param="model", code="model_not_found")

  def job(self, body: dict, prompt: list[int], *, chat: bool) -> Job:
    """Check the fields both endpoints share (n, sampling, seed, stop, max_tokens, stream) and the prompt's
    fit in a slot."""
    n = body.get("n", 1)
    if n is not None and n != 1:
      raise ApiError(400, f"n must be 1 on this server (one completion per request), got {n!r}", param="n")
    for field, neutral in UNSUPPORTED.items():
      if body.get(field) not in neutral:
        raise ApiError(400, f"{field} is not supported by this server; leave it out", param=field)
    sampling = self._sampling(body)
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not -2 ** 63 <= seed < 2 ** 63):
      raise ApiError(400, f"seed must be a signed 64-bit integer, got {seed!r}", param="seed")
    stop = self._stop(body.get("stop"))
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    default = self.plan.max_new_tokens if chat else min(self.completion_default_tokens, self.plan.max_new_tokens)
    max_tokens = body.get(key)
    # Unasked, a reply may take what the context leaves after the prompt (``--max-model-len``).
    max_tokens = max(1, min(default, self.plan.committed_rows - len(prompt))) if max_tokens is None else max_tokens
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
      raise ApiError(400, f"{key} must be a positive integer, got {max_tokens!r}", param=key)
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
      raise ApiError(400, f"stream must be true or false, got {stream!r}", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
      raise ApiError(400, "stream_options must be an object such as {\"include_usage\": true}", param="stream_options")
    self._fits(prompt, max_tokens, "messages" if chat else "prompt", key)
    return Job(prompt=prompt, max_tokens=max_tokens, seed=seed, sampling=sampling, stop=stop, stream=stream,
               include_usage=bool(options.get("include_usage")))

  def _sampling(self, body: dict) -> dict:
    """The request's temperature / top_p / top_k, checked (top_k -1 is vLLM's "off", here 0)."""
    values = {}
    for field in ("temperature", "top_p", "top_k"):
      v = body.get(field)
      if v is None:
        continue
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ApiError(400, f"{field} must be a number, got {v!r}", param=field)
      values[field] = v
    if values.get("temperature", 0) < 0:
      raise ApiError(400, f"temperature must be >= 0 (0: greedy), got {values['temperature']}", param="temperature")
    if not 0 < values.get("top_p", 1) <= 1:
      raise ApiError(400, f"top_p must be in (0, 1] (1: off), got {values['top_p']}", param="top_p")
    if "top_k" in values:
      k = values["top_k"]
      if k != int(k) or k < -1:
        raise ApiError(400, f"top_k must be an integer >= -1 (-1 or 0: off), got {k}", param="top_k")
      values["top_k"] = max(int(k), 0)
    if self.plan.per_request_sampling:
      return values
    s = self.sampling
    if s.greedy and values.get("temperature", 0) == 0:          # greedy decoding ignores top_p and top_k
      return {}
    for field, v in values.items():
      if not math.isclose(v, getattr(s, field), rel_tol=1e-6, abs_tol=1e-9):
        raise ApiError(400, f"{field} {v} differs from this server's sampling (temperature {s.temperature:g}, "
                            f"top_p {s.top_p:g}, top_k {s.top_k}), which it compiled when it started (jetspec-jax "
                            f"serve --fixed-sampling); leave {field} out or send the server's value",
                       param=field, code="unsupported_value")
    return {}

  @staticmethod
  def _stop(stop) -> list[str]:
    stop = [stop] if isinstance(stop, str) else [] if stop is None else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > MAX_STOP:
      raise ApiError(400, f"stop must be a string or a list of at most {MAX_STOP} strings", param="stop")
    return [s for s in stop if s]

  def _fits(self, prompt: list[int], max_tokens: int, param: str, tokens_param: str) -> None:
    if not prompt:
      raise ApiError(400, "the prompt is empty; send at least one token", param=param)
    p = self.plan
    if len(prompt) > p.max_prompt:
      raise ApiError(400, f"the prompt has {len(prompt)} tokens, more than this server's {p.max_prompt} "
                          f"(jetspec-jax serve --max-prompt); shorten it", param=param, code="context_length_exceeded")
    if max_tokens > p.max_new_tokens:
      raise ApiError(400, f"{tokens_param} {max_tokens} is more than this server's {p.max_new_tokens} "
                          f"(jetspec-jax serve --max-tokens); ask for fewer", param=tokens_param,
                     code="context_length_exceeded")
    try:
      check_requests([Request(prompt, max_tokens)], self.cfg, p)
    except JetSpecError as e:
      raise ApiError(400, str(e).removeprefix("request 0: "), param=param) from None

  def completion_prompt(self, body: dict) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
      prompt = prompt[0]                       # a batch of one
    if isinstance(prompt, str):
      return self.tokenizer.encode(prompt, add_special_tokens=False)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
      return prompt
    raise ApiError(400, "prompt must be a string or a list of token ids (one prompt per request)", param="prompt")

  def chat_prompt(self, body: dict) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
      raise ApiError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
    plain = []
    for i, m in enumerate(messages):
      content = m.get("content") if isinstance(m, dict) else None
      if isinstance(content, list):              # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
          raise ApiError(400, f"messages[{i}].content has a part that is not text; this server reads text only",
                         param=f"messages[{i}].content")
        content = "".join(p["text"] for p in content)
      if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") or not isinstance(content,
                                                                                                          str):
        raise ApiError(400, f"messages[{i}] must have a role (system, user or assistant) and text content",
                       param=f"messages[{i}]")
      plain.append({"role": m["role"], "content": content})
    return chat_prompt_ids(self.tokenizer, plain)

  # ----- running -----------------------------------------------------------------------------------

  def check_open(self) -> None:
    if self.draining or self.driver.error is not None:
      self.metrics.requests.labels("unavailable").inc()
    if self.draining:
      raise ApiError(503, "the server is shutting down and takes no new requests; send it to another server",
                     type="service_unavailable", code="shutting_down")
    if self.driver.error is not None:
      raise ApiError(503, self.driver.error, type="server_error", code="engine_failed")

  def begin(self, job: Job) -> "Run":
    """Hand ``job`` to the driver (before any response is sent, so a refusal is a plain 429)."""
    import jax
    loop = asyncio.get_running_loop()
    updates: asyncio.Queue = asyncio.Queue()

    def publish(tokens, done, error):
      try:
        loop.call_soon_threadsafe(updates.put_nowait, (tokens, done, error))
      except RuntimeError:                     # the loop closed: nobody is listening any more
        pass

    key = None if job.seed is None else jax.random.key(job.seed)
    try:
      ticket = self.driver.submit(Ticket(Request(job.prompt, job.max_tokens, key, **job.sampling), publish))
    except Overloaded as e:
      self.metrics.requests.labels("refused").inc()
      raise ApiError(429, str(e), type="rate_limit_error", code="overloaded",
                     headers={"Retry-After": str(self.retry_after)}) from None
    return Run(job=job, ticket=ticket, updates=updates, started=time.monotonic())

  def end(self, run: "Run") -> None:
    """Cancel ``run``'s request unless it finished (its client left, or it ran out of time)."""
    if not run.ticket.done:
      self.driver.cancel(run.ticket)

  async def events(self, run: "Run", disconnected: Callable[[], "asyncio.Future[bool]"] | None = None
                   ) -> AsyncIterator[Event]:
    """``run``'s text as it comes; the last event has the finish reason. Leaving early (or a disconnect, polled
    with ``disconnected`` while waiting) cancels the request, as does running past ``request_timeout`` (504)."""
    text = TextStream(self.tokenizer, run.job.stop)
    checked = time.monotonic()
    deadline = None if self.request_timeout is None else run.started + self.request_timeout
    count, first_at, outcome = 0, None, "cancelled"
    try:
      while True:
        wait = None if disconnected is None else DISCONNECT_POLL_S
        if deadline is not None:
          wait = max(min(wait or math.inf, deadline - time.monotonic()), 0.0)
        try:
          update = await (run.updates.get() if wait is None else asyncio.wait_for(run.updates.get(), wait))
        except asyncio.TimeoutError:
          update = None
        if update is None and deadline is not None and time.monotonic() >= deadline:
          outcome = "timeout"
          raise ApiError(504, f"the request ran longer than this server's limit of {self.request_timeout:g}s "
                              f"(serve --request-timeout); ask for fewer tokens", type="timeout_error", code="timeout")
        if disconnected is not None and time.monotonic() - checked >= DISCONNECT_POLL_S:
          checked = time.monotonic()
          if await disconnected():
            return
        if update is None:
          continue
        tokens, done, error = update
        if error is not None:
          outcome = "failed"
          raise ApiError(503, error, type="server_error", code="request_ended")
        if tokens and first_at is None:
          first_at = time.monotonic()
          self.metrics.ttft.observe(first_at - run.started)
        count += len(tokens)
        self.metrics.tokens.inc(len(tokens))
        eos = done and bool(tokens) and tokens[-1] in self.eos
        delta = text.feed(tokens[:len(tokens) - eos])
        if text.stopped or done:
          outcome = "completed"
          if count > 1:
            self.metrics.tpot.observe((time.monotonic() - first_at) / (count - 1))
        if text.stopped:
          yield Event(delta, "stop", text.used)
          return
        if done:
          yield Event(delta + text.flush(), "stop" if eos else "length", count, run.ticket.cached_tokens)
          return
        if delta:
          yield Event(delta)
    finally:
      self.metrics.requests.labels(outcome).inc()
      self.end(run)


@dataclasses.dataclass
class Run:
  """A job handed to the driver: its ticket, the queue its updates arrive on and when it was submitted."""
  job: Job
  ticket: Ticket
  updates: asyncio.Queue
  started: float


class Metrics:
  """The server's Prometheus metrics (``GET /metrics``), in a registry of its own: requests by outcome
  (completed, cancelled, failed, timeout, refused, unavailable, invalid), running and waiting requests, generated
  tokens, time to first token and per output token, slot occupancy and tau of the finished requests, KV pages in
  the pool, held and cached, and the finished requests' prompt tokens, prefix-cached ones and preemptions."""

  def __init__(self, driver: Driver, slots: int):
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    self.registry = r = CollectorRegistry()
    self.requests = Counter("jetspec_requests", "Requests by outcome", ["outcome"], registry=r)
    self.tokens = Counter("jetspec_generated_tokens", "Tokens generated (streamed to clients)", registry=r)
    latency = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120)
    self.ttft = Histogram("jetspec_time_to_first_token_seconds", "Submit to first token", buckets=latency, registry=r)
    self.tpot = Histogram("jetspec_time_per_output_token_seconds", "Mean time per token after the first",
                          buckets=(.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1), registry=r)
    Gauge("jetspec_requests_running", "Requests in the engine (queued on device or decoding)",
          registry=r).set_function(driver.running)
    Gauge("jetspec_requests_waiting", "Requests waiting for the engine's queue", registry=r).set_function(driver.waiting)
    Gauge("jetspec_slot_occupancy", "Requests in the engine over its slots (at most 1)",
          registry=r).set_function(lambda: min(driver.running() / slots, 1.0))
    Gauge("jetspec_tau", "Committed tokens per decode round over the finished requests",
          registry=r).set_function(driver.tau)
    Gauge("jetspec_kv_pages_used", "KV cache pages held by requests", registry=r).set_function(
        lambda: driver.pages_used)
    Gauge("jetspec_kv_pages_cached", "Free KV cache pages holding prefix-cached prompt rows",
          registry=r).set_function(lambda: driver.pages_cached)
    Gauge("jetspec_kv_pages", "KV cache pages in the pool", registry=r).set(
        driver.engine.plan.pool_pages(driver.engine.head_cfg))
    Gauge("jetspec_preemptions", "Times finished requests were preempted for pages (since start)",
          registry=r).set_function(lambda: driver.preemptions)
    Gauge("jetspec_prompt_tokens", "Prompt tokens of finished requests (since start)",
          registry=r).set_function(lambda: driver.prompt_tokens)
    Gauge("jetspec_prefix_cached_tokens", "Of them, rows taken from the prefix cache (since start)",
          registry=r).set_function(lambda: driver.cached_tokens)

  def text(self) -> bytes:
    from prometheus_client import generate_latest
    return generate_latest(self.registry)


def _usage(prompt: int, completion: int, cached: int) -> dict:
  return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
          "prompt_tokens_details": {"cached_tokens": cached}}


def create_app(service: Service):
  """The FastAPI application of ``service``."""
  app = FastAPI(title="jetspec-jax", docs_url=None, redoc_url=None, openapi_url=None)

  @app.exception_handler(ApiError)
  async def api_error(_, e: ApiError):
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

  @app.exception_handler(HTTPException)
  async def http_error(_, e: HTTPException):
    return JSONResponse(ApiError(e.status_code, f"{e.detail}: see GET /v1/models and POST /v1/completions or "
                                                "/v1/chat/completions").body(), status_code=e.status_code)

  async def body_of(request: HttpRequest) -> dict:
    too_big = ApiError(413, f"the request body is larger than this server's limit ({service.max_body} bytes); "
                            f"send a shorter prompt", code="body_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > service.max_body:
      raise too_big
    parts, size = [], 0
    async for chunk in request.stream():
      size += len(chunk)
      if size > service.max_body:
        raise too_big
      parts.append(chunk)
    raw = b"".join(parts)
    try:
      body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ApiError(400, f"the request body is not valid JSON ({e}); send one JSON object") from None
    if not isinstance(body, dict):
      raise ApiError(400, "the request body must be a JSON object")
    return body

  async def answer(request: HttpRequest, chat: bool):
    service.check_open()
    try:
      body = await body_of(request)
      service.check_model(body)
      prompt = service.chat_prompt(body) if chat else service.completion_prompt(body)
      job = service.job(body, prompt, chat=chat)
    except ApiError:
      service.metrics.requests.labels("invalid").inc()
      raise
    run = service.begin(job)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": service.model_name}
    if not job.stream:
      parts, last = [], None
      async for ev in service.events(run, request.is_disconnected):
        parts.append(ev.text)
        last = ev
      if last is None:                         # the client left
        return JSONResponse({}, status_code=499)
      text = "".join(parts)
      choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat
                else {"index": 0, "text": text})
      return {**head, "choices": [{**choice, "logprobs": None, "finish_reason": last.finish_reason}],
              "usage": _usage(len(prompt), last.completion_tokens, last.cached_tokens)}

    head["object"] = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, finish: str | None, first: bool = False) -> str:
      if chat:
        delta = ({"role": "assistant", "content": ""} if first else {} if text is None else {"content": text})
        choice = {"index": 0, "delta": delta}
      else:
        choice = {"index": 0, "text": text or ""}
      return f"data: {json.dumps({**head, 'choices': [{**choice, 'logprobs': None, 'finish_reason': finish}]})}\n\n"

    async def stream():
      if chat:
        yield chunk(None, None, first=True)
      try:
        async for ev in service.events(run):
          if ev.text:
            yield chunk(ev.text, None)
          if ev.finish_reason is not None:
            yield chunk(None, ev.finish_reason)
            if job.include_usage:
              usage = _usage(len(prompt), ev.completion_tokens, ev.cached_tokens)
              yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\n"
      except ApiError as e:
        yield f"data: {json.dumps(e.body())}\n\n"
      yield "data: [DONE]\n\n"

    # The background task cancels the request if the stream never ran (a client that left before it began).
    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                             background=BackgroundTask(service.end, run))

  @app.post("/v1/completions")
  async def completions(request: HttpRequest):
    return await answer(request, chat=False)

  @app.post("/v1/chat/completions")
  async def chat_completions(request: HttpRequest):
    return await answer(request, chat=True)

  @app.get("/v1/models")
  async def models():
    p = service.plan
    return {"object": "list", "data": [{"id": service.model_name, "object": "model", "created": service.created,
                                        "owned_by": "jetspec-jax", "max_prompt_tokens": p.max_prompt,
                                        "max_tokens": p.max_new_tokens}]}

  @app.get("/metrics")
  async def metrics():
    from prometheus_client import CONTENT_TYPE_LATEST
    return Response(service.metrics.text(), media_type=CONTENT_TYPE_LATEST)

  @app.get("/health")
  async def health():
    ok = not service.draining and service.driver.error is None
    status = "ok" if ok else "draining" if service.draining else "failed"
    d = service.driver
    return JSONResponse({"status": status, "outstanding": d.outstanding(), "segments": d.segments,
                         "cancelled": d.cancelled}, status_code=200 if ok else 503)

  return app


def make_server(service: Service, host: str, port: int, *, drain_timeout: float = 30.0,
                on_ready: Callable[[str], None] = lambda url: None, log_level: str = "warning"):
  """A uvicorn server for ``service`` on host:port: ``run()`` serves until SIGTERM / SIGINT (module
  docstring; ``handle_exit`` starts the drain) or ``should_exit``, calling ``on_ready(url)`` once listening
  (port 0: a free port)."""
  class Server(uvicorn.Server):
    drainer: threading.Thread | None = None

    async def startup(self, sockets=None):
      await super().startup(sockets)
      if self.started:
        bound = self.servers[0].sockets[0].getsockname()
        on_ready(f"http://{host}:{bound[1]}")

    def handle_exit(self, sig, frame):
      if self.drainer is not None:             # a second signal: uvicorn's own (exit now)
        return super().handle_exit(sig, frame)
      service.draining = True
      self.drainer = threading.Thread(target=self._drain, name="jetspec-drain", daemon=True)
      self.drainer.start()

    def _drain(self):
      service.driver.drain(drain_timeout)
      self.should_exit = True

  config = uvicorn.Config(create_app(service), host=host, port=port, log_level=log_level, lifespan="off",
                          timeout_graceful_shutdown=5)
  return Server(config)
