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
//   q       f32   [B, K, G, D]      queries, grouped by the kv head serving them
//   k       T     [B, K, D, S]      keys transposed (T: f32, bf16 bits as u16, s8)
//   k_scale f32   [B, K, S]         per-token key scales (s8; else [0])
//   v       T     [B, K, S, E]      float values; s8 values transposed [B, K, E, S]
//   v_scale f32   [B, K, S]         per-token value scales (s8; else [0])
//   mask    pred  [B, S]            True where a slot may be attended
//   out     f32   [B, K, G, E]
// attrs: scale (softmax scale, f32).
//
// Semantics are those of `attention.decode_softmax_values`: logits = scale
// * q.k (times the key scale), masked slots set to the lowest float before
// the softmax, so a fully masked row averages its values (finite, never
// NaN).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"


namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 128;  // slots per block: logits [G, 128] in L1

inline float load(float x) { return x; }
inline float load(uint16_t bits) {  // bfloat16 bits -> float32
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline float load(int8_t code) { return static_cast<float>(code); }

// exp(x) for x <= 0 in a form the compiler vectorizes (std::exp is a scalar
// call, and a decode step takes G exponentials per cached slot): 2^n · p(r)
// with n = round(x / ln 2), r = x - n ln 2 in two parts (Cody-Waite), p a
// degree-6 polynomial; relative error below 2e-7 (tests compare it with
// XLA's softmax). Below -87 (an underflowing or masked logit) it is 0.
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

// Online-softmax partial result of one (sequence, kv head, slot range).
struct Partial {
  std::vector<float> m, l, acc;  // [G], [G], [G, E]
};

// Eight float32 lanes (one AVX register; GCC / Clang vector extensions, so
// the kernel also builds where AVX is absent). Accumulators are named
// vectors, not arrays, so that they stay in registers.
typedef float f8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef int8_t i8x8 __attribute__((vector_size(8)));
typedef uint8_t u8x8 __attribute__((vector_size(8)));

inline f8 load8(const float* p) {
  f8 r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}
inline f8 load8(const uint16_t* p) {  // bfloat16 bits: the high half of a float
  u16x8 u;
  std::memcpy(&u, p, sizeof(u));
  const u32x8 w = __builtin_convertvector(u, u32x8) << 16;
  f8 r;
  std::memcpy(&r, &w, sizeof(r));
  return r;
}
inline f8 load8(const int8_t* p) {
#ifdef __AVX2__
  // GCC 12 scalarises a direct int8 -> float vector conversion.
  const __m256 r = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  f8 out;
  std::memcpy(&out, &r, sizeof(out));
  return out;
#else
  i8x8 c;
  std::memcpy(&c, p, sizeof(c));
  return __builtin_convertvector(__builtin_convertvector(c, i32x8), f8);
#endif
}
inline void store8(float* p, f8 x) { std::memcpy(p, &x, sizeof(x)); }

constexpr int64_t kLanes = 16;  // slots (or value channels) per register tile

// Logits of GN query rows against one block of n slots: lg[g][j] = q_g . k_j.
// The GN × 16 partial sums stay in registers while the loop walks the D key
// rows, so each key is loaded once for all rows.
template <int GN, typename KT>
inline void block_logits(const float* __restrict__ qs, int64_t D,
                         const KT* __restrict__ k, int64_t S, int64_t b0,
                         int64_t n, float* __restrict__ lg) {
  int64_t j0 = 0;
  for (; j0 + kLanes <= n; j0 += kLanes) {
    f8 a0[GN], a1[GN];
    for (int g = 0; g < GN; ++g) a0[g] = a1[g] = f8{};
    const KT* kr = k + b0 + j0;
    for (int64_t d = 0; d < D; ++d, kr += S) {
      const f8 k0 = load8(kr), k1 = load8(kr + 8);
      for (int g = 0; g < GN; ++g) {
        const float qd = qs[g * D + d];
        a0[g] += qd * k0;
        a1[g] += qd * k1;
      }
    }
    for (int g = 0; g < GN; ++g) {
      store8(lg + g * kBlock + j0, a0[g]);
      store8(lg + g * kBlock + j0 + 8, a1[g]);
    }
  }
  for (; j0 < n; ++j0) {  // tail of a block whose length is not a multiple
    for (int g = 0; g < GN; ++g) {
      float a = 0.0f;
      for (int64_t d = 0; d < D; ++d)
        a += qs[g * D + d] * load(k[d * S + b0 + j0]);
      lg[g * kBlock + j0] = a;
    }
  }
}

// acc[g][e] += sum_j p[g][j] · v[j][e] over float values [S, E].
template <int GN, typename VT>
inline void block_values(const float* __restrict__ p,
                         const VT* __restrict__ v, int64_t E, int64_t b0,
                         int64_t n, float* __restrict__ acc) {
  int64_t e0 = 0;
  for (; e0 + kLanes <= E; e0 += kLanes) {
    f8 a0[GN], a1[GN];
    for (int g = 0; g < GN; ++g) {
      a0[g] = load8(acc + g * E + e0);
      a1[g] = load8(acc + g * E + e0 + 8);
    }
    const VT* vr = v + b0 * E + e0;
    for (int64_t j = 0; j < n; ++j, vr += E) {
      const f8 v0 = load8(vr), v1 = load8(vr + 8);
      for (int g = 0; g < GN; ++g) {
        const float pj = p[g * kBlock + j];
        a0[g] += pj * v0;
        a1[g] += pj * v1;
      }
    }
    for (int g = 0; g < GN; ++g) {
      store8(acc + g * E + e0, a0[g]);
      store8(acc + g * E + e0 + 8, a1[g]);
    }
  }
  for (; e0 < E; ++e0)  // channels past the last multiple of 16
    for (int g = 0; g < GN; ++g)
      for (int64_t j = 0; j < n; ++j)
        acc[g * E + e0] += p[g * kBlock + j] * load(v[(b0 + j) * E + e0]);
}

// acc[g][e] += sum_j p[g][j] · v[e][j] over values stored transposed [E, S]
// (int8 codes; p already carries each token's value scale).
template <int GN, typename VT>
inline void block_values_t(const float* __restrict__ p,
                           const VT* __restrict__ v, int64_t E, int64_t S,
                           int64_t b0, int64_t n, float* __restrict__ acc) {
  for (int64_t e = 0; e < E; ++e) {
    const VT* vr = v + e * S + b0;
    f8 a0[GN], a1[GN];
    for (int g = 0; g < GN; ++g) a0[g] = a1[g] = f8{};
    int64_t j0 = 0;
    for (; j0 + kLanes <= n; j0 += kLanes) {
      const f8 v0 = load8(vr + j0), v1 = load8(vr + j0 + 8);
      for (int g = 0; g < GN; ++g) {
        a0[g] += load8(p + g * kBlock + j0) * v0;
        a1[g] += load8(p + g * kBlock + j0 + 8) * v1;
      }
    }
    for (int g = 0; g < GN; ++g) {
      const f8 t = a0[g] + a1[g];
      float s = ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
      for (int64_t j = j0; j < n; ++j) s += p[g * kBlock + j] * load(vr[j]);
      acc[g * E + e] += s;
    }
  }
}

// One tile of GN query rows over slots [s0, s1): the online softmax.
template <int GN, typename KT, typename VT, bool kVTransposed>
void attend_tile(const float* __restrict__ qs, const KT* __restrict__ k, const float* __restrict__ k_scale,
                 const VT* __restrict__ v, const float* __restrict__ v_scale, const bool* __restrict__ mask,
                 int64_t D, int64_t E, int64_t S, int64_t s0, int64_t s1,
                 float* __restrict__ m, float* l, float* acc) {
  constexpr float kLowest = std::numeric_limits<float>::lowest();
  alignas(64) float lg[GN * kBlock];
  for (int64_t b0 = s0; b0 < s1; b0 += kBlock) {
    const int64_t n = std::min(kBlock, s1 - b0);
    block_logits<GN, KT>(qs, D, k, S, b0, n, lg);
    for (int g = 0; g < GN; ++g) {
      float* row = lg + g * kBlock;
      if (k_scale != nullptr) {
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) row[j] *= k_scale[b0 + j];
      }
      const uint8_t* mk = reinterpret_cast<const uint8_t*>(mask + b0);
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) row[j] = mk[j] ? row[j] : kLowest;
      float bm = kLowest;
#pragma omp simd reduction(max : bm)
      for (int64_t j = 0; j < n; ++j) bm = std::max(bm, row[j]);
      const float m_new = std::max(m[g], bm);
      const float corr = std::exp(m[g] - m_new);
      if (corr != 1.0f) {
        l[g] *= corr;
        for (int64_t e = 0; e < E; ++e) acc[g * E + e] *= corr;
      }
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < n; ++j) {
        row[j] = exp_nonpositive(row[j] - m_new);
        sum += row[j];
      }
      l[g] += sum;
      m[g] = m_new;
      if (v_scale != nullptr) {
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) row[j] *= v_scale[b0 + j];
      }
    }
    if constexpr (kVTransposed) {
      block_values_t<GN, VT>(lg, v, E, S, b0, n, acc);
    } else {
      block_values<GN, VT>(lg, v, E, b0, n, acc);
    }
  }
}

// Online-softmax state of every query row of one (sequence, kv head) over
// slots [s0, s1), in query tiles of at most 4 rows.
template <typename KT, typename VT, bool kVTransposed>
void attend_range(const float* q, const KT* k, const float* k_scale,
                  const VT* v, const float* v_scale, const bool* mask,
                  int64_t G, int64_t D, int64_t E, int64_t S, int64_t s0,
                  int64_t s1, float scale, Partial& out) {
  out.m.assign(G, -std::numeric_limits<float>::infinity());
  out.l.assign(G, 0.0f);
  out.acc.assign(G * E, 0.0f);
  std::vector<float> qs(G * D);
  for (int64_t i = 0; i < G * D; ++i) qs[i] = q[i] * scale;
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    float* m = out.m.data() + g0;
    float* l = out.l.data() + g0;
    float* acc = out.acc.data() + g0 * E;
    const float* qg = qs.data() + g0 * D;
    switch (std::min<int64_t>(4, G - g0)) {
      case 4:
        attend_tile<4, KT, VT, kVTransposed>(qg, k, k_scale, v, v_scale, mask,
                                             D, E, S, s0, s1, m, l, acc);
        break;
      case 3:
        attend_tile<3, KT, VT, kVTransposed>(qg, k, k_scale, v, v_scale, mask,
                                             D, E, S, s0, s1, m, l, acc);
        break;
      case 2:
        attend_tile<2, KT, VT, kVTransposed>(qg, k, k_scale, v, v_scale, mask,
                                             D, E, S, s0, s1, m, l, acc);
        break;
      default:
        attend_tile<1, KT, VT, kVTransposed>(qg, k, k_scale, v, v_scale, mask,
                                             D, E, S, s0, s1, m, l, acc);
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

template <typename KT, typename VT, bool kVTransposed>
void attend_all(ffi::ThreadPool& pool, const float* q, const KT* k,
                const float* k_scale, const VT* v, const float* v_scale,
                const bool* mask, float* out, int64_t B, int64_t K, int64_t G,
                int64_t D, int64_t E, int64_t S, float scale) {
  // Tasks: (sequence, kv head, slot chunk). Chunks split the slots when
  // there are fewer (sequence, head) pairs than twice the threads, so that
  // batch 1 uses every core; partials are combined afterwards.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t pairs = B * K;
  int64_t chunks = std::max<int64_t>(1, (2 * threads + pairs - 1) / pairs);
  chunks = std::min<int64_t>(chunks, std::max<int64_t>(1, S / (4 * kBlock)));
  const int64_t chunk = (S + chunks - 1) / chunks;
  std::vector<Partial> parts(pairs * chunks);
  parallel_for(pool, pairs * chunks, [&](int64_t t) {
    const int64_t p = t / chunks, c = t % chunks;
    const int64_t b = p / K;
    const int64_t s0 = std::min(S, c * chunk), s1 = std::min(S, s0 + chunk);
    attend_range<KT, VT, kVTransposed>(
        q + p * G * D, k + p * D * S,
        k_scale != nullptr ? k_scale + p * S : nullptr,
        v + p * S * E, v_scale != nullptr ? v_scale + p * S : nullptr,
        mask + b * S, G, D, E, S, s0, s1, scale, parts[t]);
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

}  // namespace

static ffi::Error DecodeAttentionImpl(
    ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::Buffer<ffi::F32> k_scale,
    ffi::AnyBuffer v, ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::PRED> mask,
    ffi::ResultBuffer<ffi::F32> out, float scale) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4)
    return ffi::Error::InvalidArgument("q, k, v must be rank 4");
  const int64_t B = qd[0], K = qd[1], G = qd[2], D = qd[3], S = kd[3];
  if (kd[0] != B || kd[1] != K || kd[2] != D)
    return ffi::Error::InvalidArgument("k must be [B, K, D, S]");
  const bool quantized = k.element_type() == ffi::S8;
  const bool has_scale = k_scale.element_count() > 0;
  if (quantized != has_scale || (v_scale.element_count() > 0) != has_scale)
    return ffi::Error::InvalidArgument("scales go with int8 codes only");
  if (has_scale && (k_scale.element_count() != B * K * S ||
                    v_scale.element_count() != B * K * S))
    return ffi::Error::InvalidArgument("scales must be [B, K, S]");
  if (mask.element_count() != B * S)
    return ffi::Error::InvalidArgument("mask must be [B, S]");
  const bool* m = mask.typed_data();
  float* o = out->typed_data();
  const float* ks = has_scale ? k_scale.typed_data() : nullptr;
  const float* vs = has_scale ? v_scale.typed_data() : nullptr;
  if (k.element_type() != v.element_type())
    return ffi::Error::InvalidArgument("k and v must share a dtype");
  switch (k.element_type()) {
    case ffi::F32: {
      const int64_t E = vd[3];
      if (vd[0] != B || vd[1] != K || vd[2] != S)
        return ffi::Error::InvalidArgument("float v must be [B, K, S, E]");
      attend_all<float, float, false>(
          pool, q.typed_data(), reinterpret_cast<const float*>(k.untyped_data()),
          nullptr, reinterpret_cast<const float*>(v.untyped_data()), nullptr,
          m, o, B, K, G, D, E, S, scale);
      return ffi::Error::Success();
    }
    case ffi::U16: {  // bfloat16 bits (kvjax.quant stores bfloat16 so)
      const int64_t E = vd[3];
      if (vd[0] != B || vd[1] != K || vd[2] != S)
        return ffi::Error::InvalidArgument("bf16 v must be [B, K, S, E]");
      attend_all<uint16_t, uint16_t, false>(
          pool, q.typed_data(), reinterpret_cast<const uint16_t*>(k.untyped_data()),
          nullptr, reinterpret_cast<const uint16_t*>(v.untyped_data()),
          nullptr, m, o, B, K, G, D, E, S, scale);
      return ffi::Error::Success();
    }
    case ffi::S8: {
      const int64_t E = vd[2];
      if (vd[0] != B || vd[1] != K || vd[3] != S)
        return ffi::Error::InvalidArgument("int8 v must be [B, K, E, S]");
      attend_all<int8_t, int8_t, true>(
          pool, q.typed_data(), reinterpret_cast<const int8_t*>(k.untyped_data()),
          ks, reinterpret_cast<const int8_t*>(v.untyped_data()), vs, m, o, B,
          K, G, D, E, S, scale);
      return ffi::Error::Success();
    }
    default:
      return ffi::Error::InvalidArgument("k: f32, u16 (bfloat16 bits) or s8");
  }
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxDecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()         // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_scale
                                  .Arg<ffi::AnyBuffer>()         // v
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_scale
                                  .Arg<ffi::Buffer<ffi::PRED>>() // mask
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<float>("scale"));
