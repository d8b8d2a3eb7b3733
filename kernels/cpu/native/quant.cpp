// shardwise CPU weight-only quantized linear with 8-bit activations and AVX512-VNNI dot products.
//
// Registered as the torch op ``shardwise_native::cpu_qlinear`` (the fake/meta impl lives in Python,
// shardwise.kernels.cpu.native). Built by torch.utils.cpp_extension at first use with explicit
// -mavx512f -mavx512bw -mavx512vl -mavx512vnni (the loader checks the CPU has them).
//
// Layout (made by shardwise.kernels.cpu.quant._pack_native; Nb = ceil(N / 16)):
//   qweight uint8 [Nb, K / KB, 16, 4]: for each block of 16 output rows, K in steps of KB, one
//     64-byte vector per step holding 4 bytes per row (row r = dword lane r).
//     bits 8: KB = 4, byte j of lane r = q[r, k + j] + 128.
//     bits 4: KB = 8, byte j of lane r = (q[r, k + j] + 8) | (q[r, k + 4 + j] + 8) << 4.
//   scales float32 [Nb, G, 16]; zeros float32 [Nb, G, 16] or undefined (symmetric): the weight
//     is (q - zero) * scale, so with the stored unsigned u = q + OFF (OFF 128 / 8):
//     w = (u - (OFF + zero)) * scale.
// Activations x [M, K] (float32 / bfloat16 / float16) are quantized per block of ``ablock``
// columns (ablock divides the group) to int8: d = amax / 127, q = round_half_even(x * (127 /
// amax)) (0 when amax = 0). Then, per row m, output n, group g:
//   y[m, n] = sum_g scale[n, g] * (sum_{b in g} d[m, b] * float(sum_{k in b} u[n, k] q[m, k]))
//             - scale[n, g] * (OFF + zero[n, g]) * A[m, g],
//   A[m, g] = sum_{b in g} d[m, b] * float(sum_{k in b} q[m, k])
// (+ bias in float32), returned in x's dtype. The torch oracle of exactly this math is
// shardwise.kernels.reference.quant.int8_activation_linear.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "scratch.h"
#include "simd.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <limits>

// 4 activation bytes as one int32 for a broadcast (memcpy: no aliasing or alignment assumption)
static inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

namespace {

constexpr int ROWS = 16;  // output rows per 64-byte weight vector (one int32 lane each)

// x row [K] float -> q [K] int8, d [K / ablock], isum-scaled A per group [K / group].
void quantize_row(const float* x, int64_t K, int64_t ablock, int64_t group, int8_t* q,
                  float* d, float* A) {
  const int64_t nblocks = K / ablock, per_group = group / ablock;
  for (int64_t b = 0; b < nblocks; ++b) {
    const float* xb = x + b * ablock;
    int8_t* qb = q + b * ablock;
    float amax = 0.f;
    bool nan = false;  // max ignores NaN: a NaN activation makes its block's scale NaN instead
    int64_t i = 0;
    if (ablock % 16 == 0) {
      __m512 mx = _mm512_setzero_ps();
      __mmask16 unordered = 0;
      for (; i < ablock; i += 16) {
        const __m512 v = _mm512_loadu_ps(xb + i);
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        mx = _mm512_max_ps(mx, _mm512_abs_ps(v));
      }
      amax = _mm512_reduce_max_ps(mx);
      nan = unordered != 0;
    } else {
      for (; i < ablock; ++i) {
        nan = nan || std::isnan(xb[i]);
        amax = std::fmax(amax, std::fabs(xb[i]));
      }
    }
    const float scale = nan ? std::numeric_limits<float>::quiet_NaN() : amax / 127.f;
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t isum = 0;
    if (ablock % 16 == 0) {
      const __m512 vinv = _mm512_set1_ps(inv);
      __m512i vs = _mm512_setzero_si512();
      for (i = 0; i < ablock; i += 16) {
        __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + i), vinv));  // RNE
        vs = _mm512_add_epi32(vs, qi);
        _mm512_mask_cvtepi32_storeu_epi8(qb + i, 0xFFFF, qi);
      }
      isum = _mm512_reduce_add_epi32(vs);
    } else {
      for (i = 0; i < ablock; ++i) {
        int32_t qi = static_cast<int32_t>(std::nearbyint(xb[i] * inv));
        qb[i] = static_cast<int8_t>(qi);
        isum += qi;
      }
    }
    d[b] = scale;
    if (b % per_group == 0) A[b / per_group] = 0.f;
    A[b / per_group] += scale * static_cast<float>(isum);
  }
}

// Integer dot products of one activation block (AB columns; AB = 0: ``ablock`` at run time)
// for MB activation rows against 16 weight rows, accumulated in NA independent chains per row
// (dpbusd's latency, not the loads, bounds one chain), summed into iacc[MB].
template <int MB, int BITS, int AB>
inline const uint8_t* block_dots(const uint8_t* w, const int8_t* aq, int64_t lda, int64_t k,
                                 int64_t ablock, __m512i* iacc) {
  constexpr int KB = BITS == 8 ? 4 : 8;  // k columns per 64-byte weight vector
  constexpr int NA = MB == 1 ? 4 : (MB == 2 ? 2 : 1);
  const __m512i nib = _mm512_set1_epi8(0x0F);
  __m512i part[MB][NA];
  for (int m = 0; m < MB; ++m)
    for (int c = 0; c < NA; ++c) part[m][c] = _mm512_setzero_si512();
  const int64_t steps = (AB ? AB : ablock) / KB;
  // With AB fixed the loop is unrolled, so the chain index (step * 2 + half) % NA is constant.
#pragma GCC unroll 16
  for (int64_t s = 0; s < steps; ++s) {
    const __m512i wv = _mm512_loadu_si512(w + s * 64);
    shardwise_native::prefetch_weights(w + s * 64);
    const int64_t kk = k + s * KB;
    if constexpr (BITS == 8) {
      for (int m = 0; m < MB; ++m) {
        const __m512i av = _mm512_set1_epi32(load4(aq + m * lda + kk));
        const int c = AB ? static_cast<int>(s % NA) : 0;
        part[m][c] = _mm512_dpbusd_epi32(part[m][c], wv, av);
      }
    } else {
      const __m512i lo = _mm512_and_si512(wv, nib);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), nib);
      for (int m = 0; m < MB; ++m) {
        const int8_t* a = aq + m * lda + kk;
        const int c0 = AB ? static_cast<int>((2 * s) % NA) : 0;
        const int c1 = AB ? static_cast<int>((2 * s + 1) % NA) : 0;
        part[m][c0] = _mm512_dpbusd_epi32(part[m][c0], lo, _mm512_set1_epi32(load4(a)));
        part[m][c1] = _mm512_dpbusd_epi32(part[m][c1], hi, _mm512_set1_epi32(load4(a + 4)));
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    __m512i sum = part[m][0];
    for (int c = 1; c < NA; ++c) sum = _mm512_add_epi32(sum, part[m][c]);
    iacc[m] = sum;
  }
  return w + steps * 64;
}

// One block of 16 output rows for MB activation rows. w: this row block's bytes; sc/zr: its
// [G, 16] scales / zeros (zr null when symmetric); aq [MB][lda] int8, ad [MB][nblocks],
// aA [MB][G]; ``out`` (OutF32 / OutBF16) at this row block's first column and first row,
// ``valid`` columns written (+ its bias, when it has one).
template <int MB, int BITS, int AB, typename Out>
inline void row_block(const uint8_t* w, const float* sc, const float* zr, const int8_t* aq,
                      int64_t lda, const float* ad, int64_t ldd, const float* aA, int64_t ldA,
                      int64_t K, int64_t group, int64_t ablock, Out out, int valid) {
  constexpr float OFF = BITS == 8 ? 128.f : 8.f;
  const int64_t G = K / group, per_group = group / ablock;
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  int64_t k = 0, b = 0;
  for (int64_t g = 0; g < G; ++g) {
    __m512 gacc[MB];
    for (int m = 0; m < MB; ++m) gacc[m] = _mm512_setzero_ps();
    for (int64_t bb = 0; bb < per_group; ++bb, ++b, k += ablock) {
      __m512i iacc[MB];
      w = block_dots<MB, BITS, AB>(w, aq, lda, k, ablock, iacc);
      for (int m = 0; m < MB; ++m)
        gacc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[m]), _mm512_set1_ps(ad[m * ldd + b]), gacc[m]);
    }
    const __m512 s = _mm512_loadu_ps(sc + g * ROWS);
    const __m512 off = zr ? _mm512_add_ps(_mm512_set1_ps(OFF), _mm512_loadu_ps(zr + g * ROWS))
                          : _mm512_set1_ps(OFF);
    const __m512 sz = _mm512_mul_ps(s, off);
    for (int m = 0; m < MB; ++m) {
      acc[m] = _mm512_fmadd_ps(s, gacc[m], acc[m]);
      acc[m] = _mm512_fnmadd_ps(sz, _mm512_set1_ps(aA[m * ldA + g]), acc[m]);
    }
  }
  const __mmask16 mask = valid >= ROWS ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
  if (out.bias) {
    const __m512 bv = _mm512_maskz_loadu_ps(mask, out.bias);
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_add_ps(acc[m], bv);
  }
  for (int m = 0; m < MB; ++m) out.store(m, acc[m], mask);
}

template <int BITS, typename Out>
void run_rows(int64_t rows, const uint8_t* w, const float* sc, const float* zr, const int8_t* aq,
              int64_t lda, const float* ad, int64_t ldd, const float* aA, int64_t ldA, int64_t K,
              int64_t group, int64_t ablock, Out out, int valid) {
  // Rows of activations in chunks of 8 / 4 / 2 / 1, each reusing every loaded weight vector;
  // the row block's weights (16 x K bytes or half) stay in L1/L2 between chunks.
  int64_t m = 0;
#define SW_CHUNK(MB)                                                                          \
  for (; m + MB <= rows; m += MB) {                                                           \
    if (ablock == 32)                                                                         \
      row_block<MB, BITS, 32>(w, sc, zr, aq + m * lda, lda, ad + m * ldd, ldd, aA + m * ldA,  \
                              ldA, K, group, ablock, out.at_row(m), valid);                   \
    else if (ablock == 16)                                                                    \
      row_block<MB, BITS, 16>(w, sc, zr, aq + m * lda, lda, ad + m * ldd, ldd, aA + m * ldA,  \
                              ldA, K, group, ablock, out.at_row(m), valid);                   \
    else                                                                                      \
      row_block<MB, BITS, 0>(w, sc, zr, aq + m * lda, lda, ad + m * ldd, ldd, aA + m * ldA,   \
                             ldA, K, group, ablock, out.at_row(m), valid);                    \
  }
  SW_CHUNK(8)
  SW_CHUNK(4)
  SW_CHUNK(2)
  SW_CHUNK(1)
#undef SW_CHUNK
}

// Output writers for 16 columns of row m: float32 as is, bfloat16 rounded to nearest even
// (NaN to the quiet NaN 0x7FC0), as c10::BFloat16's conversion does. ``bias``: float32 at this
// row block's first column (null: none); ``p`` at this row block's first column of row 0.
struct OutF32 {
  float* p;
  int64_t ld;
  const float* bias;
  OutF32 at_row(int64_t m) const { return {p + m * ld, ld, bias}; }
  inline void store(int m, __m512 v, __mmask16 mask) const {
    _mm512_mask_storeu_ps(p + m * ld, mask, v);
  }
};

struct OutBF16 {
  uint16_t* p;
  int64_t ld;
  const float* bias;
  OutBF16 at_row(int64_t m) const { return {p + m * ld, ld, bias}; }
  inline void store(int m, __m512 v, __mmask16 mask) const {
    _mm256_mask_storeu_epi16(p + m * ld, mask, shardwise_native::narrow_bf16(v));
  }
};

// bf16 [count] -> float (the high half of the bits)
inline void bf16_to_float(const uint16_t* src, int64_t count, float* dst) {
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) {
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(src + i)));
    _mm512_storeu_si512(dst + i, _mm512_slli_epi32(v, 16));
  }
  for (; i < count; ++i) {
    const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(dst + i, &bits, sizeof(bits));
  }
}

using shardwise_native::scratch_bytes;

at::Tensor cpu_qlinear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& zeros, const std::optional<at::Tensor>& bias,
                       int64_t bits, int64_t group, int64_t ablock, int64_t n) {
  TORCH_CHECK(x.dim() == 2, "cpu_qlinear: x must be [M, K]");
  TORCH_CHECK(bits == 8 || bits == 4, "cpu_qlinear: bits must be 8 or 4");
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.is_contiguous(),
              "cpu_qlinear: qweight must be contiguous uint8");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "cpu_qlinear: scales must be contiguous float32");
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t KB = bits == 8 ? 4 : 8;
  TORCH_CHECK(group > 0 && K % group == 0 && ablock > 0 && group % ablock == 0 && ablock % KB == 0,
              "cpu_qlinear: K ", K, ", group ", group, ", ablock ", ablock, " do not fit");
  const int64_t nb = (n + ROWS - 1) / ROWS, G = K / group, nblocks = K / ablock;
  TORCH_CHECK(qweight.numel() == nb * K / KB * 64, "cpu_qlinear: qweight has the wrong size");
  TORCH_CHECK(scales.numel() == nb * G * ROWS, "cpu_qlinear: scales has the wrong size");
  const float* zr = nullptr;
  at::Tensor z;
  if (zeros.has_value() && zeros->defined()) {
    z = zeros->contiguous();
    TORCH_CHECK(z.scalar_type() == at::kFloat && z.numel() == scales.numel(),
                "cpu_qlinear: zeros must be float32 like scales");
    zr = z.data_ptr<float>();
  }
  // Scratch (per thread, reused): the block scales d [M, nblocks] and group sums A [M, G]
  // (float), the bias as float [N] when it is not float32, the float rows of a non-float32 x
  // [M, K], then the int8 activations [M, K].
  const auto xt = x.scalar_type();
  const bool is_float = xt == at::kFloat, is_bf16 = xt == at::kBFloat16;
  const at::Tensor xc = x.contiguous();
  const bool has_bias = bias.has_value() && bias->defined();
  at::Tensor bias_c;
  if (has_bias) {
    TORCH_CHECK(bias->numel() == n, "cpu_qlinear: bias must have ", n, " elements");
    bias_c = bias->contiguous();
  }
  const bool bias_float = has_bias && bias_c.scalar_type() == at::kFloat;
  const int64_t bias_floats = has_bias && !bias_float ? (n + 15) / 16 * 16 : 0;
  const int64_t row_floats = is_float ? 0 : M * K;
  const int64_t floats = M * (nblocks + G) + bias_floats + row_floats;
  float* adp = reinterpret_cast<float*>(scratch_bytes(floats * 4 + M * K));
  float* aAp = adp + M * nblocks;
  float* bfp = aAp + M * G;
  float* rows = bfp + bias_floats;
  int8_t* aqp = reinterpret_cast<int8_t*>(adp + floats);
  const float* biasp = nullptr;
  if (has_bias) {
    if (bias_float) {
      biasp = bias_c.data_ptr<float>();
    } else if (bias_c.scalar_type() == at::kBFloat16) {
      bf16_to_float(reinterpret_cast<const uint16_t*>(bias_c.data_ptr()), n, bfp);
      biasp = bfp;
    } else {
      at::from_blob(bfp, {n}, x.options().dtype(at::kFloat)).copy_(bias_c);
      biasp = bfp;
    }
  }
  if (!is_float && !is_bf16)  // e.g. float16: torch converts, once for all rows
    at::from_blob(rows, {M, K}, x.options().dtype(at::kFloat)).copy_(xc);
  // quantize the activation rows (in parallel for prefill-sized batches)
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* xr;
      if (is_float) {
        xr = xc.data_ptr<float>() + m * K;
      } else if (is_bf16) {
        bf16_to_float(reinterpret_cast<const uint16_t*>(xc.data_ptr()) + m * K, K, rows + m * K);
        xr = rows + m * K;
      } else {
        xr = rows + m * K;
      }
      quantize_row(xr, K, ablock, group, aqp + m * K, adp + m * nblocks, aAp + m * G);
    }
  });

  // The output in x's dtype: float32 and bfloat16 written by the kernel, another dtype
  // through a float32 result.
  const bool direct = is_float || is_bf16;
  at::Tensor out = at::empty({M, n}, x.options().dtype(direct ? xt : at::kFloat));
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const int64_t wblock = K / KB * 64;  // bytes per row block
  auto run = [&](auto out0) {
    at::parallel_for(0, nb, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int valid = static_cast<int>(std::min<int64_t>(ROWS, n - r * ROWS));
        const float* zb = zr ? zr + r * G * ROWS : nullptr;
        auto o = out0;
        o.p += r * ROWS;
        o.bias = biasp ? biasp + r * ROWS : nullptr;
        if (bits == 8)
          run_rows<8>(M, wp + r * wblock, sp + r * G * ROWS, zb, aqp, K, adp, nblocks, aAp, G,
                      K, group, ablock, o, valid);
        else
          run_rows<4>(M, wp + r * wblock, sp + r * G * ROWS, zb, aqp, K, adp, nblocks, aAp, G,
                      K, group, ablock, o, valid);
      }
    });
  };
  if (is_bf16)
    run(OutBF16{reinterpret_cast<uint16_t*>(out.data_ptr()), n, nullptr});
  else
    run(OutF32{out.data_ptr<float>(), n, nullptr});
  return direct ? out : out.to(xt);
}

// How many threads an at::parallel_for over ``tasks`` items runs on in this library (the
// build check: compiled without OpenMP, ATen's parallel_for is a serial loop, 1).
int64_t parallel_threads(int64_t tasks) {
  std::atomic<uint64_t> seen{0};
  at::parallel_for(0, tasks, 1, [&](int64_t, int64_t) {
    seen.fetch_or(uint64_t{1} << std::min(at::get_thread_num(), 63));
  });
  return __builtin_popcountll(seen.load());
}

}  // namespace

TORCH_LIBRARY(shardwise_native, m) {
  m.def("cpu_qlinear(Tensor x, Tensor qweight, Tensor scales, Tensor? zeros, Tensor? bias, "
        "int bits, int group, int ablock, int n) -> Tensor");
  m.def("parallel_threads(int tasks) -> int", &parallel_threads);
}

TORCH_LIBRARY_IMPL(shardwise_native, CPU, m) { m.impl("cpu_qlinear", &cpu_qlinear); }
