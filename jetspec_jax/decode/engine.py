"""The engine: continuous batching over B slots inside one jitted ``lax.while_loop``.

Requests wait in a device-resident queue (per group: Q entries holding prompt ids,
``max_new_tokens``, a PRNG key and sampling parameters, admitted in order of their sequence numbers).
Every round:

  1. prefill under a token budget: each group's L lanes of C = ``prefill_rows`` prompt rows go to its
     prefilling slots, oldest request first, each taking as many consecutive chunks of its prompt as
     remain (so one prompt of up to L * C rows completes in one round, or several prompts share it);
     a round in which no slot is prefilling runs a body without lanes;
  2. budget: a decoding slot offers its root (the newest committed token) and, speculative, the
     nodes of its drafted tree; per group the ``rows / groups`` best are kept: every root, then tree
     nodes by calibrated cumulative draft log-probability (``decode.budget``), so the round's node
     budget is shared by the whole batch and spent where acceptance is likeliest. A kept node's
     parents and lower-ranked siblings are kept too: each slot verifies a smaller tree of its kind;
  3. ONE target forward over the kept decode rows and the lanes' rows (``models.layers.PackedRows``:
     the dense layers see K + L * C rows per group; every row's keys and values are written in place at
     its own cache row, decode rows attend in the caches' [B, W] layout and each lane over its slot's rows);
  4. accept and commit (greedy or sampled, as ``decode.verify``); a slot whose prompt completed draws
     its first token; a finished slot's tokens go to its request's output entry and the slot is free
     (``prefix_len`` 0: attention reads nothing of it);
  5. admit: each free slot takes the next queued request of its group (no host round-trip), so the next
     round's body (lanes or not, key length) is known before it runs.

Groups are the unit of sharding: slots, queues, lanes and packed rows of group g live on data shard
g (G a multiple of the mesh's data axis), and a round moves nothing between shards.

Invariants per slot b (see ``decode.speculative`` for the speculative ones): free: prefix_len[b] = 0;
  prefilling: prefix_len[b] < prompt_len[b] prompt rows are in the cache, num_tokens[b] = 0;
  decoding: prefix_len[b] = prompt_len[b] + num_tokens[b] - 1 and ``last_token`` is not yet cached.
A request's greedy tokens equal its own AR generation whatever the other slots hold, except where the
target's two best float32 logits are within rounding of each other: programs of other shapes (batch,
verified rows) can break such a near-tie either way, and the request continues from the other token
(``decode.agreement``: identical or parted at a near-tie, tested; docs/verification.md measures how
often). Its sampled tokens draw from fold_in(key, step): step 0 is the prefill's first token, step s >= 1 its s-th decode
round (``decode.sampling``).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Callable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax import pages
from jetspec_jax.attention import cache_rows, resolve_implementation
from jetspec_jax.config import Qwen3Config
from jetspec_jax.distributed import host_values
from jetspec_jax.decode import budget, sampling, verify
from jetspec_jax.decode.regime import Regime, regime_for
from jetspec_jax.decode.sampling import SamplingConfig
from jetspec_jax.decode.tree import Tree
from jetspec_jax.decode.speculative import (DraftView, Drafter, TreeConfig, build_round_tree, head_drafter,
                                            observe_ranks)
from jetspec_jax.errors import JetSpecError
from jetspec_jax.models import draft_head, qwen3
from jetspec_jax.models.draft_head import DraftConfig
from jetspec_jax.models.layers import PackedRows
from jetspec_jax.sharding import per_data_shard, whole_vocab

EMPTY, QUEUED, RUNNING, FINISHED = 0, 1, 2, 3     # queue entry status
# Request ids are Python ints; on device a request's sequence number (admission order, and its default key's
# fold_in) is its id modulo 2**31 (int32): past 2**31 requests one engine admits the wrapped ids first once.
SEQ_WRAP = 1 << 31
TRANSFER_GUARDS = ("allow", "log", "disallow", "log_explicit", "disallow_explicit")
ROUND_BODIES = "jetspec_round_bodies"    # the named scope of the loops of round bodies (``bench.hlo_dot_flops``)


@functools.cache
def key_shape() -> tuple[int, ...]:
  """The shape of one PRNG key's data (computed on first use: nothing runs on a device at import)."""
  return jax.random.key_data(jax.random.key(0)).shape


PREFILL_SCORE_BYTES = 1 << 30    # per device and layer: the attention scores one prefill chunk may hold


def prefill_chunk(batch: int, heads: int, prompt_width: int, cache_len: int, mesh=None,
                  score_bytes: int = PREFILL_SCORE_BYTES) -> int:
  """The prefill chunk (query rows per forward) that keeps one layer's float32 attention scores
  [B, H, chunk, cache_len] within ``score_bytes`` per device: 0 (the whole prompt in one forward) when
  it fits, else the largest power of two that does (at least 16). Batch and heads count per device."""
  if mesh is not None:
    data, model = mesh.shape["data"], mesh.shape["model"]
    batch, heads = -(-batch // data), -(-heads // model) if heads % model == 0 else heads
  per_row = batch * heads * cache_len * 4
  if prompt_width * per_row <= score_bytes:
    return 0
  return max(16, 1 << max(int(score_bytes // per_row).bit_length() - 1, 0))


def page_bytes(cfg: Qwen3Config, head_cfg: DraftConfig | None, page_rows: int, dtype) -> int:
  """Bytes one KV page takes over every layer of the target and the head (keys and values)."""
  width = cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
  if head_cfg is not None:
    width += head_cfg.num_hidden_layers * head_cfg.num_key_value_heads * head_cfg.head_dim
  return 2 * width * page_rows * jnp.dtype(dtype).itemsize


def resolve_eos(cfg: Qwen3Config, eos_ids) -> tuple[int, ...]:
  """Explicit EOS ids, or the config's (empty tuple: never stop early)."""
  return tuple(int(e) for e in (cfg.eos_token_ids if eos_ids is None else eos_ids))


@dataclasses.dataclass(frozen=True)
class EnginePlan:
  """What is static in an engine program.

  slots B, rows K (decode rows verified per round: the batch-wide node budget, roots included) and
  prefill lanes L are split evenly over ``groups``; K/G >= B/G so every decoding slot verifies its root.
  ``prefill_rows`` C: prompt rows per lane; a group's round prefills at most ``prefill_budget`` / G = L / G * C
  prompt rows (its token budget), one prompt taking several lanes. ``max_prompt`` / ``max_new_tokens``: a slot's
  capacity; ``queue``: entries per group. ``tree`` None: plain AR decoding (no draft head).
  ``key_buckets`` > 1: attention reads only the cache's first S / 2**i rows (i < key_buckets) while no slot
  needs more (``run_rounds``): a round's attention costs what the longest live request needs, not the
  capacity, for one compiled round body per bucket. ``per_request_sampling``: each request's temperature,
  top_k and top_p are read from the state (one program for any mix, greedy requests included; every
  sampled row pays a full-vocabulary sort); otherwise the engine's one setting is compiled in.

  KV caches are paged (``jetspec_jax.pages``): a pool of ``pages`` pages of ``page_rows`` rows (split evenly over
  the groups; None: every slot's capacity, ``slots * max_pages``, so nothing ever waits for pages) shared by the
  target's and the head's caches through one page table; a slot holds the pages its rows need, at most
  ``max_pages``. ``prefix_caching``: a request's full prompt pages (all but the page of its last prompt token) are
  keyed by their tokens; an admitted request takes the cached pages of its prompt's longest keyed prefix and
  prefills only the rest, and waits while an older request is computing pages it would share. ``max_model_len``: a
  request's prompt plus new tokens at most (None: max_prompt + max_new_tokens), which sizes a slot's page table
  and the attention's key length; memory is the pool's."""
  slots: int
  rows: int
  lanes: int
  prefill_rows: int
  max_prompt: int
  max_new_tokens: int
  queue: int
  groups: int = 1
  tree: TreeConfig | None = None
  key_buckets: int = 1
  per_request_sampling: bool = False
  page_rows: int = 16
  pages: int | None = None
  prefix_caching: bool = True
  max_model_len: int | None = None

  @property
  def committed_rows(self) -> int:
    """Rows one request can commit: its prompt and new tokens, at most ``max_model_len``."""
    committed = self.max_prompt + self.max_new_tokens
    return committed if self.max_model_len is None else min(committed, self.max_model_len)

  @property
  def prefix_pages(self) -> int:
    """Keyed prompt pages per request K (0 without prefix caching): the full pages before a prompt's last token."""
    return (self.max_prompt - 1) // self.page_rows if self.prefix_caching else 0

  def shared_pages(self, prompt_len: jax.Array) -> jax.Array:
    """Keyed pages of a prompt of ``prompt_len`` tokens (its last token is always computed: its logits are needed)."""
    return jnp.minimum(jnp.maximum(prompt_len - 1, 0) // self.page_rows, self.prefix_pages)

  def max_pages(self, head_cfg: DraftConfig | None) -> int:
    """Pages one slot can hold T: a full request and one round's scratch rows (``cache_lengths``)."""
    return pages.pages_for(max(self.cache_lengths(head_cfg)), self.page_rows)

  def pool_pages(self, head_cfg: DraftConfig | None) -> int:
    """Pages in the pool, over all groups."""
    return self.slots * self.max_pages(head_cfg) if self.pages is None else self.pages

  def scratch_rows(self, head_cfg: DraftConfig | None) -> int:
    """Rows a decoding slot writes past its committed ones in a round: its tree's nodes and the head's block."""
    return self.nodes if head_cfg is None else max(self.nodes, head_cfg.block_size)

  def request_pages(self, rows: int, head_cfg: DraftConfig | None) -> int:
    """Pages a request of ``rows`` prompt plus new tokens can come to hold."""
    return pages.pages_for(rows + self.scratch_rows(head_cfg), self.page_rows)

  @property
  def nodes(self) -> int:
    """Tree nodes per slot N (1 for AR: the root)."""
    return 1 if self.tree is None else self.tree.num_nodes()

  @property
  def budget_binds(self) -> bool:
    """Whether a round can offer more decode rows than it keeps (else every offered row is verified, unranked)."""
    return self.group_rows < self.slots // self.groups * self.nodes

  @property
  def prefill_budget(self) -> int:
    """Prompt rows per round over all groups: lanes x prefill_rows."""
    return self.lanes * self.prefill_rows

  @property
  def depth(self) -> int:
    return 0 if self.tree is None else self.tree.depth

  @property
  def group_rows(self) -> int:
    """Decode rows kept per group and round: rows / groups, at most all its slots' nodes."""
    return min(self.rows // self.groups, self.slots // self.groups * self.nodes)

  def key_lengths(self) -> tuple[int, ...]:
    """The attention key lengths of the buckets, ascending (multiples of 8, the last the cache's)."""
    full = self.cache_lengths(None)[0]
    return tuple(sorted({min(full, -(-(full >> i) // 8) * 8) for i in range(self.key_buckets)}))

  def cache_lengths(self, head_cfg: DraftConfig | None) -> tuple[int, int]:
    """(target, draft) cache rows per slot: a full request plus one round's scratch rows (tree nodes, the draft's
    block) past it, and a prompt's last lane (up to C rows from its last prompt row)."""
    committed = self.committed_rows
    lanes = self.max_prompt + self.prefill_rows
    draft = 0 if head_cfg is None else cache_rows(max(committed + head_cfg.block_size, lanes))
    return cache_rows(max(committed + self.nodes, lanes)), draft

  def validate(self, mesh=None) -> None:
    g = self.groups
    if min(self.slots, self.rows, self.lanes, self.prefill_rows, self.max_prompt, self.max_new_tokens, self.queue,
           g, self.key_buckets) < 1:
      raise JetSpecError(f"every engine size must be at least 1: {self}")
    if self.slots % g or self.rows % g or self.lanes % g:
      raise JetSpecError(f"slots ({self.slots}), rows ({self.rows}) and lanes ({self.lanes}) must split evenly "
                         f"over {g} groups")
    if self.rows < self.slots:
      raise JetSpecError(f"{self.rows} rows for {self.slots} slots: every slot needs a row for its root, so use "
                         f"rows >= {self.slots}")
    if self.page_rows < 8 or self.page_rows % 8:
      raise JetSpecError(f"page_rows {self.page_rows} is not a positive multiple of 8 (the Mosaic GPU kernel's TMA boxes start "
                         f"at multiples of 8 rows)")
    if self.max_model_len is not None and self.max_model_len < 2:
      raise JetSpecError(f"max_model_len {self.max_model_len} leaves no room for a prompt token and a new one")
    if self.pages is not None and (self.pages < g or self.pages % g):
      raise JetSpecError(f"{self.pages} KV pages do not split evenly over {g} groups")
    if mesh is not None and g % mesh.shape["data"]:
      raise JetSpecError(f"{g} engine groups do not split over the mesh's data axis of {mesh.shape['data']}")


@flax.struct.dataclass
class Queue:
  """Requests and their outputs per group g and entry q. QUEUED entries are admitted in order of their
  sequence numbers; rounds are the engine's round counter. A preempted request is QUEUED again with its tokens
  and counts so far (``_to_queue``) and resumes from them."""
  prompt: jax.Array        # [G, Q, T] int32
  prompt_len: jax.Array    # [G, Q]
  max_new: jax.Array       # [G, Q]
  key: jax.Array           # [G, Q, 2] uint32 PRNG key data (``jax.random.key_data``)
  temperature: jax.Array   # [G, Q] float32 (per-request sampling; 0: greedy)
  top_k: jax.Array         # [G, Q] int32 (0: off)
  top_p: jax.Array         # [G, Q] float32 (1: off)
  status: jax.Array        # [G, Q] EMPTY | QUEUED | RUNNING | FINISHED
  seq: jax.Array           # [G, Q] admission order
  tokens: jax.Array        # [G, Q, M] generated ids, -1 past num_tokens
  num_tokens: jax.Array    # [G, Q]
  steps: jax.Array         # [G, Q] decode rounds the request took part in (after its first token)
  depth_hist: jax.Array    # [G, Q, D+1] rounds that accepted exactly d draft tokens
  depth_visits: jax.Array  # [G, Q, D] the request's acceptance-profile counts (``decode.profile``)
  rank_hits: jax.Array     # [G, Q, D, W']
  rank_mass: jax.Array     # [G, Q, D, W']
  admitted: jax.Array      # [G, Q] round it took a slot
  first: jax.Array         # [G, Q] round its first token was drawn
  finished: jax.Array      # [G, Q] round it finished
  preempted: jax.Array     # [G, Q] times its slot was taken back for pages (its rows recomputed)
  page_keys: jax.Array     # [G, Q, K, 2] int32 keys of its prompt's first K full pages (``pages.prefix_keys``)
  cached: jax.Array        # [G, Q] prompt rows it took from the prefix cache (every admission summed)


@flax.struct.dataclass
class EngineState:
  """The loop state: the queue, B slots, the caches' pages and the round counters (see the module docstring).
  ``cache`` and ``draft_cache`` hold page pools [G, Pg, Hkv, R, Dh] per layer, read through ``pages.table``."""
  queue: Queue
  entry: jax.Array         # [B] queue entry of the slot's request (-1: free)
  seq: jax.Array           # [B] its sequence number (prefill lanes serve the oldest first)
  prompt_len: jax.Array    # [B] rows to prefill: the prompt (a resumed request's: and its tokens but the last)
  cached: jax.Array        # [B] of them, rows taken from the prefix cache at admission (its first prefix_len)
  max_new: jax.Array       # [B]
  key: jax.Array           # [B, 2] uint32 key data
  temperature: jax.Array   # [B] the request's sampling parameters (read with ``plan.per_request_sampling``)
  top_k: jax.Array         # [B]
  top_p: jax.Array         # [B]
  prefix_len: jax.Array    # [B]
  last_token: jax.Array    # [B]
  tokens: jax.Array        # [B, M]
  num_tokens: jax.Array    # [B]
  steps: jax.Array         # [B]
  first: jax.Array         # [B] the round its first token was drawn
  done: jax.Array          # [B] bool: its request finished this round (``flush`` hands it to the queue)
  cache: qwen3.KVCache
  draft_cache: qwen3.KVCache | None
  pages: pages.Pages       # the pool's allocator and the slots' page table [B, T]
  granted: jax.Array       # [B] bool: the slot holds the pages its next round writes (``with_control``)
  depth_hist: jax.Array    # [B, D+1]
  depth_visits: jax.Array  # [B, D] the request's acceptance-profile counts so far (``decode.profile``; read by
  rank_hits: jax.Array     # [B, D, W'] online calibration; W' = the tree's candidates)
  rank_mass: jax.Array     # [B, D, W']
  round: jax.Array         # [] rounds run
  busy: jax.Array          # [B] rounds the slot held a request (summed on the host: no reduction on device)
  control: jax.Array       # [3] int32 (pending, the next round's body, flush due): ``with_control``


def init_state(plan: EnginePlan, cfg: Qwen3Config, head_cfg: DraftConfig | None, cache_dtype, draft_dtype,
               mesh=None) -> EngineState:
  """An empty engine: free slots, an empty queue, zeroed caches (created in their shardings)."""
  g, q, b, m, t = plan.groups, plan.queue, plan.slots, plan.max_new_tokens, plan.max_prompt
  d = plan.depth
  w = 1 if plan.tree is None else plan.tree.num_candidates
  pool = (plan.groups, plan.pool_pages(head_cfg) // plan.groups, plan.page_rows)
  zi = lambda *shape: jnp.zeros(shape, jnp.int32)
  zf = lambda *shape: jnp.zeros(shape, jnp.float32)
  queue = Queue(prompt=zi(g, q, t), prompt_len=zi(g, q), max_new=zi(g, q),
                key=jnp.zeros((g, q) + key_shape(), jnp.uint32), temperature=zf(g, q), top_k=zi(g, q),
                top_p=zf(g, q) + 1, status=zi(g, q), seq=zi(g, q),
                tokens=jnp.full((g, q, m), -1, jnp.int32), num_tokens=zi(g, q), steps=zi(g, q),
                depth_hist=zi(g, q, d + 1), depth_visits=zi(g, q, d), rank_hits=zi(g, q, d, w),
                rank_mass=zf(g, q, d, w), admitted=zi(g, q), first=zi(g, q), finished=zi(g, q), preempted=zi(g, q),
                page_keys=zi(g, q, plan.prefix_pages, 2), cached=zi(g, q))
  draft_cache = None if head_cfg is None else draft_head.init_context_pool(head_cfg, *pool, draft_dtype, mesh)
  state = EngineState(queue=queue, entry=jnp.full((b,), -1, jnp.int32), seq=zi(b), prompt_len=zi(b), cached=zi(b),
                      max_new=zi(b),
                      key=jnp.zeros((b,) + key_shape(), jnp.uint32), temperature=zf(b), top_k=zi(b), top_p=zf(b) + 1,
                      prefix_len=zi(b), last_token=zi(b),
                      tokens=jnp.full((b, m), -1, jnp.int32), num_tokens=zi(b), steps=zi(b), first=zi(b),
                      done=jnp.zeros((b,), bool),
                      cache=qwen3.init_pool(cfg, *pool, cache_dtype, mesh), draft_cache=draft_cache,
                      pages=empty_pages(plan, head_cfg), granted=jnp.zeros((b,), bool),
                      depth_hist=zi(b, d + 1), depth_visits=zi(b, d), rank_hits=zi(b, d, w), rank_mass=zf(b, d, w),
                      round=jnp.zeros((), jnp.int32), busy=zi(b),
                      control=jnp.zeros((3,), jnp.int32))
  return place(state, mesh)


def empty_pages(plan: EnginePlan, head_cfg: DraftConfig | None) -> pages.Pages:
  """The allocator of an empty engine: every page free."""
  return pages.init_pages(plan.groups, plan.pool_pages(head_cfg) // plan.groups, plan.slots, plan.max_pages(head_cfg))


def reset(state: EngineState) -> EngineState:
  """``state`` emptied as ``init_state`` makes it (free slots, empty queues, every page free, counters 0), in
  place, its caches kept as they are: no row past a slot's ``prefix_len`` is ever read, and a free slot's is 0."""
  caches = (state.cache, state.draft_cache)
  p = state.pages
  empty = pages.init_pages(p.groups, p.pages_per_group, p.table.shape[0], p.table.shape[1])
  fresh = jax.tree.map(jnp.zeros_like, state.replace(cache=None, draft_cache=None, pages=None))
  neg = lambda x: jnp.full_like(x, -1)
  one = lambda x: jnp.ones_like(x)
  fresh = fresh.replace(queue=fresh.queue.replace(top_p=one(fresh.queue.top_p), tokens=neg(fresh.queue.tokens)),
                        entry=neg(fresh.entry), top_p=one(fresh.top_p), tokens=neg(fresh.tokens))
  return fresh.replace(cache=caches[0], draft_cache=caches[1], pages=empty)


def place(state: EngineState, mesh=None) -> EngineState:
  """Groups' queues and the slots over the mesh's data axis (caches are created sharded)."""
  if mesh is None:
    return state
  from jax.sharding import NamedSharding, PartitionSpec as P
  data = NamedSharding(mesh, P("data"))
  put = lambda x: jax.device_put(x, data)
  queue = jax.tree.map(put, state.queue)
  small = {f: put(getattr(state, f)) for f in ("entry", "seq", "prompt_len", "cached", "max_new", "key", "temperature", "top_k",
                                               "top_p", "prefix_len", "last_token", "tokens", "num_tokens", "steps", "first", "done",
                                               "depth_hist", "depth_visits", "rank_hits", "rank_mass", "busy",
                                               "granted")}
  return state.replace(queue=queue, pages=jax.tree.map(put, state.pages), **small)


def enqueue(state: EngineState, group: jax.Array, entry: jax.Array, seq: jax.Array, prompt: jax.Array,
            prompt_len: jax.Array, max_new: jax.Array, seed: jax.Array, key: jax.Array, own_key: jax.Array,
            temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, page_keys: jax.Array) -> EngineState:
  """Queue requests [R] at (group, entry) [R] (entries the host holds free: EMPTY, or FINISHED and already
  collected; the caller's to choose) with sequence numbers
  seq [R] (admission order and request ids), prompt [R, T], prompt_len, max_new [R], sampling parameters
  temperature, top_k, top_p [R] and PRNG keys: key data [R, 2] where own_key [R], else fold_in(key(seed), seq)
  (``seed`` [] uint32; derived here, so submitting costs no eager key arithmetic on the host) and its prompt's
  page keys [R, K, 2] (``pages.prefix_keys``)."""
  q = state.queue
  derived = jax.vmap(lambda i: jax.random.key_data(jax.random.fold_in(jax.random.key(seed), i)))(seq)
  key = jnp.where(own_key[:, None], key, derived)
  at = lambda a, v: a.at[group, entry].set(v, mode="drop")           # entry Q: padding
  queue = q.replace(prompt=at(q.prompt, prompt), prompt_len=at(q.prompt_len, prompt_len),
                    max_new=at(q.max_new, max_new), key=at(q.key, key), temperature=at(q.temperature, temperature),
                    top_k=at(q.top_k, top_k), top_p=at(q.top_p, top_p), status=at(q.status, QUEUED),
                    seq=at(q.seq, seq), tokens=at(q.tokens, -1), num_tokens=at(q.num_tokens, 0),
                    steps=at(q.steps, 0), depth_hist=at(q.depth_hist, 0), depth_visits=at(q.depth_visits, 0),
                    rank_hits=at(q.rank_hits, 0), rank_mass=at(q.rank_mass, 0), first=at(q.first, 0),
                    preempted=at(q.preempted, 0), page_keys=at(q.page_keys, page_keys), cached=at(q.cached, 0))
  return state.replace(queue=queue)


def drop(state: EngineState, group: jax.Array, entry: jax.Array) -> EngineState:
  """Cancel the requests at (group, entry) [R]: their queue entries EMPTY (a QUEUED one is never admitted)
  and the slots holding them free, their pages returned (``_admit`` resets a slot's rows when it takes the next
  request)."""
  per = state.entry.shape[0] // state.queue.status.shape[0]
  slot_group = jnp.arange(state.entry.shape[0]) // per
  held = jnp.any((state.entry[:, None] == entry[None, :]) & (slot_group[:, None] == group[None, :]), axis=1)
  held = held & (state.entry >= 0)
  status = state.queue.status.at[group, entry].set(EMPTY, mode="drop")       # entry Q: padding
  return state.replace(queue=state.queue.replace(status=status), entry=jnp.where(held, -1, state.entry),
                       prefix_len=jnp.where(held, 0, state.prefix_len), done=state.done & ~held,
                       pages=pages.release(state.pages, held, state.round), granted=state.granted & ~held)


def _admit(s: EngineState, plan: EnginePlan, mesh=None) -> EngineState:
  """Give each free slot the queued request of its group with the lowest sequence number (per group,
  vmapped: a group's slots read only its own queue). A resumed request brings its tokens and counts so far and
  prefills its prompt and its tokens but the last. With prefix caching, a request waits while a slot of its group
  is computing a keyed page of its prompt (it will share it), and an admitted one takes the cached pages of its
  prompt's longest keyed prefix (``pages.share``): its prefill starts after them."""
  g, per, r = plan.groups, plan.slots // plan.groups, plan.page_rows
  lowest = jnp.iinfo(jnp.int32).min
  by_group = lambda x: x.reshape((g, per) + x.shape[1:])

  def group(q: Queue, entry, prefix_len, keys):
    free = entry < 0
    candidate = q.status == QUEUED
    if plan.prefix_pages:
      shared = plan.shared_pages(q.prompt_len)                              # [Q]
      # Wait while a slot is computing a keyed page of the request's own prompt.
      e = jnp.maximum(entry, 0)
      frontier = prefix_len // r                                            # [S] its next page to compute
      computing = (entry >= 0) & (frontier < plan.shared_pages(q.prompt_len[e]))
      k = jnp.minimum(frontier, plan.prefix_pages - 1)
      same = jnp.all(q.page_keys[:, k] == q.page_keys[e, k][None], axis=-1) & (frontier[None, :] < shared[:, None])
      candidate = candidate & ~jnp.any(same & computing[None, :], axis=1)
      # Of queued requests whose first page is not cached yet, only the oldest of those sharing it computes it.
      first = q.page_keys[:, 0]                                             # [Q, 2]
      _, cached = pages.find(keys, first)
      family = jnp.all(first[:, None] == first[None, :], axis=-1) & (q.seq[None, :] < q.seq[:, None])
      older = jnp.any(family & candidate[None, :] & (shared[None, :] > 0), axis=1)
      candidate = candidate & ~(older & (shared > 0) & ~cached)
    best, waiting = jax.lax.top_k(jnp.where(candidate, -q.seq, lowest), min(per, plan.queue))
    rank = jnp.cumsum(free) - 1
    ok = free & (rank < best.shape[0])
    rank = jnp.minimum(rank, best.shape[0] - 1)
    admit = ok & (best[rank] > lowest)
    new_entry = waiting[rank]
    dropped = jnp.where(admit, new_entry, plan.queue)                     # out of range: not written
    first_time = (q.num_tokens == 0) & (q.preempted == 0)
    q = q.replace(status=q.status.at[dropped].set(RUNNING, mode="drop"),
                  admitted=q.admitted.at[jnp.where(first_time[new_entry], dropped, plan.queue)].set(s.round,
                                                                                                   mode="drop"))
    fields = ("prompt_len", "max_new", "key", "seq", "temperature", "top_k", "top_p", "tokens", "num_tokens", "steps",
              "first", "depth_hist", "depth_visits", "rank_hits", "rank_mass", "page_keys")
    return q, admit, new_entry, {f: getattr(q, f)[new_entry] for f in fields}

  queue, admit, new_entry, got = per_data_shard(jax.vmap(group), mesh)(s.queue, by_group(s.entry),
                                                                       by_group(s.prefix_len), s.pages.key)
  fresh = admit.reshape(-1)
  keys = got.pop("page_keys").reshape(plan.slots, plan.prefix_pages, 2)
  pick = lambda new, old: jnp.where(fresh.reshape((-1,) + (1,) * (old.ndim - 1)), new.reshape(old.shape), old)
  got = {f: pick(v, getattr(s, f)) for f, v in got.items()}
  allocator, cached = s.pages, jnp.zeros_like(s.prefix_len)
  if plan.prefix_pages:
    allocator, hits = per_data_shard(pages.share, mesh)(s.pages, fresh, keys, plan.shared_pages(got["prompt_len"]))
    cached = hits * r
    add = lambda c, e, n: c.at[e].add(n, mode="drop")
    queue = queue.replace(cached=jax.vmap(add)(queue.cached, jnp.where(admit, new_entry, plan.queue),
                                               by_group(cached)))
  got["prompt_len"] = got["prompt_len"] + jnp.where(fresh, jnp.maximum(got["num_tokens"] - 1, 0), 0)
  got["last_token"] = pick(jnp.take_along_axis(got["tokens"], jnp.maximum(got["num_tokens"] - 1, 0)[:, None],
                                               axis=1)[:, 0], s.last_token)
  return s.replace(queue=queue, entry=pick(new_entry, s.entry), prefix_len=pick(cached, s.prefix_len),
                   cached=pick(cached, s.cached), pages=allocator, done=s.done & ~fresh, **got)


def _register(s: EngineState, plan: EnginePlan, mesh=None) -> EngineState:
  """Key the full prompt pages every held slot has computed (``pages.register``): later requests may share them."""
  if not plan.prefix_pages:
    return s
  g, per = plan.groups, plan.slots // plan.groups
  e = jnp.maximum(s.entry, 0).reshape(g, per)
  keys = jax.vmap(lambda k, e: k[e])(s.queue.page_keys, e).reshape(plan.slots, plan.prefix_pages, 2)
  prompt = jax.vmap(lambda n, e: n[e])(s.queue.prompt_len, e).reshape(-1)
  count = jnp.where(s.entry >= 0, jnp.minimum(plan.shared_pages(prompt), s.prefix_len // plan.page_rows), 0)
  return s.replace(pages=per_data_shard(pages.register, mesh)(s.pages, keys, count))


def _lanes(s: EngineState, plan: EnginePlan, prefilling: jax.Array, mesh):
  """Each group's prefill lanes: its prefilling slots oldest request first, each taking ceil(remaining / C)
  consecutive lanes (chunks of its prompt) while the group's L/G lanes last. Returns (lane slot [G, L/G] within
  the group, slots_per_group for an idle lane; lane start [G, L/G]: its first prompt row; prompt rows
  [G * L/G, C])."""
  g, per, lanes, c = plan.groups, plan.slots // plan.groups, plan.lanes // plan.groups, plan.prefill_rows
  last = jnp.iinfo(jnp.int32).max

  def group(q: Queue, waiting, seq, entry, prefix, prompt_len):
    order = jnp.argsort(jnp.where(waiting, seq, last))                   # waiting slots first, oldest first
    need = jnp.where(waiting, -(-(prompt_len - prefix) // c), 0)[order]
    end = jnp.cumsum(need)
    j = jnp.arange(lanes)
    i = jnp.sum(end[None, :] <= j[:, None], axis=1)                       # position in ``order`` of lane j's slot
    live = i < per
    i = jnp.minimum(i, per - 1)
    slot = jnp.where(live, order[i], per).astype(jnp.int32)
    start = jnp.where(live, prefix[order[i]] + (j - (end[i] - need[i])) * c, 0).astype(jnp.int32)
    cols = start[:, None] + jnp.arange(c)[None, :]
    e = jnp.maximum(entry[order[i]], 0)[:, None]
    # The prompt, then (a resumed request) its tokens.
    plen = q.prompt_len[e]
    ids = jnp.where(cols < plen, q.prompt[e, jnp.clip(cols, 0, plan.max_prompt - 1)],
                    q.tokens[e, jnp.clip(cols - plen, 0, plan.max_new_tokens - 1)])
    return slot, start, ids

  by_group = lambda x: x.reshape(g, per)
  slot, start, rows = per_data_shard(jax.vmap(group), mesh)(s.queue, by_group(prefilling), by_group(s.seq),
                                                            by_group(s.entry), by_group(s.prefix_len),
                                                            by_group(s.prompt_len))
  return slot, start, rows.reshape(plan.lanes, c)


def _to_queue(s: EngineState, plan: EnginePlan, slots: jax.Array, status: int, mesh=None) -> EngineState:
  """The requests of ``slots`` [B] bool back to their queue entries with their tokens and counts (``FINISHED``: done
  this round; ``QUEUED``: preempted, to resume from them) and the slots freed (prefix_len 0: attention reads nothing
  of them), their pages returned."""
  g, per = plan.groups, plan.slots // plan.groups
  by_group = lambda x: x.reshape((g, per) + x.shape[1:])
  values = dict(tokens=s.tokens, num_tokens=s.num_tokens, steps=s.steps, first=s.first, depth_hist=s.depth_hist,
                depth_visits=s.depth_visits, rank_hits=s.rank_hits, rank_mass=s.rank_mass)
  recomputed = (s.prefix_len > s.cached).astype(jnp.int32)        # rows of its own computed: recomputed later

  def group(q: Queue, at, vals, again):
    put = lambda a, v: a.at[at].set(v, mode="drop")
    if status == FINISHED:
      q = q.replace(finished=put(q.finished, s.round - 1))
    else:
      q = q.replace(preempted=q.preempted.at[at].add(again, mode="drop"))
    return q.replace(status=put(q.status, status), **{k: put(getattr(q, k), v) for k, v in vals.items()})

  at = by_group(jnp.where(slots, s.entry, plan.queue))
  queue = jax.vmap(group)(s.queue, at, {k: by_group(v) for k, v in values.items()}, by_group(recomputed))
  # A freed slot's counts go too: online calibration over the batch reads the requests holding slots.
  free = lambda x: jnp.where(slots.reshape((-1,) + (1,) * (x.ndim - 1)), jnp.zeros_like(x), x)
  release = functools.partial(pages.release, now=s.round)
  return s.replace(queue=queue, entry=jnp.where(slots, -1, s.entry), prefix_len=free(s.prefix_len),
                   cached=free(s.cached), rank_hits=free(s.rank_hits), rank_mass=free(s.rank_mass),
                   done=s.done & ~slots, pages=per_data_shard(release, mesh)(s.pages, slots),
                   granted=s.granted & ~slots)


def flush(s: EngineState, program: RoundProgram) -> EngineState:
  """Between rounds: every done slot's request (tokens, counts, rounds) goes to its queue entry (FINISHED) and
  the slot is freed, then free slots are admitted (``_admit``), the next round's pages granted (``with_control``)
  and, where pages ran out, slots handed back to the queue (``QUEUED``): those refused that hold no rows of their
  own yet (the request waits, in order) and, in a group where a slot holding rows of its own was refused, its
  newest slot holding rows of its own (preemption: its pages go to older requests; it resumes later from its tokens).
  First, the prompt pages computed so far are keyed for prefix caching (``_register``). Rounds run between flushes
  without touching the queue."""
  plan, mesh = program.plan, program.mesh
  g, per = plan.groups, plan.slots // plan.groups
  s = _to_queue(_register(s, plan, mesh), plan, s.done, FINISHED, mesh)
  s = with_control(_admit(s, plan, mesh), program)
  held = s.entry >= 0
  refused = held & ~s.granted
  waits = refused & (s.prefix_len <= s.cached)
  stuck = jnp.any((refused & ~waits).reshape(g, per), axis=1)                                # [G]
  newest = jnp.argmax(jnp.where(held & ~waits & (s.pages.held > 0), s.seq, -1).reshape(g, per), axis=1)
  victim = (jax.nn.one_hot(newest, per, dtype=bool) & stuck[:, None]).reshape(-1) & held & ~waits
  requeue = waits | victim
  # Right after admission a free slot makes no flush due: whom it could admit waits (for pages, or for a prefix
  # being computed) until a round has run.
  return with_control(_to_queue(s, plan, requeue, QUEUED, mesh), program, admitting=False)


@dataclasses.dataclass(frozen=True)
class RoundProgram:
  """Everything static in the engine's compiled loop, hashable: ``run_rounds``' one static argument. The plan,
  the target's and head's configurations, EOS ids, the sampling regime (``decode.regime``), the attention
  implementation, the mesh and the drafter (``speculative.Drafter``: a speculative round's per-depth logits)."""
  plan: EnginePlan
  cfg: Qwen3Config
  head_cfg: DraftConfig | None
  eos_ids: tuple[int, ...]
  regime: Regime
  attn_impl: object = "xla"
  mesh: object = None
  drafter: Drafter = head_drafter


@flax.struct.dataclass
class Slots:
  """What a round knows of its slots [B] before it runs: which hold a request, are prefilling or decoding, the
  round's keys (``sampling.step_keys`` at the request's next decode step) and the decoding slots' sampling
  parameters (``regime.slot_settings``; empty for a compiled setting)."""
  held: jax.Array
  prefilling: jax.Array
  decoding: jax.Array
  keys: jax.Array           # [B] the requests' PRNG keys
  round_keys: jax.Array     # [B]
  settings: tuple


@flax.struct.dataclass
class Offer:
  """The decode rows the slots offer, in the [B, N] layout: token ids, positions, the attention mask [B, N, N]
  (a node sees its ancestors and itself) and priority (``budget.ROOT`` for a decoding slot's root, its node
  scores, -inf where nothing is offered). Speculative: the round's tree, the processed draft log-probs
  (None when greedy) and the draft cache with the round's context rows; AR: None."""
  tokens: jax.Array
  positions: jax.Array
  mask: jax.Array
  priority: jax.Array
  tree: Tree | None = None
  draft_logp: jax.Array | None = None
  draft_cache: qwen3.KVCache | None = None


@flax.struct.dataclass
class Batch:
  """The rows one target forward verifies: where they live (``packed``: the kept decode rows [G, K], then the
  lanes' prompt rows), which offered rows were kept (``chosen`` [B, N]; ``live`` [G, K]: a packed row holds one),
  token ids and positions [G, K + L * C], the mask [B, N, N] over kept nodes, the lanes' positions [G * L, C],
  and per lane [G * L]: whether it serves a slot, its prompt rows left from its start and the rows it takes."""
  packed: PackedRows
  live: jax.Array
  chosen: jax.Array
  tokens: jax.Array
  positions: jax.Array
  mask: jax.Array
  lane_positions: jax.Array
  lane_live: jax.Array
  lane_remaining: jax.Array
  lane_take: jax.Array


@flax.struct.dataclass
class Verified:
  """The target forward's outputs: decode rows' logits [G, K, V], the logits of each lane's last prompt row
  [G * L, V], the caches with the round's rows written, and the head's taps of every row [G, K + L * C, F]."""
  logits: jax.Array
  lane_logits: jax.Array | None
  cache: qwen3.KVCache
  taps: jax.Array | None


@flax.struct.dataclass
class Accepted:
  """Per slot [B]: the tokens a decoding slot commits (``new`` [B, D+1], ``count`` of them), its next anchor
  (``correction``), the tree's acceptance (speculative) and the tree narrowed to the kept nodes; a prefilling
  slot's ``consumed`` prompt rows, whether its prompt ``completes`` and then its ``first_token``."""
  new: jax.Array
  count: jax.Array
  correction: jax.Array
  acceptance: verify.Acceptance | None
  tree: Tree | None
  consumed: jax.Array
  completes: jax.Array
  first_token: jax.Array


def _slots(s: EngineState, p: RoundProgram) -> Slots:
  held = s.entry >= 0
  runs = held & s.granted                     # a slot refused pages sits the round out (``flush`` settles it)
  prefilling = runs & (s.prefix_len < s.prompt_len)
  decoding = runs & ~prefilling
  keys = jax.random.wrap_key_data(s.key)
  return Slots(held=held, prefilling=prefilling, decoding=decoding, keys=keys,
               round_keys=sampling.step_keys(keys, s.steps + 1), settings=p.regime.slot_settings(s, decoding))


def _offer(target_params, head_params, s: EngineState, slots: Slots, p: RoundProgram) -> Offer:
  """Draft (speculative): the drafter's per-depth logits, the round's tree and its nodes' priorities."""
  plan, tree_cfg, regime = p.plan, p.plan.tree, p.regime
  b, n = plan.slots, plan.nodes
  if tree_cfg is None:
    return Offer(tokens=s.last_token[:, None], positions=s.prefix_len[:, None], mask=jnp.ones((b, 1, 1), bool),
                 priority=jnp.where(slots.decoding, budget.ROOT, -jnp.inf)[:, None])
  with jax.named_scope("jetspec_draft"):
    view = DraftView(cache=s.cache, draft_cache=s.draft_cache, last_token=s.last_token, prefix_len=s.prefix_len,
                     keys=slots.round_keys, table=s.pages.table)
    depth_logits, draft_cache = p.drafter(target_params, head_params, view, cfg=p.cfg, head_cfg=p.head_cfg,
                                          tree_cfg=tree_cfg, attn_impl=p.attn_impl, mesh=p.mesh)
  with jax.named_scope("jetspec_tree"):
    def tree_and_scores(anchor, logits, round_keys, hits, mass, *rows):
      def build(t, k, top_p):
        tree, draft_logp = build_round_tree(anchor, logits, round_keys, tree_cfg, temperature=t, top_k=k,
                                            top_p=top_p, accept=regime.accept, counts=(hits, mass))
        if not plan.budget_binds:            # every offered node is kept: no scores to rank them by
          return tree, draft_logp, jnp.zeros(tree.tokens.shape, jnp.float32)
        # The shape's log-probs (sorted top-W): with the rejection rule the tree holds sampled tokens, and
        # what a round keeps must not depend on which were drawn.
        shape_logp = tree.candidate_logp
        if draft_logp is not None and regime.accept == "rejection":
          shape_logp = jax.lax.top_k(draft_logp, tree_cfg.num_candidates)[0]
          if not sampling.is_fixed(t, k, top_p):
            shape_logp = jnp.where((t <= 0)[:, None, None], tree.candidate_logp, shape_logp)
        return tree, draft_logp, budget.node_scores(tree, budget.rank_scores(shape_logp, tree_cfg, (hits, mass)))
      return regime.tree(build, *rows)

    if not regime.greedy:                    # sampling's per-row sorts want whole rows (sharding.whole_vocab)
      depth_logits = whole_vocab(depth_logits, p.mesh)
    tree, draft_logp, scores = per_data_shard(tree_and_scores, p.mesh)(s.last_token, depth_logits, slots.round_keys,
                                                                       s.rank_hits, s.rank_mass, *slots.settings)
  node_priority = jnp.where(tree.valid, jnp.where(jnp.arange(n) == 0, budget.ROOT, scores), -jnp.inf)
  return Offer(tokens=tree.tokens, positions=s.prefix_len[:, None] + tree.depths, mask=tree.ancestors,
               priority=jnp.where(slots.decoding[:, None], node_priority, -jnp.inf), tree=tree,
               draft_logp=draft_logp, draft_cache=draft_cache)


def _pack(s: EngineState, slots: Slots, offer: Offer, p: RoundProgram, key_len: int | None,
          prefill: bool) -> Batch:
  """Budget: each group keeps its ``plan.group_rows`` best offered rows; the prefill lanes (``_lanes``) join them."""
  plan = p.plan
  g, per, n, c = plan.groups, plan.slots // plan.groups, plan.nodes, plan.prefill_rows
  with jax.named_scope("jetspec_budget"):
    if plan.budget_binds:
      pack = functools.partial(budget.pack, rows=plan.group_rows, slots_per_group=per, nodes=n)
      slot, node, live, index = per_data_shard(pack, p.mesh)(offer.priority.reshape(g, per * n))
    else:                                     # every offered row is kept, in the [B, N] layout's own order
      live = offer.priority.reshape(g, per * n) > -jnp.inf
      index = jnp.broadcast_to(jnp.arange(per * n, dtype=jnp.int32), live.shape)
      slot, node = jnp.where(live, index // n, per).astype(jnp.int32), index % n
    if prefill:
      lane_slot, lane_start, lane_tokens = _lanes(s, plan, slots.prefilling, p.mesh)
    else:
      lane_slot = lane_start = jnp.zeros((g, 0), jnp.int32)
      lane_tokens = jnp.zeros((0, c), jnp.int32)
    # Decode rows are written at prefix_len: past every committed row (a prefilling slot's lanes write after them).
    packed = PackedRows(slot=slot, node=node, lane_slot=lane_slot, lane_start=lane_start, write_start=s.prefix_len,
                        slots_per_group=per, nodes=n, lane_rows=c, key_len=key_len, dense=not plan.budget_binds)
    chosen = packed.scatter(live[..., None])[..., 0]                                   # [B, N]
    flat = ((lambda x: x.reshape(g, per * n)) if packed.dense else
            (lambda x: jnp.take_along_axis(x.reshape(g, per * n), index, axis=1)))
    lane_positions = packed.lane_start.reshape(-1)[:, None] + jnp.arange(c)[None, :]
    join = lambda dec_rows, lane_rows: jnp.concatenate([dec_rows, lane_rows.reshape(g, -1)], axis=1)
    # A lane's prompt rows this round (its slot's rows left from the lane's start, at most C).
    lane_remaining = packed.lane_sequences(s.prompt_len) - packed.lane_start.reshape(-1)
    lane_live = packed.lane_slot.reshape(-1) < per
    return Batch(packed=packed, live=live, chosen=chosen, tokens=join(flat(offer.tokens), lane_tokens),
                 positions=join(flat(offer.positions), lane_positions),
                 mask=(offer.mask & chosen[:, None, :]) | jnp.eye(n, dtype=bool)[None],
                 lane_positions=lane_positions, lane_live=lane_live, lane_remaining=lane_remaining,
                 lane_take=jnp.where(lane_live, jnp.minimum(lane_remaining, c), 0))


def _verify(target_params, s: EngineState, slots: Slots, batch: Batch, p: RoundProgram) -> Verified:
  """ONE target forward over the kept decode rows and the lanes' rows; logits of the decode rows and of each
  lane's last prompt row."""
  target = qwen3.bind(p.cfg, target_params)
  with jax.named_scope("jetspec_verify"):
    taps_at = () if p.plan.tree is None else p.head_cfg.target_layer_ids
    # Slots not decoding attend from row 0 (their decode rows are discarded): nothing of them is read.
    h, cache, taps = target.hidden(batch.tokens, batch.positions, batch.mask, cache=s.cache,
                                   prefix_len=jnp.where(slots.decoding, s.prefix_len, 0), tap_layers=taps_at,
                                   attn_impl=p.attn_impl, mesh=p.mesh, packed=batch.packed, table=s.pages.table)
    h_dec, h_lane = batch.packed.split(h)
    lane_logits = None
    if batch.packed.num_lanes:
      last = jnp.take_along_axis(h_lane, jnp.maximum(batch.lane_take - 1, 0)[:, None, None], axis=1)[:, 0]
      lane_logits = target.logits(last)                                                # [G * L, V]
    return Verified(logits=target.logits(h_dec), lane_logits=lane_logits, cache=cache, taps=taps)


def _accept(s: EngineState, slots: Slots, offer: Offer, batch: Batch, verified: Verified,
            p: RoundProgram) -> Accepted:
  """Accept (greedy or sampled, as ``p.regime``) each decoding slot's tokens; a completed prompt's first token."""
  plan, regime, mesh, packed = p.plan, p.regime, p.mesh, batch.packed
  b, n, d = plan.slots, plan.nodes, plan.depth
  per = plan.slots // plan.groups
  with jax.named_scope("jetspec_accept"):
    consumed, completes, first = jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool), jnp.zeros((b,), jnp.int32)
    if packed.num_lanes:                      # the lane holding a prompt's last row draws its slot's first token
      lane_completes = batch.lane_live & (batch.lane_take == batch.lane_remaining)
      lane_keys = sampling.step_keys(packed.lane_sequences(slots.keys), 0)
      lane_first = regime.first_tokens(verified.lane_logits, lane_keys, mesh,
                                       *regime.lane_settings(s, packed.lane_sequences))
      consumed = packed.sum_lane_sequences(batch.lane_take)
      completes = packed.set_lane_sequences(jnp.zeros((b,), bool), lane_completes, keep=lane_completes)
      first = packed.set_lane_sequences(jnp.zeros((b,), jnp.int32), lane_first, keep=lane_completes)
    # Row r of the [B, N] layout -> its packed row (for logits; unchosen rows read packed row 0).
    row_of = packed.scatter(jnp.broadcast_to(jnp.arange(plan.group_rows, dtype=jnp.int32), batch.live.shape)[..., None])[..., 0]

    def node_logits(cols):                                                   # cols [B, R] -> [B, R, V]
      rows = jnp.take_along_axis(row_of, cols, axis=1).reshape(plan.groups, per, -1)
      out = jax.vmap(lambda lg, r: lg[r])(verified.logits, rows)
      return whole_vocab(out.reshape((b,) + out.shape[2:]), mesh)

    argmax_next = None
    if regime.argmax:
      argmax_next = packed.scatter(jnp.argmax(verified.logits, axis=-1).astype(jnp.int32)[..., None])[..., 0]  # [B, N]
    if plan.tree is None:
      new = regime.ar_tokens(lambda: node_logits(jnp.zeros((b, 1), jnp.int32)), slots.round_keys, argmax_next, mesh,
                             *slots.settings)
      return Accepted(new=new, count=jnp.ones((b,), jnp.int32), correction=new[:, 0], acceptance=None, tree=None,
                      consumed=consumed, completes=completes, first_token=first)
    tree = offer.tree.replace(valid=offer.tree.valid & batch.chosen)
    acc = regime.accept_tree(tree, lambda: node_logits(jnp.broadcast_to(jnp.arange(n), (b, n))), offer.draft_logp,
                             slots.round_keys, argmax_next, mesh, *slots.settings, depth=d,
                             width=plan.tree.num_candidates)
    new, count = verify.accepted_tokens(tree, acc)
    return Accepted(new=new, count=count, correction=acc.correction, acceptance=acc, tree=tree, consumed=consumed,
                    completes=completes, first_token=first)


def _commit(head_params, s: EngineState, slots: Slots, offer: Offer, batch: Batch, verified: Verified,
            accepted: Accepted, p: RoundProgram) -> EngineState:
  """Commit: tokens, lengths and counts; the speculative caches compacted to the accepted path and the head's
  context rows appended. A slot whose request finished is ``done`` (``flush`` frees it after the round)."""
  plan, packed = p.plan, batch.packed
  b, d = plan.slots, plan.depth
  decoding = slots.decoding
  with jax.named_scope("jetspec_commit"):
    out, num, done_dec, appended = verify.commit_tokens(s.tokens, s.num_tokens, ~decoding, accepted.new,
                                                        accepted.count, p.eos_ids, s.max_new)
    finished = decoding & done_dec
    prefix_len = s.prefix_len + jnp.where(decoding, appended, 0)
    last_token = jnp.where(decoding, accepted.correction, s.last_token)
    first_round = s.first
    if packed.num_lanes:                      # prompts completed this round: their first tokens
      # (a resumed request's prefill ends at its tokens but the last: its ``last_token`` since admission)
      completes = accepted.completes & (s.num_tokens == 0)
      out, num, done_first, _ = verify.commit_tokens(out, num, ~completes, accepted.first_token[:, None],
                                                     jnp.ones((b,), jnp.int32), p.eos_ids, s.max_new)
      finished = finished | (completes & done_first)
      prefix_len = prefix_len + accepted.consumed
      last_token = jnp.where(completes, accepted.first_token, last_token)
      first_round = jnp.where(completes, s.round, s.first)
    cache = verified.cache
    depth_hist, depth_visits, rank_hits, rank_mass = s.depth_hist, s.depth_visits, s.rank_hits, s.rank_mass
    draft_cache = None
    if plan.tree is None:
      depth_hist = depth_hist + decoding[:, None].astype(jnp.int32)
    else:
      acc = accepted.acceptance
      head = draft_head.bind(p.head_cfg, head_params)
      table = s.pages.table
      cache = verify.compact_cache(cache, s.prefix_len, jnp.where(decoding[:, None], acc.path, jnp.arange(d + 1)),
                                   table, max(plan.nodes, d + 1))
      taps_dec, taps_lane = packed.split(verified.taps)
      path_taps = jnp.take_along_axis(packed.scatter(taps_dec), acc.path[:, :, None], axis=1)     # [B, D+1, F]
      draft_cache = head.append_context(offer.draft_cache, path_taps, s.prefix_len, table)
      if packed.num_lanes:                    # the lanes' context rows, each written in place at its own row
        lane_ctx = head.context_kv(taps_lane, batch.lane_positions)      # per layer [G * L, Hkv, C, Dh]
        seq, at = packed.lane_cache_rows()
        rows_of = lambda x: x.transpose(0, 2, 1, 3).reshape((plan.groups, -1) + x.shape[1:2] + x.shape[3:])
        write = lambda c_, rows: packed.put_rows(c_, rows_of(rows), seq, at, table)
        draft_cache = qwen3.KVCache(k=tuple(write(c_, k) for c_, (k, _) in zip(draft_cache.k, lane_ctx)),
                                    v=tuple(write(c_, v) for c_, (_, v) in zip(draft_cache.v, lane_ctx)))
      depth_hist = depth_hist + jax.nn.one_hot(acc.accepted, d + 1, dtype=jnp.int32) * decoding[:, None]
      visits, hits, mass = observe_ranks(accepted.tree, acc, accepted.new, decoding)
      depth_visits, rank_hits, rank_mass = depth_visits + visits, rank_hits + hits, rank_mass + mass
  return s.replace(prefix_len=prefix_len, last_token=last_token, tokens=out, num_tokens=num,
                   steps=s.steps + decoding.astype(jnp.int32), first=first_round, done=finished, cache=cache,
                   draft_cache=draft_cache, depth_hist=depth_hist, depth_visits=depth_visits, rank_hits=rank_hits,
                   rank_mass=rank_mass, round=s.round + 1, busy=s.busy + slots.held.astype(jnp.int32))


def engine_round(target_params, head_params, s: EngineState, *, program: RoundProgram, key_len: int | None = None,
                 prefill: bool = True) -> EngineState:
  """One round of every slot, as its stages (module docstring): draft (``_offer``), budget and lanes
  (``_pack``), one target forward (``_verify``), acceptance (``_accept``), commit (``_commit``); admission and
  finishing run between rounds (``flush``). ``key_len``: the target's attention reads cache rows < key_len only
  (the caller checks no slot needs more). ``prefill`` False: the body without lanes (no slot is prefilling)."""
  slots = _slots(s, program)
  offer = _offer(target_params, head_params, s, slots, program)
  batch = _pack(s, slots, offer, program, key_len, prefill)
  verified = _verify(target_params, s, slots, batch, program)
  accepted = _accept(s, slots, offer, batch, verified, program)
  return _commit(head_params, s, slots, offer, batch, verified, accepted, program)


def with_control(s: EngineState, program: RoundProgram, admitting: bool = True) -> EngineState:
  """The state with the next round's pages granted and ``control`` = (pending: a slot holds a request or one is
  queued; the next round's body, 2 * key bucket + prefilling: the shortest of ``plan.key_lengths()`` no held
  slot's rows reach past, and whether a slot is prefilling; flush due: a slot is done, a slot was refused pages, or
  a slot is free while its group's oldest queued request would get pages, unless not ``admitting``: right after a
  flush admitted whom it could). Pages: each held slot is given those
  its rows up to the end of its next round need (its committed rows, or a prefilling slot's whole prompt, plus
  ``scratch_rows``), oldest request first (``pages.grow``; ``granted``). The control's values come from ONE max
  over the slots (the only reduction across data shards of a round)."""
  plan = program.plan
  g, per = plan.groups, plan.slots // plan.groups
  held = s.entry >= 0
  prefilling = held & (s.prefix_len < s.prompt_len)
  lane_rows = jnp.minimum(s.prompt_len, s.prefix_len + plan.prefill_budget // g)
  scratch = plan.scratch_rows(program.head_cfg)
  active = held & ~s.done                              # a done slot writes nothing more (``flush`` frees it)
  # A prefilling slot holds pages for its whole prefill and first round from the start: it never waits mid-prompt.
  rows = jnp.where(active, jnp.maximum(s.prefix_len, s.prompt_len) + scratch, 0)
  grow = functools.partial(pages.grow, page_rows=plan.page_rows)
  allocator, granted = per_data_shard(grow, program.mesh)(s.pages, rows, s.seq)
  granted = granted | ~held
  # Each group's oldest queued request: would the pages of its whole prefill be free now?
  q = s.queue
  waiting = q.status == QUEUED
  oldest = jnp.argmin(jnp.where(waiting, q.seq, jnp.iinfo(jnp.int32).max), axis=1)
  first = lambda x: jnp.take_along_axis(x, oldest[:, None], axis=1)[:, 0]
  fill = first(q.prompt_len) + jnp.maximum(first(q.num_tokens) - 1, 0)
  first_pages = pages.pages_for(fill + scratch, plan.page_rows)
  admissible = jnp.repeat(jnp.any(waiting, axis=1) & (first_pages <= allocator.free_count()), per)   # [B]
  lane_reach = lane_rows + plan.prefill_rows
  # Every slot's decode rows sit somewhere in the [B, W] layout (row 0 onwards when not decoding).
  needed = jnp.where(held, jnp.where(prefilling, lane_reach, s.prefix_len + plan.nodes), 0)
  queued = jnp.repeat(jnp.any(waiting, axis=1), per)
  due = s.done | (~held & admissible & admitting) | ~granted
  pending, needed, prefill, due = jnp.max(jnp.stack([held | queued, needed, prefilling, due], axis=1).astype(jnp.int32),
                                          axis=0)
  lengths = plan.key_lengths()
  bucket = jnp.minimum(jnp.sum(jnp.asarray(lengths) < jnp.maximum(needed, plan.nodes)), len(lengths) - 1)
  return s.replace(pages=allocator, granted=granted,
                   control=jnp.stack([pending, 2 * bucket + prefill, due]).astype(jnp.int32))


@flax.struct.dataclass
class Report:
  """What one ``run_rounds`` call hands the host, in buffers of its own: the state is donated to the next call,
  a report is not, so the host reads it while the next call runs. W: the token window (``token_window``: at
  least the tokens one request can commit in the call). Per queue entry [G, Q]: ``ended`` (FINISHED), ``queued``
  (QUEUED: waiting, or preempted with its tokens so far), ``seq``, ``num`` tokens, ``start`` (the tokens it had
  when the call began), ``tail`` [G, Q, W] (its tokens from ``start`` on) and its counts (``RequestResult``); per
  slot [B], for the request it holds at the end (``slot_entry`` -1: none): the same token fields; ``round``: the
  engine's round counter at the end (int32, wrapping), ``busy`` [B]: rounds each slot held a request in the call,
  ``free_pages`` [G]: each group's free pages at the end (``cached_pages`` [G] of them hold prefix-cached rows)."""
  ended: jax.Array
  queued: jax.Array
  seq: jax.Array
  num: jax.Array
  start: jax.Array
  tail: jax.Array
  steps: jax.Array
  depth_hist: jax.Array
  depth_visits: jax.Array
  rank_hits: jax.Array
  rank_mass: jax.Array
  admitted: jax.Array
  first: jax.Array
  finished: jax.Array
  preempted: jax.Array
  cached: jax.Array
  slot_entry: jax.Array
  slot_seq: jax.Array
  slot_num: jax.Array
  slot_start: jax.Array
  slot_tail: jax.Array
  round: jax.Array
  busy: jax.Array
  free_pages: jax.Array
  cached_pages: jax.Array


def token_window(plan: EnginePlan, rounds: int) -> int:
  """The report's token window for a call of at most ``rounds`` rounds: a round commits at most depth + 1
  tokens of a request; a power of two (few programs), at most ``max_new_tokens``."""
  need = max(1, rounds) * (plan.depth + 1)
  return min(plan.max_new_tokens, 1 << (need - 1).bit_length())


def _report(begin: EngineState, s: EngineState, plan: EnginePlan, window: int) -> Report:
  """The report of a call that began at ``begin`` and ended at ``s`` (``Report``)."""
  g, per, q = plan.groups, plan.slots // plan.groups, s.queue
  cols = lambda start: jnp.clip(start[..., None] + jnp.arange(window), 0, plan.max_new_tokens - 1)
  # Per entry, its tokens when the call began: the queue's count (waiting or preempted: its tokens so far), or the
  # slot's that held it then.
  start = jax.vmap(lambda n, e, m: n.at[jnp.where(e >= 0, e, plan.queue)].set(m, mode="drop"))(
      begin.queue.num_tokens * (begin.queue.status == QUEUED), begin.entry.reshape(g, per),
      begin.num_tokens.reshape(g, per))
  slot_start = jax.vmap(lambda st, e: st[jnp.maximum(e, 0)])(start, s.entry.reshape(g, per)).reshape(-1)
  return Report(ended=q.status == FINISHED, queued=q.status == QUEUED, seq=q.seq, num=q.num_tokens, start=start,
                tail=jnp.take_along_axis(q.tokens, cols(start), axis=2), steps=q.steps, depth_hist=q.depth_hist,
                depth_visits=q.depth_visits, rank_hits=q.rank_hits, rank_mass=q.rank_mass, admitted=q.admitted,
                first=q.first, finished=q.finished, preempted=q.preempted, cached=q.cached, slot_entry=s.entry, slot_seq=s.seq,
                slot_num=s.num_tokens, slot_start=slot_start,
                slot_tail=jnp.take_along_axis(s.tokens, cols(slot_start), axis=1), round=s.round,
                busy=s.busy - begin.busy, free_pages=s.pages.free_count(),
                cached_pages=s.pages.cached_count())


def run_rounds(target_params, head_params, state: EngineState, max_rounds: jax.Array, *,
               program: RoundProgram, window: int) -> tuple[EngineState, Report]:
  """Rounds until no request is pending or ``max_rounds`` (a traced int: one program serves offline
  runs and segments) more have run; the state is donated. Returns the state and the call's ``Report``
  (token window ``window``, ``token_window``)."""
  plan = program.plan
  begin = state.round
  body = functools.partial(engine_round, target_params, head_params, program=program)
  going = lambda s: (s.control[0] > 0) & (s.round - begin < max_rounds)     # int32 difference: wraps safely
  # One round body per (key length, with or without prefill lanes); the body changes rarely (a prompt
  # arriving or completing, a request growing past a length, the longest one finishing): another loop then.
  variants = [(key_len, prefill) for key_len in plan.key_lengths() for prefill in (False, True)]

  def rounds_in(v):
    key_len, prefill = variants[v]
    step = lambda s: with_control(body(s, key_len=key_len, prefill=prefill), program)
    return lambda s: jax.lax.while_loop(lambda s: going(s) & (s.control[1] == v) & (s.control[2] == 0), step, s)

  def rounds(s):                       # flush (finish, admit), then rounds of one body until the next flush is due
    s = flush(s, program)
    # Each body's loop in turn; only the one the control names runs rounds (a later one may follow it when the
    # body changes with no flush due: a flush then would do nothing). No conditional carries the state: on
    # XLA:CPU a switch between the loops cost a copy of the caches.
    with jax.named_scope(ROUND_BODIES):
      for v in range(len(variants)):
        s = rounds_in(v)(s)
    return s
  end = jax.lax.while_loop(going, rounds, with_control(state, program))
  end = flush(end, program)         # the call's finished requests in the queue, free slots admitted
  return end, _report(state, end, plan, window)


LIVE_PROGRAMS = 2    # program sets (``programs``) kept for reuse beyond those that live engines hold


class Programs:
  """An engine's compiled device functions (``run_rounds`` and the state's ``reset``, ``enqueue`` and ``drop``),
  each a jit of a function object of its own: jax keys its compiled programs by that object, so they are freed
  with this set. Every XLA:CPU executable keeps its machine code in memory maps (about three per kernel), and a
  process may hold at most vm.max_map_count (65,530 by default) of them: compiled programs must not outlive
  their engines (``programs``)."""

  def __init__(self):
    self.run_rounds = _owned_jit(run_rounds, static_argnames=("program", "window"), donate_argnames=("state",))
    self.reset = _owned_jit(reset, donate_argnames=("state",))
    self.enqueue = _owned_jit(enqueue, donate_argnames=("state",))
    self.drop = _owned_jit(drop, donate_argnames=("state",))


def _owned_jit(fn, **jit_kw):
  """``jax.jit`` of a new function object calling ``fn`` (same name and signature): compiled programs of its own."""
  @functools.wraps(fn)
  def owned(*args, **kw):
    return fn(*args, **kw)
  return jax.jit(owned, **jit_kw)


_PROGRAMS: collections.OrderedDict = collections.OrderedDict()


def programs(program: RoundProgram) -> Programs:
  """The ``Programs`` of engines running ``program``: shared by every engine with an equal program, the
  ``LIVE_PROGRAMS`` most recently asked for kept ready; an older set lives on only while an engine holds it."""
  found = _PROGRAMS.pop(program, None) or Programs()
  _PROGRAMS[program] = found
  while len(_PROGRAMS) > LIVE_PROGRAMS:
    _PROGRAMS.popitem(last=False)
  return found


@dataclasses.dataclass(frozen=True)
class Request:
  """One generation request: prompt ids and how many tokens it may generate. ``key``: its PRNG key
  (None: fold_in(key(seed), request id), as ``decode.sampling.sequence_keys`` gives batch row b).
  temperature / top_k / top_p: its sampling (None: the engine's); an engine without
  ``plan.per_request_sampling`` takes only its own setting."""
  prompt: Sequence[int]
  max_new_tokens: int
  key: jax.Array | None = None
  temperature: float | None = None
  top_k: int | None = None
  top_p: float | None = None


@dataclasses.dataclass(frozen=True)
class RequestResult:
  """What the engine produced for one request. steps: decode rounds after its first token;
  depth_histogram [D+1]: those rounds by accepted draft tokens (AR: [steps]); depth_visits [D], rank_hits and
  rank_mass [D, W]: its acceptance-profile counts (``decode.profile``; AR: D = 0); admitted / first /
  finished: the engine rounds at which it took a slot, drew its first token and finished; preempted: times its
  slot was taken back for pages (its rows then recomputed); cached_tokens: prompt rows it took from the prefix
  cache instead of computing them (every admission summed)."""
  id: int
  tokens: list[int]
  steps: int
  depth_histogram: np.ndarray
  depth_visits: np.ndarray
  rank_hits: np.ndarray
  rank_mass: np.ndarray
  admitted: int
  first: int
  finished: int
  preempted: int = 0
  cached_tokens: int = 0


def acceptance(results: Sequence[RequestResult]) -> dict:
  """tau and per-depth acceptance over requests: the one place they are computed. tau = committed tokens per
  decode round, each request's first token (drawn by its prefill) excluded; acceptance_by_depth[d-1] = share of
  rounds that accepted at least d draft tokens."""
  rounds = sum(r.steps for r in results)
  decoded = sum(len(r.tokens) - 1 for r in results)
  hist = np.sum([r.depth_histogram for r in results], axis=0)
  at_least = hist[::-1].cumsum()[::-1]
  return {"tau": decoded / max(rounds, 1), "rounds": rounds, "depth_histogram": hist.tolist(),
          "acceptance_by_depth": [float(at_least[d] / max(rounds, 1)) for d in range(1, len(hist))]}


def acceptance_profile(results: Sequence[RequestResult]):
  """The per-(depth, rank) acceptance counts of speculative requests, summed (``decode.profile.AcceptanceProfile``)."""
  from jetspec_jax.decode.profile import AcceptanceProfile
  total = lambda field: np.sum([getattr(r, field) for r in results], axis=0)
  return AcceptanceProfile.from_counts(total("depth_visits"), total("rank_hits"), total("rank_mass"))


@dataclasses.dataclass(frozen=True)
class EngineRun:
  """An offline run: per-request results (in request order), rounds, slot-rounds that held a request,
  and wall time (the first run of a plan includes compilation)."""
  results: list[RequestResult]
  rounds: int
  busy_slot_rounds: int
  slots: int
  wall_s: float

  @property
  def occupancy(self) -> float:
    """Slot-rounds that held a request over all slot-rounds."""
    return self.busy_slot_rounds / max(self.rounds * self.slots, 1)

  @property
  def tokens(self) -> list[list[int]]:
    """Each request's generated ids, in request order."""
    return [r.tokens for r in self.results]


@dataclasses.dataclass(frozen=True)
class Segment:
  """A dispatched ``run_rounds`` call: its report (device arrays, copying to the host) and its index."""
  report: Report
  index: int


@dataclasses.dataclass(frozen=True)
class Update:
  """A collected segment: the requests that finished (by id), every outstanding request's new tokens ``new``
  {id: tokens} (the finished ones' last tokens included), the round counter at its end, the slot-rounds
  that held a request in it and the KV pages held at its end (and the free pages holding prefix-cached rows)."""
  finished: list[RequestResult]
  new: dict[int, list[int]]
  round: int
  busy: int
  pages_used: int = 0
  pages_cached: int = 0


class Engine:
  """Continuous batching over ``plan.slots`` slots (AR without a head, speculative with ``head_cfg``,
  ``head_params`` and ``plan.tree``). Offline: ``run(requests)``. Segmented: ``submit`` requests, then
  ``dispatch(rounds)`` starts at most that many rounds on device (state donated) and ``collect`` returns what
  they did (``Update``: finished requests, every request's new tokens); a host keeps one segment in flight
  (dispatch the next, then collect the previous), submitting and cancelling between. ``step``: dispatch and
  collect at once.

  ``attn_impl``: the attention implementation (``jetspec_jax.attention``; "auto": ``resolve_implementation``'s
  choice for the backend). ``drafter``: the speculative rounds' per-depth logits (``speculative.Drafter``; default
  the head). Instrumentation
  (benchmarks, tests): ``transfer_guard`` (one of ``TRANSFER_GUARDS``) runs every ``step``'s device loop, and waits
  for it, under ``jax.transfer_guard_device_to_host(transfer_guard)``; ``on_fetch(arrays)`` sees the device arrays
  ``step`` fetches to the host, just before."""

  def __init__(self, target_cfg: Qwen3Config, target_params: dict, plan: EnginePlan, *,
               head_cfg: DraftConfig | None = None, head_params: dict | None = None,
               sampling_cfg=None, eos_ids: Sequence[int] | None = None, attn_impl="auto", mesh=None,
               cache_dtype=None, drafter: Drafter = head_drafter, transfer_guard: str | None = None,
               on_fetch: Callable[[tuple[jax.Array, ...]], None] | None = None):
    if transfer_guard is not None and transfer_guard not in TRANSFER_GUARDS:
      raise JetSpecError(f"transfer_guard {transfer_guard!r} is not one of {', '.join(TRANSFER_GUARDS)}")
    if (head_cfg is None) != (plan.tree is None):
      raise JetSpecError("a speculative engine needs both a draft head and a tree (plan.tree); AR needs neither")
    plan.validate(mesh)
    if head_cfg is not None:
      plan.tree.validate(head_cfg)
      head_cfg.validate(target_cfg)
    self.cfg, self.params, self.plan = target_cfg, target_params, plan
    self.head_cfg, self.head_params = head_cfg, head_params
    given = sampling_cfg or SamplingConfig()
    self.sampling = given.resolved()
    if plan.per_request_sampling:          # sampled requests take the rule even when the default is greedy
      self.sampling = dataclasses.replace(self.sampling, accept=given.accept)
    self.regime = regime_for(self.sampling, plan.per_request_sampling)
    self.eos = resolve_eos(target_cfg, eos_ids)
    self.attn_impl = resolve_implementation(attn_impl) if attn_impl == "auto" else attn_impl
    self.mesh, self.drafter = mesh, drafter
    self.transfer_guard, self.on_fetch = transfer_guard, on_fetch
    self.cache_dtype = cache_dtype or target_params["embed"].dtype
    self.programs = programs(self.program)     # held while this engine lives
    self.state = None
    self._next_id = 0
    self._entries: list[dict[int, int]] = []        # per group: entry -> outstanding request id
    self._tokens: dict[int, list[int]] = {}         # outstanding request id -> its tokens collected so far
    self._dispatched = self._collected = 0          # segments

  @classmethod
  def for_requests(cls, target_cfg: Qwen3Config, target_params: dict, requests: Sequence[Request], *, slots: int,
                   rows: int | None = None, lanes: int | None = None, prefill_rows: int = 32, groups: int = 1,
                   max_prompt: int | None = None,
                   tree: TreeConfig | None = None, key_buckets: int = 1, per_request_sampling: bool = False,
                   page_rows: int = 16, pages: int | None = None, prefix_caching: bool = True, **kw) -> "Engine":
    """An engine whose slot capacity fits ``requests`` (``max_prompt`` default: their longest prompt; rows default:
    every slot's whole tree; lanes: one per group; KV ``pages`` of ``page_rows`` rows default: every slot's
    capacity; ``prefix_caching``: ``EnginePlan``'s)."""
    check_requests(requests, target_cfg)
    nodes = 1 if tree is None else tree.num_nodes()
    plan = EnginePlan(slots=slots, rows=rows or slots * nodes, lanes=lanes or groups, prefill_rows=prefill_rows,
                      max_prompt=max_prompt or max(len(r.prompt) for r in requests),
                      max_new_tokens=max(r.max_new_tokens for r in requests),
                      queue=-(-len(requests) // groups), groups=groups, tree=tree, key_buckets=key_buckets,
                      per_request_sampling=per_request_sampling, page_rows=page_rows, pages=pages,
                      prefix_caching=prefix_caching)
    return cls(target_cfg, target_params, plan, **kw)

  @property
  def speculative(self) -> bool:
    return self.head_cfg is not None

  def start(self) -> None:
    """A fresh engine state: free slots, empty queues (the previous state's caches reused in place)."""
    if self.state is not None:
      self.state = self.programs.reset(self.state)
    else:
      draft_dtype = None if self.head_params is None else self.head_params["fc"].dtype
      self.state = init_state(self.plan, self.cfg, self.head_cfg, self.cache_dtype, draft_dtype, self.mesh)
    self._entries = [dict() for _ in range(self.plan.groups)]
    self._tokens = {}
    self._next_id = 0
    self._collected = self._dispatched                # segments of the previous state are not collected

  def submit(self, requests: Sequence[Request]) -> list[int]:
    """Queue requests (each to the group with the fewest outstanding); returns their ids. Refuses, in
    one sentence and before queueing any, a request that does not fit a slot or a full queue."""
    if self.state is None:
      self.start()
    self.check(requests)
    groups, entries, ids = [], [], []
    taken = [set(e) for e in self._entries]
    for i, _ in enumerate(requests):
      g = min(range(self.plan.groups), key=lambda j: (len(taken[j]), j))
      if len(taken[g]) >= self.plan.queue:
        raise JetSpecError(f"the engine's queue is full ({self.plan.queue} requests per group); step it to let "
                           f"requests finish, or build it with a larger queue")
      e = min(set(range(self.plan.queue)) - taken[g])
      taken[g].add(e)
      groups.append(g)
      entries.append(e)
      ids.append(self._next_id + i)
    seqs = [i % SEQ_WRAP for i in ids]
    # Every array padded to the queue's capacity (pad rows at entry Q: dropped), so one enqueue program serves
    # any number of requests.
    cap, n = self.plan.queue * self.plan.groups, len(requests)
    prompt = np.zeros((cap, self.plan.max_prompt), np.int32)
    own = np.zeros((cap,), bool)
    keys = np.zeros((cap,) + key_shape(), np.uint32)
    settings = np.zeros((cap, 3), np.float64)
    settings[:, 2] = 1.0
    page_keys = np.zeros((cap, self.plan.prefix_pages, 2), np.int32)
    for i, r in enumerate(requests):
      prompt[i, :len(r.prompt)] = r.prompt
      page_keys[i] = pages.prefix_keys(r.prompt, self.plan.page_rows, self.plan.prefix_pages)
      settings[i] = self.request_sampling(r)
      if r.key is not None:
        own[i], keys[i] = True, np.asarray(jax.random.key_data(r.key))
    pad = lambda values, fill: np.asarray(list(values) + [fill] * (cap - n), np.int32)
    self.state = self.programs.enqueue(
        self.state, pad(groups, 0), pad(entries, self.plan.queue), pad(seqs, 0), prompt,
        pad([len(r.prompt) for r in requests], 0), pad([r.max_new_tokens for r in requests], 0),
        np.uint32(self.sampling.seed), keys, own, settings[:, 0].astype(np.float32), settings[:, 1].astype(np.int32),
        settings[:, 2].astype(np.float32), page_keys)
    for g, e, rid in zip(groups, entries, ids):
      self._entries[g][e] = rid
      self._tokens[rid] = []
    self._next_id += len(requests)
    return ids

  def check(self, requests: Sequence[Request]) -> None:
    """Refuse, in one sentence naming the request, one this engine cannot run (``check_requests`` with its plan,
    or its own sampling where the engine compiles one setting)."""
    check_requests(requests, self.cfg, self.plan, self.head_cfg)
    for i, r in enumerate(requests):
      if not self.plan.per_request_sampling and self.request_sampling(r) != self.request_sampling(Request([], 1)):
        raise JetSpecError(f"request {i} asks for its own sampling (temperature, top_k, top_p) but this engine "
                           f"compiles one setting (temperature {self.sampling.temperature:g}, top_k {self.sampling.top_k}, "
                           f"top_p {self.sampling.top_p:g}); build it with "
                           f"per_request_sampling=True in its plan")

  def request_sampling(self, r: Request) -> tuple[float, int, float]:
    """(temperature, top_k, top_p) a request runs with: its own where set, else the engine's (greedy: 0, 0, 1)."""
    s = self.sampling
    t = s.temperature if r.temperature is None else float(r.temperature)
    k = s.top_k if r.top_k is None else int(r.top_k)
    p = s.top_p if r.top_p is None else float(r.top_p)
    return (0.0, 0, 1.0) if t == 0.0 else (t, k, p)

  @property
  def program(self) -> RoundProgram:
    """The static half of the compiled loop (``run_rounds``)."""
    return RoundProgram(plan=self.plan, cfg=self.cfg, head_cfg=self.head_cfg, eos_ids=self.eos, regime=self.regime,
                        attn_impl=self.attn_impl, mesh=self.mesh, drafter=self.drafter)

  def trace(self, rounds: int = 1 << 30) -> jax.stages.Traced:
    """The program ``step`` runs, traced (lower it for this backend, or ``.lower(lowering_platforms=...)`` for
    another)."""
    if self.state is None:
      self.start()
    return self.programs.run_rounds.trace(self.params, self.head_params, self.state, np.int32(rounds),
                                          program=self.program, window=token_window(self.plan, rounds))

  def lower(self, rounds: int = 1 << 30) -> jax.stages.Lowered:
    """The program ``step`` runs, lowered for this backend (neither run nor donated)."""
    return self.trace(rounds).lower()

  def dispatch(self, rounds: int = 1 << 30) -> Segment:
    """Start at most ``rounds`` rounds on device (until nothing is pending; the state donated) and return at
    once: the host may submit, cancel and ``collect`` the previous segment while this one runs. Every segment
    is collected, in dispatch order."""
    if self.state is None:
      self.start()
    call = lambda: self.programs.run_rounds(self.params, self.head_params, self.state, np.int32(rounds),
                                            program=self.program, window=token_window(self.plan, rounds))
    if self.transfer_guard is None:
      self.state, report = call()
    else:
      with jax.transfer_guard_device_to_host(self.transfer_guard):
        self.state, report = jax.block_until_ready(call())
    for leaf in jax.tree.leaves(report):
      leaf.copy_to_host_async()
    self._dispatched += 1
    return Segment(report=report, index=self._dispatched - 1)

  def collect(self, segment: Segment) -> Update:
    """Wait for ``segment``'s report (one fetch of arrays of their own: no device work queued behind the next
    segment) and return what it says: every outstanding request's new tokens (host work in the new tokens)
    and the requests that finished, their queue entries freed for new requests."""
    if segment.index != self._collected:
      raise JetSpecError(f"segment {segment.index} collected out of order (segment {self._collected} is next): "
                         f"collect every dispatched segment once, in dispatch order")
    self._collected += 1
    if self.on_fetch is not None:
      self.on_fetch(tuple(jax.tree.leaves(segment.report)))
    r = host_values(segment.report)
    per = self.plan.slots // self.plan.groups
    new: dict[int, list[int]] = {}

    def take(g, e, seq, num, start, tail):
      """The request at (g, e) if still outstanding as ``seq``: its new tokens appended, its id returned."""
      rid = self._entries[g].get(int(e))
      if rid is None or rid % SEQ_WRAP != seq:
        return None
      have = self._tokens[rid]
      skip = len(have) - int(start)
      if skip < 0:
        raise JetSpecError(f"request {rid} is missing tokens {len(have)}..{int(start)}: a segment was not collected")
      delta = tail[skip:int(num) - int(start)].tolist()
      if delta:
        have.extend(delta)
        new[rid] = delta
      return rid

    for b in np.flatnonzero(r.slot_entry >= 0):
      take(b // per, r.slot_entry[b], r.slot_seq[b], r.slot_num[b], r.slot_start[b], r.slot_tail[b])
    for g, e in zip(*np.nonzero(r.queued & (r.num > r.start))):          # preempted in the call: tokens so far
      take(g, e, r.seq[g, e], r.num[g, e], r.start[g, e], r.tail[g, e])
    finished = []
    for g, e in zip(*np.nonzero(r.ended)):
      rid = take(g, e, r.seq[g, e], r.num[g, e], r.start[g, e], r.tail[g, e])
      if rid is None:
        continue
      del self._entries[g][int(e)]
      finished.append(RequestResult(id=rid, tokens=self._tokens.pop(rid), steps=int(r.steps[g, e]),
                                    depth_histogram=r.depth_hist[g, e], depth_visits=r.depth_visits[g, e],
                                    rank_hits=r.rank_hits[g, e], rank_mass=r.rank_mass[g, e],
                                    admitted=int(r.admitted[g, e]), first=int(r.first[g, e]),
                                    finished=int(r.finished[g, e]), preempted=int(r.preempted[g, e]),
                                    cached_tokens=int(r.cached[g, e])))
    finished.sort(key=lambda x: x.id)
    pool = self.plan.pool_pages(self.head_cfg)
    return Update(finished=finished, new=new, round=int(r.round), busy=int(np.sum(r.busy)),
                  pages_used=pool - int(np.sum(r.free_pages)), pages_cached=int(np.sum(r.cached_pages)))

  def step(self, rounds: int = 1 << 30) -> list[RequestResult]:
    """Run at most ``rounds`` rounds (until nothing is pending) and wait for them (``dispatch`` then
    ``collect``); returns the requests finished since the last step."""
    return self.collect(self.dispatch(rounds)).finished

  def progress(self) -> dict[int, list[int]]:
    """The tokens so far of every outstanding request, as of the last collected segment (host memory: no
    device work): a prefix of its final tokens."""
    return {rid: list(t) for rid, t in self._tokens.items()}

  def cancel(self, ids: Sequence[int]) -> list[int]:
    """Stop the queued or running requests ``ids`` and free their slots and queue entries; they never
    appear in ``step``'s results. Ids not outstanding (unknown, or already returned by ``step``) are
    skipped. Returns the ids cancelled."""
    wanted = set(ids)
    hits = [(g, e, rid) for g, entries in enumerate(self._entries) for e, rid in entries.items() if rid in wanted]
    if not hits:
      return []
    cap = self.plan.queue * self.plan.groups                  # padded: one program for any number (entry Q: none)
    pad = lambda values, fill: np.asarray(values + [fill] * (cap - len(values)), np.int32)
    self.state = self.programs.drop(self.state, pad([g for g, _, _ in hits], 0),
                                    pad([e for _, e, _ in hits], self.plan.queue))
    for g, e, rid in hits:
      del self._entries[g][e]
      del self._tokens[rid]
    return [rid for _, _, rid in hits]

  def run(self, requests: Sequence[Request]) -> EngineRun:
    """All requests through a fresh engine in one device loop; results in request order."""
    self.start()
    t0 = time.perf_counter()
    ids = self.submit(requests)
    update = self.collect(self.dispatch())
    wall = time.perf_counter() - t0
    results = {r.id: r for r in update.finished}
    return EngineRun(results=[results[i] for i in ids], rounds=update.round, busy_slot_rounds=update.busy,
                     slots=self.plan.slots, wall_s=wall)


def check_requests(requests: Sequence[Request], cfg: Qwen3Config, plan: EnginePlan | None = None,
                   head_cfg: DraftConfig | None = None) -> None:
  """Refuse, in one sentence naming the request, one that cannot run: an empty prompt, a token id outside
  the vocabulary, max_new_tokens < 1, longer than the model's context, larger than a slot (``plan``) or than a
  group's KV pages (``plan`` and the engine's head, ``head_cfg``)."""
  if not requests:
    raise JetSpecError("no requests to run")
  for i, r in enumerate(requests):
    n = len(r.prompt)
    if n == 0:
      raise JetSpecError(f"request {i} has an empty prompt")
    if int(r.max_new_tokens) != r.max_new_tokens or r.max_new_tokens < 1:
      raise JetSpecError(f"request {i}: max_new_tokens must be a positive integer, got {r.max_new_tokens}")
    bad = [t for t in r.prompt if not 0 <= int(t) < cfg.vocab_size]
    if bad:
      raise JetSpecError(f"request {i}: token id {bad[0]} is outside the vocabulary (0..{cfg.vocab_size - 1})")
    if n + r.max_new_tokens > cfg.max_position_embeddings:
      raise JetSpecError(f"request {i}: a prompt of {n} tokens plus {r.max_new_tokens} new tokens exceeds the "
                         f"model's context of {cfg.max_position_embeddings} positions")
    settings = {"temperature": r.temperature, "top_k": r.top_k, "top_p": r.top_p}
    for name, v in settings.items():
      if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating))):
        raise JetSpecError(f"request {i}: {name} must be a number, got {v!r}")
    try:
      sampling.validate_sampling(*(d if v is None else v for v, d in zip(settings.values(), (0.0, 0, 1.0))))
    except JetSpecError as e:
      raise JetSpecError(f"request {i}: {e}") from None
    if plan is not None and (n > plan.max_prompt or r.max_new_tokens > plan.max_new_tokens):
      raise JetSpecError(f"request {i}: a prompt of {n} tokens with max_new_tokens {r.max_new_tokens} does not fit "
                         f"a slot (at most {plan.max_prompt} prompt tokens and {plan.max_new_tokens} new tokens)")
    if plan is not None and n + r.max_new_tokens > plan.committed_rows:
      raise JetSpecError(f"request {i}: a prompt of {n} tokens plus max_new_tokens {r.max_new_tokens} is more than "
                         f"the engine's max_model_len of {plan.committed_rows} tokens")
    if plan is not None:
      need, have = plan.request_pages(n + r.max_new_tokens, head_cfg), plan.pool_pages(head_cfg) // plan.groups
      if need > have:
        raise JetSpecError(f"request {i}: a prompt of {n} tokens with max_new_tokens {r.max_new_tokens} needs {need} "
                           f"KV pages of {plan.page_rows} rows, more than the {have} of a group's pool; give the "
                           f"engine more KV pages")


def generate(target_cfg: Qwen3Config, target_params: dict, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             *, slots: int | None = None, prefill_rows: int | None = None, **kw) -> EngineRun:
  """``prompts`` (token-id lists), each to at most ``max_new_tokens`` new tokens, through an engine of ``slots``
  slots (default one per prompt) whose prefill lanes take the longest prompt whole in the round it is admitted
  (``prefill_rows`` default); ``kw``: ``Engine.for_requests``' and ``Engine``'s (head_cfg, head_params, tree,
  sampling_cfg, eos_ids, attn_impl, mesh, drafter, groups, rows, lanes, ...). A new engine per call (one
  program per plan: prompt capacities are rounded up to a multiple of ``CACHE_ROWS_MULTIPLE``, so calls whose
  longest prompts round alike, with the same slots and ``max_new_tokens``, share one; ``programs`` keeps the most
  recent few); hold an ``Engine`` to run many batches."""
  requests = [Request(list(p), max_new_tokens) for p in prompts]
  check_requests(requests, target_cfg)
  longest = max(len(p) for p in prompts)
  capacity = max(longest, min(cache_rows(longest), target_cfg.max_position_embeddings - max_new_tokens))
  rows = cache_rows(longest) if prefill_rows is None else prefill_rows
  eng = Engine.for_requests(target_cfg, target_params, requests, slots=slots or len(requests), prefill_rows=rows,
                            **{"max_prompt": capacity, **kw})
  return eng.run(requests)
