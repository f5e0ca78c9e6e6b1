"""The attention-variant ablation: quality against KV bytes per token.

Trains MHA, MQA, GQA and MLA at matched parameter count on identical data,
steps and seeds (`configs/train.py`), then reports per variant: validation
loss and bits per byte (per seed, mean, spread), KV bytes per token,
batch-1 decode tokens/s of the trained model at a short context, and the
decode step where the cache dominates (a batch at a long context: step
time, tokens/s and the fraction of the read probe its bytes reach). Each
speed is timed with all variants interleaved in one run, so the ratios
share the machine's load.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import statistics
import time
from typing import Any, Callable, Mapping, Sequence

from absl import logging
import jax
import numpy as np

from kvjax import cache as cache_lib
from kvjax import cli
from kvjax import inference
from kvjax import orbax_checkpoint
from kvjax import train
from kvjax.config import ModelConfig
from kvjax.lab import benchmarking
from kvjax.params import param_count


@dataclasses.dataclass(frozen=True)
class Run:
  variant: str
  seed: int
  workdir: str
  bits_per_byte: float
  loss: float
  wall_s: float
  steps: int = 0  # training steps of the run (final.json's step)


def train_all(model_configs: Mapping[str, ModelConfig],
              train_config: train.TrainConfig, seeds: Sequence[int],
              workdir: str | os.PathLike,
              run_fn: Callable[..., dict[str, Any]] = train.run) -> list[Run]:
  """Trains every (variant, seed) into workdir/<variant>-s<seed>.

  A finished run (its final.json exists) is not retrained, so an
  interrupted ablation resumes where it stopped. Each run is logged as it
  starts and appended to workdir/runs.jsonl as it finishes (or is found
  finished).
  """
  runs = []
  total = len(seeds) * len(model_configs)
  with cli.JsonLines(pathlib.Path(workdir) / "runs.jsonl") as partial:
    for seed in seeds:
      for variant, mc in model_configs.items():
        wd = pathlib.Path(workdir) / f"{variant}-s{seed}"
        final_path = wd / "final.json"
        if final_path.exists():
          final = json.loads(final_path.read_text())
          logging.info("[%d/%d] %s seed %d: finished before (%s)",
                       len(runs) + 1, total, variant, seed, final_path)
        else:
          logging.info("[%d/%d] training %s seed %d (%d steps) into %s",
                       len(runs) + 1, total, variant, seed,
                       train_config.num_steps, wd)
          final = run_fn(mc, dataclasses.replace(train_config, seed=seed), wd)
        runs.append(Run(variant, seed, str(wd), final["bits_per_byte"],
                        final["loss"], final.get("wall_s", float("nan")),
                        int(final.get("step", train_config.num_steps))))
        partial.write(dataclasses.asdict(runs[-1]))
  return runs


def decode_speed(model_configs: Mapping[str, ModelConfig],
                 params: Mapping[str, Any], *, prompt_len: int = 128,
                 new_tokens: int = 128, repeats: int = 5
                 ) -> dict[str, float]:
  """Batch-1 decode tokens/s of each model, timed interleaved.

  Times `generate` (prefill + scan decode) and prefill alone; decode
  tokens/s = (new_tokens − 1) / (generate − prefill) from the medians.
  """
  fns = {}
  for name, mc in model_configs.items():
    p = params[name]
    tokens = np.random.default_rng(0).integers(
        0, mc.vocab_size, (1, prompt_len), dtype=np.int32)
    capacity = inference.default_capacity(prompt_len, new_tokens)

    def gen(p=p, mc=mc, tokens=tokens, capacity=capacity):
      return inference.generate(p, mc, tokens, new_tokens, capacity=capacity)

    def pre(p=p, mc=mc, tokens=tokens, capacity=capacity):
      cache = cache_lib.init_cache(mc, 1, capacity)
      return inference.prefill(p, mc, tokens, cache)

    fns[f"{name}/generate"] = gen
    fns[f"{name}/prefill"] = pre
  timings = benchmarking.time_alternating(fns, warmup=1, repeats=repeats)
  return {name: (new_tokens - 1) / max(
      timings[f"{name}/generate"].median - timings[f"{name}/prefill"].median,
      1e-9) for name in model_configs}


def summarize(runs: Sequence[Run], model_configs: Mapping[str, ModelConfig],
              tokens_per_s: Mapping[str, float],
              long_decode: Mapping[str, Any] | None = None
              ) -> list[dict[str, Any]]:
  """One row per variant: bpb per seed, mean and spread, bytes, speed.

  long_decode: `long_decode_speed`'s result, or None: its batch, context,
  and per variant step time, tokens/s and read fraction join the rows.
  """
  rows = []
  for variant, mc in model_configs.items():
    mine = [r for r in runs if r.variant == variant]
    bpb = [r.bits_per_byte for r in mine]
    extra = {}
    if long_decode:
      d = long_decode["variants"][variant]
      extra = dict(long_batch=long_decode["batch"],
                   long_context=long_decode["context"],
                   long_step_ms=1e3 * d["step_s"],
                   long_tokens_per_s=long_decode["batch"] / d["step_s"],
                   long_read_fraction=d.get("read_fraction"))
    rows.append(dict(**extra,
        variant=variant, params=param_count(mc),
        kv_bytes_per_token=cache_lib.kv_bytes_per_token(mc),
        seeds=[r.seed for r in mine],
        steps=sorted({r.steps for r in mine}),
        bpb_per_seed=bpb, bpb_mean=statistics.mean(bpb),
        bpb_spread=(max(bpb) - min(bpb)) if len(bpb) > 1 else 0.0,
        decode_tokens_per_s=tokens_per_s[variant],
        train_wall_s=sum(r.wall_s for r in runs if r.variant == variant),
        curves=[validation_curve(r.workdir) for r in mine]))
  return rows


def validation_curve(workdir: str | os.PathLike) -> list[list[float]]:
  """[[step, validation bits/byte], ...] of one run (its metrics.jsonl;
  empty when the run left none)."""
  return [[r["step"], r["bits_per_byte"]]
          for r in train.read_metrics(pathlib.Path(workdir) / "metrics.jsonl")
          if r.get("split") == "validation"]


def markdown(rows: Sequence[Mapping[str, Any]]) -> str:
  long = bool(rows) and "long_step_ms" in rows[0]
  head = ("| variant | params | KV bytes/token | val bits/byte per seed | "
          "mean | spread (max−min) | decode tok/s (batch 1) |")
  rule = "|---|---|---|---|---|---|---|"
  if long:
    head += (f" decode ms/step (batch {rows[0]['long_batch']}, "
             f"{rows[0]['long_context']:,} cached) | tok/s | % of read probe |")
    rule += "---|---|---|"
  out = [head, rule]
  for r in rows:
    seeds = ", ".join(f"{b:.4f}" for b in r["bpb_per_seed"])
    line = (f"| {r['variant']} | {r['params'] / 1e6:.3f} M | "
            f"{r['kv_bytes_per_token']:,} | {seeds} | {r['bpb_mean']:.4f} | "
            f"{r['bpb_spread']:.4f} | {r['decode_tokens_per_s']:.0f} |")
    if long:
      frac = r["long_read_fraction"]
      line += (f" {r['long_step_ms']:.1f} | {r['long_tokens_per_s']:.0f} | "
               f"{'—' if frac is None else f'{100 * frac:.0f} %'} |")
    out.append(line)
  return "\n".join(out)


def _count(values: Sequence[int], what: str) -> str:
  """'600 steps', or '300-600 steps' when the runs differ."""
  values = sorted(set(values))
  if not values:
    return f"? {what}"
  span = (f"{values[0]}" if len(values) == 1 else
          f"{values[0]}-{values[-1]}")
  return f"{span} {what}"


def plot(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike
         ) -> dict[str, Any]:
  """Validation bits/byte against KV bytes per token: one dot per seed, the
  mean with a bar over the seeds' range (min to max); the title says how
  many seeds and training steps the points are. When the rows carry
  validation curves, a second panel draws them against the training step
  (per variant the mean over seeds, shaded over their range): where the
  variants separate, and where the seeds' spread still covers the gaps.
  Returns the figure's words (`benchmarking.figure_labels`)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  from matplotlib import transforms  # pylint: disable=g-import-not-at-top
  curves = any(c for r in rows for c in r.get("curves", ()))
  if curves:
    fig, (ax, ax_c) = plt.subplots(1, 2, figsize=(12.0, 4.6))
  else:
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
  for k, r in enumerate(rows):
    x = r["kv_bytes_per_token"]
    bpb = r["bpb_per_seed"]
    # The seeds' dots a few points right of the mean and its bar.
    for i, b in enumerate(bpb):
      shift = transforms.ScaledTranslation((7 + 5 * i) / 72, 0,
                                           fig.dpi_scale_trans)
      ax.scatter([x], [b], alpha=0.7, s=14, color=f"C{k}",
                 transform=ax.transData + shift)
    ax.errorbar([x], [r["bpb_mean"]],
                yerr=[[r["bpb_mean"] - min(bpb)], [max(bpb) - r["bpb_mean"]]],
                fmt="o", color="black", ms=4, capsize=4)
    ax.annotate(r["variant"], (x, r["bpb_mean"]), textcoords="offset points",
                xytext=(-8, 4), ha="right")
  ax.set_xscale("log", base=2)
  ax.margins(x=0.12)
  from matplotlib.ticker import NullFormatter  # pylint: disable=g-import-not-at-top
  xs = sorted({r["kv_bytes_per_token"] for r in rows})
  # A tick within 30 % of the one before it (GQA's 2,048 beside MLA's
  # 2,304) puts its label a line lower, so the two do not overprint.
  ax.set_xticks(xs, [("\n" if i and x < 1.3 * xs[i - 1] else "") + f"{x:,}"
                     for i, x in enumerate(xs)])
  ax.xaxis.set_minor_formatter(NullFormatter())
  ax.set_xlabel("KV cache bytes per token (float32, all layers)")
  ax.set_ylabel("validation bits per byte (lower is better)")
  seeds = _count([len(r["bpb_per_seed"]) for r in rows], "seeds per variant")
  steps = _count([s for r in rows for s in r.get("steps", ())],
                 "training steps each")
  ax.set_title("Quality vs cache size at matched parameters\n"
               f"{seeds}, {steps}; black: mean, bar: min-max over seeds",
               fontsize=10)
  ax.grid(alpha=0.3)
  if curves:
    _plot_curves(ax_c, rows)
  fig.tight_layout()
  labels = benchmarking.figure_labels(fig)
  fig.savefig(path, dpi=120, bbox_inches="tight")
  plt.close(fig)
  return labels


def _plot_curves(ax, rows: Sequence[Mapping[str, Any]]) -> None:
  """Validation bits/byte against step: per variant the mean over the
  seeds that logged each step, shaded from their min to their max."""
  for k, r in enumerate(rows):
    by_step: dict[int, list[float]] = {}
    for curve in r.get("curves", ()):
      for step, bpb in curve:
        by_step.setdefault(int(step), []).append(bpb)
    if not by_step:
      continue
    steps = sorted(by_step)
    vals = [by_step[t] for t in steps]
    ax.plot(steps, [statistics.mean(v) for v in vals], color=f"C{k}",
            label=f"{r['variant']} ({len(r['curves'])} seeds)")
    ax.fill_between(steps, [min(v) for v in vals], [max(v) for v in vals],
                    color=f"C{k}", alpha=0.2)
  ax.set_xlabel("training step")
  ax.set_ylabel("validation bits per byte")
  ax.set_title("Validation curves: mean over seeds, shaded min-max",
               fontsize=10)
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3, which="both")


def write_outputs(rows: Sequence[Mapping[str, Any]], runs: Sequence[Run],
                  workdir: str | os.PathLike, wall_s: float) -> pathlib.Path:
  """Writes ablation.json, ablation.md (the `markdown` table) and
  ablation.png to workdir, and nothing elsewhere (code never edits the
  docs); returns the table's path."""
  wd = pathlib.Path(workdir)
  wd.mkdir(parents=True, exist_ok=True)
  (wd / "ablation.json").write_text(json.dumps(
      dict(rows=list(rows), runs=[dataclasses.asdict(r) for r in runs],
           wall_s=wall_s, device=str(jax.devices()[0].device_kind)),
      indent=1))
  table = wd / "ablation.md"
  table.write_text(markdown(rows) + "\n")
  plot(rows, wd / "ablation.png")
  return table


def long_decode_speed(model_configs: Mapping[str, ModelConfig],
                      params: Mapping[str, Any], batch: int, context: int,
                      *, repeats: int = 5, probe_bytes: int = 1 << 29
                      ) -> dict[str, Any]:
  """Float32 decode steps of each model from a cache holding `context`
  tokens per sequence, `batch` sequences: where the cache, not the weights,
  is what a step reads. Timed interleaved with the read probe
  (`benchmarking.decode_models_alternating`).

  Returns:
    batch, context, read_probe (bytes/s), and per variant step_s, bytes,
    read_fraction, vs_first (the first variant's step time / this one's).
  """
  t = benchmarking.decode_models_alternating(
      {v: (params[v], mc) for v, mc in model_configs.items()}, batch,
      context, repeats=repeats, probe_bytes=probe_bytes)
  keep = ("step_s", "bytes", "read_fraction", "vs_first", "layout")
  return dict(batch=batch, context=context,
              read_probe=t["read_probe"]["bytes_per_s"] if probe_bytes
              else None,
              variants={v: {k: t[v][k] for k in keep if k in t[v]}
                        for v in model_configs})


def run_ablation(model_configs: Mapping[str, ModelConfig],
                 train_config: train.TrainConfig, seeds: Sequence[int],
                 workdir: str | os.PathLike, *, long_batch: int = 8,
                 long_context: int = 4096) -> list[dict[str, Any]]:
  """Trains, times and summarizes; writes ablation.json / .md / .png.
  long_context 0 leaves out the cache-dominated decode timing."""
  t0 = time.perf_counter()
  runs = train_all(model_configs, train_config, seeds, workdir)
  params = {}
  for variant in model_configs:
    # Decode speed does not depend on the seed: time the first seed's model.
    wd = next(r.workdir for r in runs if r.variant == variant)
    _, params[variant] = orbax_checkpoint.restore_params(wd)
  speed = decode_speed(model_configs, params)
  long = (long_decode_speed(model_configs, params, long_batch, long_context)
          if long_context else None)
  rows = summarize(runs, model_configs, speed, long)
  write_outputs(rows, runs, workdir, time.perf_counter() - t0)
  return rows
