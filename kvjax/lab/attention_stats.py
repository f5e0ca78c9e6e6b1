"""Where attention goes, per layer and head: sink mass, entropy, distance.

Every statistic reads the probe's probabilities (`kvjax.probe`:
probs [L, B, N, T, T]) and comes with its uniform-causal baseline: the same
statistic of attention spread evenly over the keys each query may see
(`uniform_probs`), so "the first token gets 0.0002" can be read against
"uniform attention would give it 0.0054".

Queries: each statistic averages over the real queries at stream position
>= `min_query` (0: all). Early queries see few keys, so their uniform
share of any key is large; a window's second half (min_query = T // 2, as
`kvjax.lab.streaming.attention_profile`) is the usual choice.

Shapes: L layers, B batch, N query heads, T query / key positions (and the
distances 0..T-1). Padding (left, `attention_mask` [B, T]) is no query and no
key; positions count real tokens only.

`summarize` gathers the statistics into the JSON-able dict
`experiments/attention_map.py` writes; `plot_heatmaps` and `plot_summary`
draw it.
"""

from __future__ import annotations

import numpy as np

from kvjax import probe
from kvjax.config import ModelConfig


def _mask(attention_mask_BT, B: int, T: int) -> np.ndarray:
  if attention_mask_BT is None:
    return np.ones((B, T), bool)
  return np.asarray(attention_mask_BT).astype(bool)


def positions(attention_mask_BT) -> np.ndarray:
  """[B, T] stream position of each token (real tokens counted from 0),
  -1 for padding (as `kvjax.model.stream_positions`)."""
  m = np.asarray(attention_mask_BT).astype(bool)
  return np.where(m, np.cumsum(m, axis=1) - 1, -1)


def uniform_probs(attention_mask_BT, window: int = 0) -> np.ndarray:
  """[B, T, T] float64: each real query's attention spread evenly over the
  keys it may see (real, not in the future, inside a sliding `window` when
  > 0); padding queries' rows are 0 (as the probe's)."""
  pos = positions(attention_mask_BT)
  q, k = pos[:, :, None], pos[:, None, :]
  ok = (q >= 0) & (k >= 0) & (k <= q)
  if window:
    ok &= k > q - window
  count = np.maximum(ok.sum(-1, keepdims=True), 1)
  return ok / count


def _queries(probs, attention_mask_BT, min_query: int):
  """float64 probs and the [B, T] weights of the averaged queries."""
  probs = np.asarray(probs, np.float64)
  B, T = probs.shape[1], probs.shape[3]
  pos = positions(_mask(attention_mask_BT, B, T))
  sel_BT = pos >= min_query
  if not sel_BT.any():
    raise ValueError(f"min_query={min_query}: no query lies at or past it "
                     f"(the longest sequence has {pos.max() + 1} tokens)")
  return probs, sel_BT


def _query_mean(x_LBNT, sel_BT) -> np.ndarray:
  """[L, N] mean of a per-query value over the selected queries."""
  w = sel_BT[None, :, None, :]
  return (x_LBNT * w).sum(axis=(1, 3)) / sel_BT.sum()


def sink_mass(probs, attention_mask_BT=None, *, k: int = 1,
              min_query: int = 0) -> np.ndarray:
  """[L, N]: mean attention on the first `k` tokens (stream positions < k)
  per layer and head."""
  probs, sel = _queries(probs, attention_mask_BT, min_query)
  first_BS = positions(_mask(attention_mask_BT, *sel.shape))
  first_BS = (first_BS >= 0) & (first_BS < k)
  mass_LBNT = (probs * first_BS[None, :, None, None, :]).sum(-1)
  return _query_mean(mass_LBNT, sel)


def entropy(probs, attention_mask_BT=None, *, min_query: int = 0
            ) -> np.ndarray:
  """[L, N]: mean entropy (nats) of the queries' attention distributions,
  -sum p log p with 0 log 0 = 0 (uniform over n keys: log n)."""
  probs, sel = _queries(probs, attention_mask_BT, min_query)
  plogp = np.where(probs > 0, probs * np.log(np.where(probs > 0, probs, 1)),
                   0.0)
  return _query_mean(-plogp.sum(-1), sel)


def distance_profile(probs, attention_mask_BT=None, *, min_query: int = 0
                     ) -> np.ndarray:
  """[L, N, T]: mean attention a query pays the key d = 0..T-1 tokens back
  (d = 0: itself), over the selected queries that have such a key (NaN
  where none has)."""
  probs, sel = _queries(probs, attention_mask_BT, min_query)
  L, B, N, T, _ = probs.shape
  real = _mask(attention_mask_BT, B, T)
  out = np.full((L, N, T), np.nan)
  for d in range(T):
    q, k = np.arange(d, T), np.arange(T - d)
    w_BT = sel[:, q] & real[:, k]  # left padding: index distance = d
    if w_BT.any():
      diag = probs[:, :, :, q, k]  # [L, B, N, T - d]
      out[:, :, d] = ((diag * w_BT[None, :, None]).sum(axis=(1, 3)) /
                      w_BT.sum())
  return out


def summarize(probs, attention_mask_BT=None, *, sink_k=(1, 4),
              min_query: int = 0, window: int = 0) -> dict:
  """The statistics above and their uniform baselines, JSON-able.

  Args:
    probs: [L, B, N, T, T] (`kvjax.probe.attention_probs`).
    sink_k: the k of each sink mass.
    window: the model's sliding window (0: none), for the baseline.
  Returns:
    dict(sink_mass={k: [L][N]}, sink_mass_uniform={k: float},
    entropy=[L][N], entropy_uniform, distance_profile=[L][N][T],
    distance_profile_uniform=[T], per_layer (head means), min_query,
    queries (how many were averaged)). Keys of the sink dicts are str(k).
  """
  L, B, N, T, _ = np.shape(probs)
  mask = _mask(attention_mask_BT, B, T)
  uniform = uniform_probs(mask, window)[None, :, None]  # [1, B, 1, T, T]
  kw = dict(min_query=min_query)
  out = dict(min_query=min_query,
             queries=int((positions(mask) >= min_query).sum()),
             sink_mass={}, sink_mass_uniform={})
  for k in sink_k:
    out["sink_mass"][str(k)] = sink_mass(probs, mask, k=k, **kw)
    out["sink_mass_uniform"][str(k)] = float(
        sink_mass(uniform, mask, k=k, **kw)[0, 0])
  out["entropy"] = entropy(probs, mask, **kw)
  out["entropy_uniform"] = float(entropy(uniform, mask, **kw)[0, 0])
  out["distance_profile"] = distance_profile(probs, mask, **kw)
  out["distance_profile_uniform"] = distance_profile(uniform, mask,
                                                     **kw)[0, 0]
  out["per_layer"] = [
      dict(layer=l, entropy=float(out["entropy"][l].mean()),
           **{f"sink_mass_{k}": float(v[l].mean())
              for k, v in out["sink_mass"].items()},
           **{f"sink_mass_{k}_max_head": float(v[l].max())
              for k, v in out["sink_mass"].items()})
      for l in range(L)]
  return _jsonable(out)


def _jsonable(x):
  if isinstance(x, dict):
    return {k: _jsonable(v) for k, v in x.items()}
  if isinstance(x, list):
    return [_jsonable(v) for v in x]
  if isinstance(x, np.ndarray):
    return np.where(np.isnan(x), None, x).tolist() if x.dtype.kind == "f" \
        else x.tolist()
  return x


def analyse(params, config: ModelConfig, tokens_BT, attention_mask_BT=None,
            *, sink_k=(1, 4), min_query: int = 0):
  """The probe and its summary: (probs [L, B, N, T, T] numpy, summary)."""
  probs = np.asarray(probe.attention_probs(params, config, tokens_BT,
                                           attention_mask_BT))
  return probs, summarize(probs, attention_mask_BT, sink_k=sink_k,
                          min_query=min_query, window=config.sliding_window)


# ---- plots -------------------------------------------------------------------
def _pyplot():
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


def pick(n: int, chosen=(), most: int = 8) -> list[int]:
  """Indices to draw: `chosen` (checked against n), else all of range(n)
  when n <= most, else `most` evenly spaced (first and last included)."""
  if chosen:
    bad = [i for i in chosen if not 0 <= i < n]
    if bad:
      raise ValueError(f"indices {bad} outside [0, {n})")
    return list(chosen)
  if n <= most:
    return list(range(n))
  return sorted({int(round(i)) for i in np.linspace(0, n - 1, most)})


def plot_heatmaps(probs_LNTT, path, *, layers, heads, title: str = ""):
  """A grid of attention maps, one row per layer, one column per head
  (log colour scale; keys a query may not see are blank).

  Args:
    probs_LNTT: one sequence's probabilities [L, N, T, T].
    layers, heads: the indices drawn.
  """
  plt = _pyplot()
  from matplotlib import colors  # pylint: disable=g-import-not-at-top
  probs_LNTT = np.asarray(probs_LNTT, np.float64)
  T = probs_LNTT.shape[-1]
  future = np.triu(np.ones((T, T), bool), 1)
  size = 1.9
  fig, axes = plt.subplots(len(layers), len(heads), squeeze=False,
                           figsize=(size * len(heads) + 1.2,
                                    size * len(layers) + 0.8),
                           layout="constrained")
  norm = colors.LogNorm(vmin=1e-4, vmax=1.0)
  image = None
  for i, l in enumerate(layers):
    for j, n in enumerate(heads):
      ax = axes[i, j]
      a = np.ma.masked_where(future, np.maximum(probs_LNTT[l, n], 1e-30))
      image = ax.imshow(a, norm=norm, cmap="magma", interpolation="nearest")
      ax.set_xticks([])
      ax.set_yticks([])
      if i == 0:
        ax.set_title(f"head {n}", fontsize=8)
      if j == 0:
        ax.set_ylabel(f"layer {l}\nquery", fontsize=8)
      if i == len(layers) - 1:
        ax.set_xlabel("key", fontsize=8)
  fig.colorbar(image, ax=axes, shrink=0.6, label="attention probability")
  fig.suptitle(title, fontsize=9, wrap=True)
  fig.savefig(path, dpi=90)
  plt.close(fig)


def plot_summary(summary: dict, path, *, title: str = ""):
  """Three panels: the first-token sink mass and the entropy of every
  layer / head (one dot per head) against uniform attention (dashed), and
  the mean attention by distance per layer (head mean) against uniform."""
  plt = _pyplot()
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.3))
  k = sorted(summary["sink_mass"], key=int)[0]
  sink = np.asarray(summary["sink_mass"][k], np.float64)
  ent = np.asarray(summary["entropy"], np.float64)
  L, N = sink.shape
  jitter = (np.arange(N) - (N - 1) / 2) * (0.5 / max(N, 1))
  for ax, values, base, label, log in (
      (axes[0], sink, summary["sink_mass_uniform"][k],
       f"attention on the first {k} token{'s' if k != '1' else ''}", True),
      (axes[1], ent, summary["entropy_uniform"], "entropy (nats)", False)):
    for l in range(L):
      ax.scatter(l + jitter, np.maximum(values[l], 1e-12) if log
                 else values[l], s=12, c=np.arange(N), cmap="viridis",
                 vmin=0, vmax=max(N - 1, 1))
    ax.axhline(base, color="k", ls="--", lw=1,
               label=f"uniform causal ({base:.3g})")
    if log:
      ax.set_yscale("log")
    ax.set_xlabel("layer (dots: heads, coloured by index)")
    ax.set_ylabel(label)
    ax.set_xticks(range(L))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
  prof = np.asarray(summary["distance_profile"], np.float64)  # None -> nan
  d = np.arange(prof.shape[-1])
  ax = axes[2]
  cmap = plt.get_cmap("viridis")
  for l in range(L):
    ax.plot(d + 1, np.nanmean(prof[l], axis=0), lw=1.2,
            color=cmap(l / max(L - 1, 1)), label=f"layer {l}")
  ax.plot(d + 1, np.asarray(summary["distance_profile_uniform"], np.float64),
          "k--", lw=1, label="uniform causal")
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("distance + 1 (1: the query itself)")
  ax.set_ylabel("mean attention (mean over heads)")
  ax.legend(fontsize=7, ncol=2)
  ax.grid(alpha=0.3, which="both")
  fig.suptitle(title, fontsize=9, wrap=True)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)

