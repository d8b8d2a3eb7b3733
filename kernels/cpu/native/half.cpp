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
// the sum differs). A float32 x (16-bit weights under fp32 compute: ``weight_dtype``) is not
// rounded at all: y = x @ float(w) + bias in float32, the weight widened exactly.
// Why not ATen: its 16-bit GEMV and small-M GEMMs read the plain [N, K] weight at well under
// the copy bandwidth (benchmarks/README.md, "bf16 decode on the CPU").

#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <immintrin.h>

#include "simd.h"
#include "scratch.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int BLOCK = 32;  // output columns per block: one 64-byte vector of 16-bit values
// Up to this many rows the widening loops below (each weight vector read once per 8 rows) beat
// ATen's 16-bit GEMM on a reassembled weight; beyond, that GEMM (benchmarks/kernel_half_linear.py).
// bf16 on a CPU with AVX512-BF16 takes its loops at every row count instead: the dot loops, or,
// where they lost the timing below, the widening ones (ATen's bf16 GEMM runs on the same slow
// instruction there: 124-162 GFLOP/s past 64 rows on the Xeon where the widening loops ran
// 264 at 64).
constexpr int64_t NATIVE_ROWS = 64;
// The largest reassembled weight kept in the thread's scratch (cpu_blocked_layout's constant of
// the same name: 64 MiB, a 1.7B model's MLP weights in fp32).
constexpr int64_t SCRATCH_MAX_BYTES = int64_t{64} << 20;

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
  // 16 floats -> 16 bf16 (simd.h)
  static inline __m256i narrow(__m512 v) { return shardwise_native::narrow_bf16(v); }
};

// float16: columns 0-15 and 16-31 converted by the hardware (AVX512F vcvtph2ps / vcvtps2ph).
struct F16 {
  using Scalar = c10::Half;
  static constexpr bool kInterleaved = false;
  static inline void widen(const uint16_t* w, __m512& a, __m512& b) {
    a = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
    b = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16)));
  }
  static inline __m256i narrow(__m512 v) { return shardwise_native::narrow_f16(v); }
};

// Columns 0..15 (c0) and 16..31 (c1) of one output row: + bias (float [32] or null), the first
// ``valid`` stored at ``out``: narrowed to 16 bits (O = uint16_t) or as floats (O = float: an
// fp32 x against 16-bit weights, nothing rounded).
template <typename T, typename O>
inline void store_columns(__m512 c0, __m512 c1, const float* bias, O* out, int valid) {
  const __mmask16 m0 = valid >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
  const __mmask16 m1 = valid >= 32 ? 0xFFFF
                       : valid <= 16 ? 0 : static_cast<__mmask16>((1u << (valid - 16)) - 1);
  if (bias) {
    c0 = _mm512_add_ps(c0, _mm512_maskz_loadu_ps(m0, bias));
    c1 = _mm512_add_ps(c1, _mm512_maskz_loadu_ps(m1, bias + 16));
  }
  if constexpr (std::is_same_v<O, float>) {
    _mm512_mask_storeu_ps(out, m0, c0);
    _mm512_mask_storeu_ps(out + 16, m1, c1);
  } else {
    _mm256_mask_storeu_epi16(out, m0, T::narrow(c0));
    _mm256_mask_storeu_epi16(out + 16, m1, T::narrow(c1));
  }
}

// Rows [0, MB) of x (float [MB][K], row stride K) against one block's weights w [K][32]:
// out[m][0..valid) = the float sums (+ bias, float [32] or null), stored as O (store_columns).
// One row keeps two chains per vector (FMA latency, not the loads, bounds a single chain).
template <typename T, int MB, typename O>
inline void block_rows(const uint16_t* w, const float* x, int64_t K, const float* bias,
                       O* out, int64_t ldo, int valid) {
  constexpr int C = MB == 1 ? 2 : 1;
  __m512 acc_a[MB][C], acc_b[MB][C];
  for (int m = 0; m < MB; ++m)
    for (int c = 0; c < C; ++c) acc_a[m][c] = acc_b[m][c] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + C <= K; k += C) {
#pragma GCC unroll 2
    for (int c = 0; c < C; ++c) {
      __m512 a, b;
      shardwise_native::prefetch_weights(w + (k + c) * BLOCK);
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
  for (int m = 0; m < MB; ++m) {
    __m512 a = acc_a[m][0], b = acc_b[m][0];
    for (int c = 1; c < C; ++c) {
      a = _mm512_add_ps(a, acc_a[m][c]);
      b = _mm512_add_ps(b, acc_b[m][c]);
    }
    if constexpr (T::kInterleaved)
      store_columns<T, O>(_mm512_permutex2var_ps(a, lo, b), _mm512_permutex2var_ps(a, hi, b),
                          bias, out + m * ldo, valid);
    else
      store_columns<T, O>(a, b, bias, out + m * ldo, valid);
  }
}

// bf16 on CPUs with AVX512-BF16: vdpbf16ps multiplies pairs of bf16 along k and adds both
// products to a float lane (each product exact, each addition one float rounding; denormal
// inputs and results flushed to zero, as the instruction does), half the instructions of
// widening and FMAs, so more rows per weight vector stay cheap (a 64-row prompt chunk as fast
// as ATen's GEMM on the plain weight: no reassembly). Two weight vectors (k, k + 1) are
// interleaved in registers into pairs: ``lo`` holds columns {0-3, 8-11, 16-19, 24-27}, ``hi``
// the others; x is read as bf16 pairs (x[m, k], x[m, k + 1]).
template <int MB>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline void block_rows_dot(
    const uint16_t* w, const uint16_t* x, int64_t K, const float* bias, uint16_t* out,
    int64_t ldo, int valid) {
  __m512 acc_lo[MB], acc_hi[MB];
  for (int m = 0; m < MB; ++m) acc_lo[m] = acc_hi[m] = _mm512_setzero_ps();
  const int64_t even = K & ~int64_t{1};
  for (int64_t k = 0; k < even; k += 2) {
    shardwise_native::prefetch_weights(w + k * BLOCK);
    shardwise_native::prefetch_weights(w + (k + 1) * BLOCK);
    const __m512i v0 = _mm512_loadu_si512(w + k * BLOCK);
    const __m512i v1 = _mm512_loadu_si512(w + (k + 1) * BLOCK);
    const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(v0, v1);
    const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(v0, v1);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * K + k, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      acc_lo[m] = _mm512_dpbf16_ps(acc_lo[m], lo, xv);
      acc_hi[m] = _mm512_dpbf16_ps(acc_hi[m], hi, xv);
    }
  }
  if (even < K) {  // odd K: the last k paired with zeros (weights and x alike)
    const __m512i v0 = _mm512_loadu_si512(w + even * BLOCK), v1 = _mm512_setzero_si512();
    const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(v0, v1);
    const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(v0, v1);
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * K + even]));
      acc_lo[m] = _mm512_dpbf16_ps(acc_lo[m], lo, xv);
      acc_hi[m] = _mm512_dpbf16_ps(acc_hi[m], hi, xv);
    }
  }
  const __m512i c0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i c1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int m = 0; m < MB; ++m)
    store_columns<BF16, uint16_t>(_mm512_permutex2var_ps(acc_lo[m], c0, acc_hi[m]),
                        _mm512_permutex2var_ps(acc_lo[m], c1, acc_hi[m]), bias, out + m * ldo,
                        valid);
}

// For each block of 32 output columns (split over the threads), x's rows in chunks of 8 / 4 /
// 2 / 1, each chunk reusing the block's weights (16-64 KiB per 1k of K: L2):
// ``Rows::run<MB>(block weights, rows of x, K, bias, out, ldo, valid)``. x: XS [M, K], out:
// OS [M, n].
template <typename Rows, typename XS, typename OS>
void for_each_block(const XS* x, int64_t M, int64_t K, const uint16_t* w, int64_t nb,
                    const float* bias, int64_t n, OS* out) {
  at::parallel_for(0, nb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int valid = static_cast<int>(std::min<int64_t>(BLOCK, n - r * BLOCK));
      const uint16_t* wr = w + r * K * BLOCK;
      const float* br = bias ? bias + r * BLOCK : nullptr;
      OS* o = out + r * BLOCK;
      int64_t m = 0;
      for (; m + 8 <= M; m += 8) Rows::template run<8>(wr, x + m * K, K, br, o + m * n, n, valid);
      for (; m + 4 <= M; m += 4) Rows::template run<4>(wr, x + m * K, K, br, o + m * n, n, valid);
      for (; m + 2 <= M; m += 2) Rows::template run<2>(wr, x + m * K, K, br, o + m * n, n, valid);
      for (; m < M; ++m) Rows::template run<1>(wr, x + m * K, K, br, o + m * n, n, valid);
    }
  });
}

template <typename T>
struct WideningRows {
  template <int MB, typename O>
  static void run(const uint16_t* w, const float* x, int64_t K, const float* bias, O* out,
                  int64_t ldo, int valid) {
    block_rows<T, MB, O>(w, x, K, bias, out, ldo, valid);
  }
};

struct DotRows {
  template <int MB, typename O>
  static void run(const uint16_t* w, const uint16_t* x, int64_t K, const float* bias, O* out,
                  int64_t ldo, int valid) {
    static_assert(std::is_same_v<O, uint16_t>, "the dot loops take bf16 x and give bf16");
    block_rows_dot<MB>(w, x, K, bias, out, ldo, valid);
  }
};

// The widening loops over T weights. x float: read as it is, the output float (nothing
// rounded); x in T's dtype: widened to float once into ``xf`` [M, K], the output narrowed.
template <typename T>
void run_widening(const at::Tensor& x, const at::Tensor& w, const float* bias, int64_t n,
                  at::Tensor& out, float* xf) {
  using S = typename T::Scalar;
  const int64_t M = x.size(0), K = x.size(1);
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  if (x.scalar_type() == at::kFloat) {
    for_each_block<WideningRows<T>>(x.data_ptr<float>(), M, K, wp, w.size(0), bias, n,
                                    out.data_ptr<float>());
    return;
  }
  const S* xs = x.data_ptr<S>();
  for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(xs[i]);
  for_each_block<WideningRows<T>>(xf, M, K, wp, w.size(0), bias, n,
                                  reinterpret_cast<uint16_t*>(out.data_ptr()));
}

void run_bf16_dot(const at::Tensor& x, const at::Tensor& w, const float* bias, int64_t n,
                  at::Tensor& out) {
  for_each_block<DotRows>(reinterpret_cast<const uint16_t*>(x.data_ptr()), x.size(0), x.size(1),
                          reinterpret_cast<const uint16_t*>(w.data_ptr()), w.size(0), bias, n,
                          reinterpret_cast<uint16_t*>(out.data_ptr()));
}

// Which bf16 loops are faster on this CPU, timed once per process on one thread: 8 rows of x
// against one block of 32 columns x 1024 features (64 KiB of weight, in cache, so the loops'
// arithmetic is what differs). vdpbf16ps halves the instructions, but its throughput is the
// CPU's: on an AMD EPYC (Zen 4) the dot loops ran 2x the widening ones at 8 rows, on an Intel
// Xeon with AVX512-BF16 the widening loops ran 1.2-1.7x the dot ones from 2 rows up
// (benchmarks/README.md, "bf16 decode on the CPU"). The dot loops are kept unless the widening
// ones take under 1/DOT_MARGIN of their time, so a near tie (timing noise) never flips a CPU's
// numerics from one process to the next. Returns {dot seconds, widening seconds} per call.
constexpr double DOT_MARGIN = 1.15;

std::pair<double, double> time_bf16_loops() {
  constexpr int64_t K = 1024, MB = 8, REPS = 64, TRIALS = 5;
  std::vector<uint16_t> w(K * BLOCK), x(MB * K), out(MB * BLOCK);
  std::vector<float> xf(MB * K);
  for (int64_t i = 0; i < K * BLOCK; ++i) w[i] = 0x3F80 + static_cast<uint16_t>(i % 61);
  for (int64_t i = 0; i < MB * K; ++i) {
    x[i] = 0x3F00 + static_cast<uint16_t>(i % 53);
    xf[i] = static_cast<float>(c10::BFloat16(x[i], c10::BFloat16::from_bits()));
  }
  using clock = std::chrono::steady_clock;
  auto best = [&](auto&& call) {
    double t = 1e30;
    for (int trial = 0; trial < TRIALS; ++trial) {
      const auto t0 = clock::now();
      for (int r = 0; r < REPS; ++r) call();
      t = std::min(t, std::chrono::duration<double>(clock::now() - t0).count() / REPS);
    }
    return t;
  };
  auto dot = [&] { block_rows_dot<MB>(w.data(), x.data(), K, nullptr, out.data(), BLOCK, BLOCK); };
  auto widen = [&] {
    block_rows<BF16, MB, uint16_t>(w.data(), xf.data(), K, nullptr, out.data(), BLOCK, BLOCK);
  };
  dot(), widen();  // warm the caches
  const double td = best(dot), tw = best(widen);
  return {td, tw};
}

bool cpu_has_bf16_dot() {
  static const bool cpu = __builtin_cpu_supports("avx512bf16");
  return cpu;
}

std::pair<double, double> bf16_loop_times() {
  static const std::pair<double, double> times =
      cpu_has_bf16_dot() ? time_bf16_loops() : std::pair<double, double>{0.0, 0.0};
  return times;
}

// Whether bf16 takes the vdpbf16ps loops: the CPU has AVX512-BF16 (the build does not assume
// it: the cache may outlive the CPU) and SHARDWISE_CPU_BF16_DOT (read per call: the tests and
// benchmarks compare the paths) is "1", or unset and the timing above prefers them; "0": never.
bool bf16_dot() {
  if (!cpu_has_bf16_dot()) return false;
  const char* env = std::getenv("SHARDWISE_CPU_BF16_DOT");
  if (env && (env[0] == '0' || env[0] == '1') && env[1] == '\0') return env[0] == '1';
  const auto [td, tw] = bf16_loop_times();
  return !(tw * DOT_MARGIN < td);
}

// {1 if bf16 takes the dot loops now else 0, the dot loops' probe seconds, the widening ones'}
// (0, 0 without AVX512-BF16: not timed), for the tests and benchmarks/kernel_half_linear.py.
std::vector<double> cpu_bf16_dot_choice() {
  const auto [td, tw] = bf16_loop_times();
  return {bf16_dot() ? 1.0 : 0.0, td, tw};
}

// More rows than NATIVE_ROWS: ATen's GEMM (fp32 accumulation, bias inside, one rounding) on the
// plain [K, n] weight, reassembled into the thread's scratch from the blocks, in x's dtype (a
// float x: the 16-bit weight widened, exactly, as it is copied).
at::Tensor reassembled_linear(const at::Tensor& x, const at::Tensor& blocked,
                              const std::optional<at::Tensor>& bias, int64_t n) {
  const int64_t nb = blocked.size(0), K = blocked.size(1);
  // the thread's scratch (scratch.h): a fresh weight-sized tensor per call costs its page
  // faults (~2 GB/s here, where the copy into memory already touched runs at ~6); a weight
  // over SCRATCH_MAX_BYTES (an output head) gets a transient tensor, so no thread keeps that
  const auto opts = blocked.options().dtype(x.scalar_type());
  const int64_t bytes = blocked.numel() * static_cast<int64_t>(x.element_size());
  at::Tensor plain =
      bytes > SCRATCH_MAX_BYTES
          ? at::empty({K, nb, BLOCK}, opts)
          : at::from_blob(shardwise_native::scratch_bytes(bytes), {K, nb, BLOCK}, opts);
  plain.copy_(blocked.transpose(0, 1));
  const at::Tensor mat2 = plain.view({K, nb * BLOCK}).narrow(1, 0, n);  // [K, n]
  if (bias.has_value() && bias->defined())
    return at::addmm(bias->to(x.scalar_type()), x, mat2);
  return at::mm(x, mat2);
}

at::Tensor cpu_blocked_linear(const at::Tensor& x, const at::Tensor& blocked,
                              const std::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.dim() == 2, "cpu_blocked_linear: x must be [M, K]");
  const auto dt = x.scalar_type(), wt = blocked.scalar_type();
  TORCH_CHECK(wt == at::kBFloat16 || wt == at::kHalf,
              "cpu_blocked_linear: the weight must be bfloat16 or float16");
  TORCH_CHECK(dt == wt || dt == at::kFloat,
              "cpu_blocked_linear: x must be in the weight's dtype, or float32");
  TORCH_CHECK(blocked.dim() == 3 && blocked.size(2) == BLOCK && blocked.is_contiguous(),
              "cpu_blocked_linear: the weight must be contiguous [Nb, K, 32]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(blocked.size(1) == K, "cpu_blocked_linear: x has ", K,
              " features, the weight ", blocked.size(1));
  TORCH_CHECK(n > 0 && (n + BLOCK - 1) / BLOCK == blocked.size(0),
              "cpu_blocked_linear: ", n, " outputs do not fit ", blocked.size(0), " blocks");
  const at::Tensor xc = x.contiguous();
  // a float x keeps its products exact: the widening loops (the dot loops would round it)
  const bool dot = dt == at::kBFloat16 && bf16_dot();
  const bool every_row_count = dt == at::kBFloat16 && cpu_has_bf16_dot();
  if (M > NATIVE_ROWS && !every_row_count) return reassembled_linear(xc, blocked, bias, n);
  // scratch: x as float [M, K], then the bias as float [Nb * 32] (zero-padded)
  const int64_t padded = blocked.size(0) * BLOCK;
  const bool has_bias = bias.has_value() && bias->defined();
  // the widening loops read a 16-bit x widened into scratch; a float x (and the dot loops' bf16
  // x) is read as it is
  const int64_t xfloats = dot || dt == at::kFloat ? 0 : M * K;
  float* xf = reinterpret_cast<float*>(
      shardwise_native::scratch_bytes((xfloats + (has_bias ? padded : 0)) * 4));
  float* bf = nullptr;
  if (has_bias) {
    TORCH_CHECK(bias->numel() == n, "cpu_blocked_linear: bias must have ", n, " elements");
    bf = xf + xfloats;
    const at::Tensor b = bias->to(at::kFloat).contiguous();
    std::copy(b.data_ptr<float>(), b.data_ptr<float>() + n, bf);
    std::fill(bf + n, bf + padded, 0.f);
  }
  at::Tensor out = at::empty({M, n}, x.options());
  if (M == 0) return out;
  if (dot)
    run_bf16_dot(xc, blocked, bf, n, out);
  else if (wt == at::kBFloat16)
    run_widening<BF16>(xc, blocked, bf, n, out, xf);
  else
    run_widening<F16>(xc, blocked, bf, n, out, xf);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(shardwise_native, m) {
  m.def("cpu_blocked_linear(Tensor x, Tensor blocked, Tensor? bias, int n) -> Tensor");
  m.def("cpu_bf16_dot_choice() -> float[]", &cpu_bf16_dot_choice);
}

TORCH_LIBRARY_IMPL(shardwise_native, CPU, m) { m.impl("cpu_blocked_linear", &cpu_blocked_linear); }
