"""A decode segment's write-back (`into_cache(cache, view, steps)`): only the
window of slots each sequence's segment wrote goes back to the stacked
cache (`layered.written_window`), or nothing where the segment read and
wrote the stacked cache in place (`native_latent.InPlaceLatent`); the
result equals the XLA layered view's whole prefix written back, for every
segment view, kv dtype and a window that has to move left to fit the
view."""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

from kvjax import attention
from kvjax import blocked
from kvjax import cache as cache_lib
from kvjax import layered
from kvjax import layered_latent
from kvjax import mla
from kvjax import native_attention
from kvjax import native_latent
from kvjax import native_layered
import cases
from tiny_models import tiny

CAPACITY, S, STEPS = 256, 128, 5
# Sequence 2's segment starts 2 slots before S: its window is moved left to
# [S - STEPS, S) and its last 3 writes are dropped, as the view drops them.
LENGTHS = (3, 70, S - 2)

VIEWS = {"layered": layered, "native": native_layered, "blocked": blocked,
         "layered_latent": layered_latent, "native_latent": native_latent}
GQA_DTYPES = {"layered": ("float32", "bfloat16", "int8", "int4"),
              "native": ("float32", "bfloat16", "int8", "int4"),
              "blocked": ("float32",)}
MLA_DTYPES = ("float32", "bfloat16", "int8", "int4")
CASES = ([dict(view=v, dtype=d) for v, ds in GQA_DTYPES.items() for d in ds]
         + [dict(view=v, dtype=d) for v in ("layered_latent", "native_latent")
            for d in MLA_DTYPES])


def _random_cache(view: str, dtype: str):
  """A cache of CAPACITY slots, random entries in every slot (written
  through its own write, quantized as it stores them), lengths LENGTHS."""
  latent = view.endswith("latent")
  config = tiny("mla" if latent else "gqa")
  B = len(LENGTHS)
  cache = cache_lib.init_cache(config, B, CAPACITY,
                               policy=cache_lib.CachePolicy(kv_dtype=dtype))
  slots_BT = jnp.broadcast_to(jnp.arange(CAPACITY), (B, CAPACITY))
  for layer in range(config.num_layers):
    ka, kb = jax.random.split(jax.random.key(layer))
    if latent:
      cache = mla.write_latent(
          cache, layer, slots_BT,
          jax.random.normal(ka, (B, CAPACITY, config.kv_lora_rank)),
          jax.random.normal(kb, (B, CAPACITY, config.qk_rope_head_dim)),
          fresh=True)
    else:
      shape = (B, CAPACITY, config.num_kv_heads, config.head_dim)
      cache = attention.write_kv(cache, layer, slots_BT,
                                 jax.random.normal(ka, shape),
                                 jax.random.normal(kb, shape), fresh=True)
  return config, cache.replace(length=jnp.asarray(LENGTHS, jnp.int32))


def _segment(config, cache, module):
  """The view of a segment attending S slots after STEPS decode writes per
  layer (slot length + j; past S dropped, as the model writes them)."""
  view = module.from_cache(cache, S)
  write = attention.decode_cache(view).write
  B = len(LENGTHS)
  for j in range(STEPS):
    slots_BT = jnp.minimum(cache.length + j, S)[:, None]
    for layer in range(config.num_layers):
      ka, kb = jax.random.split(jax.random.key(100 * j + layer))
      if isinstance(cache, cache_lib.LatentCache):
        new = (jax.random.normal(ka, (B, 1, config.kv_lora_rank)),
               jax.random.normal(kb, (B, 1, config.qk_rope_head_dim)))
      else:
        shape = (B, 1, config.num_kv_heads, config.head_dim)
        new = jax.random.normal(ka, shape), jax.random.normal(kb, shape)
      view = write(view, layer, slots_BT, *new)
  return view.replace(length=view.length + STEPS)


class WindowTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    if not native_attention.available():
      self.fail("the native kernel did not build: " +
                str(native_attention.library_path()))

  @cases.named(CASES, slow=lambda view, dtype: dtype in ("bfloat16", "int4"))
  def test_window_equals_the_whole_prefix(self, view, dtype):
    module = VIEWS[view]
    config, cache = _random_cache(view, dtype)
    seg = _segment(config, cache, module)
    # The reference: the XLA layered view of the same writes, its whole
    # prefix written back.
    latent = isinstance(cache, cache_lib.LatentCache)
    ref = layered_latent if latent else layered
    want = ref.into_cache(cache, _segment(config, cache, ref))
    got = jax.jit(module.into_cache, static_argnums=2)(cache, seg, STEPS)
    chex.assert_trees_all_equal(got, want)
    # The writes landed (the comparison is not between two untouched
    # caches).
    field = "c_kv" if latent else "k"
    self.assertFalse(np.array_equal(getattr(want, field),
                                    getattr(cache, field)))
    if isinstance(seg, native_latent.InPlaceLatent):
      # Read and written in place: nothing to write back.
      self.assertIs(module.into_cache(cache, seg, STEPS).c_kv,
                    seg.stacked.c_kv)
    elif isinstance(seg, native_layered.NativeKV):
      # Values written in place; a key window one step short misses the
      # last of the key writes.
      self.assertIs(module.into_cache(cache, seg, STEPS).v, seg.stacked.v)
      short = module.into_cache(cache, seg, STEPS - 1)
      self.assertFalse(np.array_equal(short.k, want.k))
    else:
      # A window one step short misses the last of the writes.
      short = module.into_cache(cache, seg, STEPS - 1)
      self.assertFalse(np.array_equal(getattr(short, field),
                                      getattr(want, field)))

  def test_window_starts(self):
    config, cache = _random_cache("layered", "float32")
    view = layered.from_cache(cache, S)
    np.testing.assert_array_equal(
        layered.written_window(cache, view, STEPS), [3, 70, S - STEPS])
    self.assertIsNone(layered.written_window(cache, view, None))
    self.assertIsNone(layered.written_window(cache, view, S))


if __name__ == "__main__":
  absltest.main()
