"""The generation API: SamplingConfig, Generator's two jitted phases, GenerationResult, and no host
transfer inside either decode loop."""
import functools

import jax
import numpy as np
import pytest

from jetspec_jax.bench import HOST_OPS
from greedy import assert_agree
from jetspec_jax.decode.generation import acceptance
from jetspec_jax.config import Qwen3Config
from jetspec_jax.decode.generation import Generator
from jetspec_jax.decode.sampling import SamplingConfig
from jetspec_jax.decode.speculative import TreeConfig
from jetspec_jax.errors import JetSpecError
from jetspec_jax.models import draft_head, qwen3


CFG = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
HEAD = draft_head.DraftConfig.for_target(CFG, block_size=5, target_layer_ids=(1,))
TREE = TreeConfig("accum_logp", 16, 3, 4)
PROMPTS = [[5, 17, 33, 2], [61, 3, 9]]


@functools.cache
def weights():
  target = {k: v * 10 if v.ndim > 1 else v for k, v in qwen3.init_target(CFG, jax.random.key(0)).items()}
  return target, draft_head.init_head(HEAD, jax.random.key(1))


def test_sampling_config_resolves_greedy_and_rejects_bad_options():
  assert SamplingConfig(temperature=0.0, top_k=5, top_p=0.3, accept="match").resolved() == SamplingConfig()
  assert SamplingConfig().describe()["accept"] == "greedy"
  assert SamplingConfig(0.7, 3, 0.9, "match", 2).resolved() == SamplingConfig(0.7, 3, 0.9, "match", 2)
  with pytest.raises(JetSpecError):
    Generator(CFG, weights()[0], sampling_cfg=SamplingConfig(temperature=1.0, top_p=0.0))


def test_result_counts_for_ar_and_speculative():
  target, head = weights()
  ar = Generator(CFG, target, eos_ids=()).generate(PROMPTS, 9)
  assert [len(t) for t in ar.tokens] == [9, 9] and ar.num_tokens.tolist() == [9, 9]
  assert ar.rounds.tolist() == [8, 8] and ar.target_forwards == 9 and ar.depth_histogram is None
  spec = Generator(CFG, target, head_cfg=HEAD, head_params=head, tree=TREE, eos_ids=()).generate(PROMPTS, 9)
  assert_agree(CFG, target, PROMPTS, ar.tokens, spec.tokens)
  assert spec.depth_histogram.shape == (2, TREE.depth + 1)
  assert spec.depth_histogram.sum(axis=1).tolist() == spec.rounds.tolist()
  assert acceptance([spec])["tau"] == (int(spec.num_tokens.sum()) - 2) / int(spec.rounds.sum())
  assert spec.prefill_s > 0 and spec.decode_s > 0


def test_prefill_width_and_key_reproduce_a_regeneration_batch():
  """A wider padding and an explicit key change neither a greedy row nor a sampled one's reproducibility."""
  target, _ = weights()
  greedy = Generator(CFG, target, eos_ids=())
  assert_agree(CFG, target, PROMPTS, greedy.generate(PROMPTS, 6).tokens, greedy.generate(PROMPTS, 6, width=16).tokens)
  sampled = Generator(CFG, target, sampling_cfg=SamplingConfig(temperature=1.0), eos_ids=())
  key = jax.random.fold_in(jax.random.key(3), 1)
  assert sampled.generate(PROMPTS, 6, key=key).tokens == sampled.generate(PROMPTS, 6, key=key).tokens
  with pytest.raises(JetSpecError, match="does not fit the batch width 2"):
    greedy.generate(PROMPTS, 6, width=2)


@pytest.mark.parametrize("speculative_mode", [False, True], ids=["ar", "speculative"])
def test_no_host_transfer_inside_the_decode_loop(speculative_mode):
  """The compiled while loop (the whole decode) holds no infeed/outfeed, send/recv or host callback."""
  target, head = weights()
  kw = dict(head_cfg=HEAD, head_params=head, tree=TREE) if speculative_mode else {}
  gen = Generator(CFG, target, eos_ids=(), **kw)
  state = gen.prefill(PROMPTS, 8)
  text = gen.lower_decode(state).compile().as_text()          # the program Generator.decode runs
  assert "while" in text and not HOST_OPS.findall(text)
  assert np.asarray(jax.device_get(state.base.tokens if speculative_mode else state.tokens)).shape == (2, 8)


@pytest.mark.parametrize("speculative_mode", [False, True], ids=["ar", "speculative"])
def test_transfer_guard_and_fetch_hooks(speculative_mode, monkeypatch):
  """``transfer_guard`` wraps each decode call in the device-to-host guard at that level; ``on_fetch`` sees the
  arrays of the one final fetch (3 AR, 8 speculative); the tokens are those of an uninstrumented Generator."""
  target, head = weights()
  kw = dict(head_cfg=HEAD, head_params=head, tree=TREE) if speculative_mode else {}
  levels, fetches = [], []
  guard = jax.transfer_guard_device_to_host
  monkeypatch.setattr(jax, "transfer_guard_device_to_host", lambda level: levels.append(level) or guard(level))
  gen = Generator(CFG, target, eos_ids=(), transfer_guard="disallow", on_fetch=fetches.append, **kw)
  out = gen.generate(PROMPTS, 8)
  assert levels == ["disallow"] and [len(f) for f in fetches] == [8 if speculative_mode else 3]
  assert all(isinstance(a, jax.Array) for a in fetches[0])
  assert out.tokens == Generator(CFG, target, eos_ids=(), **kw).generate(PROMPTS, 8).tokens
  with pytest.raises(JetSpecError, match="transfer_guard 'sometimes'"):
    Generator(CFG, target, transfer_guard="sometimes")


def test_host_op_scan_sees_a_callback_in_a_loop():
  """Control for the check above: a host callback inside a while loop is found in the compiled text."""
  def body(i):
    jax.debug.callback(lambda v: None, i)
    return i + 1
  text = jax.jit(lambda: jax.lax.while_loop(lambda i: i < 3, body, 0)).lower().compile().as_text()
  assert HOST_OPS.findall(text)
