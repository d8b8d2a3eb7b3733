// Small AVX512 pieces shared by the native CPU ops: the weight-stream prefetch of the linears
// (quant.cpp, half.cpp) and the narrowing of floats to bf16/fp16 (half.cpp, elementwise.cpp).
#pragma once

#include <immintrin.h>

#include <cstdint>

// How far ahead of its loads a linear's weight stream is prefetched (compile-time; an A/B build:
// SHARDWISE_CPU_NATIVE_CFLAGS=-DSHARDWISE_PREFETCH_BYTES=N, 0 for none).
#ifndef SHARDWISE_PREFETCH_BYTES
#define SHARDWISE_PREFETCH_BYTES 2048
#endif

namespace shardwise_native {

// Prefetch into L1 the line PREFETCH_BYTES past p, a weight vector about to be loaded. The
// weights of a decode step are read once from DRAM, and with one or two threads the hardware
// prefetchers alone kept too few lines in flight: on a 2-core Xeon the 1.7B's int4 step read
// 19.7 GB/s without it and 25.6 with it, the copy probe being 25 (benchmarks/README.md). Past
// the end of a thread's range it touches a line it will not use: harmless.
inline void prefetch_weights(const void* p) {
  if constexpr (SHARDWISE_PREFETCH_BYTES > 0)
    _mm_prefetch(static_cast<const char*>(p) + SHARDWISE_PREFETCH_BYTES, _MM_HINT_T0);
}

// 16 floats -> 16 half-width values, rounded as c10's scalar conversions round them.

// to bf16: round to nearest even (bf16 is the high half of a float); NaN to the quiet NaN
// 0x7FC0, as c10::BFloat16's conversion
inline __m256i narrow_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

// to fp16: the hardware conversion (AVX512F vcvtps2ph), round to nearest even
inline __m256i narrow_f16(__m512 v) {
  return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// exp of 16 floats to ~1 ulp: x = n ln2 + r (ln2 in two parts, |r| <= ln2 / 2), exp(r) by its
// degree-7 Taylor polynomial (truncation < 6e-9 relative), times 2^n by vscalefps (inf past
// the float range, 0 below it; NaN stays NaN).
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(89.f), _mm512_max_ps(_mm512_set1_ps(-104.f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// Lane j of the result: the sum of the 16 lanes of v[j] (16 horizontal sums at once: 15 adds
// and 31 shuffles, where 16 separate reductions take about 4 times as many operations).
inline __m512 hsum16(const __m512 v[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // 256-bit halves: quarters 0-1 of a[i] from v[2i], 2-3 from v[2i+1]
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // quarter q of b[i]: 4 partial sums of v[4i + q]
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i) {  // quarter q of c[i]: 2 partials of v[8i + q], 2 of v[8i + 4 + q]
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // lane 4q + e: the sum of v[q + 4e]; permuted so that lane j holds v[j]'s
  const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, s);
}

}  // namespace shardwise_native
