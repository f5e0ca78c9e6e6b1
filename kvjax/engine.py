"""Continuous batching over a paged cache: a host-side scheduler.

Requests (prompt, max new tokens, sampler, stop tokens, arrival) join a
fixed number of rows B (decode slots) of one `paged.PagedCache` as they
arrive and rows free up; each is prefilled in chunks of T tokens, decoded
with the others, and leaves when it stops, freeing its pages. Dimension
letters as in `kvjax.paged` (Z pages of Y slots, M pages per row, A pages
a call reads); here also U, the rows one prefill call serves, and k, the
decode steps one call runs.

One engine iteration:

  admit    arrived requests, oldest first, into free rows while the pool
           can hold what their prompts need beyond what the rows still
           prefilling need (prefix-cache hits first: `kvjax.prefix`);
           `static` scheduling admits only into an empty batch and waits
           for the whole batch to finish (the baseline).
  prefill  the next chunk of T prompt tokens of each of the U oldest rows
           still in prefill, in one call (`model.extend_logits` on their
           view), so a long prompt never stalls the running rows for more
           than one chunk; pages are taken as the chunk needs them; the
           chunk that ends a prompt samples its first token.
  decode   k steps of every decoding row in one call (`paged.decode_loop`:
           the one decode loop, `kvjax.decode.run`, on a `paged.PagedKV`:
           each step reads every layer's pages in place and writes the
           new token into its page).
           Before it, every row gets the pages of its next slots; when the
           pool runs out (here or in prefill), the most recently admitted
           row is preempted
           (LIFO, as vLLM): 'recompute' drops its pages and re-prefills
           prompt + generated tokens when it is readmitted; 'swap' copies
           its pages to host memory and back. Either way it resumes where
           it stopped and loses no token.

Fixed shapes: the row count, U, chunk length, k, the sampler menu and the
page buckets a call reads (`paged.all_view_pages`) are static, so `warmup` compiles
every program the loop can call and a run after it compiles nothing
(`compile_counter`, tested).

Exactness: each row's steps are the same `model` functions `generate`
runs, on pages holding what its contiguous cache holds, sampled with the key
`generate` would use for that token (`jax.random.split(key(seed),
max_new_tokens)[i]`), so each request's output equals `kvjax.generate`
on that request alone (tested, greedy and sampled, for every arrival
order and batch mix); chunked prefill, recomputation after preemption
and shared prefix pages change only float rounding.

Bad input raises ValueError before any compute (`Engine.run`): a request
longer than the pool or the row capacity can ever hold, an unknown
sampler, duplicate ids, bad token ids. Errors recorded in the cache during
a run raise ValueError naming the request.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
import time
from typing import Hashable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as cache_lib
from kvjax import errors
from kvjax import inference
from kvjax import model
from kvjax import packed
from kvjax import paged as paged_lib
from kvjax import params as params_lib
from kvjax import prefix as prefix_lib
from kvjax.config import ModelConfig
from kvjax.sampling import GREEDY, Sampler
from kvjax.validate import check_bool, check_choice, check_int

PREEMPTIONS = ("recompute", "swap")
RESERVATIONS = ("none", "max")
SCHEDULING = ("continuous", "static")
CLOCKS = ("steps", "wall")


@dataclasses.dataclass(frozen=True)
class Request:
  """One generation request.

  id: unique within a run (any hashable).
  prompt: token ids (non-empty).
  max_new_tokens: tokens to generate at most.
  sampler: one of the engine's `EngineSpec.samplers`.
  stop_tokens: ids that end the request (the stop token is returned).
  arrival: when it arrives: an engine iteration ('steps' clock) or seconds
    after the run starts ('wall' clock).
  seed: its PRNG key is `jax.random.key(seed)` (sampling samplers).
  """

  id: Hashable
  prompt: tuple
  max_new_tokens: int
  sampler: Sampler = GREEDY
  stop_tokens: tuple = ()
  arrival: float = 0.0
  seed: int = 0


@dataclasses.dataclass(frozen=True)
class EngineSpec:
  """The engine's static shape and policies.

  rows: B, requests served at once (decode slots).
  page_size: Y, slots per page.
  num_pages: Z, the KV memory budget in pages (bytes: `paged.page_bytes`).
  capacity: most tokens one request can hold (a multiple of page_size);
    M = capacity / page_size pages per row.
  chunk: T, prompt tokens per row per prefill call.
  prefill_rows: U, rows whose next chunk one prefill call computes (one
    call per iteration, oldest rows first).
  decode_steps: k, decode steps per call (a row that finishes inside
    wastes at most k - 1 steps; requests join between calls).
  prefix_caching: share the pages of common prompt prefixes.
  preemption: 'recompute' or 'swap' when the pool runs out.
  reserve: 'none' (pages on demand: paged) or 'max' (a row reserves all M
    pages when admitted: contiguous max-length reservation, for
    comparison; no prefix caching).
  scheduling: 'continuous' or 'static' (admit only into an empty batch).
  samplers: the sampler menu (static; every one runs on every row).
  policy: the cache's `CachePolicy` (storage dtype, key quantization).
  min_view_slots: the smallest view a call reads.
  """

  rows: int = 8
  page_size: int = 16
  num_pages: int = 256
  capacity: int = 1024
  chunk: int = 64
  prefill_rows: int = 4
  decode_steps: int = 8
  prefix_caching: bool = True
  preemption: str = "recompute"
  reserve: str = "none"
  scheduling: str = "continuous"
  samplers: tuple = (GREEDY,)
  policy: cache_lib.CachePolicy = cache_lib.CachePolicy()
  min_view_slots: int = paged_lib.MIN_VIEW_SLOTS

  def __post_init__(self):
    """Raises ValueError naming the field (before anything is built)."""
    check_int("EngineSpec.rows", self.rows, 1)
    check_int("EngineSpec.page_size", self.page_size, 1)
    check_int("EngineSpec.num_pages", self.num_pages, 1)
    check_int("EngineSpec.capacity", self.capacity, 1)
    check_int("EngineSpec.chunk", self.chunk, 1)
    check_int("EngineSpec.prefill_rows", self.prefill_rows, 1)
    check_int("EngineSpec.decode_steps", self.decode_steps, 1)
    check_int("EngineSpec.min_view_slots", self.min_view_slots, 1)
    check_bool("EngineSpec.prefix_caching", self.prefix_caching)
    check_choice("EngineSpec.preemption", self.preemption, PREEMPTIONS)
    check_choice("EngineSpec.reserve", self.reserve, RESERVATIONS)
    check_choice("EngineSpec.scheduling", self.scheduling, SCHEDULING)
    if self.capacity % self.page_size:
      raise ValueError(
          f"EngineSpec.page_size={self.page_size} does not divide "
          f"EngineSpec.capacity={self.capacity}: a row addresses whole "
          "pages")
    if self.prefill_rows > self.rows:
      raise ValueError(f"EngineSpec.prefill_rows={self.prefill_rows} exceeds "
                       f"rows={self.rows}")
    if self.num_pages < self.rows:
      raise ValueError(
          f"EngineSpec.num_pages={self.num_pages} is below one page per row "
          f"(rows={self.rows}): rows could never all hold a token")
    paged_lib.check_policy(self.policy, self.page_size)
    if self.prefix_caching and self.policy.channel_keys:
      raise ValueError(
          "EngineSpec.prefix_caching needs key_quant='token': KIVI keeps a "
          "sequence's newest key group in float32 outside the pages, which "
          "a shared page cannot carry")
    if self.reserve == "max" and self.num_pages < self.max_pages:
      raise ValueError(
          f"EngineSpec.reserve='max' reserves max_pages={self.max_pages} "
          f"pages per row; num_pages={self.num_pages} cannot hold one row")
    if self.reserve == "max" and self.prefix_caching:
      raise ValueError("EngineSpec.reserve='max' models contiguous "
                       "per-sequence caches, which share nothing: set "
                       "prefix_caching=False")
    samplers = tuple(self.samplers)
    if not samplers or not all(isinstance(s, Sampler) for s in samplers):
      raise ValueError("EngineSpec.samplers must be a non-empty tuple of "
                       f"Sampler, got {self.samplers!r}")
    if len(set(samplers)) != len(samplers):
      raise ValueError("EngineSpec.samplers has duplicates")
    object.__setattr__(self, "samplers", samplers)

  @property
  def max_pages(self) -> int:
    """M."""
    return self.capacity // self.page_size


@dataclasses.dataclass
class Result:
  """What became of one request (times in seconds since the run began)."""

  id: Hashable
  tokens: list
  finish_reason: str  # 'stop' or 'length'
  prompt_len: int
  arrival_s: float
  first_token_s: float
  finish_s: float
  preemptions: int
  cached_tokens: int  # prompt tokens read from shared prefix pages
  prefill_tokens: int  # tokens computed by prefill (recomputation too)

  @property
  def ttft_s(self) -> float:
    return self.first_token_s - self.arrival_s

  @property
  def tpot_s(self) -> float | None:
    """Mean time per output token after the first (None for one token)."""
    if len(self.tokens) < 2:
      return None
    return (self.finish_s - self.first_token_s) / (len(self.tokens) - 1)


@dataclasses.dataclass
class Report:
  """A run: per-request results, the per-iteration timeline, totals."""

  results: dict
  timeline: list
  summary: dict


# ---- compile counting -------------------------------------------------------
@contextlib.contextmanager
def compile_counter():
  """Counts XLA compilations inside the block (every jit, eager op or
  engine program that compiles): `with compile_counter() as c: ...;
  c['compiles']`."""
  out = {"compiles": 0}
  event = "/jax/core/compile/backend_compile_duration"

  def listener(name, _secs, **_):
    if name == event:
      out["compiles"] += 1

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield out
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


# ---- jitted programs --------------------------------------------------------
def _rows(paged: paged_lib.PagedCache, rows_U) -> paged_lib.PagedCache:
  """Rows `rows_U` [U] of a paged cache as a U-row cache (same pool); a
  row index B (an idle lane) reads as an empty row with no pages."""
  def take(x, axis, fill=0):
    return jnp.take(x, rows_U, axis=axis, mode="fill", fill_value=fill)

  return paged.replace(
      block_table=take(paged.block_table, 0, paged_lib.NO_PAGE),
      length=take(paged.length, 0), errors=take(paged.errors, 0),
      resid={k: take(v, 1) for k, v in paged.resid.items()})


def _put_rows(paged, sub, rows_U) -> paged_lib.PagedCache:
  """`paged` with rows `rows_U` replaced by `sub`'s (index B: dropped)."""
  put = lambda x, y: x.at[rows_U].set(y, mode="drop")
  return paged.replace(
      pool=sub.pool, block_table=put(paged.block_table, sub.block_table),
      length=put(paged.length, sub.length),
      errors=put(paged.errors, sub.errors),
      resid={k: v.at[:, rows_U].set(sub.resid[k], mode="drop")
             for k, v in paged.resid.items()})


@functools.partial(jax.jit,
                   static_argnames=("config", "pages", "samplers"),
                   donate_argnames=("paged",))
def prefill_chunk(params, config, tokens_UT, mask_UT, paged, rows_U,
                  write_UM, keys_U, sampler_U, *, pages: int,
                  samplers: tuple):
  """One prefill chunk of each of U rows (left-padded [U, T] tokens; row
  index B: an idle lane) in one call: `model.extend_logits` on the rows'
  view of `pages` pages, the touched pages written back (to `write_UM`),
  and the token each chunk's last logits sample (meaningful after a
  prompt's last chunk). Returns (tokens [U] int32, new cache)."""
  sub = _rows(paged, rows_U)
  vc = paged_lib.view(sub, pages)
  logits_U1V, vc = model.extend_logits(params, config, tokens_UT, mask_UT,
                                       vc, False)
  J = min(pages, paged_lib.pages_written(tokens_UT.shape[1],
                                         paged.page_size))
  sub = paged_lib.write_back(sub, vc, sub.length, pages, J, write_UM)
  tok_U = paged_lib.sample_rows(logits_U1V[:, 0],
                                jax.random.wrap_key_data(keys_U), sampler_U,
                                samplers)
  return tok_U, _put_rows(paged, sub, rows_U)


@jax.jit
def _read_pages(pool, pages_M):
  """The pool's pages `pages_M` (Z: zeros), per field [L, M, ...]."""
  return {k: jnp.take(v, pages_M, axis=1, mode="fill", fill_value=0)
          for k, v in pool.items()}


@functools.partial(jax.jit, donate_argnames=("paged",))
def _write_pages(paged, pages_M, data, row, resid_row):
  """Writes host copies back into pages `pages_M` (Z: dropped) and sets row
  `row`'s residuals."""
  pool = {k: v.at[:, pages_M].set(data[k], mode="drop")
          for k, v in paged.pool.items()}
  resid = {k: jax.lax.dynamic_update_slice_in_dim(v, resid_row[k], row, 1)
           for k, v in paged.resid.items()}
  return paged.replace(pool=pool, resid=resid)


@functools.partial(jax.jit, donate_argnames=("paged",))
def _clear_row(paged, row):
  """Row `row`'s residuals set to zero (a new sequence in the row)."""
  resid = {k: jax.lax.dynamic_update_slice_in_dim(
      v, jnp.zeros((v.shape[0], 1) + v.shape[2:], v.dtype), row, 1)
           for k, v in paged.resid.items()}
  return paged.replace(resid=resid)


# ---- host-side state --------------------------------------------------------
@dataclasses.dataclass
class _Seq:
  req: Request
  order: int  # order of its first admission (oldest first; LIFO preemption)
  tokens: list  # prompt + generated
  keys: np.ndarray  # [max_new, ...] key data
  sampler_id: int
  arrival_s: float = 0.0
  state: str = "waiting"  # waiting / prefill / decode / done
  row: int | None = None
  pages: list = dataclasses.field(default_factory=list)
  reserved: list = dataclasses.field(default_factory=list)
  length: int = 0
  chain: prefix_lib.Chain = dataclasses.field(
      default_factory=prefix_lib.Chain)
  swapped: dict | None = None
  preemptions: int = 0
  cached_tokens: int = 0
  prefill_tokens: int = 0
  first_token_s: float | None = None

  @property
  def generated(self) -> int:
    return len(self.tokens) - len(self.req.prompt)

  @property
  def remaining(self) -> int:
    return self.req.max_new_tokens - self.generated


def reference_tokens(params, config: ModelConfig, request: Request,
                     policy: cache_lib.CachePolicy | None = None) -> list:
  """What `kvjax.generate` produces for `request` alone (up to and
  including its first stop token), with the cache `policy`: the engine's
  contract."""
  toks = inference.generate(
      params, config, np.asarray([request.prompt], np.int32),
      request.max_new_tokens, sampler=request.sampler,
      rng=jax.random.key(request.seed), stop_tokens=request.stop_tokens,
      policy=policy)
  out = []
  for t in np.asarray(toks)[0].tolist():
    out.append(t)
    if t in request.stop_tokens:
      break
  return out


def _percentile(values, q):
  return float(np.percentile(values, q)) if len(values) else None


class Engine:
  """Continuous batching over a paged cache (see the module docstring)."""

  def __init__(self, params, config: ModelConfig, spec: EngineSpec):
    params_lib.check_params(params, config)
    if not isinstance(spec, EngineSpec):
      raise ValueError(f"spec must be an EngineSpec, got "
                       f"{type(spec).__name__}")
    if spec.capacity > config.max_seq_len:
      raise ValueError(f"EngineSpec.capacity={spec.capacity} exceeds "
                       f"config.max_seq_len={config.max_seq_len}")
    self.params = packed.for_decode(params, config)
    self.config, self.spec = config, spec
    # Decode views may reach k slots past a row's capacity (the discarded
    # steps of a finishing row stay inside the view).
    self.decode_view_cap = -(-(spec.capacity + spec.decode_steps) //
                             spec.page_size)
    self.prefill_views = paged_lib.all_view_pages(
        spec.page_size, spec.max_pages, spec.min_view_slots)
    self.decode_views = paged_lib.all_view_pages(
        spec.page_size, self.decode_view_cap, spec.min_view_slots)
    self.plans = {A: paged_lib.loop_plan(
        self.params, config, spec.policy, spec.rows, A, spec.page_size,
        spec.decode_steps) for A in self.decode_views}
    self.cache = paged_lib.init_paged(config, spec.rows, spec.num_pages,
                                      spec.page_size, spec.max_pages,
                                      spec.policy)
    self.alloc = prefix_lib.PageAllocator(spec.num_pages, spec.page_size,
                                          spec.prefix_caching)
    self._key_shape = tuple(jax.random.key_data(jax.random.key(0)).shape)
    self._warm = False

  # ---- public -------------------------------------------------------------
  def reset_prefix_cache(self) -> None:
    """Forgets every cached prefix (between runs that must not share)."""
    self.alloc = prefix_lib.PageAllocator(self.spec.num_pages,
                                          self.spec.page_size,
                                          self.spec.prefix_caching)

  def warmup(self) -> float:
    """Compiles every program a run can call (each view bucket of the
    prefill chunk and the decode loop, the row and swap helpers) on idle
    rows, which write nothing. Returns the seconds it took."""
    t0 = time.perf_counter()
    s, B, M = self.spec, self.spec.rows, self.spec.max_pages
    self._request_keys(0, 1)
    no_pages = np.full((B, M), paged_lib.NO_PAGE, np.int32)
    self._load(no_pages, np.zeros(B, np.int32))
    for A in self.decode_views:
      keys = np.zeros((B, s.decode_steps) + self._key_shape, np.uint32)
      toks, self.cache = paged_lib.decode_loop(
          self.params, self.config, jnp.zeros((B,), jnp.int32), self.cache,
          jnp.asarray(no_pages), keys, np.zeros(B, np.int32),
          np.zeros(B, np.int32), pages=A, steps=s.decode_steps,
          samplers=s.samplers, plan=self.plans[A])
      jax.block_until_ready(toks)
      self._load(no_pages, np.zeros(B, np.int32))
    for A in self.prefill_views:
      U = s.prefill_rows
      tok, self.cache = prefill_chunk(
          self.params, self.config, np.zeros((U, s.chunk), np.int32),
          np.ones((U, s.chunk), bool), self.cache,
          np.full((U,), B, np.int32), no_pages[:U],
          np.zeros((U,) + self._key_shape, np.uint32),
          np.zeros((U,), np.int32), pages=A, samplers=s.samplers)
      jax.block_until_ready(tok)
      self._load(no_pages, np.zeros(B, np.int32))
    self._load(no_pages, np.zeros(B, np.int32))
    self.cache = _clear_row(self.cache, np.int32(0))
    if s.preemption == "swap":
      pages = np.full((M,), s.num_pages, np.int32)
      data = _read_pages(self.cache.pool, pages)
      resid = {k: np.asarray(v)[:, :1] for k, v in self.cache.resid.items()}
      self.cache = _write_pages(self.cache, pages, data, np.int32(0), resid)
    jax.block_until_ready(self.cache)
    self._warm = True
    return time.perf_counter() - t0

  def run(self, requests: Iterable[Request], *,
          clock: str = "steps") -> Report:
    """Serves `requests` to completion.

    Args:
      requests: the trace (any order; each arrives at its `arrival`).
      clock: 'steps' (arrival = engine iteration; deterministic batches)
        or 'wall' (arrival = seconds since the start; idle time waits).
    Returns:
      Report: results per id (every request finishes: none is dropped),
      the per-iteration timeline, the summary.
    Raises:
      ValueError: bad requests (before any compute), or an error recorded
        in the cache (naming the request).
    """
    check_choice("clock", clock, CLOCKS)
    seqs = self._prepare(list(requests))
    if not self._warm:
      self.warmup()
    return self._loop(seqs, clock)

  # ---- validation -----------------------------------------------------------
  def _prepare(self, requests: list) -> list:
    s, config = self.spec, self.config
    seen = set()
    out = []
    for r in requests:
      if not isinstance(r, Request):
        raise ValueError(f"expected Request objects, got {type(r).__name__}")
      try:
        hash(r.id)
      except TypeError:
        raise ValueError(f"request id {r.id!r} is not hashable") from None
      if r.id in seen:
        raise ValueError(f"duplicate request id {r.id!r}")
      seen.add(r.id)
      what = f"request {r.id!r}"
      prompt = list(r.prompt) if isinstance(r.prompt, (list, tuple)) else (
          None)
      if not prompt or not all(isinstance(t, (int, np.integer)) and
                               not isinstance(t, bool) for t in prompt):
        raise ValueError(f"{what}: prompt must be a non-empty sequence of "
                         "int token ids")
      if min(prompt) < 0 or max(prompt) >= config.vocab_size:
        raise ValueError(f"{what}: prompt ids must be in [0, "
                         f"{config.vocab_size})")
      n = check_int(f"{what}: max_new_tokens", r.max_new_tokens, 1)
      for t in r.stop_tokens:
        check_int(f"{what}: stop_tokens (token ids)", t, 0,
                  config.vocab_size - 1)
      if r.sampler not in s.samplers:
        raise ValueError(f"{what}: sampler {r.sampler!r} is not in "
                         "EngineSpec.samplers (the static sampler menu)")
      if not isinstance(r.arrival, (int, float)) or not r.arrival >= 0:
        raise ValueError(f"{what}: arrival must be a number >= 0, got "
                         f"{r.arrival!r}")
      check_int(f"{what}: seed", r.seed, 0)
      # Slots written: the prompt and every token but the last.
      slots = len(prompt) + n - 1
      if slots > s.capacity:
        raise ValueError(
            f"{what}: {len(prompt)} prompt + {n} new tokens need {slots} "
            f"slots, more than EngineSpec.capacity={s.capacity}; it can "
            "never be served")
      pages = -(-slots // s.page_size)
      if pages > s.num_pages:
        raise ValueError(
            f"{what}: needs {pages} pages of {s.page_size} slots, the pool "
            f"has {s.num_pages}; it can never be served")
      if len(prompt) + n > config.max_seq_len:
        raise ValueError(f"{what}: {len(prompt)} + {n} tokens exceed "
                         f"config.max_seq_len={config.max_seq_len}")
      if r.sampler.greedy:
        keys = np.zeros((n,) + self._key_shape, np.uint32)
      else:
        keys = self._request_keys(r.seed, n)
      out.append(_Seq(req=r, order=-1, tokens=list(map(int, prompt)),
                      keys=keys, sampler_id=s.samplers.index(r.sampler)))
    return out

  def _request_keys(self, seed: int, n: int) -> np.ndarray:
    """`jax.random.split(key(seed), n)` as key data, [n, ...], without a
    compile per distinct n: with partitionable threefry (key i depends on i
    alone) the first n of one split to the capacity bound are those keys;
    otherwise the exact split (which compiles for each new n)."""
    key = jax.random.key(seed)
    if not jax.config.jax_threefry_partitionable:
      return np.asarray(jax.random.key_data(jax.random.split(key, n)))
    # n <= capacity: slots = prompt + n - 1 <= capacity, prompt >= 1. The
    # slice is on the host (a device slice compiles per n).
    keys = jax.random.key_data(jax.random.split(key, self.spec.capacity))
    return np.asarray(keys)[:n]

  # ---- device calls ---------------------------------------------------------
  def _load(self, table, length):
    """The host's block tables and lengths into the cache (errors cleared:
    the host raises on any error a call returns)."""
    B = self.spec.rows
    self.cache = self.cache.replace(
        block_table=jnp.asarray(table), length=jnp.asarray(length),
        errors=jnp.asarray(np.zeros(B, np.int32)))

  def _check_errors(self, seqs):
    bits = np.asarray(self.cache.errors)
    bad = [(q, int(bits[q.row])) for q in seqs if bits[q.row]]
    if bad:
      raise ValueError("; ".join(
          f"request {q.req.id!r}: {errors.describe(np.array([b]))}"
          for q, b in bad))

  # ---- pages ----------------------------------------------------------------
  def _take_page(self, seq) -> int | None:
    if seq.reserved:
      return seq.reserved.pop(0)
    got = self.alloc.allocate(1)
    return None if got is None else got[0]

  def _plan(self, seq, start: int, end: int):
    """Pages for writing slots [start, end) of `seq`: its write-table row
    and the changes to commit after the call, or None (nothing kept) when
    the pool cannot supply them."""
    Y = self.spec.page_size
    row = self._table[seq.row].copy()
    cow, new = [], []
    for j in range(start // Y, (end - 1) // Y + 1):
      if j < len(seq.pages) and not self.alloc.shared(seq.pages[j]):
        continue
      page = self._take_page(seq)
      if page is None:
        for _, p in cow + new:
          self.alloc.release(p)
        return None
      (cow if j < len(seq.pages) else new).append((j, page))
      row[j] = page
    return row, cow, new

  def _commit(self, seq, plan):
    _, cow, new = plan
    self.cow_copies += len(cow)
    for j, page in cow:
      self.alloc.release(seq.pages[j])
      seq.pages[j] = page
    for _, page in new:
      seq.pages.append(page)
    self._table[seq.row, :len(seq.pages)] = seq.pages

  # ---- scheduling -----------------------------------------------------------
  def _to_fill(self, seq) -> int:
    """Pages `seq` has yet to take for the rest of its prompt: blocks from
    its length on that are unmapped, or shared (copy-on-write)."""
    Y = self.spec.page_size
    n = sum(1 for j in range(seq.length // Y, -(-len(seq.tokens) // Y))
            if j >= len(seq.pages) or self.alloc.shared(seq.pages[j]))
    return max(0, n - len(seq.reserved))

  def _admit(self, seq) -> bool:
    """Starts (or resumes) `seq` in a free row; False (nothing kept) if
    the pool cannot hold what its prompt needs besides what the rows
    already prefilling need for theirs. Prompt pages are taken chunk by
    chunk; with reserve='max' all M are taken now."""
    s, Y = self.spec, self.spec.page_size
    promised = sum(self._to_fill(q) for q in self._active
                   if q.state == "prefill")
    if seq.swapped is not None:
      n = len(seq.swapped["pages"])
      extra = s.max_pages - n if s.reserve == "max" else 0
      rest = 0
      if seq.swapped["state"] == "prefill" and s.reserve == "none":
        rest = -(-len(seq.tokens) // Y) - n
      if self.alloc.available - promised < n + extra + rest:
        return False
      pages = self.alloc.allocate(n + extra)
      row = self._free_rows.pop()
      ids = np.full((s.max_pages,), s.num_pages, np.int32)
      ids[:n] = pages[:n]
      self.cache = _write_pages(self.cache, ids, seq.swapped["data"],
                                np.int32(row), seq.swapped["resid"])
      seq.pages, seq.reserved = pages[:n], pages[n:]
      seq.length, seq.state = seq.swapped["length"], seq.swapped["state"]
      seq.swapped = None
      self.swap_ins += 1
    else:
      tokens = seq.tokens
      hit = self.alloc.match(tokens, len(tokens) // Y)
      seq.pages, seq.reserved = hit, []
      seq.length = min(len(hit) * Y, len(tokens) - 1)
      need = s.max_pages if s.reserve == "max" else self._to_fill(seq)
      room = self.alloc.available - promised
      if room < need and hit and not self._active:
        # Alone, a full-prompt hit's copy-on-write page may be the one
        # the pool lacks: recompute the prompt instead.
        self.alloc.release_all(hit)
        seq.pages, seq.length = [], 0
        need = s.max_pages if s.reserve == "max" else self._to_fill(seq)
        room = self.alloc.available - promised
      if room < need:
        self.alloc.release_all(seq.pages)
        seq.pages, seq.length = [], 0
        return False
      if s.reserve == "max":
        seq.reserved = self.alloc.allocate(need)
      row = self._free_rows.pop()
      seq.state = "prefill"
      seq.cached_tokens += seq.length
      seq.chain = prefix_lib.Chain()
      self.alloc.offer(seq.chain, tokens, seq.pages, len(seq.pages) * Y)
      if self.cache.resid:
        self.cache = _clear_row(self.cache, np.int32(row))
    seq.row = row
    self._table[row] = paged_lib.NO_PAGE
    self._table[row, :len(seq.pages)] = seq.pages
    self._length[row] = seq.length
    if seq.order < 0:
      seq.order = self._admissions
      self._admissions += 1
    return True

  def _release(self, seq):
    self.alloc.release_all(seq.pages)
    self.alloc.release_all(seq.reserved)
    seq.pages, seq.reserved = [], []
    self._table[seq.row] = paged_lib.NO_PAGE
    self._length[seq.row] = 0
    self._free_rows.append(seq.row)
    seq.row = None

  def _preempt(self, seq):
    """Frees `seq`'s row and pages; it resumes when readmitted."""
    if self.spec.preemption == "swap" and seq.pages:
      ids = np.full((self.spec.max_pages,), self.spec.num_pages, np.int32)
      ids[:len(seq.pages)] = seq.pages
      data = jax.device_get(_read_pages(self.cache.pool, ids))
      resid = {k: np.asarray(v)[:, seq.row:seq.row + 1]
               for k, v in self.cache.resid.items()}
      seq.swapped = dict(data=data, resid=resid, pages=list(seq.pages),
                         length=seq.length, state=seq.state)
      self.swap_outs += 1
    else:
      seq.length = 0
    self._release(seq)
    seq.state = "waiting"
    seq.preemptions += 1
    self.preemptions += 1
    self._active.remove(seq)
    self._waiting.appendleft(seq)

  def _finish(self, seq, reason: str, now: float):
    self.alloc.offer(seq.chain, seq.tokens, seq.pages,
                     min(seq.length, len(seq.tokens)))
    self._release(seq)
    seq.state = "done"
    self._active.remove(seq)
    r = seq.req
    self._results[r.id] = Result(
        id=r.id, tokens=seq.tokens[len(r.prompt):], finish_reason=reason,
        prompt_len=len(r.prompt), arrival_s=seq.arrival_s,
        first_token_s=seq.first_token_s, finish_s=now,
        preemptions=seq.preemptions, cached_tokens=seq.cached_tokens,
        prefill_tokens=seq.prefill_tokens)

  def _emit(self, seq, token: int, now: float) -> bool:
    """Appends a sampled token; True when the request is done."""
    seq.tokens.append(int(token))
    if seq.first_token_s is None:
      seq.first_token_s = now
    if token in seq.req.stop_tokens:
      self._finish(seq, "stop", now)
      return True
    if seq.remaining == 0:
      self._finish(seq, "length", now)
      return True
    return False

  def _plan_or_preempt(self, seq, start: int, end: int):
    """`_plan` for `seq`, preempting the most recently admitted requests
    (LIFO, as vLLM; possibly `seq` itself: then None) until the pool can
    supply it."""
    while seq.state in ("prefill", "decode"):
      plan = self._plan(seq, start, end)
      if plan is not None:
        return plan
      self._preempt(max(self._active, key=lambda q: q.order))
    return None

  def _prefill(self, now):
    """The next chunk of up to U prefilling rows, oldest first, in one
    call; a row whose prompt ends samples its first token."""
    s, B = self.spec, self.spec.rows
    U, T = s.prefill_rows, s.chunk
    rows = sorted((q for q in self._active if q.state == "prefill"),
                  key=lambda q: q.order)[:U]
    work = []
    for seq in rows:
      start = seq.length
      end = min(len(seq.tokens), start + T)
      plan = self._plan_or_preempt(seq, start, end)
      if plan is not None:
        work.append((seq, start, end, plan))
    if not work:
      return
    tokens = np.zeros((U, T), np.int32)
    mask = np.zeros((U, T), bool)
    lanes = np.full((U,), B, np.int32)
    write = np.full((U, s.max_pages), paged_lib.NO_PAGE, np.int32)
    keys = np.zeros((U,) + self._key_shape, np.uint32)
    which = np.zeros((U,), np.int32)
    for i, (seq, start, end, plan) in enumerate(work):
      n = end - start
      tokens[i, T - n:] = seq.tokens[start:end]
      mask[i, T - n:] = True
      lanes[i] = seq.row
      write[i] = plan[0]
      keys[i] = seq.keys[min(seq.generated, seq.req.max_new_tokens - 1)]
      which[i] = seq.sampler_id
    A = paged_lib.view_pages(max(start for _, start, _, _ in work) + T,
                             s.page_size, s.max_pages, s.min_view_slots)
    self._load(self._table, self._length)
    t0 = time.perf_counter()
    toks, self.cache = prefill_chunk(
        self.params, self.config, tokens, mask, self.cache, lanes, write,
        keys, which, pages=A, samplers=s.samplers)
    toks = np.asarray(toks)
    self.prefill_s += time.perf_counter() - t0
    self.prefill_calls += 1
    self._check_errors([w[0] for w in work])
    t = now()
    for i, (seq, start, end, plan) in enumerate(work):
      self._commit(seq, plan)
      seq.length = end
      self._length[seq.row] = end
      seq.prefill_tokens += end - start
      self.prefill_tokens += end - start
      self.alloc.offer(seq.chain, seq.tokens, seq.pages, end)
      if end == len(seq.tokens) and not self._emit(seq, toks[i], t):
        seq.state = "decode"

  def _decode(self, now):
    s, B = self.spec, self.spec.rows
    k = s.decode_steps
    rows = sorted((q for q in self._active if q.state == "decode"),
                  key=lambda q: q.order)
    plans = {}
    for seq in rows:
      if seq.state != "decode":  # preempted for an older row
        continue
      valid = min(k, seq.remaining)
      plan = self._plan_or_preempt(seq, seq.length, seq.length + valid)
      if plan is not None:
        plans[seq.req.id] = (seq, valid, plan)
    if not plans:
      return
    write = self._table.copy()
    token = np.zeros(B, np.int32)
    keys = np.zeros((B, k) + self._key_shape, np.uint32)
    which = np.zeros(B, np.int32)
    valid_B = np.zeros(B, np.int32)
    top = 0
    for seq, valid, plan in plans.values():
      b = seq.row
      write[b] = plan[0]
      token[b] = seq.tokens[-1]
      keys[b, :valid] = seq.keys[seq.generated:seq.generated + valid]
      which[b] = seq.sampler_id
      valid_B[b] = valid
      top = max(top, seq.length + k)
    A = paged_lib.view_pages(top, s.page_size, self.decode_view_cap,
                             s.min_view_slots)
    self._load(self._table, self._length)
    t0 = time.perf_counter()
    toks, self.cache = paged_lib.decode_loop(
        self.params, self.config, jnp.asarray(token), self.cache,
        jnp.asarray(write), keys, which, valid_B, pages=A, steps=k,
        samplers=s.samplers, plan=self.plans[A])
    toks = np.asarray(toks)
    self.decode_s += time.perf_counter() - t0
    self.decode_calls += 1
    t = now()
    self._check_errors([q for q, _, _ in plans.values()])
    for seq, valid, plan in plans.values():
      self._commit(seq, plan)
      seq.length += valid
      self._length[seq.row] = seq.length
      for i in range(valid):
        self.decode_tokens += 1
        if self._emit(seq, toks[seq.row, i], t):
          break
      else:
        self.alloc.offer(seq.chain, seq.tokens, seq.pages,
                         min(seq.length, len(seq.tokens)))

  def _usage(self) -> dict:
    """Token slots used and allocated now (pages held x Y)."""
    Y = self.spec.page_size
    filled = {}
    for q in self._active:
      for j, page in enumerate(q.pages):
        n = min(Y, q.length - j * Y)
        if n > 0:
          filled[page] = max(filled.get(page, 0), n)
    return dict(used=sum(filled.values()), allocated=self.alloc.held * Y,
                cached=self.alloc.cached * Y)

  def _loop(self, seqs: list, clock: str) -> Report:
    s = self.spec
    B, M = s.rows, s.max_pages
    if self.alloc.held:  # a run that raised left pages held: start over
      self.reset_prefix_cache()
    self._table = np.full((B, M), paged_lib.NO_PAGE, np.int32)
    self._length = np.zeros(B, np.int32)
    self._free_rows = list(range(B - 1, -1, -1))
    self._active, self._waiting = [], collections.deque()
    self._results, self._admissions = {}, 0
    self.preemptions = self.swap_ins = self.swap_outs = 0
    self.prefill_tokens = self.decode_tokens = self.decode_calls = 0
    self.prefill_calls = 0
    self.prefill_s = self.decode_s = 0.0
    self.cow_copies = 0
    evictions0 = self.alloc.evictions
    pending = collections.deque(sorted(seqs, key=lambda q: q.req.arrival))
    timeline = []
    t0 = time.perf_counter()
    now = lambda: time.perf_counter() - t0
    it = 0
    static_open = True
    with compile_counter() as compiles:
      while pending or self._waiting or self._active:
        clock_now = it if clock == "steps" else now()
        while pending and pending[0].req.arrival <= clock_now:
          seq = pending.popleft()
          seq.arrival_s = (now() if clock == "steps" else seq.req.arrival)
          self._waiting.append(seq)
        if s.scheduling == "static":
          static_open = not self._active
        active_before, admitted = len(self._active), 0
        while self._waiting and self._free_rows and static_open:
          if not self._admit(self._waiting[0]):
            if not self._active:  # `_prepare` sized every request
              raise AssertionError("a request fits no empty pool")
            break
          seq = self._waiting.popleft()
          self._active.append(seq)
          admitted += 1
        if any(q.state == "prefill" for q in self._active):
          self._prefill(now)
        if any(q.state == "decode" for q in self._active):
          self._decode(now)
        if not self._active and not self._waiting and pending:
          if clock == "wall":  # idle until the next arrival
            time.sleep(max(0.0, pending[0].req.arrival - now()))
          else:
            it = max(it, math.ceil(pending[0].req.arrival) - 1)
        timeline.append(dict(t=now(), iteration=it, admitted=admitted,
                             active_before=active_before,
                             active=len(self._active),
                             waiting=len(self._waiting), **self._usage()))
        it += 1
    wall = now()
    return Report(results=self._results, timeline=timeline,
                  summary=self._summary(wall, it, compiles["compiles"],
                                        self.alloc.evictions - evictions0,
                                        timeline))

  def _summary(self, wall, iterations, compiles, evictions, timeline):
    res = list(self._results.values())
    gen = sum(len(r.tokens) for r in res)
    ttft = [r.ttft_s for r in res]
    tpot = [r.tpot_s for r in res if r.tpot_s is not None]
    busy = [x for x in timeline if x["allocated"]]
    return dict(
        requests=len(res), wall_s=wall, iterations=iterations,
        generated_tokens=gen, tokens_per_s=gen / wall,
        requests_per_s=len(res) / wall,
        prompt_tokens=sum(r.prompt_len for r in res),
        prefill_tokens=self.prefill_tokens,
        cached_tokens=sum(r.cached_tokens for r in res),
        prefill_s=self.prefill_s, decode_s=self.decode_s,
        decode_calls=self.decode_calls, prefill_calls=self.prefill_calls,
        cow_copies=self.cow_copies,
        preemptions=self.preemptions, swap_outs=self.swap_outs,
        swap_ins=self.swap_ins, evictions=evictions,
        compiles_after_warmup=compiles,
        peak_allocated_slots=max((x["allocated"] for x in timeline),
                                 default=0),
        mean_utilisation=(float(np.mean([x["used"] / x["allocated"]
                                         for x in busy])) if busy else None),
        ttft_p50_s=_percentile(ttft, 50), ttft_p99_s=_percentile(ttft, 99),
        tpot_p50_s=_percentile(tpot, 50), tpot_p99_s=_percentile(tpot, 99))
