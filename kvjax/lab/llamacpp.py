"""llama.cpp as a peer on kvjax's own weights (llama-cpp-python, optional).

`LlamaCpp(gguf_path, ...)` drives llama.cpp through llama-cpp-python's
low-level API (llama_batch / llama_decode: the high-level `Llama` class
runs one sequence only), with the shapes kvjax's entry points take:

  logits(ids_T)              [T, V] float32 logits of every position
  generate(ids_BT, new)      [B, new] greedy ids: one prefill of the B
                             prompts, then new − 1 decode steps of B tokens
  tokenize(text)             llama.cpp's token ids of `text` (no specials)

Each call starts from an empty KV cache (`llama_memory_clear`), as
`kvjax.generate` builds a fresh cache. Sequences are llama.cpp sequence ids
0..B−1 in one context of B·capacity slots with a non-unified KV cache (one
stream per sequence: what llama.cpp recommends for independent sequences);
prompts are submitted in chunks of at most `n_batch` tokens (llama.cpp's
default 2048, micro-batches of `n_ubatch` = 512), across sequences.
Greedy selection is an argmax over llama.cpp's float32 logits in numpy,
one [B, V] read per step. The KV cache is float32 by default (`kv_dtype`;
llama.cpp's own default is float16), flash attention off (this binding's
default; with a float32 cache it prefilled 3x slower here). The GGUF file
comes from `kvjax.gguf_export.write_gguf`.

Beside it: `parity` (logits and greedy tokens against kvjax on one
prompt), `compare` (both timed alternately on the same prompts) and `plot`
(tokens/s side by side), which experiments/llamacpp_peer.py runs.

`import_llama_cpp()` returns the module or raises ImportError with the
install line (`pip install -e .[llamacpp]`), so callers can skip cleanly.
It sets OMP_WAIT_POLICY=PASSIVE unless the environment sets a policy:
llama.cpp's CPU backend is built with OpenMP (libgomp), whose threads spin
at every barrier by default; on a host where another process holds a core
(load ~6 on 2 vCPUs here) a 2-thread llama.cpp then decoded the shipped
Austen model at 1.4 tokens/s against ~630 with PASSIVE and ~1000 with one
thread (experiments/llamacpp_peer.py records the policy). libgomp reads
the variable once, when llama.cpp's library is loaded.

Dimension alphabet (`kvjax.config`): B batch, T prompt length, V vocab,
I decode steps.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import numpy as np

INSTALL = "pip install -e '.[llamacpp]' (llama-cpp-python==0.3.16, gguf)"
# ggml_type of the KV cache storage.
GGML_TYPES = {"float32": 0, "float16": 1}
_LOG_SINK = None  # the C callback must outlive every llama.cpp call


def import_llama_cpp():
  """The `llama_cpp` module with llama.cpp's logging silenced.

  Raises:
    ImportError: llama-cpp-python is absent (the message says how to
      install it).
  """
  global _LOG_SINK
  os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
  try:
    import llama_cpp  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(f"llama-cpp-python is not installed ({e}); {INSTALL}"
                      ) from e
  if _LOG_SINK is None:
    _LOG_SINK = llama_cpp.llama_log_callback(lambda level, text, data: None)
    llama_cpp.llama_log_set(_LOG_SINK, ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()
  return llama_cpp


def default_threads() -> int:
  """The cores this process may run on (what XLA:CPU's thread pool uses)."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # not Linux
    return os.cpu_count() or 1


class LlamaCpp:
  """One llama.cpp model and context (module docstring).

  Args:
    gguf_path: a GGUF file (`kvjax.gguf_export.write_gguf`).
    capacity: KV slots per sequence (prompt + generated tokens).
    batch: sequences decoded together (B; llama.cpp's n_seq_max).
    threads: llama.cpp threads for decode and prefill (default: the cores
      this process may use, `default_threads`).
    n_batch, n_ubatch: llama.cpp's logical / physical batch sizes (its
      defaults).
    flash_attn: llama.cpp's flash-attention kernel (off by default in this
      binding).
    kv_dtype: the KV cache's storage, 'float32' (kvjax's default, and what
      the parity tests compare) or 'float16' (llama.cpp's own default).
  Raises:
    ImportError: llama-cpp-python is absent.
    ValueError: a non-positive size, or llama.cpp failed to load the file
      or create the context.
  """

  def __init__(self, gguf_path: str | os.PathLike, *, capacity: int,
               batch: int = 1, threads: int | None = None,
               n_batch: int = 2048, n_ubatch: int = 512,
               flash_attn: bool = False, kv_dtype: str = "float32"):
    if kv_dtype not in GGML_TYPES:
      raise ValueError(f"kv_dtype must be one of {sorted(GGML_TYPES)}, got "
                       f"{kv_dtype!r}")
    for name, v in (("capacity", capacity), ("batch", batch),
                    ("n_batch", n_batch), ("n_ubatch", n_ubatch)):
      if v < 1:
        raise ValueError(f"{name} must be >= 1, got {v}")
    self._lib = lib = import_llama_cpp()
    self.threads = threads or default_threads()
    self.capacity, self.batch, self.n_batch = capacity, batch, n_batch
    self._model = self._ctx = self._batch = None
    mparams = lib.llama_model_default_params()
    mparams.n_gpu_layers = 0
    self._model = lib.llama_model_load_from_file(
        os.fspath(gguf_path).encode(), mparams)
    if not self._model:
      raise ValueError(f"llama.cpp could not load {gguf_path}")
    cparams = lib.llama_context_default_params()
    cparams.n_ctx = capacity * batch
    cparams.n_batch = n_batch
    cparams.n_ubatch = min(n_ubatch, n_batch)
    cparams.n_seq_max = batch
    cparams.n_threads = cparams.n_threads_batch = self.threads
    cparams.flash_attn = flash_attn
    cparams.kv_unified = False
    cparams.type_k = cparams.type_v = GGML_TYPES[kv_dtype]
    self.kv_dtype = kv_dtype
    cparams.no_perf = True
    self._ctx = lib.llama_init_from_model(self._model, cparams)
    if not self._ctx:
      self.close()
      raise ValueError(f"llama.cpp could not create a context (n_ctx="
                       f"{capacity * batch}, n_seq_max={batch})")
    self._vocab = lib.llama_model_get_vocab(self._model)
    self.vocab_size = lib.llama_vocab_n_tokens(self._vocab)
    self._batch = lib.llama_batch_init(n_batch, 0, 1)
    self._np_token = np.ctypeslib.as_array(self._batch.token, (n_batch,))
    self._np_pos = np.ctypeslib.as_array(self._batch.pos, (n_batch,))
    self._np_nseq = np.ctypeslib.as_array(self._batch.n_seq_id, (n_batch,))
    self._np_logits = np.ctypeslib.as_array(self._batch.logits, (n_batch,))
    self._np_nseq[:] = 1
    self._seq_slot = [self._batch.seq_id[i] for i in range(n_batch)]
    self._last_seq = np.full(n_batch, -1, np.int64)

  # ---- lifetime ---------------------------------------------------------------
  def close(self) -> None:
    """Frees the batch, context and model (idempotent)."""
    lib = self._lib
    if self._batch is not None:
      lib.llama_batch_free(self._batch)
      self._batch = None
    if self._ctx:
      lib.llama_free(self._ctx)
      self._ctx = None
    if self._model:
      lib.llama_model_free(self._model)
      self._model = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def __del__(self):
    try:
      self.close()
    except Exception:  # pylint: disable=broad-except
      pass

  # ---- one llama_decode ---------------------------------------------------------
  def _clear(self) -> None:
    self._lib.llama_memory_clear(self._lib.llama_get_memory(self._ctx), True)

  def _decode(self, token, pos, seq, want) -> np.ndarray:
    """One llama_decode of n <= n_batch tokens; returns the float32 logits
    [sum(want), V] of the flagged tokens, in batch order (a view into
    llama.cpp's buffer, valid until the next decode)."""
    n = len(token)
    self._np_token[:n] = token
    self._np_pos[:n] = pos
    self._np_logits[:n] = want
    for i in np.flatnonzero(self._last_seq[:n] != seq):
      self._seq_slot[i][0] = int(seq[i])
    self._last_seq[:n] = seq
    self._batch.n_tokens = n
    rc = self._lib.llama_decode(self._ctx, self._batch)
    if rc != 0:
      raise RuntimeError(f"llama_decode returned {rc} ({n} tokens)")
    n_out = int(np.count_nonzero(want))
    ptr = self._lib.llama_get_logits(self._ctx)
    return np.ctypeslib.as_array(ptr, (n_out, self.vocab_size))

  def _prompt(self, ids_BT: np.ndarray, all_logits: bool) -> np.ndarray:
    """Feeds every prompt (sequence b at positions 0..T−1) in chunks of
    n_batch tokens; returns the logits [B, T, V] (all_logits) or [B, V]
    (last position)."""
    B, T = ids_BT.shape
    token = ids_BT.reshape(-1).astype(np.int32)
    pos = np.tile(np.arange(T, dtype=np.int32), B)
    seq = np.repeat(np.arange(B, dtype=np.int32), T)
    want = np.ones(B * T, np.int8) if all_logits else (pos == T - 1).astype(
        np.int8)
    out = []
    for s in range(0, B * T, self.n_batch):
      e = min(s + self.n_batch, B * T)
      if want[s:e].any():
        out.append(np.array(self._decode(token[s:e], pos[s:e], seq[s:e],
                                         want[s:e])))
      else:
        self._decode(token[s:e], pos[s:e], seq[s:e], want[s:e])
    logits = np.concatenate(out)
    return logits.reshape(B, T, -1) if all_logits else logits

  def _check(self, ids_BT, new: int = 0) -> np.ndarray:
    ids_BT = np.asarray(ids_BT)
    if ids_BT.ndim != 2 or ids_BT.shape[1] < 1:
      raise ValueError(f"ids must be [B, T] with T >= 1, got shape "
                       f"{ids_BT.shape}")
    B, T = ids_BT.shape
    if B > self.batch:
      raise ValueError(f"batch {B} > the context's {self.batch} sequences")
    if T + new > self.capacity:
      raise ValueError(f"prompt {T} + {new} new tokens > capacity "
                       f"{self.capacity}")
    if ids_BT.min() < 0 or ids_BT.max() >= self.vocab_size:
      raise ValueError(f"token ids must lie in [0, {self.vocab_size})")
    return ids_BT

  # ---- the entry points ---------------------------------------------------------
  def logits(self, ids_T) -> np.ndarray:
    """float32 [T, V] logits of every position of one prompt `ids_T` [T]."""
    ids_BT = self._check(np.asarray(ids_T)[None])
    self._clear()
    return self._prompt(ids_BT, all_logits=True)[0]

  def generate(self, ids_BT, new: int) -> np.ndarray:
    """Greedy ids [B, new]: a prefill of the prompts [B, T], then new − 1
    decode steps of one token per sequence (`new` = 1: the prefill only)."""
    if new < 1:
      raise ValueError(f"new must be >= 1, got {new}")
    ids_BT = self._check(ids_BT, new)
    B, T = ids_BT.shape
    self._clear()
    out_BI = np.empty((B, new), np.int32)
    out_BI[:, 0] = self._prompt(ids_BT, all_logits=False).argmax(-1)
    seq = np.arange(B, dtype=np.int32)
    want = np.ones(B, np.int8)
    for i in range(1, new):
      pos = np.full(B, T + i - 1, np.int32)
      out_BI[:, i] = self._decode(out_BI[:, i - 1], pos, seq, want).argmax(-1)
    return out_BI

  def tokenize(self, text: str) -> np.ndarray:
    """llama.cpp's ids of `text` (no BOS/EOS added, specials not parsed)."""
    raw = text.encode("utf-8")
    buf = (self._lib.llama_token * (len(raw) + 8))()
    n = self._lib.llama_tokenize(self._vocab, raw, len(raw), buf, len(buf),
                                 False, False)
    if n < 0:
      raise RuntimeError(f"llama_tokenize needs {-n} slots")
    return np.array(buf[:n], np.int32)

  def piece(self, token: int) -> bytes:
    """The bytes llama.cpp detokenizes `token` to (specials rendered)."""
    buf = ctypes.create_string_buffer(64)
    n = self._lib.llama_token_to_piece(self._vocab, token, buf, len(buf), 0,
                                       True)
    return buf.raw[:n]

  def info(self) -> dict[str, Any]:
    """What the figures were measured with."""
    return dict(threads=self.threads, capacity=self.capacity,
                batch=self.batch, n_batch=self.n_batch,
                kv_dtype=self.kv_dtype,
                omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
                llama_cpp_python=getattr(self._lib, "__version__", None))


# ---- kvjax beside llama.cpp: parity and alternating timing -------------------
def parity(params, config, llm: LlamaCpp, ids_T, check_tokens: int, *,
           rounding: str = "float32") -> dict[str, Any]:
  """llama.cpp against kvjax on one prompt `ids_T` [T]: the largest logit
  difference over every position (float64), the bound `kvjax.tolerance`
  allows (float32 compute, depth L + 1, keys and values rounded to
  `rounding` on llama.cpp's side: 'float16' for its CPU flash-attention
  kernel, which measured 4.6e-3 against kvjax's float32 on random
  gqa-medium where the float32 bound is 1.3e-4), and for how many of
  `check_tokens` greedy tokens the two agree (the first disagreement ends
  the count)."""
  import kvjax  # pylint: disable=g-import-not-at-top
  from kvjax import tolerance  # pylint: disable=g-import-not-at-top
  ids_T = np.asarray(ids_T, np.int32)
  want_TV = np.asarray(kvjax.forward(params, config, ids_T[None])[0])
  got_TV = llm.logits(ids_T)
  err, scale = tolerance.max_error(got_TV, want_TV)
  kv_ids = np.asarray(kvjax.generate(params, config, ids_T[None],
                                     check_tokens))[0]
  cpp_ids = llm.generate(ids_T[None], check_tokens)[0]
  return dict(max_logit_diff=err, logit_scale=scale,
              logit_bound=tolerance.tolerance(config,
                                              cache=rounding).atol(scale),
              rounding=rounding,
              positions=int(ids_T.size),
              greedy_agree=int(np.cumprod(kv_ids == cpp_ids).sum()),
              greedy_checked=check_tokens)


def compare(params, config, llm: LlamaCpp, ids_BT, new_tokens: int, *,
            repeats: int, warmup: int = 1) -> dict[str, Any]:
  """kvjax and llama.cpp timed alternately (`benchmarking.time_alternating`:
  kvjax generate, kvjax prefill, llama.cpp generate, llama.cpp prefill,
  order rotated each round) on the prompts `ids_BT` [B, T].

  Both sides use the same definitions (as experiments/peer_benchmark.py):
  prefill = a generate of one token; decode tokens/s = B·(new − 1) /
  (t_generate − t_prefill) (medians; `round_rates` per round); prefill
  tokens/s = B·T / t_prefill. kvjax runs `kvjax.generate` on the params
  as given (it lays them out for decode itself) with `bucket=False`, so it
  prefills exactly the T tokens llama.cpp does (a benchmark case has one
  prompt length: the power-of-two padding that spares recompiles would
  only add work, 6.7% at T = 7680), and a cache of
  `default_capacity(T, new)` slots; llama.cpp runs `LlamaCpp.generate`.

  Returns:
    A JSON-able row: per side `{side}_decode_tokens_per_s` (+ `_rounds`),
    `{side}_prefill_tokens_per_s`, `{side}_prefill_s`, the timings, and
    `decode_ratio` / `prefill_ratio` = kvjax / llama.cpp with the rounds'
    spread.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import kvjax  # pylint: disable=g-import-not-at-top
  from kvjax import inference  # pylint: disable=g-import-not-at-top
  from kvjax.lab import benchmarking as bm  # pylint: disable=g-import-not-at-top
  ids_BT = np.asarray(ids_BT, np.int32)
  B, T = ids_BT.shape
  N = new_tokens
  ids_j = jax.numpy.asarray(ids_BT)
  cap = inference.default_capacity(T, N)
  fns = {
      "kvjax_generate": lambda: kvjax.generate(params, config, ids_j, N,
                                               capacity=cap, bucket=False),
      "kvjax_prefill": lambda: kvjax.generate(params, config, ids_j, 1,
                                              capacity=cap, bucket=False),
      "llamacpp_generate": lambda: (llm.generate(ids_BT, N), None)[1],
      "llamacpp_prefill": lambda: (llm.generate(ids_BT, 1), None)[1],
  }
  t = bm.time_alternating(fns, warmup=warmup, repeats=repeats)
  row = dict(batch=B, prompt_len=T, new_tokens=N, kvjax_capacity=cap,
             timings={name: timing.to_dict() for name, timing in t.items()})
  rates = {}
  for side in ("kvjax", "llamacpp"):
    gen, pre = t[f"{side}_generate"], t[f"{side}_prefill"]
    row[f"{side}_decode_tokens_per_s"] = B * (N - 1) / (gen.median -
                                                         pre.median)
    rates[side] = bm.round_rates(gen, pre, B * (N - 1))
    row[f"{side}_decode_tokens_per_s_rounds"] = rates[side]
    row[f"{side}_prefill_s"] = pre.median
    row[f"{side}_prefill_tokens_per_s"] = B * T / pre.median
  row["decode_ratio"] = (row["kvjax_decode_tokens_per_s"] /
                         row["llamacpp_decode_tokens_per_s"])
  rounds = bm.paired_ratios(rates["kvjax"], rates["llamacpp"])
  row["decode_ratio_rounds"] = rounds
  row["decode_ratio_spread"] = bm.spread(rounds)
  row["prefill_ratio"] = (row["kvjax_prefill_tokens_per_s"] /
                          row["llamacpp_prefill_tokens_per_s"])
  return row


def plot(results: dict[str, Any], path) -> None:
  """Side-by-side bars of kvjax and llama.cpp tokens/s for every measured
  case: decode (left; whiskers: the rounds' quartiles) and prefill
  (right); labels: kvjax / llama.cpp. `results` as llamacpp_peer.json."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  from kvjax.lab import benchmarking as bm  # pylint: disable=g-import-not-at-top
  rows = results["rows"]
  labels = [f"{r['model']}\nB{r['batch']} T{r['prompt_len']}" for r in rows]
  x = np.arange(len(rows))
  fig, axes = plt.subplots(1, 2, figsize=(max(10, 2.2 * len(rows) + 2), 4.5))
  names = {"kvjax": "kvjax", "llamacpp": "llama.cpp"}
  for ax, what in zip(axes, ("decode", "prefill")):
    for i, side in enumerate(names):
      h = np.array([r[f"{side}_{what}_tokens_per_s"] for r in rows])
      yerr = None
      if what == "decode":
        q = [bm.spread(r[f"{side}_decode_tokens_per_s_rounds"])
             for r in rows]
        yerr = np.array([[max(v - s["q1"], 0), max(s["q3"] - v, 0)]
                         for v, s in zip(h, q)]).T
      ax.bar(x + 0.4 * i - 0.2, h, 0.4, yerr=yerr, capsize=3,
             label=names[side])
    for xi, r in zip(x, rows):
      top = max(r[f"kvjax_{what}_tokens_per_s"],
                r[f"llamacpp_{what}_tokens_per_s"])
      ax.annotate(f"{r[what + '_ratio']:.2f}×", (xi, top), ha="center",
                  va="bottom", fontsize=8, xytext=(0, 6),
                  textcoords="offset points")
    ax.set(xticks=x, yscale="log",
           ylabel=f"{what} tokens/s (higher is better)",
           title=f"{what} (medians of {results['repeats']} rounds, "
           f"{results['long_repeats']} at long contexts)")
    ax.title.set_fontsize(9)
    ax.set_xticklabels(labels, fontsize=7)
    ax.margins(y=0.15)
    ax.legend(fontsize=8)
  fig.suptitle(f"kvjax vs llama.cpp on the same weights (f32 weights and "
               f"KV cache, {results['threads']} threads each, alternating "
               f"rounds); labels: kvjax / llama.cpp\n{results['cpu']}, "
               f"commit {results['revision']['head']}", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
