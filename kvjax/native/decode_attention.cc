// Decode attention (one query token per sequence) over a per-layer KV cache,
// as an XLA FFI custom call for the CPU (`kvjax.native_attention`).
//
// Why a kernel: XLA:CPU runs a decode step's per-(sequence, head) products
// (a few query rows against thousands of cached keys) well below the rate
// at which the cache can be read, and converts a bfloat16 or int8 cache to
// float32 in a separate pass before its dots. This kernel reads each cached
// key and value once, as stored, converts in registers and keeps the
// softmax online (one pass, no [.., S] logits in memory), so a step costs
// the time to read the cache's bytes.
//
// Shapes (the dimension alphabet of kvjax.config):
//   q       f32   [B, K, G, D]   queries, grouped by the kv head serving them
//   k       T     [B, K, S/16, D, 16]  keys in tiles of 16 slots (T: f32,
//                                bf16 bits as u16, s8, or u8 int4 pairs:
//                                [B, K, S/16, D/2, 16] bytes, D a multiple
//                                of 8); S a multiple of 16.
//                                s8 tiles hold [D/4, 16, 4] (four channels
//                                of a slot adjacent: `quad` tiles), D a
//                                multiple of 4; bf16 tiles [D/2, 16, 2]
//                                (`pair` tiles), D even
//   k_scale f32   [B, K, S]      per-token key scales (s8, u8; else [0])
//   v       T     [B, K, S, E]   values (u8: [B, K, S, E/2], two a byte)
//   v_scale f32   [B, K, S]      per-token value scales (s8, u8; else [0])
//   mask    pred  [B, S]         True where a slot may be attended
//   out     f32   [B, K, G, E]
// attrs: scale (softmax scale, f32).
//
// Semantics are those of `attention.decode_softmax_values`: logits = scale
// * q.k (times the key scale), masked slots set to the lowest float before
// the softmax, so a fully masked row averages its values (finite, never
// NaN). Over int8 keys the scaled query is rounded as the keys are (per
// row, symmetric int8: `quant.quantize`) and the logits are integer dot
// products, q_scale · k_scale · (q_codes · k_codes): AVX-512 VNNI's
// vpdpbusd takes four channels' products a lane per instruction where
// float32 multiply-adds take one. int4 codes are read packed, two a byte,
// and unpacked in registers to the same integers (so a step reads half an
// int8 cache's code bytes). Over bfloat16 keys and values the query
// and the probabilities are rounded to bfloat16 (FlashAttention's
// numerics: bf16 products, float32 sums and softmax) and AVX-512 BF16's
// vdpbf16ps takes two products a lane per instruction.
//
// Work: tasks of (sequence, kv head, slot chunk) on XLA's intra-op thread
// pool; each walks its slots in blocks of 128 with the online softmax, the
// logits of up to eight query rows in registers (16 slots at a time) while
// the D key rows stream by, then the values' weighted sums (16 channels at
// a time). Chunks of one (sequence, head) are combined at the end. MLA's
// latents are rows (they are the values too), so its logits are dot
// products over each slot's row, 16 / G slots at a time, their lane sums
// taken together (`lane_sums16`); where the host has AMX (Intel Xeon from
// Sapphire Rapids) its bfloat16 and int8 latents' logits are tile products
// instead, 16 slots × up to 8 query rows a tile (`latent_tile_amx`).
// Built without AVX-512 (AVX2 hosts) the loops run on 8 lanes, 4 query rows
// a tile; int8 and int4 codes in contract are `quant.quantize`'s, |code| <=
// 127 (the AVX2 integer products take |q| and k · sign(q)).

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 128;  // slots per block: logits [G, 128] in L1
constexpr int64_t kLanes = 16;   // slots (or value channels) per vector
// Slots ahead of the reads that the latent logits prefetch (two blocks:
// one measured no faster than none, four no faster than two).
constexpr int64_t kAheadSlots = 2 * kBlock;
// Query rows per register tile: 8 where AVX-512's 32 registers hold their
// 2 × 8 accumulators (MQA's and MLA's G = 8 rows in one pass), else 4.
#if defined(KVJAX_ROWS)
constexpr int kRows = KVJAX_ROWS;
#elif defined(__AVX512F__)
constexpr int kRows = 8;
#else
constexpr int kRows = 4;
#endif

// Prefetches the line at p into L2, not L1 (prefetcht1). Two blocks of
// keys and values ahead are 64 KiB of float32 at batch 8 (keys and values,
// 128 slots of H 32 each), twice the 32 KiB L1: prefetched into L1 they
// evicted each other and the block in use. Into L2 a thread's reads ran at
// 1.4-1.8x the rate (isolated kernel, gqa/mha shapes at 32k slots, WORKSPACE.md).
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

// Sixteen float32 lanes (GCC / Clang vector extensions: one AVX-512
// register, two AVX ones, four SSE ones; the kernel builds on any of them).
// Accumulators are named vectors, not arrays, so they stay in registers.
typedef float f16v __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef int8_t i8x16 __attribute__((vector_size(16)));

inline float load1(float x) { return x; }
inline float load1(uint16_t bits) {  // bfloat16 bits: a float's high half
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline float load1(int8_t code) { return static_cast<float>(code); }

inline f16v load16(const float* p) {
  f16v r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}
inline f16v load16(const uint16_t* p) {
  f16v r;
#if defined(__AVX512F__)
  // One widening load and a shift (GCC splits the generic conversion into
  // halves and reinserts them: three times the shuffles).
  const __m512i w = _mm512_slli_epi32(
      _mm512_cvtepu16_epi32(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))),
      16);
  std::memcpy(&r, &w, sizeof(r));
#else
  u16x16 u;
  std::memcpy(&u, p, sizeof(u));
  const u32x16 w = __builtin_convertvector(u, u32x16) << 16;
  std::memcpy(&r, &w, sizeof(r));
#endif
  return r;
}
inline f16v load16(const int8_t* p) {
  f16v out;
#if defined(__AVX512F__)
  // GCC 12 scalarises a direct int8 -> float vector conversion.
  const __m512 r = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  std::memcpy(&out, &r, sizeof(out));
#elif defined(__AVX2__)
  const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c));
  const __m256 hi =
      _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c, 8)));
  std::memcpy(&out, &lo, sizeof(lo));
  std::memcpy(reinterpret_cast<char*>(&out) + sizeof(lo), &hi, sizeof(hi));
#else
  i8x16 c;
  std::memcpy(&c, p, sizeof(c));
  out = __builtin_convertvector(__builtin_convertvector(c, i32x16), f16v);
#endif
  return out;
}
inline void store16(float* p, f16v x) { std::memcpy(p, &x, sizeof(x)); }

// int4 pairs (uint8, two's-complement nibbles; `quant.pack_int4`): both
// codes of each of 16 bytes as floats, sign-extended: lo gets the low
// nibbles, hi the high ones (one load and sign extension for 32 codes).
inline void load16_nibble_pair(const uint8_t* p, f16v& lo, f16v& hi) {
#if defined(__AVX512F__)
  const __m512i x = _mm512_cvtepi8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512 l = _mm512_cvtepi32_ps(
      _mm512_srai_epi32(_mm512_slli_epi32(x, 28), 28));
  const __m512 h = _mm512_cvtepi32_ps(_mm512_srai_epi32(x, 4));
  std::memcpy(&lo, &l, sizeof(lo));
  std::memcpy(&hi, &h, sizeof(hi));
#else
  i8x16 b;
  std::memcpy(&b, p, sizeof(b));
  const i32x16 x = __builtin_convertvector(b, i32x16);
  lo = __builtin_convertvector((x << 28) >> 28, f16v);
  hi = __builtin_convertvector(x >> 4, f16v);
#endif
}
// One half of them (the other half's work is dead code, compiled away).
template <bool high>
inline f16v load16_nibbles(const uint8_t* p) {
  f16v lo, hi;
  load16_nibble_pair(p, lo, hi);
  return high ? hi : lo;
}
inline float load1_nibble(uint8_t byte, bool high) {
  const int32_t x = static_cast<int8_t>(byte);
  const int32_t low = static_cast<int32_t>(static_cast<uint32_t>(x) << 28);
  return static_cast<float>(high ? x >> 4 : low >> 28);
}

typedef uint8_t u8x16 __attribute__((vector_size(16)));
constexpr float kLowest = std::numeric_limits<float>::lowest();

// 16 logits as the softmax reads them: times their keys' scales (int8),
// masked slots at the lowest float; folds them into the running maximum.
// Done in registers, before the logits are stored, so the softmax needs
// one pass over them instead of four.
inline f16v finish16(f16v a, const float* k_scale, const bool* mask,
                     f16v& vmax) {
  if (k_scale != nullptr) a *= load16(k_scale);
  u8x16 mk;
  std::memcpy(&mk, mask, sizeof(mk));
  const i32x16 keep = __builtin_convertvector(mk, i32x16);
  a = keep != 0 ? a : f16v{} + kLowest;
  vmax = a > vmax ? a : vmax;
  return a;
}

// Lane reductions as shuffle trees (four steps; the sum in
// _mm512_reduce_add_ps' order): a loop over the lanes compiles to a chain
// of 16 dependent scalar operations, which a step paid once per query row
// and block.
template <typename Op>
inline float lane_tree(f16v x, Op op) {
  constexpr i32x16 h8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
  constexpr i32x16 h4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
  constexpr i32x16 h2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
  constexpr i32x16 h1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
  x = op(x, __builtin_shuffle(x, h8));
  x = op(x, __builtin_shuffle(x, h4));
  x = op(x, __builtin_shuffle(x, h2));
  x = op(x, __builtin_shuffle(x, h1));
  return x[0];
}
inline float hmax(f16v x) {
  return lane_tree(x, [](f16v a, f16v b) { return a > b ? a : b; });
}
inline float hsum(f16v x) {
  return lane_tree(x, [](f16v a, f16v b) { return a + b; });
}

// exp(x) for x <= 0 in a form the compiler vectorizes (std::exp is a scalar
// call, and a step takes G exponentials per cached slot): 2^n · p(r) with
// n = round(x / ln 2), r = x - n ln 2 in two parts (Cody-Waite), p a
// degree-6 Taylor polynomial; relative error below 1e-6 (the tests compare
// the kernel with a float64 softmax). Below -87 (an underflowing or masked
// logit) it is 0.
inline float exp_nonpositive(float x) {
  const float xc = std::max(x, -87.0f);
  const float n = std::nearbyint(xc * 1.44269504088896341f);
  float r = xc - n * 0.693359375f;
  r -= n * -2.12194440e-4f;
  float p = 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return x < -87.0f ? 0.0f : p * two_n;
}

// Online-softmax state of the G query rows of one (sequence, kv head) over
// slots [s0, s1): m, l [G], acc [G, E].
struct Partial {
  std::vector<float> m, l, acc;
};

// Logits of GN query rows against one block of n slots (n a multiple of
// 16): lg[g][j] = q_g . k_j over keys in tiles of 16 slots, [S/16, D, 16]:
// a tile's D × 16 keys are contiguous, so the loop streams them in order.
// The GN × 16 partial sums stay in registers while the loop walks the D
// key rows, so each key is loaded once for all rows.
#if defined(__AVX2__) && !defined(__AVX512F__)
// AVX2 builds (no 64-byte registers): GCC keeps a 64-byte vector (f16v) in
// memory where the target has no register that wide, and lowers each
// operation through the stack (a broadcast became 16 scalar stores, every
// multiply-add a load and a store: the float32 step ran at a third of
// XLA's on an AMD EPYC with AVX2). So each inner loop has an 8-lane form
// in registers for these builds, beside its 16-lane one: the float32 and
// bfloat16 logits on each tile's two 8-slot halves, the int8 / int4
// logits as integer products (vpmaddubsw: AVX2 has no VNNI), MLA's latent
// logits in slot groups of 8 / G, the softmax and the values' sums.
typedef float f8v __attribute__((vector_size(32)));

inline f8v load8(const float* p) {
  f8v r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}
inline void store8(float* p, f8v x) { std::memcpy(p, &x, sizeof(x)); }
// x in every lane (`f8v{} + x` is an add: 0 + -0 is +0).
inline f8v bcast8(float x) { return _mm256_set1_ps(x); }

// 8 logits as `finish16` leaves them (float keys: no key scales).
inline f8v finish8(f8v a, const bool* mask, f8v& vmax) {
  const __m256i keep = _mm256_cvtepu8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(mask)));
  const __m256 drop = _mm256_castsi256_ps(
      _mm256_cmpeq_epi32(keep, _mm256_setzero_si256()));
  const __m256 r = _mm256_blendv_ps(a, _mm256_set1_ps(kLowest), drop);
  vmax = _mm256_max_ps(vmax, r);
  return r;
}

inline float hmax8(f8v x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x),
                        _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

// The frame of the 8-lane logits: each tile of 16 slots of the block as
// two halves (a: slots 0-7, c: 8-15), 2 × GN sums (Acc: float or int32
// lanes) that sums(j0, a, c) fills for the tile at b0 + j0; as_float(x, g)
// turns row g's sums into logits, times the keys' scales where k_scale is
// set, masked (`finish8`) into lg, each row's maximum into bm.
template <int GN, typename Acc, typename Sums, typename AsFloat>
inline void tiles8(int64_t b0, int64_t n, const float* __restrict__ k_scale,
                   const bool* __restrict__ mask, float* __restrict__ lg,
                   float* __restrict__ bm, const Sums& sums,
                   const AsFloat& as_float) {
  f8v vmax[GN];
  for (int g = 0; g < GN; ++g) vmax[g] = bcast8(kLowest);
  for (int64_t j0 = 0; j0 < n; j0 += kLanes) {
    Acc a[GN], c[GN];
    for (int g = 0; g < GN; ++g) a[g] = c[g] = Acc{};
    sums(j0, a, c);
    for (int g = 0; g < GN; ++g)
      for (int h = 0; h < 2; ++h) {
        const int64_t j = j0 + 8 * h;
        f8v x = as_float(h ? c[g] : a[g], g);
        if (k_scale != nullptr) x *= load8(k_scale + b0 + j);
        store8(lg + g * kBlock + j, finish8(x, mask + b0 + j, vmax[g]));
      }
  }
  for (int g = 0; g < GN; ++g) bm[g] = hmax8(vmax[g]);
}

inline f8v as_is(f8v x, int) { return x; }

// `block_logits` over float32 keys (`tiles8`), the 2 × GN sums in
// registers while the D key rows stream by.
template <int GN>
inline void block_logits_f32x8(const float* __restrict__ qs, int64_t D,
                               const float* __restrict__ k,
                               const bool* __restrict__ mask, int64_t b0,
                               int64_t n, float* __restrict__ lg,
                               float* __restrict__ bm) {
  tiles8<GN, f8v>(
      b0, n, nullptr, mask, lg, bm,
      [&](int64_t j0, f8v* a, f8v* c) {
        const float* kr = k + (b0 + j0) * D;
        for (int64_t d = 0; d < D; ++d, kr += kLanes) {
          prefetch_l2(kr + 2 * kBlock * D);
          const f8v k0 = load8(kr), k1 = load8(kr + 8);
          for (int g = 0; g < GN; ++g) {
            const f8v qd = bcast8(qs[g * D + d]);
            a[g] += qd * k0;
            c[g] += qd * k1;
          }
        }
      },
      as_is);
}

inline float hsum8(f8v x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x),
                        _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// `exp_nonpositive` on 8 lanes (GCC left the 16-lane loop over it scalar
// on AVX2: a third of the float32 step's instructions).
inline f8v exp8(f8v x) {
  const f8v xc = _mm256_max_ps(x, bcast8(-87.0f));
  const f8v n = _mm256_round_ps(xc * 1.44269504088896341f,
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  f8v r = xc - n * 0.693359375f;
  r -= n * -2.12194440e-4f;
  f8v p = bcast8(1.0f / 720);
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const f8v y = p * _mm256_castsi256_ps(bits);
  return _mm256_blendv_ps(y, _mm256_setzero_ps(),
                          _mm256_cmp_ps(x, bcast8(-87.0f), _CMP_LT_OQ));
}

// Prefetches the lines of `bytes` bytes from p into L2.
inline void prefetch_span(const void* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64)
    prefetch_l2(static_cast<const char*>(p) + o);
}

// acc[g][e] += sum_j p[g][j] · v_j[e] over a block's n slots for channels
// [e_begin, e_end), slot by slot: row(j, e) gives slot j's channels
// e .. e + 7 as floats, one(j, e) channel e alone (the channels past the
// last 8), fetch(j, e, c) prefetches what slot j two blocks ahead holds of
// channels e .. e + c. Each slot's G weights are broadcast once for up to
// 32 channels (the channel-outer loop broadcast them once per 8, and the
// broadcasts outnumbered the multiply-adds); up to 8 sums in registers,
// split into even and odd slots' sums where fewer rows leave them fewer
// than 8 (the multiply-add latency). A channel's sum is the same in every
// grouping of the channels (int4 halves give int8's bits).
template <int GN, typename Row, typename One, typename Fetch>
inline void value_channels8(const float* __restrict__ p, const Row& row,
                            const One& one, const Fetch& fetch, int64_t n,
                            float* __restrict__ acc, int64_t E,
                            int64_t e_begin, int64_t e_end) {
  constexpr bool split = GN <= 2;
  constexpr int kW = GN == 1 ? 4 : 2;  // 8-channel groups per pass
  int64_t e0 = e_begin;
  auto pass = [&](auto width) {
    constexpr int W = decltype(width)::value;
    f8v a[W][GN], c[W][GN];
    for (int w = 0; w < W; ++w)
      for (int g = 0; g < GN; ++g) {
        a[w][g] = load8(acc + g * E + e0 + 8 * w);
        c[w][g] = f8v{};
      }
    int64_t j = 0;
    if constexpr (split) {
      for (; j + 2 <= n; j += 2) {
        fetch(j, e0, 8 * W);
        fetch(j + 1, e0, 8 * W);
        f8v v0[W], v1[W];
        for (int w = 0; w < W; ++w) {
          v0[w] = row(j, e0 + 8 * w);
          v1[w] = row(j + 1, e0 + 8 * w);
        }
        for (int g = 0; g < GN; ++g) {
          const f8v p0 = bcast8(p[g * kBlock + j]);
          const f8v p1 = bcast8(p[g * kBlock + j + 1]);
          for (int w = 0; w < W; ++w) {
            a[w][g] += p0 * v0[w];
            c[w][g] += p1 * v1[w];
          }
        }
      }
    }
    for (; j < n; ++j) {
      fetch(j, e0, 8 * W);
      f8v v0[W];
      for (int w = 0; w < W; ++w) v0[w] = row(j, e0 + 8 * w);
      for (int g = 0; g < GN; ++g) {
        const f8v p0 = bcast8(p[g * kBlock + j]);
        for (int w = 0; w < W; ++w) a[w][g] += p0 * v0[w];
      }
    }
    for (int w = 0; w < W; ++w)
      for (int g = 0; g < GN; ++g)
        store8(acc + g * E + e0 + 8 * w, a[w][g] + c[w][g]);
  };
  for (; e0 + 8 * kW <= e_end; e0 += 8 * kW)
    pass(std::integral_constant<int, kW>());
  for (; e0 + 8 <= e_end; e0 += 8) pass(std::integral_constant<int, 1>());
  for (; e0 < e_end; ++e0)
    for (int g = 0; g < GN; ++g)
      for (int64_t j = 0; j < n; ++j)
        acc[g * E + e0] += p[g * kBlock + j] * one(j, e0);
}

// Eight values as floats: float32, bfloat16 bits, int8 codes.
inline f8v load8v(const float* p) { return load8(p); }
inline f8v load8v(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
      16));
}
inline f8v load8v(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// `block_values` on 8 lanes over values [S, E] of float32, bfloat16 bits
// or int8 codes, rows from vb.
template <int GN, bool ahead, typename VT>
inline void block_values8(const float* __restrict__ p,
                          const VT* __restrict__ vb, int64_t E, int64_t n,
                          float* __restrict__ acc) {
  value_channels8<GN>(
      p, [&](int64_t j, int64_t e) { return load8v(vb + j * E + e); },
      [&](int64_t j, int64_t e) { return load1(vb[j * E + e]); },
      [&](int64_t j, int64_t e, int64_t c) {
        if (ahead)
          prefetch_span(vb + (j + 2 * kBlock) * E + e,
                        c * static_cast<int64_t>(sizeof(VT)));
      },
      n, acc, E, 0, E);
}
#endif

template <int GN, typename KT>
inline void block_logits(const float* __restrict__ qs, int64_t D,
                         const KT* __restrict__ k,
                         const float* __restrict__ k_scale,
                         const bool* __restrict__ mask, int64_t b0, int64_t n,
                         float* __restrict__ lg, float* __restrict__ bm) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  if constexpr (std::is_same_v<KT, float>) {
    if (k_scale == nullptr)
      return block_logits_f32x8<GN>(qs, D, k, mask, b0, n, lg, bm);
  }
#endif
  f16v vmax[GN];
  for (int g = 0; g < GN; ++g) vmax[g] = f16v{} + kLowest;
  const float* ks = k_scale != nullptr ? k_scale + b0 : nullptr;
  int64_t j0 = 0;
  // Two tiles at a time: 2 × GN independent sums, enough to hide the
  // multiply-add latency (GN alone left the loop waiting on it).
  for (; j0 + 2 * kLanes <= n; j0 += 2 * kLanes) {
    f16v a[GN], c[GN];
    for (int g = 0; g < GN; ++g) a[g] = c[g] = f16v{};
    const KT* kr = k + (b0 + j0) * D;  // the tiles of slots b0 + j0 ...
    for (int64_t d = 0; d < D; ++d, kr += kLanes) {
      // Two blocks ahead of the reads (the hardware prefetcher alone left
      // the loads waiting on memory).
      prefetch_l2(kr + 2 * kBlock * D);
      prefetch_l2(kr + 2 * kBlock * D + kLanes * D);
      const f16v k0 = load16(kr), k1 = load16(kr + kLanes * D);
      for (int g = 0; g < GN; ++g) {
        const float qd = qs[g * D + d];
        a[g] += qd * k0;
        c[g] += qd * k1;
      }
    }
    for (int g = 0; g < GN; ++g) {
      store16(lg + g * kBlock + j0,
              finish16(a[g], ks != nullptr ? ks + j0 : nullptr,
                       mask + b0 + j0, vmax[g]));
      store16(lg + g * kBlock + j0 + kLanes,
              finish16(c[g], ks != nullptr ? ks + j0 + kLanes : nullptr,
                       mask + b0 + j0 + kLanes, vmax[g]));
    }
  }
  for (; j0 < n; j0 += kLanes) {  // an odd tile at the block's end
    f16v a[GN];
    for (int g = 0; g < GN; ++g) a[g] = f16v{};
    const KT* kr = k + (b0 + j0) * D;
    for (int64_t d = 0; d < D; ++d, kr += kLanes) {
      const f16v kv = load16(kr);
      for (int g = 0; g < GN; ++g) a[g] += qs[g * D + d] * kv;
    }
    for (int g = 0; g < GN; ++g)
      store16(lg + g * kBlock + j0,
              finish16(a[g], ks != nullptr ? ks + j0 : nullptr,
                       mask + b0 + j0, vmax[g]));
  }
  for (int g = 0; g < GN; ++g) bm[g] = hmax(vmax[g]);
}

// G query rows of width W rounded to int8 codes as `quant.quantize` rounds
// a row (x / (max|x| / 127), to nearest even): the codes, the same as
// floats (portable paths: float sums of these integers are exact), each
// row's scale and 128 · Σ codes (the offset of VNNI's unsigned key bytes,
// codes + 128).
struct RoundedRows {
  std::vector<int8_t> codes;
  std::vector<float> fcodes, scale;
  std::vector<int32_t> offset;

  RoundedRows() = default;
  RoundedRows(const float* x, int64_t G, int64_t W)
      : codes(G * W), fcodes(G * W), scale(G), offset(G) {
    for (int64_t g = 0; g < G; ++g) {
      float amax = 0.0f;
      for (int64_t e = 0; e < W; ++e)
        amax = std::max(amax, std::fabs(x[g * W + e]));
      const float s = amax / 127.0f, safe = s > 0.0f ? s : 1.0f;
      int32_t sum = 0;
      for (int64_t e = 0; e < W; ++e) {
        const float c = std::min(
            127.0f, std::max(-127.0f, std::nearbyint(x[g * W + e] / safe)));
        codes[g * W + e] = static_cast<int8_t>(c);
        fcodes[g * W + e] = c;
        sum += static_cast<int32_t>(c);
      }
      scale[g] = s;
      offset[g] = 128 * sum;
    }
  }
};

// An int8 latent slot's logit from its exact integer sums dc (latent) and
// dr (rotary): cs · (sa · dc) + rs · (sb · dr), the slot's scales cs, rs
// and the query's sa, sb, with one explicit fma so that every path (VNNI,
// AMX, portable; scalar or in lanes) rounds it alike, whatever the
// compiler would contract.
inline float int8_logit(float cs, float sa, float dc, float rs, float sb,
                        float dr) {
  return std::fma(cs, sa * dc, rs * (sb * dr));
}

// MLA's rounded query tile over int8 latents (rows g0.. of `RoundedRows`
// for the latent part, width A, and the rotary part, width R).
struct LatentQuery {
  const int8_t *ca, *cb;    // codes [GN, A], [GN, R]
  const float *fa, *fb;     // the codes as floats
  const float *sa, *sb;     // row scales [GN]
  const int32_t *oa, *ob;   // offsets [GN]
};

// float32 -> bfloat16 bits, rounded to nearest even (as XLA's convert;
// no NaNs reach it: queries and probabilities are finite).
inline uint32_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}
inline float bf16_float(uint32_t bits) {
  const uint32_t u = bits << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// G query rows of width W (even) rounded to bfloat16: as words of two
// channels (2e in the low half, 2e + 1 in the high: vdpbf16ps' pairs) and
// as floats (the portable path).
struct PairRows {
  std::vector<uint32_t> words;
  std::vector<float> floats;

  PairRows() = default;
  PairRows(const float* x, int64_t G, int64_t W)
      : words(G * W / 2), floats(G * W) {
    for (int64_t i = 0; i < G * W; ++i)
      floats[i] = bf16_float(bf16_bits(x[i]));
    for (int64_t i = 0; i < G * W / 2; ++i)
      words[i] = bf16_bits(x[2 * i]) | bf16_bits(x[2 * i + 1]) << 16;
  }
};

// Sixteen lanes of slot-pair words as two float vectors: the even member
// (low half) and the odd one (high half).
inline void unpair16(const uint32_t* p, f16v& even, f16v& odd) {
  u32x16 w;
  std::memcpy(&w, p, sizeof(w));
  const u32x16 lo = w << 16, hi = w & 0xFFFF0000u;
  std::memcpy(&even, &lo, sizeof(even));
  std::memcpy(&odd, &hi, sizeof(odd));
}

// Whether the bfloat16 products run as AVX-512 BF16's vdpbf16ps (two
// products a lane per instruction) or as float32 multiply-adds over keys
// and values widened in registers (one a lane). Both add the same exact
// products in the same order, so they give the same bits; which is faster
// is the CPU's: on an AMD EPYC Zen 4 moving the products to vdpbf16ps made
// the MQA / GQA steps 1.20x / 1.11x faster, while on the Intel Xeon
// (family 6 model 207) vdpbf16ps delivers half the products per cycle of
// a multiply-add (WORKSPACE.md "Quantized caches, and the cache-dominated
// regime"; `product_times` measures it). 0: measure, 1: vdpbf16ps, 2: fma.
enum Bf16Form : int64_t { kBf16Auto = 0, kBf16Dot = 1, kBf16Fma = 2 };

// Seconds per 16 products (one register's lanes) of each form, as
// `product_times` measured them: [vdpbf16ps, multiply-add]; zero where
// not measured.
struct ProductTimes {
  double dot = 0.0, fma = 0.0;
};

#if defined(__AVX512BF16__)
// Times 16 independent chains of vdpbf16ps against 32 of float32
// multiply-adds (the same number of products) in registers; once per
// process (about a millisecond).
const ProductTimes& product_times() {
  static const ProductTimes times = [] {
    using clock = std::chrono::steady_clock;
    auto best = [](auto&& body) {
      double t = 1e30;
      for (int rep = 0; rep < 5; ++rep) {
        const auto t0 = clock::now();
        body();
        t = std::min(t, std::chrono::duration<double>(clock::now() - t0)
                            .count());
      }
      return t;
    };
    constexpr int kIters = 4096;
    volatile float sink = 0.0f;
    const double dot = best([&] {
      __m512 a[16];
      for (auto& x : a) x = _mm512_setzero_ps();
      __m512bh k = (__m512bh)_mm512_set1_epi32(0x3F803F80);
      const __m512bh q = (__m512bh)_mm512_set1_epi32(0x3C003C00);
      for (int it = 0; it < kIters; ++it) {
        for (auto& x : a) x = _mm512_dpbf16_ps(x, k, q);
        asm volatile("" : "+v"(k));
      }
      float r = 0.0f;
      for (auto& x : a) r += _mm512_reduce_add_ps(x);
      sink = r;
    });
    const double fma = best([&] {
      __m512 a[16], c[16];
      for (int i = 0; i < 16; ++i) a[i] = c[i] = _mm512_setzero_ps();
      __m512 k = _mm512_set1_ps(1.0f);
      const __m512 q = _mm512_set1_ps(1e-3f);
      for (int it = 0; it < kIters; ++it) {
        for (int i = 0; i < 16; ++i) {
          a[i] = _mm512_fmadd_ps(k, q, a[i]);
          c[i] = _mm512_fmadd_ps(k, q, c[i]);
        }
        asm volatile("" : "+v"(k));
      }
      float r = 0.0f;
      for (int i = 0; i < 16; ++i) r += _mm512_reduce_add_ps(a[i] + c[i]);
      sink = r;
    });
    (void)sink;
    // Per register of products: 16 x kIters vdpbf16ps make 32 x kIters
    // registers of products, as the 32 x kIters multiply-adds do.
    return ProductTimes{dot / (32.0 * kIters), fma / (32.0 * kIters)};
  }();
  return times;
}

// Whether vdpbf16ps is at least 10 % faster per product.
bool dot_products_faster() {
  const ProductTimes& t = product_times();
  return t.dot * 1.1 < t.fma;
}
#endif

// Query rows from which 'auto' takes the measured form. Below it a step is
// bound by the bytes it reads and on the Intel Xeon the two forms were
// level (MHA's step within its run-to-run spread), so vdpbf16ps' fewer
// instructions are kept; from 4 rows the products bind, and there the
// multiply-adds were the faster (WORKSPACE.md "Quantized caches, and the
// cache-dominated regime").
constexpr int kMeasuredFromRows = 4;

// Whether `form` (Bf16Form) runs the bfloat16 products of a tile of `rows`
// query rows as vdpbf16ps.
inline bool use_dot_products(int64_t form, int rows) {
#if defined(__AVX512BF16__)
  return form == kBf16Dot ||
         (form == kBf16Auto &&
          (rows < kMeasuredFromRows || dot_products_faster()));
#else
  (void)form;
  (void)rows;
  return false;
#endif
}

// `block_logits` over bfloat16 keys in pair tiles ([D/2, 16, 2] per tile of
// 16 slots) for a query rounded to bfloat16 (`PairRows`, rows of this
// tile): each lane adds a pair's two products, the odd channel's first, as
// vdpbf16ps does (`dot`); the fma form widens the pair (`unpair16`) and
// multiply-adds it in that order (each product exact in float32, so the
// two agree to the bit).
template <int GN>
inline void block_logits_pairs(const uint32_t* __restrict__ qw,
                               const float* __restrict__ qf, int64_t D,
                               const uint16_t* __restrict__ k,
                               const bool* __restrict__ mask, int64_t b0,
                               int64_t n, float* __restrict__ lg,
                               float* __restrict__ bm, bool dot) {
  const int64_t D2 = D / 2;
#if defined(__AVX2__) && !defined(__AVX512F__)
  // 8 lanes: each tile's 16 slots as two halves (a: slots 0-7, c: 8-15),
  // each pair word widened to its even and odd channel in registers.
  (void)qw;
  (void)dot;
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  auto widen = [&](const uint16_t* r, f8v& even, f8v& odd) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(w, high));
  };
  return tiles8<GN, f8v>(
      b0, n, nullptr, mask, lg, bm,
      [&](int64_t j0, f8v* a, f8v* c) {
        const uint16_t* kr = k + (b0 + j0) * D;
        for (int64_t d2 = 0; d2 < D2; ++d2, kr += 2 * kLanes) {
          prefetch_l2(kr + 2 * kBlock * D);
          f8v e0, o0, e1, o1;
          widen(kr, e0, o0);
          widen(kr + kLanes, e1, o1);
          for (int g = 0; g < GN; ++g) {
            const f8v qo = bcast8(qf[g * D + 2 * d2 + 1]);
            const f8v qe = bcast8(qf[g * D + 2 * d2]);
            a[g] += qo * o0;
            a[g] += qe * e0;
            c[g] += qo * o1;
            c[g] += qe * e1;
          }
        }
      },
      as_is);
#endif
  f16v vmax[GN];
  for (int g = 0; g < GN; ++g) vmax[g] = f16v{} + kLowest;
  auto finish = [&](int g, f16v sum, int64_t j) {
    store16(lg + g * kBlock + j,
            finish16(sum, nullptr, mask + b0 + j, vmax[g]));
  };
  int64_t j0 = 0;
#if defined(__AVX512BF16__)
  if (dot) {
    auto as_f16v = [](__m512 x) {
      f16v r;
      std::memcpy(&r, &x, sizeof(r));
      return r;
    };
    for (; j0 + 2 * kLanes <= n; j0 += 2 * kLanes) {
      __m512 a[GN], c[GN];
      for (int g = 0; g < GN; ++g) a[g] = c[g] = _mm512_setzero_ps();
      const uint16_t* kr = k + (b0 + j0) * D;
      for (int64_t d2 = 0; d2 < D2; ++d2, kr += 2 * kLanes) {
        prefetch_l2(kr + 2 * kBlock * D);
        prefetch_l2(kr + 2 * kBlock * D + kLanes * D);
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kr);
        const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kr + kLanes * D);
        for (int g = 0; g < GN; ++g) {
          const __m512bh qv = (__m512bh)_mm512_set1_epi32(qw[g * D2 + d2]);
          a[g] = _mm512_dpbf16_ps(a[g], k0, qv);
          c[g] = _mm512_dpbf16_ps(c[g], k1, qv);
        }
      }
      for (int g = 0; g < GN; ++g) {
        finish(g, as_f16v(a[g]), j0);
        finish(g, as_f16v(c[g]), j0 + kLanes);
      }
    }
    for (; j0 < n; j0 += kLanes) {
      __m512 a[GN];
      for (int g = 0; g < GN; ++g) a[g] = _mm512_setzero_ps();
      const uint16_t* kr = k + (b0 + j0) * D;
      for (int64_t d2 = 0; d2 < D2; ++d2, kr += 2 * kLanes) {
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kr);
        for (int g = 0; g < GN; ++g)
          a[g] = _mm512_dpbf16_ps(
              a[g], k0, (__m512bh)_mm512_set1_epi32(qw[g * D2 + d2]));
      }
      for (int g = 0; g < GN; ++g) finish(g, as_f16v(a[g]), j0);
    }
    for (int g = 0; g < GN; ++g) bm[g] = hmax(vmax[g]);
    return;
  }
#else
  (void)qw;
  (void)dot;
#endif
  // Two tiles at a time (2 × GN independent sums: the multiply-add latency).
  for (; j0 + 2 * kLanes <= n; j0 += 2 * kLanes) {
    f16v a[GN], c[GN];
    for (int g = 0; g < GN; ++g) a[g] = c[g] = f16v{};
    const uint16_t* kr = k + (b0 + j0) * D;
    for (int64_t d2 = 0; d2 < D2; ++d2, kr += 2 * kLanes) {
      prefetch_l2(kr + 2 * kBlock * D);
      prefetch_l2(kr + 2 * kBlock * D + kLanes * D);
      f16v e0, o0, e1, o1;
      unpair16(reinterpret_cast<const uint32_t*>(kr), e0, o0);
      unpair16(reinterpret_cast<const uint32_t*>(kr + kLanes * D), e1, o1);
      for (int g = 0; g < GN; ++g) {
        const float qo = qf[g * D + 2 * d2 + 1], qe = qf[g * D + 2 * d2];
        a[g] += qo * o0;
        a[g] += qe * e0;
        c[g] += qo * o1;
        c[g] += qe * e1;
      }
    }
    for (int g = 0; g < GN; ++g) {
      finish(g, a[g], j0);
      finish(g, c[g], j0 + kLanes);
    }
  }
  for (; j0 < n; j0 += kLanes) {  // an odd tile at the block's end
    f16v a[GN];
    for (int g = 0; g < GN; ++g) a[g] = f16v{};
    const uint16_t* kr = k + (b0 + j0) * D;
    for (int64_t d2 = 0; d2 < D2; ++d2, kr += 2 * kLanes) {
      f16v even, odd;
      unpair16(reinterpret_cast<const uint32_t*>(kr), even, odd);
      for (int g = 0; g < GN; ++g) {
        a[g] += qf[g * D + 2 * d2 + 1] * odd;
        a[g] += qf[g * D + 2 * d2] * even;
      }
    }
    for (int g = 0; g < GN; ++g) finish(g, a[g], j0);
  }
  for (int g = 0; g < GN; ++g) bm[g] = hmax(vmax[g]);
}

// acc[g][e] += sum_j p[g][j] · v[j][e] over bfloat16 values [S, E], two
// slots at a time, the probabilities rounded to bfloat16 (FlashAttention
// rounds P so for its P·V product; the softmax's sum l is taken before the
// rounding, in float32), the odd slot's product first. `dot`: the two
// slots' rows interleaved in a register (vpermt2w) into channel pairs for
// vdpbf16ps; else float32 multiply-adds over the widened rows (the same
// exact products in the same order: the same bits). n is even (blocks are
// whole tiles of 16 slots).
template <int GN>
inline void block_values_pairs(const float* __restrict__ p,
                               const uint16_t* __restrict__ v, int64_t E,
                               int64_t b0, int64_t n,
                               float* __restrict__ acc, bool dot) {
  const uint16_t* vb = v + b0 * E;
#if defined(__AVX2__) && !defined(__AVX512F__)
  // 8 lanes: the probabilities rounded to bfloat16 as `bf16_bits` rounds,
  // then `block_values8`'s sums over the widened rows.
  (void)dot;
  alignas(32) float pr[GN * kBlock];
  const __m256i half = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1);
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int g = 0; g < GN; ++g)
    for (int64_t j = 0; j < n; j += 8) {
      const __m256i u = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(p + g * kBlock + j));
      const __m256i r = _mm256_add_epi32(
          _mm256_add_epi32(u, half),
          _mm256_and_si256(_mm256_srli_epi32(u, 16), one));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + g * kBlock + j),
                          _mm256_and_si256(r, high));
    }
  return block_values8<GN, true>(pr, vb, E, n, acc);
#endif
  auto rounded = [](const float* x) {
    u32x16 u;
    std::memcpy(&u, x, sizeof(u));
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  };
#if defined(__AVX512BF16__)
  if (dot) {
    constexpr int64_t kPairs = kBlock / 2;
    alignas(64) uint32_t pw[GN * kPairs];
    // 32 slots' probabilities at a time, rounded as `bf16_bits` and paired
    // (word i: slots 2i, 2i + 1) in vector registers; a block's last 16
    // slots with zeros after them.
    constexpr i32x16 even = {0, 2, 4, 6, 8, 10, 12, 14,
                             16, 18, 20, 22, 24, 26, 28, 30};
    constexpr i32x16 odd = even + 1;
    for (int g = 0; g < GN; ++g)
      for (int64_t j = 0; j < n; j += 2 * kLanes) {
        const u32x16 a = rounded(p + g * kBlock + j);
        const u32x16 b = j + kLanes < n
                             ? rounded(p + g * kBlock + j + kLanes)
                             : u32x16{};
        const u32x16 w = __builtin_shuffle(a, b, even) |
                         __builtin_shuffle(a, b, odd) << 16;
        std::memcpy(pw + g * kPairs + j / 2, &w, sizeof(w));
      }
    // Element 2i of the pair vector: slot j's channel i; 2i + 1: slot
    // j + 1's.
    alignas(64) static constexpr uint16_t kInterleave[32] = {
        0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
        8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i interleave = _mm512_load_si512(kInterleave);
    auto pair_rows = [&](const uint16_t* r) {
      const __m512i lo = _mm512_castsi256_si512(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r)));
      const __m512i hi = _mm512_castsi256_si512(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + E)));
      return (__m512bh)_mm512_permutex2var_epi16(lo, interleave, hi);
    };
    int64_t e0 = 0;
    for (; e0 + kLanes <= E; e0 += kLanes) {
      const uint16_t* vr = vb + e0;
      __m512 a[GN], c[GN];
      for (int g = 0; g < GN; ++g) {
        a[g] = _mm512_loadu_ps(acc + g * E + e0);
        c[g] = _mm512_setzero_ps();
      }
      int64_t i = 0;
      // Two slot pairs at a time into separate sums (the latency).
      for (; i + 2 <= n / 2; i += 2, vr += 4 * E) {
        for (int r = 0; r < 4; ++r) prefetch_l2(vr + 2 * kBlock * E + r * E);
        const __m512bh v0 = pair_rows(vr), v1 = pair_rows(vr + 2 * E);
        for (int g = 0; g < GN; ++g) {
          a[g] = _mm512_dpbf16_ps(
              a[g], v0, (__m512bh)_mm512_set1_epi32(pw[g * kPairs + i]));
          c[g] = _mm512_dpbf16_ps(
              c[g], v1, (__m512bh)_mm512_set1_epi32(pw[g * kPairs + i + 1]));
        }
      }
      for (; i < n / 2; ++i, vr += 2 * E) {
        const __m512bh v0 = pair_rows(vr);
        for (int g = 0; g < GN; ++g)
          a[g] = _mm512_dpbf16_ps(
              a[g], v0, (__m512bh)_mm512_set1_epi32(pw[g * kPairs + i]));
      }
      for (int g = 0; g < GN; ++g)
        _mm512_storeu_ps(acc + g * E + e0, _mm512_add_ps(a[g], c[g]));
    }
    for (; e0 < E; ++e0)  // channels past the last multiple of 16
      for (int g = 0; g < GN; ++g)
        for (int64_t i = 0; i < n / 2; ++i) {
          const uint32_t w = pw[g * kPairs + i];
          const uint16_t* r = vb + 2 * i * E + e0;
          acc[g * E + e0] += bf16_float(w >> 16) * load1(r[E]);
          acc[g * E + e0] += bf16_float(w & 0xFFFFu) * load1(r[0]);
        }
    return;
  }
#else
  (void)dot;
#endif
  // The probabilities rounded to bfloat16, as floats (one broadcast
  // operand of a multiply-add each).
  alignas(64) float pf[GN * kBlock];
  for (int g = 0; g < GN; ++g)
    for (int64_t j = 0; j < n; j += kLanes) {
      const u32x16 w = rounded(p + g * kBlock + j) << 16;
      std::memcpy(pf + g * kBlock + j, &w, sizeof(w));
    }
  int64_t e0 = 0;
  for (; e0 + kLanes <= E; e0 += kLanes) {
    f16v a[GN], c[GN];
    for (int g = 0; g < GN; ++g) {
      a[g] = load16(acc + g * E + e0);
      c[g] = f16v{};
    }
    const uint16_t* vr = vb + e0;
    int64_t j = 0;
    // Two slot pairs at a time into separate sums (the latency).
    for (; j + 4 <= n; j += 4, vr += 4 * E) {
      for (int r = 0; r < 4; ++r) prefetch_l2(vr + 2 * kBlock * E + r * E);
      const f16v v0 = load16(vr), v1 = load16(vr + E);
      const f16v v2 = load16(vr + 2 * E), v3 = load16(vr + 3 * E);
      for (int g = 0; g < GN; ++g) {
        const float* pg = pf + g * kBlock + j;
        a[g] += pg[1] * v1;
        a[g] += pg[0] * v0;
        c[g] += pg[3] * v3;
        c[g] += pg[2] * v2;
      }
    }
    for (; j < n; j += 2, vr += 2 * E) {
      const f16v v0 = load16(vr), v1 = load16(vr + E);
      for (int g = 0; g < GN; ++g) {
        a[g] += pf[g * kBlock + j + 1] * v1;
        a[g] += pf[g * kBlock + j] * v0;
      }
    }
    for (int g = 0; g < GN; ++g) store16(acc + g * E + e0, a[g] + c[g]);
  }
  for (; e0 < E; ++e0)  // channels past the last multiple of 16
    for (int g = 0; g < GN; ++g)
      for (int64_t j = 0; j < n; j += 2) {
        const uint16_t* r = vb + j * E + e0;
        acc[g * E + e0] += pf[g * kBlock + j + 1] * load1(r[E]);
        acc[g * E + e0] += pf[g * kBlock + j] * load1(r[0]);
      }
}

// A query tile over int8 (quad-tiled) keys: the rows rounded to int8 codes
// (`quant.quantize`: scale max|x| / 127), as int32 words of four codes
// (one quad), the codes again as floats (the portable path), each row's
// scale, and 128 · Σ codes (the VNNI path's offset: it multiplies unsigned
// key bytes, codes + 128).
struct QuadQuery {
  const int32_t* words;  // [GN, D/4]
  const float* codes;    // [GN, D]
  const float* scale;    // [GN]
  const int32_t* offset; // [GN]
};

// `block_logits` over integer codes for a query rounded to int8
// (`QuadQuery`): integer dot products, exact (|sum| <= D · 127² < 2^24 for
// D <= 1024, so every path agrees to the bit), times the query's and the
// keys' scales. T = int8_t: keys in quad tiles ([D/4, 16, 4] per tile of
// 16 slots). T = uint8_t: int4 keys read as stored, the tiles of the
// packed rows (`quant.pack_int4`: byte i holds channel i in its low nibble
// and channel i + D/2 in its high one) in quads of bytes, [D/8, 16, 4] per
// tile; a quad's low nibbles are channels 4i..4i+3 and its high ones
// D/2 + 4i.., so the query's int8 quads serve unchanged (quad i for the
// low half, D/8 + i for the high). The nibbles are unpacked in registers
// (a mask, a shift): the step reads half the bytes of an int8 cache, and
// the sums equal those over the unpacked codes, so the logits are int8's
// to the bit.
template <int GN, typename T>
inline void block_logits_codes(const QuadQuery& q, int64_t D,
                               const T* __restrict__ k,
                               const float* __restrict__ k_scale,
                               const bool* __restrict__ mask, int64_t b0,
                               int64_t n, float* __restrict__ lg,
                               float* __restrict__ bm) {
  constexpr bool nibbles = std::is_same_v<T, uint8_t>;
  const int64_t D4 = D / 4;
  const int64_t row = nibbles ? D / 2 : D;  // bytes a slot's key takes
  const int64_t units = row / 4;  // 64-byte runs of a tile's keys
#if defined(__AVX2__) && !defined(__AVX512F__)
  // 8 lanes, integer products (AVX2 has no VNNI): vpmaddubsw multiplies
  // unsigned by signed bytes, so the query's codes go in as |q| and the
  // keys' as k · sign(q) (vpsignb), the same products q · k; each adjacent
  // pair's sum fits int16 (|k|, |q| <= 127: `quant.quantize`'s codes, so
  // 2 · 127² < 2^15), and vpmaddwd adds the pairs into a lane's int32 sum
  // of four channels. Exact, as the other paths.
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i low = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi8(8);
  // 32 bytes of a run (8 slots' quads) as signed codes: int8 as stored,
  // int4 a quad of low nibbles (lo) and one of high ones (hi).
  auto unpack = [&](const T* p, __m256i& lo, __m256i& hi) {
    const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (nibbles) {
      lo = _mm256_sub_epi8(_mm256_xor_si256(_mm256_and_si256(y, low), eight),
                           eight);
      hi = _mm256_sub_epi8(
          _mm256_xor_si256(_mm256_and_si256(_mm256_srli_epi16(y, 4), low),
                           eight),
          eight);
    } else {
      lo = hi = y;
    }
  };
  auto dot = [&](__m256i acc, __m256i keys, __m256i qv, __m256i qa) {
    return _mm256_add_epi32(
        acc, _mm256_madd_epi16(
                 _mm256_maddubs_epi16(qa, _mm256_sign_epi8(keys, qv)), ones));
  };
  return tiles8<GN, __m256i>(
      b0, n, k_scale, mask, lg, bm,
      [&](int64_t j0, __m256i* a, __m256i* c) {
        const T* kr = k + (b0 + j0) * row;
        for (int64_t u = 0; u < units; ++u, kr += 4 * kLanes) {
          prefetch_l2(kr + 2 * kBlock * row);
          __m256i l0, h0, l1, h1;
          unpack(kr, l0, h0);
          unpack(kr + 2 * kLanes, l1, h1);
          for (int g = 0; g < GN; ++g) {
            const __m256i qv = _mm256_set1_epi32(q.words[g * D4 + u]);
            const __m256i qa = _mm256_abs_epi8(qv);
            a[g] = dot(a[g], l0, qv, qa);
            c[g] = dot(c[g], l1, qv, qa);
            if constexpr (nibbles) {
              const __m256i hv =
                  _mm256_set1_epi32(q.words[g * D4 + units + u]);
              const __m256i ha = _mm256_abs_epi8(hv);
              a[g] = dot(a[g], h0, hv, ha);
              c[g] = dot(c[g], h1, hv, ha);
            }
          }
        }
      },
      [&](__m256i x, int g) -> f8v {
        return _mm256_cvtepi32_ps(x) * q.scale[g];
      });
#endif
  f16v vmax[GN];
  for (int g = 0; g < GN; ++g) vmax[g] = f16v{} + kLowest;
  const float* ks = k_scale + b0;
  auto finish = [&](int g, f16v sum, int64_t j) {
    store16(lg + g * kBlock + j,
            finish16(sum * q.scale[g], ks + j, mask + b0 + j, vmax[g]));
  };
  int64_t j0 = 0;
#if defined(__AVX512VNNI__)
  // Keys as unsigned bytes, the query's four codes broadcast (vpdpbusd
  // multiplies unsigned by signed): each lane (slot) gains four channels'
  // products an instruction. int8 codes + 128 (the sign bit flipped) add
  // 128 · Σ q_codes to every slot of a row; int4's two's-complement
  // nibbles flipped to code + 8 add 8 · Σ q_codes, a sixteenth. Taken off
  // before the scales.
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(nibbles ? 0x88
                                                                   : 0x80));
  const __m512i low = _mm512_set1_epi8(0x0F);
  auto to_f16v = [&](__m512i acc, int g) {
    const __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(
        acc, _mm512_set1_epi32(q.offset[g] / (nibbles ? 16 : 1))));
    f16v r;
    std::memcpy(&r, &f, sizeof(r));
    return r;
  };
  // One 64-byte run of a tile as unsigned codes: int8 one quad of each
  // slot (lo), int4 two (lo from the low nibbles, hi from the high).
  auto unpack = [&](const T* p, __m512i& lo, __m512i& hi) {
    const __m512i y = _mm512_xor_si512(_mm512_loadu_si512(p), flip);
    if constexpr (nibbles) {
      lo = _mm512_and_si512(y, low);
      hi = _mm512_and_si512(_mm512_srli_epi32(y, 4), low);
    } else {
      lo = hi = y;
    }
  };
  // Run u's products into a row's sums: quad u (int8); quads u and
  // D/8 + u (int4).
  auto add = [&](__m512i acc, __m512i lo, __m512i hi, int g, int64_t u) {
    acc = _mm512_dpbusd_epi32(acc, lo,
                              _mm512_set1_epi32(q.words[g * D4 + u]));
    if constexpr (nibbles)
      acc = _mm512_dpbusd_epi32(
          acc, hi, _mm512_set1_epi32(q.words[g * D4 + units + u]));
    return acc;
  };
  for (; j0 + 2 * kLanes <= n; j0 += 2 * kLanes) {
    __m512i a[GN], c[GN];
    for (int g = 0; g < GN; ++g) a[g] = c[g] = _mm512_setzero_si512();
    const T* kr = k + (b0 + j0) * row;
    for (int64_t u = 0; u < units; ++u, kr += 4 * kLanes) {
      prefetch_l2(kr + 2 * kBlock * row);
      prefetch_l2(kr + 2 * kBlock * row + kLanes * row);
      __m512i l0, h0, l1, h1;
      unpack(kr, l0, h0);
      unpack(kr + kLanes * row, l1, h1);
      for (int g = 0; g < GN; ++g) {
        a[g] = add(a[g], l0, h0, g, u);
        c[g] = add(c[g], l1, h1, g, u);
      }
    }
    for (int g = 0; g < GN; ++g) {
      finish(g, to_f16v(a[g], g), j0);
      finish(g, to_f16v(c[g], g), j0 + kLanes);
    }
  }
  for (; j0 < n; j0 += kLanes) {
    __m512i a[GN];
    for (int g = 0; g < GN; ++g) a[g] = _mm512_setzero_si512();
    const T* kr = k + (b0 + j0) * row;
    for (int64_t u = 0; u < units; ++u, kr += 4 * kLanes) {
      __m512i l0, h0;
      unpack(kr, l0, h0);
      for (int g = 0; g < GN; ++g) a[g] = add(a[g], l0, h0, g, u);
    }
    for (int g = 0; g < GN; ++g) finish(g, to_f16v(a[g], g), j0);
  }
#else
  // Portable: each quad's codes unpacked from the 32-bit lanes (shift
  // left, arithmetic shift right: bytes, or int4's two nibbles a byte),
  // float multiply-adds of the query's codes: the same integers, summed
  // exactly.
  for (; j0 < n; j0 += kLanes) {
    f16v a[GN];
    for (int g = 0; g < GN; ++g) a[g] = f16v{};
    const T* kr = k + (b0 + j0) * row;
    for (int64_t u = 0; u < units; ++u, kr += 4 * kLanes) {
      prefetch_l2(kr + 2 * kBlock * row);
      i32x16 w;
      std::memcpy(&w, kr, sizeof(w));
      for (int c = 0; c < 4; ++c) {
        if constexpr (nibbles) {
          const f16v lo =
              __builtin_convertvector((w << (28 - 8 * c)) >> 28, f16v);
          const f16v hi =
              __builtin_convertvector((w << (24 - 8 * c)) >> 28, f16v);
          for (int g = 0; g < GN; ++g) {
            a[g] += q.codes[g * D + 4 * u + c] * lo;
            a[g] += q.codes[g * D + row + 4 * u + c] * hi;
          }
        } else {
          const f16v kc =
              __builtin_convertvector((w << (24 - 8 * c)) >> 24, f16v);
          for (int g = 0; g < GN; ++g)
            a[g] += q.codes[g * D + 4 * u + c] * kc;
        }
      }
    }
    for (int g = 0; g < GN; ++g) finish(g, a[g], j0);
  }
#endif
  for (int g = 0; g < GN; ++g) bm[g] = hmax(vmax[g]);
}

// Lane sums of 16 vectors at once: r[k] = sum of v[k]'s lanes. A tree of
// pairwise half-swaps and adds (4 levels, 30 shuffles and 15 adds for the
// 16 sums) instead of 16 separate horizontal sums (each a chain of ~8
// dependent shuffles and adds): the latent logits' reduction cost per slot
// falls ~3x.
inline f16v lane_sums16(const f16v* v) {
  // Lane k takes the first (lo) or second (hi) h lanes of each 2h-lane
  // group of x, then of y: (k / h) · 2h + k % h (+ h), for h = 8, 4, 2, 1.
  constexpr i32x16 lo8 = {0, 1, 2, 3, 4, 5, 6, 7,
                          16, 17, 18, 19, 20, 21, 22, 23};
  constexpr i32x16 hi8 = lo8 + 8;
  constexpr i32x16 lo4 = {0, 1, 2, 3, 8, 9, 10, 11,
                          16, 17, 18, 19, 24, 25, 26, 27};
  constexpr i32x16 hi4 = lo4 + 4;
  constexpr i32x16 lo2 = {0, 1, 4, 5, 8, 9, 12, 13,
                          16, 17, 20, 21, 24, 25, 28, 29};
  constexpr i32x16 hi2 = lo2 + 2;
  constexpr i32x16 lo1 = {0, 2, 4, 6, 8, 10, 12, 14,
                          16, 18, 20, 22, 24, 26, 28, 30};
  constexpr i32x16 hi1 = lo1 + 1;
  // Each level halves the vectors and the partial sums per input vector,
  // keeping the inputs' order: level 1 puts v[2i]'s 8 partials in lanes
  // 0-7 and v[2i+1]'s in 8-15, level 2 four each, and so on.
  f16v u[8], w[4], x[2];
  for (int i = 0; i < 8; ++i)
    u[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], lo8) +
           __builtin_shuffle(v[2 * i], v[2 * i + 1], hi8);
  for (int i = 0; i < 4; ++i)
    w[i] = __builtin_shuffle(u[2 * i], u[2 * i + 1], lo4) +
           __builtin_shuffle(u[2 * i], u[2 * i + 1], hi4);
  for (int i = 0; i < 2; ++i)
    x[i] = __builtin_shuffle(w[2 * i], w[2 * i + 1], lo2) +
           __builtin_shuffle(w[2 * i], w[2 * i + 1], hi2);
  return __builtin_shuffle(x[0], x[1], lo1) + __builtin_shuffle(x[0], x[1], hi1);
}

inline f16v lane_sums(const f16v* v) { return lane_sums16(v); }
#if defined(__AVX2__) && !defined(__AVX512F__)
// Lane sums of 8 vectors at once: r[k] = sum of v[k]'s lanes (vhaddps
// pairs within 128-bit halves, then the halves added).
inline f8v lane_sums8(const f8v* v) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]),
                                   _mm256_hadd_ps(v[2], v[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]),
                                   _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20),
                       _mm256_permute2f128_ps(ab, cd, 0x31));
}

inline f8v lane_sums(const f8v* v) { return lane_sums8(v); }
#endif

// A register's lanes (V: f16v, or f8v in AVX2 builds) of floats, bfloat16
// bits or int8 codes from p, as floats.
template <typename V, typename T>
inline V lanes_of(const T* p) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  if constexpr (sizeof(V) == 32) return load8v(p);
#endif
  if constexpr (sizeof(V) == 64) return load16(p);
}

// Logits of GN query rows against P = L / GN slots whose keys are rows
// (slots j0 .. j0 + P - 1 of a, b), V a register of L float lanes (16, or
// 8 in AVX2 builds): the P × GN dot products in L accumulators, reduced
// together (`lane_sums`). Lane g · P + p of the result is slot j0 + p's
// logit for row g (lanes past P · GN: 0). With `split` (int8 codes: the
// latent and the rotary key have scales of their own) the latent part goes
// to `rc` and the rotary part to `rr`, each reduced; else both to `rc`.
template <int GN, typename T, bool split, typename V = f16v>
inline void slot_group_logits(const float* __restrict__ qa, int64_t A,
                              const float* __restrict__ qb, int64_t R,
                              const T* __restrict__ a,
                              const T* __restrict__ b, int64_t j0, V& rc,
                              V& rr) {
  constexpr int L = sizeof(V) / sizeof(float);
  constexpr int P = L / GN;
  V acc[L];
  for (int i = 0; i < L; ++i) acc[i] = V{};
  // acc[g · P + p] += q_g · row_p over the W channels in whole vectors;
  // the channels past the last multiple of L (none for MLA's usual C and
  // R) go into `tail` after the reduction.
  auto dots = [&](const float* q, int64_t W, const T* rows) {
    for (int64_t e = 0; e + L <= W; e += L) {
      V kv[P];
      for (int p = 0; p < P; ++p) kv[p] = lanes_of<V>(rows + p * W + e);
      for (int g = 0; g < GN; ++g) {
        const V qv = lanes_of<V>(q + g * W + e);
        for (int p = 0; p < P; ++p) acc[g * P + p] += qv * kv[p];
      }
    }
  };
  auto tails = [&](const float* q, int64_t W, const T* rows, V& tail) {
    for (int64_t e = W / L * L; e < W; ++e)
      for (int p = 0; p < P; ++p)
        for (int g = 0; g < GN; ++g)
          tail[g * P + p] += q[g * W + e] * load1(rows[p * W + e]);
  };
  const T* aj = a + j0 * A;
  const T* bj = b + j0 * R;
  dots(qa, A, aj);
  if (split) {
    rc = lane_sums(acc);
    for (int i = 0; i < L; ++i) acc[i] = V{};
  }
  dots(qb, R, bj);
  if (split) {
    rr = lane_sums(acc);
  } else {
    rc = lane_sums(acc);
    rr = V{};
  }
  tails(qa, A, aj, rc);
  tails(qb, R, bj, split ? rr : rc);
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// `slot_group_logits` on 8 lanes over int8 rows for a rounded query (`LatentQuery`):
// integer products as `block_logits_codes`' AVX2 path takes them (|q| and
// k · sign(q) into vpmaddubsw, pairs into int32 by vpmaddwd), 32 channels
// an instruction; lanes g · P + p of rc / rr the exact integer sums.
template <int GN>
inline void slot_group_logits_i8x8(const LatentQuery& q, int64_t A,
                                   int64_t R, const int8_t* __restrict__ a,
                                   const int8_t* __restrict__ b, int64_t j0,
                                   f8v& rc, f8v& rr) {
  constexpr int P = 8 / GN;
  const __m256i ones = _mm256_set1_epi16(1);
  auto dots = [&](const int8_t* qc, int64_t W, const int8_t* rows) {
    __m256i acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_si256();
    auto chunk = [&](int64_t e, auto load) {
      __m256i kv[P];
      for (int p = 0; p < P; ++p) kv[p] = load(rows + p * W + e);
      for (int g = 0; g < GN; ++g) {
        const __m256i qv = load(qc + g * W + e);
        const __m256i qa = _mm256_abs_epi8(qv);
        for (int p = 0; p < P; ++p)
          acc[g * P + p] = _mm256_add_epi32(
              acc[g * P + p],
              _mm256_madd_epi16(
                  _mm256_maddubs_epi16(qa, _mm256_sign_epi8(kv[p], qv)),
                  ones));
      }
    };
    int64_t e = 0;
    for (; e + 32 <= W; e += 32)
      chunk(e, [](const int8_t* x) {
        return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
      });
    if (e + 16 <= W) {  // 16 channels in the low half, zeros above
      chunk(e, [](const int8_t* x) {
        return _mm256_zextsi128_si256(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
      });
      e += 16;
    }
    f8v f[8];
    for (int i = 0; i < 8; ++i) f[i] = _mm256_cvtepi32_ps(acc[i]);
    f8v r = lane_sums8(f);
    for (; e < W; ++e)  // channels past the last 16
      for (int p = 0; p < P; ++p)
        for (int g = 0; g < GN; ++g)
          r[g * P + p] += static_cast<float>(qc[g * W + e]) *
                           static_cast<float>(rows[p * W + e]);
    return r;
  };
  rc = dots(q.ca, A, a + j0 * A);
  rr = dots(q.cb, R, b + j0 * R);
}
#endif

#if defined(__AVX512VNNI__)
// `slot_group_logits` over int8 rows for a rounded query (`LatentQuery`):
// VNNI dots, 64 channels of a row an instruction (masked loads for the
// last), lanes g · P + p of rc / rr the exact integer sums q_g · row_p
// (each accumulator starts at -offset in lane 0, taking off the +128 of
// the unsigned key bytes; exact in float for A <= 512).
template <int GN>
inline void slot_group_logits_vnni(const LatentQuery& q, int64_t A,
                                   int64_t R, const int8_t* __restrict__ a,
                                   const int8_t* __restrict__ b, int64_t j0,
                                   f16v& rc, f16v& rr) {
  constexpr int P = 16 / GN;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  auto dots = [&](const int8_t* qc, const int32_t* off, int64_t W,
                  const int8_t* rows) {
    __m512i acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_si512();
    for (int p = 0; p < P; ++p)
      for (int g = 0; g < GN; ++g)
        acc[g * P + p] = _mm512_mask_set1_epi32(acc[g * P + p], 1, -off[g]);
    for (int64_t e = 0; e < W; e += 64) {
      const __mmask64 m =
          W - e >= 64 ? ~__mmask64{0} : (__mmask64{1} << (W - e)) - 1;
      __m512i kv[P];
      for (int p = 0; p < P; ++p)
        kv[p] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, rows + p * W + e),
                                 flip);
      for (int g = 0; g < GN; ++g) {
        const __m512i qv = _mm512_maskz_loadu_epi8(m, qc + g * W + e);
        for (int p = 0; p < P; ++p)
          acc[g * P + p] = _mm512_dpbusd_epi32(acc[g * P + p], kv[p], qv);
      }
    }
    f16v f[16];
    for (int i = 0; i < 16; ++i) {
      const __m512 x = _mm512_cvtepi32_ps(acc[i]);
      std::memcpy(&f[i], &x, sizeof(x));
    }
    return lane_sums16(f);
  };
  rc = dots(q.ca, q.oa, A, a + j0 * A);
  rr = dots(q.cb, q.ob, R, b + j0 * R);
}
#endif

// The per-slot form of `block_logits_rows` for slots [j_begin, n) of the
// block: one horizontal sum per (row, slot).
template <int GN, typename T>
inline void block_logits_rows_each(const float* __restrict__ qa, int64_t A,
                                   const float* __restrict__ qb, int64_t R,
                                   const T* __restrict__ a,
                                   const T* __restrict__ b,
                                   const float* __restrict__ cs,
                                   const float* __restrict__ rs,
                                   const float* __restrict__ sa,
                                   const float* __restrict__ sb,
                                   const bool* __restrict__ mask, int64_t b0,
                                   int64_t j_begin, int64_t n,
                                   float* __restrict__ lg,
                                   float* __restrict__ bm) {
  for (int64_t j = j_begin; j < n; ++j) {
    const T* aj = a + (b0 + j) * A;
    const T* bj = b + (b0 + j) * R;
    f16v acc[GN], accr[GN];
    for (int g = 0; g < GN; ++g) acc[g] = accr[g] = f16v{};
    int64_t e = 0;
    for (; e + kLanes <= A; e += kLanes) {
      const f16v kv = load16(aj + e);
      for (int g = 0; g < GN; ++g) acc[g] += load16(qa + g * A + e) * kv;
    }
    float tail[GN] = {}, tailr[GN] = {};
    for (; e < A; ++e)
      for (int g = 0; g < GN; ++g) tail[g] += qa[g * A + e] * load1(aj[e]);
    e = 0;
    for (; e + kLanes <= R; e += kLanes) {
      const f16v kv = load16(bj + e);
      for (int g = 0; g < GN; ++g) accr[g] += load16(qb + g * R + e) * kv;
    }
    for (; e < R; ++e)
      for (int g = 0; g < GN; ++g) tailr[g] += qb[g * R + e] * load1(bj[e]);
    for (int g = 0; g < GN; ++g) {
      const float dc = hsum(acc[g]) + tail[g], dr = hsum(accr[g]) + tailr[g];
      const float dot =
          cs != nullptr
              ? int8_logit(cs[b0 + j], sa[g], dc, rs[b0 + j], sb[g], dr)
              : dc + dr;
      const float x = mask[b0 + j] ? dot : kLowest;
      lg[g * kBlock + j] = x;
      bm[g] = std::max(bm[g], x);
    }
  }
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// P consecutive floats from p in every P-lane run of a register: lane k
// holds p[k % P] (P = 8, 4, 2 or 1; reads exactly P floats).
template <int P>
inline f8v runs8(const float* p) {
  if constexpr (P == 8) return _mm256_loadu_ps(p);
  if constexpr (P == 4) return _mm256_broadcast_ps(reinterpret_cast<const __m128*>(p));
  if constexpr (P == 2)
    return _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(p)));
  if constexpr (P == 1) return _mm256_broadcast_ss(p);
}

// The same for P mask bytes: lane k all ones where mask[k % P].
template <int P>
inline __m256 mask_runs8(const bool* mask) {
  __m128i bytes;
  if constexpr (P == 8) {
    uint64_t u;
    std::memcpy(&u, mask, 8);
    bytes = _mm_cvtsi64_si128(static_cast<int64_t>(u));
  } else if constexpr (P == 4) {
    uint32_t u;
    std::memcpy(&u, mask, 4);
    bytes = _mm_set1_epi32(static_cast<int32_t>(u));
  } else if constexpr (P == 2) {
    uint16_t u;
    std::memcpy(&u, mask, 2);
    bytes = _mm_set1_epi16(static_cast<int16_t>(u));
  } else {
    bytes = _mm_set1_epi8(static_cast<char>(mask[0]));
  }
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_cvtepu8_epi32(bytes),
                                                _mm256_setzero_si256()));
}

// A slot group's logits x, lane g · P + p row g's logit of slot j + p
// (`slot_group_logits`), masked and stored into lg[g][j ..] (each row's P
// lanes as one store), their running maxima in vmax: no per-lane scalar
// work (it had cost as much as a group's reduction).
template <int GN>
inline void store_group8(f8v x, const bool* __restrict__ mask,
                         float* __restrict__ lg, f8v& vmax) {
  constexpr int P = 8 / GN;
  x = _mm256_blendv_ps(bcast8(kLowest), x, mask_runs8<P>(mask));
  vmax = _mm256_max_ps(vmax, x);
  if constexpr (P == 8) {
    _mm256_storeu_ps(lg, x);
  } else {
    const __m128 lo = _mm256_castps256_ps128(x);
    const __m128 hi = _mm256_extractf128_ps(x, 1);
    if constexpr (P == 4) {
      _mm_storeu_ps(lg, lo);
      _mm_storeu_ps(lg + kBlock, hi);
    } else if constexpr (P == 2) {
      _mm_storel_pi(reinterpret_cast<__m64*>(lg), lo);
      _mm_storeh_pi(reinterpret_cast<__m64*>(lg + kBlock), lo);
      _mm_storel_pi(reinterpret_cast<__m64*>(lg + 2 * kBlock), hi);
      if constexpr (GN == 4)
        _mm_storeh_pi(reinterpret_cast<__m64*>(lg + 3 * kBlock), hi);
    } else {
      float t[8];
      _mm256_storeu_ps(t, x);
      for (int g = 0; g < GN; ++g) lg[g * kBlock] = t[g];
    }
  }
}
#endif

// Logits of GN query rows against one block of n slots whose keys are rows:
// lg[g][j] = qa_g . a_j + qb_g . b_j, a [S, A] and b [S, R] (MLA's latents
// and rotary keys). Slots go in groups of 16 / GN (`slot_group_logits`),
// each key row loaded once for all GN rows; the block's last slots that
// fill no group go one at a time. int8 codes (cs set) take the rounded
// query `lq` instead of qa, qb: lg = cs · sa · (ca · a) + rs · sb · (cb · b).
template <int GN, typename T>
inline void block_logits_rows(const float* __restrict__ qa, int64_t A,
                              const float* __restrict__ qb, int64_t R,
                              const LatentQuery& lq,
                              const T* __restrict__ a,
                              const T* __restrict__ b,
                              const float* __restrict__ cs,
                              const float* __restrict__ rs,
                              const bool* __restrict__ mask, int64_t b0,
                              int64_t n, float* __restrict__ lg,
                              float* __restrict__ bm) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  using lanes = f8v;  // 8-lane slot groups
  constexpr int P = 8 / GN;
  auto group = [&](auto split, const float* x, const float* y, int64_t s,
                   lanes& rc, lanes& rr) {
    slot_group_logits<GN, T, decltype(split)::value, f8v>(x, A, y, R, a, b, s,
                                                          rc, rr);
  };
#else
  using lanes = f16v;
  constexpr int P = 16 / GN;
  auto group = [&](auto split, const float* x, const float* y, int64_t s,
                   lanes& rc, lanes& rr) {
    slot_group_logits<GN, T, decltype(split)::value>(x, A, y, R, a, b, s, rc,
                                                     rr);
  };
#endif
  constexpr int64_t kLine = 64 / sizeof(T);  // elements per cache line
  for (int g = 0; g < GN; ++g) bm[g] = kLowest;
#if defined(__AVX2__) && !defined(__AVX512F__)
  // Lane g · P + p's query scales (int8 codes), and the running maxima.
  alignas(32) float sa_l[8] = {}, sb_l[8] = {};
  if (cs != nullptr)
    for (int k = 0; k < GN * P; ++k) {
      sa_l[k] = lq.sa[k / P];
      sb_l[k] = lq.sb[k / P];
    }
  const f8v sav = load8(sa_l), sbv = load8(sb_l);
  f8v vmax = bcast8(kLowest);
#endif
  int64_t j = 0;
  for (; j + P <= n; j += P) {
    // The rows two blocks ahead, latents and rotary keys, on their way
    // while this group computes (the hardware prefetcher alone left the
    // loads waiting on memory: 10.5 of 26.5 GB/s).
    for (int p = 0; p < P; ++p) {
      const T* ahead_a = a + (b0 + j + p + kAheadSlots) * A;
      for (int64_t e = 0; e < A; e += kLine) prefetch_l2(ahead_a + e);
      prefetch_l2(b + (b0 + j + p + kAheadSlots) * R);
    }
    lanes rc, rr;
    if (cs != nullptr) {  // int8 codes: each part times its slot's scale
#if defined(__AVX512VNNI__)
      if constexpr (std::is_same_v<T, int8_t>) {
        slot_group_logits_vnni<GN>(lq, A, R, a, b, b0 + j, rc, rr);
      } else {
        group(std::true_type(), lq.fa, lq.fb, b0 + j, rc, rr);
      }
#elif defined(__AVX2__) && !defined(__AVX512F__)
      if constexpr (std::is_same_v<T, int8_t>) {
        slot_group_logits_i8x8<GN>(lq, A, R, a, b, b0 + j, rc, rr);
      } else {
        group(std::true_type(), lq.fa, lq.fb, b0 + j, rc, rr);
      }
#else
      group(std::true_type(), lq.fa, lq.fb, b0 + j, rc, rr);
#endif
#if defined(__AVX2__) && !defined(__AVX512F__)
      // `int8_logit` in lanes: the same roundings, one fma.
      const int64_t s = b0 + j;
      store_group8<GN>(
          _mm256_fmadd_ps(runs8<P>(cs + s), sav * rc,
                          runs8<P>(rs + s) * (sbv * rr)),
          mask + s, lg + j, vmax);
#else
      for (int p = 0; p < P; ++p)
        for (int g = 0; g < GN; ++g) {
          const int k = g * P + p;
          const int64_t s = b0 + j + p;
          const float x = mask[s] ? int8_logit(cs[s], lq.sa[g], rc[k],
                                               rs[s], lq.sb[g], rr[k])
                                  : kLowest;
          lg[g * kBlock + j + p] = x;
          bm[g] = std::max(bm[g], x);
        }
#endif
    } else {
      group(std::false_type(), qa, qb, b0 + j, rc, rr);
#if defined(__AVX2__) && !defined(__AVX512F__)
      store_group8<GN>(rc, mask + b0 + j, lg + j, vmax);
#else
      for (int p = 0; p < P; ++p)
        for (int g = 0; g < GN; ++g) {
          const float x = mask[b0 + j + p] ? rc[g * P + p] : kLowest;
          lg[g * kBlock + j + p] = x;
          bm[g] = std::max(bm[g], x);
        }
#endif
    }
  }
#if defined(__AVX2__) && !defined(__AVX512F__)
  alignas(32) float lane_max[8];
  store8(lane_max, vmax);
  for (int k = 0; k < GN * P; ++k)
    bm[k / P] = std::max(bm[k / P], lane_max[k]);
#endif
  if (cs != nullptr) {
    block_logits_rows_each<GN, T>(lq.fa, A, lq.fb, R, a, b, cs, rs, lq.sa,
                                  lq.sb, mask, b0, j, n, lg, bm);
  } else {
    block_logits_rows_each<GN, T>(qa, A, qb, R, a, b, cs, rs, nullptr,
                                  nullptr, mask, b0, j, n, lg, bm);
  }
}

// For each of W blocks of 16 value channels starting at e0[w]:
// acc[g][e0[w] ..] += sum_j p[g][j] · v_w(j) over a block's n slots, where
// row(j, v) sets v[w] to slot j's 16 channels of block w as floats; fetch(j)
// prefetches what slot j two blocks ahead will read. Even and odd slots go
// into separate sums (the multiply-add latency), added at the end.
template <int GN, int W, typename Row, typename Fetch>
inline void value_channels(const float* __restrict__ p, const Row& row,
                           const Fetch& fetch, int64_t n,
                           float* __restrict__ acc, int64_t E,
                           const int64_t (&e0)[W]) {
  f16v a[W][GN], c[W][GN];
  for (int w = 0; w < W; ++w)
    for (int g = 0; g < GN; ++g) {
      a[w][g] = load16(acc + g * E + e0[w]);
      c[w][g] = f16v{};
    }
  int64_t j = 0;
  for (; j + 2 <= n; j += 2) {
    fetch(j);
    fetch(j + 1);
    f16v v0[W], v1[W];
    row(j, v0);
    row(j + 1, v1);
    for (int w = 0; w < W; ++w)
      for (int g = 0; g < GN; ++g) {
        a[w][g] += p[g * kBlock + j] * v0[w];
        c[w][g] += p[g * kBlock + j + 1] * v1[w];
      }
  }
  for (; j < n; ++j) {
    f16v vv[W];
    row(j, vv);
    for (int w = 0; w < W; ++w)
      for (int g = 0; g < GN; ++g) a[w][g] += p[g * kBlock + j] * vv[w];
  }
  for (int w = 0; w < W; ++w)
    for (int g = 0; g < GN; ++g)
      store16(acc + g * E + e0[w], a[w][g] + c[w][g]);
}

// acc[g][e] += sum_j p[g][j] · v[j][e] over values [S, E]; with `ahead`,
// prefetching the values two blocks ahead (MLA's values are its latents,
// which the logits prefetch already).
template <int GN, typename VT, bool ahead = true>
inline void block_values(const float* __restrict__ p,
                         const VT* __restrict__ v, int64_t E, int64_t b0,
                         int64_t n, float* __restrict__ acc) {
  const VT* vb = v + b0 * E;
#if defined(__AVX2__) && !defined(__AVX512F__)
  return block_values8<GN, ahead>(p, vb, E, n, acc);
#endif
  int64_t e0 = 0;
  for (; e0 + kLanes <= E; e0 += kLanes)
    value_channels<GN, 1>(
        p, [&](int64_t j, f16v* r) { r[0] = load16(vb + j * E + e0); },
        [&](int64_t j) {
          if (ahead) prefetch_l2(vb + (j + 2 * kBlock) * E + e0);
        },
        n, acc, E, {e0});
  for (; e0 < E; ++e0)  // channels past the last multiple of 16
    for (int g = 0; g < GN; ++g)
      for (int64_t j = 0; j < n; ++j)
        acc[g * E + e0] += p[g * kBlock + j] * load1(vb[j * E + e0]);
}

// `block_values` over int4 values read as stored, rows of E/2 bytes
// (`quant.pack_int4`: channel i in byte i's low nibble, i + E/2 in its
// high one), in blocks of 16 channels as `block_values` takes them, in the
// same order over the same codes: int8's sums to the bit where E/2 is a
// multiple of 16. Up to 4 query rows hold both halves' sums in registers,
// so each 16 bytes are loaded and sign-extended once for 32 channels;
// wider tiles take the halves one after the other.
template <int GN>
inline void block_values_nibbles(const float* __restrict__ p,
                                 const uint8_t* __restrict__ v, int64_t E,
                                 int64_t b0, int64_t n,
                                 float* __restrict__ acc) {
  const int64_t E2 = E / 2;
  const uint8_t* vb = v + b0 * E2;
#if defined(__AVX2__) && !defined(__AVX512F__)
  // 8 lanes: each half of the channels (low nibbles, then high ones) as
  // `value_channels8` takes int8's.
  auto half = [&](auto high_tag) {
    constexpr bool high = decltype(high_tag)::value;
    const int64_t off = high ? E2 : 0;  // channel e is byte e - off
    value_channels8<GN>(
        p,
        [&](int64_t j, int64_t e) {
          const __m256i x = _mm256_cvtepi8_epi32(_mm_loadl_epi64(
              reinterpret_cast<const __m128i*>(vb + j * E2 + e - off)));
          return _mm256_cvtepi32_ps(
              high ? _mm256_srai_epi32(x, 4)
                   : _mm256_srai_epi32(_mm256_slli_epi32(x, 28), 28));
        },
        [&](int64_t j, int64_t e) {
          return load1_nibble(vb[j * E2 + e - off], high);
        },
        [&](int64_t j, int64_t e, int64_t c) {  // the high half re-reads
          if (!high) prefetch_span(vb + (j + 2 * kBlock) * E2 + e, c);
        },
        n, acc, E, off, off + E2);
  };
  half(std::false_type());
  half(std::true_type());
  return;
#endif
  auto fetch_at = [&](int64_t i0) {
    return [vb, E2, i0](int64_t j) {
      prefetch_l2(vb + (j + 2 * kBlock) * E2 + i0);
    };
  };
  int64_t i0 = 0;  // byte in the row: channels i0 (low) and E2 + i0 (high)
  if constexpr (GN <= 4) {
    for (; i0 + kLanes <= E2; i0 += kLanes)
      value_channels<GN, 2>(
          p,
          [&](int64_t j, f16v* r) {
            load16_nibble_pair(vb + j * E2 + i0, r[0], r[1]);
          },
          fetch_at(i0), n, acc, E, {i0, E2 + i0});
  } else {
    // One half of the channels after the other (one block of sums each).
    auto half = [&](auto high_tag) {
      constexpr bool high = decltype(high_tag)::value;
      for (int64_t b = 0; b + kLanes <= E2; b += kLanes)
        value_channels<GN, 1>(
            p,
            [&](int64_t j, f16v* r) {
              r[0] = load16_nibbles<high>(vb + j * E2 + b);
            },
            [&](int64_t j) {  // the high half re-reads what the low brought
              if constexpr (!high) fetch_at(b)(j);
            },
            n, acc, E, {high * E2 + b});
    };
    half(std::false_type());
    half(std::true_type());
    i0 = E2 / kLanes * kLanes;
  }
  for (; i0 < E2; ++i0)  // bytes past the last multiple of 16
    for (int half = 0; half < 2; ++half)
      for (int g = 0; g < GN; ++g)
        for (int64_t j = 0; j < n; ++j)
          acc[g * E + half * E2 + i0] +=
              p[g * kBlock + j] * load1_nibble(vb[j * E2 + i0], half == 1);
}

// One block's step of the online softmax for GN query rows: lg[g][0, n)
// holds the block's logits (scaled, masked) and bm[g] their maximum. The
// running maximum m, sum l and output sums acc [GN, E] move to the new
// maximum, and lg becomes the weights exp(x - m), each times its slot's
// value scale vs[j] where given (int8: the scale goes into the weight, not
// into the sum).
template <int GN>
inline void softmax_block(float* __restrict__ lg, const float* bm, int64_t n,
                          const float* __restrict__ vs, int64_t E,
                          float* __restrict__ m, float* __restrict__ l,
                          float* __restrict__ acc) {
  for (int g = 0; g < GN; ++g) {
    float* row = lg + g * kBlock;
    const float m_new = std::max(m[g], bm[g]);
    const float corr = std::exp(m[g] - m_new);
    if (corr != 1.0f) {
      l[g] *= corr;
      for (int64_t e = 0; e < E; ++e) acc[g * E + e] *= corr;
    }
    // The weights a register at a time, their sum kept in lanes and
    // reduced once per row and block.
    int64_t j0 = 0;
#if defined(__AVX2__) && !defined(__AVX512F__)
    // 8 lanes (`exp8`: GCC left the 16-lane loop below scalar on AVX2).
    const f8v mv = bcast8(m_new);
    f8v sums = {};
    for (; j0 + 8 <= n; j0 += 8) {
      const f8v p = exp8(load8(row + j0) - mv);
      sums += p;
      store8(row + j0, vs != nullptr ? p * load8(vs + j0) : p);
    }
    float total = hsum8(sums);
#else
    f16v sums = {};
    for (; j0 + kLanes <= n; j0 += kLanes) {
      alignas(64) float w[kLanes];
#pragma omp simd
      for (int64_t t = 0; t < kLanes; ++t)
        w[t] = exp_nonpositive(row[j0 + t] - m_new);
      const f16v p = load16(w);
      sums += p;
      store16(row + j0, vs != nullptr ? p * load16(vs + j0) : p);
    }
    float total = hsum(sums);
#endif
    for (; j0 < n; ++j0) {  // MLA's slots past the last register
      const float p = exp_nonpositive(row[j0] - m_new);
      total += p;
      row[j0] = vs != nullptr ? p * vs[j0] : p;
    }
    l[g] += total;
    m[g] = m_new;
  }
}

// One tile of GN query rows over slots [s0, s1): the online softmax.
// logits(b0, n, lg) fills lg[g][j] for the block's n slots from b0.
template <int GN, typename T, bool value_ahead, bool pair_values,
          typename Logits>
void attend_tile(const Logits& logits, const T* __restrict__ v,
                 const float* __restrict__ v_scale, int64_t E, int64_t s0,
                 int64_t s1, float* __restrict__ m, float* __restrict__ l,
                 float* __restrict__ acc, bool dot = false) {
  alignas(64) float lg[GN * kBlock];
  float bm[GN];
  for (int64_t b0 = s0; b0 < s1; b0 += kBlock) {
    const int64_t n = std::min(kBlock, s1 - b0);
    logits(b0, n, lg, bm);  // scaled, masked, and each row's maximum
    softmax_block<GN>(lg, bm, n, v_scale != nullptr ? v_scale + b0 : nullptr,
                      E, m, l, acc);
    if constexpr (pair_values) {
      block_values_pairs<GN>(lg, v, E, b0, n, acc, dot);
    } else if constexpr (std::is_same_v<T, uint8_t>) {
      block_values_nibbles<GN>(lg, v, E, b0, n, acc);
    } else {
      block_values<GN, T, value_ahead>(lg, v, E, b0, n, acc);
    }
  }
}

template <int GN, typename T>
void gqa_tile(const float* qg, const QuadQuery& quads, const uint32_t* qw,
              const float* qf, const T* k, const float* k_scale, const T* v,
              const float* v_scale, const bool* mask, int64_t D, int64_t E,
              int64_t S, int64_t s0, int64_t s1, float* m, float* l,
              float* acc, bool dot) {
  // bfloat16 (bits, uint16): keys in pair tiles, values two slots at a
  // time; `dot`: their products as vdpbf16ps (`Bf16Form`).
  constexpr bool pairs = std::is_same_v<T, uint16_t>;
  attend_tile<GN, T, true, pairs>(
      [&](int64_t b0, int64_t n, float* lg, float* bm) {
        if constexpr (std::is_same_v<T, int8_t> ||
                      std::is_same_v<T, uint8_t>) {  // int8, int4 codes
          block_logits_codes<GN, T>(quads, D, k, k_scale, mask, b0, n, lg,
                                    bm);
        } else if constexpr (pairs) {
          block_logits_pairs<GN>(qw, qf, D, k, mask, b0, n, lg, bm, dot);
        } else {
          block_logits<GN, T>(qg, D, k, k_scale, mask, b0, n, lg, bm);
        }
      },
      v, v_scale, E, s0, s1, m, l, acc, dot);
}

// How MLA's latent products run (`latent_attend`'s `latent_products`):
// 'auto' takes AMX tiles wherever the build, the OS and the shapes allow
// them (`amx_latents`), else the vector path; 'amx' is refused where they
// cannot run; 'vector' is the AVX-512 (or portable) path of
// `latent_tile`.
enum LatentForm : int64_t {
  kLatentAuto = 0,
  kLatentAmx = 1,
  kLatentVector = 2
};

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && \
    defined(__AMX_INT8__) && defined(__AVX512F__) && defined(__linux__)
#define KVJAX_AMX 1
#else
#define KVJAX_AMX 0
#endif

// Whether this process may use AMX's tiles: Linux grants their state only
// to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA),
// once; false in a build without AMX.
bool amx_usable() {
#if KVJAX_AMX
  static const bool ok =
      syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
              18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
#else
  return false;
#endif
}

// Whether latents of `elem`-byte elements (bfloat16 bits: 2, int8 codes:
// 1) with A latent and R rotary channels fit the AMX tiles: each latent row
// in whole 64-byte tile rows, the rotary row in whole 4-byte words, at
// most one tile row.
inline bool amx_shapes(int64_t elem, int64_t A, int64_t R) {
  return elem != 4 && A > 0 && (A * elem) % 64 == 0 && (R * elem) % 4 == 0 &&
         R * elem <= 64;
}

// Whether MLA's latents of type T run on AMX tiles under `form`.
template <typename T>
bool amx_latents(int64_t form, int64_t A, int64_t R) {
  constexpr bool typed =
      std::is_same_v<T, uint16_t> || std::is_same_v<T, int8_t>;
  return typed && form != kLatentVector && amx_usable() &&
         amx_shapes(sizeof(T), A, R);
}

#if KVJAX_AMX
// AMX's tile configuration (palette 1): rows and bytes per row of each of
// the eight tiles. `latent_tile_amx`'s tiles:
//   0  latent logits, [16 slots, GN] float32 (int8: int32)
//   1  rotary logits of int8 codes (their own scales), [16, GN] int32
//   2  latent rows as A [16 slots, 64 B]
//   3  the query's latent words as B, [16, GN words]
//   4  rotary rows as A [16 slots, R elements]
//   5  the query's rotary words as B
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  void set(int tile, int64_t r, int64_t bytes) {
    rows[tile] = static_cast<uint8_t>(r);
    colsb[tile] = static_cast<uint16_t>(bytes);
  }
};

// Query rows [G, W] as AMX's B operand for the rows g0 .. g0 + GN:
// words of 2 bfloat16s (x float: rounded as `bf16_bits`) or 4 int8 codes,
// [W / per, GN] (word w of row g at w · GN + g).
inline std::vector<uint32_t> query_words(const float* x, int64_t GN,
                                         int64_t W) {
  std::vector<uint32_t> out(W / 2 * GN);
  for (int64_t g = 0; g < GN; ++g)
    for (int64_t w = 0; w < W / 2; ++w)
      out[w * GN + g] =
          bf16_bits(x[g * W + 2 * w]) | bf16_bits(x[g * W + 2 * w + 1]) << 16;
  return out;
}
inline std::vector<uint32_t> query_words(const int8_t* x, int64_t GN,
                                         int64_t W) {
  std::vector<uint32_t> out(W / 4 * GN);
  for (int64_t g = 0; g < GN; ++g)
    for (int64_t w = 0; w < W / 4; ++w)
      std::memcpy(&out[w * GN + g], x + g * W + 4 * w, 4);
  return out;
}

// One query tile's AMX operands: the latent and rotary query words
// (`query_words`), the int8 query's row scales, and scratch for a group of
// slots past the range's end.
template <typename T>
struct AmxTile {
  std::vector<uint32_t> qa, qb;
  const float *sa = nullptr, *sb = nullptr;
  std::vector<T> pad;           // [16, A + R]
};

// `block_logits_rows` on AMX tiles: each group of 16 slots' latent rows
// (tile 2, 64 bytes of each row at a time) times the query words (tile 3)
// into [16, GN] sums, the rotary part likewise; the sums go to lg[g][j]
// with the mask (int8: exact integer sums times the query's and the
// slots' scales, as the VNNI path's). The bfloat16 products take the
// query rounded to bfloat16 (FlashAttention's numerics).
template <int GN, typename T>
void amx_block_logits(AmxTile<T>& t, const T* __restrict__ a, int64_t A,
                      const T* __restrict__ b, int64_t R,
                      const float* __restrict__ cs,
                      const float* __restrict__ rs,
                      const bool* __restrict__ mask, int64_t b0, int64_t n,
                      float* __restrict__ lg, float* __restrict__ bm) {
  constexpr bool codes = std::is_same_v<T, int8_t>;
  constexpr int64_t chunk = 64 / sizeof(T);  // channels per tile row
  constexpr int64_t per = 4 / sizeof(T);     // channels per word
  alignas(64) float sums[16 * GN];
  alignas(64) int32_t ia[16 * GN], ib[16 * GN];
  f16v vmax[GN];
  for (int g = 0; g < GN; ++g) {
    bm[g] = kLowest;
    vmax[g] = f16v{} + kLowest;
  }
  auto gathered = [](__m512 x) {
    f16v r;
    std::memcpy(&r, &x, sizeof(r));
    return r;
  };
  auto as_m512 = [](f16v x) {
    __m512 r;
    std::memcpy(&r, &x, sizeof(r));
    return r;
  };
  // Lane p of row g's sums sits at p · GN + g of the stored [16, GN] tile.
  const __m512i at = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(GN));
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t rows = std::min<int64_t>(16, n - j0);
    const T* ar = a + (b0 + j0) * A;
    const T* br = b + (b0 + j0) * R;
    // The rotary rows two blocks ahead on their way; the latent rows' are
    // issued by the values' loop (`latent_tile_amx`).
    for (int p = 0; p < 16; ++p)
      prefetch_l2(b + (b0 + j0 + p + kAheadSlots) * R);
    if (rows < 16) {  // the range's last slots: rows past them read zeros
      T* pa = t.pad.data();
      T* pb = pa + 16 * A;
      std::fill(t.pad.begin(), t.pad.end(), T{});
      std::memcpy(pa, ar, rows * A * sizeof(T));
      std::memcpy(pb, br, rows * R * sizeof(T));
      ar = pa;
      br = pb;
    }
    _tile_zero(0);
    if constexpr (codes) _tile_zero(1);
    for (int64_t c = 0; c < A; c += chunk) {
      _tile_loadd(2, ar + c, A * sizeof(T));
      _tile_loadd(3, t.qa.data() + c / per * GN, GN * 4);
      if constexpr (codes) {
        _tile_dpbssd(0, 2, 3);
      } else {
        _tile_dpbf16ps(0, 2, 3);
      }
    }
    if (R > 0) {
      _tile_loadd(4, br, R * sizeof(T));
      _tile_loadd(5, t.qb.data(), GN * 4);
      if constexpr (codes) {
        _tile_dpbssd(1, 4, 5);
      } else {
        _tile_dpbf16ps(0, 4, 5);
      }
    }
    if constexpr (codes) {
      _tile_stored(0, ia, GN * 4);
      _tile_stored(1, ib, GN * 4);
    } else {
      _tile_stored(0, sums, GN * 4);
    }
    if (rows == 16) {
      // Row g's 16 sums gathered into lanes (`at`), finished 16 slots at a
      // time (`finish16`).
      const int64_t s = b0 + j0;
      const __m512 cs16 = codes ? _mm512_loadu_ps(cs + s) : __m512{};
      const __m512 rs16 = codes ? _mm512_loadu_ps(rs + s) : __m512{};
      for (int g = 0; g < GN; ++g) {
        const __m512i idx = _mm512_add_epi32(at, _mm512_set1_epi32(g));
        f16v x;
        if constexpr (codes) {
          const f16v dc = gathered(_mm512_cvtepi32_ps(
              _mm512_i32gather_epi32(idx, ia, 4)));
          const f16v dr = gathered(_mm512_cvtepi32_ps(
              _mm512_i32gather_epi32(idx, ib, 4)));
          // `int8_logit` in lanes: the same multiplies and one fma.
          const __m512 u = as_m512(t.sa[g] * dc), v = as_m512(t.sb[g] * dr);
          x = gathered(_mm512_fmadd_ps(cs16, u, _mm512_mul_ps(rs16, v)));
        } else {
          x = gathered(_mm512_i32gather_ps(idx, sums, 4));
        }
        store16(lg + g * kBlock + j0, finish16(x, nullptr, mask + s, vmax[g]));
      }
      continue;
    }
    for (int64_t p = 0; p < rows; ++p) {  // the range's last slots
      const int64_t s = b0 + j0 + p;
      for (int g = 0; g < GN; ++g) {
        float x;
        if constexpr (codes) {
          const float dc = static_cast<float>(ia[p * GN + g]);
          const float dr = static_cast<float>(ib[p * GN + g]);
          x = int8_logit(cs[s], t.sa[g], dc, rs[s], t.sb[g], dr);
        } else {
          x = sums[p * GN + g];
        }
        x = mask[s] ? x : kLowest;
        lg[g * kBlock + j0 + p] = x;
        bm[g] = std::max(bm[g], x);
      }
    }
  }
  for (int g = 0; g < GN; ++g) bm[g] = std::max(bm[g], hmax(vmax[g]));
}

// `latent_tile` with its logits on AMX tiles (`amx_latents`): the same
// online softmax and the same values' sums. (The values' sums as tile
// products too, the weights rounded to bfloat16 against slot pairs built
// per block, measured slower than the vector path's multiply-adds: 3.9
// against 3.2 ms for bfloat16 latents at B 8, N 8, C 128, R 16, 16,384
// slots on the Intel Xeon, the pairs' building alone 1.4 ms.)
template <int GN, typename T>
void latent_tile_amx(AmxTile<T>& t, const T* a, const T* b, const float* cs,
                     const float* rs, const bool* mask, int64_t A, int64_t R,
                     int64_t s0, int64_t s1, float* m, float* l,
                     float* acc) {
  constexpr int64_t elem = sizeof(T);
  TileConfig cfg;
  cfg.set(0, 16, GN * 4);
  cfg.set(1, 16, GN * 4);
  cfg.set(2, 16, 64);
  cfg.set(3, 16, GN * 4);
  cfg.set(4, 16, R > 0 ? R * elem : 4);
  cfg.set(5, R > 0 ? R * elem / 4 : 1, GN * 4);
  _tile_loadconfig(&cfg);
  alignas(64) float lg[GN * kBlock];
  float bm[GN];
  for (int64_t b0 = s0; b0 < s1; b0 += kBlock) {
    const int64_t n = std::min(kBlock, s1 - b0);
    amx_block_logits<GN, T>(t, a, A, b, R, cs, rs, mask, b0, n, lg, bm);
    softmax_block<GN>(lg, bm, n, cs != nullptr ? cs + b0 : nullptr, A, m, l,
                      acc);
    // The values' loop prefetches the latent rows two blocks ahead, so
    // that the reads stream while it computes (prefetched in the logits,
    // as the vector path does, they waited through it: the kernel alone
    // 1.09-1.21x slower, bfloat16 and int8 latents at B 8, N 8, C 128,
    // R 16, 16,384 slots on the Intel Xeon, one process alternating).
    block_values<GN, T, true>(lg, a, A, b0, n, acc);
  }
  _tile_release();
}
#endif  // KVJAX_AMX

template <int GN, typename T>
void latent_tile(const float* qa, const float* qb, const LatentQuery& lq,
                 const T* a, const T* b, const float* cs, const float* rs,
                 const bool* mask, int64_t A, int64_t R, int64_t s0,
                 int64_t s1, float* m, float* l, float* acc) {
  // The latents are the values too; an int8 latent's scale goes into its
  // weight (`attend_tile`'s value scales).
  attend_tile<GN, T, false, false>(
      [&](int64_t b0, int64_t n, float* lg, float* bm) {
        block_logits_rows<GN, T>(qa, A, qb, R, lq, a, b, cs, rs, mask, b0, n,
                                 lg, bm);
      },
      a, cs, A, s0, s1, m, l, acc);
}

// Dispatches a query tile of gn <= kRows rows to its register width.
template <typename F>
void by_rows(int64_t gn, const F& f) {
  switch (gn) {
#if defined(__AVX512F__)
    case 8: f(std::integral_constant<int, 8>()); break;
    case 7: f(std::integral_constant<int, 7>()); break;
    case 6: f(std::integral_constant<int, 6>()); break;
    case 5: f(std::integral_constant<int, 5>()); break;
#endif
    case 4: f(std::integral_constant<int, 4>()); break;
    case 3: f(std::integral_constant<int, 3>()); break;
    case 2: f(std::integral_constant<int, 2>()); break;
    default: f(std::integral_constant<int, 1>());
  }
}

// The G query rows of one (sequence, kv head) over slots [s0, s1), in tiles
// of kRows rows. GQA: keys [D, S] transposed, values [S, E]; MLA (qb set):
// latents a [S, A] as keys and values, rotary keys b [S, R]. `bf16_form`:
// GQA's `Bf16Form`, or MLA's `LatentForm`.
template <typename T>
void attend_range(const float* q, const float* qb, const T* k,
                  const float* k_scale, const T* v, const float* v_scale,
                  const bool* mask, int64_t G, int64_t D, int64_t R,
                  int64_t E, int64_t S, int64_t s0, int64_t s1, float scale,
                  int64_t bf16_form, Partial& out) {
  out.m.assign(G, -std::numeric_limits<float>::infinity());
  out.l.assign(G, 0.0f);
  out.acc.assign(G * E, 0.0f);
  std::vector<float> qs(G * D), qbs(qb != nullptr ? G * R : 0);
  for (int64_t i = 0; i < G * D; ++i) qs[i] = q[i] * scale;
  for (size_t i = 0; i < qbs.size(); ++i) qbs[i] = qb[i] * scale;
  // Over int8 codes the scaled query is rounded (`RoundedRows`): GQA's
  // rows against the quad tiles, MLA's latent and rotary parts apart.
  // (int4 pairs, uint8, take the int8 query: `block_logits_codes`.)
  constexpr bool codes =
      std::is_same_v<T, int8_t> || std::is_same_v<T, uint8_t>;
  const RoundedRows ra = codes ? RoundedRows(qs.data(), G, D) : RoundedRows();
  const RoundedRows rb =
      codes && qb != nullptr ? RoundedRows(qbs.data(), G, R) : RoundedRows();
  // GQA's quads as 32-bit words (one broadcast operand of vpdpbusd each).
  std::vector<int32_t> qw(codes && qb == nullptr ? G * D / 4 : 0);
  std::memcpy(qw.data(), ra.codes.data(), qw.size() * sizeof(int32_t));
  // bfloat16 keys (GQA's pair tiles): the scaled query rounded to bfloat16.
  const bool pairs = std::is_same_v<T, uint16_t> && qb == nullptr;
  const PairRows rp = pairs ? PairRows(qs.data(), G, D) : PairRows();
#if KVJAX_AMX
  // MLA's latents on AMX tiles (`form`: a `LatentForm` for MLA): each
  // query tile's words built once for the range.
  constexpr bool amx_typed =
      std::is_same_v<T, uint16_t> || std::is_same_v<T, int8_t>;
  const bool amx = qb != nullptr && amx_latents<T>(bf16_form, D, R);
  std::vector<AmxTile<T>> amx_tiles;
  if constexpr (amx_typed) {
    for (int64_t g0 = 0; amx && g0 < G; g0 += kRows) {
      const int64_t gn = std::min<int64_t>(kRows, G - g0);
      AmxTile<T> t;
      if constexpr (std::is_same_v<T, int8_t>) {
        t.qa = query_words(ra.codes.data() + g0 * D, gn, D);
        t.qb = query_words(rb.codes.data() + g0 * R, gn, R);
        t.sa = ra.scale.data() + g0;
        t.sb = rb.scale.data() + g0;
      } else {
        t.qa = query_words(qs.data() + g0 * D, gn, D);
        t.qb = query_words(qbs.data() + g0 * R, gn, R);
      }
      t.pad.resize(16 * (D + R));
      amx_tiles.push_back(std::move(t));
    }
  }
#endif
  // Blocks outside, query tiles inside: a block's keys and values come
  // from memory once and stay in cache for the other tiles of its rows
  // (MQA's and MLA's G = 8 rows are two tiles).
  for (int64_t b0 = s0; b0 < s1; b0 += kBlock) {
    const int64_t b1 = std::min(s1, b0 + kBlock);
    for (int64_t g0 = 0; g0 < G; g0 += kRows) {
      float* m = out.m.data() + g0;
      float* l = out.l.data() + g0;
      float* acc = out.acc.data() + g0 * E;
      by_rows(std::min<int64_t>(kRows, G - g0), [&](auto gn) {
        constexpr int GN = decltype(gn)::value;
        if constexpr (std::is_same_v<T, uint8_t>) {  // no int4 latents
          const QuadQuery tile{qw.data() + g0 * D / 4,
                               ra.fcodes.data() + g0 * D,
                               ra.scale.data() + g0, ra.offset.data() + g0};
          gqa_tile<GN, T>(nullptr, tile, nullptr, nullptr, k, k_scale, v,
                          v_scale, mask, D, E, S, b0, b1, m, l, acc, false);
        } else if (qb != nullptr) {
#if KVJAX_AMX
          if constexpr (amx_typed) {
            if (amx) {
              latent_tile_amx<GN, T>(amx_tiles[g0 / kRows], k, v, k_scale,
                                     v_scale, mask, D, R, b0, b1, m, l, acc);
              return;
            }
          }
#endif
          const LatentQuery lq =
              codes ? LatentQuery{ra.codes.data() + g0 * D,
                                  rb.codes.data() + g0 * R,
                                  ra.fcodes.data() + g0 * D,
                                  rb.fcodes.data() + g0 * R,
                                  ra.scale.data() + g0, rb.scale.data() + g0,
                                  ra.offset.data() + g0,
                                  rb.offset.data() + g0}
                    : LatentQuery{};
          latent_tile<GN, T>(qs.data() + g0 * D, qbs.data() + g0 * R, lq, k,
                             v, k_scale, v_scale, mask, D, R, b0, b1, m, l,
                             acc);
        } else {
          const QuadQuery tile =
              codes ? QuadQuery{qw.data() + g0 * D / 4,
                                ra.fcodes.data() + g0 * D,
                                ra.scale.data() + g0, ra.offset.data() + g0}
                    : QuadQuery{};
          gqa_tile<GN, T>(qs.data() + g0 * D, tile,
                          pairs ? rp.words.data() + g0 * D / 2 : nullptr,
                          pairs ? rp.floats.data() + g0 * D : nullptr, k,
                          k_scale, v, v_scale, mask, D, E, S, b0, b1, m, l,
                          acc, pairs && use_dot_products(bf16_form, GN));
        }
      });
    }
  }
}

// Runs task(t) for t in [0, tasks) on the caller and XLA's intra-op thread
// pool. The caller takes tasks too and returns once all have finished; a
// pool thread that starts late finds none left and touches only the shared
// counters (owned jointly), never the caller's buffers.
template <typename F>
void parallel_for(ffi::ThreadPool& pool, int64_t tasks, const F& task) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto state = std::make_shared<State>();
  auto work = [state, tasks, &task]() {
    for (int64_t t; (t = state->next.fetch_add(1)) < tasks;) {
      task(t);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers =
      std::min<int64_t>(tasks, std::max<int64_t>(1, pool.num_threads())) - 1;
  // Each copy of `work` holds the counters; `task` runs only while tasks
  // remain, and so before the caller returns.
  for (int64_t i = 0; i < helpers; ++i) {
    auto copy = work;
    pool.Schedule(std::move(copy));
  }
  work();
  while (state->done.load(std::memory_order_acquire) < tasks)
    std::this_thread::yield();
}

// Every (sequence, kv head) pair: GQA (qb null: keys [B, K, S/16, D, 16],
// values [B, K, S, E]) or MLA (K = 1: latents k [B, S, D] as keys and values, E =
// D, rotary keys v [B, S, R] for the rotary queries qb [B, G, R]).
// `stride`: slots between one pair's values (and scales) and the next's
// (0: S), where the arrays hold more slots than the S attended (a stacked
// cache read in place: MLA's latents, the GQA family's values); `k_stride`
// the keys' (0: `stride`; the GQA family's per-layer key tiles: S).
template <typename T>
void attend_all(ffi::ThreadPool& pool, const float* q, const float* qb,
                const T* k, const float* k_scale, const T* v,
                const float* v_scale, const bool* mask, float* out, int64_t B,
                int64_t K, int64_t G, int64_t D, int64_t R, int64_t E,
                int64_t S, float scale, int64_t bf16_form = kBf16Auto,
                int64_t stride = 0, int64_t k_stride = 0) {
  if (stride == 0) stride = S;
  if (k_stride == 0) k_stride = stride;
  // Chunks split the slots when there are fewer (sequence, head) pairs than
  // twice the threads, so that batch 1 uses every core.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t pairs = B * K;
  int64_t chunks = std::max<int64_t>(1, (2 * threads + pairs - 1) / pairs);
  chunks = std::min<int64_t>(chunks, std::max<int64_t>(1, S / (4 * kBlock)));
  // A multiple of 16 slots: GQA keys come in tiles of 16.
  const int64_t chunk = (S + 16 * chunks - 1) / (16 * chunks) * 16;
  // Elements of T per code: int4 pairs (uint8) hold two.
  constexpr int64_t per = std::is_same_v<T, uint8_t> ? 2 : 1;
  const int64_t v_pair = stride * (qb != nullptr ? R : E) / per;
  std::vector<Partial> parts(pairs * chunks);
  parallel_for(pool, pairs * chunks, [&](int64_t t) {
    const int64_t p = t / chunks, c = t % chunks;
    const int64_t s0 = std::min(S, c * chunk), s1 = std::min(S, s0 + chunk);
    attend_range<T>(q + p * G * D, qb != nullptr ? qb + p * G * R : nullptr,
                    k + p * D * k_stride / per,
                    k_scale != nullptr ? k_scale + p * stride : nullptr,
                    v + p * v_pair,
                    v_scale != nullptr ? v_scale + p * stride : nullptr,
                    mask + (p / K) * S, G, D, R, E, S, s0, s1, scale,
                    bf16_form, parts[t]);
  });
  for (int64_t p = 0; p < pairs; ++p) {
    for (int64_t g = 0; g < G; ++g) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < chunks; ++c)
        m = std::max(m, parts[p * chunks + c].m[g]);
      float l = 0.0f;
      float* o = out + (p * G + g) * E;
      std::fill(o, o + E, 0.0f);
      for (int64_t c = 0; c < chunks; ++c) {
        const Partial& part = parts[p * chunks + c];
        if (part.l[g] == 0.0f) continue;  // an empty chunk
        const float w = std::exp(part.m[g] - m);
        l += w * part.l[g];
        for (int64_t e = 0; e < E; ++e) o[e] += w * part.acc[g * E + e];
      }
      const float inv = 1.0f / l;
      for (int64_t e = 0; e < E; ++e) o[e] *= inv;
    }
  }
}

// Values (and scales) `stride` slots apart per (sequence, head), keys in
// per-layer tiles of S slots; `at`: the values' layer's first element.
template <typename T>
ffi::Error run(ffi::ThreadPool& pool, const float* q, const void* k,
               const float* ks, const void* v, const float* vs,
               const bool* mask, float* out, int64_t B, int64_t K, int64_t G,
               int64_t D, int64_t E, int64_t S, float scale,
               int64_t bf16_form, int64_t stride, int64_t at) {
  attend_all<T>(pool, q, nullptr, static_cast<const T*>(k), ks,
                static_cast<const T*>(v) + at, vs, mask, out, B, K, G, D, 0,
                E, S, scale, bf16_form, stride, S);
  return ffi::Error::Success();
}

}  // namespace

// Values v [B, K, S, E] (scales [B, K, S]) per layer, or a stacked cache's
// [L, B, K, S', E] (scales [L, B, K, S']) read in place, layer `layer`'s
// first S slots (S the keys'); keys always per layer, in tiles.
static ffi::Error DecodeAttentionImpl(
    ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
    ffi::Buffer<ffi::F32> k_scale, ffi::AnyBuffer v,
    ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::PRED> mask,
    ffi::ResultBuffer<ffi::F32> out, float scale, int64_t bf16_products,
    int64_t layer) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd_all = v.dimensions();
  if (bf16_products < kBf16Auto || bf16_products > kBf16Fma)
    return ffi::Error::InvalidArgument("bf16_products: 0, 1 or 2");
  if (qd.size() != 4 || (vd_all.size() != 4 && vd_all.size() != 5))
    return ffi::Error::InvalidArgument(
        "q must be rank 4, v rank 4 (or 5, stacked)");
  const int64_t L = vd_all.size() == 5 ? vd_all[0] : 1;
  const auto vd = vd_all.last(4);  // [B, K, S', E]
  if (layer < 0 || layer >= L)
    return ffi::Error::InvalidArgument("layer: one of the values' L");
  if (kd.size() != 5 || kd[4] != kLanes)
    return ffi::Error::InvalidArgument("k must be [B, K, S/16, D, 16]");
  // int4 pairs (u8) hold two codes a byte: keys [B, K, S/16, D/2, 16],
  // values [B, K, S, E/2].
  const bool nibbles = k.element_type() == ffi::U8;
  const int64_t per = nibbles ? 2 : 1;
  const int64_t B = qd[0], K = qd[1], G = qd[2], D = qd[3];
  const int64_t S = kd[2] * kLanes, E = vd[3] * per;
  if (kd[0] != B || kd[1] != K || kd[3] * per != D)
    return ffi::Error::InvalidArgument(
        nibbles ? "int4 k must be [B, K, S/16, D/2, 16]"
                : "k must be [B, K, S/16, D, 16]");
  if (k.element_type() == ffi::S8 && D % 4 != 0)
    return ffi::Error::InvalidArgument("int8 keys: D must be a multiple of 4");
  if (nibbles && D % 8 != 0)
    return ffi::Error::InvalidArgument("int4 keys: D must be a multiple of 8");
  if (k.element_type() == ffi::U16 && D % 2 != 0)
    return ffi::Error::InvalidArgument("bfloat16 keys: D must be even");
  const int64_t cap = vd[2];  // the values' slots per (sequence, head)
  if (vd[0] != B || vd[1] != K || (vd_all.size() == 4 ? cap != S : cap < S))
    return ffi::Error::InvalidArgument(
        nibbles ? "int4 v must be [(L,) B, K, S, E/2]"
                : "v must be [(L,) B, K, S, E] (stacked: S' >= S slots)");
  if (k.element_type() != v.element_type())
    return ffi::Error::InvalidArgument("k and v must share a dtype");
  const bool codes = k.element_type() == ffi::S8 || nibbles;
  const bool scales = k_scale.element_count() > 0;
  if (codes != scales || (v_scale.element_count() > 0) != scales)
    return ffi::Error::InvalidArgument("scales go with int8 / int4 codes only");
  if (scales && (k_scale.element_count() != L * B * K * cap ||
                 v_scale.element_count() != L * B * K * cap))
    return ffi::Error::InvalidArgument("scales must be the values' [(L,) B, "
                                       "K, S']");
  if (mask.element_count() != B * S)
    return ffi::Error::InvalidArgument("mask must be [B, S]");
  const int64_t at = layer * B * K * cap;  // the layer's first slot
  const int64_t at_v = at * (E / per);     // its first value element
  const float* ks = scales ? k_scale.typed_data() + at : nullptr;
  const float* vs = scales ? v_scale.typed_data() + at : nullptr;
  const float* qp = q.typed_data();
  const bool* mp = mask.typed_data();
  float* op = out->typed_data();
  switch (k.element_type()) {
    case ffi::F32:
      return run<float>(pool, qp, k.untyped_data(), ks, v.untyped_data(), vs,
                        mp, op, B, K, G, D, E, S, scale, bf16_products, cap, at_v);
    case ffi::U16:  // bfloat16 bits (kvjax.quant stores bfloat16 so)
      return run<uint16_t>(pool, qp, k.untyped_data(), ks, v.untyped_data(),
                           vs, mp, op, B, K, G, D, E, S, scale, bf16_products, cap, at_v);
    case ffi::S8:
      return run<int8_t>(pool, qp, k.untyped_data(), ks, v.untyped_data(), vs,
                         mp, op, B, K, G, D, E, S, scale, bf16_products, cap, at_v);
    case ffi::U8:  // int4 pairs (kvjax.quant.INT4_PAIRS)
      return run<uint8_t>(pool, qp, k.untyped_data(), ks, v.untyped_data(),
                          vs, mp, op, B, K, G, D, E, S, scale, bf16_products, cap, at_v);
    default:
      return ffi::Error::InvalidArgument(
          "k: f32, u16 (bfloat16 bits), s8 or u8 (int4 pairs)");
  }
}

// MLA's absorbed decode attention over one layer's latents:
//   q_lat  f32 [B, N, C]   absorbed queries     q_rope f32 [B, N, R]
//   c      T   [B, S', C]  latents (keys and values; T f32, bf16 bits or
//                          s8 codes), or the stacked [L, B, S', C]
//   c_scale f32 [B, S']    per-token latent scales (s8; else [0]), or
//                          [L, B, S']
//   r      T   [B, S', R]  rotary keys, or [L, B, S', R]
//   r_scale f32 [B, S']    per-token rotary-key scales (s8; else [0]), or
//                          [L, B, S']
//   mask   pred [B, S]     the attended slots [0, S), S <= S'
//   out    f32 [B, N, C]   the latent output (before W_UV)
// logits = scale · (q_lat · c + q_rope · r) with codes times their scales:
// `mla.absorbed_decode` of the dequantized cache. attrs: scale (f32),
// latent_products (`LatentForm`: 0 auto, 1 AMX tiles, 2 vector), layer
// (which of the stacked arrays' L layers; 0 for per-layer arrays). The
// stacked form reads a stacked cache in place: no per-layer copy of it.
static ffi::Error LatentAttentionImpl(
    ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q_lat,
    ffi::Buffer<ffi::F32> q_rope, ffi::AnyBuffer c,
    ffi::Buffer<ffi::F32> c_scale, ffi::AnyBuffer r,
    ffi::Buffer<ffi::F32> r_scale, ffi::Buffer<ffi::PRED> mask,
    ffi::ResultBuffer<ffi::F32> out, float scale, int64_t latent_products,
    int64_t layer) {
  const auto qd = q_lat.dimensions(), rd = q_rope.dimensions();
  if (latent_products < kLatentAuto || latent_products > kLatentVector)
    return ffi::Error::InvalidArgument("latent_products: 0, 1 or 2");
  const auto cd = c.dimensions(), kd = r.dimensions(), md = mask.dimensions();
  const size_t rank = cd.size();
  if (qd.size() != 3 || rd.size() != 3 || (rank != 3 && rank != 4) ||
      kd.size() != rank || md.size() != 2)
    return ffi::Error::InvalidArgument(
        "latent operands: queries rank 3, latents rank 3 (or 4, stacked), "
        "mask rank 2");
  const int64_t L = rank == 4 ? cd[0] : 1;
  const int64_t B = qd[0], N = qd[1], C = qd[2], R = rd[2];
  const int64_t cap = cd[rank - 2], S = md[1];
  if (rd[0] != B || rd[1] != N || cd[rank - 3] != B || cd[rank - 1] != C ||
      kd[rank - 3] != B || kd[rank - 2] != cap || kd[rank - 1] != R ||
      (rank == 4 && kd[0] != L))
    return ffi::Error::InvalidArgument(
        "want q_lat [B, N, C], q_rope [B, N, R], c [(L,) B, S', C], "
        "r [(L,) B, S', R]");
  if (layer < 0 || layer >= L)
    return ffi::Error::InvalidArgument("layer: one of the latents' L");
  if (c.element_type() != r.element_type())
    return ffi::Error::InvalidArgument("c and r must share a dtype");
  if (md[0] != B || S > cap)
    return ffi::Error::InvalidArgument("mask must be [B, S], S <= S'");
  const bool codes = c.element_type() == ffi::S8;
  const bool scales = c_scale.element_count() > 0;
  if (codes != scales || (r_scale.element_count() > 0) != scales)
    return ffi::Error::InvalidArgument("scales go with int8 codes only");
  if (scales && (c_scale.element_count() != L * B * cap ||
                 r_scale.element_count() != L * B * cap))
    return ffi::Error::InvalidArgument("scales must be [(L,) B, S']");
  const int64_t at = layer * B * cap;  // the layer's first slot
  const float* cs = scales ? c_scale.typed_data() + at : nullptr;
  const float* rs = scales ? r_scale.typed_data() + at : nullptr;
  auto go = [&](auto tag) {
    using T = decltype(tag);
    if (latent_products == kLatentAmx && !amx_latents<T>(kLatentAmx, C, R))
      return ffi::Error::InvalidArgument(
          "latent_products=amx: no AMX tiles here, or latents that do not "
          "fit them (bfloat16 / int8, C·bytes a multiple of 64, R·bytes of "
          "whole words up to 64)");
    attend_all<T>(pool, q_lat.typed_data(), q_rope.typed_data(),
                  static_cast<const T*>(c.untyped_data()) + at * C, cs,
                  static_cast<const T*>(r.untyped_data()) + at * R, rs,
                  mask.typed_data(), out->typed_data(), B, 1, N, C, R, C, S,
                  scale, latent_products, cap);
    return ffi::Error::Success();
  };
  switch (c.element_type()) {
    case ffi::F32:
      return go(float());
    case ffi::U16:  // bfloat16 bits
      return go(uint16_t());
    case ffi::S8:
      return go(int8_t());
    default:
      return ffi::Error::InvalidArgument(
          "latents: f32, u16 (bf16 bits) or s8");
  }
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxLatentAttention, LatentAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q_lat
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q_rope
                                  .Arg<ffi::AnyBuffer>()          // c
                                  .Arg<ffi::Buffer<ffi::F32>>()   // c_scale
                                  .Arg<ffi::AnyBuffer>()          // r
                                  .Arg<ffi::Buffer<ffi::F32>>()   // r_scale
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // mask
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("latent_products")
                                  .Attr<int64_t>("layer"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxDecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q
                                  .Arg<ffi::AnyBuffer>()          // k
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k_scale
                                  .Arg<ffi::AnyBuffer>()          // v
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v_scale
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // mask
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("bf16_products")
                                  .Attr<int64_t>("layer"));

// Whether the bfloat16 products of tiles of `kMeasuredFromRows` or more
// query rows run as vdpbf16ps where the caller leaves the form to the
// kernel (`bf16_products` 0): 1 if so, 0 if they run as float32
// multiply-adds (measured once per process; always 0 in a build without
// AVX-512 BF16). Tiles of fewer rows take vdpbf16ps wherever it exists.
extern "C" int KvjaxBf16DotProducts() {
  return use_dot_products(kBf16Auto, kMeasuredFromRows);
}

// What that choice measured: seconds per register of 16 products as
// vdpbf16ps (out[0]) and as float32 multiply-adds (out[1]); zeros in a
// build without AVX-512 BF16.
extern "C" void KvjaxBf16ProductTimes(double* out) {
#if defined(__AVX512BF16__)
  const ProductTimes& t = product_times();
  out[0] = t.dot;
  out[1] = t.fma;
#else
  out[0] = out[1] = 0.0;
#endif
}

// Whether MLA's bfloat16 and int8 latents of fitting shapes run on AMX
// tiles under 'auto' (`LatentForm`): 1 where the build has AMX and the OS
// grants its tile state to this process.
extern "C" int KvjaxLatentAmx() { return amx_usable(); }
