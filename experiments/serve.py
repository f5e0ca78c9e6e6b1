r"""Serving on a paged KV cache: memory utilisation, throughput at one KV
budget, prefix sharing, and what a paged decode step costs.

  python experiments/serve.py --workdir=workdir/serve

A random-weight preset model (default gqa-small) serves seeded synthetic
traces (`kvjax.lab.serving`: lognormal prompt / output lengths, Poisson
arrivals) through `kvjax.engine`:

  1. one trace, one KV budget (--num_pages pages of --page_size slots),
     three engines: contiguous max-length reservation (each request
     reserves --capacity slots: num_pages · page_size / capacity rows),
     paged with static batching and paged with continuous batching
     (--rows rows). Reports used / allocated KV slots over time,
     tokens/s, requests/s, TTFT and TPOT percentiles; checks that the
     three produced the same tokens.
  2. a shared-system-prompt trace through the paged engine with and
     without prefix caching: prefill tokens computed, peak KV slots,
     prefill time.
  3. the paged decode step against the contiguous one at the same batch
     and context (`serving.decode_step_cost`), one step per call and
     --decode_steps steps per call.

Outputs in --workdir: serve.json (every number, the CPU model from lscpu,
the flags) and serve.png.
"""

import dataclasses
import json
import os


from absl import flags
from absl import logging
import jax

import kvjax
from kvjax import cli
from kvjax.lab import benchmarking
from kvjax import configs
from kvjax.lab import serving
from configs import model as presets

_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory.",
                               required=True)
_PRESET = flags.DEFINE_string("preset", "gqa-small",
                              "Model preset of configs/model.py.")
_REQUESTS = flags.DEFINE_integer("requests", 48, "Requests in trace 1.",
                                 lower_bound=1)
_RATE = flags.DEFINE_float("rate", 50.0, "Poisson arrivals per second.",
                           lower_bound=1e-6)
_PAGE = flags.DEFINE_integer("page_size", 16, "Y, slots per page.",
                             lower_bound=1)
_CAPACITY = flags.DEFINE_integer("capacity", 512, "Slots one request can "
                                 "hold (the contiguous reservation).",
                                 lower_bound=1)
_PAGES = flags.DEFINE_integer("num_pages", 128, "Z, the KV budget in pages.",
                              lower_bound=1)
_ROWS = flags.DEFINE_integer("rows", 16, "Rows of the paged engines.",
                             lower_bound=1)
_CHUNK = flags.DEFINE_integer("chunk", 64, "Prefill chunk (tokens).",
                              lower_bound=1)
_PREFILL_ROWS = flags.DEFINE_integer("prefill_rows", 4, "Rows per prefill "
                                     "call.", lower_bound=1)
_STEPS = flags.DEFINE_integer("decode_steps", 8, "Decode steps per call.",
                              lower_bound=1)
_SHARED = flags.DEFINE_integer("shared_requests", 24, "Requests in the "
                               "shared-system-prompt trace.", lower_bound=1)
_SYSTEM = flags.DEFINE_integer("system_len", 192, "System prompt tokens.",
                               lower_bound=1)
_STEP_BATCH = flags.DEFINE_integer("step_batch", 8, "Batch of the step "
                                   "cost comparison.", lower_bound=1)
_STEP_CONTEXT = flags.DEFINE_integer("step_context", 1000, "Cached tokens "
                                     "of the step cost comparison.",
                                     lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 9, "Timed rounds (step cost).",
                                lower_bound=1)
_SEED = flags.DEFINE_integer("seed", 0, "Trace seed.")
_INIT_SCALE = flags.DEFINE_float(
    "init_scale", 0.15, "Std of the random weights (the presets' 0.02 gives "
    "near-uniform logits whose greedy ties float rounding decides; 0.15, as "
    "the tests' tiny models, keeps the engines' tokens comparable).",
    lower_bound=0)


def main(argv):
  del argv
  preset = _PRESET.value
  cfg = presets.get_config(preset)
  cfg.model.init_scale = _INIT_SCALE.value
  config = configs.model_config(cfg.model)
  params = kvjax.init_params(config, jax.random.key(0))
  sizes = dict(page_size=_PAGE.value, capacity=_CAPACITY.value,
               num_pages=_PAGES.value, chunk=_CHUNK.value,
               prefill_rows=_PREFILL_ROWS.value, decode_steps=_STEPS.value)
  machine = dict(benchmarking.machine_info(), cpu_model=benchmarking.cpu_model())
  logging.info("%s on %s", preset, machine["cpu_model"])
  trace = serving.TraceSpec(n=_REQUESTS.value, rate=_RATE.value,
                            seed=_SEED.value)
  shared = dataclasses.replace(trace, n=_SHARED.value, seed=_SEED.value + 1,
                               system_len=_SYSTEM.value, prompt_median=24,
                               output_median=32)
  mb = serving.memory_and_batching(
      params, config, serving.make_trace(trace, config.vocab_size,
                         _CAPACITY.value),
      rows=_ROWS.value, **sizes)
  ps = serving.prefix_sharing(
      params, config, serving.make_trace(shared, config.vocab_size,
                         _CAPACITY.value),
      rows=_ROWS.value, **sizes)
  cost = serving.step_cost(params, config, batch=_STEP_BATCH.value,
                           context=_STEP_CONTEXT.value,
                           page_size=_PAGE.value,
                           decode_steps=_STEPS.value, repeats=_REPEATS.value)
  results = dict(
      model=preset, machine=machine,
      flags={f.name: f.value for f in flags.FLAGS.get_key_flags_for_module(
          __import__("__main__"))},
      traces=dict(main=dataclasses.asdict(trace),
                  shared=dataclasses.asdict(shared)),
      memory_and_batching=mb, prefix_sharing=ps, step_cost=cost,
      same_tokens=dict(memory_and_batching=serving.tokens_agree(mb),
                       prefix_sharing=serving.tokens_agree(ps)))
  os.makedirs(_WORKDIR.value, exist_ok=True)
  serving.plot(results, os.path.join(_WORKDIR.value, "serve.png"))
  for run in list(mb.values()) + list(ps.values()):
    del run["tokens"]  # compared above; the JSON keeps the numbers
  with open(os.path.join(_WORKDIR.value, "serve.json"), "w") as f:
    json.dump(results, f, indent=1, default=str)
  print(f"{preset} on {machine['cpu_model']} ({machine['cpu_count']} CPUs)")
  print(f"{'engine':<14} {'rows':>4} {'tok/s':>7} {'req/s':>6} "
        f"{'util':>5} {'util(t)':>7} {'TTFT p50/p99 s':>15} "
        f"{'TPOT p50/p99 ms':>16} {'preempt':>7}")
  for name, run in list(mb.items()) + list(ps.items()):
    s = run["summary"]
    print(f"{name:<14} {s['rows']:>4} {s['tokens_per_s']:>7.1f} "
          f"{s['requests_per_s']:>6.2f} {s['mean_utilisation']:>5.3f} "
          f"{s['time_weighted_utilisation']:>7.3f} "
          f"{s['ttft_p50_s']:>7.2f}/{s['ttft_p99_s']:<7.2f} "
          f"{1e3 * s['tpot_p50_s']:>7.1f}/{1e3 * s['tpot_p99_s']:<8.1f} "
          f"{s['preemptions']:>7}")
  for name, run in ps.items():
    s = run["summary"]
    print(f"prefix {name}: prefill tokens {s['prefill_tokens']} (cached "
          f"{s['cached_tokens']}), peak slots {s['peak_allocated_slots']}, "
          f"prefill {s['prefill_s']:.2f} s, wall {s['wall_s']:.2f} s")
  for n, r in cost["runs"].items():
    print(f"decode step, batch {cost['batch']}, context {cost['context']}, "
          f"{n} step(s) per call: contiguous "
          f"{r['contiguous_ms_per_step']:.2f} ms, paged "
          f"{r['paged_ms_per_step']:.2f} ms, ratio {r['ratio']:.3f} "
          f"(rounds {r['round_ratios']['min']:.3f}-"
          f"{r['round_ratios']['max']:.3f})")
  print("same tokens:", results["same_tokens"])


if __name__ == "__main__":
  cli.run(main)
