// Paged decode attention on CPU, reading K/V from the pages in place.
//
// One query token per sequence attends to its whole paged context. Work item: one
// (sequence, KV head) pair; the G query heads that share the KV head are computed
// together, so each K/V row is read once per group, straight from its page (no
// gathered copy of the context, no padding to the longest sequence, no mask).
//
// Per work item, two passes over the context (the classic two-pass softmax):
//   1. logits[g][t] = (q_g * scale * k_factor) . k_t        (K rows decoded on the fly)
//   2. p = exp(logits - max) ; out_g = sum_t p[g][t] v_t / sum_t p[g][t] * v_factor
// A quantized row is decoded into a small fp32 buffer (head_dim values) with lookup
// tables: FP8 E4M3/E5M2 through a 256-entry table, 4-bit codes (fp4_e2m1 / int4, the
// layout of kvpilot/kernels/kv4.py: byte j = code[j] | code[j + D/2] << 4, one E4M3
// group scale per 16 values) through a 16-entry table times the group scale.
//
// Deterministic and batch invariant: a sequence's result depends only on its own
// query and context (fixed summation order, no split over threads inside a sequence).
// Dot products: with AVX2/FMA and head_dim 64 or 128, two 8-lane FMA chains and one
// horizontal sum per (token, query head); elsewhere 16 independent partial sums
// (vectorizable without reassociating). Either way a fixed order per build.
// Source of the design: vLLM's CPU paged attention (csrc/cpu/attention.cpp) and the
// two-pass softmax of FlashDecoding's reduction, simplified to one split per sequence.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/library.h>

#include "cpu_math.h"

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// How the cache stores a value. Must match kvpilot/kernels/cpu_attention.py.
enum Kind : int64_t {
  kFloat32 = 0,
  kBFloat16 = 1,
  kFloat16 = 2,
  kFp8E4M3 = 3,
  kFp8E5M2 = 4,
  kFp4E2M1 = 5,
  kInt4 = 6,
};

struct Tables {
  float e4m3[256];
  float e5m2[256];
  float e2m1[16];
  float int4[16];
};

const Tables& tables() {
  static const Tables t = [] {
    Tables x;
    for (int i = 0; i < 256; ++i) {
      x.e4m3[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
      x.e5m2[i] = static_cast<float>(c10::Float8_e5m2(static_cast<uint8_t>(i), c10::Float8_e5m2::from_bits()));
    }
    const float mags[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
    for (int i = 0; i < 16; ++i) {
      x.e2m1[i] = (i & 8) ? -mags[i & 7] : mags[i & 7];
      x.int4[i] = static_cast<float>(i - 8);
    }
    return x;
  }();
  return t;
}

constexpr int kLanes = 16;

// sum_d a[d] * b[d] with kLanes independent partial sums (a fixed order, so the compiler
// vectorizes it without reassociating). DC > 0: head_dim known at compile time.
template <int DC>
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  const int64_t D = DC ? DC : n;
  float acc[kLanes] = {0.f};
  int64_t d = 0;
  for (; d + kLanes <= D; d += kLanes) {
    for (int i = 0; i < kLanes; ++i) acc[i] += a[d + i] * b[d + i];
  }
  for (int i = 0; d < D; ++d, ++i) acc[i] += a[d] * b[d];
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += acc[i];
  return s;
}

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum256(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}
#endif

// out[g * stride] = q_g . k for the G query heads of a group against one K row. With AVX2
// and a head_dim known at compile time (a multiple of 16): two 8-lane FMA chains and one
// horizontal sum per dot; the portable dot<DC> otherwise (its 16 partial sums cost a
// chain of scalar adds per dot, which dominated a decode step: about 3x slower).
template <int DC>
inline void dots(const float* __restrict q, const float* __restrict k, int64_t G, int64_t D, float* out,
                 int64_t stride) {
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (DC > 0 && DC % 16 == 0) {
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * DC;
      __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(qg), _mm256_loadu_ps(k));
      __m256 a1 = _mm256_mul_ps(_mm256_loadu_ps(qg + 8), _mm256_loadu_ps(k + 8));
      for (int c = 16; c < DC; c += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + c), _mm256_loadu_ps(k + c), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + c + 8), _mm256_loadu_ps(k + c + 8), a1);
      }
      out[g * stride] = hsum256(_mm256_add_ps(a0, a1));
    }
    return;
  }
#endif
  for (int64_t g = 0; g < G; ++g) out[g * stride] = dot<DC>(q + g * D, k, D);
}

// out[d] += p * v[d]
template <int DC>
inline void axpy(float* __restrict out, float p, const float* __restrict v, int64_t n) {
  const int64_t D = DC ? DC : n;
  for (int64_t d = 0; d < D; ++d) out[d] += p * v[d];
}

// exp(x) in place over an array (softmax weights after subtracting the max).
inline void exp_inplace(float* __restrict x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = kvpilot_cpu::exp_poly(x[i]);
}

inline float sum(const float* __restrict x, int64_t n) {
  float acc[kLanes] = {0.f};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += x[i + j];
  for (int j = 0; i < n; ++i, ++j) acc[j] += x[i];
  float s = 0.f;
  for (int j = 0; j < kLanes; ++j) s += acc[j];
  return s;
}

// An FP4 E2M1 code (s.ee.m) as fp32 bits, branch-free: 0, 0.5 (e = 0) or
// (1 + m/2) * 2^(e-1).
inline uint32_t e2m1_bits(uint32_t c) {
  const uint32_t e = (c >> 1) & 3u, m = c & 1u;
  const uint32_t normal = ((126u + e) << 23) | (m << 22);
  const uint32_t sub = m ? (126u << 23) : 0u;
  return (e ? normal : sub) | ((c & 8u) << 28);
}

// One row (head_dim values of one token and KV head) as fp32. `row` indexes rows of the
// cache viewed as [num_blocks * block_size * num_kv_heads, row_bytes]. Returns a pointer
// to the values: into the cache itself for fp32, else into `buf`. FP8 E4M3 rows are
// returned 2^-8 times too small through the half-precision bit trick (the caller folds
// kFp8Factor into the scale), exactly as kvpilot/kernels/fast_dequant.py documents.
template <Kind K, int DC>
inline const float* read_row(const uint8_t* __restrict base, int64_t row, int64_t row_bytes,
                             const uint8_t* __restrict groups, int64_t n, float* __restrict buf) {
  const int64_t D = DC ? DC : n;
  const uint8_t* __restrict p = base + row * row_bytes;
  if constexpr (K == kFloat32) {
    return reinterpret_cast<const float*>(p);
  } else if constexpr (K == kBFloat16) {
    const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
    for (int64_t d = 0; d < D; ++d) buf[d] = std::bit_cast<float>(static_cast<uint32_t>(h[d]) << 16);
    return buf;
  } else if constexpr (K == kFloat16 || K == kFp8E4M3 || K == kFp8E5M2) {
    uint16_t half_bits[256];
    const uint16_t* hb;
    if constexpr (K == kFloat16) {
      hb = reinterpret_cast<const uint16_t*>(p);
    } else {
      for (int64_t d = 0; d < D; ++d) {
        uint16_t h = static_cast<uint16_t>(p[d]);
        if constexpr (K == kFp8E5M2) {
          h = static_cast<uint16_t>(h << 8);
        } else {
          h = static_cast<uint16_t>(h << 7);
          h = static_cast<uint16_t>(h + (h & 0x4000));
        }
        half_bits[d] = h;
      }
      hb = half_bits;
    }
#if defined(__F16C__)
    int64_t d = 0;
    for (; d + 8 <= D; d += 8)
      _mm256_storeu_ps(buf + d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hb + d))));
    for (; d < D; ++d) buf[d] = static_cast<float>(c10::Half(hb[d], c10::Half::from_bits()));
#else
    for (int64_t d = 0; d < D; ++d) buf[d] = static_cast<float>(c10::Half(hb[d], c10::Half::from_bits()));
#endif
    return buf;
  } else {  // 4-bit: byte j = code[j] | code[j + D/2] << 4; E4M3 group scale per 16 values
    const float* e4m3 = tables().e4m3;
    const uint8_t* g = groups + row * (D / 16);
    const int64_t half = D / 2, ng = half / 16;
    for (int64_t grp = 0; grp < ng; ++grp) {
      const float lo_scale = e4m3[g[grp]], hi_scale = e4m3[g[grp + ng]];
#if defined(__AVX2__)
      // 8 bytes at a time: both nibbles widened to int32 lanes; E2M1 magnitudes through
      // an 8-entry in-register table (vpermps) with the sign bit moved into place.
      const __m256 mags = _mm256_setr_ps(0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f);
      for (int64_t i = 0; i < 16; i += 8) {
        const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + grp * 16 + i)));
        const __m256i codes[2] = {_mm256_and_si256(bytes, _mm256_set1_epi32(15)), _mm256_srli_epi32(bytes, 4)};
        const float scales[2] = {lo_scale, hi_scale};
        for (int part = 0; part < 2; ++part) {
          __m256 val;
          if constexpr (K == kInt4) {
            val = _mm256_cvtepi32_ps(_mm256_sub_epi32(codes[part], _mm256_set1_epi32(8)));
          } else {
            const __m256 mag = _mm256_permutevar8x32_ps(mags, _mm256_and_si256(codes[part], _mm256_set1_epi32(7)));
            const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(codes[part], _mm256_set1_epi32(8)), 28);
            val = _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(mag), sign));
          }
          _mm256_storeu_ps(buf + part * half + grp * 16 + i, _mm256_mul_ps(val, _mm256_set1_ps(scales[part])));
        }
      }
      continue;
#endif
      for (int64_t i = 0; i < 16; ++i) {
        const uint32_t b = p[grp * 16 + i];
        float lo, hi;
        if constexpr (K == kInt4) {
          lo = static_cast<float>(static_cast<int32_t>(b & 15u) - 8);
          hi = static_cast<float>(static_cast<int32_t>(b >> 4) - 8);
        } else {
          lo = std::bit_cast<float>(e2m1_bits(b & 15u));
          hi = std::bit_cast<float>(e2m1_bits(b >> 4));
        }
        buf[grp * 16 + i] = lo * lo_scale;
        buf[half + grp * 16 + i] = hi * hi_scale;
      }
    }
    return buf;
  }
}

constexpr float kFp8E4M3Factor = 256.0f;  // read_row's E4M3 values are 2^-8 of the truth

struct Problem {
  const uint8_t* key;
  const uint8_t* value;
  const uint8_t* key_groups;
  const uint8_t* value_groups;
  int64_t row_bytes, block_size, Hkv, G, D, max_blocks;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  float k_mult, v_mult;  // scale * k_factor (* FP8 factor), v_factor (* FP8 factor)
  int64_t window;        // sliding window W (> 0): only the last W keys; 0 = all of them
  float softcap;         // > 0: logits l become softcap * tanh(l / softcap); 0 = off
};

struct Scratch {
  std::vector<float> q, acc, row, logits;
};

// Software prefetch of KV head h's rows in the page `table[b]` (if the context reaches
// it): a page's rows for one head are Hkv rows apart and the pages follow the block
// table, not the address order, so the hardware prefetchers lose the stream at every
// page; the kernel's time went to waiting on these loads (a bf16 decode over 64 x 350
// tokens: 5.8 ms with shuffled pages, 3.0 ms with consecutive ones, before).
inline void prefetch_block(const Problem& P, const uint8_t* base, const uint8_t* groups, const int32_t* table,
                           int64_t b, int64_t end, int64_t h) {
  const int64_t bs = P.block_size;
  if (b * bs >= end) return;
  const int64_t first = static_cast<int64_t>(table[b]) * bs * P.Hkv + h;
  const int64_t rows = std::min(bs, end - b * bs);
  for (int64_t i = 0; i < rows; ++i) {
    const uint8_t* row = base + (first + i * P.Hkv) * P.row_bytes;
    for (int64_t c = 0; c < P.row_bytes; c += 64) __builtin_prefetch(row + c, 0, 3);
    if (groups != nullptr) __builtin_prefetch(groups + (first + i * P.Hkv) * (P.D / 16), 0, 3);
  }
}

// f(r, t) for the context's tokens t = start .. end - 1 in order, r the row of token t
// and KV head h in the cache viewed as [num_blocks * block_size * Hkv, row_bytes];
// prefetches each next page's rows of `base` (and `groups`, if any) on entering a page.
template <typename F>
inline void for_each_row(const Problem& P, const uint8_t* base, const uint8_t* groups, const int32_t* table,
                         int64_t start, int64_t end, int64_t h, F&& f) {
  const int64_t bs = P.block_size, Hkv = P.Hkv;
  for (int64_t t = start; t < end;) {
    const int64_t b = t / bs, off = t % bs, n = std::min(bs - off, end - t);
    int64_t r = (static_cast<int64_t>(table[b]) * bs + off) * Hkv + h;
    prefetch_block(P, base, groups, table, b + 1, end, h);
    for (int64_t i = 0; i < n; ++i, ++t, r += Hkv) f(r, t);
  }
}

#if defined(__AVX512F__)
// 16 values of an fp32 or bf16 cache row as fp32 (bf16 -> fp32 is exact: the bits shifted up).
template <Kind K>
inline __m512 load16(const uint8_t* p) {
  if constexpr (K == kFloat32) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(p));
  } else {
    return kvpilot_cpu::load_bf16x16(p);
  }
}

// f(std::integral_constant<int, GC>{}, g0) for the G heads of a group in chunks of GC <=
// 4 (head_dim 64) or 2 (128): as many heads as the 32 vector registers hold at once.
template <int DC, typename F>
inline void for_head_chunks(int64_t G, F&& f) {
  constexpr int64_t kChunk = DC == 64 ? 4 : (DC == 128 ? 2 : 1);
  for (int64_t g0 = 0; g0 < G; g0 += kChunk) {
    switch (std::min(kChunk, G - g0)) {
      case 4: f(std::integral_constant<int, 4>{}, g0); break;
      case 3: f(std::integral_constant<int, 3>{}, g0); break;
      case 2: f(std::integral_constant<int, 2>{}, g0); break;
      default: f(std::integral_constant<int, 1>{}, g0); break;
    }
  }
}

// Pass 1 for GC query heads g0 .. g0 + GC - 1: logits[g][t] = q_g . k_t with the GC
// query rows in registers and each K row converted once, in registers (not through the
// row buffer). Lane i of the 16-lane sum holds what dots()' two 8-lane FMA chains hold
// (lanes 0-7 the first chain, 8-15 the second) and the two halves are added and summed
// as there: the same bits as dots().
template <Kind K, int DC, int GC>
void logits_k(const Problem& P, const int32_t* table, int64_t start, int64_t end, int64_t h, const float* q,
              float* logits, int64_t len, int64_t g0) {
  constexpr int NV = DC / 16;
  constexpr int64_t kBytes16 = K == kFloat32 ? 64 : 32;
  __m512 qv[GC][NV];
  for (int gi = 0; gi < GC; ++gi)
    for (int j = 0; j < NV; ++j) qv[gi][j] = _mm512_loadu_ps(q + (g0 + gi) * DC + j * 16);
  float* lg = logits + g0 * len - start;
  for_each_row(P, P.key, nullptr, table, start, end, h, [&](int64_t r, int64_t t) {
    const uint8_t* row = P.key + r * P.row_bytes;
    __m512 k[NV];
    for (int j = 0; j < NV; ++j) k[j] = load16<K>(row + j * kBytes16);
    for (int gi = 0; gi < GC; ++gi) {
      __m512 a = _mm512_mul_ps(qv[gi][0], k[0]);
      for (int j = 1; j < NV; ++j) a = _mm512_fmadd_ps(qv[gi][j], k[j], a);
      const __m256 halves = _mm256_add_ps(_mm512_castps512_ps256(a),
                                          _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
      lg[gi * len + t] = hsum256(halves);
    }
  });
}

// Pass 2 for GC query heads g0 .. g0 + GC - 1 of a group: acc_g = sum_t p[g][t] v_t with
// the GC x DC accumulators in registers and each V row converted once for the GC heads
// (the generic loop kept them in memory: a load and a store per head and token, and a
// store-to-load chain through every token). The same FMA per value in the same token
// order as that loop (which the compiler contracts to FMAs): the same bits.
template <Kind K, int DC, int GC>
void accumulate_v(const Problem& P, const int32_t* table, int64_t start, int64_t end, int64_t h,
                  const float* logits, int64_t len, float* acc, int64_t g0) {
  constexpr int NV = DC / 16;
  constexpr int64_t kBytes16 = K == kFloat32 ? 64 : 32;
  __m512 a[GC][NV];
  for (int gi = 0; gi < GC; ++gi)
    for (int j = 0; j < NV; ++j) a[gi][j] = _mm512_setzero_ps();
  const float* lg = logits + g0 * len - start;
  for_each_row(P, P.value, nullptr, table, start, end, h, [&](int64_t r, int64_t t) {
    const uint8_t* row = P.value + r * P.row_bytes;
    __m512 v[NV];
    for (int j = 0; j < NV; ++j) v[j] = load16<K>(row + j * kBytes16);
    for (int gi = 0; gi < GC; ++gi) {
      const __m512 p = _mm512_set1_ps(lg[gi * len + t]);
      for (int j = 0; j < NV; ++j) a[gi][j] = _mm512_fmadd_ps(p, v[j], a[gi][j]);
    }
  });
  for (int gi = 0; gi < GC; ++gi)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc + (g0 + gi) * DC + j * 16, a[gi][j]);
}
#endif

// One (sequence s, KV head h): the G query heads' outputs into `w.acc` [G, D],
// normalised and scaled. `q` holds the G query rows in fp32 [G, D]. The query sits at
// position len - 1; with a sliding window W it sees keys start = max(0, len - W) ..
// len - 1 (transformers' mask p - W < j <= p), and the pages before `start` are never
// read (the KV cache manager may have freed them).
template <Kind K, int DC>
void attend(const Problem& P, int64_t s, int64_t h, Scratch& w) {
  const int64_t D = DC ? DC : P.D, G = P.G;
  const int64_t end = P.seq_lens[s];
  const int64_t start = P.window > 0 ? std::max<int64_t>(0, end - P.window) : 0;
  const int64_t len = end - start;  // keys seen; logits are indexed t - start
  const int32_t* table = P.block_tables + s * P.max_blocks;
  float* logits = w.logits.data();
  float* row = w.row.data();
  const float* q = w.q.data();
  // Pass 1: logits[g][t] = q_g . k_t, K read from its page.
#if defined(__AVX512F__)
  if constexpr ((K == kFloat32 || K == kBFloat16) && DC > 0 && DC % 16 == 0) {
    for_head_chunks<DC>(G, [&](auto gc, int64_t g0) {
      logits_k<K, DC, decltype(gc)::value>(P, table, start, end, h, q, logits, len, g0);
    });
  } else
#endif
  for_each_row(P, P.key, P.key_groups, table, start, end, h, [&](int64_t r, int64_t t) {
    const float* k = read_row<K, DC>(P.key, r, P.row_bytes, P.key_groups, D, row);
    dots<DC>(q, k, G, D, logits + (t - start), len);
  });
  if (P.softcap > 0.f) {  // Gemma 2: soft-cap the scaled scores before the softmax
    const float c = P.softcap, inv = 1.f / P.softcap;
    for (int64_t i = 0; i < G * len; ++i) logits[i] = c * std::tanh(logits[i] * inv);
  }
  // Softmax weights, unnormalised: exp(logit - max).
  float denom[64];
  std::vector<float> denom_big;
  float* den = denom;
  if (G > 64) {
    denom_big.resize(G);
    den = denom_big.data();
  }
  for (int64_t g = 0; g < G; ++g) {
    float* l = logits + g * len;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < len; ++t) m = std::max(m, l[t]);
    for (int64_t t = 0; t < len; ++t) l[t] -= m;
    exp_inplace(l, len);
    den[g] = sum(l, len);
  }
  // Pass 2: acc_g = sum_t p[g][t] v_t, V read from its page.
  float* acc = w.acc.data();
#if defined(__AVX512F__)
  if constexpr ((K == kFloat32 || K == kBFloat16) && DC > 0 && DC % 16 == 0) {
    for_head_chunks<DC>(G, [&](auto gc, int64_t g0) {
      accumulate_v<K, DC, decltype(gc)::value>(P, table, start, end, h, logits, len, acc, g0);
    });
  } else
#endif
  {
    std::fill(acc, acc + G * D, 0.f);
    for_each_row(P, P.value, P.value_groups, table, start, end, h, [&](int64_t r, int64_t t) {
      const float* v = read_row<K, DC>(P.value, r, P.row_bytes, P.value_groups, D, row);
      for (int64_t g = 0; g < G; ++g) axpy<DC>(acc + g * D, logits[g * len + (t - start)], v, D);
    });
  }
  for (int64_t g = 0; g < G; ++g) {
    const float norm = P.v_mult / den[g];
    for (int64_t d = 0; d < D; ++d) acc[g * D + d] *= norm;
  }
}

template <typename QT>
void run(const Problem& P, const QT* qp, QT* op, int64_t S, int64_t max_len,
         void (*item)(const Problem&, int64_t, int64_t, Scratch&)) {
  const int64_t G = P.G, D = P.D, H = P.Hkv * G;
  at::parallel_for(0, S * P.Hkv, 1, [&](int64_t begin, int64_t end) {
    Scratch w;
    w.q.resize(G * D);
    w.acc.resize(G * D);
    w.row.resize(D);
    w.logits.resize(G * max_len);
    for (int64_t it = begin; it < end; ++it) {
      const int64_t s = it / P.Hkv, h = it % P.Hkv;
      const QT* qs = qp + (s * H + h * G) * D;
      for (int64_t i = 0; i < G * D; ++i) w.q[i] = static_cast<float>(qs[i]) * P.k_mult;
      item(P, s, h, w);
      QT* os = op + (s * H + h * G) * D;
      for (int64_t i = 0; i < G * D; ++i) os[i] = static_cast<QT>(w.acc[i]);
    }
  });
}

template <Kind K>
auto pick(int64_t D) -> void (*)(const Problem&, int64_t, int64_t, Scratch&) {
  if (D == 64) return &attend<K, 64>;
  if (D == 128) return &attend<K, 128>;
  return &attend<K, 0>;
}

auto pick(int64_t kind, int64_t D) -> void (*)(const Problem&, int64_t, int64_t, Scratch&) {
  switch (kind) {
    case kFloat32: return pick<kFloat32>(D);
    case kBFloat16: return pick<kBFloat16>(D);
    case kFloat16: return pick<kFloat16>(D);
    case kFp8E4M3: return pick<kFp8E4M3>(D);
    case kFp8E5M2: return pick<kFp8E5M2>(D);
    case kFp4E2M1: return pick<kFp4E2M1>(D);
    default: return pick<kInt4>(D);
  }
}

// out [S, H, D] (q's dtype) <- attention of q [S, H, D] over the paged context.
// key_cache/value_cache: uint8 views of the caches, [num_blocks, block_size, Hkv, row_bytes].
// key_groups/value_groups: 4-bit caches' E4M3 group scales as uint8
// [num_blocks, block_size, Hkv, D/16] (empty tensors otherwise).
// block_tables [S, max_blocks] int32, seq_lens [S] int32 (>= 1).
// k_factor/v_factor: fp32 0-d tensors, the factors that turn stored values into K/V.
// window: sliding window in tokens (0 = full context); softcap: logit soft-cap (0 = off).
void paged_decode_attention(
    at::Tensor out, const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
    const at::Tensor& key_groups, const at::Tensor& value_groups, const at::Tensor& block_tables,
    const at::Tensor& seq_lens, double scale, const at::Tensor& k_factor, const at::Tensor& v_factor,
    int64_t kind, int64_t head_dim, int64_t window, double softcap) {
  TORCH_CHECK(window >= 0, "window must be >= 0 (0 = full context); got ", window);
  TORCH_CHECK(softcap >= 0 && std::isfinite(softcap), "softcap must be finite and >= 0 (0 = off); got ", softcap);
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && out.is_contiguous(), "q/out must be contiguous [S, H, D]");
  TORCH_CHECK(q.size(2) == head_dim && out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(),
              "out must match q");
  TORCH_CHECK(key_cache.scalar_type() == at::kByte && value_cache.scalar_type() == at::kByte &&
              key_cache.is_contiguous() && value_cache.is_contiguous() && key_cache.dim() == 4 &&
              value_cache.sizes() == key_cache.sizes(),
              "caches must be contiguous uint8 views [num_blocks, block_size, Hkv, row_bytes]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() && block_tables.dim() == 2 &&
              block_tables.size(0) == q.size(0), "block_tables: int32 [S, max_blocks]");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() && seq_lens.numel() == q.size(0),
              "seq_lens: int32 [S]");
  TORCH_CHECK(kind >= kFloat32 && kind <= kInt4, "unknown cache kind ", kind);
  const bool kv4 = kind == kFp4E2M1 || kind == kInt4;
  const int64_t S = q.size(0), H = q.size(1), D = head_dim;
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1), Hkv = key_cache.size(2);
  const int64_t row_bytes = key_cache.size(3);
  static const int64_t kBytes[] = {4, 2, 2, 1, 1, 0, 0};
  TORCH_CHECK(kv4 ? (D % 32 == 0 && row_bytes * 2 == D) : row_bytes == D * kBytes[kind],
              "cache rows of ", row_bytes, " bytes do not hold head_dim ", D, " values of kind ", kind);
  TORCH_CHECK(!kv4 || (key_groups.scalar_type() == at::kByte && value_groups.scalar_type() == at::kByte &&
                       key_groups.is_contiguous() && value_groups.is_contiguous() &&
                       key_groups.numel() == num_blocks * block_size * Hkv * (D / 16) &&
                       value_groups.numel() == key_groups.numel()),
              "4-bit caches need uint8 group scales [num_blocks, block_size, Hkv, head_dim / 16]");
  TORCH_CHECK(H % Hkv == 0, "num_heads ", H, " is not a multiple of num_kv_heads ", Hkv);
  const int64_t max_blocks = block_tables.size(1);
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  int64_t max_len = 0;
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(lens[s] >= 1, "seq_lens[", s, "] = ", lens[s], " < 1");
    const int64_t nb = (lens[s] + block_size - 1) / block_size;
    TORCH_CHECK(nb <= max_blocks, "seq_lens[", s, "] = ", lens[s], " exceeds the block table (", max_blocks,
                " blocks of ", block_size, ")");
    const int64_t first = window > 0 ? std::max<int64_t>(0, lens[s] - window) / block_size : 0;
    for (int64_t b = first; b < nb; ++b) {
      const int32_t blk = bt[s * max_blocks + b];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "block_tables[", s, ", ", b, "] = ", blk,
                  " out of range (", num_blocks, " blocks)");
    }
    max_len = std::max<int64_t>(max_len, lens[s]);
  }
  const float fp8 = kind == kFp8E4M3 ? kFp8E4M3Factor : 1.0f;
  Problem P{key_cache.data_ptr<uint8_t>(), value_cache.data_ptr<uint8_t>(),
            kv4 ? key_groups.data_ptr<uint8_t>() : nullptr, kv4 ? value_groups.data_ptr<uint8_t>() : nullptr,
            row_bytes, block_size, Hkv, H / Hkv, D, max_blocks, bt, lens,
            k_factor.item<float>() * fp8 * static_cast<float>(scale), v_factor.item<float>() * fp8,
            window, static_cast<float>(softcap)};
  auto item = pick(kind, D);
  switch (q.scalar_type()) {
    case at::kFloat:
      run<float>(P, q.data_ptr<float>(), out.data_ptr<float>(), S, max_len, item);
      break;
    case at::kBFloat16:
      run<c10::BFloat16>(P, q.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), S, max_len, item);
      break;
    case at::kHalf:
      run<c10::Half>(P, q.data_ptr<c10::Half>(), out.data_ptr<c10::Half>(), S, max_len, item);
      break;
    default:
      TORCH_CHECK(false, "query dtype ", q.scalar_type(), " is not float32, bfloat16 or float16");
  }
}

}  // namespace

TORCH_LIBRARY(kvpilot_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor q, Tensor key_cache, Tensor value_cache, "
      "Tensor key_groups, Tensor value_groups, Tensor block_tables, Tensor seq_lens, float scale, "
      "Tensor k_factor, Tensor v_factor, int kind, int head_dim, int window, float softcap) -> ()");
}

TORCH_LIBRARY_IMPL(kvpilot_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
