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

}  // namespace shardwise_native
