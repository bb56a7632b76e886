// Kernels shared by the selection ops (topk_attention.cc, quest_attention.cc): dot products of a
// query with key rows, the ordered 64-bit selection keys, and exact softmax attention over a
// list of selected keys.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ffi_util.h"

namespace magicpig {
namespace selected {

// q . k over D elements (scalar; float32 accumulation in index order).
template <typename T>
inline float DotScalar(const float* q, const T* k, int64_t D) {
  float s = 0.f;
  for (int64_t d = 0; d < D; ++d) s += q[d] * Load(k, d);
  return s;
}

#ifdef MAGICPIG_HAVE_AVX2_PATH
template <typename T>
__attribute__((target("avx2,fma"))) inline float DotAvx2(const float* q, const T* k, int64_t D) {
  __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), Load8(k + d), a);
    b = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), Load8(k + d + 8), b);
  }
  for (; d + 8 <= D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), Load8(k + d), a);
  float s = Hsum(_mm256_add_ps(a, b));
  for (; d < D; ++d) s += q[d] * Load(k, d);
  return s;
}

// acc[0:D] += w * v[0:D].
template <typename T>
__attribute__((target("avx2,fma"))) inline void AxpyAvx2(float w, const T* v, float* acc, int64_t D) {
  const __m256 wv = _mm256_set1_ps(w);
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(wv, Load8(v + d), _mm256_loadu_ps(acc + d)));
  for (; d < D; ++d) acc[d] += w * Load(v, d);
}
#endif

template <typename T>
inline float Dot(const float* q, const T* k, int64_t D, bool avx2) {
#ifdef MAGICPIG_HAVE_AVX2_PATH
  if (avx2) return DotAvx2(q, k, D);
#endif
  (void)avx2;
  return DotScalar(q, k, D);
}

template <typename T>
inline void Axpy(float w, const T* v, float* acc, int64_t D, bool avx2) {
#ifdef MAGICPIG_HAVE_AVX2_PATH
  if (avx2) {
    AxpyAvx2(w, v, acc, D);
    return;
  }
#endif
  (void)avx2;
  AxpyScalar(w, v, acc, D);
}

// A selection key: ascending order of the key is descending order of `score`, ties broken by
// the smaller position (the order of magicpig_jax.attention's stable descending argsort).
// NaN scores rank last.
inline uint64_t RankKey(float score, uint32_t pos) {
  uint32_t bits;
  if (std::isnan(score)) score = -INFINITY;
  std::memcpy(&bits, &score, 4);
  // Monotone map of the float order onto uint32 (negative floats reversed), then inverted.
  const uint32_t ordered = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return (static_cast<uint64_t>(~ordered) << 32) | pos;
}
inline uint32_t RankPos(uint64_t key) { return static_cast<uint32_t>(key & 0xffffffffu); }

// Keeps the `keep` smallest keys (highest scores) in keys[0, keep), in no particular order: a
// partial selection (std::nth_element, linear on average), not a sort.
inline void SelectTop(std::vector<uint64_t>& keys, int64_t keep) {
  const int64_t n = static_cast<int64_t>(keys.size());
  if (keep <= 0 || keep >= n) return;
  std::nth_element(keys.begin(), keys.begin() + keep, keys.end());
}

// Appends the exact keys [0, s) and [e, ctx) (a decoder's static set: sinks and the unhashed tail) to a
// list of logits and value rows (query q, k and v rows of D elements).
template <typename T>
void AppendStatic(const float* q, const T* k, const T* v, int64_t s, int64_t e, int64_t ctx, int64_t D, bool avx2,
                  float sqrt_d, std::vector<float>& logit, std::vector<const T*>& rows) {
  auto add = [&](int64_t j) {
    logit.push_back(Dot(q, k + j * D, D, avx2) / sqrt_d);
    rows.push_back(v + j * D);
  };
  for (int64_t j = 0; j < s; ++j) add(j);
  for (int64_t j = e; j < ctx; ++j) add(j);
}

// Softmax attention over `n` selected keys with logits `logit[j]` and value rows `rows[j]`
// (pointers into V): out[0:D] = sum_j e_j v_j / sum_j e_j, *lse = max + log(sum). No key, or a
// non-finite maximum, gives out = 0 and lse = -inf (never NaN from an empty set).
template <typename T>
void SoftmaxOverRows(const float* logit, const T* const* rows, int64_t n, int64_t D, bool avx2, float* out,
                     float* lse) {
  std::fill(out, out + D, 0.0f);
  float m = -INFINITY;
  for (int64_t j = 0; j < n; ++j) m = std::max(m, logit[j]);
  if (n == 0 || !std::isfinite(m)) {
    *lse = -INFINITY;
    return;
  }
  double sum = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    const float e = std::exp(logit[j] - m);
    sum += e;
    Axpy(e, rows[j], out, D, avx2);
  }
  const float inv = static_cast<float>(1.0 / sum);
  for (int64_t d = 0; d < D; ++d) out[d] *= inv;
  *lse = m + static_cast<float>(std::log(sum));
}

}  // namespace selected
}  // namespace magicpig
