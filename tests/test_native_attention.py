"""The native CPU decode-attention kernel (`kvjax.native_attention`) and the
decode view that reads it (`kvjax.native_layered`).

The kernel equals a float64 reference of masked softmax attention over the
dequantized cache, for every storage form it reads, every query-group
width (register tiles of 1-4 rows and their remainders), slot counts that
are and are not multiples of its 16-slot tiles and 128-slot blocks, slot
chunks split across threads (batch 1), random masks and fully masked rows
(which average their values, as the XLA path does). Bad operands raise
before any compute. The 'native' layout gives `generate` the stacked
path's tokens and logits, and 'auto' picks it wherever it can run.
"""

import functools
import os
import subprocess
import sys
import tempfile
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import cache as cache_lib
from kvjax import decode
from kvjax import native_attention
from kvjax import native_latent
from kvjax import native_layered
from kvjax import quant
from kvjax.tolerance import assert_close
import cases  # pylint: disable=g-bad-import-order
from tiny_models import teacher_forced_layouts, tiny, tiny_params  # pylint: disable=g-bad-import-order,line-too-long

FORMS = ("float32", "bfloat16", "int8", "int4")
CODES = ("int8", "int4")  # forms whose query the kernel rounds to int8


def operands(form, B, K, G, D, E, S, seed=0):
  """Random queries and a cache in `form` (kernel layouts), and the float64
  keys [B, K, S, D] and values [B, K, S, E] they stand for."""
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, K, G, D)).astype(np.float32)
  k = rng.standard_normal((B, K, S, D)).astype(np.float32)
  v = rng.standard_normal((B, K, S, E)).astype(np.float32)
  if form in CODES:  # int4: packed pairs as stored, the codes unpacked
    storage = jnp.int8 if form == "int8" else quant.INT4_PAIRS
    unpack = quant.unpack_int4 if form == "int4" else lambda x: x
    kc, ks = quant.quantize(jnp.asarray(k), storage)
    vc, vs = quant.quantize(jnp.asarray(v), storage)
    k64 = (np.asarray(unpack(kc), np.float64) *
           np.asarray(ks, np.float64)[..., None])
    v64 = (np.asarray(unpack(vc), np.float64) *
           np.asarray(vs, np.float64)[..., None])
    return q, native_attention.tile_keys(kc), vc, ks, vs, k64, v64
  if form == "bfloat16":
    kb = quant.quantize(jnp.asarray(k), quant.BF16_BITS)[0]
    vb = quant.quantize(jnp.asarray(v), quant.BF16_BITS)[0]
    k64 = np.asarray(quant.dequantize(kb, None, jnp.float32), np.float64)
    v64 = np.asarray(quant.dequantize(vb, None, jnp.float32), np.float64)
    return q, native_attention.tile_keys(kb), vb, None, None, k64, v64
  return (q, native_attention.tile_keys(jnp.asarray(k)), jnp.asarray(v),
          None, None, k.astype(np.float64), v.astype(np.float64))


def rounded_query(q, scale):
  """The kernel's query over int8 keys: q · scale in float32, rounded per
  row to int8 codes as `quant.quantize` rounds (scale max|x| / 127), as
  float64 values (codes times scale)."""
  qs = jnp.asarray(q, jnp.float32) * np.float32(scale)
  codes, q_scale = quant.quantize(qs, jnp.int8)
  return (np.asarray(codes, np.float64) *
          np.asarray(q_scale, np.float64)[..., None])


def bf16_query(q, scale):
  """The kernel's query over bfloat16 keys: q · scale in float32, rounded
  to bfloat16, as float64."""
  qs = jnp.asarray(q, jnp.float32) * np.float32(scale)
  return np.asarray(qs.astype(jnp.bfloat16), np.float64)


def atol(form, v64):
  """The kernel's absolute error bound against `reference`: float32 sums,
  and over bfloat16 values the probabilities rounded to bfloat16 (each
  weight within 2^-9 of itself: at most 2^-9 · max|v| on the output)."""
  return 2e-5 + (2.0 ** -9 * np.abs(v64).max() if form == "bfloat16" else 0)


def reference(q, k64, v64, mask_BS, scale, form="float32"):
  """float64 masked softmax attention; a fully masked row averages. With
  form int8, int4 or bfloat16 the query is the kernel's rounded one
  (`rounded_query`, `bf16_query`)."""
  if form in CODES:
    q, scale = rounded_query(q, scale), 1.0
  elif form == "bfloat16":
    q, scale = bf16_query(q, scale), 1.0
  logits = np.einsum("bkgd,bksd->bkgs", q.astype(np.float64), k64) * scale
  logits = np.where(mask_BS[:, None, None], logits, -np.inf)
  full = ~mask_BS.any(axis=1)
  logits[full] = 0.0  # every slot masked: equal weights
  p = np.exp(logits - logits.max(axis=-1, keepdims=True))
  p /= p.sum(axis=-1, keepdims=True)
  return np.einsum("bkgs,bkse->bkge", p, v64)


def amx_runs(c, C, R) -> bool:
  """Whether the kernel runs latents like `c` (C, R channels) on AMX
  tiles here."""
  return (native_attention.latent_amx() and
          native_attention.amx_fits(jnp.asarray(c).dtype, C, R))


def latent_operands(form, B, N, C, R, S, rng):
  """MLA's absorbed attention operands in `form` (float32, bfloat16 bits,
  int8 codes with per-token scales, each part its own) drawn from `rng`:
  q_lat, q_rope, c, r, the scale keywords of `latent_attend`, and the
  latents and rotary keys as float64."""
  q_lat = rng.standard_normal((B, N, C)).astype(np.float32)
  q_rope = rng.standard_normal((B, N, R)).astype(np.float32)
  c = rng.standard_normal((B, S, C)).astype(np.float32)
  r = rng.standard_normal((B, S, R)).astype(np.float32)
  scales = {}
  if form == "bfloat16":
    c, r = (quant.quantize(jnp.asarray(x), quant.BF16_BITS)[0]
            for x in (c, r))
    c64, r64 = (np.asarray(quant.dequantize(x, None, jnp.float32),
                           np.float64) for x in (c, r))
  elif form == "int8":
    (c, cs), (r, rs) = (quant.quantize(jnp.asarray(x), jnp.int8)
                        for x in (c, r))
    c64, r64 = (np.asarray(x, np.float64) * np.asarray(sc, np.float64)[
        ..., None] for x, sc in ((c, cs), (r, rs)))
    scales = dict(c_scale_BS=cs, r_scale_BS=rs)
  else:
    c64, r64 = c.astype(np.float64), r.astype(np.float64)
  return q_lat, q_rope, c, r, scales, c64, r64


def latent_reference(q_lat, q_rope, c64, r64, mask, scale, form):
  """float64 `latent_attend` on the vector path's numerics: over int8
  codes each query part rounded as its codes are (`rounded_query`)."""
  if form == "int8":
    q64 = np.concatenate([rounded_query(q_lat, scale),
                          rounded_query(q_rope, scale)], -1)[:, None]
    scale = 1.0
  else:
    q64 = np.concatenate([q_lat, q_rope], -1).astype(np.float64)[:, None]
  k64 = np.concatenate([c64, r64], -1)[:, None]
  return reference(q64, k64, c64[:, None], mask, scale)[:, 0]


# Flags of a build without VNNI, AVX-512 BF16 and AMX (the portable
# products), and of one without AVX-512 at all (an AVX2 host's build).
PORTABLE = ("-mno-avx512vnni -mno-avxvnni -mno-avx512bf16 -mno-amx-tile "
            "-mno-amx-bf16 -mno-amx-int8")
NO_AVX512 = "-mno-avx512f " + PORTABLE


def portable_build(calls: dict[str, str], flags: str = PORTABLE,
                   **operands) -> dict[str, np.ndarray]:
  """Each of `calls` (name: an expression over `na`, `jnp` and the arrays
  `o[name]`) evaluated in one subprocess whose kernel is built with
  `flags` ($KVJAX_NATIVE_FLAGS, which name a build of their own beside the
  default one)."""
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "ops.npz")
    np.savez(path, **{k: np.asarray(v) for k, v in operands.items()})
    code = ("import numpy as np, jax.numpy as jnp\n"
            "from kvjax import native_attention as na\n"
            f"o = np.load({path!r})\n")
    for name, call in calls.items():
      out = os.path.join(tmp, name + ".npy")
      code += f"np.save({out!r}, np.asarray({call}))\n"
    env = dict(os.environ, JAX_PLATFORMS="cpu", KVJAX_NATIVE_FLAGS=flags)
    root = os.path.join(os.path.dirname(__file__), "..")
    run = subprocess.run([sys.executable, "-c", code], cwd=root, env=env,
                         capture_output=True, text=True, check=False)
    if run.returncode:
      raise AssertionError(run.stderr[-3000:])
    return {name: np.load(os.path.join(tmp, name + ".npy"))
            for name in calls}



class KernelTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    if not native_attention.available():
      self.fail("the native kernel did not build: " +
                str(native_attention.library_path()))

  # The fast tier: every form and every G, each G at one S (one diagonal
  # through the G x S grid that still meets every S).
  @cases.product(form=FORMS, G=(1, 2, 3, 4, 5, 8), S=(16, 48, 304, 2048),
                 slow=lambda form, G, S: (G, S) not in (
                     (1, 16), (2, 48), (3, 304), (4, 2048), (5, 16),
                     (8, 304)))
  def test_equals_a_float64_reference(self, form, G, S):
    B, K, D, E = 3, 2, 32, 32
    q, k, v, ks, vs, k64, v64 = operands(form, B, K, G, D, E, S, seed=G + S)
    rng = np.random.default_rng(S)
    mask = rng.random((B, S)) < 0.7
    mask[1] = False  # a fully masked row
    mask[2, -1] = True
    scale = D ** -0.5
    out = native_attention.decode_attend(q, k, v, jnp.asarray(mask), scale,
                                         ks, vs)
    want = reference(q, k64, v64, mask, scale, form)
    np.testing.assert_allclose(np.asarray(out), want, rtol=2e-5,
                               atol=atol(form, v64))

  @cases.product(form=FORMS)
  def test_widths_off_the_register_tiles(self, form):
    # D and E not multiples of 16 (tail channels), batch 1 (slot chunks
    # split across threads and combined), slots past several blocks.
    B, K, G, D, E, S = 1, 1, 3, 40, 24, 4112
    q, k, v, ks, vs, k64, v64 = operands(form, B, K, G, D, E, S)
    mask = np.arange(S)[None] < 3000
    out = native_attention.decode_attend(q, k, v, jnp.asarray(mask), 0.3,
                                         ks, vs)
    np.testing.assert_allclose(
        np.asarray(out),
        reference(q, k64, v64, mask, 0.3, form),
        rtol=2e-5, atol=atol(form, v64))

  def test_an_avx2_build_equals_the_reference(self):
    # Without AVX-512 the kernel's loops run on explicit 8-lane forms (GCC
    # keeps a 64-byte vector in memory where no register is that wide);
    # every kind, G across a register tile and past it, value channels off
    # the 8-lane groups, a fully masked row; MLA's latents in every form.
    B, K, D, E, S = 3, 2, 32, 20, 304
    ops, want, calls = {}, {}, {}
    for form in FORMS:
      for G in (1, 4, 5):
        q, k, v, ks, vs, k64, v64 = operands(form, B, K, G, D, E, S,
                                             seed=G)
        mask = np.random.default_rng(G).random((B, S)) < 0.7
        mask[1] = False
        name = f"{form}_{G}"
        ops.update({f"{name}_{x}": y for x, y in zip(
            ("q", "k", "v", "ks", "vs"), (q, k, v, ks, vs)) if y is not None})
        ops[f"{name}_mask"] = mask
        scales = ("None, None" if ks is None else
                  f"jnp.asarray(o['{name}_ks']), jnp.asarray(o['{name}_vs'])")
        calls[name] = (
            f"na.decode_attend(jnp.asarray(o['{name}_q']), "
            f"jnp.asarray(o['{name}_k']), jnp.asarray(o['{name}_v']), "
            f"jnp.asarray(o['{name}_mask']), {D ** -0.5}, {scales})")
        want[name] = (reference(q, k64, v64, mask, D ** -0.5, form),
                      atol(form, v64))
    # MLA's latents: slot groups of 8 / N, a group's last slots one at a
    # time (T = 130), latent channels past the last 8 and past the int8
    # products' last 16 (C = 40), a rotary key of one 16-byte chunk.
    R, T = 16, 130
    for form in ("float32", "bfloat16", "int8"):
      for N, C in ((1, 64), (4, 40), (8, 64)):
        rng = np.random.default_rng(N + C)
        q_lat, q_rope, c, r, scales, c64, r64 = latent_operands(
            form, B, N, C, R, T, rng)
        mask = rng.random((B, T)) < 0.7
        mask[1] = False
        name = f"latent_{form}_{N}"
        arrays = dict(ql=q_lat, qr=q_rope, c=c, r=r, mask=mask, **scales)
        ops.update({f"{name}_{k}": v for k, v in arrays.items()})
        o = {k: f"jnp.asarray(o['{name}_{k}'])" for k in arrays}
        kw = "".join(f", {k}={o[k]}" for k in scales)
        calls[name] = (f"na.latent_attend({o['ql']}, {o['qr']}, {o['c']}, "
                       f"{o['r']}, {o['mask']}, 0.1{kw})")
        want[name] = (latent_reference(q_lat, q_rope, c64, r64, mask, 0.1,
                                       form), 2e-5)
    got = portable_build(calls, flags=NO_AVX512, **ops)
    for name, (ref, tol) in want.items():
      np.testing.assert_allclose(got[name], ref, rtol=2e-5, atol=tol,
                                 err_msg=name)

  def test_int8_rounds_only_the_query(self):
    # Over int8 keys the query is rounded as the keys are; the output stays
    # within that rounding of the unrounded query's attention, and the
    # quad tiles round-trip.
    B, K, G, D, S = 2, 2, 4, 32, 512
    q, k, v, ks, vs, k64, v64 = operands("int8", B, K, G, D, D, S)
    codes = quant.quantize(jnp.asarray(np.asarray(k64, np.float32)),
                           jnp.int8)[0]
    np.testing.assert_array_equal(
        np.asarray(native_attention.untile_keys(k)), np.asarray(codes))
    tiles = np.asarray(native_attention.grouped_tiles(k))
    # slot 21 (tile 1, lane 5), channels 8-11 (quad 2): adjacent bytes
    np.testing.assert_array_equal(tiles[0, 0, 1, 2, 5],
                                  np.asarray(codes)[0, 0, 21, 8:12])
    mask = np.ones((B, S), bool)
    out = np.asarray(native_attention.decode_attend(
        q, k, v, jnp.asarray(mask), D ** -0.5, ks, vs))
    exact = reference(q, k64, v64, mask, D ** -0.5)
    rounded = reference(q, k64, v64, mask, D ** -0.5, "int8")
    np.testing.assert_allclose(out, rounded, rtol=2e-5, atol=2e-5)
    self.assertGreater(np.abs(out - exact).max(), 1e-6)  # it does round
    np.testing.assert_allclose(out, exact, atol=2e-2)

  @cases.product(E=(32, 64, 40))
  def test_int4_gives_int8s_bits_on_the_unpacked_codes(self, E):
    # Read packed and unpacked in registers, int4 pairs give the int8
    # path's output over the same codes unpacked, to the bit where E/2 is a
    # multiple of 16 (the same products in the same order); E = 40: the
    # value bytes past the last 16 in another order, within float32 sums.
    B, K, G, D, S = 2, 2, 8, 32, 304
    q, k, v, ks, vs, k64, v64 = operands("int4", B, K, G, D, E, S, seed=E)
    mask = jnp.asarray(np.random.default_rng(E).random((B, S)) < 0.8)
    packed = np.asarray(native_attention.untile_keys(k))
    self.assertEqual(packed.shape, (B, K, S, D // 2))
    codes = quant.unpack_int4(jnp.asarray(packed))
    out = np.asarray(native_attention.decode_attend(q, k, v, mask, 0.25, ks,
                                                    vs))
    want = np.asarray(native_attention.decode_attend(
        q, native_attention.tile_keys(codes), quant.unpack_int4(v), mask,
        0.25, ks, vs))
    if E % 32 == 0:
      np.testing.assert_array_equal(out, want)
    else:
      np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(
        out, reference(q, k64, v64, np.asarray(mask), 0.25, "int4"),
        rtol=2e-5, atol=2e-5)

  @pytest.mark.slow  # builds the kernel a second time (~30 s)
  def test_portable_paths_give_the_same_bits(self):
    # Built without VNNI, AVX-512 BF16 and AMX (the portable paths: the groups'
    # codes or bits unpacked, float multiply-adds of the same exact
    # products in the same order) the kernel gives the same bits for int8
    # and int4 keys, bfloat16 keys and values, and MLA's int8 latents
    # (AMX's tiles included, where the host has them). E = 40: value
    # channels past the last 16; C = 72, R = 12: a full and a partial
    # 64-channel chunk, T = 301: slots off the 16 / G slot groups.
    B, K, G, D, E, S = 2, 2, 8, 32, 40, 304
    rng = np.random.default_rng(1)
    mask = rng.random((B, S)) < 0.8
    ops, calls, here = dict(mask=mask), {}, {}
    for form in ("int8", "int4", "bfloat16"):
      q, k, v, ks, vs, _, _ = operands(form, B, K, G, D, E, S, seed=5)
      ops.update({f"q_{form}": q, f"k_{form}": k, f"v_{form}": v})
      scales = (ks, vs) if form in CODES else ()
      if scales:
        ops.update({f"ks_{form}": ks, f"vs_{form}": vs})
      calls[form] = (
          f"na.decode_attend(o['q_{form}'], jnp.asarray(o['k_{form}']), "
          f"jnp.asarray(o['v_{form}']), jnp.asarray(o['mask']), 0.25"
          + (f", o['ks_{form}'], o['vs_{form}'])" if scales else ")"))
      here[form] = native_attention.decode_attend(
          q, k, v, jnp.asarray(mask), 0.25, *scales)
    # MLA's int8 latents at two shapes: C = 72, R = 12 (off AMX's tiles),
    # and C = 128, R = 16, which fit them: where the host has AMX ('auto'
    # takes it there), int8 logits as tile products give the portable
    # path's bits too.
    N, T = 6, 301
    lmask = rng.random((B, T)) < 0.8
    ops.update(lmask=lmask)
    for name, C, R in (("latent", 72, 12), ("latent_tiles", 128, 16)):
      q_lat, q_rope = (rng.standard_normal((B, N, W)).astype(np.float32)
                       for W in (C, R))
      (c, cs), (r, rs) = (
          quant.quantize(jnp.asarray(rng.standard_normal((B, T, W)),
                                     jnp.float32), jnp.int8) for W in (C, R))
      arrays = dict(ql=q_lat, qr=q_rope, c=c, r=r, cs=cs, rs=rs)
      ops.update({f"{k}_{name}": v for k, v in arrays.items()})
      o = {k: f"o['{k}_{name}']" for k in arrays}
      calls[name] = (
          f"na.latent_attend({o['ql']}, {o['qr']}, jnp.asarray({o['c']}), "
          f"jnp.asarray({o['r']}), jnp.asarray(o['lmask']), 0.2, {o['cs']}, "
          f"{o['rs']})")
      here[name] = native_attention.latent_attend(
          q_lat, q_rope, c, r, jnp.asarray(lmask), 0.2, cs, rs)
    portable = portable_build(calls, **ops)
    for name, out in here.items():
      np.testing.assert_array_equal(portable[name], np.asarray(out),
                                    err_msg=name)

  @cases.product(G=(1, 4, 8), E=(32, 40))
  def test_bf16_product_forms_give_the_same_bits(self, G, E):
    # vdpbf16ps ('dot', where the host has AVX-512 BF16) and float32
    # multiply-adds ('fma') add the same exact products in the same order;
    # 'auto' takes one of them (`bf16_dot_products`). E = 40: value
    # channels past the last 16; S = 304: a block's odd tile at its end.
    B, K, D, S = 2, 2, 32, 304
    q, k, v, _, _, k64, v64 = operands("bfloat16", B, K, G, D, E, S, seed=G)
    mask = jnp.asarray(np.random.default_rng(E).random((B, S)) < 0.8)
    outs = {form: np.asarray(native_attention.decode_attend(
        q, k, v, mask, 0.25, bf16_products=form))
            for form in native_attention.BF16_PRODUCTS}
    np.testing.assert_array_equal(outs["dot"], outs["fma"])
    np.testing.assert_array_equal(outs["auto"], outs["fma"])
    np.testing.assert_allclose(
        outs["fma"], reference(q, k64, v64, np.asarray(mask), 0.25,
                               "bfloat16"), rtol=2e-5,
        atol=atol("bfloat16", v64))
    times = native_attention.bf16_product_times()
    self.assertEqual(times["dot"], native_attention.bf16_dot_products())
    if times["dot_ns"] > 0:  # measured (an AVX-512 BF16 build)
      self.assertGreater(times["fma_ns"], 0)
      self.assertEqual(times["dot"], times["dot_ns"] * 1.1 < times["fma_ns"])
    else:
      self.assertFalse(times["dot"])

  def test_unknown_bf16_products_is_refused(self):
    q, k, v, _, _, _, _ = operands("bfloat16", 1, 1, 2, 32, 32, 32)
    with self.assertRaisesRegex(ValueError, "bf16_products"):
      native_attention.decode_attend(q, k, v, jnp.ones((1, 32), bool), 1.0,
                                     bf16_products="vnni")

  def test_masked_slots_contribute_nothing(self):
    # Huge values behind the mask change nothing.
    B, K, G, D, S = 2, 2, 4, 32, 256
    q, k, v, _, _, _, _ = operands("float32", B, K, G, D, D, S)
    mask = np.arange(S)[None].repeat(B, 0) < 100
    poisoned = v.at[:, :, 100:].set(1e30)
    a = native_attention.decode_attend(q, k, v, jnp.asarray(mask), 0.2)
    b = native_attention.decode_attend(q, k, poisoned, jnp.asarray(mask), 0.2)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  def test_runs_under_jit_and_scan(self):
    B, K, G, D, S = 2, 2, 4, 32, 256
    q, k, v, _, _, k64, v64 = operands("float32", B, K, G, D, D, S)
    mask = jnp.ones((B, S), bool)

    @jax.jit
    def steps(q):
      def body(q, _):
        out = native_attention.decode_attend(q, k, v, mask, 0.2)
        return q, out
      return jax.lax.scan(body, q, None, length=3)[1]

    out = steps(q)
    want = reference(q, k64, v64, np.asarray(mask), 0.2)
    for i in range(3):
      np.testing.assert_allclose(np.asarray(out[i]), want, rtol=2e-5,
                                 atol=2e-5)

  @parameterized.named_parameters(
      ("float16", "float16", "float32, bfloat16 bits, int8 codes or int4"),
      ("int4_width", "int4_width", "not a multiple of 8"),
      ("mixed", "mixed", "the same for both"),
      ("scales_on_floats", "float_scales", "per-token scales"),
      ("no_scales_on_int8", "int8_no_scales", "per-token scales"),
      ("mask", "mask", "mask"),
      ("keys", "keys", "keys"),
  )
  def test_bad_operands_are_refused_before_compute(self, form, match):
    B, K, G, D, S = 2, 2, 4, 32, 64
    q, k, v, ks, vs, _, _ = operands("int8", B, K, G, D, D, S)
    fk, fv = jnp.zeros((B, K, S // 16, D, 16)), jnp.zeros((B, K, S, D))
    mask = jnp.ones((B, S), bool)
    call = {
        "float16": lambda: native_attention.decode_attend(
            q, fk.astype(jnp.float16), fv.astype(jnp.float16), mask, 1.0),
        "mixed": lambda: native_attention.decode_attend(q, fk, v, mask, 1.0),
        "float_scales": lambda: native_attention.decode_attend(
            q, fk, fv, mask, 1.0, ks, vs),
        "int8_no_scales": lambda: native_attention.decode_attend(
            q, k, v, mask, 1.0),
        "mask": lambda: native_attention.decode_attend(
            q, k, v, mask[:, :10], 1.0, ks, vs),
        "keys": lambda: native_attention.decode_attend(
            q, fk[:, :, :, :16], fv, mask, 1.0),
        # int4 pairs of D = 4 channels: a quad of bytes would span 8
        "int4_width": lambda: native_attention.decode_attend(
            q[..., :4], jnp.zeros((B, K, S // 16, 2, 16), quant.INT4_PAIRS),
            jnp.zeros((B, K, S, 2), quant.INT4_PAIRS), mask, 1.0, ks, vs),
    }[form]
    with self.assertRaisesRegex(ValueError, match):
      call()

  def test_the_build_is_named_by_source_and_host(self):
    path = native_attention.library_path()
    self.assertTrue(path.exists(), path)
    self.assertEqual(native_attention.build(), path)  # built once


class LatentKernelTest(parameterized.TestCase):

  # The fast tier: every form and every N, each N at one S. N of 3 and 6
  # give query tiles of 3 and 2 rows (on AVX2's 4-row tiles and AVX-512's
  # 8), whose slot groups' lanes hold 2 and 4 slots per row.
  @cases.product(form=("float32", "bfloat16", "int8"),
                 N=(1, 3, 4, 6, 8, 16), S=(1, 130, 2048),
                 slow=lambda form, N, S: (N, S) not in (
                     (1, 130), (3, 130), (4, 2048), (6, 130), (8, 1),
                     (16, 130)))
  def test_equals_a_float64_reference(self, form, N, S):
    # MLA's absorbed attention: keys [c | r], values c (one latent shared
    # by the N heads: K = 1, G = N); C not a multiple of 16 on one case.
    B, C, R = 2, 40 if N == 4 else 64, 16
    rng = np.random.default_rng(N + S)
    q_lat, q_rope, c, r, scales, c64, r64 = latent_operands(
        form, B, N, C, R, S, rng)
    mask = rng.random((B, S)) < 0.6
    mask[0, 0] = True
    mask[1] = False  # a fully masked row
    scale = 0.1
    outs = {}
    for products in native_attention.LATENT_PRODUCTS:
      call = functools.partial(
          native_attention.latent_attend, q_lat, q_rope, jnp.asarray(c),
          jnp.asarray(r), jnp.asarray(mask), scale,
          latent_products=products, **scales)
      if products == "amx" and not amx_runs(c, C, R):
        with self.assertRaisesRegex(ValueError, "latent_products='amx'"):
          call()
        continue
      outs[products] = np.asarray(call())
    k64 = np.concatenate([c64, r64], -1)[:, None]
    for products, out in outs.items():
      if form == "int8":  # each query part rounded as its codes are
        q64 = np.concatenate([rounded_query(q_lat, scale),
                              rounded_query(q_rope, scale)], -1)[:, None]
        want_scale = 1.0
      elif form == "bfloat16" and (products == "amx" or (
          products == "auto" and amx_runs(c, C, R))):
        # AMX's bfloat16 products: the scaled query rounded to bfloat16
        q64 = np.concatenate([bf16_query(q_lat, scale),
                              bf16_query(q_rope, scale)], -1)[:, None]
        want_scale = 1.0
      else:
        q64 = np.concatenate([q_lat, q_rope], -1).astype(np.float64)[:, None]
        want_scale = scale
      want = reference(q64, k64, c64[:, None], mask, want_scale)[:, 0]
      np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5,
                                 err_msg=products)
    if "amx" in outs:
      # int8 logits are exact integer sums on either path: the same bits.
      np.testing.assert_array_equal(outs["auto"], outs["amx"])
      if form == "int8":
        np.testing.assert_array_equal(outs["amx"], outs["vector"])
    else:
      np.testing.assert_array_equal(outs["auto"], outs["vector"])

  def test_amx_fits_bfloat16_and_int8_in_whole_tile_rows(self):
    fits = native_attention.amx_fits
    self.assertTrue(fits(quant.BF16_BITS, 128, 16))
    self.assertTrue(fits(quant.BF16_BITS, 32, 32))
    self.assertTrue(fits(jnp.int8, 64, 64))
    self.assertTrue(fits(jnp.int8, 256, 0))
    self.assertFalse(fits(jnp.float32, 128, 16))  # no float32 tiles
    self.assertFalse(fits(quant.BF16_BITS, 40, 16))  # 80 bytes a row
    self.assertFalse(fits(quant.BF16_BITS, 64, 34))  # 68 rotary bytes
    self.assertFalse(fits(jnp.int8, 64, 6))  # not whole words
    self.assertFalse(fits(jnp.int8, 32, 16))

  def test_bad_operands_are_refused_before_compute(self):
    q, c = jnp.zeros((2, 4, 32)), jnp.zeros((2, 64, 32))
    qr, r = jnp.zeros((2, 4, 8)), jnp.zeros((2, 64, 8))
    mask = jnp.ones((2, 64), bool)
    with self.assertRaisesRegex(ValueError, "float32, bfloat16 bits or int8"):
      native_attention.latent_attend(q, qr, c.astype(jnp.float16),
                                     r.astype(jnp.float16), mask, 1.0)
    with self.assertRaisesRegex(ValueError, "the same"):
      native_attention.latent_attend(q, qr, c, r.astype(jnp.int8), mask, 1.0)
    with self.assertRaisesRegex(ValueError, "per-token scales"):
      native_attention.latent_attend(q, qr, c.astype(jnp.int8),
                                     r.astype(jnp.int8), mask, 1.0)
    with self.assertRaisesRegex(ValueError, "per-token scales"):
      native_attention.latent_attend(q, qr, c, r, mask, 1.0,
                                     jnp.ones((2, 64)), jnp.ones((2, 64)))
    with self.assertRaisesRegex(ValueError, "want"):
      native_attention.latent_attend(q, qr, c.astype(jnp.int8),
                                     r.astype(jnp.int8), mask, 1.0,
                                     jnp.ones((2, 64)), jnp.ones((2, 10)))
    with self.assertRaisesRegex(ValueError, "want"):
      native_attention.latent_attend(q, qr, c, r[:, :10], mask, 1.0)
    with self.assertRaisesRegex(ValueError, "latent_products='tiles'"):
      native_attention.latent_attend(q, qr, c, r, mask, 1.0,
                                     latent_products="tiles")
    with self.assertRaisesRegex(ValueError, "latent_products='amx'"):
      native_attention.latent_attend(q, qr, c, r, mask, 1.0,  # float32
                                     latent_products="amx")


class NativeViewTest(parameterized.TestCase):

  def _generate(self, variant, kv, layout, batch=2, prompt=6, new=12,
                capacity=128):
    config = tiny(variant)
    params = kvjax.pack(tiny_params(variant), config)
    tokens = jax.random.randint(jax.random.key(3), (batch, prompt), 0,
                                config.vocab_size)
    ids, logits, _ = kvjax.generate(
        params, config, tokens, new, capacity=capacity,
        policy=cache_lib.CachePolicy(kv_dtype=kv), return_logits=True,
        decode_layout=layout)
    return np.asarray(ids), np.asarray(logits)

  @cases.named(
      [dict(variant=v, kv=k) for v in ("mha", "mqa", "gqa")
       for k in native_layered.NATIVE_DTYPES] +
      [dict(variant="mla", kv=k) for k in native_latent.NATIVE_LATENT_DTYPES],
      slow=lambda variant, kv: variant not in cases.FAST_VARIANTS)
  def test_generate_equals_the_stacked_path(self, variant, kv):
    if kv in ("int8", "int4") or (kv == "bfloat16" and (
        variant != "mla" or native_attention.latent_amx())):
      # Over int8 codes the kernel rounds the query as the keys are, over
      # bfloat16 (GQA's, and MLA's on AMX tiles) the query (and GQA's
      # probabilities) to bfloat16, so a random model's greedy tokens can
      # flip at a near-tie: the tokens are given, and the logits agree
      # within the storage's tolerance.
      out = teacher_forced_layouts(variant, kv, 2, ("stacked", "native"))
      assert_close(out["native"][1], out["stacked"][1], tiny(variant),
                   cache=kv)
      return
    ids, logits = self._generate(variant, kv, "native")
    ref_ids, ref_logits = self._generate(variant, kv, "stacked")
    np.testing.assert_array_equal(ids, ref_ids)
    # Both read the stored codes in float32 and differ in summation order
    # only; in a bfloat16 or integer cache that can move a later token's
    # stored code by one step, hence the storage's tolerance.
    assert_close(logits, ref_logits, tiny(variant), cache=kv)

  @cases.product(form=FORMS, slow=lambda form: form in ("bfloat16", "int4"))
  def test_stacked_values_read_in_place_equal_a_layer_of_them(self, form):
    # decode_attend(layer=l) over a stacked cache's values [L, B, K, S', E]
    # (and scales) reads layer l's first S slots: the per-layer call's bits.
    B, K, G, D, S_all, S = 2, 2, 3, 32, 64, 32
    layers = [operands(form, B, K, G, D, D, S_all, seed=i) for i in range(3)]
    q, kt, v, ks, vs = layers[1][:5]
    mask = jnp.asarray(np.random.default_rng(5).random((B, S)) < 0.9)
    keys = kt[:, :, :S // native_attention.TILE]
    want = native_attention.decode_attend(
        q, keys, v[:, :, :S], mask, 0.3,
        None if ks is None else ks[..., :S],
        None if vs is None else vs[..., :S])
    stack = lambda i: (None if layers[0][i] is None else
                       jnp.stack([jnp.asarray(x[i]) for x in layers]))
    got = native_attention.decode_attend(q, keys, stack(2), mask, 0.3,
                                         stack(3), stack(4), layer=1)
    np.testing.assert_array_equal(got, want)
    with self.assertRaisesRegex(ValueError, "layer 3 < L"):
      native_attention.decode_attend(q, keys, stack(2), mask, 0.3, stack(3),
                                     stack(4), layer=3)

  @cases.product(form=("float32", "bfloat16", "int8"))
  def test_stacked_latents_read_in_place_equal_a_layer_of_them(self, form):
    B, N, C, R, S_all, S = 2, 4, 32, 8, 64, 40
    layers = [latent_operands(form, B, N, C, R, S_all,
                              np.random.default_rng(i)) for i in range(3)]
    q_lat, q_rope, c, r, sc = layers[1][:5]
    mask = jnp.asarray(np.random.default_rng(5).random((B, S)) < 0.9)
    want = native_attention.latent_attend(
        q_lat, q_rope, c[:, :S], r[:, :S], mask, 0.3,
        **{k: x[:, :S] for k, x in sc.items()})
    stack = lambda get: jnp.stack([jnp.asarray(get(x)) for x in layers])
    got = native_attention.latent_attend(
        q_lat, q_rope, stack(lambda x: x[2]), stack(lambda x: x[3]), mask,
        0.3, **{k: stack(lambda x, k=k: x[4][k]) for k in sc}, layer=1)
    np.testing.assert_array_equal(got, want)

  def test_int4_view_holds_the_stored_pairs(self):
    # The kernel's view of an int4 cache keeps its key pairs as stored
    # (uint8, H/2 bytes a slot: half an int8 view's code bytes) and reads
    # its values in the cache itself; writing it back gives the cache bit
    # for bit.
    config = tiny("gqa")
    cache = cache_lib.init_cache(
        config, 2, 64, policy=cache_lib.CachePolicy(kv_dtype="int4"))
    rng = np.random.default_rng(0)
    cache = cache.replace(
        k=jnp.asarray(rng.integers(0, 256, cache.k.shape), jnp.uint8),
        v=jnp.asarray(rng.integers(0, 256, cache.v.shape), jnp.uint8))
    view = native_layered.from_cache(cache, 32)
    L, B, K, _, H2 = cache.k.shape
    self.assertLen(view.k, L)
    self.assertEqual(view.k[0].dtype, quant.INT4_PAIRS)
    self.assertEqual(view.k[0].shape, (B, K, 2, H2, 16))
    self.assertIs(view.stacked.v, cache.v)  # values read in place
    back = native_layered.into_cache(cache, view)
    np.testing.assert_array_equal(np.asarray(back.k), np.asarray(cache.k))
    np.testing.assert_array_equal(np.asarray(back.v), np.asarray(cache.v))

  def test_auto_takes_the_xla_views_where_the_kernel_is_not_preferred(self):
    config = tiny("gqa")
    params = kvjax.pack(tiny_params("gqa"), config)
    with mock.patch.object(native_attention, "preferred", return_value=False):
      for kv in ("float32", "int8"):
        plan = decode.plan(params, config,
                           cache_lib.CachePolicy(kv_dtype=kv), 8, 100, 2000,
                           4096)
        self.assertNotIn("native", plan.layouts + (plan.layout,), kv)
        self.assertIn("layered", plan.layouts + (plan.layout,), kv)

  def test_preferred_where_it_was_measured_faster(self):
    # AVX-512 and AVX2 hosts: the kernel (every kind was measured faster
    # there); a host with neither: XLA's views, unless KVJAX_NATIVE=1.
    for flags_line, env, want in (
        ("flags : avx2 avx512f", {}, True),
        ("flags : avx2 fma", {}, True),
        ("flags : sse4_2", {}, False),
        ("flags : sse4_2", {"KVJAX_NATIVE": "1"}, True)):
      native_attention.preferred.cache_clear()
      with mock.patch.object(native_attention, "_cpu_id",
                             return_value=flags_line), \
           mock.patch.dict(os.environ, env), \
           mock.patch.object(native_attention, "available",
                             return_value=True):
        self.assertEqual(native_attention.preferred(), want,
                         (flags_line, env))
    native_attention.preferred.cache_clear()

  @mock.patch.object(native_attention, "preferred", return_value=True)
  def test_auto_picks_the_kernel_wherever_it_runs(self, _):
    config = tiny("gqa")
    params = kvjax.pack(tiny_params("gqa"), config)
    for kv in native_layered.NATIVE_DTYPES:
      for batch in (1, 8):
        plan = decode.plan(params, config, cache_lib.CachePolicy(kv_dtype=kv),
                           batch, 100, 2000, 4096)
        self.assertEqual({plan.segment_layout(i)
                          for i in range(len(plan.schedule))}, {"native"},
                         (kv, batch))
    mla_config = tiny("mla")
    mla_params = kvjax.pack(tiny_params("mla"), mla_config)
    # MLA's latents in every stored form, int8 / int4 codes included.
    self.assertEqual(native_latent.NATIVE_LATENT_DTYPES,
                     ("float32", "bfloat16", "int8", "int4"))
    for kv in native_latent.NATIVE_LATENT_DTYPES:
      plan = decode.plan(mla_params, mla_config,
                         cache_lib.CachePolicy(kv_dtype=kv), 8, 100, 2000,
                         4096)
      self.assertEqual(plan.layout, "native", kv)
    # float16 and KIVI's channel keys stay on the XLA views.
    plan = decode.plan(params, config,
                       cache_lib.CachePolicy(kv_dtype="float16"), 8, 100,
                       2000, 4096)
    self.assertNotIn("native", plan.layouts + (plan.layout,))

  def test_refuses_what_it_cannot_read(self):
    config = tiny("gqa")
    params = kvjax.pack(tiny_params("gqa"), config)
    for policy, match in (
        (cache_lib.CachePolicy(kv_dtype="float16"), "float16"),
        (cache_lib.CachePolicy(eviction="window"), "decode segments"),
        (cache_lib.CachePolicy(kv_dtype="int8", key_quant="channel"),
         "key_quant='channel'")):
      with self.assertRaisesRegex(ValueError, match):
        decode.plan(params, config, policy, 2, 6, 12, 128,
                    decode_layout="native")

  def test_without_the_kernel_the_xla_path_runs(self):
    # KVJAX_NATIVE=0: not available, 'auto' plans the XLA layouts, and an
    # explicit 'native' says why not.
    code = (
        "import kvjax, jax\n"
        "from kvjax import native_attention, decode, cache as c\n"
        "import sys; sys.path.insert(0, 'tests')\n"
        "from tiny_models import tiny, tiny_params\n"
        "assert not native_attention.available()\n"
        "cfg = tiny('gqa'); p = kvjax.pack(tiny_params('gqa'), cfg)\n"
        "plan = decode.plan(p, cfg, c.CachePolicy(kv_dtype='int8'), 8, 100,"
        " 2000, 4096)\n"
        "assert 'native' not in plan.layouts + (plan.layout,), plan\n"
        "try:\n"
        "  decode.plan(p, cfg, c.CachePolicy(), 8, 100, 2000, 4096,"
        " decode_layout='native')\n"
        "except ValueError as e:\n"
        "  assert 'native' in str(e), e\n"
        "else:\n"
        "  raise AssertionError('no error')\n")
    root = os.path.join(os.path.dirname(__file__), "..")
    env = dict(os.environ, KVJAX_NATIVE="0", JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", code], cwd=root, env=env,
                         capture_output=True, text=True, check=False)
    self.assertEqual(run.returncode, 0, run.stderr[-3000:])


if __name__ == "__main__":
  absltest.main()
