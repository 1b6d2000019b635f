// bf16_gemm's tile, shared by the libraries that multiply bfloat16 pairs: cpu_ops.cpp's bf16_gemm
// (and bf16_gemm_silu) and woq_gemm.cpp's pairs kernels (their dequantized panels, and the in-place
// tiles' store), so that their products are the same bits. Included by both; NativeLibrary hashes it
// into each library's build key (its `headers`).
//
// The layout: x as bfloat16 pairs (one uint32 an input pair, a row x_stride words apart); a block of 16
// outputs as [pairs, 16] pairs (w_stride words from one block to the next), the operand of vdpbf16ps.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

#if defined(__AVX512BF16__)
#include <immintrin.h>

// ROWS rows of x against COLS blocks of 16 outputs: acc[r][c] = the sums over the pairs in order, one
// vdpbf16ps a pair (every weight pair read once a tile). While they run, the first pf_n lines at pf and
// at pf + pf_stride are asked for, one each a pair, into L2 (a panel the thread takes next; T0, into L1,
// measured slower); pf_n = 0 asks for nothing.
template <int ROWS, int COLS>
inline void bf16_tile_sums(__m512 (&acc)[ROWS][COLS], const uint32_t* x, int64_t x_stride, const uint32_t* w,
                           int64_t w_stride, int64_t pairs, const char* pf = nullptr, int64_t pf_stride = 0,
                           int64_t pf_n = 0) {
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < COLS; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < pairs; ++k) {
    if (k < pf_n) {
      _mm_prefetch(pf + 64 * k, _MM_HINT_T1);
      _mm_prefetch(pf + pf_stride + 64 * k, _MM_HINT_T1);
    }
    __m512bh wv[COLS];
    for (int c = 0; c < COLS; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(w + c * w_stride + k * 16);
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * x_stride + k]));
      for (int c = 0; c < COLS; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
    }
  }
}

// A tile's float32 sums as bfloat16, ROWS rows x COLS blocks of 16 outputs (what bf16_gemm stores);
// STREAM: past the caches (an output of several MB).
template <int ROWS, int COLS, bool STREAM = false>
inline void store_tile(const __m512 (&acc)[ROWS][COLS], c10::BFloat16* out, int64_t out_stride) {
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < COLS; ++c) {
      auto* o = reinterpret_cast<__m256i*>(out + r * out_stride + c * 16);
      if constexpr (STREAM)
        _mm256_stream_si256(o, (__m256i)_mm512_cvtneps_pbh(acc[r][c]));
      else
        _mm256_storeu_si256(o, (__m256i)_mm512_cvtneps_pbh(acc[r][c]));
    }
}
#endif
