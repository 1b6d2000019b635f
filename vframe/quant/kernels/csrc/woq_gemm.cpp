// Weight-only quantized matmul for a few rows of activations (decode): int8 or
// int4 weights with one float scale per group of consecutive inputs, optional
// zero points, read in place and never dequantized into a float weight.
//
//   y[m, o] = sum_g  s[o, g] * dot_g(x[m], q[o] - c)  -  sz[o, g] * xsum[m, g]
//
// q holds the stored integers (8 bit: [N, K] uint8; 4 bit: [N, K / 2] uint8, the
// low nibble of byte j of a group is its input j, the high nibble its input
// j + group / 2); c is the midpoint (128 or 8), so symmetric formats need no zero
// term; sz = s * (z - c) for asymmetric ones, with xsum the sum of each group's
// inputs. Accumulation in float32; the output in x's dtype.
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_int_mm.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "bf16_tile.h"  // vframe/layers/csrc: bf16_gemm's tile

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define VFRAME_WOQ_SIMD 1
#elif defined(__AVX2__)
#include <immintrin.h>
#endif

// The activation dtypes every operator here takes.
#define VFRAME_FLOAT_TYPES at::kFloat, at::kBFloat16, at::kHalf

namespace {

#if defined(__AVX2__) && defined(__FMA__)
// The 8 lanes of v added.
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// [sum(v[0]), ..., sum(v[7])]: each vector's 8 lanes added (int32 lanes exactly, then
// converted once).
inline __m256 sum_lanes8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
inline __m256 sum_lanes8(const __m256i* v) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_cvtepi32_ps(
      _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31)));
}

// One output of a one-token product whose groups of inputs each give a vector of 8
// partial sums (products(g): floats, or exact int32 sums): eight groups at a time, their vectors reduced into one (a
// lane a group) so that the eight scales and zero terms are one vector FMA each, where a
// group at a time spent more on that scalar work than on its weights:
//
//   sum_g  scales[g] * factors[g] * sum(products(g))  -  (scales[g] * mid + zeros[g]) * sums[g]
//
// (factors: an activation block's scale, or none; zeros: the group's zero term, or none;
// sums: the group's sum of inputs, for the midpoint mid and the zero term).
template <typename Products>
float eight_groups(int64_t groups, const Products& products, const float* scales, const float* factors,
                   const float* zeros, float mid, const float* sums) {
  using V = decltype(products(0));  // __m256 or __m256i
  const int64_t full = groups / 8 * 8;
  const __m256 mid8 = _mm256_set1_ps(mid);
  __m256 acc = _mm256_setzero_ps(), zero_acc = _mm256_setzero_ps();
  V parts[8];
  for (int64_t g = 0; g < full; g += 8) {
    for (int64_t j = 0; j < 8; ++j) parts[j] = products(g + j);
    const __m256 s = _mm256_loadu_ps(scales + g);
    acc = _mm256_fmadd_ps(sum_lanes8(parts), factors ? _mm256_mul_ps(s, _mm256_loadu_ps(factors + g)) : s, acc);
    __m256 z = _mm256_mul_ps(s, mid8);
    if (zeros != nullptr) z = _mm256_add_ps(z, _mm256_loadu_ps(zeros + g));
    zero_acc = _mm256_fmadd_ps(z, _mm256_loadu_ps(sums + g), zero_acc);
  }
  float total = hsum8(_mm256_sub_ps(acc, zero_acc));
  if (full < groups) {  // the last groups, fewer than 8
    for (int64_t j = 0; j < 8; ++j) parts[j] = full + j < groups ? products(full + j) : V{};
    alignas(32) float tail[8];
    _mm256_store_ps(tail, sum_lanes8(parts));
    for (int64_t g = full; g < groups; ++g)
      total += scales[g] * (factors ? factors[g] : 1.f) * tail[g - full] -
               (scales[g] * mid + (zeros != nullptr ? zeros[g] : 0.f)) * sums[g];
  }
  return total;
}
#endif

// Output rows begin .. end for m_rows (<= kMaxRows) activation rows.
constexpr int64_t kMaxRows = 8;

// The portable path (no AVX2 / AVX-512, or groups the vector paths do not tile):
// each output row's integers minus the midpoint are unpacked once into floats and
// used for every activation row, group by group.
template <typename T>
void rows_scalar(const float* x, const float* xsum, const uint8_t* q, const float* scales, const float* sz, T* y,
                 int64_t m_rows, int64_t n, int64_t k, int64_t group, int64_t bits, int64_t begin, int64_t end) {
  const int64_t groups = k / group, row_bytes = bits == 8 ? k : k / 2, half = group / 2;
  std::vector<float> w(k);
  for (int64_t o = begin; o < end; ++o) {
    const uint8_t* row = q + o * row_bytes;
    if (bits == 8) {
      for (int64_t i = 0; i < k; ++i) w[i] = static_cast<float>(static_cast<int32_t>(row[i]) - 128);
    } else {  // byte j of a group: input j (low nibble) and input j + half (high)
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t j = 0; j < half; ++j) {
          const int32_t byte = row[g * half + j];
          w[g * group + j] = static_cast<float>((byte & 15) - 8);
          w[g * group + j + half] = static_cast<float>((byte >> 4) - 8);
        }
    }
    for (int64_t m = 0; m < m_rows; ++m) {
      const float* xm = x + m * k;
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const float* xg = xm + g * group;
        const float* wg = w.data() + g * group;
        float d = 0.f;
#pragma omp simd reduction(+ : d)
        for (int64_t i = 0; i < group; ++i) d += xg[i] * wg[i];
        acc += scales[o * groups + g] * d;
        if (sz != nullptr) acc -= sz[o * groups + g] * xsum[m * groups + g];
      }
      y[m * n + o] = static_cast<T>(acc);
    }
  }
}

#if defined(VFRAME_WOQ_SIMD)
// The float vector of the widest instruction set the build has: 16 lanes with
// AVX-512, 8 with AVX2 + FMA. A chunk reads kLanes weight bytes.
#if defined(__AVX512F__)
struct Lanes {
  using V = __m512;
  static constexpr int64_t kLanes = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float v) { return _mm512_set1_ps(v); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
  static __m128i load_bytes(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
  // The kLanes low bytes of b, each minus mid, as floats.
  static V widen(__m128i b, int32_t mid) {
    return _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(b), _mm512_set1_epi32(mid)));
  }
};
#else
struct Lanes {
  using V = __m256;
  static constexpr int64_t kLanes = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float v) { return _mm256_set1_ps(v); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(V v) { return hsum8(v); }
  static __m128i load_bytes(const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }
  static V widen(__m128i b, int32_t mid) {
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(b), _mm256_set1_epi32(mid)));
  }
};
#endif

// The frame every vector path shares: per output row and group, the chunk policy
// adds the products of kLanes bytes of weights at a time into part[m] (one vector
// per activation row); the group's vector is scaled once, the zero term subtracted,
// and each output reduced once. MR (activation rows) is compile-time so that the
// accumulators stay in registers.
template <int64_t MR, typename Policy, typename XT, typename T>
void rows_grouped(const Policy& policy, const XT* x, const float* xsum, const uint8_t* q, const float* scales,
                  const float* sz, T* y, int64_t n, int64_t k, int64_t group, int64_t begin, int64_t end) {
  const int64_t groups = k / group, row_bytes = Policy::kBits == 8 ? k : k / 2;
  const int64_t group_bytes = Policy::kBits == 8 ? group : group / 2, half = group / 2;
  for (int64_t o = begin; o < end; ++o) {
    const uint8_t* row = q + o * row_bytes;
    const float* so = scales + o * groups;
    typename Lanes::V acc[MR];
    float zero_term[MR];
    for (int64_t m = 0; m < MR; ++m) acc[m] = Lanes::zero(), zero_term[m] = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      typename Lanes::V part[MR];
      for (int64_t m = 0; m < MR; ++m) part[m] = Lanes::zero();
      const uint8_t* qg = row + g * group_bytes;
      const XT* xg = x + g * group;
      for (int64_t c = 0; c < group_bytes; c += Policy::kChunkBytes)
        policy.template chunk<MR>(qg + c, xg + c, k, half, part);
      const typename Lanes::V scale = Lanes::set1(so[g]);
      for (int64_t m = 0; m < MR; ++m) acc[m] = Lanes::fmadd(part[m], scale, acc[m]);
      if (sz != nullptr)
        for (int64_t m = 0; m < MR; ++m) zero_term[m] += sz[o * groups + g] * xsum[m * groups + g];
    }
    for (int64_t m = 0; m < MR; ++m) y[m * n + o] = static_cast<T>(Lanes::sum(acc[m]) - zero_term[m]);
  }
}

// float32 activations: each kLanes weights widened to float once and used for every row.
template <int64_t BITS>
struct FloatChunk {
  static constexpr int64_t kBits = BITS, kChunkBytes = Lanes::kLanes;
  static constexpr int32_t kMid = BITS == 8 ? 128 : 8;
  const __m128i low = _mm_set1_epi8(15);

  template <int64_t MR>
  void chunk(const uint8_t* qc, const float* xc, int64_t k, int64_t half, typename Lanes::V* part) const {
    const __m128i bytes = Lanes::load_bytes(qc);
    if constexpr (BITS == 8) {
      const auto w = Lanes::widen(bytes, kMid);
      for (int64_t m = 0; m < MR; ++m) part[m] = Lanes::fmadd(Lanes::load(xc + m * k), w, part[m]);
    } else {  // byte j of a group: input j (low nibble) and input j + half (high)
      const auto lo = Lanes::widen(_mm_and_si128(bytes, low), kMid);
      const auto hi = Lanes::widen(_mm_and_si128(_mm_srli_epi16(bytes, 4), low), kMid);
      for (int64_t m = 0; m < MR; ++m) {
        part[m] = Lanes::fmadd(Lanes::load(xc + m * k), lo, part[m]);
        part[m] = Lanes::fmadd(Lanes::load(xc + m * k + half), hi, part[m]);
      }
    }
  }
};

template <int64_t BITS, int64_t MR, typename T>
void rows_simd(const float* x, const float* xsum, const uint8_t* q, const float* scales, const float* sz, T* y,
               int64_t n, int64_t k, int64_t group, int64_t begin, int64_t end) {
  rows_grouped<MR>(FloatChunk<BITS>{}, x, xsum, q, scales, sz, y, n, k, group, begin, end);
}

template <int64_t BITS, typename T>
void block_simd(int64_t rows, const float* x, const float* xsum, const uint8_t* q, const float* scales,
                const float* sz, T* y, int64_t n, int64_t k, int64_t group, int64_t begin, int64_t end) {
  switch (rows) {
#define VFRAME_ROWS(R) \
  case R: return rows_simd<BITS, R>(x, xsum, q, scales, sz, y, n, k, group, begin, end);
    VFRAME_ROWS(1) VFRAME_ROWS(2) VFRAME_ROWS(3) VFRAME_ROWS(4)
    VFRAME_ROWS(5) VFRAME_ROWS(6) VFRAME_ROWS(7) VFRAME_ROWS(8)
#undef VFRAME_ROWS
  }
}
#endif

#if defined(__AVX512BF16__)
// 4 bit with bfloat16 activations (AVX512-BF16): each nibble becomes the bfloat16
// of q - 8 through a 16-entry table (one vpermw for 32 weights) and pairs of
// products add up in float32 (vdpbf16ps). The products are exact, as in the float32
// path; only the order of the float32 additions differs.
struct Bf16Chunk4 {
  static constexpr int64_t kBits = 4, kChunkBytes = 16;
  const __m512i table = [] {
    alignas(64) uint16_t words[32] = {};
    for (int i = 0; i < 16; ++i) words[i] = c10::BFloat16(static_cast<float>(i - 8)).x;
    return _mm512_load_si512(words);
  }();
  const __m256i low = _mm256_set1_epi16(15);

  template <int64_t MR>
  void chunk(const uint8_t* qc, const uint16_t* xc, int64_t k, int64_t half, __m512* part) const {
    const __m256i words = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qc)));
    const __m512i nibbles =
        _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(words, low)), _mm256_srli_epi16(words, 4), 1);
    const __m512bh w = (__m512bh)_mm512_permutexvar_epi16(nibbles, table);
    for (int64_t m = 0; m < MR; ++m) {
      const uint16_t* xm = xc + m * k;
      const __m512i xv = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xm))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xm + half)), 1);
      part[m] = _mm512_dpbf16_ps(part[m], (__m512bh)xv, w);
    }
  }
};

template <int64_t MR>
void rows_bf16_u4(const uint16_t* x, const float* xsum, const uint8_t* q, const float* scales, const float* sz,
                  c10::BFloat16* y, int64_t n, int64_t k, int64_t group, int64_t begin, int64_t end) {
  rows_grouped<MR>(Bf16Chunk4{}, x, xsum, q, scales, sz, y, n, k, group, begin, end);
}

void block_bf16_u4(int64_t rows, const uint16_t* x, const float* xsum, const uint8_t* q, const float* scales,
                   const float* sz, c10::BFloat16* y, int64_t n, int64_t k, int64_t group, int64_t begin, int64_t end) {
  switch (rows) {
#define VFRAME_ROWS(R) \
  case R: return rows_bf16_u4<R>(x, xsum, q, scales, sz, y, n, k, group, begin, end);
    VFRAME_ROWS(1) VFRAME_ROWS(2) VFRAME_ROWS(3) VFRAME_ROWS(4)
    VFRAME_ROWS(5) VFRAME_ROWS(6) VFRAME_ROWS(7) VFRAME_ROWS(8)
#undef VFRAME_ROWS
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// float32 activations, groups that are multiples of 32 (GGUF's Q4_0 / Q4_1 / Q8_0 / Q4_K
// blocks of 32, GPTQ / AWQ groups of 64 or 128), one activation row (decode): the
// rows_grouped frame spends more on each group's scalar work (its scale, zero term and
// chains) than on its weights; here eight groups' products are reduced together into
// one vector (a lane a group), so that their scales and zero terms are one vector FMA
// each, and the midpoint moves into the zero term (sum x (q - c) = sum x q - c sum x).
// AVX2 EPYC, 4 bit, with offsets: [1, 1536] x [1536 -> 576] 168 -> 115 us on one
// thread; [1, 576] x [576 -> 3072] 188 -> 149 us on two.
//
// 32 weights: 4 bit, 16 bytes whose low nibbles are the inputs at x_lo and high ones
// those at x_hi (a group's byte j holds its inputs j and j + group / 2); 8 bit, 32
// bytes, the inputs at x_lo.
template <int64_t BITS>
inline __m256 float_products32(const uint8_t* qc, const float* x_lo, const float* x_hi) {
  __m256i w[4];
  const float* xs[4];
  if constexpr (BITS == 8) {
    for (int64_t j = 0; j < 4; ++j) {
      w[j] = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qc + 8 * j)));
      xs[j] = x_lo + 8 * j;
    }
  } else {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qc)), low = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(bytes, low), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
    w[0] = _mm256_cvtepu8_epi32(lo), w[1] = _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8));
    w[2] = _mm256_cvtepu8_epi32(hi), w[3] = _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8));
    xs[0] = x_lo, xs[1] = x_lo + 8, xs[2] = x_hi, xs[3] = x_hi + 8;
  }
  __m256 a = _mm256_mul_ps(_mm256_loadu_ps(xs[0]), _mm256_cvtepi32_ps(w[0]));
  __m256 b = _mm256_mul_ps(_mm256_loadu_ps(xs[1]), _mm256_cvtepi32_ps(w[1]));
  a = _mm256_fmadd_ps(_mm256_loadu_ps(xs[2]), _mm256_cvtepi32_ps(w[2]), a);
  b = _mm256_fmadd_ps(_mm256_loadu_ps(xs[3]), _mm256_cvtepi32_ps(w[3]), b);
  return _mm256_add_ps(a, b);
}

// One group's products as a vector of 8 partial sums.
template <int64_t BITS>
inline __m256 float_group_products(const uint8_t* qg, const float* xg, int64_t group) {
  const int64_t half = group / 2, step = BITS == 8 ? 32 : 16;
  const int64_t bytes = BITS == 8 ? group : half;
  __m256 sum = float_products32<BITS>(qg, xg, xg + half);
  for (int64_t c = step; c < bytes; c += step) sum = _mm256_add_ps(sum, float_products32<BITS>(qg + c, xg + c, xg + half + c));
  return sum;
}

template <int64_t BITS, typename T>
void float_g32_row(const float* x, const float* xsum, const uint8_t* q, const float* scales, const float* sz, T* y,
                   int64_t k, int64_t group, int64_t begin, int64_t end) {
  const int64_t group_bytes = BITS == 8 ? group : group / 2, groups = k / group;
  for (int64_t o = begin; o < end; ++o) {
    const uint8_t* row = q + o * groups * group_bytes;
    const auto products = [&](int64_t g) { return float_group_products<BITS>(row + g * group_bytes, x + g * group, group); };
    y[o] = static_cast<T>(eight_groups(groups, products, scales + o * groups, nullptr,
                                       sz == nullptr ? nullptr : sz + o * groups, BITS == 8 ? 128.f : 8.f, xsum));
  }
}
#define VFRAME_WOQ_FLOAT_G32 1
#endif

template <typename T>
void gemm(const float* x, const float* xsum, const uint8_t* q, const float* scales, const float* sz, T* y,
          int64_t m_rows, int64_t n, int64_t k, int64_t group, int64_t bits) {
  const int64_t groups = k / group;
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < m_rows; m0 += kMaxRows) {
      const int64_t rows = std::min(kMaxRows, m_rows - m0);
      const float* xm = x + m0 * k;
      const float* xs = xsum == nullptr ? nullptr : xsum + m0 * groups;
#if defined(VFRAME_WOQ_FLOAT_G32)
      if (group % 32 == 0 && rows == 1) {
        if (bits == 8)
          float_g32_row<8>(xm, xs, q, scales, sz, y + m0 * n, k, group, begin, end);
        else
          float_g32_row<4>(xm, xs, q, scales, sz, y + m0 * n, k, group, begin, end);
        continue;
      }
#endif
#if defined(VFRAME_WOQ_SIMD)
      if (group % (bits == 8 ? Lanes::kLanes : 2 * Lanes::kLanes) == 0) {
        if (bits == 8)
          block_simd<8>(rows, xm, xs, q, scales, sz, y + m0 * n, n, k, group, begin, end);
        else
          block_simd<4>(rows, xm, xs, q, scales, sz, y + m0 * n, n, k, group, begin, end);
        continue;
      }
#endif
      rows_scalar(xm, xs, q, scales, sz, y + m0 * n, rows, n, k, group, bits, begin, end);
    }
  });
}

bool bf16_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

void gemm_bf16_u4(const at::Tensor& x, const float* xsum, const at::Tensor& q, const at::Tensor& scales,
                  const at::Tensor& scaled_zeros, at::Tensor& y, int64_t group) {
#if defined(__AVX512BF16__)
  const int64_t m_rows = x.size(0), k = x.size(1), n = q.size(0), groups = k / group;
  const auto* xb = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const float* xs = scaled_zeros.numel() ? xsum : nullptr;
  const float* zs = scaled_zeros.numel() ? scaled_zeros.data_ptr<float>() : nullptr;
  auto* out = y.data_ptr<c10::BFloat16>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m0 = 0; m0 < m_rows; m0 += kMaxRows) {
      const int64_t rows = std::min(kMaxRows, m_rows - m0);
      block_bf16_u4(rows, xb + m0 * k, xs == nullptr ? nullptr : xs + m0 * groups, q.data_ptr<uint8_t>(),
                    scales.data_ptr<float>(), zs, out + m0 * n, n, k, group, begin, end);
    }
  });
#endif
}

// The weight operands of woq_gemm / woq_gemm_a8 for K inputs: q uint8 [N, K] (8 bit) or
// [N, K / 2] (4 bit), scales float32 [N, K / group], scaled_zeros empty or like scales.
void check_weight(const char* op, const at::Tensor& q, const at::Tensor& scales, const at::Tensor& scaled_zeros,
                  int64_t k, int64_t group, int64_t bits) {
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous() && q.size(1) == (bits == 8 ? k : k / 2), op,
              ": q must be contiguous uint8 [N, ", bits == 8 ? k : k / 2, "]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.size(0) == q.size(0) &&
                  scales.size(1) == k / group,
              op, ": scales must be float32 [N, K / group]");
  TORCH_CHECK(scaled_zeros.numel() == 0 || (scaled_zeros.sizes() == scales.sizes() &&
                                            scaled_zeros.scalar_type() == at::kFloat && scaled_zeros.is_contiguous()),
              op, ": scaled_zeros must be empty or float32 like scales");
}

// x: [M, K] any float dtype (bfloat16 with 4 bit and AVX512-BF16 is read as it is, else as float32); q: uint8 [N, K] (8 bit) or [N, K / 2] (4 bit); scales: [N, K / group]
// float32; scaled_zeros: the same shape or empty (symmetric). Returns [M, N] of out_dtype.
at::Tensor woq_gemm(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scales,
                    const at::Tensor& scaled_zeros, int64_t group, int64_t bits, at::ScalarType out_dtype) {
  TORCH_CHECK(bits == 8 || bits == 4, "woq_gemm: bits must be 8 or 4, got ", bits);
  TORCH_CHECK(x_in.dim() == 2, "woq_gemm: x must be [M, K]");
  // bfloat16 x stays as it is for the 4-bit AVX512-BF16 path; anything else is read as float32.
  const bool bf16_path = x_in.scalar_type() == at::kBFloat16 && bits == 4 && group % 32 == 0 &&
                         out_dtype == at::kBFloat16 && bf16_supported();
  const at::Tensor x = bf16_path ? x_in.contiguous() : x_in.to(at::kFloat).contiguous();
  const int64_t m_rows = x.size(0), k = x.size(1), n = q.size(0);
  TORCH_CHECK(group > 0 && k % group == 0 && (bits == 8 || group % 2 == 0), "woq_gemm: group ", group,
              " does not divide K=", k);
  check_weight("woq_gemm", q, scales, scaled_zeros, k, group, bits);
  const bool zeros = scaled_zeros.numel() > 0;
  // Each group's input sum (for the zero term), in float32: a loop here, not an at::sum
  // (whose dispatch costs more than a decode step's whole product at these sizes).
  const int64_t groups = k / group;
  // Groups of 32, 64, ... on AVX2 take the midpoint through the sums too (float_g32_row).
  const bool sums = zeros || group % 32 == 0;
  std::vector<float> xsum(sums ? m_rows * groups : 0);
  auto sum_groups = [&](const auto* xp) {
    for (int64_t r = 0; r < m_rows * groups; ++r) {
      float acc = 0.f;
      for (int64_t i = 0; i < group; ++i) acc += static_cast<float>(xp[r * group + i]);
      xsum[r] = acc;
    }
  };
  if (sums) {
    if (bf16_path)
      sum_groups(x.data_ptr<c10::BFloat16>());
    else
      sum_groups(x.data_ptr<float>());
  }
  if (bf16_path) {
    at::Tensor y = at::empty({m_rows, n}, x.options());
    gemm_bf16_u4(x, xsum.data(), q, scales, scaled_zeros, y, group);
    return y;
  }
  at::Tensor y = at::empty({m_rows, n}, x.options().dtype(out_dtype));
  const float* zs = zeros ? scaled_zeros.data_ptr<float>() : nullptr;
  const float* xs = sums ? xsum.data() : nullptr;
  auto run = [&](auto* out) {
    gemm(x.data_ptr<float>(), xs, q.data_ptr<uint8_t>(), scales.data_ptr<float>(), zs, out, m_rows, n, k, group, bits);
  };
  AT_DISPATCH_V2(out_dtype, "woq_gemm", AT_WRAP([&] { run(y.data_ptr<scalar_t>()); }), VFRAME_FLOAT_TYPES);
  return y;
}

// The float weight [N, K] of out_dtype the integers stand for: s * (q - c) - sz, in
// float32 (the PyTorch expression IntWeight.dequantize() spells), then cast. Where a
// batch of tokens is multiplied by it in one GEMM (prefill).
at::Tensor woq_dequantize(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& scaled_zeros, int64_t group,
                          int64_t bits, at::ScalarType out_dtype) {
  TORCH_CHECK(bits == 8 || bits == 4, "woq_dequantize: bits must be 8 or 4, got ", bits);
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous() && scales.scalar_type() == at::kFloat &&
                  scales.is_contiguous(),
              "woq_dequantize: q uint8 and scales float32, contiguous");
  const int64_t n = q.size(0), k = bits == 8 ? q.size(1) : 2 * q.size(1), groups = k / group, half = group / 2;
  TORCH_CHECK(scales.size(0) == n && scales.size(1) == groups, "woq_dequantize: scales must be [N, K / group]");
  const bool zeros = scaled_zeros.numel() > 0;
  const float* sz = zeros ? scaled_zeros.data_ptr<float>() : nullptr;
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  at::Tensor w = at::empty({n, k}, q.options().dtype(out_dtype));
  auto fill = [&](auto* out) {
    using T = std::remove_pointer_t<decltype(out)>;
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      for (int64_t o = begin; o < end; ++o) {
        for (int64_t g = 0; g < groups; ++g) {
          const float s = sp[o * groups + g], z = zeros ? sz[o * groups + g] : 0.f;
          T* dst = out + o * k + g * group;
          if (bits == 8) {
            const uint8_t* src = qp + o * k + g * group;
#pragma omp simd
            for (int64_t i = 0; i < group; ++i) {
              const float v = s * static_cast<float>(static_cast<int32_t>(src[i]) - 128);
              dst[i] = static_cast<T>(zeros ? v - z : v);
            }
          } else {
            const uint8_t* src = qp + o * (k / 2) + g * half;
#pragma omp simd
            for (int64_t j = 0; j < half; ++j) {
              const float lo = s * static_cast<float>((src[j] & 15) - 8), hi = s * static_cast<float>((src[j] >> 4) - 8);
              dst[j] = static_cast<T>(zeros ? lo - z : lo);
              dst[j + half] = static_cast<T>(zeros ? hi - z : hi);
            }
          }
        }
      }
    });
  };
  AT_DISPATCH_V2(out_dtype, "woq_dequantize", AT_WRAP([&] { fill(w.data_ptr<scalar_t>()); }), VFRAME_FLOAT_TYPES);
  return w;
}

// Weight-only integers times activations quantized to int8 per block of 32 inputs,
// as llama.cpp's (and vLLM's GGUF) dot products compute them: each block b of a row
// of x is d_b * qx with d_b = max |x_b| / 127 and qx = round(x / d_b) (half to even,
// through x * (1 / d_b)), and the products of the stored integers with qx are summed
// exactly in int32, 32 at a time, before any float arithmetic:
//
//   y[m, o] = sum_g  s[o, g] * (sum_{b in g} d_b * sum_i qx_i q_i  -  c * qsum[m, g])  +  sz'[o, g] * qsum[m, g]
//
// with qsum[m, g] = sum_{b in g} d_b * sum_i qx_i (the quantized inputs' sum) and the
// weight form of woq_gemm (q, c, s, sz = s (z - c)); 8-bit weights are read as the
// signed q - 128 (c = 0). Groups must be multiples of 32, so a block never straddles
// two groups. Per 32 weights this does a handful of integer instructions where the
// float path widens every weight to float (AVX2 EPYC: ~3x less work per weight).
constexpr int64_t kBlock = 32;  // inputs per activation block
constexpr int64_t kA8Rows = 4;  // activation rows per pass over the weights

struct QuantizedRows {
  std::vector<int8_t> q;       // [M, K]
  std::vector<float> d;        // [M, K / 32]: each block's scale
  std::vector<float> qsum;     // [M, K / group]: each group's sum of the quantized inputs
};

// Rows m0.. of QuantizedRows, as the loops read them (indexed from their first row).
struct XRows {
  const int8_t* q;
  const float* d;
  const float* qsum;
};

XRows rows_from(const QuantizedRows& all, int64_t m0, int64_t k, int64_t group) {
  return {all.q.data() + m0 * k, all.d.data() + m0 * (k / kBlock), all.qsum.data() + m0 * (k / group)};
}

QuantizedRows quantize_blocks(const float* x, int64_t m_rows, int64_t k, int64_t group) {
  const int64_t blocks = k / kBlock, groups = k / group, per_group = group / kBlock;
  QuantizedRows r{std::vector<int8_t>(m_rows * k), std::vector<float>(m_rows * blocks),
                  std::vector<float>(m_rows * groups, 0.f)};
  for (int64_t m = 0; m < m_rows; ++m)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + m * k + b * kBlock;
      float amax = 0.f;
      for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float d = amax / 127.0f, inv = d > 0.f ? 1.0f / d : 0.f;
      int32_t sum = 0;
      int8_t* qb = r.q.data() + m * k + b * kBlock;
      for (int64_t i = 0; i < kBlock; ++i) {
        const float v = std::min(127.0f, std::max(-127.0f, std::nearbyint(xb[i] * inv)));
        qb[i] = static_cast<int8_t>(v);
        sum += qb[i];
      }
      r.d[m * blocks + b] = d;
      r.qsum[m * groups + b / per_group] += d * static_cast<float>(sum);
    }
  return r;
}

// The portable loop: each block's int32 sum, then floats.
template <typename T>
void a8_rows_scalar(const XRows& xr, const uint8_t* q, const float* scales, const float* sz, T* y,
                    int64_t m_rows, int64_t n, int64_t k, int64_t group, int64_t bits, int64_t begin, int64_t end) {
  const int64_t groups = k / group, blocks = k / kBlock, half = group / 2, row_bytes = bits == 8 ? k : k / 2;
  const float mid = bits == 8 ? 0.f : 8.f;
  std::vector<int32_t> w(k);
  for (int64_t o = begin; o < end; ++o) {
    const uint8_t* row = q + o * row_bytes;
    if (bits == 8) {
      for (int64_t i = 0; i < k; ++i) w[i] = static_cast<int32_t>(row[i]) - 128;
    } else {
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t j = 0; j < half; ++j) {
          w[g * group + j] = row[g * half + j] & 15;
          w[g * group + j + half] = row[g * half + j] >> 4;
        }
    }
    for (int64_t m = 0; m < m_rows; ++m) {
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        float dot = 0.f;
        for (int64_t b = g * group / kBlock; b < (g + 1) * group / kBlock; ++b) {
          int32_t isum = 0;
          for (int64_t i = b * kBlock; i < (b + 1) * kBlock; ++i) isum += static_cast<int32_t>(xr.q[m * k + i]) * w[i];
          dot += xr.d[m * blocks + b] * static_cast<float>(isum);
        }
        const float s = scales[o * groups + g], qs = xr.qsum[m * groups + g];
        acc += s * (dot - mid * qs);
        if (sz != nullptr) acc -= sz[o * groups + g] * qs;
      }
      y[m * n + o] = static_cast<T>(acc);
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// 32 weights against MR rows' 32 quantized inputs: int16 pair sums (vpmaddubsw: one
// side unsigned) then int32 (vpmaddwd), as 8 floats times each lane's block scale.
// 4 bit: 16 bytes, the low nibbles the group's inputs c.., the high ones c + half..,
// unsigned 0..15 (the midpoint goes with qsum). 8 bit: 32 bytes of q - 128, signed:
// |w| unsigned against x carrying w's sign (|w| <= 128, so a pair stays in int16).
template <int64_t MR, int64_t BITS, typename T>
void a8_rows_avx2(const XRows& xr, const uint8_t* q, const float* scales, const float* sz, T* y,
                  int64_t n, int64_t k, int64_t group, int64_t begin, int64_t end) {
  const int64_t groups = k / group, blocks = k / kBlock, half = group / 2, row_bytes = BITS == 8 ? k : k / 2;
  const int64_t group_bytes = BITS == 8 ? group : half, chunk_bytes = BITS == 8 ? 32 : 16;
  const float mid = BITS == 8 ? 0.f : 8.f;
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(15), flip = _mm256_set1_epi8(-128);
  const int8_t* xq = xr.q;
  for (int64_t o = begin; o < end; ++o) {
    const uint8_t* row = q + o * row_bytes;
    __m256 acc[MR];
    float zero_term[MR];
    for (int64_t m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps(), zero_term[m] = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      const float s = scales[o * groups + g];
      const float z = s * mid + (sz != nullptr ? sz[o * groups + g] : 0.f);
      for (int64_t m = 0; m < MR; ++m) zero_term[m] += z * xr.qsum[m * groups + g];
      for (int64_t c = 0; c < group_bytes; c += chunk_bytes) {
        const uint8_t* qc = row + g * group_bytes + c;
        if constexpr (BITS == 8) {
          const __m256i w = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qc)), flip);
          const __m256i wabs = _mm256_abs_epi8(w);
          const int64_t at = g * group + c, b = at / kBlock;
          for (int64_t m = 0; m < MR; ++m) {
            const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * k + at));
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, _mm256_sign_epi8(xv, w)), ones);
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(s * xr.d[m * blocks + b]), acc[m]);
          }
        } else {
          const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qc));
          const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), low);
          const int64_t lo = g * group + c, hi = lo + half;  // the inputs of the low and high nibbles
          for (int64_t m = 0; m < MR; ++m) {
            const int8_t* xm = xq + m * k;
            const __m256i xv = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(xm + hi),
                                                   reinterpret_cast<const __m128i*>(xm + lo));
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), ones);
            const float* d = xr.d + m * blocks;
            const __m256 scale = _mm256_mul_ps(_mm256_set1_ps(s), _mm256_set_m128(_mm_set1_ps(d[hi / kBlock]),
                                                                                 _mm_set1_ps(d[lo / kBlock])));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc[m]);
          }
        }
      }
    }
    for (int64_t m = 0; m < MR; ++m) y[m * n + o] = static_cast<T>(hsum8(acc[m]) - zero_term[m]);
  }
}

// Groups of exactly 32 (every GGUF block type on this path), through eight_groups: eight
// groups' exact int32 sums reduced and converted together, the weight scales, the block scales and the zero
// terms of 8 groups one vector load and one FMA each rather than scalar work per group
// (AVX2 EPYC, one thread, [1, 576] x [576 -> 1536] 4 bit: 167 us group by group, 58 us so).
template <int64_t BITS>
inline __m256i a8_group_sums(const uint8_t* qg, const int8_t* xg) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (BITS == 8) {
    const __m256i w = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg)),
                                       _mm256_set1_epi8(-128));
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg));
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(xv, w)), ones);
  } else {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qg));
    const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), _mm256_set1_epi8(15));
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg));
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), ones);
  }
}

template <int64_t BITS, typename T>
void a8_g32_avx2(const XRows& xr, const uint8_t* q, const float* scales, const float* sz, T* y, int64_t m_rows,
                 int64_t n, int64_t k, int64_t begin, int64_t end) {
  constexpr int64_t kGroupBytes = BITS == 8 ? 32 : 16;
  const int64_t groups = k / 32;
  for (int64_t o = begin; o < end; ++o) {
    const uint8_t* row = q + o * groups * kGroupBytes;
    for (int64_t m = 0; m < m_rows; ++m) {
      const int8_t* xm = xr.q + m * k;
      const auto products = [&](int64_t g) { return a8_group_sums<BITS>(row + g * kGroupBytes, xm + g * 32); };
      // each group's integer sums times its weight scale and its block's activation scale
      y[m * n + o] = static_cast<T>(eight_groups(groups, products, scales + o * groups, xr.d + m * groups,
                                                 sz == nullptr ? nullptr : sz + o * groups, BITS == 8 ? 0.f : 8.f,
                                                 xr.qsum + m * groups));
    }
  }
}

template <int64_t BITS, typename T>
void a8_block_avx2(int64_t rows, const XRows& xr, const uint8_t* q, const float* scales, const float* sz,
                   T* y, int64_t n, int64_t k, int64_t group, int64_t begin, int64_t end) {
  switch (rows) {
    case 1: return a8_rows_avx2<1, BITS>(xr, q, scales, sz, y, n, k, group, begin, end);
    case 2: return a8_rows_avx2<2, BITS>(xr, q, scales, sz, y, n, k, group, begin, end);
    case 3: return a8_rows_avx2<3, BITS>(xr, q, scales, sz, y, n, k, group, begin, end);
    case 4: return a8_rows_avx2<4, BITS>(xr, q, scales, sz, y, n, k, group, begin, end);
  }
}
#endif

// The float32 [M, K] values the int8 blocks of x stand for (d_b * qx), bit for bit
// vframe.quant.kernels.builtin.quantize_per_block: what woq_cpu_a8 multiplies by the
// dequantized weight when a batch is too large for woq_gemm_a8 (prefill).
at::Tensor quantize_blocks_dequantized(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) % kBlock == 0, "quantize_blocks: x must be [M, K], K a multiple of 32");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t m_rows = x.size(0), k = x.size(1);
  const QuantizedRows xr = quantize_blocks(x.data_ptr<float>(), m_rows, k, k);
  at::Tensor out = at::empty({m_rows, k}, x.options());
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < m_rows * k; ++i) o[i] = static_cast<float>(xr.q[i]) * xr.d[i / kBlock];
  return out;
}

// x: [M, K] any float dtype; q, scales, scaled_zeros as woq_gemm's; group a multiple of 32.
at::Tensor woq_gemm_a8(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scales,
                       const at::Tensor& scaled_zeros, int64_t group, int64_t bits, at::ScalarType out_dtype) {
  TORCH_CHECK(bits == 8 || bits == 4, "woq_gemm_a8: bits must be 8 or 4, got ", bits);
  TORCH_CHECK(x_in.dim() == 2, "woq_gemm_a8: x must be [M, K]");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t m_rows = x.size(0), k = x.size(1), n = q.size(0);
  TORCH_CHECK(group > 0 && group % kBlock == 0 && k % group == 0, "woq_gemm_a8: group ", group,
              " must be a multiple of 32 that divides K=", k);
  check_weight("woq_gemm_a8", q, scales, scaled_zeros, k, group, bits);
  const bool zeros = scaled_zeros.numel() > 0;
  const QuantizedRows xr = quantize_blocks(x.data_ptr<float>(), m_rows, k, group);
  at::Tensor y = at::empty({m_rows, n}, x.options().dtype(out_dtype));
  const float* zs = zeros ? scaled_zeros.data_ptr<float>() : nullptr;
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  auto run = [&](auto* out) {
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      for (int64_t m0 = 0; m0 < m_rows; m0 += kA8Rows) {
        const int64_t rows = std::min(kA8Rows, m_rows - m0);
        const XRows part = rows_from(xr, m0, k, group);
#if defined(__AVX2__) && defined(__FMA__)
        if (group == 32) {
          if (bits == 8)
            a8_g32_avx2<8>(part, qp, sp, zs, out + m0 * n, rows, n, k, begin, end);
          else
            a8_g32_avx2<4>(part, qp, sp, zs, out + m0 * n, rows, n, k, begin, end);
        } else if (bits == 8)
          a8_block_avx2<8>(rows, part, qp, sp, zs, out + m0 * n, n, k, group, begin, end);
        else
          a8_block_avx2<4>(rows, part, qp, sp, zs, out + m0 * n, n, k, group, begin, end);
#else
        a8_rows_scalar(part, qp, sp, zs, out + m0 * n, rows, n, k, group, bits, begin, end);
#endif
      }
    });
  };
  AT_DISPATCH_V2(out_dtype, "woq_gemm_a8", AT_WRAP([&] { run(y.data_ptr<scalar_t>()); }), VFRAME_FLOAT_TYPES);
  return y;
}

// xq [T, K] int8 times weight [N, K] int8 transposed: exact int32 sums, as torch's _int_mm.
// CPUs with VNNI (AVX512-VNNI, AVX-VNNI) take _int_mm. Without it, torch's CPU _int_mm
// runs a slow generic path (AVX2 EPYC, one thread, [1, 576] x [576 -> 1536]: 0.67 ms,
// 6x float32's F.linear); the AVX2 loop here widens both sides to int16 once and sums
// pairs of products in int32 with vpmaddwd (|a b| <= 16,129, so a pair fits easily and
// the int32 sums are exact as _int_mm's), four activation rows per weight pass.
at::Tensor int8_products(const at::Tensor& xq, const at::Tensor& weight) {
#if defined(__AVX2__) && !defined(__AVX512VNNI__) && !defined(__AVXVNNI__)
  const int64_t t_rows = xq.size(0), k = xq.size(1), n = weight.size(0);
  if (k % 16 == 0) {
    constexpr int64_t kRows = 4;
    const at::Tensor w = weight.contiguous();
    std::vector<int16_t> x16(t_rows * k);  // the activations widened once
    const int8_t* xp = xq.data_ptr<int8_t>();
    for (int64_t i = 0; i < t_rows * k; ++i) x16[i] = xp[i];
    at::Tensor acc = at::empty({t_rows, n}, xq.options().dtype(at::kInt));
    int32_t* out = acc.data_ptr<int32_t>();
    const int8_t* wp = w.data_ptr<int8_t>();
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      for (int64_t o = begin; o < end; ++o) {
        const int8_t* row = wp + o * k;
        for (int64_t t0 = 0; t0 < t_rows; t0 += kRows) {
          const int64_t rows = std::min(kRows, t_rows - t0);
          __m256i sums[kRows];
          for (int64_t r = 0; r < kRows; ++r) sums[r] = _mm256_setzero_si256();
          for (int64_t i = 0; i < k; i += 16) {
            const __m256i w16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i)));
            for (int64_t r = 0; r < rows; ++r) {
              const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x16.data() + (t0 + r) * k + i));
              sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(x, w16));
            }
          }
          for (int64_t r = 0; r < rows; ++r) {
            __m128i v = _mm_add_epi32(_mm256_castsi256_si128(sums[r]), _mm256_extracti128_si256(sums[r], 1));
            v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0x4E));
            v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0xB1));
            out[(t0 + r) * n + o] = _mm_cvtsi128_si32(v);
          }
        }
      }
    });
    return acc;
  }
#endif
  return at::_int_mm(xq, weight.t());
}

// Row `row` (K floats) quantized as quantize_per_token spells it: scale = max(max |x|, 1e-12) / 127 and
// q = clamp(nearbyint(x / scale), -127, 127) (a NaN ends at -127, where std::max leaves it; vector max
// keeps its second operand likewise); q + 128 where OFFSET (int8_dynamic_vnni's unsigned operands).
// Returns the scale.
template <bool OFFSET>
float quantize_row(const float* row, int64_t k, uint8_t* q) {
  float amax = 0.f;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 m = _mm512_setzero_ps();
  for (; i + 16 <= k; i += 16) m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(row + i)), m);
  amax = _mm512_reduce_max_ps(m);
#endif
  for (; i < k; ++i) amax = std::max(amax, std::fabs(row[i]));
  const float scale = std::max(amax, 1e-12f) / 127.0f;
  const int offset = OFFSET ? 128 : 0;
  i = 0;
#if defined(__AVX512F__)
  const __m512 s = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  for (; i + 16 <= k; i += 16) {
    const __m512 v = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(row + i), s),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i n = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(v, lo), hi)),
                                       _mm512_set1_epi32(offset));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(n));
  }
#endif
  for (; i < k; ++i) {
    const float v = std::nearbyint(row[i] / scale);
    q[i] = static_cast<uint8_t>(static_cast<int>(std::min(127.0f, std::max(-127.0f, v))) + offset);
  }
  return scale;
}

#if defined(__AVX512F__)
// 16 floats stored as T, each rounded as static_cast<T> rounds: float16 by vcvtps2ph (to nearest even),
// bfloat16 by c10's round_to_nearest_even in integer arithmetic (a NaN as 0x7FC0; vcvtneps2bf16 would
// flush subnormals).
inline void store_as(float* out, __m512 v) { _mm512_storeu_ps(out, v); }
inline void store_as(at::Half* out, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void store_as(at::BFloat16* out, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7FFF));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(r));
}
#endif

#if defined(__AVX512VNNI__)
// 16 int32 vectors' lanes added: lane j of the result is the sum of v[j]'s 16 lanes (exact).
inline __m512i reduce16_epi32(const __m512i* v) {
  __m512i t[8], u[4];
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
  for (int j = 0; j < 4; ++j)
    u[j] = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2 * j], t[2 * j + 1]), _mm512_unpackhi_epi64(t[2 * j], t[2 * j + 1]));
  const __m512i x0 = _mm512_add_epi32(_mm512_shuffle_i32x4(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                      _mm512_shuffle_i32x4(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512i x1 = _mm512_add_epi32(_mm512_shuffle_i32x4(u[2], u[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                      _mm512_shuffle_i32x4(u[2], u[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(x0, x1, _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_i32x4(x0, x1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// W8A8 for a few rows on AVX512-VNNI, quantization, products and scaling in one pass: the rows
// quantized per token into unsigned bytes q + 128 (vpdpbusd multiplies unsigned by signed bytes; each
// output's sum gives back 128 w_sums), then per tile of 16 outputs (16 int32 sums a row in registers,
// reduced together) the exact sum, times the row's scale, times the outputs' w_scale, as x's dtype. A
// tile reads its weight rows one after another, one sequential stream a thread (16 rows interleaved
// with the next tile asked for ahead measured slower). For decode-sized T, where torch._int_mm (oneDNN)
// cost what a bfloat16 product does (SmolLM2 W8A8's batch-1 TPOT was 1.06-1.16x bf16's). The first VNNI
// loop (an output at a time with a horizontal add each, the quantization and scaling in scalar passes)
// took 5.2-5.6 us a call for 16 outputs against 3.7-3.9 now (2 threads, from Python).
template <typename T>
void int8_dynamic_vnni(const float* x, int64_t t_rows, int64_t k, const int8_t* w, const float* w_scale,
                       const int32_t* w_sums, int64_t n, T* out) {
  std::vector<uint8_t> xq(t_rows * k);
  std::vector<float> x_scale(t_rows);
  for (int64_t t = 0; t < t_rows; ++t) x_scale[t] = quantize_row<true>(x + t * k, k, xq.data() + t * k);
  const int64_t tiles = n / 16;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      const int8_t* wt = w + tile * 16 * k;
      for (int64_t t = 0; t < t_rows; ++t) {
        __m512i acc[16];
        for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_si512();
        const uint8_t* xr = xq.data() + t * k;
        for (int j = 0; j < 16; ++j)  // output by output: one sequential stream (measured faster than 16 interleaved)
          for (int64_t i = 0; i < k; i += 64)
            acc[j] = _mm512_dpbusd_epi32(acc[j], _mm512_loadu_si512(xr + i), _mm512_loadu_si512(wt + j * k + i));
        const __m512i sums = _mm512_sub_epi32(
            reduce16_epi32(acc), _mm512_slli_epi32(_mm512_loadu_si512(w_sums + tile * 16), 7));
        const __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(x_scale[t])),
                                       _mm512_loadu_ps(w_scale + tile * 16));
        store_as(out + t * n + tile * 16, y);
      }
    }
  });
  for (int64_t o = tiles * 16; o < n; ++o)  // the last n % 16 outputs, one at a time
    for (int64_t t = 0; t < t_rows; ++t) {
      __m512i acc = _mm512_setzero_si512();
      for (int64_t i = 0; i < k; i += 64)
        acc = _mm512_dpbusd_epi32(acc, _mm512_loadu_si512(xq.data() + t * k + i), _mm512_loadu_si512(w + o * k + i));
      const int32_t sum = _mm512_reduce_add_epi32(acc) - 128 * w_sums[o];
      out[t * n + o] = static_cast<T>(static_cast<float>(sum) * x_scale[t] * w_scale[o]);
    }
}
#endif

// W8A8 with dynamic per-token activations, as vframe.quant.kernels.builtin.quantize_per_token
// and Int8DynamicKernel spell it in PyTorch, in one call: each row of x scaled by
// max(|x|, 1e-12) / 127 and rounded half to even into int8, its exact int32 products with
// the int8 weight [N, K] (int8_products: torch's _int_mm, or the AVX2 loop above where the
// CPU has no VNNI; with the weight's row sums w_sums, up to 8 rows on AVX512-VNNI in one pass,
// int8_dynamic_vnni), then (acc * x_scale) * w_scale in float32, cast to x's dtype.
at::Tensor int8_dynamic_mm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& w_scale,
                           const std::optional<at::Tensor>& w_sums) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && weight.scalar_type() == at::kChar && x.size(1) == weight.size(1),
              "int8_dynamic_mm: x [T, K] and an int8 weight [N, K]");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous() && w_scale.numel() == weight.size(0),
              "int8_dynamic_mm: w_scale must be float32 [N]");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t t_rows = xf.size(0), k = xf.size(1), n = weight.size(0);
  const float* xp = xf.data_ptr<float>();
  at::Tensor out = at::empty({t_rows, n}, x.options());
#if defined(__AVX512VNNI__)
  if (w_sums.has_value() && t_rows <= 8 && k % 64 == 0 && weight.is_contiguous()) {
    TORCH_CHECK(w_sums->scalar_type() == at::kInt && w_sums->is_contiguous() && w_sums->numel() == n,
                "int8_dynamic_mm: w_sums must be int32 [N], the weight's row sums");
    AT_DISPATCH_V2(x.scalar_type(), "int8_dynamic_mm", AT_WRAP([&] {
      int8_dynamic_vnni(xp, t_rows, k, weight.const_data_ptr<int8_t>(), w_scale.const_data_ptr<float>(),
                        w_sums->const_data_ptr<int32_t>(), n, out.mutable_data_ptr<scalar_t>());
    }), VFRAME_FLOAT_TYPES);
    return out;
  }
#endif
  at::Tensor xq = at::empty({t_rows, k}, x.options().dtype(at::kChar));
  std::vector<float> x_scale(t_rows);
  for (int64_t t = 0; t < t_rows; ++t)
    x_scale[t] = quantize_row<false>(xp + t * k, k, reinterpret_cast<uint8_t*>(xq.data_ptr<int8_t>()) + t * k);
  const at::Tensor acc = int8_products(xq, weight);  // [T, N] int32, exact
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float* ws = w_scale.data_ptr<float>();
  auto fill = [&](auto* o) {
    using T = std::remove_pointer_t<decltype(o)>;
    for (int64_t t = 0; t < t_rows; ++t)
      for (int64_t j = 0; j < n; ++j) o[t * n + j] = static_cast<T>(static_cast<float>(ap[t * n + j]) * x_scale[t] * ws[j]);
  };
  AT_DISPATCH_V2(x.scalar_type(), "int8_dynamic_mm", AT_WRAP([&] { fill(out.data_ptr<scalar_t>()); }),
                 VFRAME_FLOAT_TYPES);
  return out;
}

// FP8 (e4m3fn) weights, a float32 scale per group of `group` consecutive inputs (the
// last group may be shorter: block-wise checkpoints cut their padding off):
//
//   y[m, o] = sum_g  s[o, g] * sum_{i in g} x[m, i] * e4m3(q[o, i])
//
// read in place, never dequantized into a float weight. e4m3's bits (s eeee mmm, bias 7)
// shifted into a float16's (s 0eeee mmm0000000, bias 15) give the same value times 2^-8
// (subnormals included), which F16C converts to float32 eight at a time; the 2^8 goes
// into the scale. The NaN bytes (0x7F, 0xFF) would read as 480: the kernel's prepare
// refuses weights holding them.
float e4m3_value(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  if (e == 15 && m == 7) return std::numeric_limits<float>::quiet_NaN();
  const float v = e == 0 ? std::ldexp(static_cast<float>(m) / 8.f, -6) : std::ldexp(1.f + static_cast<float>(m) / 8.f, e - 7);
  return (b & 0x80) ? -v : v;
}

const float* e4m3_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int b = 0; b < 256; ++b) t[b] = e4m3_value(static_cast<uint8_t>(b));
    return t;
  }();
  return table.data();
}

constexpr int64_t kFp8Rows = 4;  // activation rows per pass over a weight row

// f(std::integral_constant<int64_t, rows>{}) for rows in 1 .. kFp8Rows: a row-count
// template argument picked at run time.
template <typename F>
void with_rows(int64_t rows, F&& f) {
  switch (rows) {
    case 1: f(std::integral_constant<int64_t, 1>{}); break;
    case 2: f(std::integral_constant<int64_t, 2>{}); break;
    case 3: f(std::integral_constant<int64_t, 3>{}); break;
    default: f(std::integral_constant<int64_t, kFp8Rows>{}); break;
  }
}

// The in-place products' common frame (fp8_gemm, fp4_gemm, lut4_gemm): x ([M, K]) read as float32,
// the N outputs shared among the threads, the activation rows taken kFp8Rows at a time;
// rows(x_rows, y_rows, count, begin, end) computes outputs begin .. end of `count` rows
// (x_rows [count, K], y_rows [count, N] of out_dtype, any of VFRAME_FLOAT_TYPES).
template <typename Rows>
at::Tensor rows_gemm(const at::Tensor& x_in, int64_t n, at::ScalarType out_dtype, Rows&& rows) {
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t m_rows = x.size(0), k = x.size(1);
  at::Tensor y = at::empty({m_rows, n}, x.options().dtype(out_dtype));
  const float* xp = x.data_ptr<float>();
  auto run = [&](auto* out) {
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      for (int64_t m0 = 0; m0 < m_rows; m0 += kFp8Rows)
        rows(xp + m0 * k, out + m0 * n, std::min(kFp8Rows, m_rows - m0), begin, end);
    });
  };
  AT_DISPATCH_V2(out_dtype, "rows_gemm", AT_WRAP([&] { run(y.data_ptr<scalar_t>()); }), VFRAME_FLOAT_TYPES);
  return y;
}

// The dequantizations' common frame (fp8_dequantize, fp4_dequantize, lut4_dequantize): a
// weight [N, K] of out_dtype, its rows shared among the threads; row(o, w_row) fills row o
// (w_row: K values of any of VFRAME_FLOAT_TYPES).
template <typename Row>
at::Tensor rows_dequantize(const at::TensorOptions& options, int64_t n, int64_t k, at::ScalarType out_dtype,
                           Row&& row) {
  at::Tensor w = at::empty({n, k}, options.dtype(out_dtype));
  auto fill = [&](auto* out) {
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      for (int64_t o = begin; o < end; ++o) row(o, out + o * k);
    });
  };
  AT_DISPATCH_V2(out_dtype, "rows_dequantize", AT_WRAP([&] { fill(w.data_ptr<scalar_t>()); }), VFRAME_FLOAT_TYPES);
  return w;
}

template <typename T>
void fp8_rows_scalar(const float* x, const uint8_t* q, const float* scales, T* y, int64_t m_rows, int64_t n,
                     int64_t k, int64_t group, int64_t begin, int64_t end) {
  const float* table = e4m3_table();
  const int64_t groups = (k + group - 1) / group;
  std::vector<float> w(k);
  for (int64_t o = begin; o < end; ++o) {
    for (int64_t i = 0; i < k; ++i) w[i] = table[q[o * k + i]];
    for (int64_t m = 0; m < m_rows; ++m) {
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        float d = 0.f;
        for (int64_t i = g * group; i < std::min(k, (g + 1) * group); ++i) d += x[m * k + i] * w[i];
        acc += scales[o * groups + g] * d;
      }
      y[m * n + o] = static_cast<T>(acc);
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
template <int64_t MR, typename T>
void fp8_rows_avx2(const float* x, const uint8_t* q, const float* scales, T* y, int64_t n, int64_t k, int64_t group,
                   int64_t begin, int64_t end) {
  const int64_t groups = (k + group - 1) / group;
  const __m256i magnitude = _mm256_set1_epi16(0x7F), sign = _mm256_set1_epi16(0x80);
  for (int64_t o = begin; o < end; ++o) {
    const uint8_t* row = q + o * k;
    __m256 acc[MR];
    for (int64_t m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m256 part[MR];
      for (int64_t m = 0; m < MR; ++m) part[m] = _mm256_setzero_ps();
      for (int64_t i = g * group; i < std::min(k, (g + 1) * group); i += 16) {
        const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i)));
        const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, magnitude), 7),
                                          _mm256_slli_epi16(_mm256_and_si256(b, sign), 8));
        const __m256 w0 = _mm256_cvtph_ps(_mm256_castsi256_si128(h)), w1 = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
        for (int64_t m = 0; m < MR; ++m) {
          part[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * k + i), w0, part[m]);
          part[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * k + i + 8), w1, part[m]);
        }
      }
      const __m256 s = _mm256_set1_ps(scales[o * groups + g] * 256.f);  // float16's 2^-8 undone
      for (int64_t m = 0; m < MR; ++m) acc[m] = _mm256_fmadd_ps(part[m], s, acc[m]);
    }
    for (int64_t m = 0; m < MR; ++m) y[m * n + o] = static_cast<T>(hsum8(acc[m]));
  }
}
#endif

// x: [M, K] any float dtype (read as float32); q: uint8 [N, K], the e4m3 bits; scales:
// float32 [N, ceil(K / group)]. Returns [M, N] of out_dtype.
at::Tensor fp8_gemm(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scales, int64_t group,
                    at::ScalarType out_dtype) {
  TORCH_CHECK(x_in.dim() == 2, "fp8_gemm: x must be [M, K]");
  const int64_t k = x_in.size(1), n = q.size(0), groups = (k + group - 1) / group;
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous() && q.dim() == 2 && q.size(1) == k,
              "fp8_gemm: q must be contiguous uint8 [N, ", k, "]");
  TORCH_CHECK(group > 0 && scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.size(0) == n &&
                  scales.size(1) == groups,
              "fp8_gemm: scales must be float32 [N, ceil(K / group)]");
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  return rows_gemm(x_in, n, out_dtype, [&](const float* x, auto* y, int64_t rows, int64_t begin,
                                           int64_t end) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    if (group % 16 == 0 && k % 16 == 0) {
      with_rows(rows, [&](auto r) { fp8_rows_avx2<decltype(r)::value>(x, qp, sp, y, n, k, group, begin, end); });
      return;
    }
#endif
    fp8_rows_scalar(x, qp, sp, y, rows, n, k, group, begin, end);
  });
}

// The float weight [N, K] of out_dtype: e4m3(q) * s in float32 (the PyTorch expression
// Fp8Weight.dequantize() spells), then cast.
at::Tensor fp8_dequantize(const at::Tensor& q, const at::Tensor& scales, int64_t group, at::ScalarType out_dtype) {
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous() && q.dim() == 2, "fp8_dequantize: q must be contiguous uint8 [N, K]");
  const int64_t n = q.size(0), k = q.size(1), groups = (k + group - 1) / group;
  TORCH_CHECK(group > 0 && scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.size(0) == n &&
                  scales.size(1) == groups,
              "fp8_dequantize: scales must be float32 [N, ceil(K / group)]");
  const float* table = e4m3_table();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  return rows_dequantize(q.options(), n, k, out_dtype, [&](int64_t o, auto* w) {
    using T = std::remove_pointer_t<decltype(w)>;
    for (int64_t i = 0; i < k; ++i) w[i] = static_cast<T>(table[qp[o * k + i]] * sp[o * groups + i / group]);
  });
}

// FP4 weights: two e2m1 codes a byte, input 2j in the low nibble of byte j; a code's
// bit 3 is its sign and bits 0-2 pick one of eight magnitudes. Each group of `group`
// inputs has a scale byte, which the row's float32 global scale divides: NVFP4 groups of
// 16 with e4m3 scales, MXFP4 groups of 32 with e8m0 ones (2^(byte - 127), global 1):
//
//   y[m, o] = sum_i x[m, i] * (e2m1(q[o, i]) * (scale(s[o, i / group]) / gs[o]))
//
// The codes are read in place. On AVX2 eight codes are one 32-bit word: each lane
// shifts its nibble down, vpermps looks its magnitude up (it reads the index's low
// three bits) and the code's bit 3 becomes the float's sign.
constexpr float kE2M1[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
constexpr int64_t kScaleE4m3 = 0, kScaleE8m0 = 1;  // the scale byte formats

inline float e2m1_value(uint8_t code) { return (code & 8) ? -kE2M1[code & 7] : kE2M1[code & 7]; }

// 2^(b - 127) for every byte (0: 2^-127, a subnormal; 255, NaN in the format, reads as
// infinity here, as compressed-tensors' 2.0 ** 128 does: Fp4CpuKernel.prepare refuses it).
const float* e8m0_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int b = 0; b < 256; ++b) {
      const uint32_t bits = b == 0 ? 0x00400000u : static_cast<uint32_t>(b) << 23;
      std::memcpy(&t[b], &bits, sizeof(float));
    }
    return t;
  }();
  return table.data();
}

const float* fp4_scale_table(int64_t scale_format) {
  return scale_format == kScaleE8m0 ? e8m0_table() : e4m3_table();
}

template <typename T>
void fp4_rows_scalar(const float* x, const uint8_t* q, const uint8_t* s, const float* gs, const float* table, T* y,
                     int64_t m_rows, int64_t n, int64_t k, int64_t group, int64_t begin, int64_t end) {
  const int64_t groups = k / group;
  std::vector<float> w(k);  // the row's dequantized weight
  for (int64_t o = begin; o < end; ++o) {
    for (int64_t j = 0; j < k / 2; ++j) {
      const uint8_t b = q[o * (k / 2) + j];
      const float scale = table[s[o * groups + 2 * j / group]] / gs[o];
      w[2 * j] = e2m1_value(b & 15) * scale;
      w[2 * j + 1] = e2m1_value(b >> 4) * scale;
    }
    for (int64_t m = 0; m < m_rows; ++m) {
      float acc = 0.f;
      for (int64_t i = 0; i < k; ++i) acc += x[m * k + i] * w[i];
      y[m * n + o] = static_cast<T>(acc);
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// Eight e2m1 codes (the nibbles of `word`, lowest first) as floats.
inline __m256 e2m1_8(uint32_t word) {
  const __m256i codes = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
  const __m256 magnitude = _mm256_permutevar8x32_ps(_mm256_loadu_ps(kE2M1), codes);
  const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(codes, 28), _mm256_set1_epi32(static_cast<int>(0x80000000u)));
  return _mm256_or_ps(magnitude, _mm256_castsi256_ps(sign));
}

// Per group: its scale (table / global), each word of eight codes times it (the
// dequantized weight's values, rounded as fp4_dequantize rounds them), then one FMA per
// activation row and vector, in two chains.
template <int64_t MR, typename T>
void fp4_rows_avx2(const float* x, const uint8_t* q, const uint8_t* s, const float* gs, const float* table, T* y,
                   int64_t n, int64_t k, int64_t group, int64_t begin, int64_t end) {
  const int64_t groups = k / group;
  for (int64_t o = begin; o < end; ++o) {
    const uint8_t* row = q + o * (k / 2);
    const uint8_t* row_scales = s + o * groups;
    const float global = gs[o];
    __m256 acc[MR][2];
    for (int64_t m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const __m256 scale = _mm256_set1_ps(table[row_scales[g]] / global);
      for (int64_t i = g * group; i < (g + 1) * group; i += 16) {
        uint32_t words[2];
        std::memcpy(words, row + i / 2, sizeof(words));
        const __m256 w0 = _mm256_mul_ps(e2m1_8(words[0]), scale), w1 = _mm256_mul_ps(e2m1_8(words[1]), scale);
        for (int64_t m = 0; m < MR; ++m) {
          acc[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * k + i), w0, acc[m][0]);
          acc[m][1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * k + i + 8), w1, acc[m][1]);
        }
      }
    }
    for (int64_t m = 0; m < MR; ++m) y[m * n + o] = static_cast<T>(hsum8(_mm256_add_ps(acc[m][0], acc[m][1])));
  }
}
#endif

void check_fp4(const char* op, const at::Tensor& q, const at::Tensor& scales, const at::Tensor& global_scale,
               int64_t group, int64_t scale_format) {
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous() && q.dim() == 2, op,
              ": q must be contiguous uint8 [N, K / 2]");
  TORCH_CHECK(group % 16 == 0 && group > 0, op, ": group must be a positive multiple of 16");
  TORCH_CHECK(scale_format == kScaleE4m3 || scale_format == kScaleE8m0, op, ": scale_format must be 0 (e4m3) or 1 (e8m0)");
  const int64_t n = q.size(0), k = q.size(1) * 2;
  TORCH_CHECK(k % group == 0, op, ": K must be a multiple of ", group);
  TORCH_CHECK(scales.scalar_type() == at::kByte && scales.is_contiguous() && scales.dim() == 2 && scales.size(0) == n &&
                  scales.size(1) == k / group,
              op, ": scales must be contiguous uint8 [N, K / group]");
  TORCH_CHECK(global_scale.scalar_type() == at::kFloat && global_scale.is_contiguous() && global_scale.dim() == 1 &&
                  global_scale.size(0) == n,
              op, ": global_scale must be float32 [N]");
}

// x: [M, K] any float dtype (read as float32); q: uint8 [N, K / 2]; scales: uint8
// [N, K / group] (e4m3 or e8m0 bytes, scale_format); global_scale: float32 [N].
// Returns [M, N] of out_dtype.
at::Tensor fp4_gemm(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scales,
                    const at::Tensor& global_scale, int64_t group, int64_t scale_format, at::ScalarType out_dtype) {
  TORCH_CHECK(x_in.dim() == 2, "fp4_gemm: x must be [M, K]");
  check_fp4("fp4_gemm", q, scales, global_scale, group, scale_format);
  const int64_t k = x_in.size(1), n = q.size(0);
  TORCH_CHECK(q.size(1) * 2 == k, "fp4_gemm: x has ", k, " inputs, q ", q.size(1) * 2);
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const uint8_t* sp = scales.data_ptr<uint8_t>();
  const float* gp = global_scale.data_ptr<float>();
  const float* table = fp4_scale_table(scale_format);
  return rows_gemm(x_in, n, out_dtype, [&](const float* x, auto* y, int64_t rows, int64_t begin,
                                           int64_t end) {
#if defined(__AVX2__) && defined(__FMA__)
    with_rows(rows, [&](auto r) {
      fp4_rows_avx2<decltype(r)::value>(x, qp, sp, gp, table, y, n, k, group, begin, end);
    });
#else
    fp4_rows_scalar(x, qp, sp, gp, table, y, rows, n, k, group, begin, end);
#endif
  });
}

// The float weight [N, K] of out_dtype: e2m1(q) * (scale(s) / gs) in float32 (the PyTorch
// expression Fp4Weight.dequantize() spells), then cast.
at::Tensor fp4_dequantize(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& global_scale, int64_t group,
                          int64_t scale_format, at::ScalarType out_dtype) {
  check_fp4("fp4_dequantize", q, scales, global_scale, group, scale_format);
  const int64_t n = q.size(0), k = q.size(1) * 2, groups = k / group;
  const float* table = fp4_scale_table(scale_format);
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const uint8_t* sp = scales.data_ptr<uint8_t>();
  const float* gp = global_scale.data_ptr<float>();
  return rows_dequantize(q.options(), n, k, out_dtype, [&](int64_t o, auto* w) {
    using T = std::remove_pointer_t<decltype(w)>;
    for (int64_t g = 0; g < groups; ++g) {
      const float scale = table[sp[o * groups + g]] / gp[o];
      for (int64_t i = g * group; i < (g + 1) * group; i += 16) {
        const uint8_t* codes = qp + o * (k / 2) + i / 2;
        T* wi = w + i;
#if defined(__AVX2__) && defined(__FMA__)
        // the same products, eight at a time (e2m1 values are exact in float32)
        alignas(32) float values[16];
        uint32_t words[2];
        std::memcpy(words, codes, sizeof(words));
        _mm256_store_ps(values, _mm256_mul_ps(e2m1_8(words[0]), _mm256_set1_ps(scale)));
        _mm256_store_ps(values + 8, _mm256_mul_ps(e2m1_8(words[1]), _mm256_set1_ps(scale)));
        for (int64_t j = 0; j < 16; ++j) wi[j] = static_cast<T>(values[j]);
#else
        for (int64_t j = 0; j < 8; ++j) {
          wi[2 * j] = static_cast<T>(e2m1_value(codes[j] & 15) * scale);
          wi[2 * j + 1] = static_cast<T>(e2m1_value(codes[j] >> 4) * scale);
        }
#endif
      }
    }
  });
}

// 4-bit codes looked up in a 16-value table (bitsandbytes' NF4 / FP4, builtin.py's
// Lut4CpuKernel): two codes a byte, input 2j in the low nibble of byte j; each group of
// `group` inputs of a row has a float32 scale:
//
//   y[m, o] = sum_i x[m, i] * (table[q[o, i]] * s[o, i / group])
//
// the product table * scale in float32 (bitsandbytes' dequantize_4bit), then the sum.
template <typename T>
void lut4_rows_scalar(const float* x, const uint8_t* q, const float* s, const float* table, T* y, int64_t m_rows,
                      int64_t n, int64_t k, int64_t group, int64_t begin, int64_t end) {
  const int64_t groups = k / group;
  std::vector<float> w(k);  // the row's dequantized weight
  for (int64_t o = begin; o < end; ++o) {
    for (int64_t j = 0; j < k / 2; ++j) {
      const uint8_t b = q[o * (k / 2) + j];
      const float scale = s[o * groups + 2 * j / group];
      w[2 * j] = table[b & 15] * scale;
      w[2 * j + 1] = table[b >> 4] * scale;
    }
    for (int64_t m = 0; m < m_rows; ++m) {
      float acc = 0.f;
      for (int64_t i = 0; i < k; ++i) acc += x[m * k + i] * w[i];
      y[m * n + o] = static_cast<T>(acc);
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// Eight codes (the nibbles of `word`, lowest first) looked up in a table held as two
// registers of eight values: vpermps reads each index's low three bits from both, bit 3
// picks one (moved to the sign bit, which blendv reads).
inline __m256 lut16_8(uint32_t word, __m256 low, __m256 high) {
  const __m256i codes = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
  const __m256 a = _mm256_permutevar8x32_ps(low, codes), b = _mm256_permutevar8x32_ps(high, codes);
  return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(codes, 28)));
}

// Per group: each word of eight codes looked up and times the group's scale (the
// dequantized weight's values, as lut4_dequantize rounds them), then one FMA per
// activation row and vector, in two chains.
template <int64_t MR, typename T>
void lut4_rows_avx2(const float* x, const uint8_t* q, const float* s, const float* table, T* y, int64_t n, int64_t k,
                    int64_t group, int64_t begin, int64_t end) {
  const int64_t groups = k / group;
  const __m256 low = _mm256_loadu_ps(table), high = _mm256_loadu_ps(table + 8);
  for (int64_t o = begin; o < end; ++o) {
    const uint8_t* row = q + o * (k / 2);
    const float* row_scales = s + o * groups;
    __m256 acc[MR][2];
    for (int64_t m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const __m256 scale = _mm256_set1_ps(row_scales[g]);
      for (int64_t i = g * group; i < (g + 1) * group; i += 16) {
        uint32_t words[2];
        std::memcpy(words, row + i / 2, sizeof(words));
        const __m256 w0 = _mm256_mul_ps(lut16_8(words[0], low, high), scale);
        const __m256 w1 = _mm256_mul_ps(lut16_8(words[1], low, high), scale);
        for (int64_t m = 0; m < MR; ++m) {
          acc[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * k + i), w0, acc[m][0]);
          acc[m][1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * k + i + 8), w1, acc[m][1]);
        }
      }
    }
    for (int64_t m = 0; m < MR; ++m) y[m * n + o] = static_cast<T>(hsum8(_mm256_add_ps(acc[m][0], acc[m][1])));
  }
}
#endif

#if defined(__AVX512F__)
// Sixteen codes (eight bytes, the low nibble of each first) looked up in the 16-value table,
// one register: each byte's nibbles spread to two bytes in input order, widened to 32 bits,
// vpermps.
inline __m512 lut16_16(const uint8_t* bytes, __m512 table) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes));
  const __m128i nibble = _mm_set1_epi8(0x0F);
  const __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(b, nibble), _mm_and_si128(_mm_srli_epi16(b, 4), nibble));
  return _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(codes), table);
}

// lut4_rows_avx2 sixteen codes a vector: per group of a multiple of 16, each vector's values
// times the scale (the dequantized weight's, as lut4_dequantize rounds them), FMAs in two chains.
template <int64_t MR, typename T>
void lut4_rows_avx512(const float* x, const uint8_t* q, const float* s, const float* table, T* y, int64_t n,
                      int64_t k, int64_t group, int64_t begin, int64_t end) {
  const int64_t groups = k / group;
  const __m512 tab = _mm512_loadu_ps(table);
  for (int64_t o = begin; o < end; ++o) {
    const uint8_t* row = q + o * (k / 2);
    const float* row_scales = s + o * groups;
    __m512 acc[MR][2];
    for (int64_t m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const __m512 scale = _mm512_set1_ps(row_scales[g]);
      const int64_t stop = (g + 1) * group;
      int64_t i = g * group;
      for (; i + 32 <= stop; i += 32) {
        const __m512 w0 = _mm512_mul_ps(lut16_16(row + i / 2, tab), scale);
        const __m512 w1 = _mm512_mul_ps(lut16_16(row + i / 2 + 8, tab), scale);
        for (int64_t m = 0; m < MR; ++m) {
          acc[m][0] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * k + i), w0, acc[m][0]);
          acc[m][1] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * k + i + 16), w1, acc[m][1]);
        }
      }
      if (i < stop) {  // a group of 16 more
        const __m512 w0 = _mm512_mul_ps(lut16_16(row + i / 2, tab), scale);
        for (int64_t m = 0; m < MR; ++m) acc[m][0] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * k + i), w0, acc[m][0]);
      }
    }
    for (int64_t m = 0; m < MR; ++m) y[m * n + o] = static_cast<T>(_mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1])));
  }
}
#endif

void check_lut4(const char* op, const at::Tensor& q, const at::Tensor& scales, const at::Tensor& table, int64_t group) {
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous() && q.dim() == 2, op,
              ": q must be contiguous uint8 [N, K / 2]");
  TORCH_CHECK(group % 16 == 0 && group > 0, op, ": group must be a positive multiple of 16");
  const int64_t n = q.size(0), k = q.size(1) * 2;
  TORCH_CHECK(k % group == 0, op, ": K must be a multiple of ", group);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == n && scales.size(1) == k / group,
              op, ": scales must be contiguous float32 [N, K / group]");
  TORCH_CHECK(table.scalar_type() == at::kFloat && table.is_contiguous() && table.dim() == 1 && table.size(0) == 16,
              op, ": table must be contiguous float32 [16]");
}

// x: [M, K] any float dtype (read as float32); q: uint8 [N, K / 2]; scales: float32
// [N, K / group]; table: float32 [16]. Returns [M, N] of out_dtype.
at::Tensor lut4_gemm(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scales, const at::Tensor& table,
                     int64_t group, at::ScalarType out_dtype) {
  TORCH_CHECK(x_in.dim() == 2, "lut4_gemm: x must be [M, K]");
  check_lut4("lut4_gemm", q, scales, table, group);
  const int64_t k = x_in.size(1), n = q.size(0);
  TORCH_CHECK(q.size(1) * 2 == k, "lut4_gemm: x has ", k, " inputs, q ", q.size(1) * 2);
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* tp = table.data_ptr<float>();
  return rows_gemm(x_in, n, out_dtype, [&](const float* x, auto* y, int64_t rows, int64_t begin,
                                           int64_t end) {
#if defined(__AVX512F__)
    with_rows(rows, [&](auto r) {
      lut4_rows_avx512<decltype(r)::value>(x, qp, sp, tp, y, n, k, group, begin, end);
    });
#elif defined(__AVX2__) && defined(__FMA__)
    with_rows(rows, [&](auto r) {
      lut4_rows_avx2<decltype(r)::value>(x, qp, sp, tp, y, n, k, group, begin, end);
    });
#else
    lut4_rows_scalar(x, qp, sp, tp, y, rows, n, k, group, begin, end);
#endif
  });
}

// The float weight [N, K] of out_dtype: table[q] * scale in float32 (Lut4Weight.dequantize()), then cast:
// sixteen values a step, looked up as lut4_gemm looks them up (AVX-512: one vpermps, stored by store_as;
// AVX2: two words of eight), each product rounded once to out_dtype. SmolLM2's 120 layer shapes, random
// NF4 codes, 2 threads, Zen 4: float32 26 -> 7-10 ms, bfloat16 85 -> 12 ms against the scalar loop's.
at::Tensor lut4_dequantize(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& table, int64_t group,
                           at::ScalarType out_dtype) {
  check_lut4("lut4_dequantize", q, scales, table, group);
  const int64_t n = q.size(0), k = q.size(1) * 2, groups = k / group;
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* tp = table.data_ptr<float>();
#if defined(__AVX512F__)
  const __m512 tab = _mm512_loadu_ps(tp);
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 low = _mm256_loadu_ps(tp), high = _mm256_loadu_ps(tp + 8);
#endif
  return rows_dequantize(q.options(), n, k, out_dtype, [&](int64_t o, auto* w) {
    using T = std::remove_pointer_t<decltype(w)>;
    const uint8_t* row = qp + o * (k / 2);
    for (int64_t g = 0; g < groups; ++g) {
      const float scale = sp[o * groups + g];
      for (int64_t i = g * group; i < (g + 1) * group; i += 16) {
#if defined(__AVX512F__)
        store_as(w + i, _mm512_mul_ps(lut16_16(row + i / 2, tab), _mm512_set1_ps(scale)));
#else
        alignas(32) float values[16];
#if defined(__AVX2__) && defined(__FMA__)
        uint32_t words[2];
        std::memcpy(words, row + i / 2, sizeof(words));
        _mm256_store_ps(values, _mm256_mul_ps(lut16_8(words[0], low, high), _mm256_set1_ps(scale)));
        _mm256_store_ps(values + 8, _mm256_mul_ps(lut16_8(words[1], low, high), _mm256_set1_ps(scale)));
#else
        for (int64_t j = 0; j < 8; ++j) {
          values[2 * j] = tp[row[i / 2 + j] & 15] * scale;
          values[2 * j + 1] = tp[row[i / 2 + j] >> 4] * scale;
        }
#endif
        for (int64_t j = 0; j < 16; ++j) w[i + j] = static_cast<T>(values[j]);
#endif
      }
    }
  });
}

}  // namespace

// torch's CPU int4 packing (torch._convert_weight_to_int4pack_for_cpu), dequantized for
// prefills, where one bfloat16 GEMM over the dequantized weight beats torch's int4 kernel
// (vframe/quant/int4_cpu.py). The [N, K / 2] bytes are [N / 64, K, 32]: byte (b, k, i)
// holds input k of output 64 b + i in its low nibble and of output 64 b + 32 + i in its
// high one. Scales and zeros are bfloat16 [K / group, N, 2]; in float32, as the kernel:
//
//   w[o, k] = (q[o, k] - 8) * scale[k / group, o] + zero[k / group, o]
at::Tensor int4pack_dequantize(const at::Tensor& packed, const at::Tensor& scales_and_zeros, int64_t group) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 2 &&
                  packed.size(0) % 64 == 0,
              "int4pack_dequantize: packed must be contiguous uint8 [N, K / 2] with N a multiple of 64");
  const int64_t n = packed.size(0), k = packed.size(1) * 2;
  TORCH_CHECK(group > 0 && k % group == 0 && scales_and_zeros.scalar_type() == at::kBFloat16 &&
                  scales_and_zeros.is_contiguous() && scales_and_zeros.dim() == 3 &&
                  scales_and_zeros.size(0) == k / group && scales_and_zeros.size(1) == n && scales_and_zeros.size(2) == 2,
              "int4pack_dequantize: scales_and_zeros must be bfloat16 [K / group, N, 2]");
  const uint8_t* qp = packed.data_ptr<uint8_t>();
  const at::BFloat16* sz = scales_and_zeros.data_ptr<at::BFloat16>();
  at::Tensor w = at::empty({n, k}, packed.options().dtype(at::kBFloat16));
  at::BFloat16* out = w.data_ptr<at::BFloat16>();
  at::parallel_for(0, n, 8, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      const int64_t block = o / 64, lane = o % 32;
      const int shift = (o % 64) < 32 ? 0 : 4;
      const uint8_t* bytes = qp + block * k * 32 + lane;  // input i's byte: bytes[i * 32]
      at::BFloat16* row = out + o * k;
      for (int64_t g = 0; g < k / group; ++g) {
        const float scale = static_cast<float>(sz[(g * n + o) * 2]), zero = static_cast<float>(sz[(g * n + o) * 2 + 1]);
        for (int64_t i = g * group; i < (g + 1) * group; ++i)
          row[i] = static_cast<at::BFloat16>(static_cast<float>(((bytes[i * 32] >> shift) & 15) - 8) * scale + zero);
      }
    }
  });
  return w;
}


// Pairs (vframe/quant/kernels/builtin.py, Int4PairsKernel / Int8PairsKernel): 4- and 8-bit weights laid
// out so that a shift and a mask give AVX512-BF16's vdpbf16ps operands, for bfloat16 activations. Per
// block of 16 outputs, 64 bytes a step, read as 32 little-endian 16-bit words, word 2n + j for output n:
//
//   4 bit, a step 8 inputs 8p .. 8p + 7: word 2n + j's nibble t (bits 4t .. 4t + 3) holds input
//          8p + 2t + j; q [N / 16, K / 8, 64]
//   8 bit, a step 4 inputs 4p .. 4p + 3: word 2n + j's low byte holds input 4p + j, its high byte
//          input 4p + 2 + j; q [N / 16, K / 4, 64]
//   6 bit, a step 8 inputs: the 4-bit layout of each code's low 4 bits (64 bytes a step), then, after a
//          block's last step, 32 bytes a step, byte 2n + j holding the high 2 bits of the same four inputs
//          (bits 2t .. 2t + 1: input 8p + 2t + j); q [N / 16, K / 8, 96], a block's K / 8 x 96 bytes
//          read as K / 8 x 64 then K / 8 x 32 (no load crosses a cache line)
//
//   scales / zeros [N / 16, K / group, 16] float32 or float16 (both the same)
//   w[o, k] = scales[o, g] * q[o, k] + zeros[o, g]     (g = k / group; no zeros: scales[o, g] * (q[o, k] - 2^(bits - 1));
//                                                       zero_points: scales[o, g] * (q[o, k] - zeros[o, g]), GPTQ / AWQ's
//                                                       integer zero points, exact in float16 where -scale z is not)
//
// Bits masked out of each word and or-ed with 0x4300 (the bfloat16 128) are a bfloat16, exactly: 4 bit, a
// nibble c at bits 0-3 is 128 + c, and the words' four nibble planes (shifted down) are four vdpbf16ps
// weight operands, plane t against inputs (8p + 2t, 8p + 2t + 1); a group's sum is
// sum x (128 + q) = sum x q + 128 sum x. 8 bit, q = 128 h + l: a byte's bits 0-6 give 128 + l, its bit 7
// (the bfloat16's lowest exponent bit) 128 + 128 h, both against the byte's inputs (the low byte (4p,
// 4p + 1), the high byte, shifted down, (4p + 2, 4p + 3)); a group's sum is sum x q + 256 sum x. 6 bit:
// plane t's nibble with its two high bits or-ed in at bits 4-5 (widened from the step's last 32 bytes),
// 128 + q as at 4 bit. One shift a step at 8 bit, three at 4, six at 6. Each group's sum, in float32, is
// scaled and corrected by its inputs' sum (the planes' 128 / 256, and the zeros): tiles of up to 4 rows x
// 32 outputs (one or two rows x 64), every weight byte read once a tile, and while a thread works on one
// panel of outputs it asks for the next (PairsPrefetch). pairs_dequantize gives the weight as bfloat16
// pairs ([N / 16, K / 2, 16, 2], what cpu_ops' bf16_gemm reads) for prefills, each value rounded once
// from the float32 expression above.
bool pairs_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

namespace {

// inputs a step of a block covers, and its bytes
constexpr int64_t pairs_step_inputs(int64_t bits) { return bits == 8 ? 4 : 8; }
constexpr int64_t pairs_step_bytes(int64_t bits) { return bits == 6 ? 96 : 64; }

void check_pairs(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& zeros, int64_t group, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "pairs: bits must be 4, 6 or 8, not ", bits);
  const int64_t step = pairs_step_inputs(bits), step_bytes = pairs_step_bytes(bits);
  TORCH_CHECK(q.scalar_type() == at::kByte && q.dim() == 3 && q.size(2) == step_bytes && q.is_contiguous(),
              "pairs: q must be contiguous uint8 [N / 16, K / ", step, ", ", step_bytes, "]");
  const int64_t inputs = q.size(1) * step;
  TORCH_CHECK(group > 0 && group % step == 0 && inputs % group == 0, "pairs: the group (", group,
              ") must be a multiple of ", step, " that divides the ", inputs, " inputs");
  TORCH_CHECK((scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf) && scales.is_contiguous() &&
                  scales.dim() == 3 && scales.size(0) == q.size(0) && scales.size(1) == inputs / group &&
                  scales.size(2) == 16,
              "pairs: scales must be contiguous float32 or float16 [N / 16, K / group, 16]");
  TORCH_CHECK(zeros.numel() == 0 || zeros.sizes() == scales.sizes(), "pairs: zeros must be empty or shaped as scales");
  TORCH_CHECK(zeros.numel() == 0 || (zeros.scalar_type() == scales.scalar_type() && zeros.is_contiguous()),
              "pairs: zeros must be contiguous, of the scales' dtype");
}

#if defined(__AVX512BF16__)
// The lines a tile asks for while it runs (the panel its thread takes next: see pairs_product): n lines
// from `lines`, spread over the tile's steps, and per group the next panel's scales (and zeros) at
// scales (zeros) + group * 16, COLS blocks s_block apart.
template <typename S>
struct PairsPrefetch {
  const char* lines = nullptr;
  int64_t n = 0;
  const S* scales = nullptr;
  const S* zeros = nullptr;
};

// 16 scales (zeros) as float32
inline __m512 load_scales(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_scales(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// What the pairs' words hold (CODES): integers (int4_pairs, int8_pairs: bits or-ed into bfloat16 values,
// corrected by the inputs' sums), 4-bit codes looked up in a table (fp4_pairs, lut4_pairs) or e4m3 bytes
// (fp8_pairs, the 8-bit layout), both signed values times a scale a group.
enum : int { kIntCodes = 0, kTableCodes = 1, kFp8Codes = 2 };

// Codes looked up in a table of 16 bfloat16 values (kTableCodes: fp4_pairs_gemm, lut4_pairs_gemm): `codes`
// holds them (entries 0..15, for vpermw). FP4 (S uint8_t, the scale bytes): the rows' global scales per
// block ([N / 16, 16] float32) and the scale bytes' values (e4m3_table / e8m0_table); LUT4 (S float): the
// group scales as they are, these two unused. kFp8Codes: `e4m3` the bfloat16 bits of each e4m3 magnitude
// (0..127, 32 a register, for vpermt2w).
struct PairsLookup {
  const float* global = nullptr;
  const float* table = nullptr;
  __m512i codes = _mm512_setzero_si512();
  __m512i e4m3[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
};

// The bfloat16 bits of every e4m3 magnitude (exact: e4m3 has 4 significant bits), 32 a register
inline const PairsLookup& e4m3_lookup() {
  static const PairsLookup lookup = [] {
    PairsLookup made;
    alignas(64) uint16_t bits[128];
    for (int i = 0; i < 128; ++i) {
      uint32_t b;
      std::memcpy(&b, &e4m3_table()[i], sizeof b);
      bits[i] = static_cast<uint16_t>(b >> 16);
    }
    for (int r = 0; r < 4; ++r) made.e4m3[r] = _mm512_load_si512(bits + 32 * r);
    return made;
  }();
  return lookup;
}

// 32 e4m3 codes (the low byte of each 16-bit lane, the high byte zero) as bfloat16 bits: the magnitude
// looked up (vpermt2w reads the index's low six bits; bit 6 picks the upper two registers), bit 7 the sign.
inline __m512i e4m3_bf16(__m512i c, const __m512i* table) {
  const __m512i low = _mm512_permutex2var_epi16(table[0], c, table[1]);
  const __m512i high = _mm512_permutex2var_epi16(table[2], c, table[3]);
  const __m512i magnitude = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(c, _mm512_set1_epi16(0x40)), low, high);
  return _mm512_or_si512(magnitude, _mm512_slli_epi16(_mm512_and_si512(c, _mm512_set1_epi16(0x80)), 8));
}

// bfloat16 bits of every e2m1 code (bit 3 the sign), entries 16..31 unused
inline __m512i e2m1_bf16_table() {
  alignas(64) uint16_t table[32] = {};
  for (int i = 0; i < 16; ++i) {
    const float v = e2m1_value(static_cast<uint8_t>(i));
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    table[i] = static_cast<uint16_t>(bits >> 16);  // exact: e2m1 values have 2 significant bits
  }
  return _mm512_load_si512(table);
}

// xe: each row's bfloat16 input pairs (a step takes 4 at 4 bit, 2 at 8); xsum: each row's sum of inputs
// per group. One or two rows keep two sums per output block (the planes' halves): vdpbf16ps' latency hidden.
template <int BITS, int ROWS, int COLS, typename S, int CODES = kIntCodes>
inline void pairs_tile(const uint32_t* xe, int64_t xe_stride, const float* xsum, int64_t groups, const uint8_t* q,
                       int64_t q_block, const S* scales, const S* zeros, int64_t s_block, int64_t group_steps,
                       at::BFloat16* out, int64_t out_stride, PairsPrefetch<S> pf, bool zero_points, const PairsLookup& lookup) {
  constexpr int SPLIT = ROWS <= 2 ? 2 : 1;
  // what the planes add to x q (8 bit: x (128 + l) + x (128 + 128 h)), and without zeros, the midpoint:
  // each input's weight beyond its scaled sum is zero - bias scale (or -(bias + mid) scale)
  const __m512 bias = _mm512_set1_ps(BITS == 8 ? 256.0f : 128.0f);
  const __m512 no_zero = _mm512_set1_ps(BITS == 4 ? -136.0f : BITS == 6 ? -160.0f : -384.0f);
  const __m512i nibble = _mm512_set1_epi16(0xF), low7 = _mm512_set1_epi16(0x7F), bit7 = _mm512_set1_epi16(0x80);
  const __m512i bits45 = _mm512_set1_epi16(0x30);
  const __m512i magic = _mm512_set1_epi16(0x4300);
  const int64_t steps = groups * group_steps, per = steps ? (pf.n + steps - 1) / steps : 0;
  int64_t asked = 0;
  __m512 acc[ROWS][COLS];
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < COLS; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    if (pf.scales != nullptr)
      for (int c = 0; c < COLS; ++c) {
        _mm_prefetch(reinterpret_cast<const char*>(pf.scales + c * s_block + g * 16), _MM_HINT_T1);
        if (pf.zeros != nullptr) _mm_prefetch(reinterpret_cast<const char*>(pf.zeros + c * s_block + g * 16), _MM_HINT_T1);
      }
    __m512 part[ROWS][COLS][SPLIT];
    for (int r = 0; r < ROWS; ++r)
      for (int c = 0; c < COLS; ++c)
        for (int s = 0; s < SPLIT; ++s) part[r][c][s] = _mm512_setzero_ps();
    for (int64_t p = g * group_steps; p < (g + 1) * group_steps; ++p) {
      for (int64_t i = 0; i < per && asked < pf.n; ++i, ++asked) _mm_prefetch(pf.lines + 64 * asked, _MM_HINT_T1);
      for (int c = 0; c < COLS; ++c) {
        const __m512i words = _mm512_loadu_si512(q + c * q_block + p * 64);
        __m512bh w[4];  // 0xEA: (a & b) | c
        if constexpr (CODES == kFp8Codes) {  // the low bytes (pair 2p), then the high ones (2p + 1)
          w[0] = (__m512bh)e4m3_bf16(_mm512_and_si512(words, _mm512_set1_epi16(0xFF)), lookup.e4m3);
          w[1] = (__m512bh)e4m3_bf16(_mm512_srli_epi16(words, 8), lookup.e4m3);
        } else if constexpr (CODES == kTableCodes) {  // each nibble plane's codes looked up as bfloat16
          w[0] = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(words, nibble), lookup.codes);
          w[1] = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(_mm512_srli_epi16(words, 4), nibble), lookup.codes);
          w[2] = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(_mm512_srli_epi16(words, 8), nibble), lookup.codes);
          w[3] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(words, 12), lookup.codes);
        } else if constexpr (BITS == 6) {  // each plane's nibble, its high two bits at 4-5
          const __m512i high = _mm512_cvtepu8_epi16(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c * q_block + steps * 64 + p * 32)));
          const __m512i nib[4] = {_mm512_ternarylogic_epi32(words, nibble, magic, 0xEA),
                                  _mm512_ternarylogic_epi32(_mm512_srli_epi16(words, 4), nibble, magic, 0xEA),
                                  _mm512_ternarylogic_epi32(_mm512_srli_epi16(words, 8), nibble, magic, 0xEA),
                                  _mm512_or_si512(_mm512_srli_epi16(words, 12), magic)};
          w[0] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_slli_epi16(high, 4), bits45, nib[0], 0xEA);
          w[1] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_slli_epi16(high, 2), bits45, nib[1], 0xEA);
          w[2] = (__m512bh)_mm512_ternarylogic_epi32(high, bits45, nib[2], 0xEA);
          w[3] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(high, 2), bits45, nib[3], 0xEA);
        } else if constexpr (BITS == 4) {
          w[0] = (__m512bh)_mm512_ternarylogic_epi32(words, nibble, magic, 0xEA);
          w[1] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(words, 4), nibble, magic, 0xEA);
          w[2] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(words, 8), nibble, magic, 0xEA);
          w[3] = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(words, 12), magic);
        } else {
          const __m512i high = _mm512_srli_epi16(words, 8);
          w[0] = (__m512bh)_mm512_ternarylogic_epi32(words, low7, magic, 0xEA);
          w[1] = (__m512bh)_mm512_ternarylogic_epi32(words, bit7, magic, 0xEA);
          w[2] = (__m512bh)_mm512_ternarylogic_epi32(high, low7, magic, 0xEA);
          w[3] = (__m512bh)_mm512_ternarylogic_epi32(high, bit7, magic, 0xEA);
        }
        for (int r = 0; r < ROWS; ++r) {
          // 4 and 6 bit: plane t against pair 4p + t; 8 bit: planes 0, 1 against pair 2p, 2 and 3 against 2p + 1
          // (FP8: plane 0 against pair 2p, 1 against 2p + 1)
          const uint32_t* xs = xe + r * xe_stride + (BITS == 8 ? 2 : 4) * p;
          constexpr int planes = CODES == kFp8Codes ? 2 : 4;
          for (int t = 0; t < planes; ++t) {
            __m512& sum = part[r][c][SPLIT == 2 ? t * 2 / planes : 0];
            const uint32_t pair = xs[BITS == 8 ? t * 2 / planes : t];
            sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)), w[t]);
          }
        }
      }
    }
    if constexpr (CODES != kIntCodes) {  // signed values: no inputs' sums, no zeros
      for (int c = 0; c < COLS; ++c) {
        __m512 scale;
        if constexpr (std::is_same_v<S, uint8_t>) {  // FP4: the scale byte's value over the row's global scale
          const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + c * s_block + g * 16));
          const __m512 value = _mm512_i32gather_ps(_mm512_cvtepu8_epi32(bytes), lookup.table, 4);
          scale = _mm512_div_ps(value, _mm512_loadu_ps(lookup.global + c * 16));
        } else {
          scale = load_scales(scales + c * s_block + g * 16);
        }
        for (int r = 0; r < ROWS; ++r) {
          const __m512 sum = SPLIT == 2 ? _mm512_add_ps(part[r][c][0], part[r][c][SPLIT - 1]) : part[r][c][0];
          acc[r][c] = _mm512_fmadd_ps(sum, scale, acc[r][c]);
        }
      }
    } else {
      for (int c = 0; c < COLS; ++c) {
        const __m512 scale = load_scales(scales + c * s_block + g * 16);
        __m512 extra = _mm512_mul_ps(no_zero, scale);
        if (zeros != nullptr) {
          const __m512 zero = load_scales(zeros + c * s_block + g * 16);
          extra = zero_points ? _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_add_ps(zero, bias)), scale)
                              : _mm512_fnmadd_ps(bias, scale, zero);
        }
        for (int r = 0; r < ROWS; ++r) {
          const __m512 sum = SPLIT == 2 ? _mm512_add_ps(part[r][c][0], part[r][c][SPLIT - 1]) : part[r][c][0];
          acc[r][c] = _mm512_fmadd_ps(sum, scale, acc[r][c]);
          acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[r * groups + g]), extra, acc[r][c]);
        }
      }
    }
  }
  store_tile(acc, out, out_stride);
}

// All rows against one panel of COLS blocks, in tiles of ROWS rows (then fewer); the tiles share the
// prefetch of the thread's next panel (its scales asked for by the first tile).
template <int BITS, int COLS, int ROWS = 4, typename S, int CODES = kIntCodes>
void pairs_rows(const uint32_t* xe, int64_t xe_stride, const float* xsum, int64_t groups, int64_t rows,
                const uint8_t* q, int64_t q_block, const S* scales, const S* zeros, int64_t s_block,
                int64_t group_steps, at::BFloat16* out, int64_t out_stride, PairsPrefetch<S> pf, bool zero_points,
                const PairsLookup& lookup) {
  if constexpr (ROWS > 0) {
    const int64_t tiles = rows / ROWS + (rows % ROWS != 0), share = tiles ? (pf.n + tiles - 1) / tiles : 0;
    for (; rows >= ROWS; rows -= ROWS, xe += ROWS * xe_stride, xsum += ROWS * groups, out += ROWS * out_stride) {
      PairsPrefetch<S> mine = pf;
      mine.n = std::min(share, pf.n);
      pairs_tile<BITS, ROWS, COLS, S, CODES>(xe, xe_stride, xsum, groups, q, q_block, scales, zeros, s_block,
                                           group_steps, out, out_stride, mine, zero_points, lookup);
      pf.lines += 64 * mine.n;
      pf.n -= mine.n;
      pf.scales = pf.zeros = nullptr;
    }
    if (rows)
      pairs_rows<BITS, COLS, ROWS - 1, S, CODES>(xe, xe_stride, xsum, groups, rows, q, q_block, scales, zeros, s_block,
                                            group_steps, out, out_stride, pf, zero_points, lookup);
  }
}

// 16 bfloat16 inputs as float32
inline __m512 bf16x16(const at::BFloat16* x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), 16));
}

// Row x's sums of inputs per group into xsum.
void pairs_sums(const at::BFloat16* x, int64_t inputs, int64_t group, float* xsum) {
  for (int64_t g = 0; g < inputs / group; ++g) {
    int64_t i = g * group;
    float sum = 0.0f;
    if (group % 16 == 0) {
      __m512 acc = _mm512_setzero_ps();
      for (; i < (g + 1) * group; i += 16) acc = _mm512_add_ps(acc, bf16x16(x + i));
      sum = _mm512_reduce_add_ps(acc);
    }
    for (; i < (g + 1) * group; ++i) sum += static_cast<float>(x[i]);
    xsum[g] = sum;
  }
}

// kTableCodes: the codes in the 4-bit layout looked up in `lookup` (FP4: S the scale bytes; LUT4: float
// scales); kFp8Codes: e4m3 bytes in the 8-bit layout (float scales); no zeros, no inputs' sums (the values
// are signed).
template <int BITS, typename S, int CODES = kIntCodes>
void pairs_product(const at::Tensor& xc, const at::Tensor& q, const at::Tensor& scales, const at::Tensor& zeros,
                   int64_t group, bool zero_points, at::Tensor& out, const PairsLookup& lookup = PairsLookup{}) {
  const int64_t rows = xc.size(0), inputs = xc.size(1), blocks = q.size(0), groups = scales.size(1);
  const at::BFloat16* xb = xc.const_data_ptr<at::BFloat16>();
  std::vector<float> xsum(rows * groups);
  if constexpr (CODES == kIntCodes)
    for (int64_t r = 0; r < rows; ++r) pairs_sums(xb + r * xc.stride(0), inputs, group, xsum.data() + r * groups);
  const uint32_t* xe = reinterpret_cast<const uint32_t*>(xb);
  const int64_t xe_stride = xc.stride(0) / 2;
  const int64_t q_block = q.size(1) * q.size(2), s_block = groups * 16, outputs = blocks * 16;
  const int64_t group_steps = group / pairs_step_inputs(BITS);
  const uint8_t* qp = q.const_data_ptr<uint8_t>();
  const S* sp = scales.const_data_ptr<S>();
  const S* op = zeros.numel() ? zeros.const_data_ptr<S>() : nullptr;
  at::BFloat16* outp = out.mutable_data_ptr<at::BFloat16>();
  // Up to 2 rows, 4 blocks (64 outputs) a tile; more rows, 4 rows x 2 blocks. Each thread takes an equal
  // share of the blocks (to a block: SmolLM2's 36-block products in tasks of 4 left one thread a ninth
  // more), consecutive panels, one stream of memory: while it works on one panel it asks (into L2, spread
  // over the panel's steps) for the next, so that the panel arrives before it is needed.
  const int64_t width = rows <= 2 ? 4 : 2, threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), blocks));
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t mine_end = blocks * (t + 1) / threads;
      for (int64_t first = blocks * t / threads; first < mine_end; first += width) {
        const int64_t last = std::min(mine_end, first + width), next_last = std::min(mine_end, last + width);
        PairsPrefetch<S> pf;
        if (next_last > last) {
          pf.lines = reinterpret_cast<const char*>(qp + last * q_block);
          pf.n = (next_last - last) * q_block / 64;
          pf.scales = sp + last * s_block;
          pf.zeros = op ? op + last * s_block : nullptr;
        }
        for (int64_t b = first; b < last;) {
          const S* zs = op ? op + b * s_block : nullptr;
          const uint8_t* qb = qp + b * q_block;
          const S* sb = sp + b * s_block;
          at::BFloat16* ob = outp + b * 16;
          // a panel is one tile wide except a thread's last (nothing to ask for)
          const PairsPrefetch<S> ahead = b == first ? pf : PairsPrefetch<S>{};
          PairsLookup tile_lookup = lookup;
          if (lookup.global != nullptr) tile_lookup.global = lookup.global + b * 16;
          if (width == 4 && b + 4 <= last) {
            pairs_rows<BITS, 4, 2, S, CODES>(xe, xe_stride, xsum.data(), groups, rows, qb, q_block, sb, zs, s_block,
                                           group_steps, ob, outputs, ahead, zero_points, tile_lookup);
            b += 4;
          } else if (b + 2 <= last) {
            pairs_rows<BITS, 2, 4, S, CODES>(xe, xe_stride, xsum.data(), groups, rows, qb, q_block, sb, zs, s_block,
                                           group_steps, ob, outputs, ahead, zero_points, tile_lookup);
            b += 2;
          } else {
            pairs_rows<BITS, 1, 4, S, CODES>(xe, xe_stride, xsum.data(), groups, rows, qb, q_block, sb, zs, s_block,
                                           group_steps, ob, outputs, ahead, zero_points, tile_lookup);
            b += 1;
          }
        }
      }
    }
  });
}
#endif

}  // namespace

// x as the pairs operators read it (bfloat16 [M, inputs], each row's pairs 4-byte aligned) and their
// bfloat16 output [M, 16 q.size(0)]
std::pair<at::Tensor, at::Tensor> pairs_io(const char* op, const at::Tensor& x, const at::Tensor& q, int64_t inputs,
                                           at::ScalarType out_dtype) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && out_dtype == at::kBFloat16 && x.size(1) == inputs,
              op, ": x must be bfloat16 [M, ", inputs, "], the output bfloat16");
  at::Tensor xc = x.stride(1) == 1 && x.stride(0) % 2 == 0 ? x : x.contiguous();
  at::Tensor out = at::empty({xc.size(0), q.size(0) * 16}, x.options());
  return {xc, out};
}

#if defined(__AVX512BF16__)
namespace {

// 32 codes (16-bit lanes, lane 2n + j for output n) as bfloat16: what pairs_dequantize stores for one
// pair of inputs; s_lo / s_hi (z_lo / z_hi) hold outputs 0..7 / 8..15, each twice. With zeros
// s[n] q + z[n] (the product, then the sum, each rounded), else s[n] (q - mid) (mid: -z).
template <bool ZEROS>
inline __m512 dequantized_half(__m256i codes, __m512 s, __m512 z) {
  const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(codes));
  return ZEROS ? _mm512_add_ps(_mm512_mul_ps(s, q), z) : _mm512_mul_ps(s, _mm512_add_ps(q, z));
}

// 16 per-output values v (outputs 0..15) spread over a step's 32 word lanes (word 2n + j: output n):
// outputs 0..7 each twice in lo, 8..15 in hi, as the float32 halves of a pair's 32 values.
inline void per_word(__m512 v, __m512& lo, __m512& hi) {
  lo = _mm512_permutexvar_ps(_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0), v);
  hi = _mm512_permutexvar_ps(_mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8), v);
}

template <bool ZEROS>
inline __m512i dequantized_pair(__m512i codes, __m512 s_lo, __m512 s_hi, __m512 z_lo, __m512 z_hi) {
  return (__m512i)_mm512_cvtne2ps_pbh(dequantized_half<ZEROS>(_mm512_extracti64x4_epi64(codes, 1), s_hi, z_hi),
                                      dequantized_half<ZEROS>(_mm512_castsi512_si256(codes), s_lo, z_lo));
}

// MODE 0: no zeros, s (q - mid); 1: s q + z; 2: zero points, s (q - z)
template <int BITS, int MODE, typename S>
void pairs_dequantize_blocks(const uint8_t* qp, const S* sp, const S* zp, int64_t blocks, int64_t steps, int64_t groups,
                             int64_t group, at::BFloat16* wp) {
  // A step's 32 words are in the pairs' lane order (word 2n + j: output n, input j of a pair): each
  // nibble plane (4 bit) or byte (8 bit) is one pair of inputs of the 16 outputs, 64 bytes of w.
  constexpr int64_t step_inputs = pairs_step_inputs(BITS), step_bytes = pairs_step_bytes(BITS);
  const int64_t pairs = steps * step_inputs / 2, group_steps = group / step_inputs;
  const __m512 mid = _mm512_set1_ps(BITS == 4 ? -8.0f : BITS == 6 ? -32.0f : -128.0f);
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t g = 0; g < groups; ++g) {
        const __m512 s = load_scales(sp + (b * groups + g) * 16);
        const __m512 z = MODE == 0 ? mid
                         : MODE == 1 ? load_scales(zp + (b * groups + g) * 16)
                                     : _mm512_sub_ps(_mm512_setzero_ps(), load_scales(zp + (b * groups + g) * 16));
        __m512 s_lo, s_hi, z_lo, z_hi;
        per_word(s, s_lo, s_hi);
        per_word(z, z_lo, z_hi);
        for (int64_t p = g * group_steps; p < (g + 1) * group_steps; ++p) {
          const __m512i words = _mm512_loadu_si512(qp + b * steps * step_bytes + p * 64);
          at::BFloat16* out = wp + (b * pairs + p * step_inputs / 2) * 32;
          if constexpr (BITS == 6) {
            const __m512i high = _mm512_cvtepu8_epi16(
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qp + b * steps * step_bytes + steps * 64 + p * 32)));
            for (int t = 0; t < 4; ++t) {  // pair 4p + t, its nibbles and high bits
              const __m512i codes = _mm512_or_si512(
                  _mm512_and_si512(_mm512_srli_epi16(words, 4 * t), _mm512_set1_epi16(0xF)),
                  _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(high, 2 * t), _mm512_set1_epi16(3)), 4));
              _mm512_storeu_si512(out + 32 * t, dequantized_pair<MODE == 1>(codes, s_lo, s_hi, z_lo, z_hi));
            }
          } else if constexpr (BITS == 4) {
            for (int t = 0; t < 4; ++t) {  // pair 4p + t: inputs 8p + 2t, 8p + 2t + 1
              const __m512i codes = _mm512_and_si512(_mm512_srli_epi16(words, 4 * t), _mm512_set1_epi16(0xF));
              _mm512_storeu_si512(out + 32 * t, dequantized_pair<MODE == 1>(codes, s_lo, s_hi, z_lo, z_hi));
            }
          } else {  // pair 2p: the low bytes, 2p + 1: the high ones
            _mm512_storeu_si512(out, dequantized_pair<MODE == 1>(_mm512_and_si512(words, _mm512_set1_epi16(0xFF)), s_lo, s_hi, z_lo, z_hi));
            _mm512_storeu_si512(out + 32, dequantized_pair<MODE == 1>(_mm512_srli_epi16(words, 8), s_lo, s_hi, z_lo, z_hi));
          }
        }
      }
  });
}

// Blocks first .. first + blocks of a pairs weight as bfloat16 pairs into wp (what pairs_dequantize stores
// for them), the zeros' form picked at run time.
template <int BITS, typename S>
void pairs_dequantize_range(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& zeros, int64_t group,
                            bool zero_points, int64_t first, int64_t blocks, at::BFloat16* wp) {
  const int64_t steps = q.size(1), groups = scales.size(1);
  const uint8_t* qp = q.const_data_ptr<uint8_t>() + first * steps * q.size(2);
  const S* sp = scales.const_data_ptr<S>() + first * groups * 16;
  const S* zp = zeros.numel() ? zeros.const_data_ptr<S>() + first * groups * 16 : nullptr;
  if (zp == nullptr)
    pairs_dequantize_blocks<BITS, 0, S>(qp, sp, zp, blocks, steps, groups, group, wp);
  else if (!zero_points)
    pairs_dequantize_blocks<BITS, 1, S>(qp, sp, zp, blocks, steps, groups, group, wp);
  else
    pairs_dequantize_blocks<BITS, 2, S>(qp, sp, zp, blocks, steps, groups, group, wp);
}

// f.template operator()<BITS, S>() for the weight's bits and its scales' type (float16 or float32)
template <typename F>
void pairs_types(int64_t bits, const at::Tensor& scales, const F& f) {
  const bool half = scales.scalar_type() == at::kHalf;
  if (bits == 4 && half)
    f.template operator()<4, at::Half>();
  else if (bits == 4)
    f.template operator()<4, float>();
  else if (bits == 6 && half)
    f.template operator()<6, at::Half>();
  else if (bits == 6)
    f.template operator()<6, float>();
  else if (half)
    f.template operator()<8, at::Half>();
  else
    f.template operator()<8, float>();
}

}  // namespace
#endif

#if defined(__AVX512BF16__)
namespace {

// All rows of x against a dequantized panel of COLS blocks of 16 outputs held as bfloat16 pairs at w
// (block c at w + c * pairs * 16 words), in tiles of ROWS rows (then fewer), each bf16_gemm's tile
// (bf16_tile.h): bf16_gemm's bits. STREAM: the output written past the caches (a prefill's of 4 MiB
// or more, as bf16_gemm writes it).
template <int COLS, bool STREAM, int ROWS = 8>
void panel_rows(const uint32_t* x, int64_t x_stride, int64_t rows, const uint32_t* w, int64_t pairs, at::BFloat16* out,
                int64_t out_stride) {
  if constexpr (ROWS > 0) {
    for (; rows >= ROWS; rows -= ROWS, x += ROWS * x_stride, out += ROWS * out_stride) {
      __m512 acc[ROWS][COLS];
      bf16_tile_sums(acc, x, x_stride, w, pairs * 16, pairs);
      store_tile<ROWS, COLS, STREAM>(acc, out, out_stride);
    }
    if (rows) panel_rows<COLS, STREAM, ROWS - 1>(x, x_stride, rows, w, pairs, out, out_stride);
  }
}

// x [M, inputs] times a packed weight of `blocks` blocks of 16 outputs, for more rows than the in-place
// tiles take: each thread dequantizes two blocks at a time (dequantize(b, n, panel): n blocks from b as
// bfloat16 pairs, what pairs_dequantize stores) into a buffer of its own, which stays in its L2, and
// multiplies 256 rows at a time by them as bf16_gemm would: the bits of bf16_gemm(x, pairs_dequantize(w)),
// the dequantized weight never written to memory and read back. Zen 4, 2 threads, [M, 576] x [576 -> 3072],
// against the weight dequantized whole for bf16_gemm: 1.06 / 1.10 ms at 128 rows, 4.17 / 4.36 at 512,
// 8.35 / 8.21 at 1,024, 16.58 / 16.26 at 2,048 (each row block dequantizes the panels again): from
// 1,024 rows builtin.py's _OnPairs takes the other way.
template <typename Dequantize>
void dequantized_product(const at::Tensor& xc, int64_t blocks, const Dequantize& dequantize, at::Tensor& out) {
  const int64_t rows = xc.size(0), inputs = xc.size(1), pairs = inputs / 2, outputs = blocks * 16;
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(xc.const_data_ptr<at::BFloat16>());
  const int64_t x_stride = xc.stride(0) / 2;
  at::BFloat16* op = out.mutable_data_ptr<at::BFloat16>();
  constexpr int64_t kRowBlock = 256;  // rows a panel is used for before the next (x's block stays in cache)
  const bool stream = rows * outputs * 2 >= (4 << 20) && reinterpret_cast<uintptr_t>(op) % 32 == 0;
  const auto run = [&]<bool STREAM>() {
    for (int64_t m = 0; m < rows; m += kRowBlock) {
      const int64_t m_rows = std::min(kRowBlock, rows - m);
      at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t begin, int64_t end) {
        std::vector<at::BFloat16> panel(2 * 16 * inputs);
        const uint32_t* w = reinterpret_cast<const uint32_t*>(panel.data());
        for (int64_t task = begin; task < end; ++task) {
          const int64_t b = task * 2, n = std::min<int64_t>(2, blocks - b);
          dequantize(b, n, panel.data());
          at::BFloat16* o = op + m * outputs + b * 16;
          if (n == 2)
            panel_rows<2, STREAM>(xp + m * x_stride, x_stride, m_rows, w, pairs, o, outputs);
          else
            panel_rows<1, STREAM>(xp + m * x_stride, x_stride, m_rows, w, pairs, o, outputs);
        }
        if constexpr (STREAM) _mm_sfence();  // the streamed stores reach memory before another thread reads them
      });
    }
  };
  if (stream)
    run.template operator()<true>();
  else
    run.template operator()<false>();
}

// Rows the in-place tiles take; more go through dequantized_product. Zen 4, 2 threads, [M, 576] x
// [576 -> 1536] over 40 weights from memory, us a product in place / dequantized, two runs: 4 bit 86-89
// / 119 at 16 rows, 159-163 / 181 at 32, 233 / 245 at 48, 292-312 / 299-305 at 64, 431-437 / 428-431 at
// 96; 8 bit 85 / 119 at 8, 119-120 / 106-122 at 12, 135-137 / 118-127 at 14; FP4 (its codes looked up,
// a gather a group) 81 / 105 at 8, 107-115 / 113-115 at 12, 134-140 / 122 at 14, 283 / 202 at 32. LUT4
// (codes looked up, float32 scales) takes 4 bit's: SmolLM2's 120 body products, ms in place / dequantized,
// 10.6 / 15.9 at 16 rows, 18.6 / 23.2 at 32. 6 bit (groups of 16, as Q6_K's), those products: 15.2 /
// 19.0 at 16, 21.8 / 23.0 at 24, 26.8 / 26.9 at 32, 38.3 / 34.7 at 48.
constexpr int64_t pairs_in_place_rows(int64_t bits, bool fp4 = false) {
  return fp4 || bits == 8 ? 12 : bits == 6 ? 32 : 64;
}

}  // namespace
#endif

at::Tensor pairs_gemm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, const at::Tensor& zeros,
                      int64_t group, int64_t bits, bool zero_points, at::ScalarType out_dtype) {
  check_pairs(q, scales, zeros, group, bits);
  auto [xc, out] = pairs_io("pairs_gemm", x, q, q.size(1) * pairs_step_inputs(bits), out_dtype);
#if defined(__AVX512BF16__)
  if (xc.size(0) == 0) return out;
  pairs_types(bits, scales, [&]<int BITS, typename S>() {
    if (xc.size(0) <= pairs_in_place_rows(BITS)) return pairs_product<BITS, S>(xc, q, scales, zeros, group, zero_points, out);
    dequantized_product(xc, q.size(0), [&](int64_t b, int64_t n, at::BFloat16* panel) {
      pairs_dequantize_range<BITS, S>(q, scales, zeros, group, zero_points, b, n, panel);
    }, out);
  });
#else
  TORCH_CHECK(false, "pairs_gemm: this build has no AVX512-BF16 (pairs_available() is false)");
#endif
  return out;
}

at::Tensor pairs_dequantize(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& zeros, int64_t group,
                            int64_t bits, bool zero_points) {
  check_pairs(q, scales, zeros, group, bits);
  const int64_t blocks = q.size(0), steps = q.size(1);
  at::Tensor w = at::empty({blocks, steps * pairs_step_inputs(bits) / 2, 16, 2}, q.options().dtype(at::kBFloat16));
#if defined(__AVX512BF16__)
  pairs_types(bits, scales, [&]<int BITS, typename S>() {
    pairs_dequantize_range<BITS, S>(q, scales, zeros, group, zero_points, 0, blocks, w.mutable_data_ptr<at::BFloat16>());
  });
#else
  TORCH_CHECK(false, "pairs_dequantize: this build has no AVX512-BF16 (pairs_available() is false)");
#endif
  return w;
}

// Output rows `rows` of a pairs weight as float32 [R, K], the inputs in order: scale q + zero (no zeros:
// scale (q - mid); zero points: scale (q - zero)), each product and sum rounded once, as builtin.py's _PairsKernel spells it: what a
// quantized embedding looks a token up in (a few microseconds, where the same in tensor operations took
// some 170 us a step).
at::Tensor pairs_dequantize_rows(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& zeros, int64_t group,
                                 int64_t bits, bool zero_points, const at::Tensor& rows) {
  check_pairs(q, scales, zeros, group, bits);
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong, "pairs_dequantize_rows: rows must be int64 [R]");
  const at::Tensor ids = rows.contiguous();
  const int64_t count = ids.size(0), blocks = q.size(0), steps = q.size(1), groups = scales.size(1);
  const int64_t inputs = steps * pairs_step_inputs(bits), mid = int64_t{1} << (bits - 1), step_bytes = q.size(2);
  const int64_t* idp = ids.const_data_ptr<int64_t>();
  for (int64_t r = 0; r < count; ++r)
    TORCH_CHECK(idp[r] >= 0 && idp[r] < blocks * 16, "pairs_dequantize_rows: row ", idp[r], " is not below ", blocks * 16);
  at::Tensor out = at::empty({count, inputs}, q.options().dtype(at::kFloat));
  float* op = out.mutable_data_ptr<float>();
  const uint8_t* qp = q.const_data_ptr<uint8_t>();
  const auto run = [&]<typename S>() {
    const S* sp = scales.const_data_ptr<S>();
    const S* zp = zeros.numel() ? zeros.const_data_ptr<S>() : nullptr;
    for (int64_t r = 0; r < count; ++r) {
      const int64_t b = idp[r] / 16, n = idp[r] % 16;
      float* row = op + r * inputs;
      const auto put = [&](int64_t k, int code) {
        const int64_t at = (b * groups + k / group) * 16 + n;
        const float scale = static_cast<float>(sp[at]);
        if (zp == nullptr)
          row[k] = scale * static_cast<float>(code - mid);
        else if (zero_points)
          row[k] = scale * (static_cast<float>(code) - static_cast<float>(zp[at]));
        else
          row[k] = scale * static_cast<float>(code) + static_cast<float>(zp[at]);
      };
      for (int64_t p = 0; p < steps; ++p)
        for (int j = 0; j < 2; ++j) {
          const uint8_t* word = qp + b * steps * step_bytes + p * 64 + 2 * (2 * n + j);
          if (bits != 8) {
            const int value = word[0] | (word[1] << 8);
            const int high = bits == 6 ? qp[b * steps * step_bytes + steps * 64 + p * 32 + 2 * n + j] : 0;  // 2 bits a plane
            for (int t = 0; t < 4; ++t)
              put(8 * p + 2 * t + j, ((value >> (4 * t)) & 15) | (((high >> (2 * t)) & 3) << 4));
          } else {
            put(4 * p + j, word[0]);
            put(4 * p + 2 + j, word[1]);
          }
        }
    }
  };
  if (scales.scalar_type() == at::kHalf)
    run.template operator()<at::Half>();
  else
    run.template operator()<float>();
  return out;
}

// FP4 pairs (builtin.py's Fp4PairsKernel): NVFP4 / MXFP4 codes in the 4-bit pairs layout (q [N / 16, K / 8,
// 64]), the scale bytes per block and group (scales [N / 16, K / group, 16] uint8) and the rows' global
// scales (global [N / 16, 16] float32):
//
//   w[o, k] = e2m1(q[o, k]) * (scale(scales[o, g]) / global[o])      (scale: e4m3 or e8m0, scale_format)
//
// Each nibble plane's codes looked up as bfloat16 (vpermw, exact) are vdpbf16ps operands; each group's
// float32 sum times its scale (the byte's value, a gather from a 256-entry table, over the global scale,
// in float32 as compressed-tensors divides).
// What the operators whose codes are looked up (fp4_pairs, lut4_pairs, fp8_pairs) check alike: q in the
// pairs layout of `step` inputs a 64-byte step, a group of a multiple of `step` inputs that divides them,
// and `scales` of `scale_dtype` per block, group and output ([N / 16, K / group, 16]).
void check_lookup_pairs(const char* op, const at::Tensor& q, const at::Tensor& scales, int64_t group, int64_t step,
                        at::ScalarType scale_dtype) {
  TORCH_CHECK(q.scalar_type() == at::kByte && q.dim() == 3 && q.size(2) == 64 && q.is_contiguous(), op,
              ": q must be contiguous uint8 [N / 16, K / ", step, ", 64]");
  const int64_t inputs = q.size(1) * step;
  TORCH_CHECK(group > 0 && group % step == 0 && inputs % group == 0, op, ": the group (", group,
              ") must be a multiple of ", step, " that divides the ", inputs, " inputs");
  TORCH_CHECK(scales.scalar_type() == scale_dtype && scales.is_contiguous() && scales.dim() == 3 &&
                  scales.size(0) == q.size(0) && scales.size(1) == inputs / group && scales.size(2) == 16,
              op, ": scales must be contiguous ",
              scale_dtype == at::kByte ? "uint8" : scale_dtype == at::kHalf ? "float16" : "float32",
              " [N / 16, K / group, 16]");
}

void check_fp4_pairs(const char* op, const at::Tensor& q, const at::Tensor& scales, const at::Tensor& global,
                     int64_t group, int64_t scale_format) {
  check_lookup_pairs(op, q, scales, group, 8, at::kByte);
  TORCH_CHECK(scale_format == kScaleE4m3 || scale_format == kScaleE8m0, op, ": scale_format must be 0 (e4m3) or 1 (e8m0)");
  TORCH_CHECK(global.scalar_type() == at::kFloat && global.is_contiguous() && global.dim() == 2 &&
                  global.size(0) == q.size(0) && global.size(1) == 16,
              op, ": global must be contiguous float32 [N / 16, 16]");
}

#if defined(__AVX512BF16__)
namespace {

// Blocks of a weight whose codes (the 4-bit pairs layout, qp at its first block) index a table of
// 16 float32 values, as bfloat16 pairs into wp (what fp4_pairs_dequantize / lut4_pairs_dequantize store):
// each value table[code] * scale in float32, rounded once; scale(b, g) the 16 scales of block b, group g.
template <typename Scale>
void lookup_dequantize_blocks(const uint8_t* qp, int64_t steps, int64_t groups, int64_t group, const float* table,
                              int64_t blocks, const Scale& scale, at::BFloat16* wp) {
  const int64_t pairs = steps * 4, group_steps = group / 8;
  const __m512 values = _mm512_loadu_ps(table);
  const __m512i nibble = _mm512_set1_epi16(0xF);
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t g = 0; g < groups; ++g) {
        __m512 s_lo, s_hi;
        per_word(scale(b, g), s_lo, s_hi);
        for (int64_t p = g * group_steps; p < (g + 1) * group_steps; ++p) {
          const __m512i words = _mm512_loadu_si512(qp + (b * steps + p) * 64);
          for (int t = 0; t < 4; ++t) {  // pair 4p + t: inputs 8p + 2t, 8p + 2t + 1
            const __m512i codes = _mm512_and_si512(_mm512_srli_epi16(words, 4 * t), nibble);
            const __m512 lo = _mm512_permutexvar_ps(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(codes)), values);
            const __m512 hi = _mm512_permutexvar_ps(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(codes, 1)), values);
            _mm512_storeu_si512(wp + (b * pairs + 4 * p + t) * 32,
                                (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, s_hi), _mm512_mul_ps(lo, s_lo)));
          }
        }
      }
  });
}

// Blocks first .. first + blocks of an FP4 pairs weight as bfloat16 pairs into wp: each value e2m1
// times its group's scale(byte) / global in float32, rounded once.
void fp4_dequantize_blocks(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& global, int64_t group,
                           int64_t scale_format, int64_t first, int64_t blocks, at::BFloat16* wp) {
  const int64_t steps = q.size(1), groups = scales.size(1);
  const uint8_t* sp = scales.const_data_ptr<uint8_t>() + first * groups * 16;
  const float* gp = global.const_data_ptr<float>() + first * 16;
  const float* table = fp4_scale_table(scale_format);
  float e2m1[16];
  for (int i = 0; i < 16; ++i) e2m1[i] = e2m1_value(static_cast<uint8_t>(i));
  lookup_dequantize_blocks(q.const_data_ptr<uint8_t>() + first * steps * 64, steps, groups, group, e2m1, blocks,
                           [&](int64_t b, int64_t g) {
                             const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + (b * groups + g) * 16));
                             return _mm512_div_ps(_mm512_i32gather_ps(_mm512_cvtepu8_epi32(bytes), table, 4),
                                                  _mm512_loadu_ps(gp + b * 16));
                           }, wp);
}

}  // namespace
#endif

at::Tensor fp4_pairs_gemm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, const at::Tensor& global,
                          int64_t group, int64_t scale_format, at::ScalarType out_dtype) {
  check_fp4_pairs("fp4_pairs_gemm", q, scales, global, group, scale_format);
  auto [xc, out] = pairs_io("fp4_pairs_gemm", x, q, q.size(1) * 8, out_dtype);
#if defined(__AVX512BF16__)
  if (xc.size(0) == 0) return out;
  PairsLookup lookup;
  lookup.global = global.const_data_ptr<float>();
  lookup.table = fp4_scale_table(scale_format);
  lookup.codes = e2m1_bf16_table();
  if (xc.size(0) <= pairs_in_place_rows(4, true)) {
    pairs_product<4, uint8_t, kTableCodes>(xc, q, scales, at::empty({0}, q.options()), group, false, out, lookup);
  } else {
    dequantized_product(xc, q.size(0), [&](int64_t b, int64_t n, at::BFloat16* panel) {
      fp4_dequantize_blocks(q, scales, global, group, scale_format, b, n, panel);
    }, out);
  }
#else
  TORCH_CHECK(false, "fp4_pairs_gemm: this build has no AVX512-BF16 (pairs_available() is false)");
#endif
  return out;
}

// The weight as bfloat16 pairs ([N / 16, K / 2, 16, 2], bf16_gemm's), each value e2m1 times the group's
// scale in float32, rounded once: for prefills.
at::Tensor fp4_pairs_dequantize(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& global, int64_t group,
                                int64_t scale_format) {
  check_fp4_pairs("fp4_pairs_dequantize", q, scales, global, group, scale_format);
  const int64_t blocks = q.size(0), steps = q.size(1);
  at::Tensor w = at::empty({blocks, steps * 4, 16, 2}, q.options().dtype(at::kBFloat16));
#if defined(__AVX512BF16__)
  fp4_dequantize_blocks(q, scales, global, group, scale_format, 0, blocks, w.mutable_data_ptr<at::BFloat16>());
#else
  TORCH_CHECK(false, "fp4_pairs_dequantize: this build has no AVX512-BF16 (pairs_available() is false)");
#endif
  return w;
}

// LUT4 pairs (builtin.py's Lut4PairsKernel): bitsandbytes' NF4 / FP4 and GGUF's IQ4 codes in the 4-bit pairs
// layout (q [N / 16, K / 8, 64]), a float32 or float16 scale per group and output (scales [N / 16, K / group,
// 16]; float16 where it holds them exactly, as GGUF's IQ4_NL d) and the codes' 16 float32 values (table):
//
//   w[o, k] = table[q[o, k]] * scales[o, k / group]
//
// In place, each nibble plane's codes are looked up (vpermw) in the table rounded to bfloat16 (to nearest
// even: NF4's values are not bfloat16 ones, each within 2^-9 of its value) as vdpbf16ps operands, each
// group's float32 sum times its scale. Dequantized (more rows, lut4_pairs_dequantize), each value is
// table[q] * scale in float32 (the float32 table, vpermps), rounded once to bfloat16.
void check_lut4_pairs(const char* op, const at::Tensor& q, const at::Tensor& scales, const at::Tensor& table,
                      int64_t group) {
  check_lookup_pairs(op, q, scales, group, 8, scales.scalar_type() == at::kHalf ? at::kHalf : at::kFloat);
  TORCH_CHECK(table.scalar_type() == at::kFloat && table.is_contiguous() && table.dim() == 1 && table.size(0) == 16,
              op, ": table must be contiguous float32 [16]");
}

#if defined(__AVX512BF16__)
namespace {

template <typename S>
void lut4_dequantize_blocks(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& table, int64_t group,
                            int64_t first, int64_t blocks, at::BFloat16* wp) {
  const int64_t steps = q.size(1), groups = scales.size(1);
  const S* sp = scales.const_data_ptr<S>() + first * groups * 16;
  lookup_dequantize_blocks(q.const_data_ptr<uint8_t>() + first * steps * 64, steps, groups, group,
                           table.const_data_ptr<float>(), blocks,
                           [&](int64_t b, int64_t g) { return load_scales(sp + (b * groups + g) * 16); }, wp);
}

template <typename S>
void lut4_pairs_run(const at::Tensor& xc, const at::Tensor& q, const at::Tensor& scales, const at::Tensor& table,
                    int64_t group, at::Tensor& out) {
  if (xc.size(0) <= pairs_in_place_rows(4)) {
    PairsLookup lookup;  // the values rounded to bfloat16, entries 16..31 zero
    lookup.codes = _mm512_zextsi256_si512((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(table.const_data_ptr<float>())));
    pairs_product<4, S, kTableCodes>(xc, q, scales, at::empty({0}, q.options()), group, false, out, lookup);
  } else {
    dequantized_product(xc, q.size(0), [&](int64_t b, int64_t n, at::BFloat16* panel) {
      lut4_dequantize_blocks<S>(q, scales, table, group, b, n, panel);
    }, out);
  }
}

}  // namespace
#endif

at::Tensor lut4_pairs_gemm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, const at::Tensor& table,
                           int64_t group, at::ScalarType out_dtype) {
  check_lut4_pairs("lut4_pairs_gemm", q, scales, table, group);
  auto [xc, out] = pairs_io("lut4_pairs_gemm", x, q, q.size(1) * 8, out_dtype);
#if defined(__AVX512BF16__)
  if (xc.size(0) == 0) return out;
  if (scales.scalar_type() == at::kHalf)
    lut4_pairs_run<at::Half>(xc, q, scales, table, group, out);
  else
    lut4_pairs_run<float>(xc, q, scales, table, group, out);
#else
  TORCH_CHECK(false, "lut4_pairs_gemm: this build has no AVX512-BF16 (pairs_available() is false)");
#endif
  return out;
}

// The weight as bfloat16 pairs ([N / 16, K / 2, 16, 2], bf16_gemm's), each value table[q] * scale in float32,
// rounded once: for prefills.
at::Tensor lut4_pairs_dequantize(const at::Tensor& q, const at::Tensor& scales, const at::Tensor& table, int64_t group) {
  check_lut4_pairs("lut4_pairs_dequantize", q, scales, table, group);
  const int64_t blocks = q.size(0), steps = q.size(1);
  at::Tensor w = at::empty({blocks, steps * 4, 16, 2}, q.options().dtype(at::kBFloat16));
#if defined(__AVX512BF16__)
  if (scales.scalar_type() == at::kHalf)
    lut4_dequantize_blocks<at::Half>(q, scales, table, group, 0, blocks, w.mutable_data_ptr<at::BFloat16>());
  else
    lut4_dequantize_blocks<float>(q, scales, table, group, 0, blocks, w.mutable_data_ptr<at::BFloat16>());
#else
  TORCH_CHECK(false, "lut4_pairs_dequantize: this build has no AVX512-BF16 (pairs_available() is false)");
#endif
  return w;
}

// FP8 pairs (builtin.py's Fp8PairsKernel): e4m3 bytes in the 8-bit pairs layout (q [N / 16, K / 4, 64]: per
// block of 16 outputs and step of 4 inputs, input 4p + 2 byte + j of output n in byte `byte` of the 16-bit
// word 2n + j) and a float32 scale per group and output (scales [N / 16, K / group, 16]):
//
//   w[o, k] = e4m3(q[o, k]) * scales[o, k / group]
//
// Each byte plane's codes looked up as bfloat16 (two vpermt2w over the 128 magnitudes, the sign or-ed in:
// exact) are vdpbf16ps operands, two a step (int8_pairs' integer bytes take four); each group's float32 sum
// times its scale. More rows than 24: the weight dequantized (e4m3 times scale in float32, rounded once) for
// bf16_gemm's multiplication.
void check_fp8_pairs(const char* op, const at::Tensor& q, const at::Tensor& scales, int64_t group) {
  check_lookup_pairs(op, q, scales, group, 4, at::kFloat);
}

#if defined(__AVX512BF16__)
namespace {

// Blocks first .. first + blocks of an FP8 pairs weight as bfloat16 pairs into wp (what fp8_pairs_dequantize
// stores for them): each value e4m3 times its group's scale in float32, rounded once.
void fp8_dequantize_blocks(const at::Tensor& q, const at::Tensor& scales, int64_t group, int64_t first, int64_t blocks,
                           at::BFloat16* wp) {
  const int64_t steps = q.size(1), groups = scales.size(1), pairs = steps * 2, group_steps = group / 4;
  const uint8_t* qp = q.const_data_ptr<uint8_t>() + first * steps * 64;
  const float* sp = scales.const_data_ptr<float>() + first * groups * 16;
  const PairsLookup& lookup = e4m3_lookup();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t g = 0; g < groups; ++g) {
        __m512 s_lo, s_hi;
        per_word(_mm512_loadu_ps(sp + (b * groups + g) * 16), s_lo, s_hi);
        for (int64_t p = g * group_steps; p < (g + 1) * group_steps; ++p) {
          const __m512i words = _mm512_loadu_si512(qp + (b * steps + p) * 64);
          for (int t = 0; t < 2; ++t) {  // pair 2p + t: the low bytes, then the high ones
            const __m512i codes = t == 0 ? _mm512_and_si512(words, _mm512_set1_epi16(0xFF)) : _mm512_srli_epi16(words, 8);
            const __m512i values = e4m3_bf16(codes, lookup.e4m3);
            const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(values)), 16));
            const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(values, 1)), 16));
            _mm512_storeu_si512(wp + (b * pairs + 2 * p + t) * 32,
                                (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, s_hi), _mm512_mul_ps(lo, s_lo)));
          }
        }
      }
  });
}

}  // namespace
#endif

at::Tensor fp8_pairs_gemm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales, int64_t group,
                          at::ScalarType out_dtype) {
  check_fp8_pairs("fp8_pairs_gemm", q, scales, group);
  auto [xc, out] = pairs_io("fp8_pairs_gemm", x, q, q.size(1) * 4, out_dtype);
#if defined(__AVX512BF16__)
  if (xc.size(0) == 0) return out;
  // in place / dequantized, SmolLM2's 120 products, ms: 16.0 / 19.6 at 16 rows, 23.2 / 23.4 at 24, 30.2 / 29.0
  // at 32 (two operands a step where an integer byte takes four: the crossover comes later than int8's 12)
  constexpr int64_t kFp8InPlaceRows = 24;
  if (xc.size(0) <= kFp8InPlaceRows) {
    pairs_product<8, float, kFp8Codes>(xc, q, scales, at::empty({0}, q.options()), group, false, out, e4m3_lookup());
  } else {
    dequantized_product(xc, q.size(0), [&](int64_t b, int64_t n, at::BFloat16* panel) {
      fp8_dequantize_blocks(q, scales, group, b, n, panel);
    }, out);
  }
#else
  TORCH_CHECK(false, "fp8_pairs_gemm: this build has no AVX512-BF16 (pairs_available() is false)");
#endif
  return out;
}

// The weight as bfloat16 pairs ([N / 16, K / 2, 16, 2], bf16_gemm's), each value e4m3 times the group's scale
// in float32, rounded once: for prefills.
at::Tensor fp8_pairs_dequantize(const at::Tensor& q, const at::Tensor& scales, int64_t group) {
  check_fp8_pairs("fp8_pairs_dequantize", q, scales, group);
  const int64_t blocks = q.size(0), steps = q.size(1);
  at::Tensor w = at::empty({blocks, steps * 2, 16, 2}, q.options().dtype(at::kBFloat16));
#if defined(__AVX512BF16__)
  fp8_dequantize_blocks(q, scales, group, 0, blocks, w.mutable_data_ptr<at::BFloat16>());
#else
  TORCH_CHECK(false, "fp8_pairs_dequantize: this build has no AVX512-BF16 (pairs_available() is false)");
#endif
  return w;
}

// A float weight quantized to 4-bit codes of a table, as bitsandbytes' quantize_4bit does (bit for bit
// vframe.quant.bitsandbytes.quantize_4bit_blocks_torch, whose fast path it is): the float32 values in
// blocks of `block` (the last one shorter), each value times the reciprocal of its block's absmax (the
// shorter block's: divided by it, and its absmax kept at least 1e-38, as bitsandbytes keeps it), clamped
// to [-1, 1], coded as the number of `boundaries` (the ascending table's 15 midpoints) below it. Returns
// the codes, two a byte, the first in the high nibble (uint8 [n / 2]), and the absmax values (float32
// [blocks]). Finite values only (the caller refuses others).
std::tuple<at::Tensor, at::Tensor> lut4_quantize(const at::Tensor& values, const at::Tensor& boundaries,
                                                 int64_t block) {
  TORCH_CHECK(values.scalar_type() == at::kFloat && values.dim() == 1 && values.is_contiguous() &&
                  values.numel() % 2 == 0,
              "lut4_quantize: values must be contiguous float32 [n], n even");
  TORCH_CHECK(boundaries.scalar_type() == at::kFloat && boundaries.numel() == 15 && boundaries.is_contiguous(),
              "lut4_quantize: boundaries must be 15 contiguous float32 values");
  TORCH_CHECK(block > 0 && block % 2 == 0, "lut4_quantize: the block (", block, ") must be even");
  const int64_t n = values.numel(), blocks = (n + block - 1) / block;
  at::Tensor codes = at::empty({n / 2}, values.options().dtype(at::kByte));
  at::Tensor absmax = at::empty({blocks}, values.options());
  const float* v = values.data_ptr<float>();
  uint8_t* c = codes.data_ptr<uint8_t>();
  float* a = absmax.data_ptr<float>();
  float bound[15];
  std::memcpy(bound, boundaries.data_ptr<float>(), sizeof bound);
  at::parallel_for(0, blocks, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> scaled(block);  // a block at a time, in loops the compiler vectorizes
    std::vector<uint8_t> code(block);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t start = b * block, size = std::min(block, n - start);
      const float* x = v + start;
      float top = 0.0f;
      for (int64_t i = 0; i < size; ++i) top = std::max(top, std::fabs(x[i]));
      const float divisor = std::max(top, 1e-38f), inverse = 1.0f / divisor;
      a[b] = size == block ? top : divisor;
      if (size == block) {
        for (int64_t i = 0; i < size; ++i) scaled[i] = std::min(std::max(x[i] * inverse, -1.0f), 1.0f);
      } else {
        for (int64_t i = 0; i < size; ++i) scaled[i] = std::min(std::max(x[i] / divisor, -1.0f), 1.0f);
      }
      for (int64_t i = 0; i < size; ++i) {
        int32_t count = 0;
        for (int k = 0; k < 15; ++k) count += bound[k] < scaled[i];
        code[i] = static_cast<uint8_t>(count);
      }
      for (int64_t i = 0; i < size; i += 2) c[(start + i) / 2] = static_cast<uint8_t>(code[i] << 4 | code[i + 1]);
    }
  });
  return {codes, absmax};
}

TORCH_LIBRARY(vframe_quant_cpu, m) {
  m.def("woq_gemm(Tensor x, Tensor q, Tensor scales, Tensor scaled_zeros, int group, int bits, ScalarType out_dtype) -> Tensor");
  m.def("int8_dynamic_mm(Tensor x, Tensor weight, Tensor w_scale, Tensor? w_sums=None) -> Tensor");
  m.def("woq_gemm_a8(Tensor x, Tensor q, Tensor scales, Tensor scaled_zeros, int group, int bits, ScalarType out_dtype) -> Tensor");
  m.def("quantize_blocks(Tensor x) -> Tensor");
  m.def("lut4_quantize(Tensor values, Tensor boundaries, int block) -> (Tensor, Tensor)");
  m.def("fp8_gemm(Tensor x, Tensor q, Tensor scales, int group, ScalarType out_dtype) -> Tensor");
  m.def("fp8_dequantize(Tensor q, Tensor scales, int group, ScalarType out_dtype) -> Tensor");
  m.def("fp4_gemm(Tensor x, Tensor q, Tensor scales, Tensor global_scale, int group, int scale_format, ScalarType out_dtype) -> Tensor");
  m.def("fp4_dequantize(Tensor q, Tensor scales, Tensor global_scale, int group, int scale_format, ScalarType out_dtype) -> Tensor");
  m.def("lut4_gemm(Tensor x, Tensor q, Tensor scales, Tensor table, int group, ScalarType out_dtype) -> Tensor");
  m.def("lut4_dequantize(Tensor q, Tensor scales, Tensor table, int group, ScalarType out_dtype) -> Tensor");
  m.def("woq_dequantize(Tensor q, Tensor scales, Tensor scaled_zeros, int group, int bits, ScalarType out_dtype) -> Tensor");
  m.def("int4pack_dequantize(Tensor packed, Tensor scales_and_zeros, int group) -> Tensor");
  m.def("pairs_gemm(Tensor x, Tensor q, Tensor scales, Tensor zeros, int group, int bits, bool zero_points, ScalarType out_dtype) -> Tensor");
  m.def("pairs_dequantize(Tensor q, Tensor scales, Tensor zeros, int group, int bits, bool zero_points) -> Tensor");
  m.def("fp4_pairs_gemm(Tensor x, Tensor q, Tensor scales, Tensor global_scale, int group, int scale_format, ScalarType out_dtype) -> Tensor");
  m.def("fp4_pairs_dequantize(Tensor q, Tensor scales, Tensor global_scale, int group, int scale_format) -> Tensor");
  m.def("lut4_pairs_gemm(Tensor x, Tensor q, Tensor scales, Tensor table, int group, ScalarType out_dtype) -> Tensor");
  m.def("lut4_pairs_dequantize(Tensor q, Tensor scales, Tensor table, int group) -> Tensor");
  m.def("fp8_pairs_gemm(Tensor x, Tensor q, Tensor scales, int group, ScalarType out_dtype) -> Tensor");
  m.def("fp8_pairs_dequantize(Tensor q, Tensor scales, int group) -> Tensor");
  m.def("pairs_dequantize_rows(Tensor q, Tensor scales, Tensor zeros, int group, int bits, bool zero_points, Tensor rows) -> Tensor");
  m.def("pairs_available() -> bool", &pairs_available);
}

TORCH_LIBRARY_IMPL(vframe_quant_cpu, CPU, m) {
  m.impl("woq_gemm", &woq_gemm);
  m.impl("int8_dynamic_mm", &int8_dynamic_mm);
  m.impl("woq_gemm_a8", &woq_gemm_a8);
  m.impl("quantize_blocks", &quantize_blocks_dequantized);
  m.impl("lut4_quantize", &lut4_quantize);
  m.impl("fp8_gemm", &fp8_gemm);
  m.impl("fp8_dequantize", &fp8_dequantize);
  m.impl("fp4_gemm", &fp4_gemm);
  m.impl("fp4_dequantize", &fp4_dequantize);
  m.impl("lut4_gemm", &lut4_gemm);
  m.impl("lut4_dequantize", &lut4_dequantize);
  m.impl("woq_dequantize", &woq_dequantize);
  m.impl("int4pack_dequantize", &int4pack_dequantize);
  m.impl("pairs_gemm", &pairs_gemm);
  m.impl("pairs_dequantize", &pairs_dequantize);
  m.impl("pairs_dequantize_rows", &pairs_dequantize_rows);
  m.impl("fp4_pairs_gemm", &fp4_pairs_gemm);
  m.impl("fp4_pairs_dequantize", &fp4_pairs_dequantize);
  m.impl("lut4_pairs_gemm", &lut4_pairs_gemm);
  m.impl("fp8_pairs_gemm", &fp8_pairs_gemm);
  m.impl("fp8_pairs_dequantize", &fp8_pairs_dequantize);
  m.impl("lut4_pairs_dequantize", &lut4_pairs_dequantize);
}
