r"""Benchmarks: what the KV cache costs and saves, measured on this machine.

  python experiments/benchmark.py --config=configs/model.py:gqa-medium \
      --modes=positions,variants,roofline,memory,quant,sweep --workdir=/tmp/b

Modes (each writes <mode>.json and, where it plots, <mode>.png to --workdir):
  positions  per-step decode latency against position, with and without the
             cache, and the total time to generate --new_tokens (issue 2).
  variants   decode per-step latency and tokens/s of MLA naive vs absorbed vs
             GQA / MHA / MQA at equal width, at --positions (issue 3).
  roofline   this machine's read bandwidth and matmul peak, then for every
             variant the bytes a batch-1 decode step must read and the FLOPs
             of a batch × 128 prefill, as fractions of the measured limits;
             compile times of prefill and decode at depth L and 2L.
  memory     peak resident memory of a generate run against params + cache +
             largest activation (run first: it reads the process's RSS).
  quant      per kv_dtype: bytes per token (formula and real nbytes), max
             decode-logit error against float32, perplexity on a trained
             byte-level model (--trained; needs the corpus), decode
             tokens/s at long context (--quant_batch × --quant_context).
  sweep      decode step time against context length and batch for every
             variant and kv_dtype (the cache-dominated regime), the kinds
             and the read probe timed in alternating rounds per point;
             then per point the cache's own read rate (Δ bytes / Δ time
             against the shortest context: the step less its fixed part),
             and the same Δ as attention FLOPs against a matmul probe taken
             before each point: the arithmetic intensity, the roof that
             binds (bytes or FLOPs) and the share of it reached. A step is
             a steady one: loops of --sweep_steps and twice as many steps
             in the same rounds, their difference (a segment's copy of its
             cache in and out, paid once per generate segment, printed
             apart).
  fixed      what a decode step costs besides its cache, per variant and
             --fixed_batches: the step at a nearly empty cache, each weight
             product timed alone as the packed layout runs it, and the read
             probe, in the same rounds (`kvjax.lab.benchmarking.fixed_part`).
  ppl        only the perplexity part of `quant`.

Multi-variant modes build `model_dict(variant, size)` for the preset's size.
All logic lives in `kvjax.lab.benchmarking`; this file only sequences.

Every measurement is printed on stdout as it is taken ([done/total]) and
appended to <mode>.jsonl in --workdir, so a stopped run keeps what it
measured; <mode>.json (and the plot) are written when the mode finishes.
"""

import json
import os
import statistics

from absl import flags
import jax
import jax.numpy as jnp

import kvjax
from kvjax.lab import benchmarking as bm
from kvjax import cli
from kvjax import configs as cfg_lib
from kvjax import data
from kvjax import inference
from kvjax import native_attention
from configs import model as model_presets

MODES = ("memory", "positions", "variants", "roofline", "quant", "sweep",
         "fixed", "ppl")
KV_DTYPES = ("float32", "bfloat16", "int8")

_CONFIG = cli.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs",
                           "model.py:gqa-small"),
    "Model preset (configs/model.py:<variant>-<size>); the multi-variant "
    "modes take its size.", presets=model_presets.PRESETS)
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/kvjax_benchmark",
                               "Where JSON, JSON-lines and PNG files go.")
_MODES = cli.DEFINE_choice_list("modes", ["positions"], MODES,
                                "Modes to run (see the module docstring).")
_VARIANTS = cli.DEFINE_choice_list("variants", list(model_presets.VARIANTS),
                                   model_presets.VARIANTS,
                                   "Variants for the multi-variant modes.")
_POSITIONS = cli.DEFINE_int_list("positions", [128, 256, 512, 1024, 2048],
                                 "Cached tokens at which a step is timed.",
                                 lower_bound=0)
_BATCH = flags.DEFINE_integer("batch", 1, "Batch for positions / variants.",
                              lower_bound=1)
_PROMPT = flags.DEFINE_integer("prompt_len", 128, "Prompt length.",
                               lower_bound=1)
_NEW = flags.DEFINE_integer("new_tokens", 512,
                            "Tokens generated in the total-time comparison.",
                            lower_bound=1)
_NO_CACHE = flags.DEFINE_bool("no_cache", True,
                              "Also time the no-cache baseline (slow).")
_NO_CACHE_TOTAL = flags.DEFINE_bool(
    "no_cache_total", True,
    "Also time generating --new_tokens without the cache (one long run).")
_STEPS = flags.DEFINE_integer("steps", 8, "Decode steps per timed loop.",
                              lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed repeats (medians).",
                                lower_bound=1)
_PREFILL_BATCH = flags.DEFINE_integer("prefill_batch", 8,
                                      "Batch of the roofline prefill.",
                                      lower_bound=1)
_TRAINED = flags.DEFINE_string(
    "trained", "", "kvjax training workdir (a byte-level model) for the "
    "perplexity of quant / ppl, e.g. checkpoints/austen-gqa.")
_DATA_DIR = flags.DEFINE_string(
    "data_dir", None, "Austen corpus for perplexity (default: "
    "$KVJAX_DATA_DIR, else the user's cache directory).")
_PPL_TOKENS = flags.DEFINE_integer("ppl_tokens", 2048,
                                   "Validation tokens scored for perplexity.",
                                   lower_bound=1)
_PPL_WINDOW = flags.DEFINE_integer(
    "ppl_window", 256, "Tokens per scored row (the trained context length: "
    "a byte model trained on 256-byte windows degrades beyond them).",
    lower_bound=2)
_QUANT_BATCH = flags.DEFINE_integer("quant_batch", 16, "Long-context batch.",
                                    lower_bound=1)
_QUANT_CONTEXT = flags.DEFINE_integer("quant_context", 4096,
                                      "Long-context cached tokens.",
                                      lower_bound=0)
_SWEEP_CONTEXTS = cli.DEFINE_int_list(
    "sweep_contexts", [256, 512, 1024, 2048, 4096, 8192],
    "Context lengths of the sweep.", lower_bound=0)
_SWEEP_BATCHES = cli.DEFINE_int_list("sweep_batches", [1, 8],
                                     "Batches of the sweep.", lower_bound=1)
_SWEEP_DTYPES = cli.DEFINE_choice_list(
    "sweep_dtypes", list(KV_DTYPES), bm.CACHE_KINDS,
    "Cache kinds of the sweep (the first is the baseline of its speed-ups): "
    "kv dtypes (float32, bfloat16, float16, int8, int4, int2) or "
    "int8-kivi / int4-kivi / int2-kivi (KIVI: per-channel keys at 8 / 4 / "
    "2 bits).")
_FIXED_BATCHES = cli.DEFINE_int_list(
    "fixed_batches", [1, 8], "Batches of the fixed-part profile.",
    lower_bound=1)
_SWEEP_STEPS = flags.DEFINE_integer(
    "sweep_steps", 16, "Decode steps per timed loop of the sweep (each kind "
    "also runs loops of twice as many: the steady step is the difference).",
    lower_bound=1)


def _size() -> str:
  return _CONFIG.value.preset.partition("-")[2] or "medium"


def _variant_config(variant: str, **overrides) -> kvjax.ModelConfig:
  return kvjax.ModelConfig.from_dict(
      dict(model_presets.model_dict(variant, _size()), **overrides))


def _params(config):
  """Params as `init_params` returns them: the inference entry points lay
  them out for decode themselves (`kvjax.packed.for_decode`)."""
  return jax.block_until_ready(kvjax.init_params(config, jax.random.key(0)))


def _prompt(config, batch, length):
  return jax.random.randint(jax.random.key(1), (batch, length), 0,
                            config.vocab_size)


class _Partial:
  """One mode's measurements as they are taken: `[done/total] text` on
  stdout and the record appended to <mode>.jsonl."""

  def __init__(self, mode: str, total: int):
    self._lines = cli.JsonLines(os.path.join(_WORKDIR.value, f"{mode}.jsonl"))
    self._done, self._total = 0, total

  def __call__(self, record, text: str) -> None:
    self._done += 1
    self._lines.write(record)
    print(f"[{self._done}/{self._total}] {text}", flush=True)

  def close(self):
    self._lines.close()


def _save(name: str, result, plot=None):
  """Writes <name>.json (and <name>.png with `plot(result, path)`)."""
  os.makedirs(_WORKDIR.value, exist_ok=True)
  path = os.path.join(_WORKDIR.value, f"{name}.json")
  with open(path, "w") as f:
    json.dump(result, f, indent=1, default=float)
  written = [path]
  if plot is not None:
    written.append(os.path.join(_WORKDIR.value, f"{name}.png"))
    plot(result, written[-1])
  print(f"wrote {', '.join(written)}", flush=True)


# ---- memory -----------------------------------------------------------------
def run_memory(config):
  """Peak memory of a generate run vs params + cache + largest activation.

  Two definitions, both reported:
    compiled  XLA's buffer assignment of the generate program (arguments,
              temporaries, outputs less donated aliases): what the run
              needs on any device.
    rss       the process's peak resident set while generate runs, above a
              baseline taken after the JAX runtime started (a warm-up jit)
              and before the params exist; the executables of the
              programs that built the params (init, packing) are dropped
              and the allocator's free pages returned before the measured
              regions (weight init leaves its temporaries there
              otherwise). First run = compile + run; second run = the
              compiled program alone; the generate programs' own
              executables are measured after it and reported.
  """
  B, T, N = _BATCH.value, _PROMPT.value, _NEW.value
  jax.block_until_ready(jax.jit(lambda x: x + 1)(jnp.zeros(8)))  # runtime up
  bm.release_free_memory()
  base = bm.current_rss_bytes()
  params = _params(config)
  tokens = _prompt(config, B, T)
  cap = inference.default_capacity(inference.bucket_length(T), N)
  # The programs that built the weights and prompt (random init, packing)
  # are no part of a generate run, and a checkpoint load would not leave
  # them behind: drop their executables before the measured regions.
  setup_executables = bm.executables_rss_bytes()
  held = bm.current_rss_bytes() - base
  with bm.PeakRSS() as first:  # compile + run
    jax.block_until_ready(kvjax.generate(params, config, tokens, N))
  bm.release_free_memory()
  with bm.PeakRSS() as second:  # run only (compiled)
    jax.block_until_ready(kvjax.generate(params, config, tokens, N))
  # What the generate run's compiled programs hold (code and runtime
  # state): the resident memory that dropping them frees.
  executables = bm.executables_rss_bytes()
  # After the RSS regions: the AOT compile would add a second executable.
  compiled = bm.compiled_memory(inference.lower_generate(params, config,
                                                         tokens, N))
  p_bytes = bm.param_bytes(params)
  c_bytes = bm.tree_bytes(jax.eval_shape(
      lambda: kvjax.init_cache(config, B, cap)))
  act = bm.largest_activation_bytes(config, B, inference.bucket_length(T))
  model_bytes = p_bytes + c_bytes + act
  out = dict(batch=B, prompt_len=T, new_tokens=N, capacity=cap,
             rss_baseline=base, rss_held_before_generate=held,
             setup_executables_rss=setup_executables,
             params_bytes=p_bytes, cache_bytes=c_bytes,
             largest_activation_bytes=act, model_bytes=model_bytes,
             compiled=compiled,
             compiled_ratio=compiled["peak"] / model_bytes,
             first_run=first.to_dict(), second_run=second.to_dict(),
             first_run_ratio=(first.peak - base) / model_bytes,
             second_run_ratio=(second.peak - base) / model_bytes,
             executables_rss=executables,
             executables_ratio=executables / model_bytes,
             second_run_ratio_without_executables=(
                 second.peak - base - executables) / model_bytes)
  print("memory: params %.1f MB cache %.1f MB act %.1f MB = %.1f MB; "
        "XLA program peak %.1f MB = %.2fx (temporaries %.1f MB); "
        "RSS above the runtime baseline: held %.1f MB before "
        "generate (after dropping %.1f MB of init/packing "
        "executables), peak first run (incl. compile) %.1f MB = %.2fx, "
        "second run %.1f MB = %.2fx, of which the compiled "
        "executables hold %.1f MB (%.2fx; %.2fx without them)" % (
            p_bytes / 1e6, c_bytes / 1e6,
            act / 1e6, model_bytes / 1e6, compiled["peak"] / 1e6,
            out["compiled_ratio"], compiled["temporaries"] / 1e6,
            held / 1e6, setup_executables / 1e6,
            (first.peak - base) / 1e6, out["first_run_ratio"],
            (second.peak - base) / 1e6, out["second_run_ratio"],
            executables / 1e6, out["executables_ratio"],
            out["second_run_ratio_without_executables"]), flush=True)
  _save("memory", out)


# ---- positions (issue 2) ----------------------------------------------------
def run_positions(config):
  params = _params(config)
  B, R = _BATCH.value, _REPEATS.value
  with_total = 1 + (_NO_CACHE.value and _NO_CACHE_TOTAL.value)
  report = _Partial("positions", len(_POSITIONS.value) + with_total)
  rows = []
  for pos in _POSITIONS.value:
    row = dict(position=pos, cached=bm.decode_step_seconds(
        params, config, B, pos, steps=_STEPS.value, repeats=R))
    if _NO_CACHE.value:
      row["no_cache"] = bm.no_cache_step_seconds(params, config, B, pos,
                                                 repeats=max(2, R // 2))
    report(row, "position %5d: cached %.2f ms/step%s" % (
        pos, 1e3 * row["cached"]["step_s"],
        (" | no cache %.1f ms/step" % (1e3 * row["no_cache"]["step_s"])
         if "no_cache" in row else "")))
    rows.append(row)
  tokens = _prompt(config, B, _PROMPT.value)
  gen = bm.generate_seconds(params, config, tokens, _NEW.value,
                            repeats=max(1, R // 2))
  total = dict(new_tokens=_NEW.value, cached_s=gen.median,
               cached=gen.to_dict())
  report(dict(total=total), "generate %d tokens with the cache: %.2f s" % (
      _NEW.value, gen.median))
  if _NO_CACHE.value and _NO_CACHE_TOTAL.value:
    nc = bm.no_cache_generate_seconds(params, config, tokens, _NEW.value)
    total.update(no_cache_s=nc["total_s"], no_cache=nc,
                 speedup=nc["total_s"] / gen.median)
    report(dict(total=total),
           "generate %d tokens without the cache: %.1f s (compile %.1f s "
           "excluded): cache is %.1fx faster" % (
               _NEW.value, nc["total_s"], nc["compile_s"], total["speedup"]))
  report.close()
  c0, c1 = rows[0]["cached"]["step_s"], rows[-1]["cached"]["step_s"]
  out = dict(preset=_CONFIG.value.preset, batch=B, prompt_len=_PROMPT.value,
             rows=rows, total=total,
             cached_last_over_first=c1 / c0, machine=bm.machine_info())
  print("cached step at position %d / at %d: %.2fx" % (
      rows[-1]["position"], rows[0]["position"], c1 / c0), flush=True)
  _save("positions", out, bm.plot_positions)


# ---- variants (issue 3) -----------------------------------------------------
def _variant_rows():
  """(label, config) for every requested variant; MLA twice (naive and
  absorbed decode)."""
  rows = []
  for v in _VARIANTS.value:
    if model_presets.model_dict(v, _size())["attention"] == "mla":
      for path in ("naive", "absorbed"):
        c = _variant_config(v, mla_decode=path)
        rows.append((f"{c.variant}-{path}", c))
    else:
      c = _variant_config(v)
      rows.append((c.variant, c))
  return rows


def run_variants():
  B, R = _BATCH.value, _REPEATS.value
  positions = _POSITIONS.value
  out = dict(size=_size(), batch=B, positions=positions, variants={})
  variant_rows = _variant_rows()
  report = _Partial("variants", len(variant_rows) * len(positions))
  for label, config in variant_rows:
    params = _params(config)
    steps = []
    for p in positions:
      steps.append(bm.decode_step_seconds(params, config, B, p,
                                          steps=_STEPS.value, repeats=R))
      report(dict(variant=label, position=p, **steps[-1]),
             "%-13s @%d: %.2f ms/step (%.0f tok/s)" % (
                 label, p, 1e3 * steps[-1]["step_s"],
                 steps[-1]["tokens_per_s"]))
    out["variants"][label] = dict(
        kv_bytes_per_token=kvjax.kv_bytes_per_token(config),
        params=kvjax.param_count(config), steps=steps)
    del params
  report.close()
  _save("variants", out, bm.plot_variants)


# ---- roofline (issue 7.2) ---------------------------------------------------
def probe_machine():
  limits = dict(read=bm.read_bandwidth(), triad=bm.triad_bandwidth(),
                matvec=bm.matvec_bandwidth(), matmul_f32=bm.matmul_peak(),
                matmul_bf16=bm.matmul_peak(dtype="bfloat16"))
  print("machine: read %.1f GB/s, triad %.1f GB/s, matvec %.1f GB/s, "
        "matmul f32 %.0f GFLOP/s, bf16 (f32 acc.) %.0f GFLOP/s" % (
            limits["read"]["bytes_per_s"] / 1e9,
            limits["triad"]["bytes_per_s"] / 1e9,
            limits["matvec"]["bytes_per_s"] / 1e9,
            limits["matmul_f32"]["flops_per_s"] / 1e9,
            limits["matmul_bf16"]["flops_per_s"] / 1e9), flush=True)
  return limits


LAYOUTS = ("canonical", "packed")


def compile_times(config, batch, length, layout):
  """Prefill and decode compile seconds at depth L and 2L (no allocation:
  the programs are lowered from shapes) for the canonical params (the layer
  scan) or the decode layout (`kvjax.pack`: layers unrolled)."""
  out = {}
  for depth in (config.num_layers, 2 * config.num_layers):
    c = config.replace(num_layers=depth)
    params = jax.eval_shape(lambda c=c: kvjax.init_params(c,
                                                          jax.random.key(0)))
    if layout == "packed":
      params = jax.eval_shape(lambda p, c=c: kvjax.pack(p, c), params)
    cache = jax.eval_shape(lambda c=c: kvjax.init_cache(c, batch, 2 * length))
    tok = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    mask = jax.ShapeDtypeStruct((batch, length), jnp.bool_)
    out[depth] = dict(
        prefill=bm.compile_seconds(inference._prefill, params, c, tok, mask,  # pylint: disable=protected-access
                                   cache, False),
        decode=bm.compile_seconds(inference._decode, params, c,  # pylint: disable=protected-access
                                  jax.ShapeDtypeStruct((batch,), jnp.int32),
                                  cache))
  return out


def run_roofline():
  limits = probe_machine()
  read_bw = limits["read"]["bytes_per_s"]
  matvec_bw = limits["matvec"]["bytes_per_s"]
  peak = limits["matmul_f32"]["flops_per_s"]
  T, PB = _PROMPT.value, _PREFILL_BATCH.value
  out = dict(size=_size(), limits=limits, machine=bm.machine_info(),
             variants={})
  variant_rows = _variant_rows()
  report = _Partial("roofline", len(variant_rows))
  for label, config in variant_rows:
    params = _params(config)
    dec = bm.decode_step_seconds(params, config, 1, T, steps=_STEPS.value,
                                 repeats=_REPEATS.value)
    need = bm.decode_bytes_per_step(params, config, 1, T + 1)
    achieved_bw = need["total"] / dec["step_s"]
    pre = bm.prefill_seconds(params, config, PB, T, repeats=_REPEATS.value)
    flops = bm.prefill_flops(config, PB, T)
    achieved_flops = flops["total"] / pre["prefill_s"]
    row = dict(decode=dec, decode_bytes=need,
               decode_bytes_per_s=achieved_bw,
               decode_fraction_of_read=achieved_bw / read_bw,
               decode_fraction_of_matvec=achieved_bw / matvec_bw,
               prefill=pre, prefill_flops=flops,
               prefill_flops_per_s=achieved_flops,
               prefill_fraction_of_peak=achieved_flops / peak,
               compile={lay: compile_times(config, 1, T, lay)
                        for lay in LAYOUTS})
    out["variants"][label] = row
    report(dict(variant=label, **row), (
        "%-13s decode b1@%d: %.2f ms, %.1f MB/step -> %.1f GB/s = %.0f%% of "
        "read, %.0f%% of matvec | prefill %dx%d: %.1f ms, %.1f GFLOP -> %.0f "
        "GFLOP/s = %.0f%% of peak | compile prefill/decode, canonical L=%d: "
        "%.1f/%.1f s, 2L: %.1f/%.1f s; packed L: %.1f/%.1f s, 2L: "
        "%.1f/%.1f s") % (
            label, T, 1e3 * dec["step_s"], need["total"] / 1e6,
            achieved_bw / 1e9, 100 * row["decode_fraction_of_read"],
            100 * row["decode_fraction_of_matvec"], PB, T,
            1e3 * pre["prefill_s"], flops["total"] / 1e9,
            achieved_flops / 1e9, 100 * row["prefill_fraction_of_peak"],
            config.num_layers,
            *[row["compile"][lay][d][k]["total_s"]
              for lay in LAYOUTS
              for d in sorted(row["compile"][lay])
              for k in ("prefill", "decode")]))
    del params
  report.close()
  _save("roofline", out)


# ---- quantized caches (issue 7.4) -------------------------------------------
def _perplexity(kv_dtypes, mode):
  """Validation perplexity of a trained model read token by token through a
  cache of each kv dtype (None when no model is given)."""
  if not _TRAINED.value:
    return None
  from kvjax.lab import job, streaming  # pylint: disable=g-import-not-at-top
  loaded = job.load_model(trained=_TRAINED.value)
  docs = data.split_documents(data.load_austen(_DATA_DIR.value)).validation
  W = _PPL_WINDOW.value
  rows = max(1, _PPL_TOKENS.value // W)
  stream = data.documents_to_stream(docs)[:rows * W].reshape(rows, W)
  out = {}
  report = _Partial(f"{mode}_perplexity", len(kv_dtypes))
  for dt in kv_dtypes:
    cache = kvjax.init_cache(loaded.config, rows, W,
                             policy=bm.cache_policy(dt))
    nll, _ = streaming.stream_nll(loaded.params, loaded.config, stream, cache)
    out[dt] = streaming.perplexity(nll)
    report(dict(kv_dtype=dt, perplexity=out[dt]),
           "perplexity (%s, %d rows x %d tokens) with a %s cache: %.4f" % (
               loaded.source, rows, W, dt, out[dt]))
  report.close()
  return dict(source=loaded.source, rows=rows, window=W,
              tokens=rows * (W - 1), by_dtype=out)


def run_quant():
  from kvjax.lab import streaming  # pylint: disable=g-import-not-at-top
  out = dict(size=_size(), variants={},
             long_context=dict(batch=_QUANT_BATCH.value,
                               context=_QUANT_CONTEXT.value))
  variant_rows = _variant_rows()
  dtypes = bm.CACHE_KINDS
  report = _Partial("quant", len(variant_rows) * len(dtypes))
  for label, config in variant_rows:
    params = _params(config)
    tokens = _prompt(config, 2, 64)
    logits = {}
    for dt in dtypes:
      cache = kvjax.init_cache(config, 2, 64, policy=bm.cache_policy(dt))
      _, cache = kvjax.prefill(params, config, tokens[:, :32], cache)
      logits[dt], _ = streaming.decode_tokens(params, config, tokens[:, 32:],
                                              cache)
    rows = {}
    for dt in dtypes:
      policy = bm.cache_policy(dt)
      group = policy.key_group if policy.channel_keys else 0
      real = kvjax.cache_bytes(kvjax.init_cache(
          config, 1, max(group, 1), policy=policy))["kv"] / max(group, 1)
      speed = bm.decode_step_seconds(
          params, config, _QUANT_BATCH.value, _QUANT_CONTEXT.value,
          steps=4, repeats=3, kv_dtype=dt)
      rows[dt] = dict(
          bytes_per_token=kvjax.kv_bytes_per_token(
              config, policy.kv_dtype, key_group=group),
          real_nbytes_per_token=real,
          max_logit_error=float(jnp.max(jnp.abs(logits[dt] -
                                                logits["float32"]))),
          long_context=speed)
      report(dict(variant=label, kv_dtype=dt, **rows[dt]),
             "%-13s %-9s %6g B/token (real %6g), max |dlogit| %.2e, "
             "b%d@%d: %.1f ms/step %.0f tok/s" % (
                 label, dt, rows[dt]["bytes_per_token"], real,
                 rows[dt]["max_logit_error"], _QUANT_BATCH.value,
                 _QUANT_CONTEXT.value, 1e3 * speed["step_s"],
                 speed["tokens_per_s"]))
    out["variants"][label] = rows
    del params
  report.close()
  out["perplexity"] = _perplexity(bm.CACHE_KINDS, "quant")
  _save("quant", out)


# ---- sweep (issue 7.6) ------------------------------------------------------
def run_sweep():
  contexts, batches = _SWEEP_CONTEXTS.value, _SWEEP_BATCHES.value
  kinds = _SWEEP_DTYPES.value
  out = dict(size=_size(), contexts=contexts, batches=batches, kinds=kinds,
             steps=_SWEEP_STEPS.value, rows=[], machine=bm.machine_info())
  configs = [(label, c) for label, c in _variant_rows()
             if not label.endswith("naive")]
  times = (native_attention.bf16_product_times()
           if native_attention.preferred() else {})
  if times.get("dot_ns"):  # measured: the host has AVX-512 BF16
    out["bf16_products"] = times
    print("native kernel, bfloat16 products per 16 lanes: vdpbf16ps %.3f ns,"
          " multiply-adds %.3f ns -> %s" % (
              times["dot_ns"], times["fma_ns"],
              "vdpbf16ps" if times["dot"] else "multiply-adds"))
  report = _Partial("sweep", len(configs) * len(kinds) * len(batches) *
                    len(contexts))
  for label, config in configs:
    params = _params(config)
    for B in batches:
      for ctx in contexts:
        # The FLOP ceiling beside the read probe: the attention's roof
        # where its products, not its bytes, bind (MQA's and MLA's).
        flop_probe = bm.matmul_peak(2048, warmup=1, repeats=3)["flops_per_s"]
        timed = bm.decode_steps_alternating(
            params, config, B, ctx, kinds, steps=_SWEEP_STEPS.value,
            repeats=_REPEATS.value, probe_bytes=1 << 29, steady=True)
        probe = timed.pop("read_probe")["bytes_per_s"]
        flops = bm.decode_flops_per_step(config, B, ctx + 1)
        for kind, t in timed.items():
          need = bm.decode_bytes_per_step(params, config, B, ctx + 1, kind)
          row = dict(variant=label, kv_dtype=kind, batch=B, context=ctx,
                     bytes=need, flops=flops,
                     attention_flops=flops["attention"],
                     flop_probe=flop_probe, **t)
          row["read_probe"] = probe
          row["of_read_probe"] = need["total"] / t["step_s"] / probe
          row["roofline"] = bm.roofline(need["total"], flops["total"],
                                        t["step_s"], probe, flop_probe)
          out["rows"].append(row)
          report(row, "%-13s %-9s b%-3d ctx %5d: %7.2f ms/step (%s), "
                 "%5.2fx %s (%s), cache %3.0f%% of %6.1f MB,"
                 " %3.0f%% of the read probe; %4.1f FLOP/byte: %s-bound, "
                 "%3.0f%% of that roof" % (
                     label, kind, B, ctx, 1e3 * t["step_s"],
                     "segment copy %.1f ms" % (1e3 * t["segment_s"])
                     if t["steady"] else "not steady: the loop / steps",
                     t["vs_first"], kinds[0],
                     t["layout"], 100 * need["cache"] / need["total"],
                     need["total"] / 1e6, 100 * row["of_read_probe"],
                     row["roofline"]["intensity"], row["roofline"]["bound"],
                     100 * row["roofline"]["of_roofline"]))
    del params
  report.close()
  # The cache's own read rate per point (against the shortest context of
  # its variant, kind and batch): the step minus its fixed part.
  out["rows"] = bm.cache_read_rates(out["rows"])
  for r in out["rows"]:
    if "cache_read_error" in r:
      print("no cache read rate: " + r["cache_read_error"])
    if "cache_read" in r:
      c = r["cache_read"]
      print("%-13s %-9s b%-3d ctx %5d: cache read at %5.1f GB/s, %3.0f%% of "
            "the read probe (fixed part %.2f ms, from ctx %d); attention "
            "%5.1f GFLOP/s, %3.0f%% of the matmul probe; %4.1f FLOP/byte "
            "(ridge %4.1f): %s-bound, %3.0f%% of that roof" % (
                r["variant"], r["kv_dtype"], r["batch"], r["context"],
                c["bytes_per_s"] / 1e9, 100 * c["of_read_probe"],
                1e3 * c["fixed_s"], c["from_context"], c["flops_per_s"] / 1e9,
                100 * c["of_flop_probe"], c["intensity"], c["ridge"],
                c["bound"], 100 * c["of_roofline"]))
  # The figure's probe line: the median of the points' own probes.
  out["read_probe"] = dict(bytes_per_s=statistics.median(
      r["read_probe"] for r in out["rows"]))
  _save("sweep", out, bm.plot_sweep)


# ---- fixed part -------------------------------------------------------------
def run_fixed():
  out = dict(size=_size(), batches=_FIXED_BATCHES.value, rows=[],
             machine=bm.machine_info())
  configs = [(label, c) for label, c in _variant_rows()
             if not label.endswith("naive")]
  report = _Partial("fixed", len(configs) * len(_FIXED_BATCHES.value))
  for label, config in configs:
    params = _params(config)
    for B in _FIXED_BATCHES.value:
      r = dict(variant=label, **bm.fixed_part(params, config, B,
                                              repeats=_REPEATS.value))
      probe = r["read_probe"]["bytes_per_s"]
      lines = ["%-13s b%-3d step %.2f ms at %d cached slots (%s): weights "
               "%.1f MB, %.2f ms at the read probe's %.1f GB/s; products "
               "%.2f ms, the rest %.2f ms" % (
                   label, B, 1e3 * r["step_s"], r["capacity"], r["layout"],
                   r["weight_bytes"] / 1e6, 1e3 * r["weights_at_probe_s"],
                   probe / 1e9, 1e3 * r["products_s"], 1e3 * r["rest_s"])]
      for p in r["products"]:
        lines.append("    %-10s %-13s x%-2d %7.3f ms  %5.1f GB/s (%3.0f%% of "
                     "the probe)  %5.1f G multiply-adds/s" % (
                         p["name"], "x".join(map(str, p["shape"])),
                         p["count"], 1e3 * p["s"], p["bytes_per_s"] / 1e9,
                         100 * p["of_read_probe"], p["macs_per_s"] / 1e9))
      out["rows"].append(r)
      report(r, "\n".join(lines))
    del params
  report.close()
  _save("fixed", out)


def _check_perplexity(modes):
  """Perplexity's inputs, checked before anything is built or compiled."""
  if "ppl" in modes and not _TRAINED.value:
    raise ValueError("--modes=ppl needs --trained (a byte-level kvjax "
                     "training workdir, e.g. checkpoints/austen-gqa)")
  if _TRAINED.value and {"ppl", "quant"} & set(modes):
    if not os.path.isdir(_TRAINED.value):
      raise ValueError(f"--trained={_TRAINED.value}: no such directory")
    data.locate_corpus(_DATA_DIR.value)


def main(argv):
  del argv
  modes = _MODES.value
  with cli.checking("--config.model"):
    config = cfg_lib.model_config(_CONFIG.value.model)
  with cli.checking():
    _check_perplexity(modes)
  print("preset %s: %s, %.1fM params; machine %s" % (
      _CONFIG.value.preset, config.variant, kvjax.param_count(config) / 1e6,
      bm.machine_info()), flush=True)
  _run_modes(config, modes)


def _run_modes(config, modes):
  # memory first: it measures the process's resident set.
  for mode in MODES:
    if mode not in modes:
      continue
    if mode == "memory":
      run_memory(config)
    elif mode == "positions":
      run_positions(config)
    elif mode == "variants":
      run_variants()
    elif mode == "roofline":
      run_roofline()
    elif mode == "quant":
      run_quant()
    elif mode == "sweep":
      run_sweep()
    elif mode == "fixed":
      run_fixed()
    elif mode == "ppl":
      _save("ppl", dict(perplexity=_perplexity(bm.CACHE_KINDS, "ppl")))


if __name__ == "__main__":
  cli.run(main)
