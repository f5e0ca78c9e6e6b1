r"""kvjax against Hugging Face transformers on the same weights (issue 7).

  python experiments/peer_benchmark.py --config=configs/model.py:gqa-medium \
      --batches=1,8 --workdir=/tmp/peer

Builds a random Llama-style model of the preset's size with transformers,
saves it as safetensors, loads the same weights into kvjax with
`kvjax.load_checkpoint`, checks that both give the same prefill logits and
greedy tokens, then times both alternately in one run (kvjax generate,
kvjax prefill, transformers generate, transformers prefill, repeated; warm-up
excluded; medians) at every batch, on the params as `load_checkpoint`
returns them ('loaded': what a user gets; `generate` lays them out for
decode itself, `kvjax.packed.for_decode`). What the decode layout buys over
the canonical one is experiments/decode_layout.py's question. Decode tokens/s =
B·(new − 1) / (t_generate − t_prefill), the same definition for both;
prefill = a generate of one token. The headline ratio is the ratio of the
medians; the ratios of the rounds (each round's kvjax and transformers
decode rates, timed side by side; `benchmarking.round_rates`) give its
spread within the run: min, quartiles, max. Logs each batch's ratios as it
finishes (and appends the batch's row to peer.jsonl), prints the ratios on
stdout, writes peer.json and peer.png (`plot`: the rounds' quartiles as
whiskers).

transformers and torch are optional (`pip install -e .[bench]`); without
them the script exits with a one-line message saying so.
"""

import json
import os
import tempfile

from absl import flags
from absl import logging
import jax
import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

import kvjax  # pylint: disable=g-import-not-at-top
from kvjax.lab import benchmarking as bm  # pylint: disable=g-import-not-at-top
from kvjax import cli  # pylint: disable=g-import-not-at-top
from kvjax import configs as cfg_lib  # pylint: disable=g-import-not-at-top
from kvjax import inference  # pylint: disable=g-import-not-at-top
from kvjax import tolerance  # pylint: disable=g-import-not-at-top
from configs import model as model_presets  # pylint: disable=g-import-not-at-top

_CONFIG = cli.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs",
                           "model.py:gqa-medium"),
    "Model preset (a gqa/mha/mqa preset: transformers builds a Llama).",
    presets=[p for p in model_presets.PRESETS if not p.startswith("mla")])
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/kvjax_peer", "Output dir.")
_BATCHES = cli.DEFINE_int_list("batches", [1, 8], "Batch sizes.",
                               lower_bound=1)
_PROMPT = flags.DEFINE_integer("prompt_len", 128, "Prompt tokens.",
                               lower_bound=1)
_NEW = flags.DEFINE_integer(
    "new_tokens", 256, "Generated tokens (>= 2: decode time = generate - "
    "prefill).", lower_bound=2)
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed rounds (medians).",
                                lower_bound=1)
_CHECK_TOKENS = flags.DEFINE_integer(
    "check_tokens", 32, "Greedy tokens compared between the two (batch 1).",
    lower_bound=1)
_OMP_PASSIVE = flags.DEFINE_bool(
    "omp_passive", False,
    "Set OMP_WAIT_POLICY=PASSIVE before importing torch (it sometimes "
    "stalls ~8 ms per parallel region on this machine).")
_TORCH_THREADS = flags.DEFINE_integer("torch_threads", 0,
                                      "torch.set_num_threads (0: default).",
                                      lower_bound=0)
_SEED = flags.DEFINE_integer("seed", 0, "Weights and prompt seed.",
                             lower_bound=0)


def _import_peer():
  """(torch, transformers), or a one-line error when they are absent."""
  if _OMP_PASSIVE.value:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
  try:
    import torch  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise cli.UsageError(
        f"peer_benchmark needs torch and transformers ({e}); install the "
        "optional extra: pip install -e '.[bench]' (torch==2.13.0 CPU)"
    ) from e
  return torch, transformers


def check_llama(config: kvjax.ModelConfig) -> None:
  """Refuses a config transformers' Llama cannot hold (MLA, MoE)."""
  if config.attention != "gqa" or config.is_moe:
    raise ValueError(f"--config: the peer model is a Llama; attention="
                     f"{config.attention!r}"
                     f"{' with MoE' if config.is_moe else ''} is not "
                     "supported here")


def hf_llama_config(transformers, config: kvjax.ModelConfig):
  """The transformers LlamaConfig of a kvjax GQA-family config."""
  check_llama(config)
  return transformers.LlamaConfig(
      vocab_size=config.vocab_size, hidden_size=config.embed_dim,
      intermediate_size=config.mlp_dim, num_hidden_layers=config.num_layers,
      num_attention_heads=config.num_heads,
      num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim,
      max_position_embeddings=config.max_seq_len,
      rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta,
      tie_word_embeddings=config.tie_embeddings, attention_bias=False,
      initializer_range=config.init_scale, bos_token_id=None,
      eos_token_id=None, pad_token_id=None)


def _rounds(results) -> int:
  row = next(iter(results["batches"].values()))
  return len(row["hf_decode_tokens_per_s_rounds"])


def plot(results, layouts, path):
  """Bars of decode tokens/s per batch (whiskers: the rounds' quartiles),
  kvjax's ratio over each of its bars; `results` as written to peer.json."""
  fig, ax = plt.subplots(figsize=(6, 3.5))
  bs = list(results["batches"])
  x = np.arange(len(bs))
  whos = [f"kvjax_{lay}" for lay in layouts] + ["hf"]
  for i, who in enumerate(whos):
    rows = [results["batches"][b] for b in bs]
    height = np.array([r[f"{who}_decode_tokens_per_s"] for r in rows])
    q = [bm.spread(r[f"{who}_decode_tokens_per_s_rounds"]) for r in rows]
    yerr = np.array([[max(h - s["q1"], 0), max(s["q3"] - h, 0)]
                     for h, s in zip(height, q)]).T
    ax.bar(x + 0.2 * i, height, 0.2, yerr=yerr, capsize=3,
           label=who.replace("_", " ") if who != "hf" else "transformers")
    if who != "hf":
      for xi, h, s, r in zip(x, height, q, rows):
        ax.annotate(f"{r['decode_ratio_' + who[len('kvjax_'):]]:.2f}×",
                    (xi + 0.2 * i, max(h, s["q3"])), ha="center",
                    va="bottom", fontsize=8, xytext=(0, 4),
                    textcoords="offset points")
  ax.set(xticks=x + 0.1 * (len(whos) - 1),
         xticklabels=[f"batch {b}" for b in bs],
         ylabel="decode tokens/s (higher is better)",
         title=f"{results['preset']}: same weights, same run, prompt "
         f"{results['prompt_len']}, {results['new_tokens']} new tokens\n"
         f"bars: medians of {_rounds(results)} rounds; whiskers: the "
         "rounds' quartiles; labels: kvjax / transformers")
  ax.margins(y=0.12)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  del argv
  with cli.checking("--config.model"):
    config = cfg_lib.model_config(_CONFIG.value.model)
  with cli.checking():
    check_llama(config)
  torch, transformers = _import_peer()
  hf_config = hf_llama_config(transformers, config)
  if _TORCH_THREADS.value:
    torch.set_num_threads(_TORCH_THREADS.value)
  torch.manual_seed(_SEED.value)
  hf_model = transformers.LlamaForCausalLM(hf_config)
  hf_model = hf_model.to(torch.float32).eval()
  hf_model.generation_config.pad_token_id = None
  hf_model.generation_config.eos_token_id = None
  with tempfile.TemporaryDirectory() as tmp:
    hf_model.save_pretrained(tmp, safe_serialization=True)
    kv_config, params = kvjax.load_checkpoint(tmp)
  # The params as loaded: the only kvjax contender (one row name, "loaded").
  layouts = {"loaded": params}

  def kv_generate(lay, *args, **kwargs):
    return kvjax.generate(layouts[lay], kv_config, *args, **kwargs)

  logging.info("preset %s: %.1fM params; torch %s (%d threads, "
               "OMP_WAIT_POLICY=%s), transformers %s, attn %s",
               _CONFIG.value.preset, kvjax.param_count(kv_config) / 1e6,
               torch.__version__, torch.get_num_threads(),
               os.environ.get("OMP_WAIT_POLICY", "default"),
               transformers.__version__,
               hf_model.config._attn_implementation)  # pylint: disable=protected-access

  rng = np.random.default_rng(_SEED.value)
  T, N = _PROMPT.value, _NEW.value

  def hf_generate(ids, n):
    with torch.inference_mode():
      return hf_model.generate(ids, attention_mask=torch.ones_like(ids),
                               max_new_tokens=n, min_new_tokens=n,
                               do_sample=False)[:, ids.shape[1]:]

  # ---- same weights, same answers -------------------------------------------
  prompt = rng.integers(0, config.vocab_size, (1, T))
  with torch.inference_mode():
    hf_logits = hf_model(torch.from_numpy(prompt)).logits[0, -1].numpy()
  kv_logits = np.asarray(kvjax.forward(params, kv_config, prompt)[0, -1])
  logit_err = float(np.abs(hf_logits - kv_logits).max())
  logit_scale = float(np.abs(hf_logits).max())
  logit_bound = tolerance.tolerance(kv_config).atol(logit_scale)
  n_check = _CHECK_TOKENS.value
  hf_ids = hf_generate(torch.from_numpy(prompt), n_check).numpy()
  agree = {}
  for lay in layouts:
    kv_ids = np.asarray(kv_generate(lay, prompt, n_check))
    agree[lay] = int(np.cumprod(hf_ids[0] == kv_ids[0]).sum())
  logging.info("prefill logits max |diff| %.2e; greedy tokens agree for "
               "%s of %d", logit_err, agree, n_check)
  if not logit_err <= logit_bound:
    raise ValueError(f"kvjax and transformers disagree on the same weights: "
                     f"max logit difference {logit_err:.3g} > "
                     f"{logit_bound:.3g} (kvjax.tolerance)")

  # ---- timing, alternating ---------------------------------------------------
  results = dict(preset=_CONFIG.value.preset, prompt_len=T, new_tokens=N,
                 torch=torch.__version__,
                 transformers=transformers.__version__,
                 torch_threads=torch.get_num_threads(),
                 omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "default"),
                 max_logit_diff=logit_err, logit_scale=logit_scale,
                 greedy_agree=agree,
                 greedy_checked=n_check, machine=bm.machine_info(),
                 batches={})
  partial = cli.JsonLines(os.path.join(_WORKDIR.value, "peer.jsonl"))
  for i, B in enumerate(_BATCHES.value):
    ids = rng.integers(0, config.vocab_size, (B, T))
    ids_t = torch.from_numpy(ids)
    ids_j = jax.numpy.asarray(ids, jax.numpy.int32)
    # The same cache size for generate and prefill: only the steps differ.
    cap = inference.default_capacity(inference.bucket_length(T), N)
    fns = {}
    for lay in layouts:
      fns[f"kvjax_{lay}_generate"] = (
          lambda lay=lay: kv_generate(lay, ids_j, N, capacity=cap))
      fns[f"kvjax_{lay}_prefill"] = (
          lambda lay=lay: kv_generate(lay, ids_j, 1, capacity=cap))
    fns["hf_generate"] = lambda: (hf_generate(ids_t, N), None)[1]
    fns["hf_prefill"] = lambda: (hf_generate(ids_t, 1), None)[1]
    t = bm.time_alternating(fns, warmup=1, repeats=_REPEATS.value)
    row = {name: timing.to_dict() for name, timing in t.items()}
    rates = {}
    for who in [f"kvjax_{lay}" for lay in layouts] + ["hf"]:
      decode_s = t[f"{who}_generate"].median - t[f"{who}_prefill"].median
      row[f"{who}_decode_tokens_per_s"] = B * (N - 1) / decode_s
      row[f"{who}_prefill_s"] = t[f"{who}_prefill"].median
      rates[who] = bm.round_rates(t[f"{who}_generate"], t[f"{who}_prefill"],
                                  B * (N - 1))
      row[f"{who}_decode_tokens_per_s_rounds"] = rates[who]
    for lay in layouts:
      row[f"decode_ratio_{lay}"] = (row[f"kvjax_{lay}_decode_tokens_per_s"] /
                                    row["hf_decode_tokens_per_s"])
      rounds = bm.paired_ratios(rates[f"kvjax_{lay}"], rates["hf"])
      row[f"decode_ratio_{lay}_rounds"] = rounds
      row[f"decode_ratio_{lay}_spread"] = bm.spread(rounds)
      row[f"prefill_ratio_{lay}"] = (row["hf_prefill_s"] /
                                     row[f"kvjax_{lay}_prefill_s"])
      sp = row[f"decode_ratio_{lay}_spread"]
      logging.info(
          "[%d/%d] batch %d, kvjax %s: decode kvjax %.1f tok/s, "
          "transformers %.1f tok/s -> %.2fx (rounds: min %.2f, quartiles "
          "%.2f-%.2f, max %.2f) | prefill %dx%d kvjax %.1f ms, transformers "
          "%.1f ms -> %.2fx", i + 1, len(_BATCHES.value), B, lay, row[f"kvjax_{lay}_decode_tokens_per_s"],
          row["hf_decode_tokens_per_s"], row[f"decode_ratio_{lay}"],
          sp["min"], sp["q1"], sp["q3"], sp["max"], B, T,
          1e3 * row[f"kvjax_{lay}_prefill_s"], 1e3 * row["hf_prefill_s"],
          row[f"prefill_ratio_{lay}"])
    results["batches"][B] = row
    partial.write(dict(batch=B, **row))
  partial.close()

  with open(os.path.join(_WORKDIR.value, "peer.json"), "w") as f:
    json.dump(results, f, indent=1, default=float)
  plot(results, list(layouts), os.path.join(_WORKDIR.value, "peer.png"))
  print(json.dumps({b: {k: v for k, v in r.items()
                        if "ratio" in k and not k.endswith("_rounds")}
                    for b, r in results["batches"].items()}))


if __name__ == "__main__":
  cli.run(main)
