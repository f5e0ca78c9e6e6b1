r"""kvjax against llama.cpp on the same weights (issue 28).

  python experiments/llamacpp_peer.py --models=shipped,preset \
      --config=configs/model.py:gqa-medium --batches=1,8 \
      --contexts=4096,8192 --workdir=/tmp/llamacpp_peer

Models: 'shipped' is the trained byte-level Austen model
(`--trained`, default checkpoints/austen-gqa, `restore_params`); 'preset'
is a random model of `--config` (default gqa-medium). Each is written as a
float32 GGUF (`kvjax.gguf_export.write_gguf`) and loaded by llama.cpp
(llama-cpp-python, `kvjax.lab.llamacpp.LlamaCpp`: f32 KV cache, threads =
the cores JAX's CPU backend runs on, OMP_WAIT_POLICY=PASSIVE unless set:
see kvjax/lab/llamacpp.py). Before timing, each model's logits
on one prompt are compared over every position (max |diff| against
`kvjax.tolerance`'s bound; the run stops if it is exceeded) and the greedy
tokens are compared.

Cases per model: batch B in `--batches` at `--prompt_len` (128) with
`--new_tokens` (128) generated; then batch 1 at each of `--contexts`: a
prompt of context − `--long_new_tokens` tokens and that many generated
tokens, so prompt + generation fill the context (kvjax runs with
bucket=False: both prefill exactly the same T tokens). `--skip` drops cases by label (e.g. preset/ctx8192). Every case
is timed alternately (`kvjax.lab.llamacpp.compare`: kvjax generate and
prefill, llama.cpp generate and prefill, rotated each round; warm-up
excluded; medians) with the same definitions for both: decode tokens/s
= B·(new − 1) / (t_generate − t_prefill), prefill tokens/s = B·T /
t_prefill.

Outputs in --workdir: llamacpp_peer.jsonl (a row as each case finishes),
llamacpp_peer.json (CPU model, commit, versions, parity, rows) and
llamacpp_peer.png (tokens/s side by side). Prints the ratios on stdout.

llama-cpp-python and gguf are optional (`pip install -e .[llamacpp]`):
without them the script writes llamacpp_peer.json saying why, prints that
JSON, and exits 0.
"""

import json
import os
import sys
import tempfile

from absl import flags
from absl import logging
import jax
import numpy as np

import kvjax
from kvjax import cli
from kvjax import configs as cfg_lib
from kvjax import data
from kvjax import gguf_export
from kvjax import orbax_checkpoint
from kvjax.lab import benchmarking as bm
from kvjax.lab import llamacpp
from configs import model as model_presets

ROOT = os.path.join(os.path.dirname(__file__), "..")
MODELS = ("shipped", "preset")

_CONFIG = cli.DEFINE_config_file(
    "config", os.path.join(ROOT, "configs", "model.py:gqa-medium"),
    "The random 'preset' model (a gqa/mha/mqa preset).",
    presets=[p for p in model_presets.PRESETS if not p.startswith("mla")])
_MODELS = cli.DEFINE_choice_list("models", list(MODELS), MODELS,
                                 "Which models to compare.")
_TRAINED = flags.DEFINE_string(
    "trained", os.path.join(ROOT, "checkpoints", "austen-gqa"),
    "Training workdir of the 'shipped' model.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/kvjax_llamacpp_peer",
                               "Output dir.")
_BATCHES = cli.DEFINE_int_list("batches", [1, 8],
                               "Batch sizes at --prompt_len.", lower_bound=1)
_PROMPT = flags.DEFINE_integer("prompt_len", 128, "Short prompt tokens.",
                               lower_bound=1)
_NEW = flags.DEFINE_integer("new_tokens", 128,
                            "Generated tokens at --prompt_len (>= 2).",
                            lower_bound=2)
_CONTEXTS = cli.DEFINE_int_list(
    "contexts", [4096, 8192], "Batch-1 long contexts (prompt + generated "
    "tokens); --skip drops them.", lower_bound=2)
_LONG_NEW = flags.DEFINE_list(
    "long_new_tokens", ["shipped:512", "preset:64"],
    "Generated tokens in a long context, per model (name:tokens, >= 2): "
    "enough that the decode time stands out of the prefill's noise (the "
    "shipped model decodes ~100x faster than it prefills 4k tokens).")
_LONG_REPEATS = flags.DEFINE_integer(
    "long_repeats", 2, "Timed rounds of the long-context cases.",
    lower_bound=1)
_SKIP = flags.DEFINE_list("skip", [], "Case labels not to run, e.g. "
                          "preset/ctx8192, shipped/b8.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed rounds (medians).",
                                lower_bound=1)
_CHECK_TOKENS = flags.DEFINE_integer(
    "check_tokens", 32, "Greedy tokens compared in the parity check.",
    lower_bound=1)
_FLASH = flags.DEFINE_bool("llamacpp_flash_attn", False,
                           "llama.cpp's flash-attention kernel.")
_SEED = flags.DEFINE_integer("seed", 0, "Weights and prompt seed.",
                             lower_bound=0)


def _skip_json(reason: str) -> None:
  out = dict(skipped=True, reason=reason)
  os.makedirs(_WORKDIR.value, exist_ok=True)
  with open(os.path.join(_WORKDIR.value, "llamacpp_peer.json"), "w") as f:
    json.dump(out, f, indent=1)
  print(json.dumps(out))


def _models(config):
  """name -> (config, params) for --models."""
  out = {}
  for name in _MODELS.value:
    if name == "shipped":
      with cli.checking("--trained"):
        cfg, params = orbax_checkpoint.restore_params(_TRAINED.value)
      out[name] = (cfg, params)
    else:
      out[name] = (config, kvjax.init_params(config, jax.random.key(
          _SEED.value)))
  return out


def _long_new_tokens() -> dict[str, int]:
  out = {}
  for item in _LONG_NEW.value:
    name, _, n = item.partition(":")
    if name not in MODELS or not n.isdigit() or int(n) < 2:
      raise cli.UsageError(f"--long_new_tokens: {item!r} is not name:tokens "
                           f"with name in {MODELS} and tokens >= 2")
    out[name] = int(n)
  # Only the models this run compares need an entry.
  missing = set(_MODELS.value) - set(out)
  if missing:
    raise cli.UsageError(f"--long_new_tokens has no entry for "
                         f"{sorted(missing)}")
  return out


def _cases(config, name):
  """(label, batch, prompt_len, new_tokens) of one model's cases."""
  cases = [(f"{name}/b{b}", b, _PROMPT.value, _NEW.value)
           for b in _BATCHES.value]
  new = _long_new_tokens()[name]
  for ctx in _CONTEXTS.value:
    cases.append((f"{name}/ctx{ctx}", 1, ctx - new, new))
  out = []
  for label, b, t, n in cases:
    if label in _SKIP.value:
      continue
    if t < 1 or t + n > config.max_seq_len:
      logging.warning("%s: prompt %d + %d new > max_seq_len %d; skipped",
                      label, t, n, config.max_seq_len)
      continue
    out.append((label, b, t, n))
  return out


def _prompts(name, config, rng, batch, length):
  """Austen text for the shipped model (a trained model's natural input),
  random ids for the random preset."""
  if name != "shipped":
    return rng.integers(0, config.vocab_size, (batch, length))
  try:
    stream = data.heldout_stream()
  except (data.CorpusNotFoundError, OSError, ValueError):
    return rng.integers(0, data.BYTE_VOCAB, (batch, length))
  starts = rng.integers(0, len(stream) - length, batch)
  return np.stack([stream[s:s + length] for s in starts])


def main(argv):
  del argv
  with cli.checking("--config.model"):
    config = cfg_lib.model_config(_CONFIG.value.model)
  with cli.checking("--config"):
    gguf_export.check_exportable(config)
  _long_new_tokens()
  try:
    llamacpp.import_llama_cpp()
    import gguf  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError as e:
    why = str(e) if llamacpp.INSTALL in str(e) else (
        f"{e}; {llamacpp.INSTALL}")
    logging.warning("skipped: %s", why)
    _skip_json(f"llamacpp_peer needs llama-cpp-python and gguf: {why}")
    return
  threads = llamacpp.default_threads()
  results = dict(
      cpu=bm.cpu_model(), revision=bm.revision(ROOT),
      machine=bm.machine_info(), threads=threads,
      llama_cpp_python=llamacpp.import_llama_cpp().__version__,
      argv=sys.argv, flash_attn=_FLASH.value, kv_dtype="float32",
      repeats=_REPEATS.value, long_repeats=_LONG_REPEATS.value,
      omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
      preset=_CONFIG.value.preset, trained=_TRAINED.value, parity={},
      rows=[])
  logging.info("%s; %d threads (JAX and llama.cpp); llama-cpp-python %s; "
               "OMP_WAIT_POLICY=%s", results["cpu"], threads,
               results["llama_cpp_python"], results["omp_wait_policy"])
  rng = np.random.default_rng(_SEED.value)
  partial = cli.JsonLines(os.path.join(_WORKDIR.value,
                                       "llamacpp_peer.jsonl"))
  with tempfile.TemporaryDirectory() as tmp:
    for name, (cfg, params) in _models(config).items():
      path = gguf_export.write_gguf(os.path.join(tmp, f"{name}.gguf"),
                                    params, cfg, name=name)
      cases = _cases(cfg, name)
      ids_T = _prompts(name, cfg, rng, 1, _PROMPT.value)[0]
      cap = max([_PROMPT.value + _CHECK_TOKENS.value] +
                [t + n for _, b, t, n in cases if b == 1])
      with llamacpp.LlamaCpp(path, capacity=cap, threads=threads,
                             flash_attn=_FLASH.value) as llm:
        # llama.cpp's CPU flash-attention kernel rounds through float16.
        p = llamacpp.parity(params, cfg, llm, ids_T, _CHECK_TOKENS.value,
                            rounding="float16" if _FLASH.value else
                            "float32")
        results["parity"][name] = dict(p, params=kvjax.param_count(cfg),
                                       gguf_bytes=os.path.getsize(path))
        logging.info("%s: max |dlogit| %.2e (bound %.2e) over %d positions; "
                     "greedy tokens agree for %d of %d", name,
                     p["max_logit_diff"], p["logit_bound"], p["positions"],
                     p["greedy_agree"], p["greedy_checked"])
        if not p["max_logit_diff"] <= p["logit_bound"]:
          raise ValueError(
              f"{name}: llama.cpp and kvjax disagree on the same weights: "
              f"max logit difference {p['max_logit_diff']:.3g} > "
              f"{p['logit_bound']:.3g} (kvjax.tolerance)")
        for label, b, t, n in cases:
          if b == 1:
            _run_case(results, partial, name, label, params, cfg, llm,
                      _prompts(name, cfg, rng, b, t), n)
      for label, b, t, n in cases:
        if b == 1:
          continue
        with llamacpp.LlamaCpp(path, capacity=t + n, batch=b,
                               threads=threads,
                               flash_attn=_FLASH.value) as llm:
          _run_case(results, partial, name, label, params, cfg, llm,
                    _prompts(name, cfg, rng, b, t), n)
  partial.close()
  results["rows"].sort(key=lambda r: (MODELS.index(r["model"]),
                                      r["prompt_len"], r["batch"]))
  with open(os.path.join(_WORKDIR.value, "llamacpp_peer.json"), "w") as f:
    json.dump(results, f, indent=1, default=float)
  llamacpp.plot(results, os.path.join(_WORKDIR.value, "llamacpp_peer.png"))
  print(json.dumps({r["label"]: {k: round(r[k], 3) for k in (
      "kvjax_decode_tokens_per_s", "llamacpp_decode_tokens_per_s",
      "decode_ratio", "kvjax_prefill_tokens_per_s",
      "llamacpp_prefill_tokens_per_s", "prefill_ratio")}
                    for r in results["rows"]}))


def _run_case(results, partial, name, label, params, cfg, llm, ids_BT, n):
  """Times one case and records its row; a case whose decode time is lost
  in the prefill's noise is logged and left out (`failed` in the JSON)."""
  repeats = (_LONG_REPEATS.value if "/ctx" in label else _REPEATS.value)
  try:
    row = llamacpp.compare(params, cfg, llm, ids_BT, n, repeats=repeats)
  except ValueError as e:
    logging.warning("%s: %s", label, e)
    results.setdefault("failed", {})[label] = str(e)
    return
  row = dict(model=name, label=label, repeats=repeats, **row)
  results["rows"].append(row)
  partial.write(row)
  sp = row["decode_ratio_spread"]
  logging.info(
      "%s: decode kvjax %.1f tok/s, llama.cpp %.1f tok/s -> %.2fx (rounds "
      "%.2f-%.2f) | prefill %dx%d kvjax %.0f tok/s, llama.cpp %.0f tok/s -> "
      "%.2fx", label, row["kvjax_decode_tokens_per_s"],
      row["llamacpp_decode_tokens_per_s"], row["decode_ratio"], sp["min"],
      sp["max"], row["batch"], row["prompt_len"],
      row["kvjax_prefill_tokens_per_s"], row["llamacpp_prefill_tokens_per_s"],
      row["prefill_ratio"])


if __name__ == "__main__":
  cli.run(main)
