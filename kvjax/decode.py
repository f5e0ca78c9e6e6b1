"""The one decode loop. Everything that decodes more than one token runs it:
`generate`, the decode benchmarks, the streaming evaluation.

  plan(...)  how a loop lays out its work (static): the attention schedule
             (segments that attend a prefix of the cache) and the layout a
             segment reads: the stacked cache itself, or a per-segment
             view of its prefix (`kvjax.blocked`, `kvjax.layered`,
             `kvjax.layered_latent`, and the native kernel's
             `kvjax.native_layered`, `kvjax.native_latent`), copied in
             once per segment (MLA's native view reads the stacked cache
             in place) and written back as the window of slots the
             segment's steps wrote (`layered.written_window`).
  run(...)   n decode steps from a token and a cache: `lax.scan` segments
             per the plan, or one `lax.while_loop` that stops when every
             sequence has emitted a stop token. Step i feeds the current
             token, gets the logits, emits `emit(logits, next, x_i, cache)`
             and continues with `next = choose(logits, x_i)`: a sampler
             (generate, benchmarks) or the next given token (teacher
             forcing: the streaming evaluation).

The loop alone chooses the cache layout a step reads; the model sees a cache
and never asks which. RoPE's cos/sin of the next position ride in the loop
carry (`model.decode_rope`), computed once per step rather than in every
consumer.

Dimension alphabet (`kvjax.config`): B batch, V vocab, I the n steps of one
loop.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from kvjax import blocked
from kvjax import cache as cache_lib
from kvjax import layered
from kvjax import layered_latent
from kvjax import model
from kvjax import native_attention
from kvjax import native_latent
from kvjax import native_layered
from kvjax import norm_matvec
from kvjax import projections
from kvjax.config import ModelConfig

ATTEND_MIN = 128  # smallest attention prefix a decode segment uses
DECODE_LAYOUTS = ("auto", "stacked", "blocked", "layered", "native")
# Segment views per (layout, attention): modules with supports / from_cache /
# into_cache and a registered decode cache kind
# (`attention.register_decode_cache`).
_VIEWS = {("blocked", "gqa"): blocked, ("layered", "gqa"): layered,
          ("layered", "mla"): layered_latent,
          ("native", "gqa"): native_layered, ("native", "mla"): native_latent}


def segment_view(layout: str, attention: str):
  """The module of a segment's view for `layout` and `config.attention`
  ('layered' / 'native' / 'blocked'; None where the layout has none:
  'stacked', or 'blocked' for MLA): supports / from_cache / into_cache."""
  return _VIEWS.get((layout, attention))


# 'auto' reads float caches layered from this batch on: at batch 1 a float
# per-layer array measured 0.5x the stacked step (gqa-small, 8192 slots).
LAYERED_MIN_BATCH = 4
# 'auto' reads float caches layered (`kvjax.layered`) in segments attending
# this many slots or more, from LAYERED_MIN_BATCH sequences on (float32 at
# batch 8 against the stacked cache, experiments/cache_layout.py:
# gqa-medium 0.99x at 512 slots, 1.05x at 2048, 1.20x at 4096; mha-small
# 1.60x at 2048, 2.06x at 8192; WORKSPACE.md "Quantized caches"), and
# int8 / int4 caches layered at every batch and length (integer
# attention). Nothing picks 'blocked' by itself any more: the layered cache
# beat it at every point (blocked 0.94-1.01x for gqa-medium, 1.24-1.54x
# for mha-small). MLA: int8 / int4 latents layered at every batch and
# length (integer attention, `kvjax.layered_latent`: mla-small at batch 8,
# 2.9-3.7x the stacked float32 step at 2048-4096 slots), float latents
# stacked (layered 0.92-1.11x there: the absorbed step is bound by its
# dots, not by the slice copy).
LAYERED_MIN_SLOTS = 2048


@dataclasses.dataclass(frozen=True)
class Plan:
  """How `run` lays out its steps (static, hashable).

  schedule: segments ((n_steps, attend), ...): each a `lax.scan` attending
    the first `attend` slots (0: the whole cache); None: one segment over
    the whole cache.
  layout: 'stacked' (steps read the cache itself), or a view every
    segment whose prefix the view supports reads instead: 'blocked'
    (`BlockedKV`), 'layered' (`LayeredKV`).
  layouts: one layout per segment of the schedule, overriding `layout`
    (() : `layout` for all).
  """

  schedule: tuple[tuple[int, int], ...] | None = None
  layout: str = "stacked"
  layouts: tuple[str, ...] = ()

  def segment_layout(self, i: int) -> str:
    return self.layouts[i] if self.layouts else self.layout

  @property
  def blocked(self) -> bool:
    """Whether any segment reads the blocked view."""
    return "blocked" in (self.layouts or (self.layout,))


def bucket_length(n: int, minimum: int = 16) -> int:
  """The power of two >= n (at least `minimum`): prompt buckets and attended
  prefixes, so that a new length rarely needs a new compiled program."""
  return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def attention_schedule(prompt_len: int, decode_steps: int, capacity: int,
                       multiple: int = 1, minimum: int = ATTEND_MIN
                       ) -> tuple[tuple[int, int], ...]:
  """Segments (n_steps, attend) of a decode loop over a cache whose filled
  slots are a prefix (eviction 'none'): decode step j (0-based) of a prompt
  of at most `prompt_len` tokens fills slots [0, prompt_len + j], so it
  attends over the smallest power of two (at least `minimum`) that covers
  them, or, in the last segment, over the slots the whole generation fills
  rounded up to `minimum`; attends are rounded up to `multiple`, and 0
  stands for the whole capacity.

  Why: attention and the cache read cost the attended slots, not the filled
  ones; a cache sized for the longest generation would otherwise be read
  whole from the first step. A power-of-two schedule wastes at most 2x and
  compiles one loop body per segment (log2 of capacity / prompt). The last
  segment stops at what the generation needs, not at the next power of two
  (prompt 128 + 255 steps in a 512-slot cache: 128 steps over 256 slots,
  then 127 over 384, not 512): fewer slots read, no extra loop body.
  """
  def round_up(n, m):
    return -(-n // m) * m

  last = round_up(round_up(prompt_len + decode_steps, minimum), multiple)
  out, j = [], 0
  while j < decode_steps:
    need = prompt_len + j + 1
    S = min(round_up(bucket_length(need, minimum), multiple), last)
    if S >= capacity:
      out.append((decode_steps - j, 0))
      break
    n = min(decode_steps - j, S - prompt_len - j)
    out.append((n, S))
    j += n
  return tuple(out)


def platform(params) -> str:
  """The platform the params live on (numpy leaves: the default backend)."""
  leaf = jax.tree_util.tree_leaves(params)[0]
  if isinstance(leaf, jax.Array):
    return next(iter(leaf.devices())).platform
  return jax.default_backend()


def plan(params, config: ModelConfig, policy: cache_lib.CachePolicy,
         batch: int, prompt_len: int, steps: int, capacity: int, *,
         attend_buckets: bool = True, stops: bool = False,
         sharded: bool = False, decode_layout: str = "auto") -> Plan:
  """The plan `generate` uses for `steps` decode steps after a prompt of
  `prompt_len` (bucketed) tokens in a `capacity`-slot cache; the decode
  benchmarks call it with the same arguments, so they time the same loop.

  The attention schedule needs eviction 'none', positions 'original', no
  stop tokens (the while_loop has one body) and no sharding plan; without
  `attend_buckets` it is one segment over the whole cache. Both
  views need the schedule and per-layer params (what
  `kvjax.packed.for_decode` gives on CPU); 'blocked' a float GQA-family
  cache, 'layered' a `layered.LAYERED_DTYPES` one with per-token keys, or
  MLA's latents (`layered_latent.LAYERED_LATENT_DTYPES`, absorbed decode
  path); 'native' what the CPU kernel reads (`native_layered.NATIVE_DTYPES`,
  MLA's `native_latent.NATIVE_LATENT_DTYPES`) where it built. 'auto'
  (CPU params, where they were measured): 'native' where
  `native_attention.preferred` (built, on an AVX-512 or AVX2 host: every
  kind; WORKSPACE.md "Quantized caches, and the cache-dominated regime");
  else 'layered' for int8 / int4 caches at every batch (MLA's latents
  too); for the GQA family's float caches from LAYERED_MIN_BATCH sequences
  on, 'layered' in segments attending LAYERED_MIN_SLOTS slots or more;
  else 'stacked'.

  Raises:
    ValueError: an unknown decode_layout, or a view where it cannot run.
  """
  if decode_layout not in DECODE_LAYOUTS:
    raise ValueError(f"decode_layout={decode_layout!r} is not one of "
                     f"{DECODE_LAYOUTS}")
  schedule = None
  if (not policy.bounded and policy.positions == "original" and not stops
      and not sharded):
    # Without buckets: one segment over the whole cache (what run does for
    # schedule None), so that a view can still read it.
    schedule = attention_schedule(
        prompt_len, steps, capacity,
        policy.key_group if policy.channel_keys else 1) if attend_buckets \
        else ((steps, 0),)
  if decode_layout == "stacked":
    return Plan(schedule)
  if decode_layout != "auto":
    why = _why_not(decode_layout, schedule, params, config, policy)
    if why:
      raise ValueError(f"decode_layout={decode_layout!r}: {why}")
    return Plan(schedule, decode_layout)
  if platform(params) != "cpu":
    return Plan(schedule)
  if native_attention.preferred() and not _why_not(
      "native", schedule, params, config, policy):
    return Plan(schedule, "native")
  if _why_not("layered", schedule, params, config, policy):
    return Plan(schedule)
  if policy.quantized:
    return Plan(schedule, "layered")
  if batch < LAYERED_MIN_BATCH or config.attention == "mla":
    return Plan(schedule)
  layouts = tuple("layered" if (attend or capacity) >= LAYERED_MIN_SLOTS
                  else "stacked" for _, attend in schedule)
  return Plan(schedule, layouts[-1], layouts)


def _why_not(layout: str, schedule, params, config: ModelConfig,
             policy: cache_lib.CachePolicy) -> str | None:
  """Why `layout` (a view) cannot run this loop, or None."""
  if schedule is None:
    return ("it runs decode segments, which need eviction='none', "
            "positions='original', no stop tokens and no shardings")
  if (layout, config.attention) not in _VIEWS:
    return (f"attention={config.attention!r} has no {layout!r} view (MLA's "
            "latents have 'layered' and 'native')")
  if config.attention == "mla" and config.mla_decode != "absorbed":
    return (f"mla_decode={config.mla_decode!r} expands the latents every "
            "step; the layered latent view serves the absorbed path")
  if layout == "blocked" and policy.quantized:
    return f"kv_dtype={policy.kv_dtype!r} (quantized scales are not blocked)"
  dtypes = {("layered", "gqa"): layered.LAYERED_DTYPES,
            ("layered", "mla"): layered_latent.LAYERED_LATENT_DTYPES,
            ("native", "gqa"): native_layered.NATIVE_DTYPES,
            ("native", "mla"): native_latent.NATIVE_LATENT_DTYPES,
            }.get((layout, config.attention), ())
  if layout in ("layered", "native") and (policy.kv_dtype not in dtypes
                                          or policy.channel_keys):
    return (f"kv_dtype={policy.kv_dtype!r}, key_quant={policy.key_quant!r} "
            f"({layout}: {dtypes}, per-token keys)")
  if layout == "native" and not native_attention.available():
    return ("the native decode-attention kernel did not build on this host "
            "(or KVJAX_NATIVE=0)")
  if not projections.is_packed(params):
    return ("stacked layer params reach the cache by a traced layer index; "
            "per-layer arrays need the decode layout (`kvjax.pack`)")
  return None


def _no_pin(logits, cache):
  return logits, cache


def run(params, config: ModelConfig, tok_B, cache, xs, *,
        choose: Callable[[jax.Array, Any], jax.Array],
        emit: Callable[..., Any], n: int | None = None,
        plan: Plan = Plan(), stop_tokens: tuple[int, ...] = (),
        pad_id: int = 0, pin: Callable = _no_pin):
  """Decode steps from `tok_B` [B] and `cache` (traceable; jit the caller).

  Args:
    xs: per-step inputs, a pytree with leading axis I (n steps: PRNG keys,
      given tokens), or None with `n`.
    choose: (logits [B, V] float32, x_i) -> the next token [B] int32.
    emit: (logits [B, V], next [B], x_i, cache) -> a pytree recorded per
      step.
    plan: the segments and layout (`plan`); with stop tokens one body runs.
    stop_tokens: with stop tokens a `lax.while_loop` runs until every
      sequence has chosen one (or n steps); a finished sequence chooses
      `pad_id` from then on and its emitted records keep their zeros.
    pin: (logits, cache) -> (logits, cache): sharding constraints applied
      to every step's results (generate's sharding plan).
  Returns:
    (last token [B], new cache, records stacked on a leading I axis).
  """
  if n is None:
    n = jax.tree_util.tree_leaves(xs)[0].shape[0]

  def step(tok_B, cache, rope, attend=0):
    with norm_matvec.weights(params):  # the step streams these
      logits_BV, cache = pin(*model.decode_logits(params, config, tok_B,
                                                  cache, attend, rope))
    return logits_BV, cache

  def x_at(i):
    return None if xs is None else jax.tree_util.tree_map(lambda a: a[i],
                                                          xs)

  if not stop_tokens:
    def body(carry, x, attend):
      tok_B, cache, rope = carry
      logits_BV, cache = step(tok_B, cache, rope, attend)
      nxt_B = choose(logits_BV, x)
      return ((nxt_B, cache, model.decode_rope(config, cache)),
              emit(logits_BV, nxt_B, x, cache))

    records, start = [], 0
    for i, (steps, attend) in enumerate(plan.schedule or ((n, 0),)):
      prefix = attend or cache.capacity
      view = segment_view(plan.segment_layout(i), config.attention)
      use_view = view is not None and view.supports(cache, prefix) is None
      seg = view.from_cache(cache, prefix) if use_view else cache
      seg_xs = (None if xs is None else
                jax.tree_util.tree_map(lambda a, s=start, k=steps: a[s:s + k],
                                       xs))
      (tok_B, seg, _), ys = jax.lax.scan(
          functools.partial(body, attend=0 if use_view else attend),
          (tok_B, seg, model.decode_rope(config, seg)), seg_xs,
          length=steps)
      cache = view.into_cache(cache, seg, steps) if use_view else seg
      records.append(ys)
      start += steps
    ys = jax.tree_util.tree_map(lambda *a: jnp.concatenate(a, axis=0),
                                *records)
    return tok_B, cache, ys

  stops = jnp.asarray(stop_tokens, jnp.int32)
  B = tok_B.shape[0]
  shape = jax.eval_shape(
      lambda t, c: emit(jnp.zeros((B, config.vocab_size), jnp.float32), t,
                        x_at(0), c), tok_B, cache)
  ys = jax.tree_util.tree_map(lambda s: jnp.zeros((n,) + s.shape, s.dtype),
                              shape)

  def cond(state):
    i, _, _, _, done_B, _ = state
    return (i < n) & ~jnp.all(done_B)

  def loop_body(state):
    i, tok_B, cache, rope, done_B, ys = state
    x = x_at(i)
    logits_BV, cache = step(tok_B, cache, rope)
    nxt_B = jnp.where(done_B, pad_id, choose(logits_BV, x)).astype(jnp.int32)
    ys = jax.tree_util.tree_map(lambda buf, y: buf.at[i].set(y), ys,
                                emit(logits_BV, nxt_B, x, cache))
    done_B = done_B | jnp.isin(nxt_B, stops)
    return (i + 1, nxt_B, cache, model.decode_rope(config, cache), done_B,
            ys)

  done0 = jnp.isin(tok_B, stops)
  state = (jnp.int32(0), tok_B, cache, model.decode_rope(config, cache),
           done0, ys)
  _, tok_B, cache, _, _, ys = jax.lax.while_loop(cond, loop_body, state)
  return tok_B, cache, ys
