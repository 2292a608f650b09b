// WNA16 GEMM for few activation rows on CPU: out[M, N] = x[M, K] @ W[N, K]^T in fp32,
// W held as grouped integer codes (the canonical layout of
// kvpilot/engine/quantization/weights.py's WNA16Weight):
//   qweight uint8: 4 bits [N, K/2], column 2j in byte j's low nibble, 2j+1 in its high
//   nibble; 8 bits [N, K]. scales, offsets [N, K/g] (fp32/bf16/fp16):
//   w[n, k] = q[n, k] * scale[n, k/g] + offset[n, k/g].
// The same tiles also read float rows, fp32, bf16 or fp16 [N, K], with no scales
// (float_gemm_cpu: a quantized model's LM head read in place, in the checkpoint's dtype).
//
// Why: a decode step multiplies a few rows of activations by every weight matrix, so it
// is bound by reading the weights. Dequantizing a tile of fp32 rows and calling sgemm
// writes and re-reads 4 bytes per weight (8 times the 4-bit codes); here each row's
// codes are read once per call and turned into fp32 weights in registers.
//
// Numerics: every weight is dequantized exactly as fp32 (one fused multiply-add,
// q * scale + offset rounded once) and multiplied into fp32 accumulators, so the result
// is x @ dequant(W)^T up to summation order. Each (token, output row) pair has its own
// accumulators that walk K in the same order whatever the batch: a token's result does
// not depend on the other rows of x (batch invariant), only on the build's ISA path.
//
// Design (memory-bound decode):
// - Work items: chunks of kChunkRows output rows over ATen's intra-op pool. In a chunk,
//   register tiles of R rows x MB tokens (AVX-512: 4 x up to 4): the R*MB accumulators
//   stay in registers for the whole of K, each weight vector is dequantized once and
//   used MB times, each activation vector loaded once and used R times. More than 4
//   tokens: balanced blocks of at most 4, each over the chunk's rows again (in L1/L2 by
//   then). Measured on a Zen 5 core, 4 x 4 tiles beat 8 tokens x 2 rows by up to 1.35x
//   from 4 tokens up, and tie it at one: activation loads, not FMAs, bounded the wider
//   token tiles.
// - The next tiles' codes are prefetched in software (see prefetch_rows).
// - 4 bits with AVX-512: per group a 16-entry fp32 table lut[q] = q * scale + offset
//   (one FMA per group and row); 16 bytes of codes (32 columns) are widened to 16 dwords
//   with vpmovzxbd, and vpermps looks up both nibbles (it reads only an index's low 4
//   bits, so the low nibble needs no mask; the high one one shift). The high nibbles are
//   the odd columns: x is permuted once per call (each 32-column block as its 16 even
//   then its 16 odd columns) so that no code is ever shuffled.
// - 4 bits with AVX2 (8 lanes): mask/shift, convert, one FMA with the group's scale and
//   offset (a 16-entry table does not fit one 8-lane permute). Same x permutation.
// - 8 bits: vpmovzxbd, convert, one FMA with scale and offset.
// - Group sizes the vector paths cannot take (4 bits: not a multiple of 32; 8 bits: of
//   16) and builds without AVX2: each row dequantized into a buffer of K floats, then a
//   dot product per token with 16 fixed partial sums (the compiler vectorizes it).
// Source of the design: llama.cpp's ggml_vec_dot_q4_0 / q8_0 (codes unpacked in
// registers, one row read per output) and the lookup-table dequantization of
// PyTorch's _weight_int4pack_mm_for_cpu, kept in fp32 instead of bf16.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_math.h"

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <bit>
#include <cstdint>
#include <vector>

namespace {

// Weight formats, as the BITS template argument: 4- and 8-bit codes, or float rows
// (fp32/bf16/fp16, no scales: see float_gemm_cpu).
constexpr int kBF16 = 16;
constexpr int kF16 = 17;
constexpr int kF32 = 32;
constexpr bool is_float(int bits) { return bits == kBF16 || bits == kF16 || bits == kF32; }
// fp16 rows need F16C's conversion on the 8-lane path (AVX-512F has its own).
#if defined(__AVX512F__) || defined(__F16C__)
constexpr bool kF16C = true;
#else
constexpr bool kF16C = false;
#endif

constexpr int kMaxTokens = 4;       // tokens per register tile
constexpr int64_t kChunkRows = 24;  // output rows per work item (a multiple of every R)

inline float to_f(float v) { return v; }
inline float to_f(c10::BFloat16 v) { return static_cast<float>(v); }
inline float to_f(c10::Half v) {
#if defined(__F16C__)
  return _cvtsh_ss(v.x);
#else
  return static_cast<float>(v);
#endif
}

// One work item's view: a chunk of output rows and a block of tokens.
struct Tile {
  const uint8_t* q;  // the chunk's first row of codes; rows qs bytes apart
  int64_t qs;
  const float* sc;  // the chunk's scales and offsets as fp32, [rows, G]
  const float* of;
  int64_t G, g, K;
  const float* x;  // the block's first token, rows K apart (permuted for the 4-bit vector paths)
  float* out;      // out[m0, n0]; rows ldo apart
  int64_t ldo;
};

#if defined(__AVX2__) || defined(__AVX512F__)
// The same bytes kPrefetchTiles register tiles ahead (R rows each), one cache line per
// row: a tile reads R rows side by side, a few hundred bytes each, and the hardware
// prefetchers lose such short interleaved streams (measured: 8-bit rows of 576 read
// at 11 GB/s from DRAM without this, about 3 times slower than from L2).
constexpr int64_t kPrefetchTiles = 2;

// Keep a and b in registers: without this GCC folds each activation load into every FMA
// that reads it (R loads of the same vector instead of one), and a tile of 4 tokens x 4
// rows then waited on loads, not FMAs (measured: M = 8 about 1.35 times slower).
#if defined(__AVX512F__)
#define KVPILOT_VREG "+v"  // any of the 32 vector registers
#else
#define KVPILOT_VREG "+x"
#endif
template <typename V>
inline void in_register(V& a) {
  asm("" : KVPILOT_VREG(a));
}
template <typename V>
inline void in_register(V& a, V& b) {
  asm("" : KVPILOT_VREG(a), KVPILOT_VREG(b));
}

template <int R>
inline void prefetch_rows(const uint8_t* p, int64_t qs) {
  const char* a = reinterpret_cast<const char*>(p + kPrefetchTiles * R * qs);
  for (int r = 0; r < R; ++r) _mm_prefetch(a + r * qs, _MM_HINT_T0);
}
#endif

#if defined(__AVX512F__)
constexpr bool kVector = true;

// Rows per register tile: 4 rows x up to 4 tokens, 16 accumulators plus 8 weight
// vectors, 4 tables and 2 activations within the 32 zmm registers; each activation
// vector is loaded once and used 4 times, each weight vector built once and used MB
// times. (Measured against 8 tokens x 2 rows, 6 x 3: this is as fast at one token and up
// to 1.35 times faster from 4 tokens up.)
constexpr int rows_for(int) { return 4; }

// acc[r][m] += w[r] * x[m], x[m] the 16 columns at xb + m * K (one load per token,
// used by every row).
template <int MB, int R>
inline void fma_tokens(__m512 (&acc)[R][MB], const __m512 (&w)[R], const float* xb, int64_t K) {
  for (int m = 0; m < MB; ++m) {
    __m512 xv = _mm512_loadu_ps(xb + m * K);
    in_register(xv);
    for (int r = 0; r < R; ++r) acc[r][m] = _mm512_fmadd_ps(w[r], xv, acc[r][m]);
  }
}

template <int BITS, int MB, int R>
void tile(const Tile& t, int64_t r0) {
  const int64_t K = t.K, G = t.G, g = t.g;
  const uint8_t* q = t.q + r0 * t.qs;
  const float* sc = t.sc + r0 * G;
  const float* of = t.of + r0 * G;
  __m512 acc[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps();
  if constexpr (is_float(BITS)) {
    // 16 columns per step: 64 bytes of an fp32 row (one cache line), 32 of a 16-bit one.
    constexpr int64_t step = BITS == kF32 ? 64 : 32;
    for (int64_t b = 0; b < K / 16; ++b) {
      if (BITS == kF32 || (b & 1) == 0) prefetch_rows<R>(q + b * step, t.qs);
      __m512 w[R];
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = q + r * t.qs + b * step;
        if constexpr (BITS == kF32) {
          w[r] = _mm512_loadu_ps(reinterpret_cast<const float*>(p));
        } else if constexpr (BITS == kBF16) {
          w[r] = kvpilot_cpu::load_bf16x16(p);
        } else {
          w[r] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        }
      }
      const float* xb = t.x + b * 16;
      fma_tokens<MB, R>(acc, w, xb, K);
    }
  } else if constexpr (BITS == 4) {
    const __m512 iota = _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f, 10.f, 11.f, 12.f, 13.f,
                                       14.f, 15.f);
    const int64_t per_group = g / 32;
    for (int64_t grp = 0; grp < G; ++grp) {
      __m512 lut[R];
      for (int r = 0; r < R; ++r) {
        lut[r] = _mm512_fmadd_ps(iota, _mm512_set1_ps(sc[r * G + grp]), _mm512_set1_ps(of[r * G + grp]));
      }
      for (int64_t b = grp * per_group; b < (grp + 1) * per_group; ++b) {
        if ((b & 3) == 0) prefetch_rows<R>(q + b * 16, t.qs);
        __m512 wl[R], wh[R];
        for (int r = 0; r < R; ++r) {
          const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + r * t.qs + b * 16)));
          wl[r] = _mm512_permutexvar_ps(v, lut[r]);
          wh[r] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut[r]);
        }
        const float* xb = t.x + b * 32;
        for (int m = 0; m < MB; ++m) {
          __m512 x0 = _mm512_loadu_ps(xb + m * K);
          __m512 x1 = _mm512_loadu_ps(xb + m * K + 16);
          in_register(x0, x1);
          for (int r = 0; r < R; ++r) {
            acc[r][m] = _mm512_fmadd_ps(wl[r], x0, acc[r][m]);
            acc[r][m] = _mm512_fmadd_ps(wh[r], x1, acc[r][m]);
          }
        }
      }
    }
  } else {
    const int64_t per_group = g / 16;
    for (int64_t grp = 0; grp < G; ++grp) {
      __m512 s[R], o[R];
      for (int r = 0; r < R; ++r) {
        s[r] = _mm512_set1_ps(sc[r * G + grp]);
        o[r] = _mm512_set1_ps(of[r * G + grp]);
      }
      for (int64_t b = grp * per_group; b < (grp + 1) * per_group; ++b) {
        if ((b & 3) == 0) prefetch_rows<R>(q + b * 16, t.qs);
        __m512 w[R];
        for (int r = 0; r < R; ++r) {
          const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + r * t.qs + b * 16)));
          w[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), s[r], o[r]);
        }
        const float* xb = t.x + b * 16;
        fma_tokens<MB, R>(acc, w, xb, K);
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int r = 0; r < R; ++r) t.out[m * t.ldo + r0 + r] = _mm512_reduce_add_ps(acc[r][m]);
  }
}

#elif defined(__AVX2__) && defined(__FMA__)
constexpr bool kVector = true;

// 16 ymm registers: R * MB accumulators plus 2R weight vectors and 2R scale/offset
// broadcasts.
constexpr int rows_for(int mb) { return mb == 1 ? 4 : (mb == 2 ? 2 : 1); }

inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// acc[r][m] += w0[r] * x0[m] + w1[r] * x1[m], x0[m] and x1[m] the 8 columns at
// x0p + m * K and x1p + m * K (two loads per token, used by every row).
template <int MB, int R>
inline void fma_tokens(__m256 (&acc)[R][MB], const __m256 (&w0)[R], const __m256 (&w1)[R], const float* x0p,
                       const float* x1p, int64_t K) {
  for (int m = 0; m < MB; ++m) {
    __m256 x0 = _mm256_loadu_ps(x0p + m * K);
    __m256 x1 = _mm256_loadu_ps(x1p + m * K);
    in_register(x0, x1);
    for (int r = 0; r < R; ++r) {
      acc[r][m] = _mm256_fmadd_ps(w0[r], x0, acc[r][m]);
      acc[r][m] = _mm256_fmadd_ps(w1[r], x1, acc[r][m]);
    }
  }
}

inline __m256i load8_u8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

template <int BITS, int MB, int R>
void tile(const Tile& t, int64_t r0) {
  const int64_t K = t.K, G = t.G, g = t.g;
  const uint8_t* q = t.q + r0 * t.qs;
  const float* sc = t.sc + r0 * G;
  const float* of = t.of + r0 * G;
  __m256 acc[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = _mm256_setzero_ps();
  if constexpr (is_float(BITS)) {
    constexpr int64_t step = BITS == kF32 ? 64 : 32;  // bytes of 16 columns
    for (int64_t b = 0; b < K / 16; ++b) {
      if (BITS == kF32 || (b & 1) == 0) prefetch_rows<R>(q + b * step, t.qs);
      __m256 w0[R], w1[R];
      for (int r = 0; r < R; ++r) {
        const __m128i* p = reinterpret_cast<const __m128i*>(q + r * t.qs + b * step);
        if constexpr (BITS == kF32) {
          w0[r] = _mm256_loadu_ps(reinterpret_cast<const float*>(p));
          w1[r] = _mm256_loadu_ps(reinterpret_cast<const float*>(p) + 8);
        } else if constexpr (BITS == kBF16) {
          w0[r] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p)), 16));
          w1[r] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p + 1)), 16));
        } else {
#if defined(__F16C__)
          w0[r] = _mm256_cvtph_ps(_mm_loadu_si128(p));
          w1[r] = _mm256_cvtph_ps(_mm_loadu_si128(p + 1));
#else  // never runs: vector_path sends fp16 rows to rows_generic without F16C
          w0[r] = w1[r] = _mm256_setzero_ps();
#endif
        }
      }
      fma_tokens<MB, R>(acc, w0, w1, t.x + b * 16, t.x + b * 16 + 8, K);
    }
  } else {
    // Both widths step 16 columns: 4 bits as 8 bytes (8 even and 8 odd columns of the
    // permuted 32-column block), 8 bits as two halves of 8 columns.
    const int64_t per_group = g / 16;
    for (int64_t grp = 0; grp < G; ++grp) {
      __m256 s[R], o[R];
      for (int r = 0; r < R; ++r) {
        s[r] = _mm256_set1_ps(sc[r * G + grp]);
        o[r] = _mm256_set1_ps(of[r * G + grp]);
      }
      for (int64_t b = grp * per_group; b < (grp + 1) * per_group; ++b) {
        if ((b & 3) == 0 || BITS == 8) prefetch_rows<R>(q + b * (BITS == 4 ? 8 : 16), t.qs);
        __m256 w0[R], w1[R];
        for (int r = 0; r < R; ++r) {
          if constexpr (BITS == 4) {
            const __m256i v = load8_u8(q + r * t.qs + b * 8);
            const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xF)));
            const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
            w0[r] = _mm256_fmadd_ps(lo, s[r], o[r]);
            w1[r] = _mm256_fmadd_ps(hi, s[r], o[r]);
          } else {
            w0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(load8_u8(q + r * t.qs + b * 16)), s[r], o[r]);
            w1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(load8_u8(q + r * t.qs + b * 16 + 8)), s[r], o[r]);
          }
        }
        // 4 bits: block b is half b % 2 of the 32-column block b / 2, its low nibbles
        // permuted columns 8 * (b % 2) .. + 8 and its high ones 16 more.
        const float* x0p = BITS == 4 ? t.x + (b >> 1) * 32 + (b & 1) * 8 : t.x + b * 16;
        const float* x1p = BITS == 4 ? x0p + 16 : x0p + 8;
        fma_tokens<MB, R>(acc, w0, w1, x0p, x1p, K);
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    for (int r = 0; r < R; ++r) t.out[m * t.ldo + r0 + r] = hsum(acc[r][m]);
  }
}

#else
constexpr bool kVector = false;
constexpr int rows_for(int) { return 1; }
template <int BITS, int MB, int R>
void tile(const Tile&, int64_t) {}
#endif

// Whether the register tiles take this group size (and the 4-bit x permutation applies).
bool vector_path(int64_t bits, int64_t g) {
  return kVector && g % (bits == 4 ? 32 : 16) == 0 && (bits != kF16 || kF16C);
}

// Rows [r0, r1) of the chunk for the MB tokens of t.
template <int BITS, int MB>
void rows_block(const Tile& t, int64_t r0, int64_t r1) {
  constexpr int R = rows_for(MB);
  int64_t r = r0;
  for (; r + R <= r1; r += R) tile<BITS, MB, R>(t, r);
  for (; r < r1; ++r) tile<BITS, MB, 1>(t, r);
}

template <int BITS>
void rows_tokens(const Tile& t, int64_t rows, int64_t mb) {
  static_assert(kMaxTokens == 4, "one case per token count up to kMaxTokens");
  switch (mb) {
    case 1: rows_block<BITS, 1>(t, 0, rows); break;
    case 2: rows_block<BITS, 2>(t, 0, rows); break;
    case 3: rows_block<BITS, 3>(t, 0, rows); break;
    default: rows_block<BITS, 4>(t, 0, rows); break;
  }
}

// sum_k a[k] * b[k] with 16 fixed partial sums (vectorizable without reassociating).
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  constexpr int L = 16;
  float acc[L] = {0.f};
  int64_t k = 0;
  for (; k + L <= n; k += L) {
    for (int i = 0; i < L; ++i) acc[i] += a[k + i] * b[k + i];
  }
  for (int i = 0; k < n; ++k, ++i) acc[i] += a[k] * b[k];
  float s = 0.f;
  for (int i = 0; i < L; ++i) s += acc[i];
  return s;
}

// Any group size, any build: each row dequantized into w (K floats), then one dot per
// token (t.x unpermuted, all M tokens).
template <int BITS>
void rows_generic(const Tile& t, int64_t rows, int64_t M, float* __restrict w) {
  const int64_t K = t.K, G = t.G, g = t.g;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* __restrict q = t.q + r * t.qs;
    for (int64_t grp = 0; grp < G; ++grp) {
      const float s = is_float(BITS) ? 1.f : t.sc[r * G + grp], o = is_float(BITS) ? 0.f : t.of[r * G + grp];
      for (int64_t k = grp * g; k < (grp + 1) * g; ++k) {
        if constexpr (BITS == kF32) {
          w[k] = reinterpret_cast<const float*>(q)[k];
        } else if constexpr (BITS == kBF16) {
          w[k] = to_f(reinterpret_cast<const c10::BFloat16*>(q)[k]);
        } else if constexpr (BITS == kF16) {
          w[k] = to_f(reinterpret_cast<const c10::Half*>(q)[k]);
        } else {
          const int code = BITS == 4 ? (q[k / 2] >> (4 * (k % 2))) & 0xF : q[k];
          w[k] = static_cast<float>(code) * s + o;
        }
      }
    }
    for (int64_t m = 0; m < M; ++m) t.out[m * t.ldo + r] = dot(w, t.x + m * K, K);
  }
}

// dst[i] = float(src[i]): the chunk's scales and offsets, once per work item.
inline void to_float(float* __restrict dst, const float* __restrict src, int64_t n) {
  std::copy(src, src + n, dst);
}
inline void to_float(float* __restrict dst, const c10::BFloat16* __restrict src, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) dst[i] = std::bit_cast<float>(static_cast<uint32_t>(bits[i]) << 16);
}
inline void to_float(float* __restrict dst, const c10::Half* __restrict src, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
#endif
  for (; i < n; ++i) dst[i] = to_f(src[i]);
}

template <typename T>
void permute_rows(float* __restrict dst, const T* __restrict src, int64_t M, int64_t K, int64_t ld) {
  // Each 32-column block as its 16 even columns, then its 16 odd ones.
  for (int64_t m = 0; m < M; ++m) {
    const T* s = src + m * ld;
    float* d = dst + m * K;
    for (int64_t b = 0; b < K; b += 32) {
      for (int i = 0; i < 16; ++i) {
        d[b + i] = static_cast<float>(s[b + 2 * i]);
        d[b + 16 + i] = static_cast<float>(s[b + 2 * i + 1]);
      }
    }
  }
}

template <int BITS, typename S>
void run(const uint8_t* q, int64_t qs, const S* sc, const S* of, int64_t G, int64_t g, const float* x, int64_t M,
         int64_t K, int64_t N, float* out, bool vec) {
  const int64_t chunks = (N + kChunkRows - 1) / kChunkRows;
  // At least 2^19 multiply-adds per thread: below that, waking the pool cost more than
  // the second thread saved (measured: 192 x 576 at 4 tokens, 9.5 us on one thread,
  // 11.8 us on two).
  const int64_t per_chunk = kChunkRows * K * M;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 19) / std::max<int64_t>(1, per_chunk));
  // Token blocks of at most kMaxTokens, balanced (7 tokens: 4, 3; 17: 4, 4, 3, 3, 3).
  const int64_t blocks = (M + kMaxTokens - 1) / kMaxTokens;
  at::parallel_for(0, chunks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(static_cast<size_t>(2 * kChunkRows * G + (vec ? 0 : K)));
    float* sf = buf.data();
    float* off = sf + kChunkRows * G;
    for (int64_t c = begin; c < end; ++c) {
      const int64_t n0 = c * kChunkRows, rows = std::min(N - n0, kChunkRows);
      if constexpr (!is_float(BITS)) {
        to_float(sf, sc + n0 * G, rows * G);
        to_float(off, of + n0 * G, rows * G);
      }
      Tile t{q + n0 * qs, qs, sf, off, G, g, K, x, out + n0, N};
      if (!vec) {
        rows_generic<BITS>(t, rows, M, off + kChunkRows * G);
        continue;
      }
      int64_t m0 = 0;
      for (int64_t i = 0; i < blocks; ++i) {
        const int64_t mb = M / blocks + (i < M % blocks ? 1 : 0);
        t.x = x + m0 * K;
        t.out = out + m0 * N + n0;
        rows_tokens<BITS>(t, rows, mb);
        m0 += mb;
      }
    }
  });
}

// out [M, N] fp32 = x [M, K] (fp32 or bf16) @ dequant(qweight, scales, offsets)^T.
void wna16_gemm_cpu(at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                    const at::Tensor& offsets, int64_t bits, int64_t group_size) {
  TORCH_CHECK(bits == 4 || bits == 8, "wna16_gemm_cpu: bits must be 4 or 8, got ", bits);
  for (const at::Tensor* t : {static_cast<const at::Tensor*>(&out), &x, &qweight, &scales, &offsets}) {
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 2, "wna16_gemm_cpu: every tensor must be a 2-D CPU tensor");
  }
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "wna16_gemm_cpu: x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.stride(1) == 1, "wna16_gemm_cpu: x's rows must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.is_contiguous(),
              "wna16_gemm_cpu: qweight must be contiguous uint8");
  TORCH_CHECK(qweight.size(1) == (bits == 4 ? K / 2 : K) && (bits == 8 || K % 2 == 0),
              "wna16_gemm_cpu: qweight ", qweight.sizes(), " does not hold ", bits, "-bit rows of K = ", K);
  TORCH_CHECK(group_size > 0 && K % group_size == 0, "wna16_gemm_cpu: group size ", group_size,
              " does not divide K = ", K);
  const int64_t G = K / group_size;
  TORCH_CHECK(scales.sizes() == offsets.sizes() && scales.size(0) == N && scales.size(1) == G &&
                  scales.is_contiguous() && offsets.is_contiguous(),
              "wna16_gemm_cpu: scales and offsets must be contiguous [", N, ", ", G, "], got ", scales.sizes(), " and ",
              offsets.sizes());
  TORCH_CHECK(scales.scalar_type() == offsets.scalar_type(), "wna16_gemm_cpu: scales and offsets differ in dtype");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.size(0) == M && out.size(1) == N,
              "wna16_gemm_cpu: out must be contiguous float32 [", M, ", ", N, "]");
  if (M == 0 || N == 0) return;
  if (K == 0) {
    out.zero_();
    return;
  }
  const bool vec = vector_path(bits, group_size);
  // The activations as the kernel reads them: fp32 [M, K], permuted per 32 columns for
  // the 4-bit vector paths (a copy the size of x; none for fp32 x otherwise).
  at::Tensor xf;
  if (vec && bits == 4) {
    xf = at::empty({M, K}, x.options().dtype(at::kFloat));
    if (x.scalar_type() == at::kFloat) {
      permute_rows(xf.data_ptr<float>(), x.data_ptr<float>(), M, K, x.stride(0));
    } else {
      permute_rows(xf.data_ptr<float>(), x.data_ptr<c10::BFloat16>(), M, K, x.stride(0));
    }
  } else {
    xf = x.to(at::kFloat).contiguous();
  }
  auto go = [&](auto tag) {
    using S = decltype(tag);
    const auto* sc = scales.data_ptr<S>();
    const auto* of = offsets.data_ptr<S>();
    const uint8_t* q = qweight.data_ptr<uint8_t>();
    if (bits == 4) {
      run<4, S>(q, qweight.size(1), sc, of, G, group_size, xf.data_ptr<float>(), M, K, N, out.data_ptr<float>(), vec);
    } else {
      run<8, S>(q, qweight.size(1), sc, of, G, group_size, xf.data_ptr<float>(), M, K, N, out.data_ptr<float>(), vec);
    }
  };
  switch (scales.scalar_type()) {
    case at::kFloat: go(float{}); break;
    case at::kBFloat16: go(c10::BFloat16{}); break;
    case at::kHalf: go(c10::Half{}); break;
    default: TORCH_CHECK(false, "wna16_gemm_cpu: scales must be float32, bfloat16 or float16, got ", scales.scalar_type());
  }
}

// out [M, N] fp32 = x [M, K] (fp32 or bf16) @ W^T for W [N, K] fp32, bf16 or fp16: a
// quantized float32 model's LM head, read where it lies (the checkpoint's 16-bit table,
// or a tied fp32 embedding table, with no packed second copy). Each weight is widened
// exactly to fp32 in registers and multiplied into fp32 accumulators, with the tiles,
// chunks and batch invariance of the integer path above: the result is
// x @ W.float()^T up to summation order.
void float_gemm_cpu(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight) {
  for (const at::Tensor* t : {static_cast<const at::Tensor*>(&out), &x, &weight}) {
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 2, "float_gemm_cpu: every tensor must be a 2-D CPU tensor");
  }
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "float_gemm_cpu: x must be float32 or bfloat16, got ", x.scalar_type());
  const auto wt = weight.scalar_type();
  TORCH_CHECK(wt == at::kFloat || wt == at::kBFloat16 || wt == at::kHalf,
              "float_gemm_cpu: weight must be float32, bfloat16 or float16, got ", wt);
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.is_contiguous() && weight.size(1) == K, "float_gemm_cpu: weight must be contiguous [N, ", K,
              "], got ", weight.sizes());
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.size(0) == M && out.size(1) == N,
              "float_gemm_cpu: out must be contiguous float32 [", M, ", ", N, "]");
  if (M == 0 || N == 0) return;
  if (K == 0) {
    out.zero_();
    return;
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const auto* q = static_cast<const uint8_t*>(weight.data_ptr());
  const int64_t qs = K * static_cast<int64_t>(weight.element_size());
  const float* none = nullptr;  // no scales or offsets: one group of K columns
  float* o = out.data_ptr<float>();
  const float* xp = xf.data_ptr<float>();
  if (wt == at::kFloat) {
    run<kF32, float>(q, qs, none, none, 1, K, xp, M, K, N, o, vector_path(kF32, K));
  } else if (wt == at::kBFloat16) {
    run<kBF16, float>(q, qs, none, none, 1, K, xp, M, K, N, o, vector_path(kBF16, K));
  } else {
    run<kF16, float>(q, qs, none, none, 1, K, xp, M, K, N, o, vector_path(kF16, K));
  }
}

// ---------------------------------------------------------------------------- INT8 W8A8
// The two elementwise passes around torch._int_mm for INT8 W8A8 weights, each one pass
// over a row instead of one pass (and one allocation) per torch operator. Both give the
// bits of the torch formulation in weights.py (quantize_int8_rows; the scale epilogue of
// Int8Weight.linear): the same fp32 operations in the same order (no contraction is
// possible: no operation is an add), round-half-to-even as torch.round, and c10's
// round-to-nearest-even conversion to the output dtype.

#if defined(__AVX512F__) && defined(__AVX512BW__)
// float32 and bfloat16 rows take 16-lane paths (the same operations as the scalar loops).
template <typename T>
constexpr bool kVecRows = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) { return kvpilot_cpu::load_bf16x16(p); }
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
// fp32 -> bf16 rounded to nearest even, c10::BFloat16's rule (NaN -> 0x7FC0).
inline void store16(c10::BFloat16* p, __m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
#else
template <typename T>
constexpr bool kVecRows = false;
#endif

// max_k |x[k]| of a row (max is exact in any order, so 16 lanes give the scalar result).
template <typename T>
inline float row_absmax(const T* __restrict x, int64_t K) {
  float amax = 0.0f;
  int64_t k = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if constexpr (kVecRows<T>) {
    __m512 vmax = _mm512_setzero_ps();
    for (; k + 16 <= K; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(load16(x + k)));
    amax = _mm512_reduce_max_ps(vmax);
  }
#endif
  for (; k < K; ++k) amax = std::max(amax, std::fabs(to_f(x[k])));
  return amax;
}

// xq[t, k] = clamp(nearbyint(x[t, k] / s[t]), -128, 127) with
// s[t] = max(max_k |x[t, k]|, 1e-10) / 127 (dynamic per token) or static_scale (> 0).
void int8_quantize_rows_cpu(at::Tensor& xq, at::Tensor& scales, const at::Tensor& x, double static_scale) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "int8_quantize_rows_cpu: x must be [T, K] with contiguous rows");
  const int64_t M = x.size(0), K = x.size(1), xs = x.stride(0);
  TORCH_CHECK(xq.scalar_type() == at::kChar && xq.is_contiguous() && xq.size(0) == M && xq.size(1) == K,
              "int8_quantize_rows_cpu: xq must be a contiguous int8 [T, K]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == M,
              "int8_quantize_rows_cpu: scales must be a contiguous float32 [T]");
  const float fixed = static_cast<float>(static_scale);
  auto go = [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    int8_t* qp = xq.data_ptr<int8_t>();
    float* sp = scales.data_ptr<float>();
    at::parallel_for(0, M, 4, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const T* __restrict xr = xp + t * xs;
        int8_t* __restrict qr = qp + t * K;
        const float sc = fixed > 0.0f ? fixed : std::max(row_absmax(xr, K), 1e-10f) / 127.0f;
        sp[t] = sc;
        int64_t k0 = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        if constexpr (kVecRows<T>) {
          const __m512 vs = _mm512_set1_ps(sc), lo = _mm512_set1_ps(-128.0f), hi = _mm512_set1_ps(127.0f);
          for (; k0 + 16 <= K; k0 += 16) {
            __m512 v = _mm512_roundscale_ps(_mm512_div_ps(load16(xr + k0), vs),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
            _mm_storeu_si128(reinterpret_cast<__m128i*>(qr + k0), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
          }
        }
#endif
        for (int64_t k = k0; k < K; ++k) {
          const float v = std::nearbyint(to_f(xr[k]) / sc);
          qr[k] = static_cast<int8_t>(std::min(std::max(v, -128.0f), 127.0f));
        }
      }
    });
  };
  switch (x.scalar_type()) {
    case at::kFloat: go(float{}); break;
    case at::kBFloat16: go(c10::BFloat16{}); break;
    case at::kHalf: go(c10::Half{}); break;
    default: TORCH_CHECK(false, "int8_quantize_rows_cpu: x must be float32, bfloat16 or float16, got ", x.scalar_type());
  }
}

// out[t, n] = (float(acc[t, n]) * sx[t]) * sw[n], rounded to out's dtype.
void int8_scale_cpu(at::Tensor& out, const at::Tensor& acc, const at::Tensor& sx, const at::Tensor& sw) {
  TORCH_CHECK(acc.scalar_type() == at::kInt && acc.dim() == 2 && acc.is_contiguous(),
              "int8_scale_cpu: acc must be a contiguous int32 [T, N]");
  const int64_t M = acc.size(0), N = acc.size(1);
  TORCH_CHECK(out.is_contiguous() && out.size(0) == M && out.size(1) == N,
              "int8_scale_cpu: out must be a contiguous [T, N] like acc");
  TORCH_CHECK(sx.scalar_type() == at::kFloat && sx.is_contiguous() && sx.numel() == M,
              "int8_scale_cpu: sx must be a contiguous float32 [T]");
  TORCH_CHECK(sw.scalar_type() == at::kFloat && sw.is_contiguous() && sw.numel() == N,
              "int8_scale_cpu: sw must be a contiguous float32 [N]");
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float* xp = sx.data_ptr<float>();
  const float* wp = sw.data_ptr<float>();
  auto go = [&](auto tag) {
    using T = decltype(tag);
    T* op = out.data_ptr<T>();
    at::parallel_for(0, M, 4, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const int32_t* __restrict ar = ap + t * N;
        T* __restrict orow = op + t * N;
        const float st = xp[t];
        int64_t n0 = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        if constexpr (kVecRows<T>) {
          const __m512 vst = _mm512_set1_ps(st);
          for (; n0 + 16 <= N; n0 += 16) {
            const __m512 acc16 = _mm512_cvtepi32_ps(_mm512_loadu_si512(ar + n0));
            store16(orow + n0, _mm512_mul_ps(_mm512_mul_ps(acc16, vst), _mm512_loadu_ps(wp + n0)));
          }
        }
#endif
        for (int64_t n = n0; n < N; ++n) orow[n] = static_cast<T>((static_cast<float>(ar[n]) * st) * wp[n]);
      }
    });
  };
  switch (out.scalar_type()) {
    case at::kFloat: go(float{}); break;
    case at::kBFloat16: go(c10::BFloat16{}); break;
    case at::kHalf: go(c10::Half{}); break;
    default: TORCH_CHECK(false, "int8_scale_cpu: out must be float32, bfloat16 or float16, got ", out.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvpilot_cpu, m) {
  m.def(
      "wna16_gemm_cpu(Tensor(a!) out, Tensor x, Tensor qweight, Tensor scales, Tensor offsets, int bits, "
      "int group_size) -> ()");
  m.def("float_gemm_cpu(Tensor(a!) out, Tensor x, Tensor weight) -> ()");
  m.def("int8_quantize_rows_cpu(Tensor(a!) xq, Tensor(b!) scales, Tensor x, float static_scale) -> ()");
  m.def("int8_scale_cpu(Tensor(a!) out, Tensor acc, Tensor sx, Tensor sw) -> ()");
}

TORCH_LIBRARY_IMPL(kvpilot_cpu, CPU, m) {
  m.impl("wna16_gemm_cpu", &wna16_gemm_cpu);
  m.impl("float_gemm_cpu", &float_gemm_cpu);
  m.impl("int8_quantize_rows_cpu", &int8_quantize_rows_cpu);
  m.impl("int8_scale_cpu", &int8_scale_cpu);
}
