// Fused elementwise operators of the decoder layers on the CPU, each equal to the
// PyTorch expression it replaces (vframe/layers/cpu_ops.py):
//
//   rms_norm(x, w, eps)        w * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)
//   rotary_neox_(pos, q, k, c) q, k rotated in place: [x1*cos - x2*sin, x2*cos + x1*sin]
//                              with cos / sin = c[pos].to(q.dtype), every product and sum
//                              rounded to q's dtype as PyTorch's separate operators round them
//   store_kv(k, v, kv, s)      kv[0] slot s[i] = k[i], kv[1] slot s[i] = v[i] (two index_copy_ calls); a
//                              float8 cache takes k, v clamped to its largest finite value and rounded
//                              to nearest even, as x.clamp(-max, max).to(float8) does (with calibrated
//                              scales: k.float() / k_scale, v.float() / v_scale)
//   silu_and_mul(x)            F.silu(g).mul_(u) for g, u = x.chunk(2, -1), as PyTorch's kernels compute
//                              it: g / (1 + exp(-g)) with SLEEF's expf (torch's own, 1 ulp) on vectors
//                              of 8 and std::exp on a row's last values, rounded to x's dtype, times u
//   moe_combine(r, t, w, n)    a mixture-of-experts layer's sum: acc = zeros(n, H) float32;
//                              acc.index_add_(0, t, r.float() * w[:, None]) for expert rows r [S, H]
//                              (pairs in order, each token's sum in that order), weights w float32 [S]
//   moe_experts(x, w, ids, w13, w2, layout)
//                              FusedMoE.forward's experts (vframe/layers/moe.py) in one call: the (token,
//                              expert) pairs sorted by expert (stable), each expert's rows through its
//                              gate/up product, silu_and_mul and its down product, then moe_combine;
//                              the same operators on the same rows in the same order as the Python path
//   bf16_gemm(x, w)            x @ W^T for bfloat16 x [M, K] and W [N, K] held as w = bf16_pairs(W),
//                              [N / 16, K / 2, 16, 2] (each block of 16 outputs, the inputs in pairs):
//                              AVX512-BF16 vdpbf16ps tiles of 8 rows x 32 outputs, float32 sums over the
//                              inputs in order, rounded to bfloat16 once; bf16_gemm_available() says
//                              whether this build has it (a CPU with AVX512-BF16)
//   bf16_gemm_silu(x, w)       silu_and_mul(bf16_gemm(x, w)) for the pairs of a [gate; up] weight, bit for
//                              bit, in one pass (LlamaMLP's prefills: no [M, 2 I] product in memory)
//   argmax_rows(x)             x.argmax(-1) for float32 [B, V]: the first index of a row's maximum, a NaN
//                              counting as the maximum (torch's CPU argmax does not vectorise its
//                              index-tracking reduction: 3.9 ms for [64, 49152], amax 0.18 ms)
//   DecodePlan                 a torch.classes object: a Llama-style model's decoder layers for a
//                              decode step, these operators and the layers' own linears and paged
//                              attention called from here (vframe/backends/cpu_paged/plan.py)
//
// Built with -ffp-contract=off so that no product and sum fuse into one rounding.
// rms_norm's mean adds the squares in another order than PyTorch's reduction: its
// float32 variance may differ in the last bit (the rotation is bit-exact).
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/add.h>
#include <ATen/ops/div.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "bf16_tile.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#include <sleef.h>  // torch's headers ship it and libtorch_cpu exports its functions
#endif

namespace {

template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}
template <>
inline float round_to<float>(float x) {
  return x;
}

#if defined(__AVX2__) && defined(__F16C__)
// Eight values of T as float32 and back, with the rounding c10's conversions do: bfloat16
// to nearest even (a NaN becomes the quiet NaN 0x7FC0, as c10::BFloat16 makes it), float16
// by F16C's IEEE rounding to nearest even. round8<T>(v) is float(T(v)) for each lane, so a
// chain of them rounds exactly where PyTorch's separate operators round.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// float32 -> the bfloat16 bits in the upper half of each 32-bit lane (lower half zero)
inline __m256i bf16_bits(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(_mm256_and_si256(rounded, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))),
                            _mm256_set1_epi32(0x7FC00000), nan);
}

template <typename T>
inline __m256 round8(__m256 v);
template <>
inline __m256 round8<float>(__m256 v) { return v; }
template <>
inline __m256 round8<c10::BFloat16>(__m256 v) { return _mm256_castsi256_ps(bf16_bits(v)); }
template <>
inline __m256 round8<c10::Half>(__m256 v) { return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT)); }

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) {
  const __m256i high = _mm256_srli_epi32(bf16_bits(v), 16);  // 0..0xFFFF in each lane
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline void store8(c10::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

#if defined(__AVX512F__)
// The same sixteen at a time.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512i bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_blend_epi32(nan, _mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))),
                                 _mm512_set1_epi32(0x7FC00000));
}
template <typename T>
inline __m512 round16(__m512 v);
template <>
inline __m512 round16<float>(__m512 v) { return v; }
template <>
inline __m512 round16<c10::BFloat16>(__m512 v) { return _mm512_castsi512_ps(bf16_bits(v)); }
template <>
inline __m512 round16<c10::Half>(__m512 v) { return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT)); }
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits(v), 16)));
}
inline void store16(c10::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
#endif

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t n, int64_t x_stride, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      T* o = out + r * n;
      float sum = 0.f;
      int64_t i = 0;
#if defined(__AVX2__) && defined(__F16C__)
      __m256 squares = _mm256_setzero_ps();
      for (; i + 8 <= n; i += 8) {
        const __m256 v = load8(xr + i);
        squares = _mm256_add_ps(squares, _mm256_mul_ps(v, v));
      }
      sum = hsum8(squares);
#endif
      for (; i < n; ++i) {
        const float v = static_cast<float>(xr[i]);
        sum += v * v;
      }
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
      i = 0;
#if defined(__AVX2__) && defined(__F16C__)
      const __m256 scale = _mm256_set1_ps(inv);
      for (; i + 8 <= n; i += 8)
        store8(o + i, _mm256_mul_ps(load8(w + i), round8<T>(_mm256_mul_ps(load8(xr + i), scale))));
#endif
      for (; i < n; ++i) {
        const float normed = round_to<T>(static_cast<float>(xr[i]) * inv);
        o[i] = static_cast<T>(static_cast<float>(w[i]) * normed);
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be [T, E] with contiguous rows");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be a contiguous [E] of x's dtype");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  const float e = static_cast<float>(eps);
  AT_DISPATCH_V2(x.scalar_type(), "rms_norm", AT_WRAP([&] {
    rms_norm_rows(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, n, stride, e);
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return out;
}

// One head row x (its D = 2 * half values) rotated by the cos / sin row cs, rounded to T
// (cs[j] = T(cos), cs[j + half] = T(sin)).
template <typename T>
inline void rotate_row(T* x, const float* cs, int64_t half) {
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= half; j += 16) {
    const __m512 c = load16(cs + j), s = load16(cs + j + half);
    const __m512 x1 = load16(x + j), x2 = load16(x + j + half);
    store16(x + j, _mm512_sub_ps(round16<T>(_mm512_mul_ps(x1, c)), round16<T>(_mm512_mul_ps(x2, s))));
    store16(x + j + half, _mm512_add_ps(round16<T>(_mm512_mul_ps(x2, c)), round16<T>(_mm512_mul_ps(x1, s))));
  }
#endif
#if defined(__AVX2__) && defined(__F16C__)
  for (; j + 8 <= half; j += 8) {
    const __m256 c = load8(cs + j), s = load8(cs + j + half);
    const __m256 x1 = load8(x + j), x2 = load8(x + j + half);
    store8(x + j, _mm256_sub_ps(round8<T>(_mm256_mul_ps(x1, c)), round8<T>(_mm256_mul_ps(x2, s))));
    store8(x + j + half, _mm256_add_ps(round8<T>(_mm256_mul_ps(x2, c)), round8<T>(_mm256_mul_ps(x1, s))));
  }
#endif
  for (; j < half; ++j) {
    const float c = cs[j], s = cs[j + half];
    const float x1 = static_cast<float>(x[j]), x2 = static_cast<float>(x[j + half]);
    const float a = round_to<T>(x1 * c) - round_to<T>(x2 * s);
    const float b = round_to<T>(x2 * c) + round_to<T>(x1 * s);
    x[j] = static_cast<T>(a);
    x[j + half] = static_cast<T>(b);
  }
}

// Every head of query and key, a token's cos / sin rounded to T once for all its heads, the
// tokens split over the threads (Zen 4, bfloat16, 2 threads, 9 + 3 heads of 64: a 64-token decode
// step 31 -> 17 us, a 4,096-token prefill step 1.05 -> 0.58 ms; 16 lanes a step on AVX-512).
template <typename T>
void rotate(const at::Tensor& query, const at::Tensor& key, const int64_t* pos, const at::Tensor& cache) {
  const int64_t tokens = query.size(0), half = query.size(2) / 2;
  const float* cp = cache.data_ptr<float>();
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> cs(2 * half);
    for (int64_t t = begin; t < end; ++t) {
      const float* row = cp + pos[t] * cache.stride(0);
      for (int64_t j = 0; j < 2 * half; ++j) cs[j] = round_to<T>(row[j]);
      for (const at::Tensor* x : {&query, &key}) {
        T* xt = x->data_ptr<T>() + t * x->stride(0);
        for (int64_t h = 0; h < x->size(1); ++h) rotate_row(xt + h * x->stride(1), cs.data(), half);
      }
    }
  });
}

void rotary_neox_(const at::Tensor& positions, const at::Tensor& query, const at::Tensor& key,
                  const at::Tensor& cos_sin_cache) {
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "rotary_neox_: positions int64");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.stride(1) == 1 &&
                  cos_sin_cache.size(1) == query.size(2),
              "rotary_neox_: cos_sin_cache must be float32 [max_pos, D]");
  for (const auto* t : {&query, &key}) {
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1 && t->size(0) == positions.size(0) && t->size(2) % 2 == 0 &&
                    t->scalar_type() == query.scalar_type() && t->size(2) == query.size(2),
                "rotary_neox_: query and key must be [T, heads, D] of one dtype with contiguous heads");
  }
  const int64_t* pos = positions.data_ptr<int64_t>();
  AT_DISPATCH_V2(query.scalar_type(), "rotary_neox_", AT_WRAP([&] { rotate<scalar_t>(query, key, pos, cos_sin_cache); }),
                 at::kFloat, at::kBFloat16, at::kHalf);
}

// Row `src` of `count` values of S into `dst` of float8 type F: each float(x) / scale (float32, as
// PyTorch's x.float() / scale; scale 1.0: x as it is), clamped to F's largest finite value.
template <typename F, typename S>
void round_row_to_fp8(F* dst, const S* src, int64_t count, float scale) {
  const float limit = static_cast<float>(std::numeric_limits<F>::max());
  for (int64_t j = 0; j < count; ++j) {
    const float x = scale == 1.0f ? static_cast<float>(src[j]) : static_cast<float>(src[j]) / scale;
    dst[j] = F(x > limit ? limit : (x < -limit ? -limit : x));  // NaN stays NaN
  }
}

// store_kv into a float8 cache: each row rounded on the way, keys over k_scale and values over v_scale.
template <typename F>
void store_kv_fp8(const at::Tensor& key, const at::Tensor& value, F* kc, F* vc, const int64_t* sp, int64_t n,
                  float k_scale, float v_scale) {
  const int64_t row = key.size(1) * key.size(2);
  AT_DISPATCH_V2(key.scalar_type(), "store_kv", AT_WRAP([&] {
    const auto* kp = key.const_data_ptr<scalar_t>();
    const auto* vp = value.const_data_ptr<scalar_t>();
    for (int64_t i = 0; i < n; ++i) {
      round_row_to_fp8(kc + sp[i] * row, kp + i * key.stride(0), row, k_scale);
      round_row_to_fp8(vc + sp[i] * row, vp + i * value.stride(0), row, v_scale);
    }
  }), at::kFloat, at::kBFloat16, at::kHalf);
}

// kv_cache[0] slot slots[i] = key[i] and kv_cache[1] slot slots[i] = value[i] for the
// first n = len(slots) rows: what two index_copy_ calls on the caches' [num_slots, KVH,
// D] views do, in one operator (a decode step's KV write took about 20 us of dispatch a
// layer). key / value [T, KVH, D] with each row's KVH * D values contiguous (a split of
// the fused qkv output); kv_cache [2, num_blocks, block_size, KVH, D] contiguous, of
// key's dtype, or float8 (e4m3fn, e5m2) for float32 / bfloat16 / float16 keys, rounded
// on the way by store_kv_fp8, divided by the calibrated k_scale / v_scale (plugin API 1.19; 1.0: none,
// the only value a cache of key's dtype takes).
void store_kv(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache, const at::Tensor& slots,
              double k_scale, double v_scale) {
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(), "store_kv: slots int64 [n]");
  const int64_t n = slots.size(0);
  const bool fp8 = kv_cache.scalar_type() == at::kFloat8_e4m3fn || kv_cache.scalar_type() == at::kFloat8_e5m2;
  TORCH_CHECK(fp8 || (k_scale == 1.0 && v_scale == 1.0), "store_kv: k_scale / v_scale apply to a float8 cache only");
  for (const auto* t : {&key, &value}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) >= n && t->stride(2) == 1 && t->stride(1) == t->size(2) &&
                    (t->scalar_type() == kv_cache.scalar_type() ||
                     (fp8 && t->scalar_type() == key.scalar_type() &&
                      (key.scalar_type() == at::kFloat || key.scalar_type() == at::kBFloat16 ||
                       key.scalar_type() == at::kHalf))),
                "store_kv: key and value must be [T, KVH, D] rows of the cache's dtype (or of one float dtype, "
                "for a float8 cache), each row contiguous");
  }
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
                  kv_cache.size(3) == key.size(1) && kv_cache.size(4) == key.size(2),
              "store_kv: kv_cache must be a contiguous [2, num_blocks, block_size, KVH, D] like key");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t row_bytes = key.size(1) * key.size(2) * key.element_size();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < num_slots, "store_kv: slot ", sp[i], " outside the cache's ", num_slots);
  if (fp8) {
    const int64_t cache_row = key.size(1) * key.size(2);  // one byte each
    auto* base = static_cast<uint8_t*>(kv_cache.data_ptr());
    if (kv_cache.scalar_type() == at::kFloat8_e4m3fn) {
      auto* kc = reinterpret_cast<c10::Float8_e4m3fn*>(base);
      store_kv_fp8(key, value, kc, kc + num_slots * cache_row, sp, n, static_cast<float>(k_scale),
                   static_cast<float>(v_scale));
    } else {
      auto* kc = reinterpret_cast<c10::Float8_e5m2*>(base);
      store_kv_fp8(key, value, kc, kc + num_slots * cache_row, sp, n, static_cast<float>(k_scale),
                   static_cast<float>(v_scale));
    }
    return;
  }
  auto* kc = static_cast<char*>(kv_cache.data_ptr());
  char* vc = kc + num_slots * row_bytes;
  const auto* kp = static_cast<const char*>(key.data_ptr());
  const auto* vp = static_cast<const char*>(value.data_ptr());
  const int64_t ks = key.stride(0) * key.element_size(), vs = value.stride(0) * value.element_size();
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(kc + sp[i] * row_bytes, kp + i * ks, row_bytes);
    std::memcpy(vc + sp[i] * row_bytes, vp + i * vs, row_bytes);
  }
}

// silu(g) in float32 exactly as PyTorch's CPU kernel computes it (aten silu_kernel with
// AVX2 vectors): g / (1 + exp(-g)), SLEEF's 1-ulp expf on 8 floats at a time, over the
// row in pieces of 16 (two vectors, TensorIterator's unrolled step), the last values
// with std::exp (the kernel's scalar loop). Built with AVX-512, pieces of 32 go first
// through SLEEF's 16-float expf (equal to the 8-float one on every 16-bit value:
// tests/layers/test_cpu_ops.py), as torch's AVX-512 kernels take it.
inline float silu_scalar(float g) { return g / (1.0f + std::exp(-g)); }

#if defined(__AVX512F__)
// silu(g) rounded to T, times u, for 16 lanes: silu_and_mul_rows' AVX-512 step, and
// bf16_gemm_silu's epilogue (which must give the same bits).
template <typename T>
inline __m512 silu_mul16(__m512 g, __m512 u) {
  const __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), _mm512_set1_epi32(INT32_MIN)));
  const __m512 sv = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), Sleef_expf16_u10avx512f(neg)));
  return _mm512_mul_ps(round16<T>(sv), u);
}
#endif

template <typename T>
void silu_and_mul_rows(const T* x, T* out, int64_t rows, int64_t inter, int64_t x_stride) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(inter, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = x + r * x_stride;
      const T* u = g + inter;
      T* o = out + r * inter;
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + 32 <= inter; i += 32)
        for (int j = 0; j < 32; j += 16) store16(o + i + j, silu_mul16<T>(load16(g + i + j), load16(u + i + j)));
#endif
#if defined(__AVX2__) && defined(__F16C__)
      const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
      for (; i + 16 <= inter; i += 16) {
        for (int j = 0; j < 16; j += 8) {
          const __m256 gv = load8(g + i + j);
          const __m256 sv = _mm256_div_ps(gv, _mm256_add_ps(one, Sleef_expf8_u10avx2(_mm256_xor_ps(sign, gv))));
          store8(o + i + j, _mm256_mul_ps(round8<T>(sv), load8(u + i + j)));  // T(float(T(silu)) * float(u))
        }
      }
#endif
      for (; i < inter; ++i)
        o[i] = static_cast<T>(static_cast<float>(static_cast<T>(silu_scalar(static_cast<float>(g[i])))) *
                              static_cast<float>(u[i]));
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "silu_and_mul: x must be [T, 2 * I] with contiguous rows");
  const int64_t rows = x.size(0), inter = x.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, x.options());
  AT_DISPATCH_V2(x.scalar_type(), "silu_and_mul", AT_WRAP([&] {
    silu_and_mul_rows(x.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(), rows, inter, x.stride(0));
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return out;
}

// One row: its largest value (vectorised, NaN noticed on the way), then the first index
// holding it; a row with NaN answers its first NaN, as torch.argmax does.
int64_t argmax_row(const float* x, int64_t n) {
  int64_t i = 0;
  float best = -INFINITY;
  bool nan = false;
#if defined(__AVX2__)
  __m256 mx = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    mx = _mm256_max_ps(mx, v);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  for (float l : lanes) best = std::max(best, l);
  nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (; i < n; ++i) {
    nan |= std::isnan(x[i]);
    best = std::max(best, x[i]);
  }
  if (nan) {
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(x[j])) return j;
  }
  int64_t j = 0;
#if defined(__AVX2__)
  const __m256 target = _mm256_set1_ps(best);
  for (; j + 8 <= n; j += 8) {
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), target, _CMP_EQ_OQ));
    if (mask) return j + __builtin_ctz(mask);
  }
#endif
  for (; j < n; ++j)
    if (x[j] == best) return j;
  return 0;  // not reached: the maximum is in the row
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) > 0,
              "argmax_rows: x must be float32 [B, V] with contiguous rows, V > 0");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.const_data_ptr<float>();
  int64_t* op = out.mutable_data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * stride, n);
  });
  return out;
}

// acc[tok[p]] += w[p] * rows[p - first] over columns [begin, end) for the pairs p in [first, last),
// in order: each product w * r rounded to float32, then added, as index_add_ adds the multiplied
// rows. moe_combine and moe_experts split the columns over the threads, so that every token's
// sum runs over its pairs in order on one thread.
template <typename T>
inline void add_weighted_rows(float* acc, int64_t hidden, const int64_t* tok, const float* w, int64_t first,
                              int64_t last, const T* rows, int64_t stride, int64_t begin, int64_t end) {
  for (int64_t p = first; p < last; ++p) {
    const float wp = w[p];
    const T* rp = rows + (p - first) * stride;
    float* ap = acc + tok[p] * hidden;
    for (int64_t d = begin; d < end; ++d) ap[d] += wp * static_cast<float>(rp[d]);
  }
}

at::Tensor moe_combine(const at::Tensor& rows, const at::Tensor& token_ids, const at::Tensor& weights,
                       int64_t num_tokens) {
  TORCH_CHECK(rows.dim() == 2 && rows.stride(1) == 1, "moe_combine: rows must be [S, H] with contiguous rows");
  const int64_t pairs = rows.size(0), hidden = rows.size(1);
  TORCH_CHECK(token_ids.dim() == 1 && token_ids.size(0) == pairs && token_ids.scalar_type() == at::kLong &&
                  token_ids.is_contiguous(),
              "moe_combine: token_ids must be int64 [S], S = ", pairs);
  TORCH_CHECK(weights.dim() == 1 && weights.size(0) == pairs && weights.scalar_type() == at::kFloat &&
                  weights.is_contiguous(),
              "moe_combine: weights must be float32 [S], S = ", pairs);
  TORCH_CHECK(num_tokens >= 0, "moe_combine: num_tokens must be >= 0");
  const int64_t* tok = token_ids.const_data_ptr<int64_t>();
  for (int64_t p = 0; p < pairs; ++p)
    TORCH_CHECK(tok[p] >= 0 && tok[p] < num_tokens, "moe_combine: token id ", tok[p], " is not below ", num_tokens);
  at::Tensor out = at::zeros({num_tokens, hidden}, rows.options().dtype(at::kFloat));
  const float* w = weights.const_data_ptr<float>();
  float* acc = out.mutable_data_ptr<float>();
  AT_DISPATCH_V2(rows.scalar_type(), "moe_combine", AT_WRAP([&] {
    const scalar_t* r = rows.const_data_ptr<scalar_t>();
    const int64_t stride = rows.stride(0);
    at::parallel_for(0, hidden, 64, [&](int64_t begin, int64_t end) {
      add_weighted_rows(acc, hidden, tok, w, 0, pairs, r, stride, begin, end);
    });
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return out;
}

// bf16_gemm. A tile: ROWS rows of x against COLS blocks of 16 outputs, the sums in registers
// (8 x 2: 16 accumulators, 2 weight vectors, one broadcast pair of x a row); every weight pair
// is read once per tile. Zen 4, 2 threads, [16, 512] x [512 -> 2048]: 374 GFLOP/s against
// oneDNN's packed linear's 275; [1, 512] x [512 -> 2048] 107 against 36; at 256 rows both ~410.
#if defined(__AVX512BF16__)
// One tile's sums as bfloat16 (what bf16_gemm stores), read back as float32.
inline __m512 bf16_rounded(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// SILU: COLS is 2, the blocks a gate block and its up block, and the tile stores
// silu_and_mul of its two bfloat16 results (the AVX-512 path of silu_and_mul_rows, bit for bit).
template <int ROWS, int COLS, bool SILU, bool STREAM>
inline void bf16_tile(const uint32_t* x, int64_t x_stride, const uint32_t* w, int64_t w_stride, int64_t pairs,
                      at::BFloat16* out, int64_t out_stride, const char* pf, int64_t pf_stride, int64_t pf_n) {
  __m512 acc[ROWS][COLS];
  bf16_tile_sums(acc, x, x_stride, w, w_stride, pairs, pf, pf_stride, pf_n);  // the next panel into L2 meanwhile
  if constexpr (SILU) {
    static_assert(COLS == 2, "a gate block and its up block");
    for (int r = 0; r < ROWS; ++r) {
      const __m512 y = silu_mul16<c10::BFloat16>(bf16_rounded(acc[r][0]), bf16_rounded(acc[r][1]));
      if constexpr (STREAM)
        _mm256_stream_si256(reinterpret_cast<__m256i*>(out + r * out_stride),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits(y), 16)));
      else
        store16(out + r * out_stride, y);
    }
  } else {
    store_tile<ROWS, COLS, STREAM>(acc, out, out_stride);
  }
}

// All rows of x against one panel of COLS blocks (w_stride apart), in tiles of ROWS rows
// (then fewer). While they run, the tiles ask in equal shares for the pf_n lines at pf and
// at pf + pf_stride (the two blocks of the panel the thread takes next): a panel read from
// memory arrives before its first tile needs it.
template <int COLS, bool SILU, bool STREAM, int ROWS = 8>
void bf16_rows(const uint32_t* x, int64_t x_stride, int64_t rows, const uint32_t* w, int64_t w_stride, int64_t pairs,
               at::BFloat16* out, int64_t out_stride, const char* pf, int64_t pf_stride, int64_t pf_n) {
  if constexpr (ROWS > 0) {
    const int64_t tiles = rows / ROWS + (rows % ROWS != 0);
    const int64_t share = tiles ? (pf_n + tiles - 1) / tiles : 0;
    for (; rows >= ROWS; rows -= ROWS, x += ROWS * x_stride, out += ROWS * out_stride) {
      const int64_t n = std::min(share, pf_n);
      bf16_tile<ROWS, COLS, SILU, STREAM>(x, x_stride, w, w_stride, pairs, out, out_stride, pf, pf_stride, n);
      pf += 64 * n;
      pf_n -= n;
    }
    if (rows)
      bf16_rows<COLS, SILU, STREAM, ROWS - 1>(x, x_stride, rows, w, w_stride, pairs, out, out_stride, pf, pf_stride, pf_n);
  }
}
#endif

bool bf16_gemm_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

namespace {

// bf16_gemm, or with silu bf16_gemm_silu: one body, the tasks two blocks of the product's
// outputs, or a gate block and its up block.
at::Tensor bf16_product(const at::Tensor& x, const at::Tensor& w, bool silu) {
  const char* name = silu ? "bf16_gemm_silu" : "bf16_gemm";
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1 && x.stride(0) % 2 == 0 &&
                  x.size(1) % 2 == 0,
              name, ": x must be bfloat16 [M, K] with contiguous rows, K and the row stride even");
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.size(1) * 2 == x.size(1) &&
                  w.size(2) == 16 && w.size(3) == 2 && (!silu || w.size(0) % 2 == 0),
              name, ": w must be contiguous bfloat16 [N / 16, K / 2, 16, 2] with K = x.size(1)",
              silu ? " (a [gate; up] weight as bf16_pairs, N / 2 a multiple of 16)" : "");
  const int64_t rows = x.size(0), pairs = w.size(1), blocks = w.size(0), half = blocks / 2;
  const int64_t outputs = silu ? half * 16 : blocks * 16;
  at::Tensor out = at::empty({rows, outputs}, x.options());
#if defined(__AVX512BF16__)
  if (rows == 0) return out;
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x.const_data_ptr<at::BFloat16>());
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(w.const_data_ptr<at::BFloat16>());
  at::BFloat16* op = out.mutable_data_ptr<at::BFloat16>();
  const int64_t x_stride = x.stride(0) / 2, block = pairs * 16, block_bytes = block * 4;
  constexpr int64_t kRowBlock = 256;  // the rows one pass over the weight takes (x's block stays in cache)
  // An output of several MB (a prefill step's) is written past the caches (non-temporal stores):
  // ordinary stores first read each line in and then push x's row block and the weight panels out
  // of L2. Zen 4, 2 threads, [4096, 576] x [576 -> 3072]: 409-430 -> 439-450 GFLOP/s (bf16_gemm_silu
  // 398-413 -> 414-419); the offline workload's prefill 10.76 -> 10.60 s (means of 5, alternating).
  constexpr int64_t kStreamBytes = 4 << 20;
  const bool stream = rows * outputs * 2 >= kStreamBytes && reinterpret_cast<uintptr_t>(op) % 32 == 0;
  const auto run = [&]<bool STREAM>() {
    for (int64_t m = 0; m < rows; m += kRowBlock) {
      const int64_t m_rows = std::min(kRowBlock, rows - m);
      const uint32_t* xs = xp + m * x_stride;
      at::parallel_for(0, silu ? half : (blocks + 1) / 2, 1, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
          if (silu) {  // gate block j and up block j + half; next, the pair j + 1
            const int64_t j = task, up = half * block;
            const char* next = reinterpret_cast<const char*>(wp + std::min(j + 1, half) * block);
            bf16_rows<2, true, STREAM>(xs, x_stride, m_rows, wp + j * block, up, pairs, op + m * outputs + j * 16,
                                       outputs, next, up * 4, j + 1 < half ? pairs : 0);
            continue;
          }
          const int64_t b = task * 2;
          at::BFloat16* os = op + m * outputs + b * 16;
          // the thread's next panel: blocks b + 2 and b + 3 (or b + 2 twice), if any
          const char* next = reinterpret_cast<const char*>(wp + std::min(b + 2, blocks) * block);
          const int64_t next_n = b + 2 < blocks ? pairs : 0, next_stride = b + 3 < blocks ? block_bytes : 0;
          if (b + 1 < blocks)
            bf16_rows<2, false, STREAM>(xs, x_stride, m_rows, wp + b * block, block, pairs, os, outputs, next,
                                        next_stride, next_n);
          else
            bf16_rows<1, false, STREAM>(xs, x_stride, m_rows, wp + b * block, block, pairs, os, outputs, next,
                                        next_stride, next_n);
        }
        if constexpr (STREAM) _mm_sfence();  // the streamed stores reach memory before another thread reads them
      });
    }
  };
  if (stream)
    run.template operator()<true>();
  else
    run.template operator()<false>();
#else
  TORCH_CHECK(false, name, ": this build has no AVX512-BF16 (bf16_gemm_available() is false)");
#endif
  return out;
}

}  // namespace

at::Tensor bf16_gemm(const at::Tensor& x, const at::Tensor& w) { return bf16_product(x, w, false); }

// silu_and_mul(bf16_gemm(x, w)) for w the pairs of a [gate; up] weight ([2 I, K], I a multiple
// of 16), in one pass: each tile takes gate block j and up block j and stores the I-wide
// activation, bit for bit what the two operators give, without the [M, 2 I] product in memory.
at::Tensor bf16_gemm_silu(const at::Tensor& x, const at::Tensor& w) { return bf16_product(x, w, true); }

// One expert's product x weight^T (vframe/layers/moe.py's _mm / _packed_mm / _pairs_mm): torch.mm on
// the stacked [out, in] weight, oneDNN's linear on a weight packed for it, or bf16_gemm on pairs.
at::Tensor expert_product(const at::Tensor& x, const at::Tensor& weight, int64_t layout) {
  if (layout == 0) return at::mm(x, weight.t());
  if (layout == 2) return bf16_gemm(x, weight);
  static const c10::OperatorHandle linear = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  static const c10::TypePtr scalars = linear.schema().arguments()[4].type()->castRaw<c10::ListType>()->getElementType();
  torch::jit::Stack stack{x, weight, c10::IValue(), std::string("none"), c10::impl::GenericList(scalars), std::string("")};
  linear.callBoxed(stack);
  return std::move(stack[0]).toTensor();
}

// x [T, H], topk_weights [T, K] float32, topk_ids [T, K] int64 -> [T, H] float32, the weighted sum
// of each token's experts before the cast (w13 / w2: E matrices [2I, H] / [H, I], stacked or packed).
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                       const std::vector<at::Tensor>& w13, const std::vector<at::Tensor>& w2, int64_t layout) {
  TORCH_CHECK(layout >= 0 && layout <= 2, "moe_experts: layout must be 0 (stacked), 1 (oneDNN) or 2 (bf16 pairs)");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "moe_experts: x must be [T, H] with contiguous rows");
  const int64_t tokens = x.size(0), num_experts = static_cast<int64_t>(w13.size());
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == tokens && topk_ids.scalar_type() == at::kLong &&
                  topk_ids.is_contiguous(),
              "moe_experts: topk_ids must be contiguous int64 [T, K], T = ", tokens);
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes() && topk_weights.scalar_type() == at::kFloat &&
                  topk_weights.is_contiguous(),
              "moe_experts: topk_weights must be contiguous float32, shaped as topk_ids");
  TORCH_CHECK(num_experts > 0 && w2.size() == w13.size(), "moe_experts: w13 and w2 must hold the same experts");
  const int64_t top_k = topk_ids.size(1), pairs = tokens * top_k;
  const int64_t* ids = topk_ids.const_data_ptr<int64_t>();
  const float* weights = topk_weights.const_data_ptr<float>();
  // A stable counting sort of the pairs by expert: torch.argsort(ids, stable=True).
  std::vector<int64_t> starts(num_experts + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(ids[p] >= 0 && ids[p] < num_experts, "moe_experts: expert id ", ids[p], " is not below ", num_experts);
    ++starts[ids[p] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) starts[e + 1] += starts[e];
  at::Tensor token_ids = at::empty({pairs}, topk_ids.options());
  at::Tensor pair_weights = at::empty({pairs}, topk_weights.options());
  int64_t* tok = token_ids.mutable_data_ptr<int64_t>();
  float* pw = pair_weights.mutable_data_ptr<float>();
  std::vector<int64_t> next(starts.begin(), starts.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t at = next[ids[p]]++;
    tok[at] = p / top_k;
    pw[at] = weights[p];
  }
  const at::Tensor rows = x.index_select(0, token_ids);  // [S, H], grouped by expert
  // Each expert's rows through its MLP, its output kept apart (no copy into one [S, H] buffer).
  std::vector<at::Tensor> outs(num_experts);
  for (int64_t e = 0; e < num_experts; ++e)
    if (starts[e + 1] > starts[e])
      outs[e] = expert_product(silu_and_mul(expert_product(rows.slice(0, starts[e], starts[e + 1]), w13[e], layout)),
                               w2[e], layout);
  // moe_combine over the experts' outputs in pair order: the same products and sums.
  for (const at::Tensor& out : outs)
    TORCH_CHECK(!out.defined() || out.stride(1) == 1, "moe_experts: an expert's output rows are not contiguous");
  const int64_t hidden = x.size(1);
  at::Tensor acc = at::zeros({tokens, hidden}, x.options().dtype(at::kFloat));
  float* ap = acc.mutable_data_ptr<float>();
  AT_DISPATCH_V2(x.scalar_type(), "moe_experts", AT_WRAP([&] {
    at::parallel_for(0, hidden, 64, [&](int64_t begin, int64_t end) {
      for (int64_t e = 0; e < num_experts; ++e)
        if (outs[e].defined())
          add_weighted_rows(ap, hidden, tok, pw, starts[e], starts[e + 1], outs[e].const_data_ptr<scalar_t>(),
                            outs[e].stride(0), begin, end);
    });
  }), at::kFloat, at::kBFloat16, at::kHalf);
  return acc;
}

// ------------------------------------------------------------------------------------------- //
// A decode plan (vframe/backends/cpu_paged/plan.py): a Llama-style model's decoder layers for a step
// whose tokens are all decodes, run here with no Python between the operators. Each layer is
// exactly LlamaDecoderLayer.forward with every module bound (vframe/layers/binding.py):
//
//   h = x + o(attention(rotary(split(qkv(rms_norm(x))))))     x' = h + down(silu_and_mul(gate_up(rms_norm(h))))
//
// where a bfloat16 layer's gate/up weight is held as pairs (set_silu_pairs) its product and SwiGLU
// are one operator, as the bound LlamaMLP calls them: x' = h + down(bf16_gemm_silu(rms_norm(h), pairs)),
//
// or, for a layer whose MLP is a mixture of experts (MixtralSparseMoeBlock with its FusedMoE),
//
//   x' = h + moe_experts(n, softmax_topk(router(n)), experts).to(dtype)      n = rms_norm(h)
//
// with softmax_topk as vframe/layers/moe.py spells it (the same ATen operators: softmax in float32,
// topk, optionally divided by the sum).
//
// the four linears called through the dispatcher as their bound functions describe them
// (vframe.quant.native_call.NativeCall: op(x, *args) [+ bias]), the norms, rotary, KV write and SwiGLU
// as the functions above, attention as cpu_paged's paged_decode_attention. Same operators,
// same order, same arguments as the layers' bound forward: the same result bit for bit.

struct BoundCall {
  c10::OperatorHandle op;
  std::vector<c10::IValue> args;  // what follows x
  std::optional<at::Tensor> bias;  // added after the call (out + bias), where op does not take it

  at::Tensor operator()(const at::Tensor& x) const {
    torch::jit::Stack stack;
    stack.reserve(args.size() + 1);
    stack.emplace_back(x);
    stack.insert(stack.end(), args.begin(), args.end());
    op.callBoxed(stack);
    at::Tensor out = std::move(stack[0]).toTensor();
    return bias ? at::add(out, *bias) : out;
  }
};

c10::OperatorHandle find_operator(const std::string& name, const std::string& overload) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload == "default" ? "" : overload.c_str());
}

struct MoeMlp {
  BoundCall router;
  int64_t top_k;
  bool renormalize;
  std::vector<at::Tensor> w13, w2;
  int64_t layout;
};

// Calibrated FP8 KV-cache scales per KV head (plugin API 1.22), float32, shaped to broadcast as
// AttentionImpl.fold_kv_head_scales applies them: keys / k and values / v ([KVH, 1] against [T, KVH, D]),
// the query heads times their KV head's k ([H, 1] against [T, H, D]), the output times its v ([H, 1]).
struct HeadScales {
  at::Tensor k, v, query, output;
};

struct PlanLayer {
  at::Tensor input_norm, post_norm;
  int64_t sliding_window;  // 0: none
  double k_scale, v_scale;  // calibrated FP8 KV-cache scales (1.0: none), as the layer's attention impl applies them
  std::vector<BoundCall> linears;  // qkv, o, gate_up, down; qkv, o where moe is set
  std::optional<MoeMlp> moe;
  std::optional<at::Tensor> silu_pairs;  // gate_up's weight as bf16 pairs: bf16_gemm_silu in place of linears[2]
  std::optional<HeadScales> head_scales;  // per KV head, in place of k_scale / v_scale
};

struct DecodePlan : torch::CustomClassHolder {
  int64_t heads, kv_heads, head_dim;
  double scale, eps;
  at::Tensor cos_sin;
  c10::OperatorHandle attention;
  std::vector<PlanLayer> layers;

  DecodePlan(int64_t heads, int64_t kv_heads, int64_t head_dim, double scale, double eps, at::Tensor cos_sin)
      : heads(heads), kv_heads(kv_heads), head_dim(head_dim), scale(scale), eps(eps), cos_sin(std::move(cos_sin)),
        attention(find_operator("vframe_cpu::paged_decode_attention", "")) {}

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, int64_t sliding_window, double k_scale, double v_scale) {
    layers.push_back(PlanLayer{std::move(input_norm), std::move(post_norm), sliding_window, k_scale, v_scale, {}, std::nullopt,
                               std::nullopt, std::nullopt});
  }

  // The last layer's calibrated FP8 KV-cache scales per KV head, k and v float32 [KVH] (its attention
  // impl's kv_head_scales).
  void set_head_scales(const at::Tensor& k, const at::Tensor& v) {
    TORCH_CHECK(!layers.empty(), "DecodePlan.set_head_scales: add_layer first");
    for (const auto* t : {&k, &v})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 1 && t->size(0) == kv_heads,
                  "DecodePlan.set_head_scales: k and v must be float32 [", kv_heads, "]");
    const int64_t group = heads / kv_heads;
    layers.back().head_scales = HeadScales{k.contiguous().view({kv_heads, 1}), v.contiguous().view({kv_heads, 1}),
                                           k.repeat_interleave(group).view({heads, 1}),
                                           v.repeat_interleave(group).view({heads, 1})};
  }

  static BoundCall bound_call(const std::string& name, const std::string& overload, std::vector<c10::IValue> args,
                              std::optional<at::Tensor> bias) {
    c10::OperatorHandle op = find_operator(name, overload);
    const auto& schema = op.schema().arguments();
    TORCH_CHECK(args.size() + 1 == schema.size(), "DecodePlan: ", name, " takes ", schema.size(),
                " arguments, not x and ", args.size());
    for (size_t i = 0; i < args.size(); ++i) {  // Python cannot send an empty list as Any: it sends None
      const auto list = schema[i + 1].type()->cast<c10::ListType>();
      if (list && args[i].isNone()) args[i] = c10::impl::GenericList(list->getElementType());
    }
    return BoundCall{std::move(op), std::move(args), std::move(bias)};
  }

  // The last layer's next linear, in the order qkv, o, gate_up, down (qkv, o before add_moe).
  void add_linear(const std::string& name, const std::string& overload, std::vector<c10::IValue> args,
                  std::optional<at::Tensor> bias) {
    TORCH_CHECK(!layers.empty() && layers.back().linears.size() < (layers.back().moe ? 2 : 4),
                "DecodePlan.add_linear: add_layer first, four linears each (two with add_moe)");
    layers.back().linears.push_back(bound_call(name, overload, std::move(args), std::move(bias)));
  }

  // The last layer's MLP is a mixture of experts: its router linear, routing and experts.
  void add_moe(const std::string& name, const std::string& overload, std::vector<c10::IValue> args,
               std::optional<at::Tensor> bias, int64_t top_k, bool renormalize, std::vector<at::Tensor> w13,
               std::vector<at::Tensor> w2, int64_t layout) {
    TORCH_CHECK(!layers.empty() && !layers.back().moe && layers.back().linears.size() <= 2,
                "DecodePlan.add_moe: add_layer first, one MoE MLP each, in place of gate_up and down");
    TORCH_CHECK(!w13.empty() && w13.size() == w2.size() && top_k >= 1 && top_k <= static_cast<int64_t>(w13.size()),
                "DecodePlan.add_moe: as many w13 as w2 matrices, 1 <= top_k <= experts");
    layers.back().moe = MoeMlp{bound_call(name, overload, std::move(args), std::move(bias)), top_k, renormalize,
                               std::move(w13), std::move(w2), layout};
  }

  // The last layer's gate/up product and SwiGLU are bf16_gemm_silu(normed, pairs) (its LlamaMLP's).
  void set_silu_pairs(at::Tensor pairs) {
    TORCH_CHECK(!layers.empty() && !layers.back().moe, "DecodePlan.set_silu_pairs: add_layer first, not with add_moe");
    layers.back().silu_pairs = std::move(pairs);
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers.size()); }

  // x [T, E] (the embedded tokens) -> the last layer's output [T, E], before the final norm.
  at::Tensor run(at::Tensor x, const at::Tensor& positions, const std::vector<at::Tensor>& kv_caches,
                 const at::Tensor& slots, const at::Tensor& block_table, const at::Tensor& seq_lens,
                 const at::Tensor& req_ids, const at::Tensor& query_rows) const {
    TORCH_CHECK(kv_caches.size() == layers.size(), "DecodePlan.run: one KV cache per layer");
    const int64_t tokens = x.size(0);
    const std::vector<int64_t> sizes{heads, kv_heads, kv_heads};
    for (size_t i = 0; i < layers.size(); ++i) {
      const PlanLayer& layer = layers[i];
      const size_t expected = layer.moe ? 2 : 4;
      TORCH_CHECK(layer.linears.size() == expected, "DecodePlan.run: layer ", i, " has ", layer.linears.size(),
                  " linears, not ", expected);
      const at::Tensor& kv = kv_caches[i];
      at::Tensor qkv = layer.linears[0](rms_norm(x, layer.input_norm, eps)).view({tokens, heads + 2 * kv_heads, head_dim});
      std::vector<at::Tensor> qkv_heads = qkv.split_with_sizes(sizes, 1);
      const at::Tensor &q = qkv_heads[0], &k = qkv_heads[1], &v = qkv_heads[2];
      rotary_neox_(positions, q, k, cos_sin);
      // a float8 cache with calibrated scales: K / k_scale and V / v_scale stored (float32 division, rounded
      // once: the bits of TorchAttentionImpl.kv_cache_domain's x.float() / scale), k_scale folded into the
      // softmax scale and v_scale into the output; per KV head (fold_kv_head_scales' operations, so its bits)
      // K and V divided per head in float32, the query heads times their k, the output times their v
      const bool fp8 = kv.scalar_type() == at::kFloat8_e4m3fn || kv.scalar_type() == at::kFloat8_e5m2;
      const HeadScales* per_head = fp8 && layer.head_scales ? &*layer.head_scales : nullptr;
      const bool scaled = fp8 && !per_head && (layer.k_scale != 1.0 || layer.v_scale != 1.0);
      at::Tensor query = q;
      if (per_head) {
        store_kv(k.to(at::kFloat).div(per_head->k), v.to(at::kFloat).div(per_head->v), kv, slots, 1.0, 1.0);
        query = q.to(at::kFloat).mul(per_head->query).to(q.scalar_type());
      } else {
        store_kv(k, v, kv, slots, scaled ? layer.k_scale : 1.0, scaled ? layer.v_scale : 1.0);
      }
      at::Tensor attended = at::empty_like(q);
      torch::jit::Stack stack{attended, query, kv.select(0, 0), kv.select(0, 1), block_table, seq_lens,
                              req_ids, query_rows, scaled ? scale * layer.k_scale : scale, layer.sliding_window};
      attention.callBoxed(stack);
      if (scaled) attended.mul_(layer.v_scale);
      if (per_head) attended.mul_(per_head->output);
      at::Tensor h = at::add(x, layer.linears[1](attended.reshape({tokens, heads * head_dim})));
      const at::Tensor normed = rms_norm(h, layer.post_norm, eps);
      at::Tensor mlp;
      if (layer.moe) {
        const MoeMlp& moe = *layer.moe;
        const at::Tensor probs = at::softmax(moe.router(normed).to(at::kFloat), -1);
        auto [weights, ids] = at::topk(probs, moe.top_k, -1);
        if (moe.renormalize) weights = at::div(weights, at::sum(weights, {-1}, true));
        mlp = moe_experts(normed, weights, ids, moe.w13, moe.w2, moe.layout).to(x.scalar_type());
      } else {
        mlp = layer.linears[3](layer.silu_pairs ? bf16_gemm_silu(normed, *layer.silu_pairs)
                                                : silu_and_mul(layer.linears[2](normed)));
      }
      x = at::add(h, mlp);
    }
    return x;
  }
};

}  // namespace

TORCH_LIBRARY(vframe_cpu_ops, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rotary_neox_(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor cos_sin_cache) -> ()");
  m.def("store_kv(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slots, float k_scale=1.0, float v_scale=1.0) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("moe_combine(Tensor rows, Tensor token_ids, Tensor weights, int num_tokens) -> Tensor");
  m.def("moe_experts(Tensor x, Tensor topk_weights, Tensor topk_ids, Tensor[] w13, Tensor[] w2, int layout) -> Tensor");
  m.def("bf16_gemm(Tensor x, Tensor w) -> Tensor");
  m.def("bf16_gemm_available() -> bool", &bf16_gemm_available);
  m.def("bf16_gemm_silu(Tensor x, Tensor w) -> Tensor");
  m.class_<DecodePlan>("DecodePlan")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, at::Tensor>())
      .def("add_layer", &DecodePlan::add_layer)
      .def("add_linear", &DecodePlan::add_linear)
      .def("add_moe", &DecodePlan::add_moe)
      .def("set_silu_pairs", &DecodePlan::set_silu_pairs)
      .def("set_head_scales", &DecodePlan::set_head_scales)
      .def("num_layers", &DecodePlan::num_layers)
      .def("run", &DecodePlan::run);
}

TORCH_LIBRARY_IMPL(vframe_cpu_ops, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary_neox_", &rotary_neox_);
  m.impl("store_kv", &store_kv);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("moe_combine", &moe_combine);
  m.impl("moe_experts", &moe_experts);
  m.impl("bf16_gemm", &bf16_gemm);
  m.impl("bf16_gemm_silu", &bf16_gemm_silu);
}

// Experts packed for oneDNN are MkldnnCPU tensors: a call holding them dispatches there.
TORCH_LIBRARY_IMPL(vframe_cpu_ops, MkldnnCPU, m) { m.impl("moe_experts", &moe_experts); }
