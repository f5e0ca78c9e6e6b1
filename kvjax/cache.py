"""KV caches as immutable pytrees, their policy, slot arithmetic and bytes.

Two cache kinds, one per attention family:

  KVCache      k, v       [L, B, K, S, H]   (MHA / MQA / GQA)
  LatentCache  c_kv       [L, B, S, C]      (MLA: one latent per token)
               k_rope     [L, B, S, R]      (MLA: the shared rotary key)

Both carry `positions [B, S]` (the stream position held by each slot, -1 when
empty), `length [B]` (tokens of each sequence seen so far, i.e. the next
position) and `errors [B]` (a sticky bit set per sequence: overflow, an
out-of-range id, an invalid mask, non-finite logits), stored once for all
layers.

Errors travel with the cache (`kvjax.errors`): traced code cannot raise, so
the step that detects a problem records it here and returns NaN logits for
the rows it hit; every public entry point raises a ValueError naming the
error and the sequences when it receives or produces a cache with a bit
set. Static metadata (the `CachePolicy`) is
a non-pytree field, so it is part of the jit cache key, never traced.

Slots are heads-first (`[L, B, K, S, H]`): measured 1.2-2.1x faster per decode
step on CPU than `[L, B, S, K, H]` because attention reads each head's keys as
one contiguous block (see WORKSPACE.md).

Every function here returns a new cache; none mutates. Under `jit` with the
cache donated XLA performs the scatter in place.
"""

from __future__ import annotations

import dataclasses
from typing import Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax import policies
from kvjax import quant
from kvjax.config import ModelConfig
from kvjax.validate import check_int

EVICTIONS = tuple(policies.REGISTRY)
POSITION_MODES = ("original", "cache")
KV_DTYPES = ("float32", "bfloat16", "float16", "int8", "int4", "int2")
# kv dtypes stored as codes and float32 scales (int2: scales and zeros).
QUANTIZED = ("int8", "int4", "int2")
KEY_QUANT = ("token", "channel")
CHANNEL_KEY_DTYPES = QUANTIZED  # key_quant='channel' (KIVI): any code width
EMPTY = -1  # position stored in a slot that holds no token


@dataclasses.dataclass(frozen=True)
class CachePolicy:
  """How a bounded cache stores and evicts tokens (static, hashable).

  eviction: a registered policy name (`kvjax.policies.REGISTRY`: none,
    window, sinks, h2o, tova, knorm, snapkv, pyramid, adakv) or a policy
    object (`kvjax.policies.SnapKV(window=16)`); stored as its name, the
    object in `evictor`.
    none    slot = position; overflowing the capacity is an error.
    window  a rolling buffer of the last `capacity` tokens.
    sinks   the first `num_sinks` tokens pinned, a rolling window for the
            rest (StreamingLLM, Xiao et al. 2023).
    h2o     heavy hitters: the `recent` newest tokens always kept, the rest of
            the slots hold the tokens with the largest accumulated attention
            (H2O, Zhang et al. 2023).
    others  see `kvjax.policies`.
  num_sinks: sinks only (>= 1). recent: scored policies' always-kept newest
    tokens (0: the policy's default; h2o given by name needs it >= 1).
  options: further options of a policy given by name, as (key, value)
    pairs (e.g. (("window", 16),) for snapkv), so that configs can set them;
    moved into `evictor` on construction (then ()).
  evictor: the policy object (derived; pass `eviction` instead).
  positions:
    original  keys are rotated once, at their position in the stream. Kept
              old tokens (sinks, heavy hitters) then sit at their full stream
              distance from the query, which a long stream pushes beyond any
              distance seen in training.
    cache     keys are stored before RoPE and rotated at attention time by
              their rank inside the cache (StreamingLLM's choice, and the
              default for sinks in the experiments), so the cache always
              looks like positions 0..S-1. Costs one rotation of
              every cached key of every layer per step: K·H numbers per slot
              for GQA, only the R-wide `k_rope` for MLA (the latent is
              position-free); scored policies also rank the slots (a sort)
              per step. Measured +13-18 % per GQA decode step, +5-8 % for
              MLA, at S = 1024 (WORKSPACE.md). With window eviction both
              modes are the same model (RoPE is relative). Policies scoped
              per layer or head need 'original'.
  kv_dtype: storage dtype; int8 and int4 store symmetric codes and one
    float32 scale per token and head (MLA: per token and latent array).
    int4 packs two codes a byte: the payload's last axis is H / 2 (MLA:
    C / 2, R / 2), so those widths must be even (`init_cache` raises
    naming the field; `kvjax.quant`). int2 (KIVI's 2-bit setting) stores
    asymmetric codes, eight an int16 (widths multiples of 8), with a
    float32 scale and zero per token and head (`kvjax.quant`).
  key_quant (int8, int4 and int2 only):
    token    keys quantized like values: one scale per token and head.
    channel  KIVI (Liu et al. 2024): keys quantized per channel over groups
             of `key_group` consecutive tokens (key outliers sit in fixed
             channels, so a per-channel scale wastes fewer levels), at
             the kv_dtype's width: int8, or int4 / int2 codes (KIVI's 4-
             and 2-bit settings; values per token at the same width). The
             newest, incomplete group is also kept in float32 (the
             residual) and attention reads it from there; each decode step
             re-quantizes that one group, so a group's final int8 values
             come from its `key_group` full-precision tokens. Eviction
             'none' only (other policies overwrite single slots
             inside a quantized group), capacity a multiple of key_group.
             MLA: both latent arrays (`c_kv`, `k_rope`) are quantized this
             way, since every key is computed from them (and its values
             from `c_kv`: see kvjax/kivi.py).
  key_group: tokens per per-channel key group (key_quant='channel').
  """

  eviction: str = "none"
  num_sinks: int = 0
  recent: int = 0
  positions: str = "original"
  kv_dtype: str = "float32"
  key_quant: str = "token"
  key_group: int = 32
  options: tuple = ()
  evictor: policies.Policy | None = None

  @property
  def append_only(self) -> bool:
    """Every token keeps its own slot, slot = position, nothing evicted or
    overwritten (eviction 'none'): a call's new tokens can be written
    before they are attended without hiding an old one."""
    return self.eviction == "none"

  def __post_init__(self):
    set_ = lambda k, v: object.__setattr__(self, k, v)
    set_("evictor", self._build_evictor())
    ev = self.evictor
    set_("eviction", ev.name)
    set_("num_sinks", ev.pinned)
    set_("recent", getattr(ev, "recent", 0))
    set_("options", ())  # held by the evictor now
    if self.positions not in POSITION_MODES:
      raise ValueError(
          f"positions={self.positions!r} is not one of {POSITION_MODES}")
    if self.kv_dtype not in KV_DTYPES:
      raise ValueError(f"kv_dtype={self.kv_dtype!r} is not one of {KV_DTYPES}")
    if self.key_quant not in KEY_QUANT:
      raise ValueError(
          f"key_quant={self.key_quant!r} is not one of {KEY_QUANT}")
    if ev.scoped and self.positions != "original":
      raise ValueError(
          f"eviction {ev.name!r} with scope={ev.scope!r} keeps different "
          "tokens per layer/head and needs positions='original' (cache "
          "ranks are per sequence)")
    if self.key_quant == "channel":
      if self.kv_dtype not in CHANNEL_KEY_DTYPES:
        raise ValueError(f"key_quant='channel' quantizes keys to integer "
                         f"codes; it needs kv_dtype in {CHANNEL_KEY_DTYPES}, "
                         f"got {self.kv_dtype!r}")
      if self.eviction != "none":
        raise ValueError(
            f"key_quant='channel' needs eviction='none', got "
            f"{self.eviction!r}: evicting single slots would leave a "
            "quantized key group with a scale computed from tokens that "
            "are gone")
      if not isinstance(self.key_group, int) or self.key_group < 1:
        raise ValueError(f"key_group must be an int >= 1, got "
                         f"{self.key_group!r}")

  def _build_evictor(self) -> policies.Policy:
    ev, n, recent = self.eviction, self.num_sinks, self.recent
    if isinstance(ev, policies.Policy):
      if n or recent or self.options:
        raise ValueError("num_sinks / recent / options are options of a "
                         "policy given by name; set them on the policy "
                         f"object {ev!r}")
      return ev
    if ev not in policies.REGISTRY:
      raise ValueError(f"eviction={ev!r} is not one of {EVICTIONS}")
    if not isinstance(n, int) or n < 0:
      raise ValueError(f"num_sinks must be >= 0, got {n}")
    if n and ev != "sinks":
      raise ValueError(f"num_sinks={n} needs eviction='sinks', got {ev!r}")
    if ev == "sinks" and n < 1:
      raise ValueError("eviction='sinks' needs num_sinks >= 1")
    scored = issubclass(policies.REGISTRY[ev], policies.Scored)
    if recent and not scored:
      raise ValueError(f"recent={recent} needs a scored eviction (h2o, "
                       f"tova, ...), got {ev!r}")
    if ev == "h2o" and recent < 1:
      raise ValueError("eviction='h2o' needs recent >= 1")
    opts = dict(self.options)
    if ev == "sinks":
      opts["num_sinks"] = n
    if recent:
      opts["recent"] = recent
    old = self.evictor
    if old is not None and old.name == ev:  # dataclasses.replace keeps it
      return dataclasses.replace(old, **opts) if opts else old
    return policies.make(ev, **opts)

  @property
  def quantized(self) -> bool:
    return self.kv_dtype in QUANTIZED

  @property
  def channel_keys(self) -> bool:
    """KIVI per-channel key groups (see `key_quant`)."""
    return self.key_quant == "channel"

  @property
  def bounded(self) -> bool:
    """True when old tokens are evicted instead of overflowing."""
    return self.evictor.bounded

  @property
  def scored(self) -> bool:
    """True for score-based eviction (a per-slot score state)."""
    return self.evictor.scored

  @property
  def scoped(self) -> bool:
    """True when layers (or heads) keep different tokens: positions are
    then [L, B, K', S] (`kvjax.policies`)."""
    return self.evictor.scoped

  def round_capacity(self, capacity: int) -> int:
    """The smallest valid capacity >= `capacity` (whole KIVI key groups)."""
    if self.channel_keys:
      return -(-capacity // self.key_group) * self.key_group
    return capacity

  def validate_capacity(self, capacity: int) -> None:
    if capacity < 1:
      raise ValueError(f"capacity must be >= 1, got {capacity}")
    self.evictor.validate_capacity(capacity)
    if self.channel_keys and capacity % self.key_group:
      raise ValueError(
          f"capacity={capacity} must be a multiple of key_group="
          f"{self.key_group} (key_quant='channel' quantizes whole groups)")


@struct.dataclass
class KVCache:
  """Per-head keys and values: k, v [L, B, K, S, H].

  k, v are [L, B, K, S, H / 2] uint8 for int4 (two codes a byte:
  `kvjax.quant`).
  k_scale, v_scale: int8 / int4 scales, [L, B, K, S] per token and head;
  None for float caches. With key_quant='channel' (KIVI) k_scale is per
  channel and group instead, [L, B, K, S / key_group, H], and
  k_resid: [L, B, K, key_group, H] float32, the newest (incomplete) key
  group of each sequence in full precision (else None).
  scores: slot scores of a scored policy (`kvjax.policies`), [B, S] for
    a global one, [L, B, K', S] per layer / head; else None.
  budget: [L, B, K'] int32 slots each scope may fill (scoped policies
    only, else None). positions is then [L, B, K', S].
  errors: [B] int32 error bits (`kvjax.errors`; `init_cache` sets zeros).
  """

  k: jax.Array
  v: jax.Array
  positions: jax.Array
  length: jax.Array
  k_scale: jax.Array | None = None
  v_scale: jax.Array | None = None
  scores: jax.Array | None = None
  k_resid: jax.Array | None = None
  errors: jax.Array | None = None
  budget: jax.Array | None = None
  policy: CachePolicy = struct.field(pytree_node=False,
                                     default=CachePolicy())

  @property
  def capacity(self) -> int:
    return self.k.shape[3]

  @property
  def batch(self) -> int:
    return self.k.shape[1]


@struct.dataclass
class LatentCache:
  """MLA's latent cache: c_kv [L, B, S, C], k_rope [L, B, S, R].

  c_kv, k_rope are [L, B, S, C / 2], [L, B, S, R / 2] uint8 for int4 (two
  codes a byte: `kvjax.quant`).
  c_scale, r_scale: int8 / int4 scales [L, B, S] (None for float caches);
  with key_quant='channel' (KIVI) per channel and group instead,
  [L, B, S / key_group, C] and [L, B, S / key_group, R], and
  c_resid [L, B, key_group, C], r_resid [L, B, key_group, R]: the newest
  group in float32 (else None).
  scores, budget: as `KVCache` (the head axis K' is 1: the latent is
    shared by every head).
  errors: [B] int32 error bits (`kvjax.errors`; `init_cache` sets zeros).
  """

  c_kv: jax.Array
  k_rope: jax.Array
  positions: jax.Array
  length: jax.Array
  c_scale: jax.Array | None = None
  r_scale: jax.Array | None = None
  scores: jax.Array | None = None
  c_resid: jax.Array | None = None
  r_resid: jax.Array | None = None
  errors: jax.Array | None = None
  budget: jax.Array | None = None
  policy: CachePolicy = struct.field(pytree_node=False,
                                     default=CachePolicy())

  @property
  def capacity(self) -> int:
    return self.c_kv.shape[2]

  @property
  def batch(self) -> int:
    return self.c_kv.shape[1]


Cache = Union[KVCache, LatentCache]


def _storage_dtype(policy: CachePolicy):
  return quant.storage_dtype(policy.kv_dtype)


def init_cache(config: ModelConfig, batch: int, capacity: int,
               dtype=None, policy: CachePolicy | None = None) -> Cache:
  """An empty cache for `batch` sequences of `capacity` slots each.

  Args:
    config: the model.
    batch: B.
    capacity: S, slots per sequence.
    dtype: storage dtype (float32, bfloat16, float16, int8, int4 or int2);
      overrides `policy.kv_dtype` when given.
    policy: eviction / position / quantization policy (default: unbounded
      float32, i.e. eviction='none').
  Returns:
    KVCache (attention='gqa') or LatentCache (attention='mla').
  Raises:
    ValueError: a bad batch / capacity, or int4 with an odd head_dim
      (MLA: kv_lora_rank, qk_rope_head_dim), naming the field.
  """
  policy = policy or CachePolicy()
  if dtype is not None:
    policy = dataclasses.replace(policy, kv_dtype=jnp.dtype(dtype).name)
  check_int("batch", batch, 1)
  check_int("capacity", capacity, 1)
  policy.validate_capacity(capacity)
  store = _storage_dtype(policy)
  L, B, S = config.num_layers, batch, capacity
  length = jnp.zeros((B,), jnp.int32)
  errors = jnp.zeros((B,), jnp.int32)
  ev = policy.evictor
  if ev.scoped:
    Kp = scope_heads(config, policy)
    positions = jnp.full((L, B, Kp, S), EMPTY, jnp.int32)
    scores = jnp.zeros((L, B, Kp, S), jnp.float32)
    budget = jnp.broadcast_to(
        jnp.asarray(ev.budgets(L, Kp, S), jnp.int32)[:, None], (L, B, Kp))
  else:
    positions = jnp.full((B, S), EMPTY, jnp.int32)
    scores = jnp.zeros((B, S), jnp.float32) if ev.scored else None
    budget = None
  q = policy.quantized
  packed = lambda w, field: quant.packed_width(policy.kv_dtype, w, field)
  # int2 scales carry (scale, zero): per token a trailing pair, per channel
  # group the scales then the zeros (`kvjax.quant`).
  pair = policy.kv_dtype == "int2"
  tok = (2,) if pair else ()
  ch = 2 if pair else 1
  if config.attention == "mla":
    C, R = config.kv_lora_rank, config.qk_rope_head_dim
    Cp, Rp = packed(C, "kv_lora_rank"), packed(R, "qk_rope_head_dim")
    extra = {}
    if policy.channel_keys:
      g = policy.key_group
      extra = dict(c_scale=jnp.zeros((L, B, S // g, ch * C), jnp.float32),
                   r_scale=jnp.zeros((L, B, S // g, ch * R), jnp.float32),
                   c_resid=jnp.zeros((L, B, g, C), jnp.float32),
                   r_resid=jnp.zeros((L, B, g, R), jnp.float32))
    elif q:
      extra = dict(c_scale=jnp.zeros((L, B, S) + tok, jnp.float32),
                   r_scale=jnp.zeros((L, B, S) + tok, jnp.float32))
    return LatentCache(
        c_kv=jnp.zeros((L, B, S, Cp), store),
        k_rope=jnp.zeros((L, B, S, Rp), store),
        positions=positions, length=length, scores=scores, policy=policy,
        errors=errors, budget=budget, **extra)
  K, H = config.num_kv_heads, config.head_dim
  Hp = packed(H, "head_dim")
  k_scale = jnp.zeros((L, B, K, S) + tok, jnp.float32) if q else None
  k_resid = None
  if policy.channel_keys:
    g = policy.key_group
    k_scale = jnp.zeros((L, B, K, S // g, ch * H), jnp.float32)
    k_resid = jnp.zeros((L, B, K, g, H), jnp.float32)
  return KVCache(
      k=jnp.zeros((L, B, K, S, Hp), store),
      v=jnp.zeros((L, B, K, S, Hp), store),
      positions=positions, length=length,
      k_scale=k_scale,
      v_scale=jnp.zeros((L, B, K, S) + tok, jnp.float32) if q else None,
      scores=scores, k_resid=k_resid, errors=errors, budget=budget,
      policy=policy)


def scope_heads(config: ModelConfig, policy: CachePolicy) -> int:
  """K': the head axis of a scoped policy's positions (1 per layer; K per
  kv head). Raises ValueError for per-head eviction of MLA's latent."""
  if policy.evictor.scope != "head":
    return 1
  if config.attention == "mla":
    raise ValueError(
        f"eviction {policy.eviction!r} with scope='head' evicts per kv head; "
        "MLA's latent cache is shared by every head (use scope='layer')")
  return config.num_kv_heads


# ---- writes -----------------------------------------------------------------
def read_slots(arr, layer, start, size: int, slot_axis: int):
  """Slots [start, start + size) of one layer of a stacked cache array
  (layers on axis 0, slots on `slot_axis`), as [...] without the layer
  axis. One dynamic slice of the whole array: inside a loop XLA reads it
  in place, where a layer slice taken before the loop is a copy of the
  layer (`flash.CachedKeys`)."""
  starts = [0] * arr.ndim
  starts[0], starts[slot_axis] = layer, start
  sizes = list(arr.shape)
  sizes[0], sizes[slot_axis] = 1, size
  return jax.lax.dynamic_slice(arr, starts, sizes)[0]


def scatter_tokens(arr, layer, slots_BT, new_BT, slot_axis):
  """arr[layer, b, ..., slots[b, t], ...] = new[b, t] (slot = S: dropped).

  slot_axis: 3 for the per-head arrays ([L, B, K, S, ...]), 2 for the
  latent ones ([L, B, S, ...]); new_BT is [B, T, ...] without the slot axis.
  slots_BT may be [B, T, K] for the per-head arrays: head k of token t goes
  to its own slot (per-head eviction; new_BT is then [B, T, K, ...]).
  """
  if slots_BT.ndim == 3:
    if slots_BT.shape[2] == 1:
      slots_BT = slots_BT[:, :, 0]
    else:
      B, T, K = slots_BT.shape
      b_BTK = jnp.broadcast_to(jnp.arange(B)[:, None, None], (B, T, K))
      k_BTK = jnp.broadcast_to(jnp.arange(K)[None, None], (B, T, K))
      return arr.at[layer, b_BTK, k_BTK, slots_BT].set(
          new_BT.astype(arr.dtype), mode="drop")
  B, T = slots_BT.shape
  b_BT = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
  if slot_axis == 3:  # [L, B, K, S, ...]
    return arr.at[layer, b_BT, :, slots_BT].set(new_BT.astype(arr.dtype),
                                                mode="drop")
  return arr.at[layer, b_BT, slots_BT].set(new_BT.astype(arr.dtype),
                                           mode="drop")



# ---- memory accounting ------------------------------------------------------
def kv_bytes_per_token(config: ModelConfig, dtype="float32", *,
                       key_group: int = 0) -> float:
  """Cache bytes one token of one sequence occupies, over all layers.

  GQA: L × K × 2 × H × bytes; MLA: L × (C + R) × bytes, int4's bytes
  being 1/2 (two codes a byte; H, or C and R, must then be even: else a
  ValueError naming the field) and int2's 1/4 (eight codes an int16;
  multiples of 8). For the integer forms the float32 scales are included
  (int2: a scale and a zero, 8 bytes): per token (and head), or with
  `key_group` > 0 (KIVI per-channel keys) the value scales per token and
  the key scales per channel and group, 4 × K × H / key_group bytes per
  token (int2: 8 ×; MLA: the latent's 4 × (C + R) / key_group; a float
  when that does not divide).
  KIVI's float32 residual group is a fixed L × B × K × key_group × H × 4
  (MLA: L × B × key_group × (C + R) × 4) bytes, not per token
  (`cache_bytes`).
  """
  name = jnp.dtype(dtype).name if not isinstance(dtype, str) else dtype
  if name not in KV_DTYPES:
    raise ValueError(f"kv dtype {name!r} is not one of {KV_DTYPES}")
  width = lambda w, field: quant.packed_width(name, w, field)
  # Storage elements per token and layer (int4: bytes of two codes each;
  # int2: int16s of eight).
  if config.attention == "mla":
    elements = (width(config.kv_lora_rank, "kv_lora_rank") +
                width(config.qk_rope_head_dim, "qk_rope_head_dim"))
  else:
    elements = 2 * config.num_kv_heads * width(config.head_dim, "head_dim")
  per_layer = elements * quant.storage_dtype(name).itemsize
  if key_group and name not in CHANNEL_KEY_DTYPES:
    raise ValueError(f"key_group (KIVI per-channel keys) needs a cache of "
                     f"{CHANNEL_KEY_DTYPES}, got {name!r}")
  # Bytes of one scale: a float32, or int2's (scale, zero) pair.
  scale_bytes = 8 if name == "int2" else 4
  if key_group:
    if config.attention == "mla":  # latent and rotary key, per channel
      value_scales = 0
      channels = config.kv_lora_rank + config.qk_rope_head_dim
    else:  # values per token and head, keys per channel
      value_scales = scale_bytes * config.num_kv_heads
      channels = config.num_kv_heads * config.head_dim
    key_scales = scale_bytes * channels / key_group
    per_layer += value_scales + (int(key_scales) if key_scales.is_integer()
                                 else key_scales)
  elif name in QUANTIZED:  # one float32 scale per token and head / array
    scales = 2 if config.attention == "mla" else 2 * config.num_kv_heads
    per_layer += scale_bytes * scales
  return config.num_layers * per_layer


def _storage_leaves(cache: Cache):
  """The per-token storage arrays (payload and per-token scales)."""
  if isinstance(cache, LatentCache):
    return [x for x in (cache.c_kv, cache.k_rope, cache.c_scale,
                        cache.r_scale) if x is not None]
  return [x for x in (cache.k, cache.v, cache.k_scale, cache.v_scale)
          if x is not None]


def cache_bytes(cache: Cache) -> dict[str, int]:
  """Bytes held by a cache.

  Returns:
    total: every array of the cache (payload, scales, positions, lengths).
    kv: the per-token payload and per-token scales (= kv_bytes_per_token ×
      B × S).
    used: the part of `kv` that holds tokens now (filled slots).
    per_token: kv / (B × S).
    residual: KIVI's float32 newest key group (0 without it), in `total`.
  """
  total = sum(int(np.prod(x.shape)) * x.dtype.itemsize
              for x in jax.tree_util.tree_leaves(cache))
  kv = sum(int(np.prod(x.shape)) * x.dtype.itemsize
           for x in _storage_leaves(cache))
  # A scoped cache's positions are [L, B, K', S]: the filled fraction of
  # its slots is the fraction of filled (layer, head, slot) entries.
  slots = cache.positions.size
  filled = int(jnp.sum(cache.positions >= 0))
  resid = sum(getattr(cache, f).nbytes
              for f in ("k_resid", "c_resid", "r_resid")
              if getattr(cache, f, None) is not None)
  return dict(total=total, kv=kv, used=kv * filled // slots,
              per_token=kv // slots, residual=resid)


# ---- slot arithmetic (positional policies: `kvjax.policies`) -------------
def slot_of(policy: CachePolicy, capacity: int, position):
  """Slot that stream `position` (int array) is written to (positional
  policies; a scored one fills slots in order until the cache is full)."""
  ev = policy.evictor
  return ev.slot_of(capacity, position) if ev.closed_form else position


def kept_after(policy: CachePolicy, capacity: int, position, total):
  """Whether `position` still holds its slot after `total` tokens are
  written (True for the last writer of each slot; a global scored policy's
  prefill keeps the newest `capacity` tokens)."""
  ev = policy.evictor
  if ev.closed_form:
    return ev.kept_after(capacity, position, total)
  return position >= total - capacity


def visible(policy: CachePolicy, capacity: int, q_pos, k_pos):
  """Whether key position k_pos is in the cache when query q_pos attends.

  Mirrors the eviction rule so that a prompt processed in one pass sees
  exactly what token-by-token decoding would see (positional policies; a
  scored policy's prompt attends in full). Causality and emptiness are
  checked by the caller.
  """
  ev = policy.evictor
  if ev.closed_form:
    return ev.visible(capacity, q_pos, k_pos)
  return jnp.ones(jnp.broadcast_shapes(jnp.shape(q_pos), jnp.shape(k_pos)),
                  bool)


def cache_ranks(cache: Cache, length):
  """RoPE positions of every slot inside the cache, [B, S] (cache mode).

  A slot's rank is the number of cached tokens older than it, so the cache
  always looks like a contiguous sequence 0..n-1 to RoPE (StreamingLLM).
  `length` [B] is the number of tokens seen including the newest.
  """
  ev, S = cache.policy.evictor, cache.capacity
  pos = cache.positions
  if ev.closed_form:
    rank = ev.ranks(pos, length, S)
  else:  # scored: no closed form; a slot's place in sorted order.
    # Empty slots (-1) sort first. Two argsorts are O(S log S) per step; the
    # pairwise count they replace took 78 ms per step at S = 4096 on CPU
    # (1.4 ms sorted).
    place = jnp.argsort(jnp.argsort(pos, axis=-1), axis=-1)
    rank = place - jnp.sum(pos < 0, axis=-1, keepdims=True)
  return jnp.where(pos >= 0, rank, 0).astype(jnp.int32)
