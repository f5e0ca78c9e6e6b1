r"""Keys in tiles or as rows: the native kernel's attention per layer, one
process, alternating rounds.

  python experiments/key_layout.py --presets=mha-small,gqa-small,mqa-small,gqa-medium,mqa-medium \
      --batch=8 --context=16384 --kv_dtypes=float32,bfloat16,int8 \
      --workdir=workdir/key_layout

The native decode view copies a segment's keys into the kernel's tiles of
16 slots (`native_layered.NativeKV`); read as rows in the stacked cache
(`native_attention.decode_attend(key_rows=True)`, the logits of MLA's
latent rows) they would need no copy. For each preset's (K, G, H) ×
kv dtype, times `decode_attend` over layer 1 of a two-layer stacked
cache with its keys as tiles and as rows, alternating, and prints the
median times and their ratio (rows / tiles) and the largest difference
of the outputs. Writes key_layout.json to --workdir.
"""

import json
import os
import statistics
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cli
from kvjax import configs as cfg_lib
from kvjax import native_attention
from kvjax import quant
from kvjax.lab import benchmarking as bm
from configs import model as presets

_PRESETS = cli.DEFINE_choice_list("presets", ["gqa-small", "mha-small"],
                                  presets.PRESETS, "GQA-family presets.")
_BATCH = flags.DEFINE_integer("batch", 8, "Sequences.", lower_bound=1)
_CONTEXT = flags.DEFINE_integer("context", 16384, "Attended slots (a "
                                "multiple of 16).", lower_bound=16)
_DTYPES = cli.DEFINE_choice_list("kv_dtypes", ["float32", "bfloat16", "int8"],
                                 ("float32", "bfloat16", "int8"),
                                 "Cache kinds.")
_ROUNDS = flags.DEFINE_integer("rounds", 21, "Alternating timed rounds.",
                               lower_bound=1)
_WORKDIR = flags.DEFINE_string("workdir", "workdir/key_layout",
                               "Output directory.")


def main(_):
  B, S, L = _BATCH.value, _CONTEXT.value, 2
  rows, rng = [], np.random.default_rng(0)
  for preset in _PRESETS.value:
    config = cfg_lib.model_config(presets.get_config(preset).model)
    K, H = config.num_kv_heads, config.head_dim
    G = config.num_heads // K
    for kind in _DTYPES.value:
      store = quant.storage_dtype(kind)
      k, k_s = quant.quantize(jnp.asarray(
          rng.standard_normal((L, B, K, S, H), np.float32)), store)
      v, v_s = quant.quantize(jnp.asarray(
          rng.standard_normal((L, B, K, S, H), np.float32)), store)
      if k_s is not None:
        k_s, v_s = k_s.reshape(L, B, K, S), v_s.reshape(L, B, K, S)
      q = jnp.asarray(rng.standard_normal((B, K, G, H), np.float32))
      mask = jnp.ones((B, S), bool)
      tiles = native_attention.tile_keys(k[1])
      attend = lambda keys, key_rows: native_attention.decode_attend(  # pylint: disable=cell-var-from-loop
          q, keys, v, mask, H ** -0.5, k_s, v_s, layer=1, key_rows=key_rows)
      forms = dict(tiles=jax.jit(lambda t: attend(t, False)),
                   rows=jax.jit(lambda r: attend(r, True)))
      args = dict(tiles=tiles, rows=k)
      outs = {f: fn(args[f]).block_until_ready() for f, fn in forms.items()}
      seconds = {f: [] for f in forms}
      for _ in range(_ROUNDS.value):
        for f, fn in forms.items():
          t0 = time.perf_counter()
          fn(args[f]).block_until_ready()
          seconds[f].append(time.perf_counter() - t0)
      t, r = (statistics.median(seconds[f]) for f in ("tiles", "rows"))
      row = dict(preset=preset, kv_dtype=kind, K=K, G=G, H=H, tiles_s=t,
                 rows_s=r, ratio=r / t, max_diff=float(jnp.max(jnp.abs(
                     outs["tiles"] - outs["rows"]))))
      rows.append(row)
      print(f"{preset:11s} {kind:9s} B{B} S{S}: tiles {1e3 * t:7.2f} ms, "
            f"rows {1e3 * r:7.2f} ms, rows/tiles {r / t:5.2f}, max |diff| "
            f"{row['max_diff']:.1e}", flush=True)
  os.makedirs(_WORKDIR.value, exist_ok=True)
  path = os.path.join(_WORKDIR.value, "key_layout.json")
  with open(path, "w") as f:
    json.dump(dict(batch=B, context=S, rows=rows,
                   machine=bm.machine_info()), f, indent=1)
  print(f"wrote {path}")


if __name__ == "__main__":
  app.run(main)
