// shardwise CPU decode attention: one query token per sequence over its valid cache range; and
// the same for the prompt chunks of a served mixed step (cpu_chunk_attention, at the end: each
// chunk token a query over its slot's row).
//
// Registered as ``shardwise_native::cpu_attention_decode`` and ``cpu_chunk_attention`` (fake
// impls in Python, shardwise.kernels.cpu.native). The decode op has the contract of the Python
// op ``shardwise::cpu_attention_decode`` and the reference ``attention_decode``
// (shardwise.kernels.reference.attention, the oracle):
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

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

namespace {

using shardwise_native::exp16;
using shardwise_native::hsum16;

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

// Per-thread scratch of head_decode (kept across its tasks: no allocation per head).
struct Scratch {
  std::vector<float> scores;  // [group, len]: scores, then their exponentials
  std::vector<float> keys;    // [16, D]: one block of keys as float32
  std::vector<float> denom;  // [group]: the softmax sums
};

// Scores of `group` query rows q [group, D] (float32) against keys s .. n-1 of k (position 0
// of this head, rows `ks` elements apart) -> scratch.scores [group, n - s], 16 keys at a time:
// each block is widened to float32 once for the whole group, and each query's 16 dot products
// are summed horizontally together (hsum16).
template <typename T>
void head_scores(const float* q, const T* k, int64_t ks, int64_t D, int64_t group, int64_t s,
                 int64_t n, const float* slopes, float scale, Scratch& w) {
  const int64_t len = n - s;
  float* kf = w.keys.data();
  for (int64_t j0 = 0; j0 < len; j0 += 16) {
    const int64_t m = std::min<int64_t>(16, len - j0);
    for (int64_t j = 0; j < m; ++j)
      for (int64_t d = 0; d < D; d += 16)
        _mm512_mask_storeu_ps(kf + j * D + d, lanes(D - d),
                              load16(k + (s + j0 + j) * ks + d, lanes(D - d)));
    // the block's first key relative to the query's position (ALiBi's distance)
    const __m512 dist = _mm512_add_ps(
        _mm512_set1_ps(static_cast<float>(s + j0 - (n - 1))),
        _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    for (int64_t g = 0; g < group; ++g) {
      // all 16 keys even in a short last block (its rows past m hold stale finite values, and
      // their scores are not stored): fixed trip counts keep the accumulators in registers
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) {
        const __mmask16 dm = lanes(D - d);
        const __m512 qv = _mm512_maskz_loadu_ps(dm, q + g * D + d);
        for (int j = 0; j < 16; ++j)
          acc[j] = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(dm, kf + j * D + d), acc[j]);
      }
      __m512 sc = _mm512_mul_ps(hsum16(acc), _mm512_set1_ps(scale));
      if (slopes) sc = _mm512_fmadd_ps(_mm512_set1_ps(slopes[g]), dist, sc);
      _mm512_mask_storeu_ps(w.scores.data() + g * len + j0, lanes(m), sc);
    }
  }
}

// out [G, D] = e [G, len] x v[s .. s + len) / denom [G]: G query rows' 16 columns accumulate in
// registers (G a compile-time constant, so they stay there) while the value rows stream past.
template <int G, typename T>
void weighted_values(const float* e, const T* v, int64_t vs, int64_t D, int64_t s, int64_t len,
                     const float* denom, float* out) {
  for (int64_t d = 0; d < D; d += 16) {
    const __mmask16 m = lanes(D - d);
    __m512 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
    for (int64_t j = 0; j < len; ++j) {
      const __m512 vv = load16(v + (s + j) * vs + d, m);
      for (int g = 0; g < G; ++g)
        acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(e[g * len + j]), vv, acc[g]);
    }
    for (int g = 0; g < G; ++g)
      _mm512_mask_storeu_ps(out + g * D + d, m, _mm512_div_ps(acc[g], _mm512_set1_ps(denom[g])));
  }
}

// One (batch, kv head): its `group` query rows q [group, D] (float32) over positions [s, n) of
// k, v (position 0 of this head, rows `ks` / `vs` elements apart); out [group, D] float32.
// Each key and value row is read once for the whole group (from memory; the later queries'
// passes find it in L1).
template <typename T>
void head_decode(const float* q, const T* k, const T* v, int64_t ks, int64_t vs, int64_t D,
                 int64_t group, int64_t s, int64_t n, const float* slopes, const float* sinks,
                 float scale, float* out, Scratch& w) {
  const int64_t len = n - s;
  w.scores.resize(static_cast<size_t>(group * len));
  w.keys.resize(static_cast<size_t>(16 * D));
  w.denom.resize(static_cast<size_t>(group));
  head_scores(q, k, ks, D, group, s, n, slopes, scale, w);
  for (int64_t g = 0; g < group; ++g) {  // softmax numerators in place, their sums
    float* sc = w.scores.data() + g * len;
    __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < len; j += 16)
      mv = _mm512_mask_max_ps(mv, lanes(len - j), mv,
                              _mm512_maskz_loadu_ps(lanes(len - j), sc + j));
    float mx = _mm512_reduce_max_ps(mv), denom = 0.f;
    if (sinks) {
      mx = std::max(mx, sinks[g]);
      denom = std::exp(sinks[g] - mx);
    }
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < len; j += 16) {
      const __mmask16 m = lanes(len - j);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sc + j), _mm512_set1_ps(mx)));
      sum = _mm512_mask_add_ps(sum, m, sum, e);
      _mm512_mask_storeu_ps(sc + j, m, e);
    }
    w.denom[g] = denom + _mm512_reduce_add_ps(sum);
  }
  // out[g] = sum_j e[g, j] v_j / denom[g], G query rows at a time
  for (int64_t g0 = 0; g0 < group; g0 += 8) {
    const float* e = w.scores.data() + g0 * len;
    float* o = out + g0 * D;
    const float* dn = w.denom.data() + g0;
    switch (std::min<int64_t>(8, group - g0)) {
      case 1: weighted_values<1>(e, v, vs, D, s, len, dn, o); break;
      case 2: weighted_values<2>(e, v, vs, D, s, len, dn, o); break;
      case 3: weighted_values<3>(e, v, vs, D, s, len, dn, o); break;
      case 4: weighted_values<4>(e, v, vs, D, s, len, dn, o); break;
      case 5: weighted_values<5>(e, v, vs, D, s, len, dn, o); break;
      case 6: weighted_values<6>(e, v, vs, D, s, len, dn, o); break;
      case 7: weighted_values<7>(e, v, vs, D, s, len, dn, o); break;
      default: weighted_values<8>(e, v, vs, D, s, len, dn, o); break;
    }
  }
}

// The query tokens of one call: token t's heads are read from q at t * q_step + head * q_head
// (elements) and written to out at t * o_step + head * o_head; it attends to cache row row[t],
// positions [first[t], last[t]) (empty: zeros).
struct Queries {
  int64_t q_step, q_head, o_step, o_head;
  std::vector<int64_t> row, first, last;
};

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Queries& qs,
         const float* slopes, const float* sinks, float scale, at::Tensor& out) {
  const int64_t N = static_cast<int64_t>(qs.row.size()), Hq = q.size(1), D = q.size(3),
                Hkv = k.size(1);
  const int64_t group = Hq / Hkv;
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  // (strides read once: TensorBase::stride is an out-of-line call; the head dimension's is 1)
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2), vs0 = v.stride(0),
                vs1 = v.stride(1), vs2 = v.stride(2);
  // work per task ~ group * len * D: small calls stay on one thread (no fork/join)
  int64_t total = 0;
  for (int64_t t = 0; t < N; ++t) total += qs.last[t] - qs.first[t];
  const int64_t grain = total * group * D * Hkv < (1 << 16) ? N * Hkv : 1;
  at::parallel_for(0, N * Hkv, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(static_cast<size_t>(group * D)), of(static_cast<size_t>(group * D));
    Scratch scratch;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / Hkv, h = task % Hkv, s = qs.first[t], n = qs.last[t],
                    r = qs.row[t];
      T* o = op + t * qs.o_step + h * group * qs.o_head;
      if (n <= s) {
        for (int64_t g = 0; g < group; ++g)
          std::fill(o + g * qs.o_head, o + g * qs.o_head + D, T(0.f));
        continue;
      }
      const T* qt = qp + t * qs.q_step + h * group * qs.q_head;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = as_float(qt[g * qs.q_head + d]);
      head_decode<T>(qf.data(), kp + r * ks0 + h * ks1, vp + r * vs0 + h * vs1, ks2, vs2, D, group,
                     s, n, slopes ? slopes + h * group : nullptr,
                     sinks ? sinks + h * group : nullptr, scale, of.data(), scratch);
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < D; ++d) o[g * qs.o_head + d] = static_cast<T>(of[g * D + d]);
    }
  });
}

at::Tensor float_heads(const std::optional<at::Tensor>& t, const char* name, int64_t Hq) {
  if (!t.has_value() || !t->defined()) return at::Tensor();
  TORCH_CHECK(t->numel() == Hq && t->device().is_cpu(), "cpu_attention_decode: ", name,
              " must hold one value per query head (", Hq, ") on the CPU");
  return t->to(at::kFloat).contiguous().reshape({Hq});
}

// What both ops need of their inputs beyond the shapes (the caller checked q's and the caches').
void check_common(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  std::optional<int64_t> window, const std::optional<at::Tensor>& alibi_slopes,
                  const std::optional<at::Tensor>& sinks, const char* op) {
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, op, ": q_heads (", q.size(1),
              ") must be a multiple of kv_heads (", k.size(1), ")");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), op,
              ": q, k and v must share a dtype");
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, op,
              ": dtype must be float32, bfloat16 or float16, got ", dt);
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), op,
              ": tensors must be on the CPU");
  TORCH_CHECK(!window.has_value() || *window >= 1, op, ": window must be >= 1");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1 && q.stride(3) == 1, op,
              ": the head dimension must be contiguous");
  const bool has_sinks = sinks.has_value() && sinks->defined();
  const bool has_alibi = alibi_slopes.has_value() && alibi_slopes->defined();
  TORCH_CHECK(!(has_sinks && has_alibi), op, ": sinks with ALiBi are not supported");
}

// run<T> for q's dtype, with the per-head options as float32 [Hq] and the scale resolved.
void run_typed(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Queries& qs,
               const std::optional<at::Tensor>& alibi_slopes, std::optional<double> scale,
               const std::optional<at::Tensor>& sinks, at::Tensor& out) {
  const int64_t Hq = q.size(1), D = q.size(3);
  const at::Tensor sl = float_heads(alibi_slopes, "alibi_slopes", Hq);
  const at::Tensor sk = float_heads(sinks, "sinks", Hq);
  const float sc = scale.has_value() ? static_cast<float>(*scale)
                                     : 1.f / std::sqrt(static_cast<float>(D));
  const float* slp = sl.defined() ? sl.data_ptr<float>() : nullptr;
  const float* skp = sk.defined() ? sk.data_ptr<float>() : nullptr;
  switch (q.scalar_type()) {
    case at::kFloat: run<float>(q, k, v, qs, slp, skp, sc, out); break;
    case at::kBFloat16: run<c10::BFloat16>(q, k, v, qs, slp, skp, sc, out); break;
    default: run<c10::Half>(q, k, v, qs, slp, skp, sc, out); break;
  }
}

at::Tensor cpu_attention_decode(const at::Tensor& q, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& lengths,
                                const std::optional<at::Tensor>& starts,
                                const std::optional<at::Tensor>& alibi_slopes,
                                std::optional<double> scale, std::optional<int64_t> window,
                                const std::optional<at::Tensor>& sinks) {
  check_args(q, k_cache, v_cache, lengths, starts);
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(3), T = k_cache.size(2);
  check_common(q, k_cache, v_cache, window, alibi_slopes, sinks, "cpu_attention_decode");
  const at::Tensor len_c = lengths.contiguous();
  at::Tensor start_c;
  if (starts.has_value() && starts->defined()) start_c = starts->contiguous();
  Queries qs{q.stride(0), q.stride(1), Hq * D, D, std::vector<int64_t>(B),
             std::vector<int64_t>(B), std::vector<int64_t>(B)};
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = read_index(len_c, b), s = start_c.defined() ? read_index(start_c, b) : 0;
    TORCH_CHECK(0 <= s && s <= n && n <= T, "cpu_attention_decode needs 0 <= starts <= lengths <= "
                "max_tokens=", T, "; got (start, length) (", s, ", ", n, ") at row ", b);
    qs.row[b] = b;
    qs.first[b] = window.has_value() ? std::max(s, n - *window) : s;
    qs.last[b] = n;
  }
  at::Tensor out = at::empty({B, Hq, 1, D}, q.options());
  run_typed(q, k_cache, v_cache, qs, alibi_slopes, scale, sinks, out);
  return out;
}

// The prompt chunks of a captured mixed step (shardwise.inject.slots.PackedRows): q [1, Hq, C, D]
// (the chunks' tokens in packed order, then padding), the layer's caches [rows, Hkv, T, D] with
// the chunks already written, spans [n, 3] int64 (slot, past, count) per chunk (count 0: none).
// Token i of a chunk attends to its slot's positions [0, past + i] (a window: the last `window`
// of them), as a decode query at length past + i + 1; padding tokens give zeros. The reference
// is attention_chunks (shardwise.kernels.reference.attention).
at::Tensor cpu_chunk_attention(const at::Tensor& q, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, const at::Tensor& spans,
                               const std::optional<at::Tensor>& alibi_slopes,
                               std::optional<double> scale, std::optional<int64_t> window,
                               const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 4 && q.size(0) == 1 && k_cache.dim() == 4 &&
                  k_cache.sizes() == v_cache.sizes() && q.size(3) == k_cache.size(3),
              "cpu_chunk_attention takes q [1, q_heads, tokens, d] and caches [rows, kv_heads, "
              "max_tokens, d]; got q ", q.sizes(), ", k ", k_cache.sizes(), ", v ",
              v_cache.sizes());
  check_common(q, k_cache, v_cache, window, alibi_slopes, sinks, "cpu_chunk_attention");
  TORCH_CHECK(spans.dim() == 2 && spans.size(1) == 3 && spans.scalar_type() == at::kLong &&
                  spans.device().is_cpu(),
              "cpu_chunk_attention: spans must be an int64 CPU tensor [chunks, 3], got ",
              spans.sizes(), " ", spans.scalar_type());
  const int64_t Hq = q.size(1), C = q.size(2), D = q.size(3), R = k_cache.size(0),
                T = k_cache.size(2);
  Queries qs{q.stride(2), q.stride(1), D, C * D, std::vector<int64_t>(C, 0),
             std::vector<int64_t>(C, 0), std::vector<int64_t>(C, 0)};
  const at::Tensor sp = spans.contiguous();
  const int64_t* span = sp.data_ptr<int64_t>();
  int64_t at_token = 0;
  for (int64_t c = 0; c < sp.size(0); ++c) {
    const int64_t slot = span[3 * c], past = span[3 * c + 1], count = span[3 * c + 2];
    if (count == 0) continue;
    TORCH_CHECK(0 <= slot && slot < R && past >= 0 && count > 0 && past + count <= T &&
                    at_token + count <= C,
                "cpu_chunk_attention: chunk ", c, " (slot ", slot, ", past ", past, ", count ",
                count, ") does not fit ", R, " rows of ", T, " positions and ", C, " tokens");
    for (int64_t i = 0; i < count; ++i, ++at_token) {
      const int64_t n = past + i + 1;
      qs.row[at_token] = slot;
      qs.first[at_token] = window.has_value() ? std::max<int64_t>(0, n - *window) : 0;
      qs.last[at_token] = n;
    }
  }
  at::Tensor out = at::empty({1, Hq, C, D}, q.options());
  run_typed(q, k_cache, v_cache, qs, alibi_slopes, scale, sinks, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(shardwise_native, m) {
  m.def("cpu_attention_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor lengths, "
        "Tensor? starts, Tensor? alibi_slopes, float? scale, int? window, Tensor? sinks) -> Tensor");
  m.def("cpu_chunk_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor spans, "
        "Tensor? alibi_slopes, float? scale, int? window, Tensor? sinks) -> Tensor");
}

TORCH_LIBRARY_IMPL(shardwise_native, CPU, m) {
  m.impl("cpu_attention_decode", &cpu_attention_decode);
  m.impl("cpu_chunk_attention", &cpu_chunk_attention);
}
