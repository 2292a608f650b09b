// Fused elementwise layer ops on CPU: RMSNorm (alone and with the residual add), rotary
// embedding in place, and SiLU-and-mul.
//
// Why: in a prefill step on CPU the matrix products run near the core's peak, and what
// is left is memory traffic. The torch formulation of these ops (x.pow(2).mean(),
// x * rsqrt, weight *, cat/neg/mul/add for rotate-half, silu then mul) makes one pass
// over the activations per operator and allocates a tensor each time: on the embedded
// model that was about a quarter of a 2,048-token prefill step. Here each op is one pass
// over a token's row while it sits in L1.
//
// Numerics follow the torch formulation of kvpilot/engine/model/layer_ops.py: fp32
// accumulation, a value rounded to the model dtype wherever torch would round it (so
// bf16/fp16 models see the same roundings); sums use 16 fixed partial sums, so a
// token's result depends only on its own row (batch invariant), but they are not
// bit-identical to torch's reduction order.
// Source of the op set and their contracts: vLLM's CPU layernorm / activation /
// pos_encoding kernels (csrc/cpu/), which fuse the same three places.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_math.h"

#include <cmath>
#include <cstdint>

namespace {

using kvpilot_cpu::exp_poly;

constexpr int kLanes = 16;

template <typename T>
inline float to_f(T v) {
  return static_cast<float>(v);
}

// x rounded to T and back (the identity for float).
template <typename T>
inline float round_t(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return static_cast<float>(static_cast<T>(x));
  }
}

// 1 / sqrt(mean(row^2) + eps) with kLanes fixed partial sums.
template <typename T>
inline float inv_rms(const T* __restrict row, int64_t H, float eps) {
  float acc[kLanes] = {0.f};
  int64_t h = 0;
  for (; h + kLanes <= H; h += kLanes) {
    for (int i = 0; i < kLanes; ++i) {
      const float v = to_f(row[h + i]);
      acc[i] += v * v;
    }
  }
  for (int i = 0; h < H; ++h, ++i) {
    const float v = to_f(row[h]);
    acc[i] += v * v;
  }
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += acc[i];
  return 1.0f / std::sqrt(s / static_cast<float>(H) + eps);
}

// out = weight * T(x * inv_rms)
template <typename T>
inline void norm_row(T* __restrict out, const T* __restrict x, const T* __restrict w, int64_t H, float inv) {
  for (int64_t h = 0; h < H; ++h) {
    out[h] = static_cast<T>(to_f(w[h]) * round_t<T>(to_f(x[h]) * inv));
  }
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D [num_tokens, hidden] with contiguous rows, got sizes ",
              t.sizes(), " strides ", t.strides());
}

void check_weight(const at::Tensor& weight, const at::Tensor& x, const char* op) {
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              op, ": weight must be contiguous [hidden] of x's dtype");
}

template <typename F>
void dispatch(at::ScalarType st, const char* op, F&& f) {
  switch (st) {
    case at::kFloat:
      f(float{});
      break;
    case at::kBFloat16:
      f(c10::BFloat16{});
      break;
    case at::kHalf:
      f(c10::Half{});
      break;
    default:
      TORCH_CHECK(false, op, ": dtype ", st, " is not one of float32, bfloat16, float16");
  }
}

// out[t] = weight * T(x[t] / sqrt(mean(x[t]^2) + eps))
void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(), "rms_norm: out must match x");
  check_weight(weight, x, "rms_norm");
  const int64_t N = x.size(0), H = x.size(1), xs = x.stride(0), os = out.stride(0);
  dispatch(x.scalar_type(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const T* row = xp + t * xs;
        norm_row<T>(op + t * os, row, wp, H, inv_rms<T>(row, H, static_cast<float>(eps)));
      }
    });
  });
}

// residual[t] = T(x[t] + residual[t]); x[t] = rms_norm(residual[t])   (both in place)
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "fused_add_rms_norm: residual must match x");
  check_weight(weight, x, "fused_add_rms_norm");
  const int64_t N = x.size(0), H = x.size(1), xs = x.stride(0), rs = residual.stride(0);
  dispatch(x.scalar_type(), "fused_add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    T* xp = x.data_ptr<T>();
    T* rp = residual.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        T* __restrict xr = xp + t * xs;
        T* __restrict rr = rp + t * rs;
        for (int64_t h = 0; h < H; ++h) rr[h] = static_cast<T>(to_f(xr[h]) + to_f(rr[h]));
        norm_row<T>(xr, rr, wp, H, inv_rms<T>(rr, H, static_cast<float>(eps)));
      }
    });
  });
}

// Rotate-half RoPE of one head row in place: for i < D/2, with c = cos[p][i], s = sin[p][i]
// rounded to T:  x1' = T(T(x1 c) + T(-x2 s)),  x2' = T(T(x2 c) + T(x1 s)).
template <typename T>
inline void rope_row(T* __restrict x, const float* __restrict c, const float* __restrict s, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float ci = round_t<T>(c[i]), si = round_t<T>(s[i]);
    const float x1 = to_f(x[i]), x2 = to_f(x[i + half]);
    const float a = round_t<T>(x1 * ci), b = round_t<T>(-x2 * si);
    const float d = round_t<T>(x2 * ci), f = round_t<T>(x1 * si);
    x[i] = static_cast<T>(a + b);
    x[i + half] = static_cast<T>(d + f);
  }
}

// q [T, Hq, D], k [T, Hk, D] (rows may be strided views of a fused QKV output; the head
// and dim axes contiguous), positions [T] int64, cos/sin [max_positions, D] fp32 tables of
// the rotate-half layout (the second half repeats the first). Mutates q and k.
void rotary_embedding(const at::Tensor& positions, at::Tensor& q, at::Tensor& k, const at::Tensor& cos,
                      const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3, "rotary_embedding: q and k must be [num_tokens, heads, head_dim]");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.scalar_type() == k.scalar_type(),
              "rotary_embedding: q and k must agree in tokens, head_dim and dtype");
  const int64_t N = q.size(0), D = q.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0, "rotary_embedding: head_dim must be even, got ", D);
  for (const at::Tensor* t : {&q, &k}) {
    TORCH_CHECK(t->device().is_cpu() && t->stride(2) == 1 && t->stride(1) == D,
                "rotary_embedding: each token's heads must be contiguous rows of head_dim");
  }
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == N && positions.scalar_type() == at::kLong &&
                  positions.is_contiguous(),
              "rotary_embedding: positions must be contiguous int64 [num_tokens]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == D && sin.sizes() == cos.sizes(),
              "rotary_embedding: cos/sin must be contiguous fp32 [max_positions, head_dim]");
  const int64_t P = cos.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < N; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "rotary_embedding: position ", pos[t], " outside the table [0, ", P, ")");
  }
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t Hq = q.size(1), Hk = k.size(1), qs = q.stride(0), ks = k.stride(0);
  dispatch(q.scalar_type(), "rotary_embedding", [&](auto tag) {
    using T = decltype(tag);
    T* qp = q.data_ptr<T>();
    T* kp = k.data_ptr<T>();
    at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const float* c = cp + pos[t] * D;
        const float* s = sp + pos[t] * D;
        for (int64_t h = 0; h < Hq; ++h) rope_row<T>(qp + t * qs + h * D, c, s, half);
        for (int64_t h = 0; h < Hk; ++h) rope_row<T>(kp + t * ks + h * D, c, s, half);
      }
    });
  });
}

// x [T, 2I] = [gate | up] -> out [T, I] = T(T(silu(gate)) * up)
void silu_and_mul(at::Tensor& out, const at::Tensor& x) {
  check_rows(x, "x");
  check_rows(out, "out");
  const int64_t N = x.size(0), I = out.size(1);
  TORCH_CHECK(x.size(1) == 2 * I && out.size(0) == N && out.scalar_type() == x.scalar_type(),
              "silu_and_mul: x must be [num_tokens, 2 * I] and out [num_tokens, I] of the same dtype");
  const int64_t xs = x.stride(0), os = out.stride(0);
  dispatch(x.scalar_type(), "silu_and_mul", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const T* __restrict g = xp + t * xs;
        const T* __restrict u = g + I;
        T* __restrict o = op + t * os;
        for (int64_t i = 0; i < I; ++i) {
          const float gi = to_f(g[i]);
          const float silu = round_t<T>(gi / (1.0f + exp_poly(-gi)));
          o[i] = static_cast<T>(silu * to_f(u[i]));
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvpilot_cpu, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rotary_embedding(Tensor positions, Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
}

TORCH_LIBRARY_IMPL(kvpilot_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("silu_and_mul", &silu_and_mul);
}
