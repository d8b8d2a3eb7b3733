// shardwise CPU linear over a 16-bit (bfloat16 / float16) weight in column blocks, for the
// small row counts of decode steps: it streams the weight once at about the copy bandwidth.
//
// Registered as ``shardwise_native::cpu_blocked_linear`` (fake impl in Python:
// shardwise.kernels.cpu.native). The torch oracle of exactly this math is
// shardwise.kernels.reference.linear.blocked_linear.
//
// Layout (shardwise.accelerators.cpu_blocked_layout.block_weight; the fp32 decode layout):
//   blocked [Nb, K, 32]: block j holds output columns [32 j, 32 j + 32) (the last block
//   zero-padded), one 64-byte vector of 32 16-bit values per input feature k, so a row block's
//   weights are one contiguous stream and each vector is used against a broadcast x[m, k].
// Math, per row m and output column n:
//   y[m, n] = round_to_dtype(sum_k float(x[m, k]) * float(w[n, k]) + float(bias[n]))
// products and sums in float32 (16-bit x 16-bit products are exact there), the bias added in
// float32, rounded once to nearest even (as F.linear / oneDNN's 16-bit GEMMs; only the order of
// the sum differs).
// Why not ATen: its 16-bit GEMV and small-M GEMMs read the plain [N, K] weight at well under
// the copy bandwidth (benchmarks/README.md, "bf16 decode on the CPU").

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>

namespace {

constexpr int BLOCK = 32;  // output columns per block: one 64-byte vector of 16-bit values

// 32 bf16 columns at one k -> two float vectors. bf16 is the high half of a float, so a 32-bit
// lane (columns 2i, 2i + 1) gives column 2i by a left shift and column 2i + 1 by masking:
// ``a`` holds the even columns, ``b`` the odd ones (interleaved back at the store).
struct BF16 {
  using Scalar = c10::BFloat16;
  static constexpr bool kInterleaved = true;
  static inline void widen(const uint16_t* w, __m512& a, __m512& b) {
    const __m512i v = _mm512_loadu_si512(w);
    a = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    b = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  // 16 floats -> 16 bf16, rounded to nearest even (NaN to the quiet NaN 0x7FC0, as
  // c10::BFloat16's conversion does)
  static inline __m256i narrow(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
  }
};

// float16: columns 0-15 and 16-31 converted by the hardware (AVX512F vcvtph2ps / vcvtps2ph).
struct F16 {
  using Scalar = c10::Half;
  static constexpr bool kInterleaved = false;
  static inline void widen(const uint16_t* w, __m512& a, __m512& b) {
    a = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
    b = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16)));
  }
  static inline __m256i narrow(__m512 v) {
    return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
};

// Rows [0, MB) of x (float [MB][K], row stride K) against one block's weights w [K][32]:
// out[m][0..valid) = the float sums (+ bias, float [32] or null), narrowed to 16 bits.
// One row keeps two chains per vector (FMA latency, not the loads, bounds a single chain).
template <typename T, int MB>
inline void block_rows(const uint16_t* w, const float* x, int64_t K, const float* bias,
                       uint16_t* out, int64_t ldo, int valid) {
  constexpr int C = MB == 1 ? 2 : 1;
  __m512 acc_a[MB][C], acc_b[MB][C];
  for (int m = 0; m < MB; ++m)
    for (int c = 0; c < C; ++c) acc_a[m][c] = acc_b[m][c] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + C <= K; k += C) {
#pragma GCC unroll 2
    for (int c = 0; c < C; ++c) {
      __m512 a, b;
      T::widen(w + (k + c) * BLOCK, a, b);
#pragma GCC unroll 8
      for (int m = 0; m < MB; ++m) {
        const __m512 xv = _mm512_set1_ps(x[m * K + k + c]);
        acc_a[m][c] = _mm512_fmadd_ps(a, xv, acc_a[m][c]);
        acc_b[m][c] = _mm512_fmadd_ps(b, xv, acc_b[m][c]);
      }
    }
  }
  for (; k < K; ++k) {  // odd K with two chains
    __m512 a, b;
    T::widen(w + k * BLOCK, a, b);
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * K + k]);
      acc_a[m][0] = _mm512_fmadd_ps(a, xv, acc_a[m][0]);
      acc_b[m][0] = _mm512_fmadd_ps(b, xv, acc_b[m][0]);
    }
  }
  // even/odd columns back to 0..15 and 16..31
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  const __mmask16 m0 = valid >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
  const __mmask16 m1 = valid >= 32 ? 0xFFFF
                       : valid <= 16 ? 0 : static_cast<__mmask16>((1u << (valid - 16)) - 1);
  for (int m = 0; m < MB; ++m) {
    __m512 a = acc_a[m][0], b = acc_b[m][0];
    for (int c = 1; c < C; ++c) {
      a = _mm512_add_ps(a, acc_a[m][c]);
      b = _mm512_add_ps(b, acc_b[m][c]);
    }
    __m512 c0 = a, c1 = b;  // columns 0..15, 16..31
    if constexpr (T::kInterleaved) {
      c0 = _mm512_permutex2var_ps(a, lo, b);
      c1 = _mm512_permutex2var_ps(a, hi, b);
    }
    if (bias) {
      c0 = _mm512_add_ps(c0, _mm512_maskz_loadu_ps(m0, bias));
      c1 = _mm512_add_ps(c1, _mm512_maskz_loadu_ps(m1, bias + 16));
    }
    uint16_t* o = out + m * ldo;
    _mm256_mask_storeu_epi16(o, m0, T::narrow(c0));
    _mm256_mask_storeu_epi16(o + 16, m1, T::narrow(c1));
  }
}

// Per-thread float scratch that only grows (decode calls this hundreds of times a step).
float* scratch_floats(int64_t count) {
  struct Buffer {
    void* p = nullptr;
    int64_t size = 0;
    ~Buffer() { std::free(p); }
  };
  static thread_local Buffer buf;
  const int64_t bytes = count * 4;
  if (buf.size < bytes) {
    std::free(buf.p);
    const int64_t size = (bytes + 4095) / 4096 * 4096;
    buf.p = std::aligned_alloc(64, size);
    TORCH_CHECK(buf.p != nullptr, "cpu_blocked_linear: cannot allocate ", size, " scratch bytes");
    buf.size = size;
  }
  return static_cast<float*>(buf.p);
}

template <typename T>
void run(const at::Tensor& x, const at::Tensor& w, const float* bias, int64_t n, at::Tensor& out,
         float* xf) {
  using S = typename T::Scalar;
  const int64_t M = x.size(0), K = x.size(1), nb = w.size(0);
  const S* xs = x.data_ptr<S>();
  for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(xs[i]);
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, nb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int valid = static_cast<int>(std::min<int64_t>(BLOCK, n - r * BLOCK));
      const uint16_t* wr = wp + r * K * BLOCK;
      const float* br = bias ? bias + r * BLOCK : nullptr;
      uint16_t* orow = op + r * BLOCK;
      // rows in chunks of 8 / 4 / 2 / 1, each reusing the block (16-64 KiB per 1k of K: L2)
      int64_t m = 0;
      for (; m + 8 <= M; m += 8) block_rows<T, 8>(wr, xf + m * K, K, br, orow + m * n, n, valid);
      for (; m + 4 <= M; m += 4) block_rows<T, 4>(wr, xf + m * K, K, br, orow + m * n, n, valid);
      for (; m + 2 <= M; m += 2) block_rows<T, 2>(wr, xf + m * K, K, br, orow + m * n, n, valid);
      for (; m < M; ++m) block_rows<T, 1>(wr, xf + m * K, K, br, orow + m * n, n, valid);
    }
  });
}

at::Tensor cpu_blocked_linear(const at::Tensor& x, const at::Tensor& blocked,
                              const std::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.dim() == 2, "cpu_blocked_linear: x must be [M, K]");
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kBFloat16 || dt == at::kHalf,
              "cpu_blocked_linear: x must be bfloat16 or float16");
  TORCH_CHECK(blocked.scalar_type() == dt && blocked.dim() == 3 && blocked.size(2) == BLOCK &&
                  blocked.is_contiguous(),
              "cpu_blocked_linear: the weight must be contiguous [Nb, K, 32] in x's dtype");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(blocked.size(1) == K, "cpu_blocked_linear: x has ", K,
              " features, the weight ", blocked.size(1));
  TORCH_CHECK(n > 0 && (n + BLOCK - 1) / BLOCK == blocked.size(0),
              "cpu_blocked_linear: ", n, " outputs do not fit ", blocked.size(0), " blocks");
  const at::Tensor xc = x.contiguous();
  // scratch: x as float [M, K], then the bias as float [Nb * 32] (zero-padded)
  const int64_t padded = blocked.size(0) * BLOCK;
  const bool has_bias = bias.has_value() && bias->defined();
  float* xf = scratch_floats(M * K + (has_bias ? padded : 0));
  float* bf = nullptr;
  if (has_bias) {
    TORCH_CHECK(bias->numel() == n, "cpu_blocked_linear: bias must have ", n, " elements");
    bf = xf + M * K;
    const at::Tensor b = bias->to(at::kFloat).contiguous();
    std::copy(b.data_ptr<float>(), b.data_ptr<float>() + n, bf);
    std::fill(bf + n, bf + padded, 0.f);
  }
  at::Tensor out = at::empty({M, n}, x.options());
  if (M == 0) return out;
  if (dt == at::kBFloat16)
    run<BF16>(xc, blocked, bf, n, out, xf);
  else
    run<F16>(xc, blocked, bf, n, out, xf);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(shardwise_native, m) {
  m.def("cpu_blocked_linear(Tensor x, Tensor blocked, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(shardwise_native, CPU, m) { m.impl("cpu_blocked_linear", &cpu_blocked_linear); }
