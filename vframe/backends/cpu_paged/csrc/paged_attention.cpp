// Paged attention for one query token per request (decode), reading keys and
// values in place through the block table: no gather into padded tensors.
//
// One task per request (per (request, KV head) on AVX2 when there are few requests):
// the `group` query heads that share a KV head are scored against each key as it is
// read, so every K/V row is loaded once.
//
//   pass 1: s[g][t] = scale * q[g] . k[t]          t in [start, seq_len)
//   softmax over t, in float32
//   pass 2: out[g]  = sum_t p[g][t] * v[t]
//
// Slots past a request's length are never read, so whatever they hold (NaN
// included) cannot reach the output.
//
// The cache holds the query's dtype, or float8 (kv_cache_dtype="fp8" / "fp8_e5m2":
// e4m3fn or e5m2 bytes, scale 1.0), read in place and widened to float32 exactly.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <numeric>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(c10::Float8_e4m3fn x) { return static_cast<float>(x); }
inline float to_float(c10::Float8_e5m2 x) { return static_cast<float>(x); }

// The vector paths (load8 / load16) read e4m3 as its value times 2^-8, a float16 of the
// same bits shifted (four integer instructions and F16C instead of nine to widen it
// exactly); the 2^8 goes into the queries (pass 1) and the probabilities (pass 2). A
// power of two: every product, and so the result, is bit for bit the exact reading's.
template <typename C>
constexpr float kLoadScale = 1.f;
template <>
constexpr float kLoadScale<c10::Float8_e4m3fn> = 256.f;

template <typename C>
inline void scale_for_loads(float* q, int64_t count) {
  if constexpr (kLoadScale<C> != 1.f)
    for (int64_t i = 0; i < count; ++i) q[i] *= kLoadScale<C>;
}

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) dst[d] = to_float(src[d]);
}

// Slot of position t, through the block table.
inline int64_t slot_of(const int32_t* blocks, int64_t block_size, int64_t t) {
  return static_cast<int64_t>(blocks[t / block_size]) * block_size + t % block_size;
}

// slots[0 .. end - begin) = the cache slots of positions begin .. end - 1, block by block
// (one table read a block, no division per token).
inline void fill_slots(std::vector<int64_t>& slots, const int32_t* blocks, int64_t block_size, int64_t begin,
                       int64_t end) {
  slots.resize(end - begin);
  for (int64_t t = begin; t < end;) {
    const int64_t base = static_cast<int64_t>(blocks[t / block_size]) * block_size;
    for (const int64_t block_end = std::min(end, (t / block_size + 1) * block_size); t < block_end; ++t)
      slots[t - begin] = base + t % block_size;
  }
}

// The first position a token at position n - 1 attends: its sliding window's start (0: none).
inline int64_t window_start(int64_t n, int64_t sliding_window) {
  return sliding_window > 0 ? std::max<int64_t>(0, n - sliding_window) : 0;
}

// Asks for the cache lines of one slot ahead of use: blocks lie anywhere in the
// cache, so the hardware prefetcher cannot follow a request from block to block.
// Locality 3 (prefetcht0, the default): into L1, for data wanted next; 2 (prefetcht1): into
// L2, for data wanted a while later.
template <int Locality = 3, typename T>
inline void prefetch_slot(const T* slot, int64_t slot_size) {
  const char* p = reinterpret_cast<const char*>(slot);
  for (int64_t off = 0; off < slot_size * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(p + off, 0, Locality);
}

constexpr int64_t kPrefetchDistance = 4;  // slots

// One request: every query head against the request's keys and values. Each
// token's slot holds all KV heads side by side ([KVH, D], contiguous), and a block
// holds block_size such slots back to back, so the cache is read as one stream per
// block. HD > 0 fixes the head size at compile time (loops unrolled and vectorized);
// HD == 0 takes it at run time.
template <typename T, int HD>
void attend_request(
    int64_t head_size_rt, int64_t num_kv_heads, int64_t group,
    const float* q,  // [H, D] float32, pre-scaled
    const T* k_cache, const T* v_cache, const int32_t* blocks, int64_t block_size, int64_t start,
    int64_t seq_len,
    float* scores,  // [H, seq_len - start]
    float* acc,     // [H, D]
    float* row) {   // [KVH * D] scratch
  const int64_t D = HD > 0 ? HD : head_size_rt;
  const int64_t slot_size = num_kv_heads * D;
  const int64_t len = seq_len - start;
  // pass 1: scores
  for (int64_t t = start; t < seq_len;) {
    const int64_t block = blocks[t / block_size];
    const int64_t end = std::min(seq_len, (t / block_size + 1) * block_size);
    const T* k = k_cache + (block * block_size + t % block_size) * slot_size;
    for (; t < end; ++t, k += slot_size) {
      if (t + kPrefetchDistance < seq_len)
        prefetch_slot(k_cache + slot_of(blocks, block_size, t + kPrefetchDistance) * slot_size, slot_size);
      load_row(k, row, slot_size);
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const float* kh = row + h * D;
        for (int64_t g = 0; g < group; ++g) {
          const float* qh = q + (h * group + g) * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qh[d] * kh[d];
          scores[(h * group + g) * len + (t - start)] = s;
        }
      }
    }
  }
  const int64_t num_heads = num_kv_heads * group;
  for (int64_t hq = 0; hq < num_heads; ++hq) {
    float* sh = scores + hq * len;
    float mx = -INFINITY;
    for (int64_t t = 0; t < len; ++t) mx = std::max(mx, sh[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < len; ++t) {
      sh[t] = std::exp(sh[t] - mx);
      sum += sh[t];
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < len; ++t) sh[t] *= inv;
  }
  // pass 2: the probability-weighted sum of values
  std::fill(acc, acc + num_heads * D, 0.f);
  for (int64_t t = start; t < seq_len;) {
    const int64_t block = blocks[t / block_size];
    const int64_t end = std::min(seq_len, (t / block_size + 1) * block_size);
    const T* v = v_cache + (block * block_size + t % block_size) * slot_size;
    for (; t < end; ++t, v += slot_size) {
      if (t + kPrefetchDistance < seq_len)
        prefetch_slot(v_cache + slot_of(blocks, block_size, t + kPrefetchDistance) * slot_size, slot_size);
      load_row(v, row, slot_size);
      for (int64_t hq = 0; hq < num_heads; ++hq) {
        const float p = scores[hq * len + (t - start)];
        const float* vh = row + (hq / group) * D;
        float* ah = acc + hq * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ah[d] += p * vh[d];
      }
    }
  }
}

#if defined(__AVX512F__)
// The AVX-512 path, for head sizes that are a multiple of 16 (NC = D / 16 vectors
// of 16 floats). Per KV head it keeps the group's queries and accumulators in
// vector registers; scores are computed 16 tokens at a time and their 16 partial
// vectors reduced together (reduce16), which costs a few instructions per token
// instead of a full horizontal sum each.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// e5m2 is the upper byte of a float16: widened through it, infinities and NaN included.
inline __m512 load16(const c10::Float8_e5m2* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(raw), 8));
}
// e4m3fn times 2^-8 (kLoadScale): as load8's, sixteen at a time.
inline __m512 load16(const c10::Float8_e4m3fn* p) {
  const __m256i s = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  __m256i h = _mm256_and_si256(_mm256_slli_epi16(s, 7), _mm256_set1_epi16(static_cast<int16_t>(0xBF80)));
  const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x3F80)), _mm256_set1_epi16(0x3F80));
  h = _mm256_or_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x7E00)));
  return _mm512_cvtph_ps(h);
}

// r[i] = sum of the 16 lanes of v[i]
__attribute__((always_inline)) inline __m512 reduce16(const __m512* v) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int j = 0; j < 4; ++j)
    u[j] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * j], t[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * j], t[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 x0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 x1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x0, x1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(x0, x1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// exp(x) for x <= 0 (softmax after subtracting the maximum): x = n ln2 + r with
// |r| <= ln2 / 2, exp(r) by its Taylor polynomial to r^6 (relative error < 2e-7),
// times 2^n by scalef. Below -87 the result flushes towards 0, as float32's exp does.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// s[0 .. len) <- softmax(s)
inline void softmax_avx512(float* s, int64_t len) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + 16 <= len; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + t));
  float m = _mm512_reduce_max_ps(mx);
  for (int64_t u = t; u < len; ++u) m = std::max(m, s[u]);
  const __m512 vm = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (t = 0; t < len; t += 16) {
    const __mmask16 mask = len - t >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (len - t)) - 1u);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + t), vm));
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(mask, e));
    _mm512_mask_storeu_ps(s + t, mask, e);
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
  for (t = 0; t < len; t += 16) {
    const __mmask16 mask = len - t >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (len - t)) - 1u);
    _mm512_mask_storeu_ps(s + t, mask, _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, s + t), inv));
  }
}

constexpr int64_t kMaxGroup = 16;

// acc[g] += sum_i p[g * len + i] * v_i for G query heads of one KV head (offset within a slot),
// the chunk's nt slots
template <typename T, int NC, int G, typename Prefetch>
inline void weighted_values(const T* const* slots, int64_t offset, int64_t nt, const float* p, int64_t len, float* acc,
                            const Prefetch& prefetch) {
  constexpr int64_t D = NC * 16;
  __m512 a[G][NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) a[g][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < nt; ++i) {
    prefetch(i);
    __m512 v[NC];
    for (int c = 0; c < NC; ++c) v[c] = load16(slots[i] + offset + c * 16);
    for (int g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(p[g * len + i] * kLoadScale<T>);
      for (int c = 0; c < NC; ++c) a[g][c] = _mm512_fmadd_ps(w, v[c], a[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c)
      _mm512_storeu_ps(acc + g * D + c * 16, _mm512_add_ps(_mm512_loadu_ps(acc + g * D + c * 16), a[g][c]));
}

#if defined(__AVX512BF16__)
// Pass 1 for a bfloat16 cache and bfloat16 queries (AVX512-BF16): vdpbf16ps multiplies
// pairs of bfloat16 exactly and adds them in float32, 32 a vector, so a key row of 64 is
// two loads and two instructions per query head, nothing widened; a chunk's 16 partial
// vectors of one query head are reduced together, then scaled. qb: the unscaled bfloat16
// queries [H, D].
template <int NC>
inline void bf16_scores(const c10::BFloat16* const* slots, int64_t offset, int64_t nt, const c10::BFloat16* qb,
                        float scale, float* out) {
  static_assert(NC % 2 == 0, "pairs of 16-float vectors: 32 bfloat16 a load");
  constexpr int W = NC / 2;  // 32-value words of a row
  __m512bh q[W];
  for (int w = 0; w < W; ++w) q[w] = (__m512bh)_mm512_loadu_si512(qb + w * 32);
  __m512 partial[16];
  for (int64_t i = 0; i < 16; ++i) {
    __m512 s = _mm512_setzero_ps();
    if (i < nt)
      for (int w = 0; w < W; ++w) s = _mm512_dpbf16_ps(s, q[w], (__m512bh)_mm512_loadu_si512(slots[i] + offset + w * 32));
    partial[i] = s;
  }
  const __mmask16 valid = static_cast<__mmask16>((1u << nt) - 1u);
  _mm512_mask_storeu_ps(out, valid, _mm512_mul_ps(reduce16(partial), _mm512_set1_ps(scale)));
}
#endif

template <typename T, int NC>
void attend_request_avx512(
    int64_t slot_size,     // values a slot holds (every KV head's)
    int64_t num_kv_heads,  // the KV heads to attend: k_cache / v_cache point at the first one's values
    int64_t group, const float* q, const T* k_cache, const T* v_cache,
    const int64_t* cache_slots,  // the cache slots of positions start .. seq_len - 1 (fill_slots)
    int64_t start, int64_t seq_len, float* scores, float* acc,
    const c10::BFloat16* qb = nullptr, float scale = 1.f,  // qb: see bf16_scores
    // the keys of the task this thread runs next (its first KV head's values, slots, count)
    const T* upcoming_k = nullptr, const int64_t* upcoming_slots = nullptr, int64_t upcoming_len = 0) {
  constexpr int64_t D = NC * 16;
  const int64_t len = seq_len - start;
  const auto slot_at = [&](const T* cache, int64_t t) { return cache + cache_slots[t - start] * slot_size; };
  const int64_t num_heads = num_kv_heads * group;
  const T* slots[16];
  __m512 partial[kMaxGroup][16];
  // Chunks of 16 tokens; each chunk's slots (all KV heads) are read from memory once
  // and then stay in L1 while every head is computed.
  const T* next[16];
  int64_t num_next = 0;
  auto chunk_slots = [&](const T* cache, int64_t t0, int64_t nt) {
    for (int64_t i = 0; i < nt; ++i) slots[i] = slot_at(cache, t0 + i);
    num_next = std::clamp<int64_t>(seq_len - t0 - 16, 0, 16);
    for (int64_t i = 0; i < num_next; ++i) next[i] = slot_at(cache, t0 + 16 + i);
  };
  // The next chunk's slots, one per token of this chunk: spread out so that the
  // prefetches never queue up behind each other.
  auto prefetch_next = [&](int64_t i) {
    if (i < num_next) prefetch_slot(next[i], num_kv_heads * D);
  };
  // Pass 1 streams the keys from memory and, alongside, asks for the keys two chunks ahead
  // and for the chunk's values (pass 2 then finds them in L2: a request's values are 24 KiB
  // per 64-dim KV head at 100 tokens). SmolLM2 bf16, 64 requests of 300 tokens, a layer
  // inside a decode step: 1.29-1.61 -> 1.00-1.06 ms (0.45 with the cache in L2).
  //
  // Those slots (up to 32, 6 lines each for SmolLM2) are asked for in equal shares over the
  // chunk's work, never at once: a burst of some 200 prefetches fills the core's miss
  // buffers, and the arithmetic behind it waits until they drain, so that memory and
  // arithmetic took turns instead of overlapping. Zen 4, bf16, the offline workload's 64
  // requests (engine-like block tables), 30 layers from memory: 0.92 -> 0.61 ms a layer
  // (float32 1.77 -> 1.12); the offline workload 385-387 -> 408-412 output tokens/s. The
  // bfloat16 path no longer asks for the next chunk's keys into L1 (no difference measured).
  const T* ahead[32];
  int64_t num_ahead = 0, ahead_done = 0;
  auto list_ahead = [&](int64_t t0, int64_t nt) {
    num_ahead = ahead_done = 0;
    for (int64_t t = t0 + 32; t < std::min(t0 + 48, seq_len); ++t) ahead[num_ahead++] = slot_at(k_cache, t);
    for (int64_t t = t0; t < t0 + nt; ++t) ahead[num_ahead++] = slot_at(v_cache, t);
  };
  // asks for the list's first ceil(num_ahead * part / parts) slots (those not asked for yet)
  auto prefetch_ahead = [&](int64_t part, int64_t parts) {
    for (const int64_t upto = (num_ahead * part + parts - 1) / parts; ahead_done < upto; ++ahead_done)
      prefetch_slot<2>(ahead[ahead_done], num_kv_heads * D);
  };
  // pass 1: scores
  for (int64_t t0 = start; t0 < seq_len; t0 += 16) {
    const int64_t nt = std::min<int64_t>(16, seq_len - t0);
    chunk_slots(k_cache, t0, nt);
    const __mmask16 valid = static_cast<__mmask16>((1u << nt) - 1u);
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, c10::BFloat16> && NC % 2 == 0) {
      if (qb != nullptr) {  // the share before each head's scores
        list_ahead(t0, nt);
        for (int64_t hq = 0; hq < num_heads; ++hq) {
          prefetch_ahead(hq + 1, num_heads);
          bf16_scores<NC>(slots, hq / group * D, nt, qb + hq * D, scale, scores + hq * len + (t0 - start));
        }
        continue;
      }
    }
#endif
    list_ahead(t0, nt);
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      for (int64_t i = 0; i < 16; ++i) {  // the share before each token of each KV head
        prefetch_ahead(h * 16 + i + 1, num_kv_heads * 16);
        if (h == 0) prefetch_next(i);
        __m512 k[NC];
        for (int c = 0; c < NC; ++c) k[c] = i < nt ? load16(slots[i] + h * D + c * 16) : _mm512_setzero_ps();
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = q + (h * group + g) * D;
          __m512 s = _mm512_mul_ps(_mm512_loadu_ps(qg), k[0]);
          for (int c = 1; c < NC; ++c) s = _mm512_fmadd_ps(_mm512_loadu_ps(qg + c * 16), k[c], s);
          partial[g][i] = s;
        }
      }
      for (int64_t g = 0; g < group; ++g)
        _mm512_mask_storeu_ps(scores + (h * group + g) * len + (t0 - start), valid, reduce16(partial[g]));
    }
  }
  for (int64_t hq = 0; hq < num_heads; ++hq) softmax_avx512(scores + hq * len, len);
  // pass 2: the probability-weighted sum of values; per chunk and head, up to four
  // query heads accumulate in registers (a count fixed at compile time, so that they stay
  // there) and are added to acc once. It reads the values from L2 and computes; meanwhile
  // the next task's keys are asked for, spread over its chunks, so that memory is busy in
  // both passes, and within a chunk one slot a token (0.62 -> 0.60 ms a layer, as above).
  // SmolLM2 bf16, 64 requests of 300 tokens, a layer inside a decode step: 0.99-1.08 ->
  // 0.88-0.97 ms. (bfloat16 probabilities and vdpbf16ps here, as the prefill
  // tile's values pass does, measured 0.90-0.92 against 0.88-0.89: the pass waits on memory.)
  std::fill(acc, acc + num_heads * D, 0.f);
  const int64_t chunks = (len + 15) / 16, upcoming_per_chunk = (upcoming_len + chunks - 1) / chunks;
  int64_t upcoming_done = 0;
  for (int64_t t0 = start; t0 < seq_len; t0 += 16) {
    const int64_t nt = std::min<int64_t>(16, seq_len - t0);
    const int64_t upcoming_end = std::min(upcoming_len, upcoming_done + upcoming_per_chunk);
    const auto prefetch_upcoming = [&] {
      prefetch_slot<2>(upcoming_k + upcoming_slots[upcoming_done++] * slot_size, num_kv_heads * D);
    };
    chunk_slots(v_cache, t0, nt);
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      for (int64_t g0 = 0; g0 < group; g0 += 4) {
        const float* p = scores + (h * group + g0) * len + (t0 - start);
        float* a = acc + (h * group + g0) * D;
        const auto prefetch = [&](int64_t i) {
          if (h == 0 && g0 == 0) prefetch_next(i);
          if (g0 == 0 && upcoming_done < upcoming_end) prefetch_upcoming();
        };
        switch (std::min<int64_t>(4, group - g0)) {
          case 1: weighted_values<T, NC, 1>(slots, h * D, nt, p, len, a, prefetch); break;
          case 2: weighted_values<T, NC, 2>(slots, h * D, nt, p, len, a, prefetch); break;
          case 3: weighted_values<T, NC, 3>(slots, h * D, nt, p, len, a, prefetch); break;
          default: weighted_values<T, NC, 4>(slots, h * D, nt, p, len, a, prefetch); break;
        }
      }
    }
    while (upcoming_done < upcoming_end) prefetch_upcoming();  // the chunk's share, if its tokens were fewer
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)  // AVX-512 CPUs too: prefill_rows uses these
// The AVX2 path (CPUs without AVX-512), head sizes a multiple of 8 (NC = D / 8 vectors):
// scores 8 tokens at a time, their 8 partial vectors reduced together (reduce8); the
// softmax's exp vectorized (exp_nonpositive8); the value pass keeps one query head's
// accumulator in registers over a chunk of tokens. Against the portable loop (a
// horizontal sum and a scalar exp per score, one task per request): AVX2 EPYC, SmolLM2's
// 9 query / 3 KV heads of 64, float32, 2 threads: one request of 300 tokens 45-60 -> 32-40
// us, of 2,000 tokens 347 -> 140-150 us, 16 of 300 540 -> 250 us.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
// As load16's float8 forms (AVX-512 above), eight at a time.
inline __m256 load8(const c10::Float8_e5m2* p) {
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), raw));
}
// e4m3fn times 2^-8 (kLoadScale): the bytes sign-extended to 16 bits and shifted left by 7
// put the magnitude's exponent and mantissa where a float16's low exponent bits and top
// mantissa bits are (the sign lands on bit 15; bit 14 is cleared), so that F16C widens
// normals and subnormals alike; magnitude 0x7F (NaN in e4m3fn) is made a float16 NaN.
inline __m256 load8(const c10::Float8_e4m3fn* p) {
  const __m128i s = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  __m128i h = _mm_and_si128(_mm_slli_epi16(s, 7), _mm_set1_epi16(static_cast<int16_t>(0xBF80)));
  const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(h, _mm_set1_epi16(0x3F80)), _mm_set1_epi16(0x3F80));
  h = _mm_or_si128(h, _mm_and_si128(nan, _mm_set1_epi16(0x7E00)));
  return _mm256_cvtph_ps(h);
}

// r[i] = sum of the 8 lanes of v[i]
inline __m256 reduce8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// exp(x) for x <= 0, as exp_nonpositive (AVX-512) computes it: x = n ln2 + r, exp(r)
// by its Taylor polynomial to r^6, times 2^n built in the exponent bits (n >= -126).
inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

// s[0 .. len) <- softmax(s)
inline void softmax_avx2(float* s, int64_t len) {
  const int64_t full = len / 8 * 8;
  __m256 mx = _mm256_set1_ps(-INFINITY);
  for (int64_t t = 0; t < full; t += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + t));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  float m = *std::max_element(lanes, lanes + 8);
  for (int64_t t = full; t < len; ++t) m = std::max(m, s[t]);
  const __m256 vm = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t t = 0; t < full; t += 8) {
    const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(s + t), vm));
    sum = _mm256_add_ps(sum, e);
    _mm256_storeu_ps(s + t, e);
  }
  _mm256_store_ps(lanes, sum);
  float total = 0.f;
  for (float l : lanes) total += l;
  if (full < len) {  // the last tokens through the same exp
    for (int64_t t = full; t < len; ++t) lanes[t - full] = s[t] - m;
    for (int64_t t = len - full; t < 8; ++t) lanes[t] = -INFINITY;
    _mm256_store_ps(lanes, exp_nonpositive8(_mm256_load_ps(lanes)));
    for (int64_t t = full; t < len; ++t) total += (s[t] = lanes[t - full]);
  }
  const __m256 inv = _mm256_set1_ps(1.f / total);
  for (int64_t t = 0; t < full; t += 8) _mm256_storeu_ps(s + t, _mm256_mul_ps(_mm256_loadu_ps(s + t), inv));
  for (int64_t t = full; t < len; ++t) s[t] *= 1.f / total;
}

// Query heads per call, whose partial sums live on the stack (32 x 8 vectors, 8 KiB).
constexpr int64_t kMaxHeads8 = 32;
// Tokens per chunk of the value pass: their slots stay in L1 while every head of the call
// accumulates over them.
constexpr int64_t kValueChunk = 16;

// KV heads [h0, h0 + nkv) of one request: their nkv * group query heads q [nkv * group, D]
// (pre-scaled) against the keys and values of the `len` cache slots `slots` (the
// request's tokens from its window's start, looked up in the block table once: no
// division per token); scores [nkv * group, len], acc [nkv * group, D]. One KV head per
// call spreads a single request over the threads; all of them (nkv = num_kv_heads) read
// each slot's contiguous [KVH, D] rows together, so every cache line is fetched once and
// the cache streams block by block: AVX2 EPYC, SmolLM2's heads, float32, 2 threads, 64
// requests of 300 tokens 3.5-3.6 -> 2.9-3.1 ms, of 1,000 tokens 10.3-10.8 -> 8.3-9.4 ms,
// 8 of 2,000 3.1 -> 2.5 ms. A query head's arithmetic, and so its result, is the same for
// any nkv: pass 1 scores 8 tokens at a time and reduces their 8 partial vectors together;
// pass 2 runs chunk by chunk over the tokens in order, the accumulators in acc between chunks.
template <typename T, int NC>
void attend_kv_heads_avx2(int64_t h0, int64_t nkv, int64_t num_kv_heads, int64_t group, const float* q,
                          const T* k_cache, const T* v_cache, const int64_t* slots, int64_t len, float* scores,
                          float* acc) {
  constexpr int64_t D = NC * 8;
  const int64_t heads = nkv * group;
  const int64_t slot_size = num_kv_heads * D;
  k_cache += h0 * D;
  v_cache += h0 * D;
  __m256 partial[kMaxHeads8][8];
  // pass 1: scores, 8 tokens at a time
  for (int64_t t0 = 0; t0 < len; t0 += 8) {
    const int64_t nt = std::min<int64_t>(8, len - t0);
    for (int64_t i = 0; i < 8; ++i) {
      if (i >= nt) {
        for (int64_t j = 0; j < heads; ++j) partial[j][i] = _mm256_setzero_ps();
        continue;
      }
      const int64_t t = t0 + i;
      if (t + kPrefetchDistance < len) prefetch_slot(k_cache + slots[t + kPrefetchDistance] * slot_size, nkv * D);
      const T* kr = k_cache + slots[t] * slot_size;
      for (int64_t h = 0; h < nkv; ++h) {
        __m256 k[NC];
        for (int c = 0; c < NC; ++c) k[c] = load8(kr + h * D + c * 8);
        for (int64_t g = 0; g < group; ++g) {
          const float* qj = q + (h * group + g) * D;
          __m256 s = _mm256_mul_ps(_mm256_loadu_ps(qj), k[0]);
          for (int c = 1; c < NC; ++c) s = _mm256_fmadd_ps(_mm256_loadu_ps(qj + c * 8), k[c], s);
          partial[h * group + g][i] = s;
        }
      }
    }
    for (int64_t j = 0; j < heads; ++j) {
      alignas(32) float r[8];
      _mm256_store_ps(r, reduce8(partial[j]));
      std::copy(r, r + nt, scores + j * len + t0);
    }
  }
  for (int64_t j = 0; j < heads; ++j) softmax_avx2(scores + j * len, len);
  // pass 2: the probability-weighted sum of values, chunk by chunk
  std::fill(acc, acc + heads * D, 0.f);
  for (int64_t c0 = 0; c0 < len; c0 += kValueChunk) {
    const int64_t c1 = std::min(len, c0 + kValueChunk);
    for (int64_t h = 0; h < nkv; ++h) {
      for (int64_t g = 0; g < group; ++g) {
        const int64_t j = h * group + g;
        __m256 a[NC];
        for (int c = 0; c < NC; ++c) a[c] = _mm256_loadu_ps(acc + j * D + c * 8);
        const float* sj = scores + j * len;
        for (int64_t t = c0; t < c1; ++t) {
          if (j == 0 && t + kValueChunk < len) prefetch_slot(v_cache + slots[t + kValueChunk] * slot_size, nkv * D);
          const T* vr = v_cache + slots[t] * slot_size + h * D;
          const __m256 p = _mm256_set1_ps(sj[t] * kLoadScale<T>);
          for (int c = 0; c < NC; ++c) a[c] = _mm256_fmadd_ps(p, load8(vr + c * 8), a[c]);
        }
        for (int c = 0; c < NC; ++c) _mm256_storeu_ps(acc + j * D + c * 8, a[c]);
      }
    }
  }
}
#define VFRAME_PAGED_AVX2_ROWS 1  // load8, reduce8, softmax_avx2: prefill_rows' vector path
#if !defined(__AVX512F__)
#define VFRAME_PAGED_AVX2 1  // the decode's AVX2 path (AVX-512 CPUs take attend_request_avx512)
#endif
#endif

// A decode task's keys, for the thread to ask for ahead of the task: the offset of its first
// KV head within a slot, its cache slots in position order, and how many.
struct Upcoming {
  int64_t offset = 0;
  const int64_t* slots = nullptr;
  int64_t len = 0;
};

// Tasks [0, n) over torch's threads, longest first (cost(task)), each thread taking the
// next task when it finishes one: decode requests of different lengths balance, where
// at::parallel_for's static split hands one thread whichever half is longer (AVX2 EPYC, 2
// threads, requests of 32 to 640 tokens, a layer: 64 of them 3.6-3.8 -> 3.4-3.6 ms, 4 0.46 -> 0.39 ms). make_worker() builds one
// thread's body (with its own scratch buffers), called with each task it takes. A body that
// takes two arguments is also told the task its thread runs next (-1: none), claimed before
// it starts this one, so that it can ask for that task's data while it computes.
template <typename Cost, typename MakeWorker>
void run_longest_first(int64_t n, Cost&& cost, MakeWorker&& make_worker) {
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost(a) > cost(b); });
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    auto work = make_worker();
    const auto claim = [&] { return next.fetch_add(1, std::memory_order_relaxed); };
    if constexpr (std::is_invocable_v<decltype(work)&, int64_t, int64_t>) {
      for (int64_t k = claim(), upcoming; k < n; k = upcoming) {
        upcoming = claim();
        work(order[k], upcoming < n ? order[upcoming] : int64_t{-1});
      }
    } else {
      for (int64_t k; (k = claim()) < n;) work(order[k]);
    }
  });
}

// What both operators read off their tensors: sizes, strides and typed pointers
// (out and query [T, H, D]; the caches [num_blocks, block_size, KVH, D]).
template <typename T, typename C>
struct PagedTensors {
  int64_t num_heads, block_size, num_kv_heads, group;
  int64_t q_row_stride, q_head_stride, o_row_stride, o_head_stride, table_stride;
  const T* q_ptr;
  T* o_ptr;
  const C* k_ptr;
  const C* v_ptr;
  const int32_t* table;
  const int32_t* lens;
};

template <typename T, typename C>
PagedTensors<T, C> paged_tensors(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                                 const at::Tensor& value_cache, const at::Tensor& block_table,
                                 const at::Tensor& seq_lens) {
  return {query.size(1), key_cache.size(1), key_cache.size(2), query.size(1) / key_cache.size(2),
          query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
          query.const_data_ptr<T>(), out.mutable_data_ptr<T>(), reinterpret_cast<const C*>(key_cache.const_data_ptr()),
          reinterpret_cast<const C*>(value_cache.const_data_ptr()), block_table.const_data_ptr<int32_t>(),
          seq_lens.const_data_ptr<int32_t>()};
}

// T: the query's and output's dtype; C: the cache's (T, or a float8 type).
template <typename T, typename C, int HD>
void decode_attention(
    at::Tensor& out,             // [T, H, D]
    const at::Tensor& query,     // [T, H, D]
    const at::Tensor& key_cache,    // [num_blocks, block_size, KVH, D]
    const at::Tensor& value_cache,  // [num_blocks, block_size, KVH, D]
    const at::Tensor& block_table,  // [B, max_blocks] int32
    const at::Tensor& seq_lens,     // [B] int32
    const at::Tensor& req_ids,      // [n] int64: the decode requests
    const at::Tensor& query_rows,   // [n] int64: their rows in query / out
    double scale, int64_t sliding_window) {
  const int64_t n = req_ids.size(0);
  const int64_t D = HD > 0 ? HD : query.size(2);
  const auto [num_heads, block_size, num_kv_heads, group, q_row_stride, q_head_stride, o_row_stride, o_head_stride,
              table_stride, q_ptr, o_ptr, k_ptr, v_ptr, table, lens] =
      paged_tensors<T, C>(out, query, key_cache, value_cache, block_table, seq_lens);
  const int64_t* reqs = req_ids.const_data_ptr<int64_t>();
  const int64_t* rows = query_rows.const_data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);
  // Query heads [first, first + count) of query row r into q [count, D], float32, scaled.
  const auto load_queries = [&](int64_t r, int64_t first, int64_t count, float* q) {
    for (int64_t j = 0; j < count; ++j) {
      load_row(q_ptr + r * q_row_stride + (first + j) * q_head_stride, q + j * D, D);
      for (int64_t d = 0; d < D; ++d) q[j * D + d] *= fscale;
    }
  };
  // acc [count, D] into out's row r, heads [first, first + count).
  const auto store_outputs = [&](int64_t r, int64_t first, int64_t count, const float* acc) {
    for (int64_t j = 0; j < count; ++j) {
      T* oh = o_ptr + r * o_row_stride + (first + j) * o_head_stride;
      for (int64_t d = 0; d < D; ++d) oh[d] = static_cast<T>(acc[j * D + d]);
    }
  };

  // The vector paths' tasks: one per (request, kv_per_task KV heads from h0), longest request
  // first; each loads its query heads (scaled for the cache's loads) and looks the request's
  // slots up in the block table once (fill_slots); attend(r, h0, start, seq_len, q, scores,
  // slots, acc, upcoming) fills acc [heads, D], which goes to out's row r. upcoming: with
  // ask_ahead, the task the thread runs next (its KV heads' offset and slots), claimed before
  // this one starts; else none (len 0), and each thread claims a task when it is free.
  [[maybe_unused]] const auto run_tasks = [&](int64_t kv_per_task, auto ask_ahead, const auto& attend) {
    const int64_t tasks_per_request = num_kv_heads / kv_per_task;
    auto seq_len_of = [&](int64_t task) { return static_cast<int64_t>(lens[reqs[task / tasks_per_request]]); };
    const auto task_slots = [&](int64_t task, std::vector<int64_t>& slots) {
      const int64_t seq_len = lens[reqs[task / tasks_per_request]];
      const int64_t start = window_start(seq_len, sliding_window);
      fill_slots(slots, table + reqs[task / tasks_per_request] * table_stride, block_size, start, seq_len);
      return Upcoming{task % tasks_per_request * kv_per_task * D, slots.data(), seq_len - start};
    };
    run_longest_first(n * tasks_per_request, seq_len_of, [&] {
      const int64_t heads = kv_per_task * group;  // query heads per task
      std::vector<float> q(heads * D), acc(heads * D), scores;
      std::vector<int64_t> slots, upcoming_slots;
      auto body = [&, heads, q = std::move(q), acc = std::move(acc), scores = std::move(scores),
                   slots = std::move(slots),
                   upcoming_slots = std::move(upcoming_slots)](int64_t task, int64_t upcoming) mutable {
        const int64_t i = task / tasks_per_request, h0 = task % tasks_per_request * kv_per_task;
        const int64_t r = rows[i];
        const Upcoming up = upcoming >= 0 ? task_slots(upcoming, upcoming_slots) : Upcoming{};
        const Upcoming now = task_slots(task, slots);
        const int64_t seq_len = lens[reqs[i]], start = seq_len - now.len;
        load_queries(r, h0 * group, heads, q.data());
        scale_for_loads<C>(q.data(), heads * D);
        scores.resize(heads * now.len);
        attend(r, h0, start, seq_len, q.data(), scores.data(), now.slots, acc.data(), up);
        store_outputs(r, h0 * group, heads, acc.data());
      };
      if constexpr (decltype(ask_ahead)::value) {
        return body;  // run_longest_first tells it the thread's next task
      } else {
        return [body = std::move(body)](int64_t task) mutable { body(task, -1); };
      }
    });
  };

#if defined(VFRAME_PAGED_AVX2)
  if constexpr (HD > 0 && HD % 8 == 0) {
    if (group <= kMaxHeads8) {
      // Few requests: one task per (request, KV head), so that one request's heads
      // spread over the threads. Many: one task per request, each slot read once.
      const bool per_request = num_heads <= kMaxHeads8 && n >= 4 * at::get_num_threads();
      const int64_t kv_per_task = per_request ? num_kv_heads : 1;
      run_tasks(kv_per_task, std::false_type{}, [&](int64_t, int64_t h0, int64_t start, int64_t seq_len, const float* q,
                                                    float* scores, const int64_t* slots, float* acc, const Upcoming&) {
        attend_kv_heads_avx2<C, HD / 8>(h0, kv_per_task, num_kv_heads, group, q, k_ptr, v_ptr, slots,
                                        seq_len - start, scores, acc);
      });
      return;
    }
  }
#endif
#if defined(__AVX512F__)
  if constexpr (HD > 0 && HD % 16 == 0) {
    if (group <= kMaxGroup) {
      // One task per request where the requests spread evenly over the threads (many, or a
      // multiple of the threads), else per (request, KV head), so that a lone request's heads
      // spread over the threads.
      const int64_t threads = at::get_num_threads();
      const int64_t kv_per_task = n >= 4 * threads || n % threads == 0 ? num_kv_heads : 1;
      // ask ahead: the values pass asks for the next task's keys
      run_tasks(kv_per_task, std::true_type{}, [&](int64_t r, int64_t h0, int64_t start, int64_t seq_len, const float* q,
                                                   float* scores, const int64_t* slots, float* acc, const Upcoming& up) {
        const c10::BFloat16* qb = nullptr;  // bfloat16 queries as they are, where bf16_scores takes them
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, c10::BFloat16> && HD % 32 == 0) {
          if (q_head_stride == D) qb = q_ptr + r * q_row_stride + h0 * group * D;
        }
#endif
        attend_request_avx512<C, HD / 16>(num_kv_heads * D, kv_per_task, group, q, k_ptr + h0 * D, v_ptr + h0 * D,
                                           slots, start, seq_len, scores, acc, qb, fscale, k_ptr + up.offset, up.slots,
                                           up.len);
      });
      return;
    }
  }
#endif
  run_longest_first(n, [&](int64_t i) { return static_cast<int64_t>(lens[reqs[i]]); }, [&] {
    std::vector<float> q(num_heads * D), acc(num_heads * D), row(num_kv_heads * D), scores;
    return [&, q = std::move(q), acc = std::move(acc), row = std::move(row), scores = std::move(scores)](
               int64_t i) mutable {
      const int64_t b = reqs[i], r = rows[i];
      const int64_t seq_len = lens[b];
      const int64_t start = window_start(seq_len, sliding_window);
      load_queries(r, 0, num_heads, q.data());
      scores.resize(num_heads * (seq_len - start));
      attend_request<C, HD>(D, num_kv_heads, group, q.data(), k_ptr, v_ptr, table + b * table_stride, block_size,
                            start, seq_len, scores.data(), acc.data(), row.data());
      store_outputs(r, 0, num_heads, acc.data());
    };
  });
}

// --------------------------------------------------------------------------------------- //
// Prefill: a request's Q query tokens, positions L - Q .. L - 1 of its L tokens (their keys
// and values already stored), against its keys causally (and within its sliding window),
// every key and value read in place through the block table: a chunk over a cached prefix
// gathers nothing. One task per (request, KV head, tile of kPrefillTile query tokens): the
// tile's group x tile query rows share each K/V row the task reads, keys kPrefillKeyBlock
// at a time so that a block's rows stay in L1 while every row of the tile passes over them
// (AVX2 EPYC, a 256-token prompt: 64 keys 1.01-1.04 ms, 128 1.15-1.16 ms).
//
//   pass 1: s[r][t] = scale * q[r] . k[t]     t in [lo[r], hi[r]): the row's window, up to its own position
//   softmax over each row's t, in float32
//   pass 2: out[r]  = sum_t p[r][t] * v[t]    t in order
constexpr int64_t kPrefillTile = 16;       // query tokens a task
#ifndef VFRAME_PREFILL_KEY_BLOCK
#define VFRAME_PREFILL_KEY_BLOCK 64
#endif
constexpr int64_t kPrefillKeyBlock = VFRAME_PREFILL_KEY_BLOCK;  // keys a pass over the tile's rows (-D to try others)

// One tile's rows through both passes: q [rows, D] (pre-scaled), row r attends the keys
// slots[lo[r]] .. slots[hi[r] - 1] of KV head h; scores [rows, nkeys], acc [rows, D].
template <typename C, int HD>
void prefill_rows(int64_t rows, int64_t head_size_rt, const float* q, const int64_t* lo, const int64_t* hi,
                  const C* k_cache, const C* v_cache, int64_t slot_size, int64_t h, const int64_t* slots,
                  int64_t nkeys, float* scores, float* acc) {
  const int64_t D = HD > 0 ? HD : head_size_rt;
  k_cache += h * D;
  v_cache += h * D;
#if defined(VFRAME_PAGED_AVX2_ROWS)
  if constexpr (HD > 0 && HD % 8 == 0) {
    constexpr int NC = HD / 8;
    for (int64_t kb = 0; kb < nkeys; kb += kPrefillKeyBlock) {  // pass 1
      const int64_t kb_end = std::min(nkeys, kb + kPrefillKeyBlock);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t t_begin = std::max(kb, lo[r]), t_end = std::min(kb_end, hi[r]);
        __m256 qv[NC];
        for (int c = 0; c < NC; ++c) qv[c] = _mm256_loadu_ps(q + r * D + c * 8);
        for (int64_t t0 = t_begin; t0 < t_end; t0 += 8) {
          const int64_t nt = std::min<int64_t>(8, t_end - t0);
          __m256 partial[8];
          for (int64_t i = 0; i < 8; ++i) {
            if (i >= nt) {
              partial[i] = _mm256_setzero_ps();
              continue;
            }
            const C* kr = k_cache + slots[t0 + i] * slot_size;
            __m256 s = _mm256_mul_ps(qv[0], load8(kr));
            for (int c = 1; c < NC; ++c) s = _mm256_fmadd_ps(qv[c], load8(kr + c * 8), s);
            partial[i] = s;
          }
          alignas(32) float r8[8];
          _mm256_store_ps(r8, reduce8(partial));
          std::copy(r8, r8 + nt, scores + r * nkeys + t0);
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) softmax_avx2(scores + r * nkeys + lo[r], hi[r] - lo[r]);
    std::fill(acc, acc + rows * D, 0.f);
    for (int64_t kb = 0; kb < nkeys; kb += kPrefillKeyBlock) {  // pass 2
      const int64_t kb_end = std::min(nkeys, kb + kPrefillKeyBlock);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t t_begin = std::max(kb, lo[r]), t_end = std::min(kb_end, hi[r]);
        if (t_begin >= t_end) continue;
        __m256 a[NC];
        for (int c = 0; c < NC; ++c) a[c] = _mm256_loadu_ps(acc + r * D + c * 8);
        const float* sr = scores + r * nkeys;
        for (int64_t t = t_begin; t < t_end; ++t) {
          const C* vr = v_cache + slots[t] * slot_size;
          const __m256 p = _mm256_set1_ps(sr[t] * kLoadScale<C>);
          for (int c = 0; c < NC; ++c) a[c] = _mm256_fmadd_ps(p, load8(vr + c * 8), a[c]);
        }
        for (int c = 0; c < NC; ++c) _mm256_storeu_ps(acc + r * D + c * 8, a[c]);
      }
    }
    return;
  }
#endif
  // The portable path: the same passes, a scalar dot product and exp per score.
  for (int64_t r = 0; r < rows; ++r) {
    const float* qr = q + r * D;
    float* sr = scores + r * nkeys;
    float mx = -INFINITY;
    for (int64_t t = lo[r]; t < hi[r]; ++t) {
      const C* kr = k_cache + slots[t] * slot_size;
      float s = 0.f;
      for (int64_t d = 0; d < D; ++d) s += qr[d] * to_float(kr[d]);
      sr[t] = s;
      mx = std::max(mx, s);
    }
    float sum = 0.f;
    for (int64_t t = lo[r]; t < hi[r]; ++t) sum += (sr[t] = std::exp(sr[t] - mx));
    float* ar = acc + r * D;
    std::fill(ar, ar + D, 0.f);
    for (int64_t t = lo[r]; t < hi[r]; ++t) {
      const C* vr = v_cache + slots[t] * slot_size;
      const float p = sr[t] / sum;
      for (int64_t d = 0; d < D; ++d) ar[d] += p * to_float(vr[d]);
    }
  }
}

#if defined(__AVX512F__)
// The AVX-512 prefill tile (head sizes a multiple of 16, NC = D / 16 vectors): small
// matrix products instead of prefill_rows' dot products, which convert every K/V row for
// each query row and reduce each score across lanes. A block of kTileKeys keys is
// converted to float32 once (kf [keys, D]), the tile's queries transposed once (qt
// [D, rows_pad]), and scores come out transposed, st [keys, rows_pad]: four keys times up
// to 48 rows are 12 vector accumulators, each query vector loaded once for the four keys
// and each key value broadcast. The softmax runs down st's columns (16 rows a vector, the
// causal / window mask from each row's lo, hi); the values pass keeps kValueRows rows'
// accumulators in registers and broadcasts their probabilities. Zen 4, bfloat16, 2 threads,
// the offline workload's 4,096-token prefill steps: attention 29.7 -> 13.6 ms a layer (9.7-10.1
// with tile_scores_bf16, 7.9 with tile_values_bf16 too).
constexpr int64_t kTileKeys = 64;

// st[t][0 .. 16 RV) += ... for t < nk: qt [D][rows_pad] (this chunk's first column), kf [nk][D]
template <int RV, int NC>
inline void tile_scores(const float* qt, int64_t rows_pad, const float* kf, int64_t nk, float* st) {
  constexpr int D = NC * 16;
  int64_t t = 0;
  for (; t + 4 <= nk; t += 4) {
    __m512 a[4][RV];
    for (int k = 0; k < 4; ++k)
      for (int j = 0; j < RV; ++j) a[k][j] = _mm512_setzero_ps();
    for (int d = 0; d < D; ++d) {
      __m512 q[RV];
      for (int j = 0; j < RV; ++j) q[j] = _mm512_loadu_ps(qt + d * rows_pad + 16 * j);
      for (int k = 0; k < 4; ++k) {
        const __m512 b = _mm512_set1_ps(kf[(t + k) * D + d]);
        for (int j = 0; j < RV; ++j) a[k][j] = _mm512_fmadd_ps(q[j], b, a[k][j]);
      }
    }
    for (int k = 0; k < 4; ++k)
      for (int j = 0; j < RV; ++j) _mm512_storeu_ps(st + (t + k) * rows_pad + 16 * j, a[k][j]);
  }
  for (; t < nk; ++t) {
    __m512 a[RV];
    for (int j = 0; j < RV; ++j) a[j] = _mm512_setzero_ps();
    for (int d = 0; d < D; ++d) {
      const __m512 b = _mm512_set1_ps(kf[t * D + d]);
      for (int j = 0; j < RV; ++j) a[j] = _mm512_fmadd_ps(_mm512_loadu_ps(qt + d * rows_pad + 16 * j), b, a[j]);
    }
    for (int j = 0; j < RV; ++j) _mm512_storeu_ps(st + t * rows_pad + 16 * j, a[j]);
  }
}

#if defined(__AVX512BF16__)
// tile_scores for a bfloat16 cache and bfloat16 queries (AVX512-BF16): qp [D / 2][rows_pad]
// holds each row's queries as they are, a pair of dimensions in each 32-bit word; a key's
// pair is broadcast from its cache row (kr[t], nothing widened) and vdpbf16ps multiplies
// both pairs exactly and adds them in float32: half tile_scores' instructions. The sums are
// scaled on the way out.
template <int RV, int NC>
inline void tile_scores_bf16(const uint32_t* qp, int64_t rows_pad, const c10::BFloat16* const* kr, int64_t nk,
                             float scale, float* st) {
  constexpr int P = NC * 8;  // pairs of a row
  const __m512 sv = _mm512_set1_ps(scale);
  const auto pair = [](const c10::BFloat16* row, int d) {
    uint32_t w;
    std::memcpy(&w, row + 2 * d, sizeof(w));
    return (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(w));
  };
  int64_t t = 0;
  for (; t + 4 <= nk; t += 4) {
    __m512 a[4][RV];
    for (int k = 0; k < 4; ++k)
      for (int j = 0; j < RV; ++j) a[k][j] = _mm512_setzero_ps();
    for (int d = 0; d < P; ++d) {
      __m512bh q[RV];
      for (int j = 0; j < RV; ++j) q[j] = (__m512bh)_mm512_loadu_si512(qp + d * rows_pad + 16 * j);
      for (int k = 0; k < 4; ++k) {
        const __m512bh b = pair(kr[t + k], d);
        for (int j = 0; j < RV; ++j) a[k][j] = _mm512_dpbf16_ps(a[k][j], q[j], b);
      }
    }
    for (int k = 0; k < 4; ++k)
      for (int j = 0; j < RV; ++j) _mm512_storeu_ps(st + (t + k) * rows_pad + 16 * j, _mm512_mul_ps(a[k][j], sv));
  }
  for (; t < nk; ++t) {
    __m512 a[RV];
    for (int j = 0; j < RV; ++j) a[j] = _mm512_setzero_ps();
    for (int d = 0; d < P; ++d) {
      const __m512bh b = pair(kr[t], d);
      for (int j = 0; j < RV; ++j)
        a[j] = _mm512_dpbf16_ps(a[j], (__m512bh)_mm512_loadu_si512(qp + d * rows_pad + 16 * j), b);
    }
    for (int j = 0; j < RV; ++j) _mm512_storeu_ps(st + t * rows_pad + 16 * j, _mm512_mul_ps(a[j], sv));
  }
}
#endif

// acc [R][D] += sum_t pt[t][r] vf[t]: pt [nk][rows_pad] (this chunk's first column), vf [nk][D]
template <int R, int NC>
inline void tile_values(const float* pt, int64_t rows_pad, const float* vf, int64_t nk, float* acc) {
  constexpr int D = NC * 16;
  __m512 a[R][NC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) a[r][c] = _mm512_loadu_ps(acc + r * D + c * 16);
  for (int64_t t = 0; t < nk; ++t) {
    __m512 v[NC];
    for (int c = 0; c < NC; ++c) v[c] = _mm512_loadu_ps(vf + t * D + c * 16);
    for (int r = 0; r < R; ++r) {
      const __m512 p = _mm512_set1_ps(pt[t * rows_pad + r]);
      for (int c = 0; c < NC; ++c) a[r][c] = _mm512_fmadd_ps(p, v[c], a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + r * D + c * 16, a[r][c]);
}

template <int NC>
constexpr int kValueRows = NC <= 4 ? 6 : NC <= 6 ? 4 : NC <= 8 ? 2 : 1;  // accumulators fit the 32 registers

#if defined(__AVX512BF16__)
// The values pass for a bfloat16 cache and bfloat16 queries: the probabilities rounded to
// bfloat16 (PyTorch's bfloat16 SDPA on the CPU rounds its exponentials before its values
// product too) and paired over consecutive keys, so that vdpbf16ps adds two keys' products
// a lane: half tile_values' instructions. Zen 4, 2 threads, the offline workload's
// 4,096-token prefill steps: a layer's attention 10.1 -> 7.9 ms.
//
// pp[t / 2][r] = (p[t][r], p[t + 1][r]) as bfloat16 (0 past nkeys), written over st in place:
// row t / 2 <= t, and rows t and t + 1 are read before it is written.
inline void pair_probabilities(float* st, int64_t rows_pad, int64_t nkeys) {
  auto* pp = reinterpret_cast<uint32_t*>(st);
  const auto half = [&](int64_t t, int64_t j) {
    return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(st + t * rows_pad + j)));
  };
  for (int64_t t = 0; t < nkeys; t += 2)
    for (int64_t j = 0; j < rows_pad; j += 16) {
      const __m512i odd = t + 1 < nkeys ? half(t + 1, j) : _mm512_setzero_si512();
      _mm512_storeu_si512(pp + t / 2 * rows_pad + j, _mm512_or_si512(half(t, j), _mm512_slli_epi32(odd, 16)));
    }
}

// vp[t / 2][d] = (v[t][d], v[t + 1][d]) for the nk value rows vr[t] (a zero row past nk)
template <int NC>
inline void pair_values(const c10::BFloat16* const* vr, int64_t nk, uint32_t* vp) {
  constexpr int D = NC * 16;
  const auto row = [](const c10::BFloat16* v) {
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v)));
  };
  for (int64_t t = 0; t < nk; t += 2)
    for (int c = 0; c < NC; ++c) {
      const __m512i odd = t + 1 < nk ? row(vr[t + 1] + c * 16) : _mm512_setzero_si512();
      _mm512_storeu_si512(vp + t / 2 * D + c * 16, _mm512_or_si512(row(vr[t] + c * 16), _mm512_slli_epi32(odd, 16)));
    }
}

// acc [R][D] += sum over key pairs tp of pp[tp][r] . vp[tp] (tile_values on pairs)
template <int R, int NC>
inline void tile_values_bf16(const uint32_t* pp, int64_t rows_pad, const uint32_t* vp, int64_t npairs, float* acc) {
  constexpr int D = NC * 16;
  __m512 a[R][NC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) a[r][c] = _mm512_loadu_ps(acc + r * D + c * 16);
  for (int64_t tp = 0; tp < npairs; ++tp) {
    __m512bh v[NC];
    for (int c = 0; c < NC; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vp + tp * D + c * 16);
    for (int r = 0; r < R; ++r) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pp[tp * rows_pad + r]));
      for (int c = 0; c < NC; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], v[c], p);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + r * D + c * 16, a[r][c]);
}
#endif

// Keys [kb, kb + nk) of KV head h (slots[t], cache rows of slot_size) as float32 rows, out [nk][D]
template <typename C, int NC>
inline void tile_rows(const C* cache, int64_t slot_size, const int64_t* slots, int64_t nk, float* out) {
  for (int64_t t = 0; t < nk; ++t)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(out + (t * NC + c) * 16, load16(cache + slots[t] * slot_size + c * 16));
}

// Whether prefill_tile_avx512 scores bfloat16 queries (qb) against a bfloat16 cache with
// vdpbf16ps: it then reads the queries as they are, and q, their float32 copy, is not read.
template <typename C, int NC>
constexpr bool kPairedScores =
#if defined(__AVX512BF16__)
    std::is_same_v<C, c10::BFloat16> && NC % 2 == 0;
#else
    false;
#endif

// prefill_rows' contract on AVX-512: q [rows, D] pre-scaled, row r attends keys [lo[r], hi[r])
// (q unread where kPairedScores and qb is given).
template <typename C, int NC>
void prefill_tile_avx512(int64_t rows, const float* q, const int64_t* lo, const int64_t* hi, const C* k_cache,
                         const C* v_cache, int64_t slot_size, int64_t h, const int64_t* slots, int64_t nkeys,
                         std::vector<float>& scratch, float* acc,
                         const c10::BFloat16* const* qb = nullptr,  // the rows' bfloat16 queries: tile_scores_bf16
                         float scale = 1.f) {
  constexpr int D = NC * 16;
  const int64_t rows_pad = (rows + 15) / 16 * 16;
  scratch.resize(D * rows_pad + nkeys * rows_pad + kTileKeys * D + 2 * rows_pad);
  float* qt = scratch.data();
  float* st = qt + D * rows_pad;
  float* kv = st + nkeys * rows_pad;
  auto* bounds = reinterpret_cast<int32_t*>(kv + kTileKeys * D);  // lo, then hi, per padded row
  const bool paired_scores = kPairedScores<C, NC> && qb != nullptr;
  for (int64_t r = 0; r < rows_pad; ++r) {
    if (!paired_scores)
      for (int d = 0; d < D; ++d) qt[d * rows_pad + r] = r < rows ? q[r * D + d] : 0.f;
    bounds[r] = r < rows ? static_cast<int32_t>(lo[r]) : 0;  // a padding row attends key 0: never empty
    bounds[rows_pad + r] = r < rows ? static_cast<int32_t>(hi[r]) : 1;
  }
  k_cache += h * D;
  v_cache += h * D;
  bool scored = false;
#if defined(__AVX512BF16__)
  if constexpr (kPairedScores<C, NC>) {
    if (paired_scores) {
      auto* qp = reinterpret_cast<uint32_t*>(qt);  // D / 2 pairs a row: fits in qt
      for (int64_t r = 0; r < rows_pad; ++r)
        for (int d = 0; d < D / 2; ++d) {
          uint32_t w = 0;
          if (r < rows) std::memcpy(&w, qb[r] + 2 * d, sizeof(w));
          qp[d * rows_pad + r] = w;
        }
      const c10::BFloat16* kr[kTileKeys];
      for (int64_t kb = 0; kb < nkeys; kb += kTileKeys) {
        const int64_t nk = std::min(kTileKeys, nkeys - kb);
        for (int64_t t = 0; t < nk; ++t) kr[t] = k_cache + slots[kb + t] * slot_size;
        int64_t j = 0;
        for (; j + 48 <= rows_pad; j += 48) tile_scores_bf16<3, NC>(qp + j, rows_pad, kr, nk, scale, st + kb * rows_pad + j);
        if (rows_pad - j == 32) tile_scores_bf16<2, NC>(qp + j, rows_pad, kr, nk, scale, st + kb * rows_pad + j);
        if (rows_pad - j == 16) tile_scores_bf16<1, NC>(qp + j, rows_pad, kr, nk, scale, st + kb * rows_pad + j);
      }
      scored = true;
    }
  }
#endif
  for (int64_t kb = 0; kb < nkeys && !scored; kb += kTileKeys) {  // pass 1: scores
    const int64_t nk = std::min(kTileKeys, nkeys - kb);
    tile_rows<C, NC>(k_cache, slot_size, slots + kb, nk, kv);
    int64_t j = 0;
    for (; j + 48 <= rows_pad; j += 48) tile_scores<3, NC>(qt + j, rows_pad, kv, nk, st + kb * rows_pad + j);
    if (rows_pad - j == 32) tile_scores<2, NC>(qt + j, rows_pad, kv, nk, st + kb * rows_pad + j);
    if (rows_pad - j == 16) tile_scores<1, NC>(qt + j, rows_pad, kv, nk, st + kb * rows_pad + j);
  }
  // softmax down each column, masked to the row's keys; probabilities times kLoadScale (pass 2's loads)
  for (int64_t j = 0; j < rows_pad; j += 16) {
    const __m512i lo_v = _mm512_loadu_si512(bounds + j), hi_v = _mm512_loadu_si512(bounds + rows_pad + j);
    const auto valid = [&](int64_t t) {
      const __m512i tv = _mm512_set1_epi32(static_cast<int32_t>(t));
      return static_cast<__mmask16>(_mm512_cmp_epi32_mask(tv, lo_v, _MM_CMPINT_NLT) &
                                    _mm512_cmp_epi32_mask(tv, hi_v, _MM_CMPINT_LT));
    };
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < nkeys; ++t) mx = _mm512_mask_max_ps(mx, valid(t), mx, _mm512_loadu_ps(st + t * rows_pad + j));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < nkeys; ++t) {
      float* sp = st + t * rows_pad + j;
      const __m512 e = _mm512_maskz_mov_ps(valid(t), exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(sp), mx)));
      sum = _mm512_add_ps(sum, e);
      _mm512_storeu_ps(sp, e);
    }
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(kLoadScale<C>), sum);
    for (int64_t t = 0; t < nkeys; ++t) {
      float* sp = st + t * rows_pad + j;
      _mm512_storeu_ps(sp, _mm512_mul_ps(_mm512_loadu_ps(sp), inv));
    }
  }
  std::fill(acc, acc + rows * D, 0.f);
  constexpr int R = kValueRows<NC>;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<C, c10::BFloat16>) {
    if (qb != nullptr) {  // pass 2 on bfloat16 pairs
      pair_probabilities(st, rows_pad, nkeys);
      const auto* pp = reinterpret_cast<const uint32_t*>(st);
      auto* vp = reinterpret_cast<uint32_t*>(kv);  // kTileKeys / 2 pairs of D words: fits in kv
      const c10::BFloat16* vr[kTileKeys];
      for (int64_t kb = 0; kb < nkeys; kb += kTileKeys) {
        const int64_t nk = std::min(kTileKeys, nkeys - kb), npairs = (nk + 1) / 2;
        for (int64_t t = 0; t < nk; ++t) vr[t] = v_cache + slots[kb + t] * slot_size;
        pair_values<NC>(vr, nk, vp);
        const uint32_t* pt = pp + kb / 2 * rows_pad;
        int64_t r = 0;
        for (; r + R <= rows; r += R) tile_values_bf16<R, NC>(pt + r, rows_pad, vp, npairs, acc + r * D);
        for (; r < rows; ++r) tile_values_bf16<1, NC>(pt + r, rows_pad, vp, npairs, acc + r * D);
      }
      return;
    }
  }
#endif
  for (int64_t kb = 0; kb < nkeys; kb += kTileKeys) {  // pass 2: values
    const int64_t nk = std::min(kTileKeys, nkeys - kb);
    tile_rows<C, NC>(v_cache, slot_size, slots + kb, nk, kv);
    const float* pt = st + kb * rows_pad;
    int64_t r = 0;
    for (; r + R <= rows; r += R) tile_values<R, NC>(pt + r, rows_pad, kv, nk, acc + r * D);
    for (; r < rows; ++r) tile_values<1, NC>(pt + r, rows_pad, kv, nk, acc + r * D);
  }
}
#endif

// T: the query's and output's dtype; C: the cache's (T, or a float8 type).
template <typename T, typename C, int HD>
void prefill_attention(
    at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
    const at::Tensor& block_table, const at::Tensor& seq_lens,
    const at::Tensor& req_ids,       // [p] int64: the prefilling requests (rows of block_table / seq_lens)
    const at::Tensor& query_starts,  // [p] int64: their first query row
    const at::Tensor& query_lens,    // [p] int64: their query tokens this step
    double scale, int64_t sliding_window) {
  const int64_t p = req_ids.size(0);
  const int64_t D = HD > 0 ? HD : query.size(2);
  const auto [num_heads, block_size, num_kv_heads, group, q_row_stride, q_head_stride, o_row_stride, o_head_stride,
              table_stride, q_ptr, o_ptr, k_ptr, v_ptr, table, lens] =
      paged_tensors<T, C>(out, query, key_cache, value_cache, block_table, seq_lens);
  const int64_t slot_size = num_kv_heads * D;
  const int64_t* reqs = req_ids.const_data_ptr<int64_t>();
  const int64_t* starts = query_starts.const_data_ptr<int64_t>();
  const int64_t* qlens = query_lens.const_data_ptr<int64_t>();
#if defined(VFRAME_PAGED_AVX2_ROWS)
  constexpr bool kVectorLoads = HD > 0 && HD % 8 == 0;  // prefill_rows' AVX2 path: loads scaled by 1 / kLoadScale
#else
  constexpr bool kVectorLoads = false;
#endif
  const float fscale = static_cast<float>(scale) * (kVectorLoads ? kLoadScale<C> : 1.f);
  // tasks: (request, tile, KV head), a request's tasks consecutive
  std::vector<int64_t> first_task(p + 1, 0);
  for (int64_t i = 0; i < p; ++i) {
    TORCH_CHECK(reqs[i] >= 0 && reqs[i] < seq_lens.size(0) && reqs[i] < block_table.size(0),
                "paged_prefill_attention: request ", reqs[i], " has no row in seq_lens and block_table");
    TORCH_CHECK(qlens[i] >= 1 && qlens[i] <= lens[reqs[i]], "paged_prefill_attention: request ", reqs[i], " has ",
                qlens[i], " query tokens of ", lens[reqs[i]]);
    TORCH_CHECK(starts[i] >= 0 && starts[i] + qlens[i] <= query.size(0), "paged_prefill_attention: request ", reqs[i],
                "'s query rows ", starts[i], " .. ", starts[i] + qlens[i], " are not rows of the ", query.size(0),
                "-row query");
    TORCH_CHECK((lens[reqs[i]] + block_size - 1) / block_size <= block_table.size(1), "paged_prefill_attention: request ",
                reqs[i], "'s ", lens[reqs[i]], " tokens need more blocks than block_table's ", block_table.size(1));
    first_task[i + 1] = first_task[i] + (qlens[i] + kPrefillTile - 1) / kPrefillTile * num_kv_heads;
  }
  const auto request_of = [&](int64_t task) {
    return std::upper_bound(first_task.begin(), first_task.end(), task) - first_task.begin() - 1;
  };
  // A task's last query position + 1, and its first key (the first row's window start).
  const auto task_keys = [&](int64_t task, int64_t* key_start, int64_t* i0, int64_t* i1) {
    const int64_t i = request_of(task), local = task - first_task[i];
    const int64_t tile = local / num_kv_heads;
    *i0 = tile * kPrefillTile;
    *i1 = std::min(qlens[i], *i0 + kPrefillTile);
    const int64_t first_pos = lens[reqs[i]] - qlens[i];
    *key_start = window_start(first_pos + *i0 + 1, sliding_window);
    return first_pos + *i1;
  };
  const auto cost = [&](int64_t task) {
    int64_t key_start, i0, i1;
    return (task_keys(task, &key_start, &i0, &i1) - key_start) * (i1 - i0);
  };
#if defined(__AVX512F__)
  // bfloat16 queries the tile scores by vdpbf16ps as they are: no float32 copy of them
  constexpr bool kQueriesAsTheyAre =
      HD > 0 && HD % 16 == 0 && std::is_same_v<T, c10::BFloat16> && kPairedScores<C, (HD > 0 ? HD / 16 : 1)>;
#else
  constexpr bool kQueriesAsTheyAre = false;
#endif
  run_longest_first(first_task[p], cost, [&] {
    std::vector<float> q(kPrefillTile * group * D), acc(kPrefillTile * group * D), scores;
    std::vector<int64_t> slots, lo(kPrefillTile * group), hi(kPrefillTile * group);
    std::vector<const T*> sources(kPrefillTile * group);  // each row's query as it is
    return [&, q = std::move(q), acc = std::move(acc), scores = std::move(scores), slots = std::move(slots),
            lo = std::move(lo), hi = std::move(hi), sources = std::move(sources)](int64_t task) mutable {
      const int64_t i = request_of(task), h = (task - first_task[i]) % num_kv_heads;
      int64_t key_start, i0, i1;
      const int64_t key_end = task_keys(task, &key_start, &i0, &i1);
      const int64_t b = reqs[i], first_pos = lens[b] - qlens[i], nkeys = key_end - key_start;
      fill_slots(slots, table + b * table_stride, block_size, key_start, key_end);
      const int64_t rows = (i1 - i0) * group;  // row (token j, head g): j * group + g
      for (int64_t j = 0; j < i1 - i0; ++j) {
        const int64_t pos = first_pos + i0 + j;
        for (int64_t g = 0; g < group; ++g) {
          const int64_t r = j * group + g;
          lo[r] = window_start(pos + 1, sliding_window) - key_start;
          hi[r] = pos + 1 - key_start;
          const T* src = sources[r] = q_ptr + (starts[i] + i0 + j) * q_row_stride + (h * group + g) * q_head_stride;
          if constexpr (!kQueriesAsTheyAre)
            for (int64_t d = 0; d < D; ++d) q[r * D + d] = to_float(src[d]) * fscale;
        }
      }
#if defined(__AVX512F__)
      if constexpr (HD > 0 && HD % 16 == 0) {
        const c10::BFloat16* const* qb = nullptr;  // bfloat16 queries and cache: scores by vdpbf16ps
        if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, c10::BFloat16>) qb = sources.data();
        prefill_tile_avx512<C, HD / 16>(rows, q.data(), lo.data(), hi.data(), k_ptr, v_ptr, slot_size, h, slots.data(),
                                        nkeys, scores, acc.data(), qb, fscale);
      } else
#endif
      {
        scores.resize(rows * nkeys);
        prefill_rows<C, HD>(rows, D, q.data(), lo.data(), hi.data(), k_ptr, v_ptr, slot_size, h, slots.data(), nkeys,
                            scores.data(), acc.data());
      }
      for (int64_t j = 0; j < i1 - i0; ++j)
        for (int64_t g = 0; g < group; ++g) {
          T* dst = o_ptr + (starts[i] + i0 + j) * o_row_stride + (h * group + g) * o_head_stride;
          const float* a = acc.data() + (j * group + g) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(a[d]);
        }
    };
  });
}

// kernel.template operator()<T, C, HD>(), HD the head size where it is unrolled, else 0
// (taken at run time).
template <typename T, typename C, typename Kernel>
void dispatch_head_size(int64_t head_size, const Kernel& kernel) {
  if constexpr (std::is_same_v<T, C>) {
    switch (head_size) {
      case 64: return kernel.template operator()<T, C, 64>();
      case 128: return kernel.template operator()<T, C, 128>();
      case 96: return kernel.template operator()<T, C, 96>();
      case 80: return kernel.template operator()<T, C, 80>();
      case 256: return kernel.template operator()<T, C, 256>();
      default: return kernel.template operator()<T, C, 0>();
    }
  } else {  // float8 caches: the common head sizes unrolled, the others at run time
    switch (head_size) {
      case 64: return kernel.template operator()<T, C, 64>();
      case 128: return kernel.template operator()<T, C, 128>();
      default: return kernel.template operator()<T, C, 0>();
    }
  }
}

// The query's dtype T, then the cache's: T itself or float8 (float32 and bfloat16 queries).
template <typename Kernel>
void dispatch_types(const char* name, const at::Tensor& query, at::ScalarType cache_type, const Kernel& kernel) {
  const int64_t head_size = query.size(2);
  const auto with_cache = [&]<typename T>() {
    switch (cache_type) {
      case at::kFloat8_e4m3fn: return dispatch_head_size<T, c10::Float8_e4m3fn>(head_size, kernel);
      case at::kFloat8_e5m2: return dispatch_head_size<T, c10::Float8_e5m2>(head_size, kernel);
      default: return dispatch_head_size<T, T>(head_size, kernel);
    }
  };
  switch (query.scalar_type()) {
    case at::kFloat: return with_cache.template operator()<float>();
    case at::kBFloat16: return with_cache.template operator()<c10::BFloat16>();
    case at::kHalf: return dispatch_head_size<c10::Half, c10::Half>(head_size, kernel);
    default: TORCH_CHECK(false, name, " supports float32, bfloat16 and float16, not ", query.scalar_type());
  }
}

// What both operators ask of their tensors.
void check_attention_inputs(const char* name, const at::Tensor& out, const at::Tensor& query,
                            const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& block_table,
                            const at::Tensor& seq_lens, std::initializer_list<const at::Tensor*> int64_vectors) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), name, ": query and out must be [T, H, D] alike");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, name, ": query and out need a contiguous last dim");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous(),
              name, ": key_cache and value_cache must be contiguous [num_blocks, block_size, KVH, D]");
  TORCH_CHECK(key_cache.size(3) == query.size(2), name, ": head sizes of query and cache differ");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, name, ": num_heads must be a multiple of num_kv_heads");
  const at::ScalarType cache_type = key_cache.scalar_type();
  const bool fp8_cache = cache_type == at::kFloat8_e4m3fn || cache_type == at::kFloat8_e5m2;
  TORCH_CHECK(out.scalar_type() == query.scalar_type() && value_cache.scalar_type() == cache_type &&
                  (cache_type == query.scalar_type() || (fp8_cache && query.scalar_type() != at::kHalf)),
              name, ": query and out must share a dtype, and the caches hold it or float8 (float8 with float32 or "
              "bfloat16 queries); got query ", query.scalar_type(), ", cache ", cache_type);
  TORCH_CHECK(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              name, ": block_table and seq_lens must be int32");
  TORCH_CHECK(block_table.stride(1) == 1 && seq_lens.is_contiguous(), name, ": block_table rows must be contiguous");
  const int64_t n = (*int64_vectors.begin())->numel();
  for (const at::Tensor* t : int64_vectors)
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == n,
                name, ": the request vectors must be contiguous int64 of one length");
}

void paged_decode_attention(
    at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
    const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& req_ids,
    const at::Tensor& query_rows, double scale, int64_t sliding_window) {
  check_attention_inputs("paged_decode_attention", out, query, key_cache, value_cache, block_table, seq_lens,
                         {&req_ids, &query_rows});
  dispatch_types("paged_decode_attention", query, key_cache.scalar_type(), [&]<typename T, typename C, int HD>() {
    decode_attention<T, C, HD>(out, query, key_cache, value_cache, block_table, seq_lens, req_ids, query_rows, scale,
                               sliding_window);
  });
}

void paged_prefill_attention(
    at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
    const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& req_ids,
    const at::Tensor& query_starts, const at::Tensor& query_lens, double scale, int64_t sliding_window) {
  check_attention_inputs("paged_prefill_attention", out, query, key_cache, value_cache, block_table, seq_lens,
                         {&req_ids, &query_starts, &query_lens});
  dispatch_types("paged_prefill_attention", query, key_cache.scalar_type(), [&]<typename T, typename C, int HD>() {
    prefill_attention<T, C, HD>(out, query, key_cache, value_cache, block_table, seq_lens, req_ids, query_starts,
                                query_lens, scale, sliding_window);
  });
}

// Whether this build's prefill takes the AVX-512 tiles (head sizes that 16 divide), whose
// products stay ahead of SDPA at every length (backend.py lifts its length limit).
bool prefill_tiles() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(vframe_cpu, m) {
  m.def("prefill_tiles() -> bool", &prefill_tiles);
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_table, Tensor seq_lens, Tensor req_ids, Tensor query_rows, float scale, "
      "int sliding_window) -> ()");
  m.def(
      "paged_prefill_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_table, Tensor seq_lens, Tensor req_ids, Tensor query_starts, Tensor query_lens, float scale, "
      "int sliding_window) -> ()");
}

TORCH_LIBRARY_IMPL(vframe_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_prefill_attention", &paged_prefill_attention);
}
