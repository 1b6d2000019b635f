// Fused elementwise operators of the decoder layers on the CPU, each equal to the
// PyTorch expression it replaces (vframe/layers/cpu_ops.py):
//
//   rms_norm(x, w, eps)        w * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)
//   rotary_neox_(pos, q, k, c) q, k rotated in place: [x1*cos - x2*sin, x2*cos + x1*sin]
//                              with cos / sin = c[pos].to(q.dtype), every product and sum
//                              rounded to q's dtype as PyTorch's separate operators round them
//
// Built with -ffp-contract=off so that no product and sum fuse into one rounding.
// rms_norm's mean adds the squares in another order than PyTorch's reduction: its
// float32 variance may differ in the last bit (the rotation is bit-exact).
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

namespace {

template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}
template <>
inline float round_to<float>(float x) {
  return x;
}

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t n, int64_t x_stride, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      T* o = out + r * n;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < n; ++i) {
        const float v = static_cast<float>(xr[i]);
        sum += v * v;
      }
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
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

template <typename T>
void rotate_heads(T* base, int64_t tokens, int64_t heads, int64_t s0, int64_t s1, int64_t half, const int64_t* pos,
                  const float* cache, int64_t cache_stride) {
  at::parallel_for(0, tokens * heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t th = begin; th < end; ++th) {
      const int64_t t = th / heads, h = th % heads;
      T* x = base + t * s0 + h * s1;
      const float* cs = cache + pos[t] * cache_stride;
#pragma omp simd
      for (int64_t j = 0; j < half; ++j) {
        const float c = round_to<T>(cs[j]), s = round_to<T>(cs[j + half]);
        const float x1 = static_cast<float>(x[j]), x2 = static_cast<float>(x[j + half]);
        const float a = round_to<T>(x1 * c) - round_to<T>(x2 * s);
        const float b = round_to<T>(x2 * c) + round_to<T>(x1 * s);
        x[j] = static_cast<T>(a);
        x[j + half] = static_cast<T>(b);
      }
    }
  });
}

template <typename T>
void rotate(const at::Tensor& x, const int64_t* pos, const at::Tensor& cache) {
  rotate_heads(x.data_ptr<T>(), x.size(0), x.size(1), x.stride(0), x.stride(1), x.size(2) / 2, pos,
               cache.data_ptr<float>(), cache.stride(0));
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
  for (const auto* t : {&query, &key}) {
    AT_DISPATCH_V2(t->scalar_type(), "rotary_neox_", AT_WRAP([&] { rotate<scalar_t>(*t, pos, cos_sin_cache); }),
                   at::kFloat, at::kBFloat16, at::kHalf);
  }
}

}  // namespace

TORCH_LIBRARY(vframe_cpu_ops, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rotary_neox_(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor cos_sin_cache) -> ()");
}

TORCH_LIBRARY_IMPL(vframe_cpu_ops, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary_neox_", &rotary_neox_);
}
