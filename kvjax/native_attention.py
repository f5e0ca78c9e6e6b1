"""The CPU decode-attention kernels (`kvjax/native/decode_attention.cc`) as
JAX primitives: XLA FFI custom calls, built on first use.

  out_BKGE = decode_attend(q_BKGD, k_tiles, v, mask_BS, scale,
                           k_scale_BKS=None, v_scale_BKS=None,
                           bf16_products='auto')
  o_lat_BNC = latent_attend(q_lat_BNC, q_rope_BNR, c_BSC, r_BSR, mask_BS,
                            scale, c_scale_BS=None, r_scale_BS=None,
                            latent_products='auto')
                                        MLA's absorbed decode (`kvjax.mla`);
                                        latents float32, bfloat16 bits or
                                        int8 codes with per-token scales

Dimension alphabet (`kvjax.config`): B batch, K kv heads, G query heads per
kv head, S cache slots, D key width, E value width (both H for the GQA
family); N query heads, C MLA's latent rank, R its rotary width. Keys
come in tiles of 16 slots (`TILE`), written [B, K, S/16, D, 16] and named
`k_tiles` (the alphabet has no letter for a tile axis).

  keys    [B, K, S/16, D, 16]: tiles of 16 slots, each tile's D × 16 keys
          contiguous (`tile_keys`), so the kernel streams them in order;
          float32, bfloat16 bits (uint16, `kvjax.quant`), or int8 codes
          with per-token float32 scales [B, K, S]; or int4 pairs (uint8,
          `quant.pack_int4`, two codes a byte) as stored: [B, K, S/16,
          D/2, 16] bytes, with scales; S a multiple of 16
  values  [B, K, S, E], the keys' storage (int8: with per-token scales;
          int4 pairs [B, K, S, E/2] bytes)
  mask    bool [B, S], True where a slot may be attended

Semantics are `attention.decode_softmax_values`' in float32: logits =
scale · q · k, masked slots at the lowest float before the softmax (a
fully masked row averages its values), then the values' weighted sum.
Over int8 keys the scaled query is rounded per row as the keys are
(`quant.quantize`) and the logits are integer dots (AVX-512 VNNI where the
host has it, exact float sums of the same integers elsewhere); unlike
`layered.int8_attend` the probabilities are not rounded: int8 values are
converted in registers. int4 codes are read packed and unpacked in
registers to the same integers: the int8 path's arithmetic on the
unpacked codes, to the bit (where E/2 is a multiple of 16), over half
the code bytes. Over bfloat16 keys and values (GQA's; not MLA's latents)
the scaled query and the probabilities are rounded to bfloat16,
FlashAttention's numerics; the products run as AVX-512 BF16's vdpbf16ps
or as float32 multiply-adds of the same exact products in the same order
(the same bits), whichever the host runs faster for the query group
(`bf16_dot_products`: measured once per process; without AVX-512 BF16,
multiply-adds). MLA's absorbed step does N · (2C + R) products per cached
token, so on hosts with AMX (`latent_amx`) its bfloat16 and int8 latents'
logits run as AMX tile products (`latent_products`): int8's are the same
exact integer sums (the same bits as the VNNI and portable paths), and
bfloat16's take the scaled query rounded to bfloat16, as GQA's do.

Why a kernel (the numbers: WORKSPACE.md "Quantized caches, and the
cache-dominated regime"): XLA:CPU runs a decode step's per-(sequence, head)
products, a few query rows against thousands of cached slots, far below
the rate at which the cache can be read, and converts a bfloat16 cache to
float32 in a separate pass before its dots, so a bfloat16 cache was slower
than a float32 one. The kernel reads every cached key and value once, as
stored, with the softmax online, on XLA's own intra-op threads.

The build: `g++ -O3 -march=native -fopenmp-simd` (the host's vector units;
OpenMP's simd pragmas only, no OpenMP runtime) into
$KVJAX_NATIVE_DIR (default ~/.cache/kvjax/native), named by a hash of the
source, the flags (with any in $KVJAX_NATIVE_FLAGS), the compiler and the
CPU, so a changed source or another
host builds anew. `available()` is False, with one logged warning, where no
compiler or no jaxlib FFI headers are found, and when KVJAX_NATIVE=0; the
decode loop then reads the XLA path (`kvjax.decode.plan`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from kvjax import quant

SOURCE = pathlib.Path(__file__).parent / "native" / "decode_attention.cc"
TARGET = "kvjax_decode_attention"
LATENT_TARGET = "kvjax_latent_attention"
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared",
         "-fPIC", "-w")
KEY_DTYPES = (jnp.dtype(jnp.float32), quant.BF16_BITS, jnp.dtype(jnp.int8),
              quant.INT4_PAIRS)
LATENT_DTYPES = (jnp.dtype(jnp.float32), quant.BF16_BITS,  # MLA's latents
                 jnp.dtype(jnp.int8))
TILE = 16  # slots per key tile (the kernel's register width)
QUAD = 4  # int8 channels of a slot kept adjacent (one VNNI product)
PAIR = 2  # bfloat16 channels of a slot kept adjacent (one vdpbf16ps)
# The bfloat16 products' forms (the kernel's `Bf16Form`): 'auto' leaves
# the choice to the kernel's measurement (`bf16_dot_products`).
BF16_PRODUCTS = {"auto": 0, "dot": 1, "fma": 2}
# MLA's latent products (the kernel's `LatentForm`): 'auto' takes AMX tiles
# where `latent_amx` and the latents fit them (`amx_fits`), else 'vector'.
LATENT_PRODUCTS = {"auto": 0, "amx": 1, "vector": 2}


def group_width(dtype) -> int:
  """How many elements of a slot a key tile keeps adjacent for `dtype`:
  4 for int8 codes and for int4 pairs (quads of bytes: 8 codes), 2 for
  bfloat16 bits (pairs), else 1."""
  dtype = jnp.dtype(dtype)
  if dtype in (jnp.dtype(jnp.int8), quant.INT4_PAIRS):
    return QUAD
  return PAIR if dtype == quant.BF16_BITS else 1


def codes_per_element(dtype) -> int:
  """Channels one stored element holds: 2 for int4 pairs, else 1."""
  return 2 if jnp.dtype(dtype) == quant.INT4_PAIRS else 1


def grouped_tiles(k_tiles):
  """Key tiles [B, K, S/16, D, 16] viewed as their channel groups, [B, K,
  S/16, D/w, 16, w] for `group_width` w (a reshape: the same bytes)."""
  B, K, n, D, _ = k_tiles.shape
  w = group_width(k_tiles.dtype)
  return k_tiles.reshape(B, K, n, D // w, TILE, w)


def tile_keys(k_BKSD):
  """Keys [B, K, S, D] as the kernel reads them, [B, K, S/16, D, 16]: each
  tile's D × 16 keys contiguous, channel-major. int8 codes and bfloat16
  bits keep w = `group_width` channels of a slot adjacent, each tile
  [D/w, 16, w] (one VNNI or vdpbf16ps product's operand; D a multiple of
  w), shaped [D, 16] all the same. int4 pairs are tiled as stored bytes
  (D here is the packed width, half the channels), in quads of bytes."""
  B, K, S, D = k_BKSD.shape
  if S % TILE:
    raise ValueError(f"tile_keys: S={S} slots is not a multiple of {TILE}")
  w = group_width(k_BKSD.dtype)
  if D % w:
    raise ValueError(f"tile_keys: {k_BKSD.dtype} keys of D={D} channels, "
                     f"not a multiple of {w} (the kernel's channel groups)")
  groups = k_BKSD.reshape(B, K, S // TILE, TILE, D // w, w)
  return jnp.swapaxes(groups, 3, 4).reshape(B, K, S // TILE, D, TILE)


def untile_keys(k_tiles):
  """The inverse of `tile_keys`: [B, K, S/16, D, 16] -> [B, K, S, D]."""
  B, K, n, D, _ = k_tiles.shape
  return jnp.swapaxes(grouped_tiles(k_tiles), 3, 4).reshape(B, K, n * TILE,
                                                            D)


def _flags() -> tuple[str, ...]:
  """The build's flags: `FLAGS` and any in $KVJAX_NATIVE_FLAGS (e.g.
  `-mno-avx512vnni`, to build the kernel's portable paths on a host that
  has the instructions)."""
  return FLAGS + tuple(os.environ.get("KVJAX_NATIVE_FLAGS", "").split())


def _cpu_id() -> str:
  """What -march=native compiles for: the CPU model and its flags."""
  try:
    with open("/proc/cpuinfo") as f:
      lines = [l for l in f if l.startswith(("model name", "flags"))]
    return "".join(sorted(set(lines)))
  except OSError:
    return platform.processor()


def _build_dir() -> pathlib.Path:
  return pathlib.Path(os.environ.get(
      "KVJAX_NATIVE_DIR", pathlib.Path.home() / ".cache" / "kvjax" / "native"))


def _compiler() -> str | None:
  return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def library_path() -> pathlib.Path:
  """Where the built kernel for this source, compiler and CPU lies."""
  cxx = _compiler() or ""
  key = hashlib.sha256(b"\0".join([
      SOURCE.read_bytes(), " ".join(_flags()).encode(), cxx.encode(),
      _cpu_id().encode(), jax.ffi.include_dir().encode()])).hexdigest()[:16]
  return _build_dir() / f"decode_attention-{key}.so"


def build() -> pathlib.Path:
  """Compiles the kernel unless this source is built for this host already.

  Raises:
    RuntimeError: no C++ compiler, or the compiler's error output.
  """
  path = library_path()
  if path.exists():
    return path
  cxx = _compiler()
  if cxx is None:
    raise RuntimeError("no C++ compiler (set CXX or install g++)")
  path.parent.mkdir(parents=True, exist_ok=True)
  # Built beside its final name and renamed: concurrent builds (test
  # workers) never load a half-written file.
  with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
    out = pathlib.Path(tmp) / path.name
    cmd = [cxx, *_flags(), f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o",
           str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if run.returncode:
      raise RuntimeError(f"{' '.join(cmd)} failed:\n{run.stderr[-4000:]}")
    os.replace(out, path)
  return path


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL:
  """The built kernel library, loaded once (builds it on the first call)."""
  return ctypes.cdll.LoadLibrary(str(build()))


@functools.lru_cache(maxsize=None)
def available() -> bool:
  """Whether the kernel is built and registered for the CPU (builds it on
  the first call; False with KVJAX_NATIVE=0, or when the build fails)."""
  if os.environ.get("KVJAX_NATIVE", "1") == "0":
    return False
  try:
    lib = _library()
    jax.ffi.register_ffi_target(
        TARGET, jax.ffi.pycapsule(lib.KvjaxDecodeAttention), platform="cpu")
    jax.ffi.register_ffi_target(
        LATENT_TARGET, jax.ffi.pycapsule(lib.KvjaxLatentAttention),
        platform="cpu")
  except (RuntimeError, OSError) as e:
    logging.warning("kvjax native decode attention unavailable, the XLA "
                    "path runs instead: %s", e)
    return False
  return True


@functools.lru_cache(maxsize=None)
def bf16_dot_products() -> bool:
  """Whether 'auto' runs the kernel's bfloat16 products as vdpbf16ps
  rather than float32 multiply-adds for query tiles of 4 or more rows
  (GQA's and MQA's groups): the kernel times both in registers once per
  process (`bf16_product_times`) and takes vdpbf16ps where it is ≥ 10 %
  faster per product (on the Intel Xeon, family 6 model 207, it delivers
  half the multiply-add's products per cycle; WORKSPACE.md "Quantized
  caches, and the cache-dominated regime"). Tiles of 1-3 rows (MHA) are
  bound by the bytes they read and take vdpbf16ps wherever the host has
  it. False without AVX-512 BF16."""
  _require("bf16_dot_products")
  return bool(_library().KvjaxBf16DotProducts())


def bf16_product_times() -> dict[str, float]:
  """What `bf16_dot_products` measured: nanoseconds per 16 products (one
  AVX-512 register's lanes) as vdpbf16ps ('dot_ns') and as float32
  multiply-adds ('fma_ns'), and whether 'auto' takes vdpbf16ps for tiles
  of 4 or more rows ('dot'). Both times are 0 without AVX-512 BF16."""
  _require("bf16_product_times")
  out = (ctypes.c_double * 2)()
  _library().KvjaxBf16ProductTimes(out)
  return dict(dot_ns=out[0] * 1e9, fma_ns=out[1] * 1e9,
              dot=bf16_dot_products())


@functools.lru_cache(maxsize=None)
def latent_amx() -> bool:
  """Whether this host runs MLA's bfloat16 and int8 latents on AMX tiles
  (`latent_attend`'s 'auto'): the build has AMX (Intel Xeon from Sapphire
  Rapids) and Linux grants this process the tile state. Where it does, the
  absorbed step's products, N · (2C + R) per cached token, stop binding
  it (WORKSPACE.md "Quantized caches, and the cache-dominated regime")."""
  _require("latent_amx")
  return bool(_library().KvjaxLatentAmx())


def amx_fits(dtype, C: int, R: int) -> bool:
  """Whether latents of `dtype` with C latent and R rotary channels fit the
  kernel's AMX tiles: bfloat16 bits or int8 codes, each latent row whole
  64-byte tile rows, the rotary row whole 4-byte words of at most 64."""
  dtype = jnp.dtype(dtype)
  if dtype not in (quant.BF16_BITS, jnp.dtype(jnp.int8)):
    return False
  elem = dtype.itemsize
  return C > 0 and C * elem % 64 == 0 and R * elem % 4 == 0 and R * elem <= 64


@functools.lru_cache(maxsize=None)
def preferred() -> bool:
  """Whether 'auto' decode takes the kernel (where it is available): on
  hosts with AVX-512 or AVX2; `KVJAX_NATIVE=1` takes it wherever it builds.

  Chosen by measurement (WORKSPACE.md "Quantized caches, and the
  cache-dominated regime"): on AVX-512 hosts (Intel Xeon, AMD EPYC Zen 4)
  and on an AMD EPYC with AVX2 only (its 8-lane paths) the kernel is the
  fastest layout for every kind and variant at batch 1 and 8; on the AVX2
  host at batch 8, 2k-16k, float32: GQA 1.5-1.9x XLA's best view, MQA
  1.6-2.0x, MLA 2.2-3.0x, MHA level with the layered view (0.97-1.04x);
  the quantized kinds 1.3-4.3x.
  """
  if not available():
    return False
  cpu = _cpu_id().split()
  return (os.environ.get("KVJAX_NATIVE") == "1" or "avx512f" in cpu or
          "avx2" in cpu)


def _require(name: str) -> None:
  """Registers the kernel for `name`'s call, or says why it cannot run
  (rather than XLA's "no FFI handler registered" at dispatch)."""
  if not available():
    raise RuntimeError(f"{name}: the native kernel is not available here "
                       "(KVJAX_NATIVE=0, or its build failed: the warning "
                       "logged names why)")


def _check_scales(name: str, int8: bool, *scales) -> None:
  """Per-token scales come with int8 (or int4) codes, and only with them."""
  if any((x is None) == int8 for x in scales):
    raise ValueError(f"{name}: per-token scales go with int8 / int4 codes, "
                     "and only with them")


def _scale_operand(x):
  """A scale array as the kernel takes it: float32, or empty for float
  storage (the FFI call has a fixed operand list)."""
  return jnp.zeros((0,), jnp.float32) if x is None else x.astype(jnp.float32)


def supports(k_dtype, v_dtype) -> str | None:
  """Why the kernel cannot attend keys and values of these dtypes (None
  when it can)."""
  k_dtype, v_dtype = jnp.dtype(k_dtype), jnp.dtype(v_dtype)
  if k_dtype not in KEY_DTYPES or v_dtype != k_dtype:
    return (f"keys {k_dtype} / values {v_dtype}: the kernel reads float32, "
            "bfloat16 bits, int8 codes or int4 pairs, the same for both")
  return None


def decode_attend(q_BKGD, k_tiles, v, mask_BS, scale: float,
                  k_scale_BKS=None, v_scale_BKS=None,
                  bf16_products: str = "auto", layer: int | None = None):
  """Decode attention of one query token per sequence (module docstring).

  Args:
    q_BKGD: queries (cast to float32).
    k_tiles: keys in tiles of 16 slots (`tile_keys`); float32, uint16
      bfloat16 bits, int8 codes or uint8 int4 pairs ([B, K, S/16, D/2,
      16]: the packed bytes tiled).
    v: values [B, K, S, E], stored as the keys are (int4 pairs: [B, K, S,
      E/2]); with `layer`, a stacked cache's [L, B, K, S', E] (S' >= S)
      read in place: layer `layer`'s first S slots.
    mask_BS: bool, True where a slot may be attended.
    scale: softmax scale.
    k_scale_BKS, v_scale_BKS: float32 per-token scales (int8 and int4
      codes only), shaped as the values' slots: [B, K, S], or with
      `layer` [L, B, K, S'].
    bf16_products: over bfloat16 bits, how the products run: 'dot'
      (vdpbf16ps, where the host has it), 'fma' (float32 multiply-adds) or
      'auto' (`bf16_dot_products`); all three give the same bits.
  Returns:
    out_BKGE float32.
  Raises:
    ValueError: shapes or dtypes the kernel does not take.
    RuntimeError: the kernel is not available (`available`).
  """
  if bf16_products not in BF16_PRODUCTS:
    raise ValueError(f"decode_attend: bf16_products={bf16_products!r}, not "
                     f"one of {sorted(BF16_PRODUCTS)}")
  _require("decode_attend")
  B, K, G, D = q_BKGD.shape
  if k_tiles.ndim != 5 or k_tiles.shape[-1] != TILE:
    raise ValueError(f"decode_attend: keys {k_tiles.shape} are not in tiles "
                     f"of {TILE} slots, [B, K, S/{TILE}, D, {TILE}]")
  S = k_tiles.shape[2] * TILE
  why = supports(k_tiles.dtype, v.dtype)
  if why:
    raise ValueError(f"decode_attend: {why}")
  per = codes_per_element(k_tiles.dtype)
  w = group_width(k_tiles.dtype) * per
  if D % w:
    raise ValueError(f"decode_attend: {k_tiles.dtype} keys of D={D} "
                     f"channels, not a multiple of {w} (the kernel's "
                     "channel groups)")
  _check_scales("decode_attend",
                k_tiles.dtype in (jnp.dtype(jnp.int8), quant.INT4_PAIRS),
                k_scale_BKS, v_scale_BKS)
  E = v.shape[-1] * per
  # Per-layer values [B, K, S, E], or with `layer` a stacked cache's [L, B,
  # K, S', E] whose first S slots the kernel reads in place.
  lead = v.shape[:1] if layer is not None else ()
  S_all = v.shape[-2] if lead else S
  want_v = lead + (B, K, S_all, E // per)
  want_k = (B, K, S // TILE, D // per, TILE)
  if (k_tiles.shape != want_k or v.shape != want_v or S_all < S or
      (lead and not 0 <= layer < lead[0])):
    raise ValueError(f"decode_attend: keys {k_tiles.shape} (want {want_k}),"
                     f" values {v.shape} (want {want_v}"
                     + (f" with S' >= {S}, layer {layer} < L" if lead else "")
                     + ")")
  if k_scale_BKS is not None and (k_scale_BKS.shape != want_v[:-1] or
                                  v_scale_BKS.shape != want_v[:-1]):
    raise ValueError(f"decode_attend: scales {k_scale_BKS.shape} / "
                     f"{v_scale_BKS.shape}, want the values' slots "
                     f"{want_v[:-1]}")
  if mask_BS.shape != (B, S):
    raise ValueError(f"decode_attend: mask {mask_BS.shape}, want {(B, S)}")
  call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((B, K, G, E),
                                                       jnp.float32),
                          vmap_method="sequential")
  return call(q_BKGD.astype(jnp.float32), k_tiles, _scale_operand(k_scale_BKS),
              v, _scale_operand(v_scale_BKS), mask_BS.astype(jnp.bool_),
              scale=np.float32(scale),
              bf16_products=np.int64(BF16_PRODUCTS[bf16_products]),
              layer=np.int64(layer or 0))



def latent_attend(q_lat_BNC, q_rope_BNR, c_BSC, r_BSR, mask_BS,
                  scale: float, c_scale_BS=None, r_scale_BS=None,
                  latent_products: str = "auto", layer: int | None = None):
  """MLA's absorbed decode attention (`mla.absorbed_decode`'s semantics) of
  one query token per sequence over per-layer latents, keys and values at
  once.

  Args:
    q_lat_BNC, q_rope_BNR: the absorbed and rotary queries (cast to
      float32).
    c_BSC, r_BSR: latents and rotary keys, float32, bfloat16 bits (uint16)
      or int8 codes, the same for both; with `layer`, a stacked cache's
      [L, B, S', C] and [L, B, S', R] (scales [L, B, S']), read in place:
      layer `layer`'s first S slots, S the mask's.
    mask_BS: bool, True where a slot may be attended.
    scale: softmax scale.
    c_scale_BS, r_scale_BS: float32 per-token scales of int8 codes (and
      only of them): the latent is c · c_scale, the rotary key r · r_scale.
    latent_products: how the logits' products run: 'amx' (AMX tiles:
      over bfloat16 latents with the scaled query rounded to bfloat16;
      over int8 codes the vector path's exact integer sums, so its bits),
      'vector' (float query over bfloat16; int8 logits by VNNI), or 'auto'
      (AMX where `latent_amx` and `amx_fits`, else vector). The values'
      sums are the vector path's in every form, probabilities in float32.
  Returns:
    o_lat_BNC float32, the latent output (before W_UV).
  Raises:
    ValueError: shapes or dtypes the kernel does not take.
    RuntimeError: the kernel is not available (`available`).
  """
  _require("latent_attend")
  B, N, C = q_lat_BNC.shape
  R, S = r_BSR.shape[-1], mask_BS.shape[-1]
  int8 = c_BSC.dtype == jnp.int8
  _check_scales("latent_attend", int8, c_scale_BS, r_scale_BS)
  if (jnp.dtype(c_BSC.dtype) not in LATENT_DTYPES or
      r_BSR.dtype != c_BSC.dtype):
    raise ValueError(f"latent_attend: latents {c_BSC.dtype} / rotary keys "
                     f"{r_BSR.dtype}: float32, bfloat16 bits or int8 codes, "
                     "the same")
  if latent_products not in LATENT_PRODUCTS:
    raise ValueError(f"latent_attend: latent_products={latent_products!r}, "
                     f"not one of {sorted(LATENT_PRODUCTS)}")
  if latent_products == "amx" and not (latent_amx() and
                                       amx_fits(c_BSC.dtype, C, R)):
    raise ValueError(
        f"latent_attend: latent_products='amx' cannot run latents "
        f"{jnp.dtype(c_BSC.dtype)} C={C} R={R} here (latent_amx() is "
        f"{latent_amx()}; `amx_fits` wants bfloat16 / int8 with C·bytes a "
        "multiple of 64 and R·bytes whole words up to 64)")
  # Per-layer arrays [B, S, C], or with `layer` a stacked cache's [L, B,
  # S', C] whose first S slots (the mask's) the kernel reads in place.
  lead = c_BSC.shape[:1] if layer is not None else ()
  S_all = c_BSC.shape[-2]
  if (q_rope_BNR.shape != (B, N, R) or c_BSC.shape != lead + (B, S_all, C) or
      r_BSR.shape != lead + (B, S_all, R) or mask_BS.shape != (B, S) or
      (S > S_all if lead else S != S_all) or
      (lead and not 0 <= layer < lead[0]) or
      (int8 and (c_scale_BS.shape != lead + (B, S_all) or
                 r_scale_BS.shape != lead + (B, S_all)))):
    want = ("[L, B, S', C], [L, B, S', R], [B, S] with S <= S' and layer < L"
            if lead else "[B, S, C], [B, S, R], [B, S]")
    raise ValueError(
        f"latent_attend: q_lat {q_lat_BNC.shape}, q_rope {q_rope_BNR.shape}, "
        f"c {c_BSC.shape}, r {r_BSR.shape}, mask {mask_BS.shape}"
        + (f", layer {layer}" if lead else "")
        + (f", scales {c_scale_BS.shape} / {r_scale_BS.shape}" if int8 else
           "") + f"; want [B, N, C], [B, N, R], {want}"
        + (", scales as the latents' slots" if int8 else ""))
  call = jax.ffi.ffi_call(LATENT_TARGET,
                          jax.ShapeDtypeStruct((B, N, C), jnp.float32),
                          vmap_method="sequential")
  return call(q_lat_BNC.astype(jnp.float32), q_rope_BNR.astype(jnp.float32),
              c_BSC, _scale_operand(c_scale_BS), r_BSR,
              _scale_operand(r_scale_BS), mask_BS.astype(jnp.bool_),
              scale=np.float32(scale),
              latent_products=np.int64(LATENT_PRODUCTS[latent_products]),
              layer=np.int64(layer or 0))
