// shardwise CPU decode attention: one query token per sequence over its valid cache range.
//
// Registered as ``shardwise_native::cpu_attention_decode`` (fake impl in Python,
// shardwise.kernels.cpu.native). Same contract as the Python op ``shardwise::cpu_attention_decode``
// and the reference ``attention_decode`` (shardwise.kernels.reference.attention, the oracle):
//   q [B, Hq, 1, D]; k_cache, v_cache [B, Hkv, T, D] (Hkv divides Hq: query head h reads kv head
//   h / (Hq / Hkv)); lengths, starts [B] int32/int64; position range [max(start, len - window), len);
//   ALiBi bias slope[h] * (j - (len - 1)); a sink logit per head in the softmax denominator.
// Scores, softmax and the weighted sum of V are computed in float32 whatever the dtype; the
// output is contiguous [B, Hq, 1, D] in q's dtype (zeros for an empty range).
// Why native: the Python op costs ~50-60 us a call (custom-op dispatch, checks, host ranges),
// more than the work at decode sizes; this one costs a few.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

namespace {

int64_t read_index(const at::Tensor& t, int64_t b) {
  return t.scalar_type() == at::kInt ? t.data_ptr<int32_t>()[b] : t.data_ptr<int64_t>()[b];
}

void check_index(const std::optional<at::Tensor>& t, const char* name, int64_t B) {
  if (!t.has_value() || !t->defined()) return;
  TORCH_CHECK(t->dim() == 1 && t->size(0) == B &&
                  (t->scalar_type() == at::kInt || t->scalar_type() == at::kLong),
              "cpu_attention_decode: ", name, " must be an int32/int64 tensor [batch=", B, "]");
  TORCH_CHECK(t->device().is_cpu(), "cpu_attention_decode: ", name, " must be on the CPU");
}

void check_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                const at::Tensor& lengths, const std::optional<at::Tensor>& starts) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && k.sizes() == v.sizes() && q.size(0) == k.size(0) &&
                  q.size(3) == k.size(3),
              "cpu_attention_decode takes q [batch, q_heads, 1, d] and caches [batch, kv_heads, "
              "max_tokens, d]; got q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(q.size(2) == 1, "cpu_attention_decode takes one query token per sequence, got q ",
              q.sizes());
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "cpu_attention_decode: q_heads (",
              q.size(1), ") must be a multiple of kv_heads (", k.size(1), ")");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(),
              "cpu_attention_decode: q, k and v must share a dtype");
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "cpu_attention_decode: dtype must be float32, bfloat16 or float16, got ", dt);
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "cpu_attention_decode: tensors must be on the CPU");
  check_index(lengths, "lengths", q.size(0));
  check_index(starts, "starts", q.size(0));
}

template <typename T>
inline float as_float(T x) { return static_cast<float>(x); }

// 16 values of T from p (the lanes of `mask` only; the others 0) as float32
inline __m512 load16(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 mask) {
  const __m256i h = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const c10::Half* p, __mmask16 mask) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
}

inline __mmask16 lanes(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

// One (batch, kv head): its `group` query rows q [group, D] (float32) over positions [s, n) of
// k, v (position 0 of this head, rows `ks` / `vs` elements apart); out [group, D] float32.
// Each key and value row is read once for the whole group.
template <typename T>
void head_decode(const float* q, const T* k, const T* v, int64_t ks, int64_t vs, int64_t D,
                 int64_t group, int64_t s, int64_t n, const float* slopes, const float* sinks,
                 float scale, float* out, std::vector<float>& scores) {
  const int64_t len = n - s;
  scores.resize(static_cast<size_t>(len * group));  // [len, group]
  std::vector<float> mx(group, -std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < len; ++j) {
    const T* kj = k + (s + j) * ks;
    for (int64_t g = 0; g < group; ++g) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) {
        const __mmask16 m = lanes(D - d);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + g * D + d), load16(kj + d, m), acc);
      }
      float sc = _mm512_reduce_add_ps(acc) * scale;
      if (slopes) sc += slopes[g] * static_cast<float>(s + j - (n - 1));
      scores[j * group + g] = sc;
      mx[g] = std::max(mx[g], sc);
    }
  }
  std::vector<float> denom(group, 0.f);
  for (int64_t g = 0; g < group; ++g) {
    if (sinks) {
      mx[g] = std::max(mx[g], sinks[g]);
      denom[g] = std::exp(sinks[g] - mx[g]);
    }
  }
  for (int64_t j = 0; j < len; ++j)
    for (int64_t g = 0; g < group; ++g) {
      float& e = scores[j * group + g];
      e = std::exp(e - mx[g]);
      denom[g] += e;
    }
  std::fill(out, out + group * D, 0.f);
  for (int64_t j = 0; j < len; ++j) {
    const T* vj = v + (s + j) * vs;
    for (int64_t d = 0; d < D; d += 16) {
      const __mmask16 m = lanes(D - d);
      const __m512 vv = load16(vj + d, m);
      for (int64_t g = 0; g < group; ++g) {
        float* o = out + g * D + d;
        _mm512_mask_storeu_ps(o, m, _mm512_fmadd_ps(_mm512_set1_ps(scores[j * group + g]), vv,
                                                    _mm512_maskz_loadu_ps(m, o)));
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = 1.f / denom[g];
    for (int64_t d = 0; d < D; ++d) out[g * D + d] *= inv;
  }
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
         const std::vector<int64_t>& first, const std::vector<int64_t>& last, const float* slopes,
         const float* sinks, float scale, at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(3), Hkv = k.size(1);
  const int64_t group = Hq / Hkv;
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  // work per task ~ group * len * D: small calls stay on one thread (no fork/join)
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) total += last[b] - first[b];
  const int64_t grain = total * group * D * Hkv < (1 << 16) ? B * Hkv : 1;
  at::parallel_for(0, B * Hkv, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(static_cast<size_t>(group * D)), of(static_cast<size_t>(group * D)),
        scores;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / Hkv, h = t % Hkv, s = first[b], n = last[b];
      T* o = op + (b * Hq + h * group) * D;
      if (n <= s) {
        std::fill(o, o + group * D, T(0.f));
        continue;
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = as_float(qp[b * q.stride(0) + (h * group + g) * q.stride(1) + d * q.stride(3)]);
      head_decode<T>(qf.data(), kp + b * k.stride(0) + h * k.stride(1),
                     vp + b * v.stride(0) + h * v.stride(1), k.stride(2), v.stride(2), D, group, s,
                     n, slopes ? slopes + h * group : nullptr, sinks ? sinks + h * group : nullptr,
                     scale, of.data(), scores);
      for (int64_t i = 0; i < group * D; ++i) o[i] = static_cast<T>(of[i]);
    }
  });
}

at::Tensor float_heads(const std::optional<at::Tensor>& t, const char* name, int64_t Hq) {
  if (!t.has_value() || !t->defined()) return at::Tensor();
  TORCH_CHECK(t->numel() == Hq && t->device().is_cpu(), "cpu_attention_decode: ", name,
              " must hold one value per query head (", Hq, ") on the CPU");
  return t->to(at::kFloat).contiguous().reshape({Hq});
}

at::Tensor cpu_attention_decode(const at::Tensor& q, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& lengths,
                                const std::optional<at::Tensor>& starts,
                                const std::optional<at::Tensor>& alibi_slopes,
                                std::optional<double> scale, std::optional<int64_t> window,
                                const std::optional<at::Tensor>& sinks) {
  check_args(q, k_cache, v_cache, lengths, starts);
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(3), T = k_cache.size(2);
  TORCH_CHECK(!window.has_value() || *window >= 1, "cpu_attention_decode: window must be >= 1");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1 && q.stride(3) == 1,
              "cpu_attention_decode: the head dimension must be contiguous");
  const bool has_sinks = sinks.has_value() && sinks->defined();
  const bool has_alibi = alibi_slopes.has_value() && alibi_slopes->defined();
  TORCH_CHECK(!(has_sinks && has_alibi), "cpu_attention_decode: sinks with ALiBi are not supported");
  const at::Tensor len_c = lengths.contiguous();
  at::Tensor start_c;
  if (starts.has_value() && starts->defined()) start_c = starts->contiguous();
  std::vector<int64_t> first(B), last(B);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = read_index(len_c, b), s = start_c.defined() ? read_index(start_c, b) : 0;
    TORCH_CHECK(0 <= s && s <= n && n <= T, "cpu_attention_decode needs 0 <= starts <= lengths <= "
                "max_tokens=", T, "; got (start, length) (", s, ", ", n, ") at row ", b);
    first[b] = window.has_value() ? std::max(s, n - *window) : s;
    last[b] = n;
  }
  const at::Tensor sl = float_heads(alibi_slopes, "alibi_slopes", Hq);
  const at::Tensor sk = float_heads(sinks, "sinks", Hq);
  const float sc = scale.has_value() ? static_cast<float>(*scale)
                                     : 1.f / std::sqrt(static_cast<float>(D));
  at::Tensor out = at::empty({B, Hq, 1, D}, q.options());
  const float* slp = sl.defined() ? sl.data_ptr<float>() : nullptr;
  const float* skp = sk.defined() ? sk.data_ptr<float>() : nullptr;
  switch (q.scalar_type()) {
    case at::kFloat: run<float>(q, k_cache, v_cache, first, last, slp, skp, sc, out); break;
    case at::kBFloat16: run<c10::BFloat16>(q, k_cache, v_cache, first, last, slp, skp, sc, out); break;
    default: run<c10::Half>(q, k_cache, v_cache, first, last, slp, skp, sc, out); break;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(shardwise_native, m) {
  m.def("cpu_attention_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor lengths, "
        "Tensor? starts, Tensor? alibi_slopes, float? scale, int? window, Tensor? sinks) -> Tensor");
}

TORCH_LIBRARY_IMPL(shardwise_native, CPU, m) {
  m.impl("cpu_attention_decode", &cpu_attention_decode);
}
