"""The three explainer pictures of kvjax, each from measured runs.

  roofline        prefill (T prompt tokens in one parallel pass) against a
                  decode step (one token that reads every weight and the
                  whole cache): FLOPs and bytes per call counted by
                  `benchmarking.prefill_flops` / `decode_bytes_per_step`,
                  seconds measured by `benchmarking.prefill_seconds` /
                  `decode_step_seconds`, placed on this machine's roofline
                  (roof: the in-run probes `benchmarking.matmul_peak` and
                  `read_bandwidth`). Prefill lands right of the ridge
                  (compute-bound), decode far left of it (memory-bound).
  no cache / cache
                  the attention probabilities of a real prompt
                  (`kvjax.attention_probs`) stepped through token by token.
                  Without a cache, step t recomputes the whole causal
                  (t+1) x (t+1) block Q·Kᵀ, whose first t rows equal the
                  previous step's (checked: `recompute_max_abs_diff`); with
                  one, step t computes one new query row against t+1 keys
                  (t cached + its own). Counted FLOPs per step
                  (`step_flops`: quadratic in t against linear) and
                  measured step times (`benchmarking.no_cache_step_seconds`
                  / `decode_step_seconds`).
  cache growth    a bounded StreamingLLM cache (`CachePolicy('sinks')`) fed
                  token by token through `kvjax.decode_step`: the stream
                  positions each slot holds after every step (the cache's
                  `positions`) and the bytes it holds, read from its arrays
                  (`kvjax.cache_bytes`) and checked against
                  `kv_bytes_per_token` × tokens held. Linear growth to the
                  cap S, then the first `num_sinks` positions stay and a
                  window of the newest S − num_sinks rolls.

`run` measures all three and draws them (PNGs, step-through GIFs drawn by
matplotlib's PillowWriter); `experiments/explain.py` is a thin absl main
over it. Every number a figure shows is in the dict `run` returns.

Shapes use the alphabet of `kvjax.config`: B batch, T tokens of a call (the
prompt), S cache slots, L layers, N query heads, D model dim, V vocab.
Here B = 1 throughout: one prompt, one stream.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from kvjax import cache as cache_lib
from kvjax import inference
from kvjax import probe
from kvjax.config import ModelConfig
from kvjax.lab import benchmarking as bm

# Warm-up loops of `decode_step_seconds`. Its first loop runs on the
# uncommitted arrays of `filled_cache`, every later one on the committed
# cache the loop returned: two compilations (seen with jax_log_compiles),
# so with one warm-up the first timed loop includes a ~2 s compile.
DECODE_WARMUP = 2

# Cell codes of the cache pictures (`occupancy`).
FUTURE, EVICTED, SINK, WINDOW = 0, 1, 2, 3


# ---- counted work per step ---------------------------------------------------
def decode_step_flops(config: ModelConfig, batch: int,
                      context: int) -> dict[str, float]:
  """FLOPs of one cached decode step that attends `context` keys (the cached
  tokens plus the new one).

  The one-token prefill of `benchmarking.prefill_flops` (every weight
  matrix once per sequence, the LM head once) with its attention term (one
  query-key pair) scaled to `context` pairs: the useful work, not the
  masked slots a fixed-capacity einsum also touches.

  Returns:
    matmul, attention, lm_head, total.
  """
  if context < 1:
    raise ValueError(f"context must be >= 1, got {context}")
  one = bm.prefill_flops(config, batch, 1)
  attention = one["attention"] * context
  return dict(matmul=one["matmul"], attention=attention,
              lm_head=one["lm_head"],
              total=one["matmul"] + attention + one["lm_head"])


def no_cache_step_flops(config: ModelConfig, batch: int,
                        position: int) -> dict[str, float]:
  """FLOPs of the no-cache step at stream `position`: the causal forward
  over the `position + 1` tokens seen so far, with logits at every position
  (what `kvjax.generate_no_cache` and `benchmarking.no_cache_step_seconds`
  run).

  It exceeds the cached step at the same position by exactly a prefill of
  the `position` earlier tokens (tests/test_explain.py): the recomputed
  history.
  """
  if position < 0:
    raise ValueError(f"position must be >= 0, got {position}")
  return bm.prefill_flops(config, batch, position + 1, all_logits=True)


def step_flops(config: ModelConfig, steps: int) -> dict[str, Any]:
  """Counted FLOPs of steps t = 0 .. steps-1 (step t feeds stream position
  t) with and without a cache, per step and cumulative (B = 1).

  Without a cache the step cost grows with t (every earlier token
  recomputed; the attention term quadratically), so the cumulative work is
  super-quadratic; with a cache the step cost is a constant plus one
  attention pair per cached key, so the cumulative work grows ~linearly
  until the attention term dominates.

  Returns:
    position [steps], no_cache, cached (FLOPs per step), no_cache_cumulative,
    cached_cumulative, attention_per_pair (FLOPs of one query-key pair over
    all layers and heads).
  """
  if steps < 1:
    raise ValueError(f"steps must be >= 1, got {steps}")
  nc = [no_cache_step_flops(config, 1, t)["total"] for t in range(steps)]
  c = [decode_step_flops(config, 1, t + 1)["total"] for t in range(steps)]
  return dict(position=list(range(steps)), no_cache=nc, cached=c,
              no_cache_cumulative=np.cumsum(nc).tolist(),
              cached_cumulative=np.cumsum(c).tolist(),
              attention_per_pair=bm.prefill_flops(config, 1, 1)["attention"])


def prefill_bytes(params, config: ModelConfig, batch: int,
                  length: int) -> dict[str, int]:
  """The minimum memory traffic of a prefill of [batch, length]: every
  weight read once (`decode_weight_bytes`: the embedding rows gathered are
  negligible) plus the K/V of the `length` tokens written to the cache. The
  same count as `benchmarking.decode_bytes_per_step` at context `length`
  (there the cache is read, here written); activations are not counted.

  Returns:
    weights, cache, total.
  """
  return bm.decode_bytes_per_step(params, config, batch, length)


# ---- picture 1: the roofline -------------------------------------------------
def _point(name: str, flops: float, nbytes: float, seconds: float,
           peak: float, bandwidth: float, **extra) -> dict[str, Any]:
  intensity = flops / nbytes
  roof = min(peak, bandwidth * intensity)
  achieved = flops / seconds
  return dict(name=name, flops=flops, bytes=nbytes, seconds=seconds,
              intensity=intensity, flops_per_s=achieved,
              bytes_per_s=nbytes / seconds, roof_flops_per_s=roof,
              fraction_of_roof=achieved / roof,
              bound="compute" if bandwidth * intensity >= peak else "memory",
              **extra)


def roofline(params, config: ModelConfig, prompt_len: int, *,
             repeats: int = 5, matmul_n: int = 2048,
             read_bytes: int = 1 << 29) -> dict[str, Any]:
  """Prefill of `prompt_len` tokens and the decode step that follows it
  (position `prompt_len`, context prompt_len + 1), against this machine's
  roofline, all measured in this call (B = 1).

  The bandwidth probe reads `read_bytes` (default 512 MiB: beyond any CPU
  cache); a model whose decode bytes fit the last-level cache (the shipped
  12 MB model on a CPU with a 300 MiB L3) can sit at or above that roof.

  Returns:
    peak (`matmul_peak`), bandwidth (`read_bandwidth`), roof_flops_per_s
    and roof_bytes_per_s (the probes' fastest repeats: the roof), ridge
    (the intensity where the roofs meet, FLOP/byte), prefill and decode
    points (medians of `repeats`):
    flops, bytes, seconds, intensity (FLOP/byte), flops_per_s (achieved),
    roof_flops_per_s, fraction_of_roof, bound, and the counted parts.
  """
  if prompt_len < 1:
    raise ValueError(f"prompt_len must be >= 1, got {prompt_len}")
  peak = bm.matmul_peak(matmul_n, config.compute_dtype)
  bw = bm.read_bandwidth(read_bytes)
  # The roof is what the machine can do: the probes' fastest repeat (on a
  # shared machine their medians sit below it); the points are medians.
  P, W = peak["best_flops_per_s"], bw["best_bytes_per_s"]
  pf = bm.prefill_flops(config, 1, prompt_len)
  pb = prefill_bytes(params, config, 1, prompt_len)
  pt = bm.prefill_seconds(params, config, 1, prompt_len, repeats=repeats)
  df = decode_step_flops(config, 1, prompt_len + 1)
  db = bm.decode_bytes_per_step(params, config, 1, prompt_len + 1)
  dt = bm.decode_step_seconds(params, config, 1, prompt_len,
                              warmup=DECODE_WARMUP, repeats=repeats)
  return dict(
      peak=peak, bandwidth=bw, roof_flops_per_s=P, roof_bytes_per_s=W,
      ridge=P / W, prompt_len=prompt_len,
      prefill=_point(f"prefill, {prompt_len} tokens", pf["total"],
                     pb["total"], pt["prefill_s"], P, W, flops_parts=pf,
                     bytes_parts=pb, timing=pt["timing"],
                     tokens_per_s=prompt_len / pt["prefill_s"]),
      decode=_point(f"decode step, {prompt_len + 1} keys", df["total"],
                    db["total"], dt["step_s"], P, W, flops_parts=df,
                    bytes_parts=db, timing=dt["loop"],
                    tokens_per_s=dt["tokens_per_s"]))


# ---- picture 2: no cache against cache ---------------------------------------
def attention_steps(params, config: ModelConfig, tokens_T,
                    layer: int | None = None) -> dict[str, Any]:
  """The attention matrix of a real prompt, and the check that a no-cache
  step recomputes what the step before it already had.

  Args:
    tokens_T: [T] prompt ids, T >= 2.
    layer: the layer drawn (None: the mean over layers); always the mean
      over query heads.
  Returns:
    matrix: [T, T] nested lists, matrix[q][k] the attention query q pays
      key k (rows sum to 1 over k <= q). recompute_max_abs_diff: the
      largest |difference| over layers, heads, rows and keys between the
      probabilities of the first T − 1 tokens computed alone and the same
      rows of the T-token forward: the no-cache step T−1 recomputes the
      previous step's block unchanged but for one new row (causality).
  """
  tokens = np.asarray(tokens_T, np.int32)
  T = tokens.shape[0]
  if tokens.ndim != 1 or T < 2:
    raise ValueError(f"tokens_T must be [T] with T >= 2, got shape "
                     f"{tokens.shape}")
  if layer is not None and not 0 <= layer < config.num_layers:
    raise ValueError(f"layer={layer}: the model has {config.num_layers}")
  probs = np.asarray(probe.attention_probs(params, config, tokens[None]))
  prev = np.asarray(probe.attention_probs(params, config, tokens[None, :-1]))
  diff = float(np.max(np.abs(prev - probs[..., :-1, :-1])))
  chosen = probs[:, 0] if layer is None else probs[layer:layer + 1, 0]
  matrix = chosen.astype(np.float64).mean(axis=(0, 1))
  return dict(matrix=matrix.tolist(), layer=layer,
              recompute_max_abs_diff=diff, length=T)


def step_times(params, config: ModelConfig, positions: Sequence[int], *,
               repeats: int = 5) -> list[dict[str, Any]]:
  """Measured step seconds at each stream position, without a cache
  (`no_cache_step_seconds`: the forward over position + 1 tokens) and with
  one (`decode_step_seconds`), beside the counted FLOPs of both (B = 1)."""
  rows = []
  for p in positions:
    nc = bm.no_cache_step_seconds(params, config, 1, p, repeats=repeats)
    c = bm.decode_step_seconds(params, config, 1, p, warmup=DECODE_WARMUP,
                               repeats=repeats)
    nf = no_cache_step_flops(config, 1, p)["total"]
    cf = decode_step_flops(config, 1, p + 1)["total"]
    rows.append(dict(position=p, no_cache_s=nc["step_s"],
                     cached_s=c["step_s"], no_cache=nc, cached=c,
                     no_cache_flops=nf, cached_flops=cf,
                     time_ratio=nc["step_s"] / c["step_s"],
                     flops_ratio=nf / cf))
  return rows


# ---- picture 3: a bounded cache fills, then evicts ---------------------------
def sinks_trace(params, config: ModelConfig, tokens, *, steps: int,
                capacity: int, num_sinks: int = 4,
                positions: str = "cache") -> dict[str, Any]:
  """Feeds a stream token by token into a sinks cache of `capacity` slots
  (`kvjax.decode_step`) and reads the cache after every step.

  Args:
    tokens: [T] ids fed first (teacher forcing); past them the greedy
      choice of the previous step is fed, so any `steps` works.
    steps: tokens fed (>= 1).
    capacity: S slots; num_sinks < S.
    positions: the policy's position mode (`CachePolicy.positions`).
  Returns:
    fed: the ids fed. held: [steps][S] the stream position each slot holds
    after each step (-1: empty), read from the cache's `positions`.
    used_bytes: [steps] bytes of the filled slots (`cache_bytes`'s used);
    formula_bytes: `kv_bytes_per_token` × min(t + 1, S), equal (checked);
    unbounded_bytes: what an unbounded cache would hold, (t + 1) × per
    token; allocated_bytes: the cache's K/V storage (the cap);
    kv_bytes_per_token, capacity, num_sinks, policy.
  Raises:
    ValueError: bad steps / capacity / num_sinks (`CachePolicy`).
    AssertionError: the bytes read from the arrays disagree with the
      formula.
  """
  if steps < 1:
    raise ValueError(f"steps must be >= 1, got {steps}")
  policy = cache_lib.CachePolicy("sinks", num_sinks=num_sinks,
                                 positions=positions)
  policy.validate_capacity(capacity)
  tokens = np.asarray(tokens, np.int32).reshape(-1)
  cache = cache_lib.init_cache(config, 1, capacity, policy=policy)
  per_token = cache_lib.kv_bytes_per_token(config, policy.kv_dtype)
  fed, held, used = [], [], []
  nxt = int(tokens[0]) if tokens.size else 0
  for t in range(steps):
    tok = int(tokens[t]) if t < tokens.size else nxt
    logits, cache = inference.decode_step(params, config,
                                          jnp.asarray([tok], jnp.int32),
                                          cache)
    fed.append(tok)
    held.append(np.asarray(cache.positions[0]).tolist())
    used.append(cache_lib.cache_bytes(cache)["used"])
    nxt = int(jnp.argmax(logits[0]))
  formula = [int(per_token * min(t + 1, capacity)) for t in range(steps)]
  if used != formula:
    raise AssertionError(f"cache bytes read from the arrays {used} differ "
                         f"from kv_bytes_per_token x tokens held {formula}")
  return dict(fed=fed, held=held, used_bytes=used, formula_bytes=formula,
              unbounded_bytes=[int(per_token * (t + 1))
                               for t in range(steps)],
              allocated_bytes=cache_lib.cache_bytes(cache)["kv"],
              kv_bytes_per_token=per_token, capacity=capacity,
              num_sinks=num_sinks, policy=dict(
                  eviction=policy.eviction, num_sinks=policy.num_sinks,
                  positions=policy.positions, kv_dtype=policy.kv_dtype))


def occupancy(trace: dict[str, Any]) -> np.ndarray:
  """[steps, steps] int codes: row t, column p is what stream position p is
  after step t: FUTURE (not yet fed), EVICTED, SINK or WINDOW (held)."""
  n, sinks = len(trace["held"]), trace["num_sinks"]
  out = np.full((n, n), FUTURE, np.int32)
  for t, held in enumerate(trace["held"]):
    out[t, :t + 1] = EVICTED
    for p in held:
      if p >= 0:
        out[t, p] = SINK if p < sinks else WINDOW
  return out


# ---- drawing ---------------------------------------------------------------
def _pyplot():
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def _save(fig, path) -> dict[str, Any]:
  labels = bm.figure_labels(fig)
  fig.savefig(path, dpi=110, bbox_inches="tight")
  _pyplot().close(fig)
  return labels


def _si(x: float, unit: str) -> str:
  for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
    if abs(x) >= scale:
      return f"{x / scale:.3g} {prefix}{unit}"
  return f"{x:.3g} {unit}"


def _write_gif(fig, frame, frames: int, path, fps: int) -> None:
  """Draws frame(0 .. frames-1) into a GIF (Pillow), then closes `fig`.
  The writer is driven by hand: `FuncAnimation.save` draws every frame
  twice."""
  from matplotlib import animation  # pylint: disable=g-import-not-at-top
  writer = animation.PillowWriter(fps=fps)
  with writer.saving(fig, path, dpi=80):
    for t in range(frames):
      frame(t)
      writer.grab_frame()
  _pyplot().close(fig)


def plot_roofline(roof: dict[str, Any], path, *, title: str) -> dict:
  """Achieved FLOP/s against arithmetic intensity (log-log), under the
  roof min(peak, bandwidth × intensity) of this machine's probes."""
  plt = _pyplot()
  P, W = roof["roof_flops_per_s"], roof["roof_bytes_per_s"]
  pts = [roof["prefill"], roof["decode"]]
  lo = min(p["intensity"] for p in pts + [dict(intensity=roof["ridge"])])
  hi = max(p["intensity"] for p in pts + [dict(intensity=roof["ridge"])])
  xs = np.geomspace(lo / 4, hi * 4, 200)
  fig, ax = plt.subplots(figsize=(7.6, 5.0))
  ax.plot(xs, np.minimum(P, W * xs), color="black", lw=2,
          label=f"roof: min({_si(P, 'FLOP/s')} matmul peak, "
          f"{_si(W, 'B/s')} read bandwidth × intensity); probes' fastest "
          "repeats")
  ax.axvline(roof["ridge"], color="gray", ls=":", lw=1,
             label=f"ridge: {roof['ridge']:.3g} FLOP/byte")
  for p, colour, marker in ((roof["prefill"], "C3", "s"),
                            (roof["decode"], "C0", "o")):
    ax.plot([p["intensity"]], [p["flops_per_s"]], marker=marker, ms=10,
            color=colour, ls="none",
            label=f"{p['name']}: {_si(p['flops'], 'FLOP')}, "
            f"{_si(p['bytes'], 'B')}, {1e3 * p['seconds']:.3g} ms "
            f"({p['bound']}-bound side)")
    ax.annotate(f"{_si(p['flops_per_s'], 'FLOP/s')}, "
                f"{_si(p['bytes_per_s'], 'B/s')}\n"
                f"{100 * p['fraction_of_roof']:.3g}% of its roof",
                (p["intensity"], p["flops_per_s"]),
                textcoords="offset points", xytext=(10, -4), fontsize=8,
                color=colour)
  ax.set(xscale="log", yscale="log",
         xlabel="arithmetic intensity (counted FLOPs / counted bytes moved)",
         ylabel="achieved FLOP/s (counted FLOPs / measured median time)",
         title=title)
  ax.set_ylim(top=2 * P)
  ax.grid(alpha=0.3, which="both")
  ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0, -0.14))
  return _save(fig, path)


def _text_ticks(ax, labels: Sequence[str] | None, T: int):
  if labels is None:
    return
  shown = [repr(c)[1:-1] if c.strip() else "␣" for c in labels]
  size = 7 if T <= 40 else 4
  ax.set_xticks(range(T))
  ax.set_xticklabels(shown, fontsize=size, family="monospace")
  ax.set_yticks(range(T))
  ax.set_yticklabels(shown, fontsize=size, family="monospace")


class _StepMatrix:
  """The attention matrix at one step of `mode` ('no_cache' or 'cache') on
  `ax`: the entries computed at that step in colour, the rest of what the
  query has seen greyed; no cache: the rows the previous step already had
  hatched (recomputed unchanged); both: the new query row outlined.
  Artists are made once and `show(t)` updates them (GIF frames)."""

  def __init__(self, ax, matrix: np.ndarray, mode: str, norm, labels=None):
    from matplotlib import patches  # pylint: disable=g-import-not-at-top
    if mode not in ("no_cache", "cache"):
      raise ValueError(f"mode={mode!r} is not 'no_cache' or 'cache'")
    self.matrix, self.mode = matrix, mode
    T = matrix.shape[0]
    self.causal = np.tril(np.ones((T, T), bool))
    self.rows = np.arange(T)[:, None]
    empty = np.ma.masked_all((T, T))
    self.grey = ax.imshow(empty, cmap="Greys", vmin=0, vmax=4,
                          interpolation="nearest")
    self.image = ax.imshow(empty, cmap="magma", norm=norm,
                           interpolation="nearest")
    self.stair = patches.Polygon([(0, 0)], closed=True, fill=False,
                                 ec=(0.17, 0.63, 0.17, 0.8), lw=1.5, ls="--",
                                 hatch="/")
    self.row = patches.Rectangle((-0.5, -0.5), 1, 1, fill=False, ec="C0",
                                 lw=1.5)
    ax.add_patch(self.stair)
    ax.add_patch(self.row)
    ax.set_xlim(-0.5, T - 0.5)
    ax.set_ylim(T - 0.5, -0.5)
    _text_ticks(ax, labels, T)
    ax.set_xlabel("key (stream position)")
    ax.set_ylabel("query (stream position)")

  def show(self, t: int):
    seen = self.causal & (self.rows <= t)
    computed = seen if self.mode == "no_cache" else seen & (self.rows == t)
    self.grey.set_data(np.ma.masked_where(~seen, np.ones(seen.shape)))
    self.image.set_data(np.ma.masked_where(~computed, self.matrix))
    stair = [(-0.5, -0.5)]
    for r in range(t):
      stair += [(r + 0.5, r - 0.5), (r + 0.5, r + 0.5)]
    stair.append((-0.5, t - 0.5))
    self.stair.set_xy(stair)
    self.stair.set_visible(self.mode == "no_cache" and t > 0)
    self.row.set_y(t - 0.5)
    self.row.set_width(t + 1)
    return self.image


def _mode_title(mode: str, t: int, flops: dict) -> str:
  if mode == "no_cache":
    return (f"no cache, step {t}: recompute all {t + 1} rows\n"
            f"({t} identical to step {t - 1}'s, dashed) — "
            f"{_si(flops['no_cache'][t], 'FLOP')}" if t else
            f"no cache, step 0: 1 row — {_si(flops['no_cache'][0], 'FLOP')}")
  return (f"KV cache, step {t}: 1 new query row against {t + 1} keys\n"
          f"({t} cached + its own; earlier rows not recomputed) — "
          f"{_si(flops['cached'][t], 'FLOP')}")


def plot_cache_vs_no_cache(attn: dict, flops: dict, times: list, path, *,
                           title: str, labels=None) -> dict:
  """Six panels: the attention matrix at the last step without / with a
  cache; counted FLOPs per step and cumulative; measured step times; the
  no-cache / cache ratio of times against that of FLOPs."""
  from matplotlib import colors  # pylint: disable=g-import-not-at-top
  plt = _pyplot()
  A = np.asarray(attn["matrix"], np.float64)
  T = A.shape[0]
  norm = colors.PowerNorm(0.5, vmin=0.0, vmax=float(A.max()))
  fig, axes = plt.subplots(2, 3, figsize=(17, 10.5))
  for ax, mode in zip(axes[0, :2], ("no_cache", "cache")):
    image = _StepMatrix(ax, A, mode, norm, labels).show(T - 1)
    ax.set_title(_mode_title(mode, T - 1, flops), fontsize=9)
  fig.colorbar(image, ax=axes[0, :2], shrink=0.7,
               label="attention probability (mean over heads"
               f"{', layers' if attn['layer'] is None else ''}; sqrt scale)")
  x = np.asarray(flops["position"]) + 1  # tokens processed by step t
  for ax, key, ylabel in (
      (axes[0, 2], "", "FLOPs of step t (counted)"),
      (axes[1, 0], "_cumulative", "FLOPs of steps 0..t (counted)")):
    ax.plot(x, flops["no_cache" + key], color="C3",
            label="no cache: forward over t + 1 tokens")
    ax.plot(x, flops["cached" + key], color="C0",
            label="KV cache: one token, t + 1 keys")
    # Log-log: a power of t is a straight line whose slope is its degree.
    ax.set(xscale="log", yscale="log",
           xlabel="t + 1 (tokens so far, the new one included)",
           ylabel=ylabel)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
  axes[0, 2].set_title("work per step (log-log): no cache grows as t "
                       "(weights) + t² (attention),\nthe cached step is "
                       "~constant (+ t attention)", fontsize=9)
  axes[1, 0].set_title("cumulative work (log-log): no cache ~t² and more, "
                       "KV cache ~t", fontsize=9)
  ax = axes[1, 1]
  if times:
    p = [r["position"] for r in times]
    ax.plot(p, [1e3 * r["no_cache_s"] for r in times], "s-", color="C3",
            label="no cache (no_cache_step_seconds)")
    ax.plot(p, [1e3 * r["cached_s"] for r in times], "o-", color="C0",
            label="KV cache (decode_step_seconds)")
    ax.set(xscale="log", yscale="log")
    bm._tick_at(ax, p)  # pylint: disable=protected-access
    ax.legend(fontsize=8)
    axes[1, 2].plot(p, [r["time_ratio"] for r in times], "o-", color="C4",
                    label="measured time ratio")
    axes[1, 2].plot(p, [r["flops_ratio"] for r in times], "s--",
                    color="C7", label="counted FLOPs ratio")
    axes[1, 2].set(xscale="log", yscale="log")
    bm._tick_at(axes[1, 2], p)  # pylint: disable=protected-access
    axes[1, 2].legend(fontsize=8)
  ax.set(xlabel="position (tokens before the new one)",
         ylabel="milliseconds per step (median)",
         title="measured step time")
  ax.grid(alpha=0.3, which="both")
  axes[1, 2].set(xlabel="position (tokens before the new one)",
                 ylabel="no cache / KV cache", title="what the cache saves")
  axes[1, 2].grid(alpha=0.3, which="both")
  fig.suptitle(title, fontsize=10)
  return _save(fig, path)


def animate_attention(attn: dict, flops: dict, mode: str, path, *,
                      title: str, labels=None, fps: int = 4) -> int:
  """A GIF stepping through the prompt, one frame per step: the attention
  block this step computes (`mode` 'no_cache' or 'cache') and the
  cumulative counted FLOPs of both so far. Returns the frame count."""
  from matplotlib import colors  # pylint: disable=g-import-not-at-top
  plt = _pyplot()
  A = np.asarray(attn["matrix"], np.float64)
  T = A.shape[0]
  norm = colors.PowerNorm(0.5, vmin=0.0, vmax=float(A.max()))
  x = np.asarray(flops["position"][:T])
  nc = np.asarray(flops["no_cache_cumulative"][:T])
  c = np.asarray(flops["cached_cumulative"][:T])
  fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 5.2),
                               gridspec_kw=dict(width_ratios=(1.1, 1)))
  view = _StepMatrix(ax, A, mode, norm, labels)
  fig.colorbar(view.image, ax=ax, shrink=0.7, label="attention probability")
  wide = dict(no_cache=2.5, cache=1)[mode]
  nc_line, = bx.plot([], [], "s-", ms=3, color="C3", lw=wide,
                     label="no cache (every step: the whole block)")
  c_line, = bx.plot([], [], "o-", ms=3, color="C0", lw=3.5 - wide,
                    label="KV cache (every step: one row)")
  bx.set(xlim=(-0.5, T - 0.5), ylim=(0, 1.05 * nc[-1]), xlabel="step t",
         ylabel="FLOPs of steps 0..t (counted)")
  bx.grid(alpha=0.3)
  bx.legend(fontsize=8, loc="upper left")
  fig.suptitle(title, fontsize=9)

  def frame(t):
    view.show(t)
    ax.set_title(_mode_title(mode, t, flops), fontsize=9)
    nc_line.set_data(x[:t + 1], nc[:t + 1])
    c_line.set_data(x[:t + 1], c[:t + 1])
    bx.set_title(f"cumulative work after step {t}: no cache "
                 f"{_si(nc[t], 'FLOP')}, cache {_si(c[t], 'FLOP')}",
                 fontsize=9)

  _write_gif(fig, frame, T, path, fps)
  return T


_CELL_COLOURS = ("white", "#d9d9d9", "#d62728", "#1f77b4")


def plot_cache_growth(trace: dict, path, *, title: str) -> dict:
  """Two panels: which stream positions the cache holds after every step
  (sinks, window, evicted), and the bytes it holds against tokens fed
  (read from the arrays; the formula and an unbounded cache beside)."""
  from matplotlib import colors  # pylint: disable=g-import-not-at-top
  from matplotlib.patches import Patch  # pylint: disable=g-import-not-at-top
  plt = _pyplot()
  occ = occupancy(trace)
  n, S = occ.shape[0], trace["capacity"]
  fig, (ax, bx) = plt.subplots(1, 2, figsize=(14, 5.6))
  ax.imshow(occ, cmap=colors.ListedColormap(_CELL_COLOURS), vmin=-0.5,
            vmax=3.5, interpolation="nearest", aspect="auto")
  ax.set(xlabel="stream position", ylabel="after step t (tokens fed − 1)",
         title=f"what the cache holds: {S} slots, first "
         f"{trace['num_sinks']} positions pinned, a window of the newest "
         f"{S - trace['num_sinks']}")
  ax.title.set_fontsize(9)
  ax.legend(handles=[Patch(color=_CELL_COLOURS[i], label=label)
                     for i, label in ((SINK, "held: sink"),
                                      (WINDOW, "held: window"),
                                      (EVICTED, "evicted"))],
            fontsize=8, loc="upper right")
  tokens = np.arange(1, n + 1)
  kib = lambda b: np.asarray(b, np.float64) / 1024
  bx.plot(tokens, kib(trace["unbounded_bytes"]), "--", color="gray",
          label="unbounded cache: tokens × kv_bytes_per_token")
  bx.plot(tokens, kib(trace["used_bytes"]), "o", ms=4, color="C0",
          label="sinks cache: bytes of filled slots (cache_bytes)")
  bx.plot(tokens, kib(trace["formula_bytes"]), "-", color="C0", lw=1,
          label="kv_bytes_per_token × min(tokens, S)")
  bx.axhline(kib(trace["allocated_bytes"]), color="C3", ls=":",
             label=f"cap: S = {S} slots = "
             f"{trace['allocated_bytes']:,} bytes")
  bx.set(xlabel="tokens fed", ylabel="KiB of K/V held",
         title=f"{trace['kv_bytes_per_token']:,} bytes per token (all "
         "layers): linear, then flat at the cap")
  bx.title.set_fontsize(9)
  bx.grid(alpha=0.3)
  bx.legend(fontsize=8, loc="upper left")
  fig.suptitle(title, fontsize=10)
  return _save(fig, path)


def animate_cache(trace: dict, path, *, title: str, fps: int = 4) -> int:
  """A GIF, one frame per step: the stream (held / evicted / to come), the
  S slots with the position each holds (the newest write outlined), and
  the bytes held so far. Returns the frame count."""
  from matplotlib import colors  # pylint: disable=g-import-not-at-top
  from matplotlib import patches  # pylint: disable=g-import-not-at-top
  plt = _pyplot()
  occ = occupancy(trace)
  n, S, sinks = occ.shape[0], trace["capacity"], trace["num_sinks"]
  cmap = colors.ListedColormap(_CELL_COLOURS)
  cells = dict(cmap=cmap, vmin=-0.5, vmax=3.5, aspect="auto",
               interpolation="nearest")
  kib = np.asarray(trace["used_bytes"], np.float64) / 1024
  unbounded = np.asarray(trace["unbounded_bytes"], np.float64) / 1024
  tokens = np.arange(1, n + 1)
  fig = plt.figure(figsize=(11, 6.2))
  grid = fig.add_gridspec(3, 1, height_ratios=(0.7, 0.9, 2.2), hspace=0.9)
  sx, cx, bx = (fig.add_subplot(grid[i]) for i in range(3))
  stream = sx.imshow(occ[:1], **cells)
  sx.set_yticks([])
  sx.set_xlabel("stream position")
  slots = cx.imshow(np.zeros((1, S)), **cells)
  numbers = [cx.text(s, 0, "", ha="center", va="center", fontsize=8,
                     color="white") for s in range(S)]
  newest = patches.Rectangle((-0.5, -0.5), 1, 1, fill=False, ec="black",
                             lw=2.5)
  cx.add_patch(newest)
  cx.set_yticks([])
  cx.set_xticks(range(S))
  cx.set(xlabel="cache slot (number: the stream position it holds; "
         "outlined: written at this step)",
         title=f"the {S} slots (cache.positions)")
  free_line, = bx.plot([], [], "--", color="gray", label="unbounded cache")
  held_line, = bx.plot([], [], "o-", ms=3, color="C0",
                       label="sinks cache (read from its arrays)")
  bx.axhline(trace["allocated_bytes"] / 1024, color="C3", ls=":",
             label=f"cap: {S} slots")
  bx.set(xlim=(0, n + 1), ylim=(0, 1.05 * unbounded[-1]),
         xlabel="tokens fed", ylabel="KiB of K/V held")
  bx.grid(alpha=0.3)
  bx.legend(fontsize=8, loc="upper left")
  for a in (cx, bx):
    a.title.set_fontsize(9)
  fig.suptitle(title, fontsize=9)

  def frame(t):
    stream.set_data(occ[t:t + 1])
    sx.set_title(f"step {t}: the stream (red: sinks, blue: window, grey: "
                 "evicted)", fontsize=9)
    held = np.asarray(trace["held"][t])
    slots.set_data(np.where(held < 0, FUTURE,
                            np.where(held < sinks, SINK, WINDOW))[None])
    for text, p in zip(numbers, held):
      text.set_text(str(p) if p >= 0 else "")
    newest.set_x(int(np.argmax(held)) - 0.5)
    free_line.set_data(tokens[:t + 1], unbounded[:t + 1])
    held_line.set_data(tokens[:t + 1], kib[:t + 1])
    bx.set_title(f"{t + 1} tokens fed, {int(np.sum(held >= 0))} held: "
                 f"{trace['used_bytes'][t]:,} bytes", fontsize=9)

  _write_gif(fig, frame, n, path, fps)
  return n


# ---- all three -------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Settings:
  """What `run` measures (B = 1 throughout).

  prompt_len: T of the roofline's prefill; its decode step attends T + 1.
  attention_len: tokens of the prompt whose attention is stepped through.
  time_positions: positions whose no-cache and cached steps are timed.
  steps, capacity, num_sinks, positions: the sinks cache's run.
  layer: the attention layer drawn (None: the mean over layers).
  repeats: timed calls per measurement (medians).
  matmul_n, read_bytes: sizes of the roofline's probes.
  fps: frames per second of the GIFs.
  """

  prompt_len: int = 256
  attention_len: int = 32
  time_positions: tuple[int, ...] = (16, 128, 1024)
  steps: int = 48
  capacity: int = 16
  num_sinks: int = 4
  positions: str = "cache"
  layer: int | None = None
  repeats: int = 5
  matmul_n: int = 2048
  read_bytes: int = 1 << 29
  fps: int = 4

  def check(self, config: ModelConfig, tokens_len: int) -> None:
    """ValueError naming the field, before anything is compiled."""
    for name in ("prompt_len", "steps", "repeats", "matmul_n", "fps"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    if self.attention_len < 2:
      raise ValueError(f"attention_len must be >= 2, got "
                       f"{self.attention_len}")
    if self.attention_len > tokens_len:
      raise ValueError(f"attention_len={self.attention_len}: the prompt "
                       f"holds {tokens_len} tokens")
    if any(p < 0 for p in self.time_positions):
      raise ValueError(f"time_positions must be >= 0, got "
                       f"{list(self.time_positions)}")
    longest = max((self.prompt_len + 1, *(p + 1 for p in
                                           self.time_positions)))
    if longest > config.max_seq_len:
      raise ValueError(f"prompt_len / time_positions reach {longest} "
                       f"tokens, past the model's max_seq_len="
                       f"{config.max_seq_len}")
    if self.layer is not None and not 0 <= self.layer < config.num_layers:
      raise ValueError(f"layer={self.layer}: the model has "
                       f"{config.num_layers} layers")
    cache_lib.CachePolicy("sinks", num_sinks=self.num_sinks,
                          positions=self.positions).validate_capacity(
                              self.capacity)


FILES = dict(roofline="roofline.png", attention="cache_vs_no_cache.png",
             no_cache_gif="no_cache_steps.gif", cache_gif="cache_steps.gif",
             growth="cache_growth.png", growth_gif="cache_growth.gif",
             json="explain.json")


def run(params, config: ModelConfig, tokens, workdir: str,
        settings: Settings = Settings(), *, text: str | None = None,
        name: str = "") -> dict[str, Any]:
  """Measures and draws the three pictures into `workdir` (`FILES`).

  Args:
    tokens: [T'] prompt ids: the first `attention_len` are the attention
      prompt; the sinks cache is fed them (then its own greedy tokens).
    text: the prompt's text (byte-level models), for the matrices' ticks.
    name: the model's description in the titles.
  Returns:
    the JSON-able dict of every plotted number (roofline, attention,
    flops, times, cache) and the figures' labels; the caller adds the host
    and model and writes it (`FILES['json']`).
  """
  tokens = np.asarray(tokens, np.int32).reshape(-1)
  settings.check(config, tokens.size)
  # Fused attention forms no probabilities: the probe runs the same model
  # with the einsum path; everything timed runs the config as given.
  probed = config.replace(attention_impl="einsum")
  os.makedirs(workdir, exist_ok=True)
  path = lambda key: os.path.join(workdir, FILES[key])
  s, cpu = settings, bm.cpu_model()
  roof = roofline(params, config, s.prompt_len, repeats=s.repeats,
                  matmul_n=s.matmul_n, read_bytes=s.read_bytes)
  attn = attention_steps(params, probed, tokens[:s.attention_len], s.layer)
  flops = step_flops(config, max((s.attention_len, *(p + 1 for p in
                                                     s.time_positions))))
  times = step_times(params, config, s.time_positions, repeats=s.repeats)
  trace = sinks_trace(params, config, tokens, steps=s.steps,
                      capacity=s.capacity, num_sinks=s.num_sinks,
                      positions=s.positions)
  labels = list(text[:s.attention_len]) if text else None
  figures = dict(
      roofline=plot_roofline(roof, path("roofline"), title=(
          f"{name}: prefill against decode on the roofline of {cpu}")),
      attention=plot_cache_vs_no_cache(attn, flops, times, path("attention"),
                                       title=f"{name}: no cache against a "
                                       f"KV cache, {cpu}", labels=labels),
      growth=plot_cache_growth(trace, path("growth"), title=(
          f"{name}: a StreamingLLM sinks cache fed {s.steps} tokens by "
          "kvjax.decode_step")))
  frames = dict(
      no_cache=animate_attention(attn, flops, "no_cache", path(
          "no_cache_gif"), title=f"{name}: without a cache", labels=labels,
                                 fps=s.fps),
      cache=animate_attention(attn, flops, "cache", path("cache_gif"),
                              title=f"{name}: with a KV cache",
                              labels=labels, fps=s.fps),
      growth=animate_cache(trace, path("growth_gif"), title=(
          f"{name}: sinks cache, S = {s.capacity}, "
          f"{s.num_sinks} sinks"), fps=s.fps))
  settings_dict = dataclasses.asdict(s)
  settings_dict["time_positions"] = list(s.time_positions)
  return dict(settings=settings_dict, roofline=roof, attention=attn,
              flops=flops, times=times, cache=trace, figures=figures,
              frames=frames, files=dict(FILES))


def summary_lines(result: dict[str, Any]) -> list[str]:
  """The numbers a run prints: the probes, prefill and decode on the
  roofline, no-cache against cached steps, the sinks cache at the end."""
  r = result["roofline"]
  out = [f"probes (fastest / median repeat): matmul peak "
         f"{_si(r['roof_flops_per_s'], 'FLOP/s')} / "
         f"{_si(r['peak']['flops_per_s'], 'FLOP/s')}, read bandwidth "
         f"{_si(r['roof_bytes_per_s'], 'B/s')} / "
         f"{_si(r['bandwidth']['bytes_per_s'], 'B/s')}; ridge "
         f"{r['ridge']:.3g} FLOP/byte"]
  for p in (r["prefill"], r["decode"]):
    out.append(f"{p['name']}: {p['flops']:.4g} FLOPs, {p['bytes']:,} bytes "
               f"(intensity {p['intensity']:.3g} FLOP/byte, {p['bound']} "
               f"side), {1e3 * p['seconds']:.3f} ms -> "
               f"{_si(p['flops_per_s'], 'FLOP/s')}, "
               f"{_si(p['bytes_per_s'], 'B/s')} "
               f"({100 * p['fraction_of_roof']:.3g}% of its roof)")
  a = result["attention"]
  out.append(f"attention of {a['length']} tokens: the no-cache step "
             f"recomputes the previous step's rows to max |diff| "
             f"{a['recompute_max_abs_diff']:.2g}")
  for t in result["times"]:
    out.append(f"position {t['position']:>5}: no cache "
               f"{1e3 * t['no_cache_s']:.3f} ms ({t['no_cache_flops']:.4g} "
               f"FLOPs), cached {1e3 * t['cached_s']:.3f} ms "
               f"({t['cached_flops']:.4g} FLOPs): x{t['time_ratio']:.3g} "
               f"time, x{t['flops_ratio']:.3g} FLOPs")
  c = result["cache"]
  out.append(f"sinks cache S={c['capacity']} ({c['num_sinks']} sinks), "
             f"{len(c['fed'])} tokens fed: holds positions "
             f"{sorted(p for p in c['held'][-1] if p >= 0)}, "
             f"{c['used_bytes'][-1]:,} bytes (cap "
             f"{c['allocated_bytes']:,}; unbounded would hold "
             f"{c['unbounded_bytes'][-1]:,}), "
             f"{c['kv_bytes_per_token']:,} bytes per token")
  return out
