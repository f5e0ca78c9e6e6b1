"""Every number is validated where it enters: ModelConfig / MoEConfig /
RopeScaling fields, Sampler settings, config.json keys, params leaves.

Property-based (hypothesis): for each field, every invalid value (a float
or bool for an int, a count below its minimum, NaN, infinity, an
out-of-range float, a string outside its set) raises ValueError whose
message names the field and the value, never a ZeroDivisionError, a
TypeError or a silently truncated config; and every valid value
constructs. config.json keys are driven through
`kvjax.hf.config_from_hf` and `kvjax.load_checkpoint` and must be
named by their Hugging Face key. The regression cases at the end pin each
example of issue 21.

One model compile in all: the checks that run `kvjax.forward` share one
small fixed config (`RUN`).
"""

import functools
import json
import math
import os
import re

import hypothesis
from hypothesis import given, settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import config as config_lib
from kvjax import hf as hf_lib
from kvjax import params as params_lib
from kvjax.config import ModelConfig, MoEConfig, RopeScaling
from kvjax.sampling import Sampler

# Small example counts: an example is one dataclass construction or one
# config.json read, and the file must run in well under 30 s on the shared
# 2-core machine (about 12 s, most of it JAX start-up and the one compile).
# derandomize: the same examples on every run, so CI cannot fail on a draw
# it never saw here (widen max_examples locally to explore).
FEW = settings(max_examples=25, deadline=None, derandomize=True,
               database=None,
               suppress_health_check=[hypothesis.HealthCheck.too_slow])

BASE = dict(vocab_size=32, num_layers=1, embed_dim=16, num_heads=4,
            num_kv_heads=2, mlp_dim=32, max_seq_len=64)
MLA = dict(BASE, attention="mla", num_kv_heads=1, kv_lora_rank=8,
           qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)
MOE = dict(num_experts=8, experts_per_token=2, expert_dim=8)

# config.json bases, one per reader path (GQA, each RoPE kind, DeepSeek).
LLAMA = dict(model_type="llama", vocab_size=64, hidden_size=16,
             intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
HF_BASES = dict(
    llama=LLAMA,
    mistral=dict(LLAMA, model_type="mistral", sliding_window=8),
    qwen2=dict(LLAMA, model_type="qwen2", use_sliding_window=True,
               sliding_window=8, max_window_layers=0),
    llama3=dict(LLAMA, rope_parameters=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=16)),
    linear=dict(LLAMA, rope_scaling=dict(type="linear", factor=2.0)),
    yarn=dict(LLAMA, rope_parameters=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=16,
        beta_fast=32, beta_slow=1, attention_factor=1.2)),
    v3=dict(model_type="deepseek_v3", vocab_size=64, hidden_size=16,
            intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
            kv_lora_rank=8, q_lora_rank=4, qk_nope_head_dim=4,
            qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=8,
            n_shared_experts=1, first_k_dense_replace=1, n_group=2,
            topk_group=1, routed_scaling_factor=2.5),
)


def _raises_naming(name: str, value):
  """pytest.raises(ValueError) whose message names `name`, then `value`."""
  return pytest.raises(ValueError,
                       match=re.escape(name) + ".*" + re.escape(repr(value)))


def _ids(cases) -> list[str]:
  """Case names from the cases themselves: their string parts, joined."""
  return ["-".join(x for x in case if isinstance(x, str)) for case in cases]


# ---- strategies --------------------------------------------------------------
def json_non_ints():
  """Values an int field must refuse, all JSON-serialisable: floats
  (integral ones too: 32.0 is refused, never truncated; NaN and Infinity,
  which Python's json reads), bools, strings, lists."""
  return st.one_of(st.floats(), st.integers(-10**6, 10**6).map(float),
                   st.booleans(), st.text(max_size=4),
                   st.lists(st.integers(), max_size=2))


def non_ints():
  """json_non_ints and numpy's bool and float scalars."""
  return st.one_of(json_non_ints(), st.sampled_from(
      [np.True_, np.float32(2.0), np.float64(2.5)]))


def ints_below(minimum: int):
  return st.integers(minimum - 10**9, minimum - 1)


def ints_from(minimum: int):
  """Valid ints, as Python and numpy scalars."""
  return st.tuples(st.integers(minimum, 10**6),
                   st.sampled_from([int, np.int32, np.int64])).map(
                       lambda p: p[1](p[0]))


def bad_floats(minimum: float, strict: bool, maximum: float | None = None):
  """Values a float field with these bounds must refuse."""
  below = st.floats(max_value=minimum, allow_nan=False)
  if not strict:
    # Not exclude_max: hypothesis would then draw -0.0, which is >= 0.
    below = below.filter(lambda v: v < minimum)
  options = [below, st.sampled_from([math.nan, math.inf, -math.inf]),
             st.booleans(), st.text(max_size=4)]
  if maximum is not None:
    options.append(st.floats(min_value=maximum, exclude_min=True))
  return st.one_of(options)


def good_floats(minimum: float, strict: bool, maximum: float = 1e6):
  return st.floats(minimum, maximum, exclude_min=strict, allow_nan=False)


# ---- ModelConfig -------------------------------------------------------------
INT_FIELDS = config_lib._INT_FIELDS  # pylint: disable=protected-access
FLOAT_FIELDS = config_lib._FLOAT_FIELDS  # pylint: disable=protected-access
CHOICE_FIELDS = (("attention", config_lib.ATTENTION_KINDS),
                 ("mla_decode", config_lib.MLA_DECODE_PATHS),
                 ("rope_layout", config_lib.ROPE_LAYOUTS),
                 ("attention_impl", config_lib.ATTENTION_IMPLS),
                 ("param_dtype", config_lib.DTYPES),
                 ("compute_dtype", config_lib.DTYPES))
BOOL_FIELDS = ("tie_embeddings", "qkv_bias", "o_bias")


@pytest.mark.parametrize("field,minimum", INT_FIELDS,
                         ids=_ids(INT_FIELDS))
@FEW
@given(bad=non_ints())
def test_int_field_refuses_non_int(field, minimum, bad):
  del minimum
  with _raises_naming(f"ModelConfig.{field}", bad):
    ModelConfig(**dict(BASE, **{field: bad}))
  # from_dict goes through the same check: 32.9 (or 32.0) is never
  # truncated to 32.
  with _raises_naming(f"ModelConfig.{field}", bad):
    ModelConfig.from_dict(dict(BASE, **{field: bad}))


@pytest.mark.parametrize("field,minimum", INT_FIELDS,
                         ids=_ids(INT_FIELDS))
@FEW
@given(data=st.data())
def test_int_field_refuses_below_minimum(field, minimum, data):
  bad = data.draw(ints_below(minimum))
  # Before any division: num_heads = 0 is a ValueError, not a
  # ZeroDivisionError from head_dim.
  with _raises_naming(f"ModelConfig.{field} must be an int >= {minimum}",
                      bad):
    ModelConfig(**dict(BASE, **{field: bad}))


# Fields no cross-field rule of BASE touches: any int >= minimum is valid.
FREE_INT_FIELDS = (("vocab_size", 1), ("num_layers", 1), ("mlp_dim", 1),
                   ("max_seq_len", 1), ("sliding_window", 0),
                   ("q_lora_rank", 0), ("kv_lora_rank", 0))


@pytest.mark.parametrize("field,minimum", FREE_INT_FIELDS,
                         ids=_ids(FREE_INT_FIELDS))
@FEW
@given(data=st.data())
def test_valid_int_field_constructs_as_python_int(field, minimum, data):
  value = data.draw(ints_from(minimum))
  c = ModelConfig(**dict(BASE, **{field: value}))
  assert getattr(c, field) == value and type(getattr(c, field)) is int
  assert ModelConfig.from_dict(c.to_dict()) == c


@pytest.mark.parametrize("field,minimum,strict", FLOAT_FIELDS,
                         ids=_ids(FLOAT_FIELDS))
@FEW
@given(data=st.data())
def test_float_field_refuses_non_finite_and_out_of_range(field, minimum,
                                                         strict, data):
  bad = data.draw(bad_floats(minimum, strict))
  with _raises_naming(f"ModelConfig.{field}", bad):
    ModelConfig(**dict(BASE, **{field: bad}))


@pytest.mark.parametrize("field,minimum,strict", FLOAT_FIELDS,
                         ids=_ids(FLOAT_FIELDS))
@FEW
@given(data=st.data())
def test_valid_float_field_constructs(field, minimum, strict, data):
  value = data.draw(good_floats(minimum, strict))
  c = ModelConfig(**dict(BASE, **{field: value}))
  assert getattr(c, field) == value


@pytest.mark.parametrize("field,choices", CHOICE_FIELDS,
                         ids=_ids(CHOICE_FIELDS))
@FEW
@given(bad=st.one_of(st.text(max_size=8), st.integers(), st.none()))
def test_choice_field_refuses_outside_its_set(field, choices, bad):
  hypothesis.assume(bad not in choices)
  with _raises_naming(f"ModelConfig.{field}", bad):
    ModelConfig(**dict(BASE, **{field: bad}))


@pytest.mark.parametrize("field", BOOL_FIELDS)
@FEW
@given(bad=st.one_of(st.integers(), st.text(max_size=5), st.none(),
                     st.floats()))
def test_bool_field_refuses_non_bool(field, bad):
  with _raises_naming(f"ModelConfig.{field}", bad):
    ModelConfig(**dict(BASE, **{field: bad}))


@st.composite
def gqa_configs(draw):
  """Valid GQA / MQA / MHA configs: K | N, H even, D = N·H or an explicit
  head_dim_override."""
  K = draw(st.integers(1, 4))
  N = K * draw(st.integers(1, 4))
  H = 2 * draw(st.integers(1, 8))
  override = draw(st.booleans())
  D = draw(st.integers(1, 64)) if override else N * H
  return dict(vocab_size=draw(st.integers(1, 512)),
              num_layers=draw(st.integers(1, 4)), embed_dim=D, num_heads=N,
              num_kv_heads=K, head_dim_override=H if override else 0,
              mlp_dim=draw(st.integers(1, 64)),
              max_seq_len=draw(st.integers(1, 1 << 16)),
              rope_theta=draw(good_floats(0, True)),
              rms_norm_eps=draw(good_floats(0, False, 1.0)),
              init_scale=draw(good_floats(0, True, 1.0)))


@st.composite
def mla_configs(draw):
  return dict(MLA, kv_lora_rank=draw(st.integers(1, 64)),
              q_lora_rank=draw(st.integers(0, 64)),
              qk_nope_head_dim=draw(st.integers(1, 32)),
              qk_rope_head_dim=2 * draw(st.integers(1, 16)),
              v_head_dim=draw(st.integers(1, 32)),
              num_heads=draw(st.integers(1, 8)))


@FEW
@given(fields=st.one_of(gqa_configs(), mla_configs()))
def test_valid_configs_construct_and_round_trip(fields):
  c = ModelConfig(**fields)
  assert c.groups * c.kv_heads == c.num_heads
  assert c.head_dim >= 1 and c.rope_dim % 2 == 0
  assert ModelConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_from_dict_refuses_integral_float_and_unknown_nested_keys():
  with _raises_naming("ModelConfig.num_layers", 32.0):
    ModelConfig.from_dict(dict(BASE, num_layers=32.0))
  with _raises_naming("ModelConfig.head_dim (alias", 8.0):
    ModelConfig.from_dict(dict(BASE, head_dim=8.0))
  with pytest.raises(ValueError, match=r"rope_scaling fields: \['fctor'\]"):
    ModelConfig.from_dict(dict(BASE, rope_scaling=dict(fctor=2.0)))
  with pytest.raises(ValueError, match=r"moe is missing .*'expert_dim'"):
    ModelConfig.from_dict(dict(BASE, moe=dict(num_experts=4,
                                              experts_per_token=2)))
  with _raises_naming("MoEConfig.num_experts", 0.0):
    ModelConfig.from_dict(dict(BASE, moe=dict(MOE, num_experts=0.0)))
  with pytest.raises(ValueError, match="needs a mapping, got NoneType"):
    ModelConfig.from_dict(None)


@pytest.mark.parametrize("overrides,field", [
    pytest.param(dict(num_heads=4, num_kv_heads=3), "num_kv_heads",
                 id="kv_heads_not_dividing_heads"),
    pytest.param(dict(embed_dim=18, num_heads=4), "embed_dim",
                 id="embed_dim_not_dividing_by_heads"),
    pytest.param(dict(embed_dim=12, num_heads=4), "head_dim",
                 id="odd_head_dim"),
    pytest.param(dict(MLA, qk_rope_head_dim=3), "qk_rope_head_dim",
                 id="mla_odd_rope_dim"),
    pytest.param(dict(MLA, v_head_dim=0), "v_head_dim",
                 id="mla_zero_v_head_dim"),
    pytest.param(dict(rope_scaling=RopeScaling(kind="yarn",
                                               original_max_position=16),
                      rope_theta=1.0), "rope_theta",
                 id="yarn_theta_1_log_zero"),
    pytest.param(dict(num_layers=2, moe=MoEConfig(**MOE,
                                                  first_dense_layers=3)),
                 "first_dense_layers", id="more_dense_layers_than_layers"),
    pytest.param(dict(rope_scaling="linear"), "rope_scaling",
                 id="rope_scaling_not_a_RopeScaling"),
    pytest.param(dict(moe=dict(MOE)), "moe", id="moe_not_a_MoEConfig"),
])
def test_cross_field_rules_name_the_field(overrides, field):
  with pytest.raises(ValueError, match=f"ModelConfig.*{field}"):
    ModelConfig(**dict(BASE, **overrides))


# ---- RopeScaling and MoEConfig -----------------------------------------------
ROPE_FLOATS = (("factor", 0, True), ("low_freq_factor", 0, True),
               ("high_freq_factor", 0, True), ("beta_fast", 0, True),
               ("beta_slow", 0, True), ("mscale", 0, False),
               ("mscale_all_dim", 0, False), ("attention_factor", 0, True))


@pytest.mark.parametrize("field,minimum,strict", ROPE_FLOATS,
                         ids=_ids(ROPE_FLOATS))
@FEW
@given(data=st.data())
def test_rope_scaling_float_refuses(field, minimum, strict, data):
  bad = data.draw(bad_floats(minimum, strict))
  with _raises_naming(f"RopeScaling.{field}", bad):
    RopeScaling(**{field: bad})


@pytest.mark.parametrize("kind", ["llama3", "yarn"])
@FEW
@given(bad=st.one_of(ints_below(1), non_ints()))
def test_rope_original_length_refused_where_divided_by(kind, bad):
  with _raises_naming("RopeScaling.original_max_position", bad):
    RopeScaling(kind=kind, original_max_position=bad)


@FEW
@given(low=good_floats(0, True, 16.0), gap=st.floats(0, 16.0))
def test_llama3_needs_high_above_low_freq_factor(low, gap):
  with pytest.raises(ValueError, match="high_freq_factor"):
    RopeScaling(kind="llama3", original_max_position=16,
                low_freq_factor=low + gap, high_freq_factor=low)


MOE_INTS = (("num_experts", 1), ("experts_per_token", 1), ("expert_dim", 1),
            ("num_shared_experts", 0), ("first_dense_layers", 0),
            ("num_groups", 1), ("topk_groups", 1))


@pytest.mark.parametrize("field,minimum", MOE_INTS,
                         ids=_ids(MOE_INTS))
@FEW
@given(data=st.data())
def test_moe_int_field_refuses(field, minimum, data):
  bad = data.draw(st.one_of(non_ints(), ints_below(minimum)))
  # num_groups = 0 is refused by name before `num_experts % num_groups`.
  with _raises_naming(f"MoEConfig.{field}", bad):
    MoEConfig(**dict(MOE, **{field: bad}))


@FEW
@given(bad=bad_floats(0, True))
def test_moe_scaling_factor_refuses(bad):
  with _raises_naming("MoEConfig.routed_scaling_factor", bad):
    MoEConfig(**MOE, routed_scaling_factor=bad)


@FEW
@given(E=st.integers(1, 64), data=st.data())
def test_moe_experts_per_token_bounded_by_experts(E, data):
  k = data.draw(st.integers(E + 1, E + 100))
  with _raises_naming("MoEConfig.experts_per_token", k):
    MoEConfig(num_experts=E, experts_per_token=k, expert_dim=4)
  MoEConfig(num_experts=E, experts_per_token=data.draw(st.integers(1, E)),
            expert_dim=4)


def test_group_limited_routing_must_keep_enough_experts():
  with pytest.raises(ValueError, match="experts_per_token=3 exceeds the 2"):
    MoEConfig(num_experts=8, experts_per_token=3, expert_dim=4,
              topk_method="group_limited_greedy", num_groups=4,
              topk_groups=1)


# ---- Sampler -----------------------------------------------------------------
@FEW
@given(bad=bad_floats(0, False))
def test_sampler_temperature_refuses(bad):
  with _raises_naming("Sampler.temperature", bad):
    Sampler(temperature=bad)


@FEW
@given(bad=st.one_of(non_ints(), ints_below(1)))
def test_sampler_top_k_refuses(bad):
  with _raises_naming("Sampler.top_k", bad):
    Sampler(temperature=1.0, top_k=bad)


@FEW
@given(bad=bad_floats(0, True, maximum=1.0))
def test_sampler_top_p_refuses(bad):
  with _raises_naming("Sampler.top_p", bad):
    Sampler(temperature=1.0, top_p=bad)


@FEW
@given(t=good_floats(0, False), k=st.one_of(st.none(), ints_from(1)),
       p=good_floats(0, True, 1.0))
def test_valid_sampler_constructs(t, k, p):
  s = Sampler(temperature=t, top_k=k, top_p=p)
  assert (s.temperature, s.top_k, s.top_p) == (t, k, p)
  assert s.top_k is None or type(s.top_k) is int
  hash(s)  # a static argument of the jitted loop


def test_valid_samplers_draw_from_the_kept_tokens():
  logits_BV = jnp.asarray([[0.0, 5.0, 4.0, 3.0, -1.0, -2.0]])
  key = jax.random.key(0)
  assert int(kvjax.GREEDY(logits_BV, key)[0]) == 1
  s = Sampler(temperature=np.float32(0.7), top_k=np.int64(3), top_p=0.9)
  for i in range(4):
    assert int(s(logits_BV, jax.random.fold_in(key, i))[0]) in (1, 2, 3)


# ---- config.json -------------------------------------------------------------
HF_INTS = (
    ("llama", "hidden_size", 1), ("llama", "num_attention_heads", 1),
    ("llama", "num_hidden_layers", 1), ("llama", "vocab_size", 1),
    ("llama", "intermediate_size", 1), ("llama", "max_position_embeddings", 1),
    ("llama", "num_key_value_heads", 1), ("llama", "head_dim", 1),
    ("mistral", "sliding_window", 0), ("qwen2", "sliding_window", 0),
    ("qwen2", "max_window_layers", 0),
    ("v3", "kv_lora_rank", 1), ("v3", "q_lora_rank", 0),
    ("v3", "qk_nope_head_dim", 1), ("v3", "qk_rope_head_dim", 1),
    ("v3", "v_head_dim", 1), ("v3", "n_routed_experts", 1),
    ("v3", "num_experts_per_tok", 1), ("v3", "moe_intermediate_size", 1),
    ("v3", "n_shared_experts", 0), ("v3", "first_k_dense_replace", 0),
    ("v3", "n_group", 1), ("v3", "topk_group", 1),
)


def _hf_with(base: str, path: tuple[str, ...], value) -> dict:
  hf = json.loads(json.dumps(HF_BASES[base]))
  node = hf
  for key in path[:-1]:
    node = node[key]
  node[path[-1]] = value
  return hf


@pytest.mark.parametrize("base,key,minimum", HF_INTS,
                         ids=_ids(HF_INTS))
@FEW
@given(data=st.data())
def test_config_json_int_refused_by_its_key(base, key, minimum, data):
  bad = data.draw(st.one_of(non_ints(), ints_below(minimum)))
  with _raises_naming(f"config.json {key}", bad):
    hf_lib.config_from_hf(_hf_with(base, (key,), bad))


HF_FLOATS = (
    ("llama", ("rope_theta",), 0, True),
    ("llama", ("rms_norm_eps",), 0, False),
    ("llama3", ("rope_parameters", "rope_theta"), 0, True),
    ("llama3", ("rope_parameters", "factor"), 0, True),
    ("llama3", ("rope_parameters", "low_freq_factor"), 0, True),
    ("llama3", ("rope_parameters", "high_freq_factor"), 0, True),
    ("linear", ("rope_scaling", "factor"), 0, True),
    ("yarn", ("rope_parameters", "factor"), 0, True),
    ("yarn", ("rope_parameters", "beta_fast"), 0, False),
    ("yarn", ("rope_parameters", "attention_factor"), 0, True),
    ("v3", ("routed_scaling_factor",), 0, True),
)


@pytest.mark.parametrize(
    "base,path,minimum,strict", HF_FLOATS,
    ids=[f"{base}-{'.'.join(path)}" for base, path, *_ in HF_FLOATS])
@FEW
@given(data=st.data())
def test_config_json_float_refused_by_its_key(base, path, minimum, strict,
                                              data):
  bad = data.draw(bad_floats(minimum, strict))
  name = f"config.json {path[0]}" + "".join(f".{k}" for k in path[1:])
  with _raises_naming(name, bad):
    hf_lib.config_from_hf(_hf_with(base, path, bad))


HF_FLAGS = (("llama", "tie_word_embeddings"), ("llama", "attention_bias"),
            ("qwen2", "use_sliding_window"), ("v3", "norm_topk_prob"),
            ("v3", "rope_interleave"))


@pytest.mark.parametrize("base,key", HF_FLAGS, ids=_ids(HF_FLAGS))
@FEW
@given(bad=st.one_of(st.integers(), st.text(max_size=5), st.floats()))
def test_config_json_flag_refused_by_its_key(base, key, bad):
  with _raises_naming(f"config.json {key}", bad):
    hf_lib.config_from_hf(_hf_with(base, (key,), bad))


@st.composite
def hf_gqa_dicts(draw):
  K = draw(st.integers(1, 4))
  N = K * draw(st.integers(1, 4))
  H = 2 * draw(st.integers(1, 8))
  return dict(
      LLAMA, model_type=draw(st.sampled_from(["llama", "mistral", "qwen2"])),
      hidden_size=N * H, num_attention_heads=N, num_key_value_heads=K,
      vocab_size=draw(st.integers(1, 512)),
      num_hidden_layers=draw(st.integers(1, 4)),
      intermediate_size=draw(st.integers(1, 64)),
      max_position_embeddings=draw(st.integers(1, 1 << 16)),
      rms_norm_eps=draw(good_floats(0, False, 1.0)),
      rope_theta=draw(st.one_of(good_floats(0, True),
                                st.integers(1, 10**6))))


@FEW
@given(hf=hf_gqa_dicts())
def test_valid_config_json_constructs(hf):
  c = hf_lib.config_from_hf(json.loads(json.dumps(hf)))
  assert (c.embed_dim, c.num_heads, c.num_kv_heads, c.vocab_size,
          c.num_layers, c.mlp_dim, c.max_seq_len) == (
              hf["hidden_size"], hf["num_attention_heads"],
              hf["num_key_value_heads"], hf["vocab_size"],
              hf["num_hidden_layers"], hf["intermediate_size"],
              hf["max_position_embeddings"])
  assert c.head_dim * c.num_heads == c.embed_dim
  assert c.rope_theta == hf["rope_theta"] and type(c.rope_theta) is float


@pytest.mark.parametrize("base", sorted(HF_BASES))
def test_each_config_json_base_is_valid(base):
  hf_lib.config_from_hf(HF_BASES[base])


# ---- load_checkpoint: the file itself ---------------------------------------
def _checkpoint_dir(tmp_path, config_bytes: bytes) -> str:
  """A directory with `config_bytes` as config.json and a safetensors file
  that is garbage: any error about the config must come before the tensor
  files are opened (else the message would be about the file)."""
  (tmp_path / "config.json").write_bytes(config_bytes)
  (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)
  return str(tmp_path)


@pytest.mark.parametrize("content,message", [
    (b'{"model_type": "llama", "hidden_size": 16\xff\xfe}', "not UTF-8"),
    (b"\xff\xfe\x00\x00", "not UTF-8"),
    (b'{"model_type": "llama", ', "not valid JSON"),
    (b'["llama"]', "must hold a JSON object, got list"),
], ids=["invalid_utf8_byte", "utf32_bom", "truncated_json", "json_array"])
def test_unreadable_config_json_named(tmp_path, content, message):
  path = _checkpoint_dir(tmp_path, content)
  with pytest.raises(ValueError,
                     match=re.escape(os.path.join(path, "config.json")) +
                     ".*" + message):
    kvjax.load_checkpoint(path)


@settings(max_examples=10, deadline=None, derandomize=True, database=None)
@given(key=st.sampled_from([k for b, k, _ in HF_INTS if b == "llama"]),
       bad=st.one_of(json_non_ints(), st.just(0), st.just(-1)))
def test_load_checkpoint_names_bad_config_key_before_reading(tmp_path_factory,
                                                             key, bad):
  path = _checkpoint_dir(tmp_path_factory.mktemp("ckpt"),
                         json.dumps(dict(LLAMA, **{key: bad})).encode())
  with pytest.raises(ValueError, match=re.escape(
      f"{os.path.join(path, 'config.json')}: config.json {key}")):
    kvjax.load_checkpoint(path)


# ---- params ------------------------------------------------------------------
# The one config that runs (one compile for the whole file).
RUN = ModelConfig(vocab_size=32, num_layers=1, embed_dim=16, num_heads=2,
                  num_kv_heads=1, head_dim_override=8, mlp_dim=32,
                  max_seq_len=16, init_scale=0.1)


@functools.lru_cache(maxsize=None)
def _numpy_params():
  # Values drawn in numpy: no compile of the random draws per leaf shape.
  rng = np.random.default_rng(0)
  shapes = jax.eval_shape(lambda: kvjax.init_params(RUN, jax.random.key(0)))
  return jax.tree_util.tree_map(
      lambda s: (RUN.init_scale * rng.standard_normal(s.shape)).astype(
          np.float32), shapes)


def _params():
  """Fresh params of RUN (new dicts: a test may replace a leaf)."""
  return jax.tree_util.tree_map(jnp.asarray, _numpy_params())


def test_valid_config_from_each_entry_point_runs():
  # The same model through the constructor, from_dict (numpy ints from a
  # config file) and config.json: one config, so one compile.
  hf = dict(model_type="llama", vocab_size=32, hidden_size=16,
            intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=16,
            rms_norm_eps=1e-6, rope_theta=10000)
  from_hf = hf_lib.config_from_hf(hf).replace(init_scale=0.1)
  from_dict = ModelConfig.from_dict(
      {k: np.int64(v) if type(v) is int else v
       for k, v in RUN.to_dict().items()})
  assert from_hf == RUN == from_dict
  logits = kvjax.forward(_params(), from_dict, jnp.zeros((1, 4), jnp.int32))
  assert logits.shape == (1, 4, RUN.vocab_size)
  assert bool(jnp.isfinite(logits).all())


@pytest.mark.parametrize("leaf", [("embed",), ("final_norm",),
                                  ("layers", "attn", "q")],
                         ids=lambda p: ".".join(p))
def test_integer_params_leaf_refused_by_path(leaf):
  params = _params()
  node = params
  for k in leaf[:-1]:
    node = node[k]
  node[leaf[-1]] = node[leaf[-1]].astype(jnp.int32)
  path = "".join(f"['{k}']" for k in leaf)
  with pytest.raises(ValueError, match=re.escape(path) + r" \(int32\)"):
    params_lib.check_params(params, RUN)


@pytest.mark.parametrize("params,kind", [(None, "NoneType"), ([], "list"),
                                         (jnp.zeros(3), "ArrayImpl")],
                         ids=["none", "list", "array"])
def test_non_mapping_params_refused(params, kind):
  with pytest.raises(ValueError,
                     match=f"params must be a dict of arrays, got {kind}"):
    kvjax.forward(params, RUN, jnp.zeros((1, 4), jnp.int32))


# ---- issue 21: every example, pinned -----------------------------------------
def _load_with(tmp_path, **overrides):
  return kvjax.load_checkpoint(_checkpoint_dir(
      tmp_path, json.dumps(dict(LLAMA, **overrides)).encode()))


@pytest.mark.parametrize("make,message", [
    (lambda _: ModelConfig(vocab_size=256.5),
     "ModelConfig.vocab_size must be an int >= 1, got 256.5 (float)"),
    (lambda _: ModelConfig(num_layers=True),
     "ModelConfig.num_layers must be an int >= 1, got True (bool)"),
    (lambda _: Sampler(temperature=float("nan")),
     "Sampler.temperature must be a finite float >= 0, got nan (float)"),
    (lambda _: Sampler(top_k=2.5), "Sampler.top_k"),
    (lambda d: _load_with(d, rope_theta=0),
     "config.json rope_theta must be a finite float > 0.0, got 0 (int)"),
    (lambda d: _load_with(d, rms_norm_eps=-1),
     "config.json rms_norm_eps must be a finite float >= 0.0, got -1 (int)"),
    (lambda d: _load_with(d, hidden_size=32.9),
     "config.json hidden_size must be an int >= 1, got 32.9 (float)"),
    (lambda d: _load_with(d, num_attention_heads=0),
     "config.json num_attention_heads must be an int >= 1, got 0 (int)"),
    (lambda d: _load_with(d, num_key_value_heads=0),
     "config.json num_key_value_heads must be an int >= 1, got 0 (int)"),
    (lambda d: kvjax.load_checkpoint(
        _checkpoint_dir(d, b'{"model_type": "ll\xe4ma"}')),
     "config.json is not UTF-8 text"),
    (lambda _: kvjax.forward(None, RUN, jnp.zeros((1, 4), jnp.int32)),
     "params must be a dict of arrays, got NoneType"),
    (lambda _: params_lib.check_params(
        dict(_params(), embed=_params()["embed"].astype(jnp.int32)), RUN),
     "['embed'] (int32)"),
], ids=["vocab_size_256.5", "num_layers_True", "temperature_nan",
        "top_k_2.5", "config_json_rope_theta_0", "config_json_rms_norm_eps_-1",
        "config_json_hidden_size_32.9", "config_json_zero_heads",
        "config_json_zero_kv_heads", "config_json_non_utf8",
        "forward_params_None", "params_int32_leaf"])
def test_issue_21_examples(tmp_path, make, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    make(tmp_path)
