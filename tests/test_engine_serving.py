"""What a server needs from the engine between segments: segments dispatched ahead of their collection (one
in flight, as the driver runs them), each request's new tokens per segment (``Update.new``: the deltas
concatenate to its final tokens), ``progress`` (the tokens so far, a prefix of the final tokens) and ``cancel``
(a queued or running request stops, frees its slot and queue entry, never comes out of ``step``, and changes no
other request's tokens)."""
import jax.numpy as jnp
import pytest

from jetspec_jax.decode.engine import Engine, EnginePlan
from jetspec_jax.decode.speculative import TreeConfig
from jetspec_jax.errors import JetSpecError
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


@pytest.mark.parametrize("mode", MODES)
def test_one_segment_in_flight_gives_every_token_once(mode):
  """The driver's loop: submit and cancel while a segment runs, dispatch the next, then collect the previous.
  Each request's deltas concatenate to exactly its final tokens, which agree with its AR tokens; a cancelled one
  never finishes; a segment collected out of order is refused in one sentence."""
  requests = random_requests(11, 6, max_new=16)
  e = engine(MODES[mode], slots=2, queue=4)
  e.start()
  have, final, cancelled, later = {}, {}, None, list(requests[3:])
  ids = e.submit(requests[:3])
  in_flight = None
  for _ in range(200):
    if in_flight is not None and cancelled is None and have.get(ids[2]):
      cancelled = e.cancel([ids[2]])                   # running (tokens seen), cancelled while a segment runs
    free = e.plan.queue - sum(len(x) for x in e._entries)
    if later and free:
      ids += e.submit(later[:free])
      later = later[free:]
    dispatched = e.dispatch(2)
    if in_flight is not None:
      update = e.collect(in_flight)
      for rid, new in update.new.items():
        have.setdefault(rid, []).extend(new)
      final.update({r.id: r.tokens for r in update.finished})
    in_flight = dispatched
    if not any(e._entries) and not later:
      break
  e.collect(in_flight)
  assert cancelled == [ids[2]] and ids[2] not in final
  kept = [i for i in ids if i != ids[2]]
  assert sorted(final) == kept
  assert all(have[i] == final[i] for i in kept)
  assert_agree(CFG, target(), [requests[i].prompt for i in kept],
               [ar_reference(tuple(requests[i].prompt), requests[i].max_new_tokens, ()) for i in kept],
               [final[i] for i in kept])
  first, second = e.dispatch(1), e.dispatch(1)
  with pytest.raises(JetSpecError, match="collected out of order"):
    e.collect(second)
  e.collect(first)
  e.collect(second)


def test_the_round_counter_wraps_without_stopping_the_loop():
  """The round counter is int32 and wraps after 2**31 rounds (weeks of a busy server): a segment's bound is a
  difference of counters, so rounds still run and requests finish across the wrap."""
  requests = random_requests(13, 2, max_new=6)
  e = engine(None)
  e.start()
  e.state = e.state.replace(round=jnp.int32(2 ** 31 - 3))
  ids = e.submit(requests)
  final = {}
  for _ in range(50):
    final.update({r.id: r.tokens for r in e.step(2)})
    if len(final) == 2:
      break
  assert sorted(final) == ids
  assert [final[i] for i in ids] == [ar_reference(tuple(r.prompt), r.max_new_tokens, ()) for r in requests]


def test_queue_programs_compile_once_for_any_number_of_requests():
  """enqueue and drop take arrays padded to the queue's capacity: one program each, whatever a call holds."""
  e = engine(None, slots=2, queue=7)                    # a queue size no other test uses: its programs are new here
  e.start()
  before = e.programs.enqueue._cache_size(), e.programs.drop._cache_size()
  for n in (1, 2, 3):
    ids = e.submit(random_requests(10 + n, n, max_new=4))
    e.cancel(ids[: n - 1] or ids)
    e.step()
  after = e.programs.enqueue._cache_size(), e.programs.drop._cache_size()
  assert (after[0] - before[0], after[1] - before[1]) == (1, 1), (before, after)


def test_compiled_programs_live_with_their_engines():
  """Engines with equal programs share one ``Programs``; the ``LIVE_PROGRAMS`` most recent sets are kept, and an
  older one is freed (its compiled executables, and their memory maps, with it) once no engine holds it."""
  import gc
  import weakref
  from jetspec_jax.decode import engine as engine_module
  sets, held = [], None
  for queue in range(11, 11 + engine_module.LIVE_PROGRAMS + 2):       # queue sizes no other test uses
    e = engine(None, queue=queue)
    assert engine(None, queue=queue).programs is e.programs
    sets.append(weakref.ref(e.programs))
    held = held or e                                                   # the first engine lives on
    del e
  gc.collect()
  alive = [r() is not None for r in sets]
  assert alive == [True] + [False] + [True] * engine_module.LIVE_PROGRAMS, alive
  assert held.programs is sets[0]()
  del held
  gc.collect()
  assert sets[0]() is None


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
