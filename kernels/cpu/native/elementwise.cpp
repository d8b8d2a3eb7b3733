// shardwise CPU elementwise ops of a decoder layer: residual-add + RMSNorm, rotary embedding,
// SwiGLU's silu(gate) * up.
//
// Registered as ``shardwise_native::cpu_rms_norm``, ``cpu_add_rms_norm``, ``cpu_rotary`` and
// ``cpu_silu_and_mul`` (fake impls in Python: shardwise.kernels.cpu.native). Their torch oracles
// are the CPU backend's implementations of the same contracts (shardwise.kernels.cpu.norms,
// .rotary, .activations), themselves tested against shardwise.kernels.reference.
// Why native: inside a compiled CPU decode step each of these is one opaque call, where their
// torch form made inductor trace, lower, generate and build a fused C++ kernel per layer and
// per fusion pattern: most of a first start's compile (benchmarks/README.md, "Start-up").
// Numerics, per element, everything in float32 and rounded to x's dtype where the torch code
// rounds (T = float32 rounds nothing):
//   rms:     h = T(x + r); inv = 1 / sqrt(sum(h^2) / H + eps); out = T(T(h * inv) * w)
//   rotary:  (x1, x2) -> (T(x1 c - x2 s), T(x2 c + x1 s)); dims past rotary_dim copied
//   silu:    out = T(T(g / (1 + exp(-g))) * u)   (exp to ~1 ulp, as ATen's silu; its float
//            result may differ from ATen's in the last bit, so a rounded 16-bit result rarely)
// Only the order of the sum of squares differs from torch's.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

#include "simd.h"

// Products and sums rounded one by one, as torch's ops (no fused multiply-adds formed from them).
#pragma GCC optimize("fp-contract=off")

namespace {

using shardwise_native::exp16;  // simd.h

// 16 lanes of T <-> 16 floats; masked so row tails need no scalar loop.
template <typename T>
struct Lanes;

template <>
struct Lanes<float> {
  static inline __m512 load(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
  static inline void store(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
  static inline __m512 round(__m512 v) { return v; }
};

template <>
struct Lanes<c10::BFloat16> {
  static inline __m512 load(const c10::BFloat16* p, __mmask16 m) {
    const __m256i h = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static inline __m256i narrow(__m512 v) { return shardwise_native::narrow_bf16(v); }
  static inline void store(c10::BFloat16* p, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, narrow(v));
  }
  static inline __m512 round(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(narrow(v)), 16));
  }
};

template <>
struct Lanes<c10::Half> {
  static inline __m512 load(const c10::Half* p, __mmask16 m) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
  }
  static inline __m256i narrow(__m512 v) { return shardwise_native::narrow_f16(v); }
  static inline void store(c10::Half* p, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, narrow(v));
  }
  static inline __m512 round(__m512 v) { return _mm512_cvtph_ps(narrow(v)); }
};

inline __mmask16 tail(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

// Rows per task: at least ~64K elements, so a decode step's single row (and a small batch)
// runs on the calling thread without waking the pool.
inline int64_t grain(int64_t row_elems) {
  return std::max<int64_t>(1, 65536 / std::max<int64_t>(row_elems, 1));
}

void check_float_dtype(const at::Tensor& t, const char* op) {
  const auto dt = t.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, op,
              ": dtype must be float32, bfloat16 or float16, got ", dt);
  TORCH_CHECK(t.device().is_cpu(), op, ": tensors must be on the CPU");
}

// ---- residual-add + RMSNorm ---------------------------------------------------------------

// rows of x (and r, h: null without a residual) [rows, H] -> out [rows, H]; w [H]
template <typename T>
void rms_rows(const T* x, const T* r, const T* w, T* out, T* h, int64_t rows, int64_t H,
              float eps) {
  using L = Lanes<T>;
  at::parallel_for(0, rows, grain(H), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* xr = x + row * H;
      const T* src = xr;  // what is normalised: h with a residual, else x
      __m512 acc = _mm512_setzero_ps();
      if (r != nullptr) {
        const T* rr = r + row * H;
        T* hr = h + row * H;
        for (int64_t i = 0; i < H; i += 16) {
          const __mmask16 m = tail(H - i);
          const __m512 v = L::round(_mm512_add_ps(L::load(xr + i, m), L::load(rr + i, m)));
          L::store(hr + i, v, m);
          acc = _mm512_fmadd_ps(v, v, acc);
        }
        src = hr;
      } else {
        for (int64_t i = 0; i < H; i += 16) {
          const __m512 v = L::load(xr + i, tail(H - i));
          acc = _mm512_fmadd_ps(v, v, acc);
        }
      }
      const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(H) + eps);
      const __m512 vinv = _mm512_set1_ps(inv);
      T* o = out + row * H;
      for (int64_t i = 0; i < H; i += 16) {
        const __mmask16 m = tail(H - i);
        const __m512 normed = L::round(_mm512_mul_ps(L::load(src + i, m), vinv));
        L::store(o + i, _mm512_mul_ps(normed, L::load(w + i, m)), m);
      }
    }
  });
}

void check_norm(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  check_float_dtype(x, op);
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1), op,
              ": weight must be [hidden=", x.dim() ? x.size(-1) : 0, "], got ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), op,
              ": weight must be in x's dtype (the torch code rounds it to x's dtype first)");
}

template <typename F>
void by_dtype(at::ScalarType dt, F&& f) {
  switch (dt) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    default: f(c10::Half{}); break;
  }
}

at::Tensor cpu_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm(x, weight, "cpu_rms_norm");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor out = at::empty(xc.sizes(), xc.options());
  const int64_t H = xc.size(-1), rows = H ? xc.numel() / H : 0;
  by_dtype(xc.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    rms_rows<T>(xc.data_ptr<T>(), nullptr, wc.data_ptr<T>(), out.data_ptr<T>(), nullptr, rows, H,
                static_cast<float>(eps));
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> cpu_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                    const at::Tensor& weight, double eps) {
  check_norm(x, weight, "cpu_add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "cpu_add_rms_norm: residual must match x (", x.sizes(), ", ", x.scalar_type(),
              "), got ", residual.sizes(), ", ", residual.scalar_type());
  const at::Tensor xc = x.contiguous(), rc = residual.contiguous(), wc = weight.contiguous();
  at::Tensor out = at::empty(xc.sizes(), xc.options());
  at::Tensor h = at::empty(xc.sizes(), xc.options());
  const int64_t H = xc.size(-1), rows = H ? xc.numel() / H : 0;
  by_dtype(xc.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    rms_rows<T>(xc.data_ptr<T>(), rc.data_ptr<T>(), wc.data_ptr<T>(), out.data_ptr<T>(),
                h.data_ptr<T>(), rows, H, static_cast<float>(eps));
  });
  return {out, h};
}

// ---- rotary ---------------------------------------------------------------------------------

// One head row x [D] (contiguous) -> o [D]: pairs rotated by c, s [R2] (float), dims past
// 2 * R2 copied. "half": pairs (i, i + R2); interleaved: (2i, 2i + 1).
template <typename T>
void rotate_row(const T* x, T* o, const float* c, const float* s, int64_t R2, int64_t D,
                bool interleaved) {
  using L = Lanes<T>;
  if (!interleaved) {
    for (int64_t i = 0; i < R2; i += 16) {
      const __mmask16 m = tail(R2 - i);
      const __m512 x1 = L::load(x + i, m), x2 = L::load(x + R2 + i, m);
      const __m512 cv = _mm512_maskz_loadu_ps(m, c + i), sv = _mm512_maskz_loadu_ps(m, s + i);
      L::store(o + i, _mm512_sub_ps(_mm512_mul_ps(x1, cv), _mm512_mul_ps(x2, sv)), m);
      L::store(o + R2 + i, _mm512_add_ps(_mm512_mul_ps(x2, cv), _mm512_mul_ps(x1, sv)), m);
    }
  } else {  // GPT-J: scalar (in float, rounded once, as the vector path)
    for (int64_t i = 0; i < R2; ++i) {
      const float x1 = static_cast<float>(x[2 * i]), x2 = static_cast<float>(x[2 * i + 1]);
      o[2 * i] = static_cast<T>(x1 * c[i] - x2 * s[i]);
      o[2 * i + 1] = static_cast<T>(x2 * c[i] + x1 * s[i]);
    }
  }
  std::copy(x + 2 * R2, x + D, o + 2 * R2);
}

// x [B, H, S, D] (last dim contiguous, any other strides) -> contiguous out; c, s [Bc, S, R2]
// contiguous float with Bc 1 or B
template <typename T>
void rotate(const at::Tensor& x, at::Tensor& out, const float* c, const float* s, int64_t Bc,
            int64_t R2, bool interleaved) {
  const int64_t B = x.size(0), H = x.size(1), S = x.size(2), D = x.size(3);
  const int64_t sb = x.stride(0), sh = x.stride(1), ss = x.stride(2);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, B * H * S, grain(D), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / (H * S), h = (i / S) % H, t = i % S;
      const int64_t cs = ((Bc == 1 ? 0 : b) * S + t) * R2;
      rotate_row<T>(xp + b * sb + h * sh + t * ss, op + i * D, c + cs, s + cs, R2, D, interleaved);
    }
  });
}

at::Tensor rotated(const at::Tensor& x, const at::Tensor& c, const at::Tensor& s,
                   bool interleaved) {
  const at::Tensor xc = x.stride(3) == 1 ? x : x.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());  // contiguous [B, H, S, D]
  if (out.numel() == 0) return out;
  by_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    rotate<T>(xc, out, c.data_ptr<float>(), s.data_ptr<float>(), c.size(0), c.size(2),
              interleaved);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> cpu_rotary(const at::Tensor& q, const at::Tensor& k,
                                              const at::Tensor& cos, const at::Tensor& sin,
                                              bool interleaved) {
  check_float_dtype(q, "cpu_rotary");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && q.scalar_type() == k.scalar_type() &&
                  q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(3) == k.size(3),
              "cpu_rotary takes q [batch, q_heads, seq, d] and k [batch, kv_heads, seq, d] of one "
              "dtype; got ", q.sizes(), ", ", k.sizes());
  TORCH_CHECK(cos.dim() == 3 && cos.sizes() == sin.sizes() && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous(),
              "cpu_rotary takes contiguous float32 cos and sin [batch | 1, seq, rotary_dim / 2]; "
              "got ", cos.sizes(), " ", cos.scalar_type());
  TORCH_CHECK((cos.size(0) == 1 || cos.size(0) == q.size(0)) && cos.size(1) == q.size(2) &&
                  2 * cos.size(2) <= q.size(3),
              "cpu_rotary: cos/sin ", cos.sizes(), " do not fit q ", q.sizes());
  return {rotated(q, cos, sin, interleaved), rotated(k, cos, sin, interleaved)};
}

// ---- silu(gate) * up ------------------------------------------------------------------------

// gate rows at g (stride ld), up rows at u (stride ld) -> out [rows, I]
template <typename T>
void silu_mul_rows(const T* g, const T* u, int64_t ld, T* out, int64_t rows, int64_t I) {
  using L = Lanes<T>;
  const __m512 one = _mm512_set1_ps(1.f);
  at::parallel_for(0, rows, grain(I), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* gr = g + row * ld;
      const T* ur = u + row * ld;
      T* o = out + row * I;
      for (int64_t i = 0; i < I; i += 16) {
        const __mmask16 m = tail(I - i);
        const __m512 gv = L::load(gr + i, m);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        const __m512 act = L::round(_mm512_div_ps(gv, _mm512_add_ps(one, e)));
        L::store(o + i, _mm512_mul_ps(act, L::load(ur + i, m)), m);
      }
    }
  });
}

at::Tensor cpu_silu_and_mul(const at::Tensor& x, const std::optional<at::Tensor>& up) {
  check_float_dtype(x, "cpu_silu_and_mul");
  TORCH_CHECK(x.dim() >= 1, "cpu_silu_and_mul: x must have a feature dim");
  const at::Tensor xc = x.contiguous();
  const bool fused = !(up.has_value() && up->defined());
  const int64_t F = xc.size(-1), I = fused ? F / 2 : F;
  TORCH_CHECK(!fused || F % 2 == 0, "cpu_silu_and_mul needs an even last dim [.., 2 * inter], got ",
              x.sizes());
  at::Tensor uc;
  if (!fused) {
    TORCH_CHECK(up->sizes() == x.sizes() && up->scalar_type() == x.scalar_type(),
                "cpu_silu_and_mul: gate and up must have one shape and dtype, got ", x.sizes(),
                ", ", up->sizes());
    uc = up->contiguous();
  }
  auto sizes = xc.sizes().vec();
  sizes.back() = I;
  at::Tensor out = at::empty(sizes, xc.options());
  const int64_t rows = F ? xc.numel() / F : 0;
  by_dtype(xc.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* g = xc.data_ptr<T>();
    const T* u = fused ? g + I : uc.data_ptr<T>();
    silu_mul_rows<T>(g, u, F, out.data_ptr<T>(), rows, I);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(shardwise_native, m) {
  m.def("cpu_rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("cpu_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) "
        "-> (Tensor, Tensor)");
  m.def("cpu_rotary(Tensor q, Tensor k, Tensor cos, Tensor sin, bool interleaved) "
        "-> (Tensor, Tensor)");
  m.def("cpu_silu_and_mul(Tensor x, Tensor? up) -> Tensor");
}

TORCH_LIBRARY_IMPL(shardwise_native, CPU, m) {
  m.impl("cpu_rms_norm", &cpu_rms_norm);
  m.impl("cpu_add_rms_norm", &cpu_add_rms_norm);
  m.impl("cpu_rotary", &cpu_rotary);
  m.impl("cpu_silu_and_mul", &cpu_silu_and_mul);
}
