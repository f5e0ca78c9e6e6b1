"""The serving measurements behind experiments/serve.py: synthetic request
traces, contiguous vs paged KV memory at one budget, static vs continuous
batching, prefix sharing, and the paged decode step's cost.

Traces (seeded, numpy only):
  lengths   ShareGPT-like lognormals: prompt and output lengths drawn from
            lognormal(log(median), sigma), rounded, clipped to a range.
  arrivals  Poisson: exponential gaps at `rate` requests per second (a
            rate above what the engine serves makes the run saturated:
            throughput is then the engine's, not the trace's).
  shared    every prompt = one system prompt + a lognormal user part
            (prefix sharing's case).

Memory budget: the same pool of Z pages of Y slots for every engine. The
contiguous baseline reserves a whole row of M pages (the capacity) per
admitted request, as systems without paging reserve the maximum length:
Z / M rows. The paged engines take pages as tokens arrive, from the same
pool, with more rows.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as cache_lib
from kvjax import decode as decode_lib
from kvjax import engine as engine_lib
from kvjax import packed
from kvjax import paged as paged_lib
from kvjax.config import ModelConfig
from kvjax.lab import benchmarking
from kvjax.sampling import GREEDY


# ---- traces -----------------------------------------------------------------
def lognormal_lengths(rng: np.random.Generator, n: int, median: float,
                      sigma: float, low: int, high: int) -> np.ndarray:
  """n ints from lognormal(log(median), sigma), rounded, clipped."""
  x = rng.lognormal(np.log(median), sigma, size=n)
  return np.clip(np.round(x), low, high).astype(int)


def poisson_arrivals(rng: np.random.Generator, n: int,
                     rate: float) -> np.ndarray:
  """Arrival times (seconds) of n requests at `rate` per second, the
  first at 0."""
  gaps = rng.exponential(1.0 / rate, size=n)
  return np.concatenate([[0.0], np.cumsum(gaps[:-1])])[:n]


@dataclasses.dataclass(frozen=True)
class TraceSpec:
  """A synthetic trace. Lengths clipped to [low, high]; system_len > 0
  gives every prompt the same system prompt of that many tokens."""

  n: int = 48
  rate: float = 50.0
  prompt_median: float = 48
  prompt_sigma: float = 0.7
  output_median: float = 64
  output_sigma: float = 0.7
  low: int = 4
  high: int = 240
  system_len: int = 0
  seed: int = 0


def make_trace(spec: TraceSpec, vocab_size: int, capacity: int) -> list:
  """The requests of `spec` (greedy; ids 0..n-1; arrivals in seconds),
  outputs shortened where prompt + output would not fit `capacity`
  slots (the engine refuses what can never be served)."""
  rng = np.random.default_rng(spec.seed)
  prompts = lognormal_lengths(rng, spec.n, spec.prompt_median,
                              spec.prompt_sigma, spec.low, spec.high)
  outputs = lognormal_lengths(rng, spec.n, spec.output_median,
                              spec.output_sigma, spec.low, spec.high)
  room = capacity + 1 - spec.system_len - prompts  # n + new - 1 <= S
  if (room < 1).any():
    raise ValueError(f"a {spec.system_len} + {prompts.max()}-token prompt "
                     f"leaves no room in capacity {capacity}")
  outputs = np.minimum(outputs, room)
  arrivals = poisson_arrivals(rng, spec.n, spec.rate)
  system = tuple(rng.integers(0, vocab_size, spec.system_len).tolist())
  return [engine_lib.Request(
      id=i, prompt=system + tuple(rng.integers(0, vocab_size, p).tolist()),
      max_new_tokens=int(o), arrival=float(a))
          for i, (p, o, a) in enumerate(zip(prompts, outputs, arrivals))]


# ---- measurements -----------------------------------------------------------
def time_weighted_utilisation(timeline: list) -> float | None:
  """sum(used · dt) / sum(allocated · dt) over a run's iterations (each
  iteration's state held for its duration)."""
  used = alloc = 0.0
  prev = 0.0
  for x in timeline:
    dt = x["t"] - prev
    prev = x["t"]
    used += x["used"] * dt
    alloc += x["allocated"] * dt
  return used / alloc if alloc else None


def serve(params, config: ModelConfig, spec: engine_lib.EngineSpec,
          requests: list, clock: str = "wall") -> dict:
  """One engine over one trace: its summary, timeline and warm-up time."""
  eng = engine_lib.Engine(params, config, spec)
  warm = eng.warmup()
  logging.info("%d rows, reserve %s, %s, prefix caching %s: warm-up %.1f s",
               spec.rows, spec.reserve, spec.scheduling, spec.prefix_caching,
               warm)
  report = eng.run(requests, clock=clock)
  logging.info("served %d requests in %.1f s", len(report.results),
               report.summary["wall_s"])
  summary = dict(report.summary, warmup_s=warm, rows=spec.rows,
                 time_weighted_utilisation=time_weighted_utilisation(
                     report.timeline))
  return dict(summary=summary, timeline=report.timeline,
              tokens={k: r.tokens for k, r in report.results.items()})


def memory_and_batching(params, config: ModelConfig, requests: list, *,
                        num_pages: int, page_size: int, capacity: int,
                        rows: int, chunk: int, prefill_rows: int,
                        decode_steps: int, clock: str = "wall") -> dict:
  """The same trace and KV budget (num_pages pages) through three engines:
  contiguous max-length reservation (num_pages / M rows), paged with static
  batching, paged with continuous batching (`rows` rows each)."""
  base = engine_lib.EngineSpec(
      rows=rows, page_size=page_size, num_pages=num_pages, capacity=capacity,
      chunk=chunk, prefill_rows=prefill_rows, decode_steps=decode_steps,
      prefix_caching=False)
  M = base.max_pages
  if num_pages < M:
    raise ValueError(f"num_pages={num_pages} cannot hold one contiguous row "
                     f"of capacity {capacity} (max_pages={M})")
  contiguous_rows = num_pages // M
  specs = {
      "contiguous": dataclasses.replace(
          base, rows=contiguous_rows, reserve="max",
          prefill_rows=min(prefill_rows, contiguous_rows)),
      "paged_static": dataclasses.replace(base, scheduling="static"),
      "paged": base,
  }
  return {name: serve(params, config, s, requests, clock)
          for name, s in specs.items()}


def prefix_sharing(params, config: ModelConfig, requests: list, *,
                   num_pages: int, page_size: int, capacity: int, rows: int,
                   chunk: int, prefill_rows: int, decode_steps: int,
                   clock: str = "wall") -> dict:
  """A shared-system-prompt trace through the paged engine with and
  without prefix caching."""
  base = engine_lib.EngineSpec(
      rows=rows, page_size=page_size, num_pages=num_pages, capacity=capacity,
      chunk=chunk, prefill_rows=prefill_rows, decode_steps=decode_steps)
  return {name: serve(params, config,
                      dataclasses.replace(base, prefix_caching=on), requests,
                      clock)
          for name, on in (("shared", True), ("not_shared", False))}


def tokens_agree(runs: dict) -> dict[str, Any]:
  """Whether every engine produced the same tokens for every request
  (greedy: they must), and how many requests were compared."""
  names = list(runs)
  first = runs[names[0]]["tokens"]
  bad = sorted({k for n in names[1:] for k in first
                if runs[n]["tokens"].get(k) != first[k]})
  return dict(requests=len(first), engines=names, differing=bad)


def plot(results: dict, path: str) -> None:
  """Utilisation over time, throughput, and prefix sharing (PNG)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  mb = results["memory_and_batching"]
  fig, ax = plt.subplots(1, 3, figsize=(16, 4.5))
  for name, run in mb.items():
    t = [x["t"] for x in run["timeline"] if x["allocated"]]
    u = [x["used"] / x["allocated"] for x in run["timeline"]
         if x["allocated"]]
    ax[0].plot(t, u, label=f"{name} ({run['summary']['rows']} rows)")
  ax[0].set(xlabel="seconds", ylabel="KV slots used / allocated",
            ylim=(0, 1.05), title="KV memory utilisation")
  ax[0].legend()
  names = list(mb)
  ax[1].bar(names, [mb[n]["summary"]["tokens_per_s"] for n in names])
  ax[1].set(ylabel="generated tokens / s",
            title="throughput at one KV budget")
  ps = results["prefix_sharing"]
  labels = ["prefill tokens", "peak allocated slots"]
  x = np.arange(len(labels))
  for i, name in enumerate(ps):
    s = ps[name]["summary"]
    ax[2].bar(x + 0.4 * i, [s["prefill_tokens"], s["peak_allocated_slots"]],
              0.4, label=name)
  ax[2].set_xticks(x + 0.2, labels)
  ax[2].set(title="prefix sharing (shared system prompt)")
  ax[2].legend()
  fig.suptitle(f"{results['model']} on {results['machine']['cpu_model']}")
  fig.tight_layout()
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)


# ---- what paging costs a decode step ---------------------------------------
@functools.partial(jax.jit, static_argnames=("config", "samplers", "plan"),
                   donate_argnames=("cache",))
def _contiguous_loop(params, config, token_B, cache, keys_BI, sampler_B,
                     samplers: tuple, plan: decode_lib.Plan):
  """`paged.decode_loop`'s steps on a contiguous cache: the same loop."""
  keys_IB = jnp.swapaxes(jax.random.wrap_key_data(keys_BI), 0, 1)
  _, cache, toks_IB = decode_lib.run(
      params, config, token_B, cache, keys_IB,
      choose=lambda logits_BV, key_B: paged_lib.sample_rows(
          logits_BV, key_B, sampler_B, samplers),
      emit=lambda logits_BV, nxt_B, key_B, cache: nxt_B, plan=plan)
  return toks_IB.T, cache


def decode_step_cost(params, config: ModelConfig, batch: int, context: int,
                     page_size: int, *, steps_per_call=(1, 8), policy=None,
                     repeats: int = 15, seed: int = 0) -> dict:
  """Paged decode against contiguous decode, same batch, context and work.

  Both caches hold `context` random tokens per row
  (`benchmarking.filled_cache`; the pool holds the same values, its pages
  in a random order: `paged.from_contiguous`) and read A · Y slots (the
  page bucket of `context + steps` tokens; the contiguous cache has
  exactly that capacity). For each n in `steps_per_call`, one jitted loop
  of n greedy steps each, both by the one decode loop: `paged.decode_loop`
  (its plan: `paged.loop_plan`, the pages read in place) against the same
  n steps on the contiguous cache with the plan `generate` would use
  (`decode.plan`: the blocked layout from 4 rows); timed alternately,
  every call starting from the same context.

  Returns:
    dict: per n, the median seconds per step of each, their ratio
    (paged / contiguous) and the spread of the per-round ratios.
  """
  policy = policy or cache_lib.CachePolicy()
  params = packed.for_decode(params, config)
  out = dict(batch=batch, context=context, page_size=page_size, runs={})
  for n in steps_per_call:
    A = paged_lib.view_pages(context + n, page_size,
                             -(-(context + n) // page_size))
    S = A * page_size
    contiguous = benchmarking.filled_cache(config, batch, S, context, policy,
                                           seed)
    rng = np.random.default_rng(seed)
    table = rng.permutation(batch * A).astype(np.int32).reshape(batch, A)
    paged = paged_lib.from_contiguous(config, contiguous, table, page_size)
    length = np.asarray(contiguous.length)  # donated leaves are consumed
    token = jnp.zeros((batch,), jnp.int32)
    keys = jax.random.key_data(jax.random.split(jax.random.key(seed),
                                                (batch, n)))
    which = jnp.zeros((batch,), jnp.int32)
    valid = jnp.full((batch,), n, jnp.int32)
    table_dev = jnp.asarray(table)
    state = dict(c=contiguous, p=paged)
    plan = paged_lib.loop_plan(params, config, policy, batch, A, page_size, n)
    contiguous_plan = decode_lib.plan(params, config, policy, batch, context,
                                      n, S)

    def run_contiguous():
      toks, state["c"] = _contiguous_loop(
          params, config, token, state["c"].replace(
              length=jnp.asarray(length)), keys, which, (GREEDY,),
          contiguous_plan)
      return toks

    def run_paged():
      toks, state["p"] = paged_lib.decode_loop(
          params, config, token, state["p"].replace(
              length=jnp.asarray(length)), table_dev, keys, which, valid,
          pages=A, steps=n, samplers=(GREEDY,), plan=plan)
      return toks

    t = benchmarking.time_alternating(
        dict(contiguous=run_contiguous, paged=run_paged), warmup=2,
        repeats=repeats)
    rounds = benchmarking.paired_ratios(t["paged"].seconds,
                                        t["contiguous"].seconds)
    out["runs"][n] = dict(
        slots_read=S, contiguous_blocked=contiguous_plan.blocked,
        contiguous_ms_per_step=1e3 * t["contiguous"].median / n,
        paged_ms_per_step=1e3 * t["paged"].median / n,
        ratio=t["paged"].median / t["contiguous"].median,
        round_ratios=benchmarking.spread(rounds))
  return out


def step_cost(params, config: ModelConfig, *, batch: int, context: int,
              page_size: int, decode_steps: int, repeats: int) -> dict:
  """`decode_step_cost` at one step per call and at the engine's k."""
  return decode_step_cost(
      params, config, batch, context, page_size,
      steps_per_call=tuple(sorted({1, decode_steps})), repeats=repeats)
