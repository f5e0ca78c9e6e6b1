r"""Training throughput: two commits side by side, one run.

  python experiments/train_speed.py --base=126e088 --variants=gqa \
      --workdir=workdir/train_speed

Checks the base commit out into a temporary git worktree and times the
training step of `configs/train.py:<variant>` (16 × 256 bytes, AdamW; the
step `kvjax.train.run` takes: `create_train_state` on `init_params`, then
`train_step`) in a fresh subprocess per commit and round, alternating base,
head, base, head, ... so both see the same load drift. Each subprocess
compiles, then times --repeats steps on the same fixed batch; a round's
figure is their median. Between rounds the parent measures the matmul
peak (`benchmarking.matmul_peak`) in float32 and in bfloat16 with float32
accumulation, the in-run probes the model FLOP utilisation is quoted
against: MFU = model FLOPs per step (3 × the forward's useful FLOPs,
`benchmarking.prefill_flops` with every position's logits) / step time /
probe, against the probe of the precision the side's products run in
(`TrainConfig.matmul_dtype`; a checkout without the field: float32), and
against the float32 probe for both.

Each subprocess sets up the host allocator as `kvjax.train.run` does
before its first step where the checkout has one (`kvjax.allocator`: XLA's
buffers kept mapped between steps); a base without it runs glibc's
defaults, as its training runs did.

Both commits start from the same seed and batch, so their losses after
the timed steps agree to the float reassociation of a changed program when
both run float32 products; with bfloat16 operands on one side they differ
by that rounding (printed; the validation bits/byte a full run reaches is
the quality check, WORKSPACE.md "Training speed").

--host_memory=keep --host_memory=system times the head with the
training loops' allocator settings and with glibc's defaults in the same
rounds: what keeping XLA's buffers mapped buys, as a same-run ratio.

--microbatches=1,4 times the head once per row-group count
(`TrainConfig.microbatches`) in the same alternating rounds, so what the
groups buy is a same-run ratio too (default: the preset's count alone).

Prints one line per variant and head count: tokens/s of each, the
speed-up (median over rounds of base time / head time), MFU of each and
the losses; writes train_speed.json (with the CPU model) to --workdir.
"""

import json
import os
import statistics

from absl import flags

from kvjax.lab import benchmarking as bm
from kvjax import cli
from kvjax import configs as cfg_lib
from configs import train as train_presets

_BASE = flags.DEFINE_string("base", None, "Git revision to compare against.",
                            required=True)
_VARIANTS = cli.DEFINE_choice_list("variants", ["gqa"],
                                   train_presets.VARIANTS,
                                   "configs/train.py variants.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Alternating subprocess rounds.",
                               lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 8, "Timed steps per subprocess.",
                                lower_bound=1)
_WORKDIR = flags.DEFINE_string("workdir", "workdir/train_speed",
                               "Output directory.")
_MICROBATCHES = flags.DEFINE_list(
    "microbatches", None, "Row-group counts to time the head at (default: "
    "the preset's); the base runs its own step.")
_HOST_MEMORY = flags.DEFINE_multi_enum(
    "host_memory", ["keep"], ["keep", "system"], "Host allocator settings "
    "to time the head with (`kvjax.allocator`: 'keep' as the training loops "
    "run, 'system' glibc's defaults); repeat the flag for both.")

# Run inside each checkout; uses only API both sides share.
_PROBE = r"""
import json, statistics, sys, time
import jax, jax.numpy as jnp, numpy as np
import kvjax
from kvjax import configs as cfg_lib
from kvjax import train
from configs import train as presets
variant, repeats, groups = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
import os
os.environ["KVJAX_HOST_MEMORY"] = sys.argv[4]
try:  # what kvjax.train.run does first, where the checkout has it
  from kvjax import allocator
  allocator.keep_host_memory()
except ImportError:
  pass
cfg = presets.get_config(variant)
config = cfg_lib.model_config(cfg.model)
tc = train.TrainConfig.from_dict(cfg.train.to_dict())
params = jax.jit(kvjax.init_params, static_argnums=0)(
    config, jax.random.key(tc.seed))
# The preset's matmul precision where the checkout has the choice.
dtype = getattr(tc, "matmul_dtype", None)
if dtype and hasattr(train, "resolve_matmul_dtype"):  # 'auto' -> measured
  dtype = train.resolve_matmul_dtype(dtype)
logits_fn = (train.model_logits_fn(config, dtype) if dtype else
             train.model_logits_fn(config))
# Row groups where the checkout has them (a base without them gets 1).
state = train.create_train_state(params, logits_fn, train.make_optimizer(tc),
                                 **({"microbatches": groups} if groups > 1
                                    else {}))
batch = jnp.asarray(np.random.default_rng(0).integers(
    0, 256, (tc.batch_size, tc.seq_len + 1)), jnp.int32)
for _ in range(2):
  state, m = train.train_step(state, batch)
  jax.block_until_ready(m)
ts = []
for _ in range(repeats):
  t0 = time.perf_counter()
  state, m = train.train_step(state, batch)
  jax.block_until_ready(m)
  ts.append(time.perf_counter() - t0)
print(json.dumps(dict(median_s=statistics.median(ts), times=ts,
                      loss=float(m["loss"]), matmul_dtype=dtype or "float32",
                      microbatches=groups, host_memory=sys.argv[4])))
"""


def _probe(tree: str, variant: str, groups: int = 1,
           host_memory: str = "keep") -> dict:
  return bm.run_probe(tree, _PROBE, variant, _REPEATS.value, groups,
                      host_memory)


def head_groups(variant: str) -> list[int]:
  """The head's row-group counts to time: --microbatches, else the
  preset's."""
  if _MICROBATCHES.value:
    groups = [int(g) for g in _MICROBATCHES.value]
    batch = train_presets.get_config(variant).train.batch_size
    bad = [g for g in groups if g < 1 or batch % g]
    if bad:
      raise ValueError(f"--microbatches {bad}: each must be >= 1 and divide "
                       f"the batch of {batch} rows")
    return groups
  return [train_presets.get_config(variant).train.get("microbatches", 1)]


def step_flops(variant: str) -> tuple[float, int]:
  """(model FLOPs of one training step, tokens per step)."""
  cfg = train_presets.get_config(variant)
  config = cfg_lib.model_config(cfg.model)
  B, T = cfg.train.batch_size, cfg.train.seq_len
  return 3.0 * bm.prefill_flops(config, B, T, all_logits=True)["total"], B * T


def main(argv):
  del argv
  head = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  os.makedirs(_WORKDIR.value, exist_ok=True)
  groups_of = {v: head_groups(v) for v in _VARIANTS.value}  # flags first
  rows = []
  with bm.commit_checkout(head, _BASE.value) as base:
    for variant in _VARIANTS.value:
      flops, tokens = step_flops(variant)
      sides = [("base", base, 1, "keep")] + [
          (f"head_mb{g}_{mode}", head, g, mode) for g in groups_of[variant]
          for mode in _HOST_MEMORY.value]
      t = {side: [] for side, *_ in sides}
      loss, dtype = {}, {}
      peaks = {"float32": [], "bfloat16": []}
      for _ in range(_ROUNDS.value):
        for d in peaks:
          peaks[d].append(bm.matmul_peak(dtype=d)["flops_per_s"])
        for side, tree, groups, mode in sides:
          r = _probe(tree, variant, groups, mode)
          t[side].append(r["median_s"])
          loss[side], dtype[side] = r["loss"], r.get("matmul_dtype",
                                                     "float32")
      peak_of = {d: statistics.median(v) for d, v in peaks.items()}
      peak = peak_of["float32"]
      med = {side: statistics.median(v) for side, v in t.items()}
      for side, _, groups, mode in sides[1:]:
        speedups = [b / h for b, h in zip(t["base"], t[side])]
        row = dict(variant=variant, microbatches=groups, host_memory=mode,
                   tokens_per_step=tokens, model_flops_per_step=flops,
                   matmul_peak_flops_per_s=peak,
                   bf16_matmul_peak_flops_per_s=peak_of["bfloat16"],
                   base_s=t["base"], head_s=t[side],
                   speedup=statistics.median(speedups), speedups=speedups,
                   base_tokens_per_s=tokens / med["base"],
                   head_tokens_per_s=tokens / med[side],
                   base_matmul_dtype=dtype["base"],
                   head_matmul_dtype=dtype[side],
                   # Against the probe of the side's own product precision.
                   base_mfu=flops / med["base"] / peak_of[dtype["base"]],
                   head_mfu=flops / med[side] / peak_of[dtype[side]],
                   base_mfu_f32_probe=flops / med["base"] / peak,
                   head_mfu_f32_probe=flops / med[side] / peak,
                   base_loss=loss["base"], head_loss=loss[side])
        rows.append(row)
        print(f"{variant}: head ({row['head_matmul_dtype']} products, "
              f"{groups} row group{'s' if groups > 1 else ''}, host memory "
              f"{mode}) "
              f"{row['head_tokens_per_s']:.0f} tok/s (MFU "
              f"{row['head_mfu']:.1%}; {row['head_mfu_f32_probe']:.1%} of the "
              f"float32 probe), base ({row['base_matmul_dtype']}) "
              f"{row['base_tokens_per_s']:.0f} tok/s (MFU "
              f"{row['base_mfu']:.1%}); speed-up {row['speedup']:.2f}x "
              f"(rounds {', '.join(f'{s:.2f}' for s in speedups)}); matmul "
              f"probes {peak / 1e9:.0f} GFLOP/s float32, "
              f"{peak_of['bfloat16'] / 1e9:.0f} bfloat16; loss after "
              f"{_REPEATS.value + 2} steps base {row['base_loss']:.6f}, head "
              f"{row['head_loss']:.6f}", flush=True)
  result = dict(base=_BASE.value, **bm.revision(head),
                host=bm.machine_info(), rows=rows)
  with open(os.path.join(_WORKDIR.value, "train_speed.json"), "w") as f:
    json.dump(result, f, indent=1)


if __name__ == "__main__":
  cli.run(main)
