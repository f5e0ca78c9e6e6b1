r"""Does a change slow generation down? Two commits, side by side, one run.

  python experiments/compare_commits.py --base=604ab8d \
      --presets=gqa-medium,gqa-small --batches=1,8 --workdir=workdir/ab
  python experiments/compare_commits.py --base=ec12593 \
      --presets=gqa-medium,mla-medium --batches=1 --prompt_len=8192 \
      --chunk=2048 --repeats=1 --workdir=workdir/ab_chunked
  python experiments/compare_commits.py --base=79a584e \
      --presets=gqa-small,mha-small --batches=8 --decode_context=16384 \
      --kv_dtype=bfloat16 --new_tokens=32 --workdir=workdir/ab_decode

Checks the base commit out into a temporary git worktree and times
`kvjax.generate` (random params of each preset, as `init_params` returns
them: the default path; prompt `--prompt_len`, `--new_tokens` new tokens,
greedy; with --chunk, `kvjax.prefill_chunked` of the prompt into a fresh
cache of --prompt_len slots in chunks of --chunk instead; with
--decode_context, `--new_tokens`-step decode loops from a cache already
holding that many tokens in --kv_dtype, `benchmarking.decode_step_seconds`:
the cache-bound step, the figure being the time per step) in a fresh
subprocess per commit and round, alternating base, head,
base, head, ... so both see the same load drift. Each subprocess warms up
(compiles) and then times `--repeats` calls; a round's figure is their
median. Prints one line per (preset, batch) with the median head/base time
ratio over rounds (< 1: head is faster) and the per-round ratios, and
writes compare_commits.json (with the CPU model) to --workdir.
"""

import json
import os
import statistics

from absl import flags

from kvjax.lab import benchmarking as bm
from kvjax import cli
from configs import model as presets

_BASE = flags.DEFINE_string("base", None, "Git revision to compare against.",
                            required=True)
_PRESETS = cli.DEFINE_choice_list("presets", ["gqa-medium", "gqa-small"],
                                  presets.PRESETS, "configs/model.py presets.")
_BATCHES = cli.DEFINE_int_list("batches", [1, 8], "Batch sizes.",
                               lower_bound=1)
_PROMPT = flags.DEFINE_integer("prompt_len", 128, "Prompt tokens.",
                               lower_bound=1)
_NEW = flags.DEFINE_integer("new_tokens", 256, "Generated tokens.",
                            lower_bound=1)
_CHUNK = flags.DEFINE_integer("chunk", 0, "Time a chunked prefill in chunks "
                              "of this many tokens (0: generate).",
                              lower_bound=0)
_CONTEXT = flags.DEFINE_integer(
    "decode_context", 0, "Time decode steps from a cache holding this many "
    "tokens instead (0: generate).", lower_bound=0)
_KV_DTYPE = flags.DEFINE_enum("kv_dtype", "float32", bm.CACHE_KINDS,
                              "Cache kind of the --decode_context steps.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Alternating subprocess rounds.",
                               lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls per subprocess.",
                                lower_bound=1)
_WORKDIR = flags.DEFINE_string("workdir", "workdir/compare_commits",
                               "Output directory.")

# Run inside each checkout; uses only API both sides share.
_PROBE = r"""
import json, statistics, sys, time
import jax, numpy as np
import kvjax
from kvjax import configs as cfg_lib
from configs import model as presets
preset, batch, prompt, new, repeats, chunk, context, kv = sys.argv[1:9]
config = cfg_lib.model_config(presets.get_config(preset).model)
need = max(int(prompt), int(context) + int(new) * (int(repeats) + 1) + 256)
if need > config.max_seq_len:
  config = kvjax.ModelConfig.from_dict(dict(config.to_dict(),
                                            max_seq_len=need))
params = kvjax.init_params(config, jax.random.key(0))
if int(context):
  from kvjax.lab import benchmarking as bm
  r = bm.decode_step_seconds(params, config, int(batch), int(context),
                             steps=int(new), repeats=int(repeats),
                             kv_dtype=kv)
  print(json.dumps(dict(median_s=r["step_s"], loop=r["loop"])))
  sys.exit(0)
tokens = np.asarray(jax.random.randint(jax.random.key(1),
                    (int(batch), int(prompt)), 0, config.vocab_size))
if int(chunk):
  run = lambda: kvjax.prefill_chunked(
      params, config, tokens, kvjax.init_cache(config, int(batch),
                                               int(prompt)), int(chunk))[0]
else:
  run = lambda: kvjax.generate(params, config, tokens, int(new))
jax.block_until_ready(run())
ts = []
for _ in range(int(repeats)):
  t0 = time.perf_counter()
  jax.block_until_ready(run())
  ts.append(time.perf_counter() - t0)
print(json.dumps(dict(median_s=statistics.median(ts), times=ts)))
"""


def _probe(tree: str, preset: str, batch: int) -> float:
  return bm.run_probe(tree, _PROBE, preset, batch, _PROMPT.value,
                      _NEW.value, _REPEATS.value, _CHUNK.value,
                      _CONTEXT.value, _KV_DTYPE.value)["median_s"]


def main(argv):
  del argv
  head = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  os.makedirs(_WORKDIR.value, exist_ok=True)
  rows = []
  with bm.commit_checkout(head, _BASE.value) as base:
    for preset in _PRESETS.value:
      for batch in _BATCHES.value:
        t = {"base": [], "head": []}
        for _ in range(_ROUNDS.value):
          t["base"].append(_probe(base, preset, batch))
          t["head"].append(_probe(head, preset, batch))
        ratios = [h / b for h, b in zip(t["head"], t["base"])]
        row = dict(preset=preset, batch=batch, base_s=t["base"],
                   head_s=t["head"], ratio=statistics.median(ratios),
                   ratios=ratios)
        rows.append(row)
        print(f"{preset} b{batch}: head/base time {row['ratio']:.3f} "
              f"(rounds {', '.join(f'{r:.3f}' for r in ratios)}; base "
              f"{statistics.median(t['base']):.4g} s, head "
              f"{statistics.median(t['head']):.4g} s)", flush=True)
  result = dict(base=_BASE.value, **bm.revision(head),
                prompt_len=_PROMPT.value, new_tokens=_NEW.value,
                chunk=_CHUNK.value, decode_context=_CONTEXT.value,
                kv_dtype=_KV_DTYPE.value,
                host=bm.machine_info(), rows=rows)
  with open(os.path.join(_WORKDIR.value, "compare_commits.json"), "w") as f:
    json.dump(result, f, indent=1)


if __name__ == "__main__":
  cli.run(main)
