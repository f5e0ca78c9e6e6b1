r"""What a decode segment pays outside its steps: the copy of the cache
into its view and the write back.

  python experiments/segment_copy.py --presets=gqa-small,mha-small,mla-small \
      --batch=8 --contexts=8192,16384 --kv_dtypes=float32,int8 \
      --layouts=native,layered --workdir=workdir/segment_copy

A `generate` decode segment reads a view of the stacked cache
(`kvjax.decode`): it copies in what the view holds apart (`from_cache`:
the native view's key tiles, the layered view's per-layer arrays; MLA's
native view and the native view's values read the stacked cache in
place), runs its steps, and writes back (`into_cache`) either the whole
prefix or only the window of slots its steps wrote
(`layered.written_window`). For each preset × kv dtype × layout ×
context, `bm.segment_copy_seconds` times the copy in and each write back
(into the donated cache, as generate donates it) in alternating rounds
in one process. Prints a
line per point, writes segment_copy.json and
segment_copy.png to --workdir. --host_memory=keep keeps freed buffers
mapped (`kvjax.allocator`), which separates the copies' page faults from
their bytes.
"""

import json
import os
import statistics

from absl import flags

from kvjax import allocator
from kvjax import cli
from kvjax import configs as cfg_lib
from kvjax.lab import benchmarking as bm
from configs import model as presets

_PRESETS = cli.DEFINE_choice_list("presets", ["gqa-small", "mla-small"],
                                  presets.PRESETS, "configs/model.py presets.")
_BATCH = flags.DEFINE_integer("batch", 8, "Sequences.", lower_bound=1)
_CONTEXTS = cli.DEFINE_int_list("contexts", [8192, 16384],
                                "Cached tokens per point.", lower_bound=1)
_DTYPES = cli.DEFINE_choice_list("kv_dtypes", ["float32", "int8"],
                                 bm.CACHE_KINDS, "Cache kinds.")
_LAYOUTS = cli.DEFINE_choice_list("layouts", ["native"],
                                  ("layered", "native", "blocked"),
                                  "Segment views (those a cache cannot take "
                                  "are skipped, with the reason).")
_STEPS = flags.DEFINE_integer("steps", 32, "Decode steps of the segment.",
                              lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 5, "Alternating timed rounds.",
                                lower_bound=1)
_HOST_MEMORY = flags.DEFINE_enum(
    "host_memory", "system", ["keep", "system"], "Host allocator: 'system' "
    "(glibc's defaults, as generate runs) or 'keep' (`kvjax.allocator`: "
    "freed buffers stay mapped, so a fresh view's pages fault in once).")
_WORKDIR = flags.DEFINE_string("workdir", "workdir/segment_copy",
                               "Output directory.")


def _ms(row, key):
  return f"{1e3 * statistics.median(row[key].seconds):8.1f}"


def main(argv):
  del argv
  if _HOST_MEMORY.value == "keep" and not allocator.keep_host_memory():
    raise SystemExit("--host_memory=keep: the JAX backend started first")
  os.makedirs(_WORKDIR.value, exist_ok=True)
  rows = []
  for preset in _PRESETS.value:
    config = cfg_lib.model_config(presets.get_config(preset).model)
    for kind in _DTYPES.value:
      for layout in _LAYOUTS.value:
        for ctx in _CONTEXTS.value:
          try:
            r = bm.segment_copy_seconds(config, _BATCH.value, ctx,
                                        steps=_STEPS.value, kv_dtype=kind,
                                        layout=layout, repeats=_REPEATS.value)
          except ValueError as e:
            print(f"{preset} {kind} {layout}: skipped ({e})", flush=True)
            break
          r.update(preset=preset, kv_dtype=kind, layout=layout, context=ctx,
                   batch=_BATCH.value, steps=_STEPS.value,
                   host_memory=_HOST_MEMORY.value)
          rows.append(r)
          print(f"{preset} b{_BATCH.value} {kind:9s} {layout:8s} ctx {ctx:6d}"
                f" made {r['view_bytes'] / 1e9:5.2f} GB  ms: copy in"
                f"{_ms(r, 'copy_in')}  whole back{_ms(r, 'whole_back')}  "
                f"window back{_ms(r, 'window_back')}"
                + ("  (in place)" if r["in_place"] else ""), flush=True)
  if not rows:
    raise SystemExit("no point could run (every combination was skipped)")
  figure = bm.plot_segment_copies(rows, os.path.join(_WORKDIR.value,
                                                     "segment_copy.png"))
  out = [dict({k: v for k, v in r.items() if not isinstance(v, bm.Timing)},
              **{k: list(v.seconds) for k, v in r.items()
                 if isinstance(v, bm.Timing)}) for r in rows]
  with open(os.path.join(_WORKDIR.value, "segment_copy.json"), "w") as f:
    json.dump(dict(machine=bm.machine_info(), figure=figure, rows=out), f,
              indent=1)


if __name__ == "__main__":
  cli.run(main)
