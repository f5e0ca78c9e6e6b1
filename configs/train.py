"""Byte-level training on the Austen novels, one preset per attention variant.

Select with `--config=configs/train.py:<variant>` (mha, mqa, gqa, mla;
default gqa); override with e.g. `--config.train.num_steps=2000` or
`--config.train.data_dir=/path/to/janeaustenr`.

All four variants share width, depth and heads (D 256, L 4, N 8, H 32) and
differ only in attention; the SwiGLU width F absorbs the difference so the
parameter counts match (2.95 M each, within 0.3 %). Per layer, GQA attention
holds 2·D·N·H + 2·D·K·H weights and the MLP 3·D·F, so against the GQA
reference (K 2, F 704): F = 704 − 2·H·(K − 2)/3, giving MHA (K 8) 576 and
MQA (K 1) 725.3 → 728. MLA holds D·(C+R) + C + C·N·(P+v) + N·v·D + D·N·(P+R)
= 266 368 against GQA's 163 840, so F = 704 − 102 528/(3·D) = 570.5 → 568.
tests/test_train.py checks the match with `kvjax.param_count`.

The run is 600 steps of 16 × 256 bytes (2.5 M tokens, ~0.7 epoch of the
3.56 MB training text). Measured (gqa, seed 0): validation 3.18 / 2.65 /
2.39 / 2.12 / 2.06 bits per byte at steps 100 / 200 / 300 / 500 / 600. One
step takes ~0.43 s on two idle cores of the Intel Xeon host (bfloat16
products, WORKSPACE.md "Training speed"): ~5 minutes for the run, twice
that on one core. `--config.train.num_steps=250` is a ~2 minute check.
"""

import ml_collections

VARIANTS = ("mha", "mqa", "gqa", "mla")

_D, _L, _N, _H = 256, 4, 8, 32
# (num_kv_heads, mlp_dim) per GQA-family variant; see the module docstring.
_GQA_FAMILY = {"mha": (8, 576), "mqa": (1, 728), "gqa": (2, 704)}
_MLA_MLP_DIM = 568


def model_dict(variant: str) -> dict:
  """Model fields (`kvjax.ModelConfig`) of one variant as a plain dict."""
  if variant not in VARIANTS:
    raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")
  m = dict(vocab_size=259,  # 256 bytes + PAD, BOS, EOS (kvjax.data)
           num_layers=_L, embed_dim=_D, num_heads=_N, head_dim=_H,
           attention="gqa", num_kv_heads=_N, mlp_dim=704, kv_lora_rank=0,
           q_lora_rank=0, qk_nope_head_dim=0, qk_rope_head_dim=0,
           v_head_dim=0, rope_theta=10000.0, rope_layout="half",
           max_seq_len=8192, rms_norm_eps=1e-6, tie_embeddings=False,
           param_dtype="float32", compute_dtype="float32", init_scale=0.02)
  if variant == "mla":
    # DeepSeek-V2 ratios: C = 4·H, R = H / 2, P = v = H, queries unfactored.
    m.update(attention="mla", num_kv_heads=1, head_dim=0,
             kv_lora_rank=4 * _H, qk_rope_head_dim=_H // 2,
             qk_nope_head_dim=_H, v_head_dim=_H, mlp_dim=_MLA_MLP_DIM,
             rope_layout="interleaved")
  else:
    m["num_kv_heads"], m["mlp_dim"] = _GQA_FAMILY[variant]
  return m


def get_config(arg: str = "gqa") -> ml_collections.ConfigDict:
  variant = arg or "gqa"
  cfg = ml_collections.ConfigDict()
  cfg.variant = variant
  cfg.model = ml_collections.ConfigDict(model_dict(variant))
  cfg.train = ml_collections.ConfigDict(dict(
      seq_len=256,
      batch_size=16,
      num_steps=600,
      lr=3e-3,
      warmup_steps=50,
      min_lr_ratio=0.1,
      weight_decay=0.1,
      b1=0.9,
      b2=0.95,
      clip=1.0,
      eval_every=100,
      eval_batches=8,  # 8 × 16 windows = 33 K held-out bytes
      checkpoint_every=100,
      keep_checkpoints=2,
      log_every=10,
      seed=0,
      bos=False,  # rows start with BOS (a shared first token: sinks)
      # 'auto': bfloat16 operands with float32 accumulation where this
      # backend multiplies them faster (kvjax.mixed_precision: the Intel
      # Xeon's AMX), else float32 (the AMD EPYC's AVX2); WORKSPACE.md
      # "Training speed". 'float32' / 'bfloat16' to fix it.
      matmul_dtype="auto",
      # The step's 16 rows as 4 groups of 4, gradients summed (the same
      # gradient up to float reassociation; kvjax.train.TrainConfig): the
      # groups' elementwise passes overlap the others' products on XLA:CPU.
      microbatches=4,
      # None: $KVJAX_DATA_DIR, else the user's cache directory
      # (kvjax.data.resolve_data_dir); `python -m kvjax.data --setup`.
      data_dir=ml_collections.config_dict.placeholder(str),
  ))
  return cfg
