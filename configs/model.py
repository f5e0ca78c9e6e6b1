"""Model + cache + generation presets.

Select with `--config=configs/model.py:<variant>[-<size>]`, e.g. `gqa`,
`mla-medium`, `mqa-tiny`; override with `--config.model.num_kv_heads=2`.

variants (same width and depth; only the attention differs):
  mha  K = N          mqa  K = 1          gqa  K = N / 3 (medium) or N / 4
  mla  DeepSeek-V2 ratios: C = 4·H, R = H / 2, P = H, v = H, no q_lora
sizes:
  tiny    D 64,  L 2,  N 4,  F 128,  V 256    (unit tests)
  small   D 256, L 6,  N 8,  F 704,  V 32000  (quick benchmarks)
  medium  D 768, L 12, N 12, F 2048, V 32000  (~125M params; the size the
          performance issue compares against transformers)

cache (kvjax.CachePolicy, plus capacity):
  capacity   slots S; 0: a power of two covering prompt + generation
  eviction   none, window, sinks (StreamingLLM: num_sinks pinned + window),
             h2o (recent newest kept + heavy hitters)
  positions  RoPE positions of kept keys: 'cache' (rank inside the cache)
             or 'original' (stream position). Unless set, it follows
             eviction (`default_positions`): 'cache' for sinks, h2o and the
             other global scored policies (StreamingLLM's choice, as
             experiments/streaming_eval.py), 'original' for the others (for
             none and window both modes are the same model, and 'original'
             skips the per-step key rotation; per-layer / per-head policies
             need it; see kvjax/cache.py).
  kv_dtype, key_quant, key_group   storage (float32, bfloat16, float16,
             int8, int4, int2; KIVI per-channel integer keys with
             key_quant='channel')

`python experiments/generate.py --show_config` prints every field.
"""

import ml_collections

VARIANTS = ("mha", "mqa", "gqa", "mla")
SIZES = {
    "tiny": dict(vocab_size=256, num_layers=2, embed_dim=64, num_heads=4,
                 mlp_dim=128, gqa_kv_heads=2),
    "small": dict(vocab_size=32000, num_layers=6, embed_dim=256, num_heads=8,
                  mlp_dim=704, gqa_kv_heads=2),
    "medium": dict(vocab_size=32000, num_layers=12, embed_dim=768,
                   num_heads=12, mlp_dim=2048, gqa_kv_heads=4),
}
PRESETS = tuple(f"{v}-{s}" for v in VARIANTS for s in SIZES)
def default_positions(eviction: str) -> str:
  """The RoPE position mode a cache section gets unless it sets one:
  'cache' for sinks and the global scored policies (h2o, tova, ...), which
  keep old tokens (StreamingLLM's choice; `kvjax.lab.streaming.parse_policy`
  does the same), else 'original' (none and window are the same model
  either way, and per-layer / per-head policies need it)."""
  from kvjax import policies  # pylint: disable=g-import-not-at-top
  cls = policies.REGISTRY.get(eviction)
  keeps_old = eviction == "sinks" or (
      cls is not None and issubclass(cls, policies.Scored) and
      getattr(cls, "scope", "global") == "global")
  return "cache" if keeps_old else "original"


def model_dict(variant: str, size: str) -> dict:
  """The model fields of one preset as a plain dict."""
  if variant not in VARIANTS:
    raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")
  if size not in SIZES:
    raise ValueError(f"unknown size {size!r}; choose from {tuple(SIZES)}")
  s = dict(SIZES[size])
  gqa_kv_heads = s.pop("gqa_kv_heads")
  n = s["num_heads"]
  h = s["embed_dim"] // n
  m = dict(s, attention="gqa", num_kv_heads=n, head_dim=0, kv_lora_rank=0,
           q_lora_rank=0, qk_nope_head_dim=0, qk_rope_head_dim=0,
           v_head_dim=0, mla_decode="absorbed", rope_theta=10000.0,
           rope_layout="half", rms_norm_eps=1e-6, tie_embeddings=False,
           sliding_window=0, attention_impl="einsum", param_dtype="float32",
           compute_dtype="float32", init_scale=0.02)
  if variant == "mqa":
    m["num_kv_heads"] = 1
  elif variant == "gqa":
    m["num_kv_heads"] = gqa_kv_heads
  elif variant == "mla":
    m.update(attention="mla", num_kv_heads=1, kv_lora_rank=4 * h,
             qk_rope_head_dim=h // 2, qk_nope_head_dim=h, v_head_dim=h,
             rope_layout="interleaved")
  return m


def get_config(arg: str = "gqa-medium") -> ml_collections.ConfigDict:
  variant, _, size = arg.partition("-")
  size = size or "medium"
  cfg = ml_collections.ConfigDict()
  cfg.preset = f"{variant}-{size}"
  cfg.model = ml_collections.ConfigDict(model_dict(variant, size))
  cfg.cache = ml_collections.ConfigDict(dict(
      capacity=0,  # 0: a power of two covering prompt + generation
      eviction="none", num_sinks=0, recent=0,
      # further options of the eviction policy, "key=value,..." (e.g.
      # "window=16,scope=head" for snapkv): see kvjax/policies/.
      options="",
      # key_quant 'channel': KIVI per-channel keys (kv_dtype int8, int4, int2).
      kv_dtype="float32", key_quant="token", key_group=32))
  # positions follows eviction until it is set (an override sets it for
  # good): a lazily computed reference. ml_collections has no public
  # constructor for a computed field; _apply_op is what its arithmetic on
  # references (`ref + 1`) uses.
  cfg.cache.positions = cfg.cache.get_ref("eviction")._apply_op(  # pylint: disable=protected-access
      default_positions)
  cfg.generate = ml_collections.ConfigDict(dict(
      # temperature 0 is greedy; the shipped byte-level model reads better
      # sampled (greedy decoding of a 2 bits/byte model loops).
      batch=1, prompt_len=128, max_new_tokens=200, temperature=0.8, top_k=40,
      top_p=0.95, seed=0))
  return cfg
