"""What a server needs from the engine between segments: ``progress`` (the running requests' tokens so
far, each a prefix of its final tokens) and ``cancel`` (a queued or running request stops, frees its slot
and queue entry, never comes out of ``step``, and changes no other request's tokens)."""
import pytest

from jetspec_jax.decode.engine import Engine, EnginePlan
from jetspec_jax.decode.speculative import TreeConfig
from greedy import assert_agree
from test_engine import ar_reference, random_requests
from test_speculative import CFG, head, target

MODES = {"ar": None, "best_nodes": TreeConfig("best_nodes", 8, 3, 4)}


def engine(tree, slots=2, queue=4) -> Engine:
  plan = EnginePlan(slots=slots, rows=slots * (1 if tree is None else tree.num_nodes()), lanes=1, prefill_rows=8,
                    max_prompt=40, max_new_tokens=16, queue=queue, tree=tree)
  kw = {} if tree is None else dict(head_cfg=head()[0], head_params=head()[1])
  return Engine(CFG, target(), plan, eos_ids=(), **kw)


def drain(e: Engine, rounds: int = 2) -> tuple[dict[int, list[int]], list[dict[int, list[int]]]]:
  """Step until nothing is outstanding: (final tokens by id, progress after every segment)."""
  final, seen = {}, []
  while any(e._entries):
    final.update({r.id: r.tokens for r in e.step(rounds)})
    seen.append(e.progress())
  return final, seen


@pytest.mark.parametrize("mode", MODES)
def test_progress_is_a_prefix_of_the_final_tokens(mode):
  requests = random_requests(3, 4, max_new=16)
  e = engine(MODES[mode])
  ids = e.submit(requests)
  final, seen = drain(e)
  assert sorted(final) == ids
  assert_agree(CFG, target(), [r.prompt for r in requests],
               [ar_reference(tuple(r.prompt), r.max_new_tokens, ()) for r in requests], [final[i] for i in ids])
  partial = [(i, toks) for snapshot in seen for i, toks in snapshot.items()]
  assert partial and all(final[i][:len(toks)] == toks for i, toks in partial)
  assert any(0 < len(toks) < len(final[i]) for i, toks in partial)       # tokens seen before the request ended
  assert e.progress() == {}


@pytest.mark.parametrize("mode", MODES)
def test_cancel_frees_the_slot_and_changes_no_other_request(mode):
  requests = random_requests(5, 4, max_new=16)
  e = engine(MODES[mode], slots=2, queue=4)
  ids = e.submit(requests)
  while not e.progress().get(ids[0]):                   # the first request is running and has tokens
    assert not e.step(1)
  assert e.cancel([ids[0], ids[3], 999]) == [ids[0], ids[3]]              # running, queued, unknown
  assert e.cancel([ids[0]]) == []
  again = e.submit([requests[0]])                       # the freed queue entries take new requests
  final, _ = drain(e)
  assert sorted(final) == [ids[1], ids[2]] + again
  kept = requests[1:3] + [requests[0]]
  assert_agree(CFG, target(), [r.prompt for r in kept], [ar_reference(tuple(r.prompt), r.max_new_tokens, ()) for r in kept],
               [final[i] for i in ids[1:3] + again])


def test_progress_since_gives_only_the_new_tokens():
  requests = random_requests(2, 4, max_new=16)
  e = engine(None)
  ids = e.submit(requests)
  have = {i: [] for i in ids}
  final = {}
  while any(e._entries):
    final.update({r.id: r.tokens for r in e.step(1)})
    for rid, new in e.progress({i: len(t) for i, t in have.items()}).items():
      have[rid] += new
  for i in ids:                                         # the deltas concatenate to a prefix of the final tokens
    assert final[i][:len(have[i])] == have[i] and have[i]


def test_queue_programs_compile_once_for_any_number_of_requests():
  """enqueue and drop take arrays padded to the queue's capacity: one program each, whatever a call holds."""
  from jetspec_jax.decode import engine as engine_module
  e = engine(None, slots=2, queue=7)                    # a queue size no other test uses: its programs are new here
  e.start()
  before = engine_module.enqueue._cache_size(), engine_module.drop._cache_size()
  for n in (1, 2, 3):
    ids = e.submit(random_requests(10 + n, n, max_new=4))
    e.cancel(ids[: n - 1] or ids)
    e.step()
  after = engine_module.enqueue._cache_size(), engine_module.drop._cache_size()
  assert (after[0] - before[0], after[1] - before[1]) == (1, 1), (before, after)


def test_request_ids_past_int32_keep_working():
  """Request ids are host integers; the device's sequence numbers wrap at 2**31 (no OverflowError)."""
  requests = random_requests(7, 2, max_new=4)
  e = engine(None)
  e.start()
  e._next_id = 2 ** 31 - 1
  ids = e.submit(requests)
  assert ids == [2 ** 31 - 1, 2 ** 31]
  final, _ = drain(e)
  assert sorted(final) == ids
  assert_agree(CFG, target(), [r.prompt for r in requests],
               [ar_reference(tuple(r.prompt), r.max_new_tokens, ()) for r in requests], [final[i] for i in ids])
