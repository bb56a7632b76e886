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

// The positions of the `keep` highest of scores[0, n) (NaN ranks last; ties: the smaller
// position), appended to `out` in no particular order: the set SelectTop keeps over RankKey.
// A radix select over the rank bits of RankKey (11, 11, then 10 bits): each level counts the
// candidates' digits, keeps outright those in the buckets above the boundary bucket, and goes on
// with the boundary bucket's candidates only; the last candidates have equal scores and are taken
// by position (they stay in ascending position order). Two passes over n plus the shrinking
// boundary sets, against std::nth_element's swaps of 64-bit keys over all n.
inline void SelectTopPositions(const float* scores, int64_t n, int64_t keep, std::vector<uint32_t>& out) {
  if (keep <= 0 || n <= 0) return;
  const size_t out0 = out.size();
  if (keep >= n) {
    for (int64_t j = 0; j < n; ++j) out.push_back(static_cast<uint32_t>(j));
    return;
  }
  constexpr int kShift[3] = {21, 10, 0};
  constexpr uint32_t kMask[3] = {0x7ffu, 0x7ffu, 0x3ffu};
  thread_local std::vector<uint32_t> rank, cand, next;
  uint32_t hist[2048] = {};
  rank.resize(n);
  for (int64_t j = 0; j < n; ++j) {
    rank[j] = static_cast<uint32_t>(RankKey(scores[j], 0) >> 32);
    hist[rank[j] >> kShift[0]]++;
  }
  // Room for every position; each level appends by a select, not a branch (the digits are
  // unpredictable), and the list is cut to the kept ones at the end.
  out.resize(out0 + n);
  uint32_t* kept = out.data() + out0;
  int64_t nk = 0;
  int64_t need = keep;
  for (int level = 0; level < 3; ++level) {
    const int sh = kShift[level];
    const uint32_t mask = kMask[level];
    if (level > 0) {
      std::fill(hist, hist + mask + 1, 0u);
      for (uint32_t j : cand) hist[(rank[j] >> sh) & mask]++;
    }
    uint32_t edge = 0;
    int64_t above = 0;  // candidates in the buckets before the boundary one (higher scores)
    while (above + hist[edge] < need) above += hist[edge++];
    const int64_t m = level == 0 ? n : static_cast<int64_t>(cand.size());
    next.resize(m);
    int64_t nn = 0;
    for (int64_t i = 0; i < m; ++i) {
      const uint32_t j = level == 0 ? static_cast<uint32_t>(i) : cand[i];
      const uint32_t d = (rank[j] >> sh) & mask;
      kept[nk] = j;
      nk += d < edge;
      next[nn] = j;
      nn += d == edge;
    }
    next.resize(nn);
    need -= above;
    cand.swap(next);
    if (need == nn) break;
  }
  for (int64_t i = 0; i < need; ++i) kept[nk++] = cand[i];
  out.resize(out0 + nk);
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

// A NaN or +inf score makes the head NaN (magicpig::Corrupt / Poison), never a selection that
// silently leaves the key out (NaN ranks last) or an empty row.
using magicpig::Corrupt;
using magicpig::Poison;

// Softmax attention over `n` selected keys with logits `logit[j]` and value rows `rows[j]`
// (pointers into V): out[0:D] = sum_j e_j v_j / sum_j e_j, *lse = max + log(sum). With softcap
// c > 0 each finite logit is first replaced, in place, by c tanh(logit / c) (Gemma 2's attention
// logit soft-capping; the selection that chose the keys ranked the uncapped logits, which the
// monotone cap orders the same way). No key gives out = 0 and lse = -inf; a NaN or +inf logit gives
// out and lse NaN (Corrupt); only -inf logits give out NaN and lse -inf (AllMinusInf; a -inf logit
// among finite ones weighs 0).
template <typename T>
void SoftmaxOverRows(float* logit, const T* const* rows, int64_t n, int64_t D, bool avx2, float softcap, float* out,
                     float* lse) {
  if (softcap > 0.0f) magicpig::SoftCapInPlace(logit, n, softcap);
  std::fill(out, out + D, 0.0f);
  float m = -INFINITY;
  bool corrupt = false;
  for (int64_t j = 0; j < n; ++j) {
    m = std::max(m, logit[j]);
    corrupt |= Corrupt(logit[j]);
  }
  if (corrupt) {
    Poison(out, D, lse);
    return;
  }
  if (n == 0) {
    *lse = -INFINITY;
    return;
  }
  if (!std::isfinite(m)) {  // only -inf logits (a -inf in q or in every kept key)
    magicpig::AllMinusInf(out, D, lse);
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
