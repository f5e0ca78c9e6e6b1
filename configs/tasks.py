r"""Task models: small byte models trained on `kvjax.lab.tasks` mixtures.

Select with `--config=configs/tasks.py:<variant>-<mixture>`, e.g.
`gqa-passkey`, `mla-mqar`, `mha-mix`; override with
`--config.train.num_steps=300`. Train with

  python -m kvjax.lab.tasks --config=configs/tasks.py:gqa-passkey \
      --workdir=workdir/tasks-gqa-passkey

and score with `experiments/policy_eval.py --checkpoint=<that workdir>`.

variants (same width, depth and heads; only the attention differs, and the
MLP width F absorbs the difference so the parameter counts match, as in
configs/train.py): D 128, L 2, N 4, H 32;
  mha  K 4     mqa  K 1     gqa  K 2 (the reference, F 384)
  mla  DeepSeek-V2 ratios: C = 4·H, R = H / 2, P = v = H
F is the width whose `kvjax.param_count` comes closest to the GQA
reference (tests/test_tasks.py checks the match within 1 %).

mixtures (`kvjax.lab.tasks.mixture_batch`; prompt_loss: next-byte loss on the
whole row, else on the answers only; validation always scores answers):
  passkey  passkey retrieval at training length T = 256, prompt_loss; half
           the rows with the noise filler, half with `passkey_span`'s
           (random sentences repeated with a period drawn up to the whole
           filler: only copying predicts them, at every distance); 4000
           updates
  mqar     multi-query associative recall, T = 256 (~27 pairs), loss on the
           answers of every query (Zoology's objective)
  niah     RULER single-key and needle-haystack multi-key, T = 256,
           prompt_loss
  needle   RULER's single needle (niah_single) alone, half the rows with the
           span filler (`niah_single_span`), T = 256, prompt_loss: what
           niah's key matching (niah_multikey_needles) failed to learn in
           5,000 updates is left out; fine-tuned from the passkey model
  recall   MQAR alone (answer loss only), half the rows with
           `mqar_dense` (12 queries a row, Zoology's dense objective);
           fine-tuned from the passkey model, whose retrieval heads already
           match a multi-byte context ("pass key is") and copy what follows
  zoology  Zoology's MQAR exactly: one-letter keys, one-digit values
           (`mqar1`; half the rows `mqar1_dense`, 12 queries), T = 256
           (26 pairs), answer loss only, from scratch
  flat     Zoology's MQAR without the newline before the questions
           (`mqar1_flat`: ' k1 a9 ... w3 a9 w3 k'), 3-6 pairs at T = 24-32,
           128 rows an update, answer loss only, from scratch, 4000
           updates. Recall formed (rows exact 0.99) with 2000 updates and
           then resumed with num_steps=4000; this straight 4000-update
           schedule did not (0.05, seed 0): WORKSPACE.md "Long-context
           tasks". With the newline (`mqar1_adjacent`) the second layer
           parks its attention on it and recall never forms
  passkey_mqar
           the passkey mixture (T 256, 16 rows) alternating by update with
           flat MQAR (`alternate`: mqar1_flat, T 24-32, 128 rows: the same
           4,096 tokens), fine-tuned from the passkey model at lr 1e-3,
           4000 updates: one model for both retrieval and recall (MQA's
           shipped model: --config.train.lr=3e-3; at 1e-3 its recall
           stalls at 0.84 of the rows, WORKSPACE.md "One model per
           variant")
  passkey_mqar_niah
           passkey_mqar's two parts and a third, RULER's single needle
           (`niah_single`, half the rows `niah_single_span`; T 256, 16
           rows, loss on the answers only), fine-tuned from the
           passkey_mqar model at lr 3e-3, 5000 updates: retrieval by key.
           GQA's shipped model ran on to 7000 (the same command with
           --config.train.num_steps=7000: at 5000 it missed a third of the
           needles right after BOS). At lr 1e-3 the needle rows stopped at
           0.02 (MHA, 4,300 updates), 0.34 (MLA) and 0.42 (MQA), and
           GQA's reached 0.98 but found 27 of 60 needles right after BOS.
           MLA's passkey part takes the loss on its answers only
           (`per_variant`): with the filler's loss as well, at 3e-3 MLA
           learned the needle but lost passkey (0.17 of the rows at 7,000
           updates), the answers' share of its loss ~5 bytes in 256
           against the needle part's whole loss. With the prompt loss
           on the needle's rows (--config.alternate_2.prompt_loss=True),
           its answers stayed at 0.20-0.22 of their bytes through 1,200
           updates of a 3,000-update run: the 7 answer bytes of a 256-byte
           row were lost in the filler's loss (WORKSPACE.md "One model per
           variant")
  mix      passkey, RULER's families and MQAR at T = 512 (multi-value and
           multi-query prompts need > 256 bytes), prompt_loss

The recipe (passkey; mqar and niah share its curriculum): a length
curriculum (`curriculum`: the first 1500 updates at one fixed T = 128)
and then rows of varied length up to T = 256 (`tasks.min_seq_len`: at one
fixed length the model learns where the needle sits, not how to find it).
What made passkey learnable is the span filler: with the short-period
`passkey_repeat` filler in its place (copying over a few dozen bytes only)
validation exact match stalled at 0.67 after 6,600 updates, retrieving late
needles only; with the span filler it jumps from 0.03 to 1.0 between
updates 2,500 and 2,900 (GQA). The other variants make the same jump
later, at an update that depends on the seed: MQA (seed 0, 6,000 updates)
ends at 0.98, MHA at 1.0 with seed 1 (6,000 updates) but 0.08 with seed 0
after 8,000, MLA at 0.95 after 12,000 (on the validation rows; at the full
T = 256 it misses most needles at depth 0). What each variant reaches: WORKSPACE.md
("Long-context tasks through a bounded cache"); on gqa-mqar the recipe does
not learn (validation answers flat at chance through 2,100 updates: the
same section); gqa-recall lifts the answer bytes above chance (0.29 at
6,000 updates) but answers no row whole; gqa-zoology stays at chance
through 6,000 updates from scratch and at 0.25-0.29 answer bytes through
3,800 fine-tuned from the passkey model (the same section).
"""

import functools

import ml_collections

VARIANTS = ("mha", "mqa", "gqa", "mla")
# names and weights are tuples so that a run can override them, e.g.
# --config.tasks.names="('niah_single', 'niah_single_span')" (ml_collections
# does not override lists).
MIXTURES = {
    "passkey": dict(names=("passkey", "passkey_span"), weights=(1.0, 1.0),
                    seq_len=256, prompt_loss=True, min_seq_len=64,
                    curriculum=(1500, 128), steps=4000),
    "mqar": dict(names=("mqar",), weights=(1.0,), seq_len=256,
                 prompt_loss=False, min_seq_len=64, curriculum=(1500, 128)),
    "niah": dict(names=("niah_single", "niah_single_span",
                        "niah_multikey_needles"),
                 weights=(1.0, 1.0, 1.0), seq_len=256, prompt_loss=True,
                 min_seq_len=64, curriculum=(1500, 128), steps=4000),
    "needle": dict(names=("niah_single", "niah_single_span"),
                   weights=(1.0, 1.0), seq_len=256, prompt_loss=True,
                   min_seq_len=64, curriculum=(0, 0), steps=3000, lr=1e-3,
                   init_from="checkpoints/tasks-{variant}-passkey"),
    "recall": dict(names=("mqar", "mqar_dense"), weights=(1.0, 1.0),
                   seq_len=256, prompt_loss=False, min_seq_len=64,
                   curriculum=(0, 0), steps=6000, lr=1e-3,
                   init_from="checkpoints/tasks-{variant}-passkey"),
    "zoology": dict(names=("mqar1", "mqar1_dense"), weights=(1.0, 1.0),
                    seq_len=256, prompt_loss=False, min_seq_len=64,
                    curriculum=(0, 0), steps=3000),
    "flat": dict(names=("mqar1_flat",), weights=(1.0,), seq_len=32,
                 prompt_loss=False, min_seq_len=24, curriculum=(0, 0),
                 steps=4000, batch_size=128),
    "passkey_mqar": dict(names=("passkey", "passkey_span"),
                         weights=(1.0, 1.0), seq_len=256, prompt_loss=True,
                         min_seq_len=64, curriculum=(0, 0), steps=4000,
                         lr=1e-3, init_from="checkpoints/tasks-{variant}-passkey",
                         alternate=dict(names=("mqar1_flat",), weights=(1.0,),
                                        seq_len=32, batch_size=128,
                                        prompt_loss=False, min_seq_len=24)),
    "passkey_mqar_niah": dict(
        names=("passkey", "passkey_span"), weights=(1.0, 1.0), seq_len=256,
        prompt_loss=True, min_seq_len=64, curriculum=(0, 0), steps=5000,
        lr=3e-3, init_from="checkpoints/tasks-{variant}-passkey_mqar",
        # MLA's passkey part on its answers only: with the filler's loss
        # too, the needle's answer-only rows took the shared retrieval
        # heads and passkey fell to 0.17 (WORKSPACE.md "One model per
        # variant").
        per_variant=dict(mla=dict(prompt_loss=False)),
        alternate=(dict(names=("mqar1_flat",), weights=(1.0,), seq_len=32,
                        batch_size=128, prompt_loss=False, min_seq_len=24),
                   dict(names=("niah_single", "niah_single_span"),
                        weights=(1.0, 1.0), seq_len=256, batch_size=16,
                        prompt_loss=False, min_seq_len=64))),
    "mix": dict(names=("passkey", "niah_single", "niah_multikey",
                       "niah_multikey_needles", "niah_multivalue",
                       "niah_multiquery", "mqar"),
                weights=(1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0), seq_len=512,
                prompt_loss=True, min_seq_len=None, curriculum=(0, 0)),
}
PRESETS = tuple(f"{v}-{m}" for v in VARIANTS for m in MIXTURES)

_D, _L, _N, _H = 128, 2, 4, 32
_GQA_KV_HEADS = {"mha": 4, "mqa": 1, "gqa": 2}
_REFERENCE_MLP = 384


def _base_model(variant: str, mlp_dim: int) -> dict:
  m = dict(vocab_size=259,  # 256 bytes + PAD, BOS, EOS (kvjax.data)
           num_layers=_L, embed_dim=_D, num_heads=_N, head_dim_override=_H,
           attention="gqa", num_kv_heads=2, mlp_dim=mlp_dim,
           kv_lora_rank=0, q_lora_rank=0, qk_nope_head_dim=0,
           qk_rope_head_dim=0, v_head_dim=0, rope_theta=10000.0,
           rope_layout="half", max_seq_len=8192, rms_norm_eps=1e-6,
           tie_embeddings=False, param_dtype="float32",
           compute_dtype="float32", init_scale=0.02)
  if variant == "mla":
    m.update(attention="mla", num_kv_heads=1, head_dim_override=0,
             kv_lora_rank=4 * _H, qk_rope_head_dim=_H // 2,
             qk_nope_head_dim=_H, v_head_dim=_H, rope_layout="interleaved")
  else:
    m["num_kv_heads"] = _GQA_KV_HEADS[variant]
  return m


@functools.lru_cache(maxsize=None)
def matched_mlp_dim(variant: str) -> int:
  """The MLP width F (a multiple of 8) whose parameter count is closest to
  the GQA reference's. The count is linear in F (L·3·D per unit), so two
  counts give the line; F is rounded to the nearest multiple of 8."""
  import kvjax  # pylint: disable=g-import-not-at-top

  def count(v, f):
    return kvjax.param_count(kvjax.ModelConfig.from_dict(_base_model(v, f)))

  target = count("gqa", _REFERENCE_MLP)
  at_8, at_16 = count(variant, 8), count(variant, 16)
  per_unit = (at_16 - at_8) / 8
  return max(8, 8 * round((8 + (target - at_8) / per_unit) / 8))


def model_dict(variant: str) -> dict:
  """Model fields (`kvjax.ModelConfig`) of one variant as a plain dict."""
  if variant not in VARIANTS:
    raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")
  return _base_model(variant, matched_mlp_dim(variant))


def get_config(arg: str = "gqa-passkey") -> ml_collections.ConfigDict:
  variant, _, mixture = (arg or "gqa-passkey").partition("-")
  if mixture not in MIXTURES:
    raise ValueError(f"unknown mixture {mixture!r}; choose from "
                     f"{tuple(MIXTURES)}")
  mix = dict(MIXTURES[mixture])
  seq_len = mix.pop("seq_len")
  num_steps = mix.pop("steps", 3400)
  batch_size = mix.pop("batch_size", 16)
  curriculum_steps, curriculum_len = mix.pop("curriculum")
  lr = mix.pop("lr", 3e-3)
  init_from = mix.pop("init_from", None)
  alternate = mix.pop("alternate", None)
  mix.update(mix.pop("per_variant", {}).get(variant, {}))
  cfg = ml_collections.ConfigDict()
  cfg.preset = f"{variant}-{mixture}"
  cfg.model = ml_collections.ConfigDict(model_dict(variant))
  cfg.tasks = ml_collections.ConfigDict(dict(mix, text_weight=0.0))
  # Mixtures whose batches alternate with these by update, each with its
  # own row shape (`kvjax.lab.tasks.train_task_model`'s parts): sections
  # alternate, alternate_2, ... (`kvjax.lab.tasks.alternate_sections`).
  from kvjax.lab.tasks import ALTERNATE_KEYS  # pylint: disable=g-import-not-at-top
  if isinstance(alternate, dict):
    alternate = (alternate,)
  for k, part in enumerate(alternate or ()):
    cfg[ALTERNATE_KEYS[k]] = ml_collections.ConfigDict(
        dict(part, text_weight=0.0))
  if mix["min_seq_len"] is None:  # a typed placeholder, so it can be set
    cfg.tasks.min_seq_len = ml_collections.config_dict.placeholder(int)
  # The first `steps` updates at seq_len `seq_len` (kvjax.lab.tasks.
  # train_task_model); steps 0 turns the curriculum off.
  cfg.curriculum = ml_collections.ConfigDict(dict(steps=curriculum_steps,
                                                  seq_len=curriculum_len))
  # A task model's workdir to start from (fine-tuning; e.g.
  # checkpoints/tasks-gqa-passkey), else a fresh init at train.seed.
  cfg.init_from = ml_collections.FieldReference(
      None if init_from is None else init_from.format(variant=variant),
      field_type=str)
  cfg.train = ml_collections.ConfigDict(dict(
      seq_len=seq_len,
      batch_size=batch_size,
      num_steps=num_steps,
      lr=lr,
      warmup_steps=50,
      min_lr_ratio=0.1,
      weight_decay=0.1,
      b1=0.9,
      b2=0.95,
      clip=1.0,
      eval_every=100,
      eval_batches=4,  # 4 × 16 fixed rows from another seed
      checkpoint_every=100,
      keep_checkpoints=2,
      log_every=10,
      seed=0,
      # The faster of bfloat16 (float32 accumulation) and float32 products
      # on this backend (kvjax.mixed_precision.fastest_matmul_dtype).
      matmul_dtype="auto",
      data_dir=ml_collections.config_dict.placeholder(str),
  ))
  return cfg
