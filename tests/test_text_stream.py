"""The server's incremental detokenizer (``serve.TextStream``): its streamed text equals a whole decode, it stops
where a brute-force search over every prefix would, and its work per token does not grow with the completion."""
import numpy as np
import pytest

from jetspec_jax import serve
from jetspec_jax.tokenizer import load_tokenizer, train_chat_tokenizer

WORDS = ["alpha", "beta", "gamma", "délta", "épsilon", "中文", "字符", "naïve", "🙂", "END", "stop", "x", "\n", "  "]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
  rng = np.random.default_rng(0)
  texts = [" ".join(rng.choice(WORDS, 12)) for _ in range(200)]
  return load_tokenizer(train_chat_tokenizer(texts, 300, str(tmp_path_factory.mktemp("tok"))))


def texts(n: int, seed: int) -> list[str]:
  rng = np.random.default_rng(seed)
  return ["".join(rng.choice(WORDS) + (" " if rng.random() < 0.6 else "") for _ in range(rng.integers(5, 60)))
          for _ in range(n)]


def stream(tokenizer, ids, stop, seed=0):
  """Feed ``ids`` in random chunks, then flush; returns (streamed text, the TextStream)."""
  rng = np.random.default_rng(seed)
  ts, out, at = serve.TextStream(tokenizer, stop), [], 0
  while at < len(ids) and not ts.stopped:
    n = int(rng.integers(1, 5))
    out.append(ts.feed(ids[at:at + n]))
    at += n
  out.append(ts.flush())
  return "".join(out), ts


def test_streamed_text_equals_the_whole_decode(tokenizer):
  for i, text in enumerate(texts(40, 1)):
    ids = tokenizer.encode(text, add_special_tokens=False)
    got, _ = stream(tokenizer, ids, [], seed=i)
    assert got == tokenizer.decode(ids, skip_special_tokens=True), text


def test_stop_strings_cut_where_a_search_of_every_prefix_would(tokenizer):
  cases = 0
  for i, text in enumerate(texts(60, 2)):
    ids = tokenizer.encode(text, add_special_tokens=False)
    for stop in (["END"], ["ta ", "字"], ["🙂"], ["naïve gam", "\n"]):
      got, ts = stream(tokenizer, ids, stop, seed=i)
      full = tokenizer.decode(ids, skip_special_tokens=True)
      hits = [full.find(s) for s in stop if s in full]
      if not hits:
        assert got == full and not ts.stopped
        continue
      cases += 1
      assert got == full[:min(hits)] and ts.stopped
      # the fewest tokens whose text holds a stop string
      used = next(k for k in range(1, len(ids) + 1)
                  if any(s in tokenizer.decode(ids[:k], skip_special_tokens=True) for s in stop))
      assert ts.used == used
  assert cases >= 40


def test_work_per_token_is_flat_in_the_completion_length(tokenizer):
  """Tokens passed to ``decode`` per streamed token, for 1k and 8k-token completions with a stop string that
  never matches (the case that decoded the whole completion at every token before)."""
  class Counting:
    def __init__(self, tok):
      self.tok, self.decoded = tok, 0

    def decode(self, ids, **kw):
      self.decoded += len(ids)
      return self.tok.decode(ids, **kw)

  pool = [t for text in texts(400, 3) for t in tokenizer.encode(text, add_special_tokens=False)]
  per_token = {}
  for n in (1000, 8000):
    counting = Counting(tokenizer)
    ts = serve.TextStream(counting, ["never appears ~~"])
    for t in pool[:n]:
      ts.feed([t])
    ts.flush()
    per_token[n] = counting.decoded / n
  assert per_token[8000] <= 1.1 * per_token[1000], per_token
  assert per_token[8000] < 8, per_token
