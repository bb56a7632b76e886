// MagicPIG host-memory LSH index and sampled attention as XLA FFI custom calls (CPU).
//
// Source: Chen et al., "MagicPIG: LSH Sampling for Efficient LLM Generation", ICLR 2025,
// arXiv 2410.16179, Sections 4.2-4.3 (SimHash tables, "collides in >= 2 of L tables",
// importance weight 1/u of Eq. (9), self-normalized estimate of Eq. (4)).
//
// Index layout (all plain XLA buffers, no global state; see magicpig_jax/host/index.py):
//   ids      uint16 [B, Hkv, NC, L, CH]   per chunk and table, token ids (pos - c*CH) sorted by bucket
//   offsets  uint16 [B, Hkv, NC, L, 2^K+1] bucket starts; offsets[..., 2^K] = tokens in the chunk
//   open     uint16 [B, Hkv, L, OPEN]      codes of the open (unsorted) chunk, scanned linearly
//   bounds   int32  [B, 3]                 (start, end, sealed_end): hashed range [start, end);
//                                          [start, sealed_end) is in the sorted chunks and
//                                          [sealed_end, end) in the open chunk (end - sealed <= OPEN)
// Chunk c covers the positions [c*CH, (c+1)*CH), CH <= 65535, so the ids and the bucket offsets
// (at most CH, the tokens in a full chunk) fit in 16 bits.
//
// Every handler re-validates shapes, dtypes and the data it dereferences and returns an
// ffi::Error instead of crashing or reading out of bounds.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ffi_util.h"
#include "handlers.h"

namespace ffi = xla::ffi;

namespace {

using magicpig::AxpyScalar;
using magicpig::CpuHasAvx2;
#ifdef MAGICPIG_HAVE_AVX2_PATH
using magicpig::Exp8;
#endif
using magicpig::InvalidArg;
using magicpig::Load;
using magicpig::PrefetchL1;
using magicpig::PrefetchL2;
using magicpig::ReadyFuture;
using magicpig::RunParallel;
using magicpig::Shape;
using magicpig::SoftCapInPlace;
using magicpig::CheckSoftcap;
#ifdef MAGICPIG_HAVE_AVX2_PATH
using magicpig::Hsum;
using magicpig::Load8;
#endif

using magicpig::kMaxChunk;
using magicpig::kMaxK;
using magicpig::kMaxL;
// Buckets longer than this are cut to a piece's positions by binary search (CollectSampled).
constexpr int64_t kSearchBucket = 64;
// How many tables ahead of the bucket walk a table's offsets are requested, and its range read
// and first id lines requested (CollectSampled). Against requesting every table's lines first,
// the captured 8K SmolLM2 step ran faster, most at B = 16 and with more tables; at 128K on the
// Llama shape nothing moved beyond the drift (docs/benchmarks.md). At 8K, 16/8, 24/12 and 32/16
// were within the runs' spread of each other.
constexpr int64_t kOffsetsAhead = 24;
constexpr int64_t kIdsAhead = 12;
constexpr float kLogUFloor = -69.07755278982137f;  // LOG_U_FLOOR of attention/magicpig.py

// ---------------------------------------------------------------------------------------------
// Numeric kernels: scalar and AVX2/FMA variants (chosen at run time).
// ---------------------------------------------------------------------------------------------

// dot = q.k, cdot = qs.(k - mean), kc2 = |k - mean|^2; qs is q scaled by a power of two (ScaledQuery).
template <typename T>
void RowScalar(const float* q, const float* qs, const float* mean, const T* k, int64_t D, float* dot,
               float* cdot, float* kc2) {
  float a = 0.f, b = 0.f, c = 0.f;
  for (int64_t d = 0; d < D; ++d) {
    float kv = Load(k, d);
    float kc = kv - mean[d];
    a += q[d] * kv;
    b += qs[d] * kc;
    c += kc * kc;
  }
  *dot = a;
  *cdot = b;
  *kc2 = c;
}

// Per-position hit counts of the open chunk: hits[i] = #{l : open[l][i] == qc[l]}.
void OpenHitsScalar(const uint16_t* open, int64_t L, int64_t stride, int64_t n, const uint32_t* qc,
                    uint16_t* hits) {
  std::fill(hits, hits + n, uint16_t{0});
  for (int64_t l = 0; l < L; ++l) {
    const uint16_t* row = open + l * stride;
    const uint16_t c = static_cast<uint16_t>(qc[l]);
    for (int64_t i = 0; i < n; ++i) hits[i] += (row[i] == c);
  }
}

#ifdef MAGICPIG_HAVE_AVX2_PATH


template <typename T>
__attribute__((target("avx2,fma"), always_inline)) inline void RowAvx2(const float* q, const float* qs,
                                                                         const float* mean, const T* k, int64_t D,
                                                                         float* dot, float* cdot, float* kc2) {
  __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps(), c = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    __m256 kv = Load8(k + d);
    __m256 kc = _mm256_sub_ps(kv, _mm256_loadu_ps(mean + d));
    a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), kv, a);
    b = _mm256_fmadd_ps(_mm256_loadu_ps(qs + d), kc, b);
    c = _mm256_fmadd_ps(kc, kc, c);
  }
  float sa = Hsum(a), sb = Hsum(b), sc = Hsum(c);
  for (; d < D; ++d) {
    float kv = Load(k, d);
    float kc = kv - mean[d];
    sa += q[d] * kv;
    sb += qs[d] * kc;
    sc += kc * kc;
  }
  *dot = sa;
  *cdot = sb;
  *kc2 = sc;
}

// qs = q times the power of two that brings its largest magnitude into [1, 2) (q itself when it is
// zero or not finite), as magicpig_jax.lsh.exponent_scaled: the cosine of q and a key is the same
// from qs (the scaling is exact), and |qs|^2 no longer underflows for a tiny q nor overflows for a
// huge one, where the pure-JAX reference computes it from the scaled vectors too.
void ScaledQuery(const float* q, int64_t D, float* qs) {
  float top = 0.f;
  bool finite = true;
  for (int64_t d = 0; d < D; ++d) {
    finite = finite && std::isfinite(q[d]);
    top = std::max(top, std::fabs(q[d]));
  }
  int e = 0;
  if (finite && top > 0.f) std::frexp(top, &e);
  for (int64_t d = 0; d < D; ++d) qs[d] = (finite && top > 0.f) ? std::ldexp(q[d], 1 - e) : q[d];
}

// Outside [kTinyKc2, kHugeKc2], |k - mean|^2 summed in float32 may have lost the key to underflow
// (each square of a component under ~1e-19 is below float32's normal range) or overflow (over
// ~1.8e19, where qs.(k - mean) can overflow too): the cosine is then taken in float64, where
// neither can happen for float32 inputs. A NaN kc2 (a NaN key) stays on the float32 path.
constexpr float kTinyKc2 = 1e-30f;
constexpr float kHugeKc2 = 1e30f;

inline bool OutOfFloatRange(float kc2) { return kc2 < kTinyKc2 || kc2 > kHugeKc2; }

// The centered cosine of qs (norm qsn) and a key, in float64: for the rare key whose centered norm
// is outside the float32 path's range (OutOfFloatRange); 0 for a zero norm, as the float path.
template <typename T>
float Float64KeyCosine(const float* qs, double qsn, const float* mean, const T* k, int64_t D) {
  double b = 0.0, c = 0.0;
  for (int64_t d = 0; d < D; ++d) {
    const double kc = static_cast<double>(Load(k, d)) - static_cast<double>(mean[d]);
    b += static_cast<double>(qs[d]) * kc;
    c += kc * kc;
  }
  const double norms = qsn * std::sqrt(c);
  return norms > 0.0 ? static_cast<float>(b / norms) : 0.f;
}

// q.k alone: the exact (static) candidates need neither the centered dot nor the key's norm.
template <typename T>
__attribute__((target("avx2,fma"), always_inline)) inline float DotAvx2(const float* q, const T* k, int64_t D) {
  __m256 a = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), Load8(k + d), a);
  float sa = Hsum(a);
  for (; d < D; ++d) sa += q[d] * Load(k, d);
  return sa;
}

template <typename T>
__attribute__((target("avx2,fma"))) void AxpyAvx2(float w, const T* v, float* acc, int64_t D) {
  __m256 wv = _mm256_set1_ps(w);
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(wv, Load8(v + d), _mm256_loadu_ps(acc + d)));
  }
  for (; d < D; ++d) acc[d] += w * Load(v, d);
}

__attribute__((target("avx2,fma"))) void OpenHitsAvx2(const uint16_t* open, int64_t L,
                                                      int64_t stride, int64_t n,
                                                      const uint32_t* qc, uint16_t* hits) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256i acc = _mm256_setzero_si256();
    for (int64_t l = 0; l < L; ++l) {
      __m256i row = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(open + l * stride + i));
      __m256i eq = _mm256_cmpeq_epi16(row, _mm256_set1_epi16(static_cast<int16_t>(qc[l])));
      acc = _mm256_sub_epi16(acc, eq);  // eq lanes are -1
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hits + i), acc);
  }
  _mm256_zeroupper();
  if (i < n) {
    std::fill(hits + i, hits + n, uint16_t{0});
    for (int64_t l = 0; l < L; ++l) {
      const uint16_t* row = open + l * stride;
      const uint16_t c = static_cast<uint16_t>(qc[l]);
      for (int64_t j = i; j < n; ++j) hits[j] += (row[j] == c);
    }
  }
}
#endif  // MAGICPIG_HAVE_AVX2_PATH

// ---------------------------------------------------------------------------------------------
// log u from the cosine: log u = 2K log p + f(p), f tabulated on a uniform grid of p in [0, 1]
// (f = log(u / p^(2K)) is smooth on [0, 1]; the table comes from magicpig_jax/host/log_u.py, float64).
// ---------------------------------------------------------------------------------------------

inline float LogU(float cos, int K, const double* table, int64_t T) {
  float c = std::min(1.0f, std::max(-1.0f, cos));
  // p = 1 - acos(c)/pi = acos(-c)/pi, the latter without cancellation for c near -1.
  float p = std::acos(-c) * static_cast<float>(M_1_PI);
  if (!(p > 0.0f)) return kLogUFloor;
  double x = static_cast<double>(p) * static_cast<double>(T);
  int64_t i = static_cast<int64_t>(x);
  if (i >= T) i = T - 1;
  if (i < 0) i = 0;
  double fr = x - static_cast<double>(i);
  double f = table[i] + fr * (table[i + 1] - table[i]);
  double lu = 2.0 * K * std::log(static_cast<double>(p)) + f;
  float r = static_cast<float>(lu);
  return r > kLogUFloor ? r : kLogUFloor;
}

#ifdef MAGICPIG_HAVE_AVX2_PATH
// acos on [-1, 1]: Abramowitz & Stegun 4.4.46 on |x| (|error| <= 2e-8), reflected for x < 0.
__attribute__((target("avx2,fma"))) inline __m256 Acos8(__m256 x) {
  const __m256 ax = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
  __m256 p = _mm256_set1_ps(-0.0012624911f);
  p = _mm256_fmadd_ps(p, ax, _mm256_set1_ps(0.0066700901f));
  p = _mm256_fmadd_ps(p, ax, _mm256_set1_ps(-0.0170881256f));
  p = _mm256_fmadd_ps(p, ax, _mm256_set1_ps(0.0308918810f));
  p = _mm256_fmadd_ps(p, ax, _mm256_set1_ps(-0.0501743046f));
  p = _mm256_fmadd_ps(p, ax, _mm256_set1_ps(0.0889789874f));
  p = _mm256_fmadd_ps(p, ax, _mm256_set1_ps(-0.2145988016f));
  p = _mm256_fmadd_ps(p, ax, _mm256_set1_ps(1.5707963050f));
  const __m256 r = _mm256_mul_ps(_mm256_sqrt_ps(_mm256_sub_ps(_mm256_set1_ps(1.0f), ax)), p);
  const __m256 neg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
  return _mm256_blendv_ps(r, _mm256_sub_ps(_mm256_set1_ps(static_cast<float>(M_PI)), r), neg);
}

// Natural log of normal positive floats: exponent + Cephes' logf polynomial on [sqrt(1/2), sqrt(2)).
__attribute__((target("avx2,fma"))) inline __m256 Log8(__m256 x) {
  const __m256i xi = _mm256_castps_si256(x);
  const __m256i e = _mm256_sub_epi32(_mm256_srli_epi32(xi, 23), _mm256_set1_epi32(127));
  __m256 m = _mm256_castsi256_ps(
      _mm256_or_si256(_mm256_and_si256(xi, _mm256_set1_epi32(0x007fffff)), _mm256_set1_epi32(0x3f800000)));
  const __m256 big = _mm256_cmp_ps(m, _mm256_set1_ps(1.41421356f), _CMP_GT_OQ);
  m = _mm256_blendv_ps(m, _mm256_mul_ps(m, _mm256_set1_ps(0.5f)), big);
  const __m256 ef = _mm256_add_ps(_mm256_cvtepi32_ps(e), _mm256_and_ps(big, _mm256_set1_ps(1.0f)));
  const __m256 f = _mm256_sub_ps(m, _mm256_set1_ps(1.0f));
  const __m256 z = _mm256_mul_ps(f, f);
  __m256 y = _mm256_set1_ps(7.0376836292e-2f);
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(-1.1514610310e-1f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.1676998740e-1f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(-1.2420140846e-1f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.4249322787e-1f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(-1.6668057665e-1f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(2.0000714765e-1f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(-2.4999993993e-1f));
  y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(3.3333331174e-1f));
  y = _mm256_mul_ps(_mm256_mul_ps(y, f), z);
  y = _mm256_fmadd_ps(ef, _mm256_set1_ps(-2.12194440e-4f), y);
  y = _mm256_fnmadd_ps(_mm256_set1_ps(0.5f), z, y);
  return _mm256_fmadd_ps(ef, _mm256_set1_ps(0.693359375f), _mm256_add_ps(f, y));
}

// LogU for n cosines, 8 at a time: the same formula and table as LogU (differences ~1e-7).
__attribute__((target("avx2,fma"))) void LogUBatchAvx2(const float* cs, int64_t n, int K, const double* table,
                                                      int64_t T, float* out) {
  const __m256 one = _mm256_set1_ps(1.0f), inv_pi = _mm256_set1_ps(static_cast<float>(M_1_PI));
  const __m256 floor = _mm256_set1_ps(kLogUFloor), tf = _mm256_set1_ps(static_cast<float>(T));
  const __m256 two_k = _mm256_set1_ps(2.0f * K);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 c = _mm256_min_ps(one, _mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), one), _mm256_loadu_ps(cs + i)));
    const __m256 p = _mm256_mul_ps(Acos8(_mm256_sub_ps(_mm256_setzero_ps(), c)), inv_pi);
    const __m256 pos = _mm256_cmp_ps(p, _mm256_setzero_ps(), _CMP_GT_OQ);
    const __m256 x = _mm256_mul_ps(p, tf);
    __m256i idx = _mm256_cvttps_epi32(x);
    idx = _mm256_max_epi32(_mm256_setzero_si256(), _mm256_min_epi32(idx, _mm256_set1_epi32(static_cast<int>(T - 1))));
    const __m256 fr = _mm256_sub_ps(x, _mm256_cvtepi32_ps(idx));
    const __m128i lo_i = _mm256_castsi256_si128(idx), hi_i = _mm256_extracti128_si256(idx, 1);
    // Masked gathers with every lane on (the unmasked form leaves its source undefined, which
    // GCC's headers report as maybe-uninitialized once the function is inlined).
    const __m256d z = _mm256_setzero_pd(), on = _mm256_castsi256_pd(_mm256_set1_epi64x(-1));
    const __m256d t0l = _mm256_mask_i32gather_pd(z, table, lo_i, on, 8);
    const __m256d t1l = _mm256_mask_i32gather_pd(z, table + 1, lo_i, on, 8);
    const __m256d t0h = _mm256_mask_i32gather_pd(z, table, hi_i, on, 8);
    const __m256d t1h = _mm256_mask_i32gather_pd(z, table + 1, hi_i, on, 8);
    const __m256d fl = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(fr)), _mm256_sub_pd(t1l, t0l), t0l);
    const __m256d fh = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(fr, 1)), _mm256_sub_pd(t1h, t0h), t0h);
    const __m256 f = _mm256_set_m128(_mm256_cvtpd_ps(fh), _mm256_cvtpd_ps(fl));
    // log of a positive p (p = 0 lanes take the floor below; feed them 1 to stay finite).
    const __m256 lp = Log8(_mm256_blendv_ps(one, p, pos));
    __m256 lu = _mm256_max_ps(floor, _mm256_fmadd_ps(two_k, lp, f));
    lu = _mm256_blendv_ps(floor, lu, pos);
    _mm256_storeu_ps(out + i, lu);
  }
  for (; i < n; ++i) out[i] = LogU(cs[i], K, table, T);
}
#endif

// The float64 table arrives as its raw bits, uint32 [T+1, 2] (no x64 mode needed in JAX).
ffi::Error CheckTable(const ffi::Buffer<ffi::U32>& table, int64_t* T) {
  if (table.dimensions().size() != 2 || table.dimensions()[0] < 2 || table.dimensions()[1] != 2) {
    return InvalidArg("log-u table must be uint32 [T+1, 2] (float64 bits) with T >= 1, got " +
                      Shape(table.dimensions()));
  }
  if (reinterpret_cast<uintptr_t>(table.untyped_data()) % alignof(double) != 0) {
    return InvalidArg("log-u table buffer is not 8-byte aligned");
  }
  *T = table.dimensions()[0] - 1;
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// Shared index geometry.
// ---------------------------------------------------------------------------------------------

struct Geometry {
  int64_t B = 0, Hkv = 0, NC = 0, L = 0, CH = 0, NB = 0, OPEN = 0;
  int K = 0;
  int64_t capacity() const { return NC * CH; }
};

ffi::Error CheckK(int64_t K) {
  if (K < 1 || K > kMaxK) {
    return InvalidArg("K must be in [1, " + std::to_string(kMaxK) + "] for the host index, got K=" +
                      std::to_string(K));
  }
  return ffi::Error::Success();
}

ffi::Error IndexGeometry(int64_t K, ffi::Span<const int64_t> ids, ffi::Span<const int64_t> offsets,
                         ffi::Span<const int64_t> open, ffi::Span<const int64_t> bounds, Geometry* g) {
  if (auto e = CheckK(K); !e.success()) return e;
  if (ids.size() != 5) return InvalidArg("ids must be uint16 [B, Hkv, NC, L, CH], got " + Shape(ids));
  g->K = static_cast<int>(K);
  g->B = ids[0];
  g->Hkv = ids[1];
  g->NC = ids[2];
  g->L = ids[3];
  g->CH = ids[4];
  g->NB = (int64_t{1} << K) + 1;
  if (g->L < 2 || g->L > kMaxL) {
    return InvalidArg("L must be in [2, " + std::to_string(kMaxL) + "], got L=" + std::to_string(g->L));
  }
  if (g->CH < 1 || g->CH > kMaxChunk) {
    return InvalidArg("chunk size must be in [1, " + std::to_string(kMaxChunk) + "], got " + std::to_string(g->CH));
  }
  if (g->NC * g->CH > INT32_MAX) return InvalidArg("index capacity exceeds int32 positions");
  if (offsets.size() != 5 || offsets[0] != g->B || offsets[1] != g->Hkv || offsets[2] != g->NC ||
      offsets[3] != g->L || offsets[4] != g->NB) {
    return InvalidArg("offsets must be uint16 [B, Hkv, NC, L, 2^K+1] = [" + std::to_string(g->B) + ", " +
                      std::to_string(g->Hkv) + ", " + std::to_string(g->NC) + ", " +
                      std::to_string(g->L) + ", " + std::to_string(g->NB) + "], got " + Shape(offsets));
  }
  if (open.size() != 4 || open[0] != g->B || open[1] != g->Hkv || open[2] != g->L || open[3] < 1) {
    return InvalidArg("open_codes must be uint16 [B, Hkv, L, OPEN>=1], got " + Shape(open));
  }
  g->OPEN = open[3];
  if (bounds.size() != 2 || bounds[0] != g->B || bounds[1] != 3) {
    return InvalidArg("bounds must be int32 [B, 3], got " + Shape(bounds));
  }
  return ffi::Error::Success();
}

ffi::Error CheckBounds(const Geometry& g, int64_t b, int32_t start, int32_t end, int32_t sealed) {
  if (!(0 <= start && start <= sealed && sealed <= end && end <= g.capacity() &&
        end - sealed <= g.OPEN)) {
    return InvalidArg("corrupt index bounds in row " + std::to_string(b) + ": (start, end, sealed_end) = (" +
                      std::to_string(start) + ", " + std::to_string(end) + ", " + std::to_string(sealed) +
                      "), capacity " + std::to_string(g.capacity()) + ", open capacity " +
                      std::to_string(g.OPEN));
  }
  return ffi::Error::Success();
}

// Sort the tokens of positions [lo, hi) of chunk c (codes given per position via `code(pos, l)`)
// into the chunk's tables by counting sort.
template <typename CodeFn>
void SortChunk(const Geometry& g, int64_t c, int64_t lo, int64_t hi, CodeFn code, uint16_t* ids,
               uint16_t* offsets) {
  const int64_t nb = g.NB - 1;
  const int64_t n = std::max<int64_t>(0, hi - lo);
  for (int64_t l = 0; l < g.L; ++l) {
    uint16_t* off = offsets + l * g.NB;
    uint16_t* out = ids + l * g.CH;
    std::fill(off, off + g.NB, 0);
    for (int64_t p = lo; p < hi; ++p) off[code(p, l) + 1]++;
    for (int64_t j = 0; j < nb; ++j) off[j + 1] += off[j];
    // Scatter using off[j] as running write pointers, then restore the starts.
    for (int64_t p = lo; p < hi; ++p) out[off[code(p, l)]++] = static_cast<uint16_t>(p - c * g.CH);
    for (int64_t j = nb; j > 0; --j) off[j] = off[j - 1];
    off[0] = 0;
    std::fill(out + n, out + g.CH, uint16_t{0});
  }
}

// ---------------------------------------------------------------------------------------------
// 1. Build.
// ---------------------------------------------------------------------------------------------

ffi::Future BuildImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U32> codes, ffi::Buffer<ffi::S32> start,
                      ffi::Buffer<ffi::S32> end, ffi::Result<ffi::Buffer<ffi::U16>> ids,
                      ffi::Result<ffi::Buffer<ffi::U16>> offsets, ffi::Result<ffi::Buffer<ffi::U16>> open,
                      ffi::Result<ffi::Buffer<ffi::S32>> bounds, int64_t K, int64_t max_threads) {
  Geometry g;
  if (auto e = IndexGeometry(K, ids->dimensions(), offsets->dimensions(), open->dimensions(),
                             bounds->dimensions(), &g);
      !e.success()) {
    return ReadyFuture(e);
  }
  auto cd = codes.dimensions();
  if (cd.size() != 4 || cd[0] != g.B || cd[1] != g.Hkv || cd[3] != g.L) {
    return ReadyFuture(InvalidArg("codes must be uint32 [B, Hkv, N, L] with B=" + std::to_string(g.B) +
                                  ", Hkv=" + std::to_string(g.Hkv) + ", L=" + std::to_string(g.L) +
                                  ", got " + Shape(cd)));
  }
  const int64_t N = cd[2];
  if (start.dimensions().size() != 1 || start.dimensions()[0] != g.B || end.dimensions().size() != 1 ||
      end.dimensions()[0] != g.B) {
    return ReadyFuture(InvalidArg("start and end must be int32 [B]"));
  }
  std::vector<int32_t> st(g.B), en(g.B);
  for (int64_t b = 0; b < g.B; ++b) {
    st[b] = start.typed_data()[b];
    en[b] = end.typed_data()[b];
    if (!(0 <= st[b] && st[b] <= en[b] && en[b] <= N && en[b] <= g.capacity())) {
      return ReadyFuture(InvalidArg("hashed range of row " + std::to_string(b) + " is [" +
                                    std::to_string(st[b]) + ", " + std::to_string(en[b]) +
                                    "); need 0 <= start <= end <= min(N, capacity) = " +
                                    std::to_string(std::min<int64_t>(N, g.capacity()))));
    }
  }
  const uint32_t kmask_hi = ~((K >= 32) ? 0u : ((1u << K) - 1u));
  // Check the codes of the hashed positions before touching any output.
  for (int64_t b = 0; b < g.B; ++b) {
    for (int64_t h = 0; h < g.Hkv; ++h) {
      const uint32_t* cb = codes.typed_data() + (b * g.Hkv + h) * N * g.L;
      for (int64_t i = int64_t{st[b]} * g.L; i < int64_t{en[b]} * g.L; ++i) {
        if (cb[i] & kmask_hi) {
          return ReadyFuture(InvalidArg("code " + std::to_string(cb[i]) + " does not fit in K=" +
                                        std::to_string(K) + " bits"));
        }
      }
    }
  }
  int32_t* bo = bounds->typed_data();
  for (int64_t b = 0; b < g.B; ++b) {
    bo[3 * b] = st[b];
    bo[3 * b + 1] = en[b];
    bo[3 * b + 2] = en[b];
  }
  std::memset(open->untyped_data(), 0, open->size_bytes());
  uint16_t* ids_p = ids->typed_data();
  uint16_t* off_p = offsets->typed_data();
  const uint32_t* codes_p = codes.typed_data();
  return RunParallel(pool, g.B * g.Hkv * g.NC, max_threads,
                     [=](int64_t item) -> ffi::Error {
                       const int64_t bh = item / g.NC, c = item % g.NC, b = bh / g.Hkv;
                       const uint32_t* cb = codes_p + bh * N * g.L;
                       const int64_t lo = std::max<int64_t>(st[b], c * g.CH);
                       const int64_t hi = std::min<int64_t>(en[b], (c + 1) * g.CH);
                       SortChunk(
                           g, c, lo, hi, [&](int64_t p, int64_t l) { return cb[p * g.L + l]; },
                           ids_p + item * g.L * g.CH, off_p + item * g.L * g.NB);
                       return ffi::Error::Success();
                     });
}

// ---------------------------------------------------------------------------------------------
// 2. Append (the index buffers are aliased input -> output).
// ---------------------------------------------------------------------------------------------

// Insert the open chunk's tokens (positions [sealed, sealed + n)) into the sorted chunks. A chunk
// must hold exactly the positions [max(start, chunk start), sealed) before: an index whose bounds
// were edited apart from its tables would otherwise be written past its chunk (or take a
// position twice), so the count is checked and a mismatch is an error, not a write.
ffi::Error MergeOpen(const Geometry& g, int64_t start, int64_t sealed, int64_t n, const uint16_t* open,
                     uint16_t* ids_bh, uint16_t* off_bh, std::vector<uint32_t>& scratch) {
  int64_t p = sealed;
  while (p < sealed + n) {
    const int64_t c = p / g.CH;
    const int64_t q_end = std::min<int64_t>(sealed + n, (c + 1) * g.CH);
    const int64_t m = q_end - p;
    const int64_t held = p - std::max<int64_t>(start, c * g.CH);
    for (int64_t l = 0; l < g.L; ++l) {
      if (off_bh[(c * g.L + l) * g.NB + g.NB - 1] != held) {
        return InvalidArg("the index's chunk " + std::to_string(c) + " holds " +
                          std::to_string(off_bh[(c * g.L + l) * g.NB + g.NB - 1]) + " positions in table " +
                          std::to_string(l) + " where its bounds say " + std::to_string(held) +
                          ": bounds edited apart from the tables (rebuild the index)");
      }
    }
    for (int64_t l = 0; l < g.L; ++l) {
      // (code << 16 | id) of the new tokens, sorted by code.
      scratch.resize(m);
      const uint16_t* orow = open + l * g.OPEN + (p - sealed);
      for (int64_t i = 0; i < m; ++i) {
        scratch[i] = (static_cast<uint32_t>(orow[i]) << 16) | static_cast<uint32_t>(p + i - c * g.CH);
      }
      std::sort(scratch.begin(), scratch.end());
      uint16_t* off = off_bh + (c * g.L + l) * g.NB;
      uint16_t* lst = ids_bh + (c * g.L + l) * g.CH;
      const int64_t nb = g.NB - 1;
      const int64_t old_count = off[nb];
      int64_t w = old_count + m;  // write pointer (exclusive)
      int64_t j = m - 1;
      int64_t old_hi = old_count;  // old start of bucket bk + 1
      off[nb] = static_cast<uint16_t>(w);
      for (int64_t bk = nb - 1; bk >= 0 && j >= 0; --bk) {
        while (j >= 0 && static_cast<int64_t>(scratch[j] >> 16) == bk) {
          lst[--w] = static_cast<uint16_t>(scratch[j] & 0xFFFFu);
          --j;
        }
        const int64_t old_lo = off[bk];
        const int64_t len = old_hi - old_lo;
        w -= len;
        if (w != old_lo && len > 0) std::memmove(lst + w, lst + old_lo, len * sizeof(uint16_t));
        off[bk] = static_cast<uint16_t>(w);
        old_hi = old_lo;
      }
    }
    p = q_end;
  }
  return ffi::Error::Success();
}

ffi::Future AppendImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U16> ids_in, ffi::Buffer<ffi::U16> off_in,
                       ffi::Buffer<ffi::U16> open_in, ffi::Buffer<ffi::S32> bounds_in,
                       ffi::Buffer<ffi::U32> codes, ffi::Buffer<ffi::S32> counts,
                       ffi::Result<ffi::Buffer<ffi::U16>> ids, ffi::Result<ffi::Buffer<ffi::U16>> offsets,
                       ffi::Result<ffi::Buffer<ffi::U16>> open, ffi::Result<ffi::Buffer<ffi::S32>> bounds,
                       int64_t K, int64_t max_threads) {
  Geometry g;
  if (auto e = IndexGeometry(K, ids_in.dimensions(), off_in.dimensions(), open_in.dimensions(),
                             bounds_in.dimensions(), &g);
      !e.success()) {
    return ReadyFuture(e);
  }
  if (ids->size_bytes() != ids_in.size_bytes() || offsets->size_bytes() != off_in.size_bytes() ||
      open->size_bytes() != open_in.size_bytes() || bounds->size_bytes() != bounds_in.size_bytes()) {
    return ReadyFuture(InvalidArg("append outputs must have the shapes of the index inputs"));
  }
  auto cd = codes.dimensions();
  if (cd.size() != 4 || cd[0] != g.B || cd[1] != g.Hkv || cd[3] != g.L) {
    return ReadyFuture(InvalidArg("new codes must be uint32 [B, Hkv, T, L], got " + Shape(cd)));
  }
  const int64_t T = cd[2];
  if (counts.dimensions().size() != 1 || counts.dimensions()[0] != g.B) {
    return ReadyFuture(InvalidArg("counts must be int32 [B], got " + Shape(counts.dimensions())));
  }
  // Without aliasing the outputs start as copies of the inputs.
  auto copy_if = [](void* dst, const void* src, size_t n) {
    if (dst != src) std::memmove(dst, src, n);
  };
  std::vector<int32_t> old_b(3 * g.B), new_b(3 * g.B), cnt(g.B);
  std::memcpy(old_b.data(), bounds_in.typed_data(), 3 * g.B * sizeof(int32_t));
  const uint32_t kmask_hi = ~((1u << K) - 1u);
  for (int64_t b = 0; b < g.B; ++b) {
    const int32_t st = old_b[3 * b], en = old_b[3 * b + 1], se = old_b[3 * b + 2];
    if (auto e = CheckBounds(g, b, st, en, se); !e.success()) return ReadyFuture(e);
    cnt[b] = counts.typed_data()[b];
    if (cnt[b] < 0 || cnt[b] > T) {
      return ReadyFuture(InvalidArg("counts[" + std::to_string(b) + "] = " + std::to_string(cnt[b]) +
                                    " must be in [0, T=" + std::to_string(T) + "]"));
    }
    if (int64_t{en} + cnt[b] > g.capacity()) {
      return ReadyFuture(InvalidArg("appending " + std::to_string(cnt[b]) + " keys to row " +
                                    std::to_string(b) + " at position " + std::to_string(en) +
                                    " exceeds the index capacity " + std::to_string(g.capacity())));
    }
    for (int64_t h = 0; h < g.Hkv; ++h) {
      const uint32_t* cb = codes.typed_data() + (b * g.Hkv + h) * T * g.L;
      for (int64_t i = 0; i < int64_t{cnt[b]} * g.L; ++i) {
        if (cb[i] & kmask_hi) {
          return ReadyFuture(InvalidArg("code " + std::to_string(cb[i]) + " does not fit in K=" +
                                        std::to_string(K) + " bits"));
        }
      }
    }
    int64_t o = en - se;
    if (cnt[b] > 0 && o + cnt[b] > g.OPEN) o = (o + cnt[b] - 1) % g.OPEN + 1;
    else o += cnt[b];
    new_b[3 * b] = st;
    new_b[3 * b + 1] = en + cnt[b];
    new_b[3 * b + 2] = static_cast<int32_t>(en + cnt[b] - o);
  }
  copy_if(ids->untyped_data(), ids_in.untyped_data(), ids_in.size_bytes());
  copy_if(offsets->untyped_data(), off_in.untyped_data(), off_in.size_bytes());
  copy_if(open->untyped_data(), open_in.untyped_data(), open_in.size_bytes());
  std::memcpy(bounds->typed_data(), new_b.data(), 3 * g.B * sizeof(int32_t));
  uint16_t* ids_p = ids->typed_data();
  uint16_t* off_p = offsets->typed_data();
  uint16_t* open_p = open->typed_data();
  const uint32_t* codes_p = codes.typed_data();
  return RunParallel(pool, g.B * g.Hkv, max_threads,
                     [=](int64_t bh) -> ffi::Error {
                       const int64_t b = bh / g.Hkv;
                       int64_t se = old_b[3 * b + 2];
                       int64_t o = old_b[3 * b + 1] - se;
                       uint16_t* ob = open_p + bh * g.L * g.OPEN;
                       uint16_t* idb = ids_p + bh * g.NC * g.L * g.CH;
                       uint16_t* offb = off_p + bh * g.NC * g.L * g.NB;
                       std::vector<uint32_t> scratch;
                       for (int64_t i = 0; i < cnt[b]; ++i) {
                         if (o == g.OPEN) {
                           if (auto e = MergeOpen(g, old_b[3 * b], se, o, ob, idb, offb, scratch); !e.success()) {
                             return e;
                           }
                           se += o;
                           o = 0;
                         }
                         const uint32_t* ci = codes_p + (bh * T + i) * g.L;
                         for (int64_t l = 0; l < g.L; ++l) ob[l * g.OPEN + o] = static_cast<uint16_t>(ci[l]);
                         ++o;
                       }
                       return ffi::Error::Success();
                     });
}

// ---------------------------------------------------------------------------------------------
// 3. Sampled attention.
// ---------------------------------------------------------------------------------------------

// Per-thread scratch. `once` and `twice` are bitsets over the positions of a chunk: a token's
// bit is set in `once` at its first hit and in `twice` at its second. They are cleared (the
// words up to the chunk's token count) at each (query head, chunk) visit: 2 bits per token stay
// in L1 where 16-bit per-token counters would not (a full chunk's 128 KiB).
struct Scratch {
  std::vector<uint64_t> once, twice;
  std::vector<int32_t> cand;     // candidate positions: the sampled keys, then the exact static ones
  std::vector<uint16_t> hits;
  std::vector<float> acc;
  std::vector<float> logit;
  std::vector<float> cosine;    // centered cosine of q and each candidate key
  std::vector<float> kc2;       // squared norm of each sampled candidate's centered key (-1: cosine given)
  std::vector<float> qs;        // the query scaled by a power of two, for the cosine (ScaledQuery)
  std::vector<float> logu;
  std::vector<int32_t> range;   // [L, 2] bucket (start, end) of the chunk being walked
  std::vector<int32_t> walk;    // a chunk's walk: its kept positions, then room for one bucket
};

Scratch& ThreadScratch() {
  thread_local Scratch s;
  return s;
}

// One sampled-attention call: its geometry, its buffers (whole, every row and head) and its
// options. A work item (row b, query head hq) reads its slices of them.
struct AttendArgs {
  Geometry g;
  int64_t Hq = 0, D = 0, Nmax = 0;
  const float* q = nullptr;          // [B, Hq, D]
  const uint32_t* q_codes = nullptr; // [B, Hq, L]
  const void* k = nullptr;           // [B, Hkv, Nmax, D] float32, or bfloat16 as uint16
  const void* v = nullptr;           // as k
  const uint16_t* ids = nullptr;     // [B, Hkv, NC, L, CH]
  const uint16_t* offsets = nullptr; // [B, Hkv, NC, L, 2^K+1]
  const uint16_t* open = nullptr;    // [B, Hkv, L, OPEN]
  const int32_t* bounds = nullptr;   // [B, 3]
  const float* mean = nullptr;       // [B, Hkv, D]
  const int32_t* lengths = nullptr;  // [B]
  int64_t window = 0;                // tail positions left to the caller
  bool sinks = false;                // also attend the sinks [0, start) exactly (else the caller does)
  float softcap = 0.0f;              // logit soft-capping c (SoftCap), 0 for none
  const double* table = nullptr;     // log-u table, T + 1 entries
  int64_t T = 0;
  bool avx2 = false;
  int64_t elem_bytes = 4;            // bytes per K/V element (2 for bfloat16)
  float* out = nullptr;              // [B, Hq, D]
  float* lse = nullptr;              // [B, Hq]
  int32_t* nsamp = nullptr;          // [B, Hq]
  uint8_t* mask = nullptr;           // [B, Hq, Nmax], or null
};

// One bucket's ids [first, last) counted into the bitsets of the chunk at `base` (`once` at a
// token's first hit, `twice` at its second); the positions reaching their second hit whose
// chunk offset lies in [lo_ok, hi_ok) are written to out. Returns how many. Ids at or past
// `filled` (a corrupt index) are skipped. Branch-free: a token reaching its second hit is kept
// by a select, not a branch (a bucket's hits are unpredictable). A function of its own so
// that its few values stay in registers.
inline int64_t WalkBucket(const uint16_t* first, const uint16_t* last, int64_t filled, int64_t lo_ok,
                          int64_t hi_ok, int64_t base, uint64_t* __restrict once, uint64_t* __restrict twice,
                          int32_t* __restrict out) {
  int64_t m = 0;
  for (const uint16_t* p = first; p < last; ++p) {
    const int64_t id = *p;
    if (id >= filled) continue;
    const int64_t w = id >> 6;
    const uint64_t bit = uint64_t{1} << (id & 63);
    const uint64_t o1 = once[w], o2 = twice[w];
    const bool reach = (o1 & ~o2 & bit) != 0;  // the second hit
    twice[w] = o2 | (o1 & bit);
    once[w] = o1 | bit;
    out[m] = static_cast<int32_t>(base + id);
    m += reach & (id >= lo_ok) & (id < hi_ok);
  }
  return m;
}

// Request the K and V rows of the n positions pos into L2 (prefetcht1). Always inlined: the AVX2
// build of AttendCandidates calls it per row (a call from a function of another target is not
// inlined otherwise).
__attribute__((always_inline)) inline void PrefetchRows(const int32_t* pos, int64_t n, int64_t row_bytes,
                                                        const char* kbytes, const char* vbytes) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t off = static_cast<int64_t>(pos[i]) * row_bytes;
    for (int64_t x = 0; x < row_bytes; x += 64) {
      PrefetchL2(kbytes + off + x);
      PrefetchL2(vbytes + off + x);
    }
  }
}

// The sampled keys of (b, h) among the positions [plo, phi) appended to s.cand: tokens of
// [start, min(sealed, len)) that collide with the query codes qc in >= 2 tables of the sorted
// chunks, then those of the open chunk [sealed, min(end, len)). A token's hits are counted over
// all L tables by the one call that owns its position, so splitting a head's positions into
// pieces gives the same sampled set.
ffi::Error CollectSampled(const AttendArgs& a, int64_t b, int64_t h, const uint32_t* qc, int64_t len,
                          int64_t plo, int64_t phi, Scratch& s) {
  const Geometry& g = a.g;
  const int64_t bh = b * g.Hkv + h;
  const int32_t* bnd = a.bounds + 3 * b;
  const int64_t start = std::max<int64_t>(bnd[0], plo), end = bnd[1], sealed = bnd[2];
  uint64_t* once = s.once.data();
  uint64_t* twice = s.twice.data();
  // The K and V rows of this (row, KV head), requested as their tokens are sampled (below).
  const int64_t row_bytes = a.D * a.elem_bytes;
  const char* kbytes = static_cast<const char*>(a.k) + bh * a.Nmax * row_bytes;
  const char* vbytes = static_cast<const char*>(a.v) + bh * a.Nmax * row_bytes;
  // Sealed chunks: one walk over the query's bucket in each table; a token becomes a candidate
  // when its hit count reaches 2.
  const int64_t sealed_hi = std::min({sealed, len, phi});
  for (int64_t c = 0; c < g.NC; ++c) {
    if (c * g.CH >= sealed_hi || (c + 1) * g.CH <= start) continue;
    const uint16_t* offc = a.offsets + (bh * g.NC + c) * g.L * g.NB;
    const uint16_t* idc = a.ids + (bh * g.NC + c) * g.L * g.CH;
    const int64_t base = c * g.CH;
    // The chunk's ids are positions below the sealed end: ids at or past it would be a corrupt
    // index, skipped, never a read past the bitsets.
    const int64_t filled = std::min<int64_t>(g.CH, sealed - base);
    const int64_t words = (filled + 63) / 64;
    std::fill(once, once + words, uint64_t{0});
    std::fill(twice, twice + words, uint64_t{0});
    const int64_t lo_ok = std::max<int64_t>(start - base, 0), hi_ok = std::min<int64_t>(sealed_hi - base, g.CH);
    // A piece that owns only part of the chunk walks only its ids: a bucket lists its ids in
    // ascending order (build sorts positions stably, append adds larger positions at the end).
    const bool part = plo > base || phi < base + g.CH;
    // The walk writes each id of a bucket before it knows whether the id is kept, so the list
    // has room for the kept ones (at most one per token of the chunk) plus one whole bucket.
    if (static_cast<int64_t>(s.walk.size()) < filled + g.CH) s.walk.resize(filled + g.CH);
    int32_t* const list = s.walk.data();
    int32_t* rng = s.range.data();
    // The L buckets sit at random places in memory, each behind its two offsets: a chain of two
    // misses per table. The walk is a pipeline over the tables: table l's offsets are requested
    // kOffsetsAhead tables before its walk, read (and its first id lines requested)
    // kIdsAhead tables before it, so that a bounded number of misses is always in flight and
    // the lines requested are still in L1 when the walk reaches them. (Requesting all L first
    // stalled on the requests themselves once the miss buffers were full, and at L = 450 the
    // first buckets' lines could leave L1 before their walk.)
    int64_t next_off = 0, next_rng = 0, m_all = 0;
    for (int64_t l = 0; l < g.L; ++l) {
      for (const int64_t to = std::min(g.L, l + kOffsetsAhead); next_off < to; ++next_off) {
        PrefetchL1(offc + next_off * g.NB + qc[next_off]);
      }
      for (const int64_t to = std::min(g.L, l + kIdsAhead + 1); next_rng < to; ++next_rng) {
        const uint16_t* off = offc + next_rng * g.NB;
        const int64_t lo = off[qc[next_rng]], hi = off[qc[next_rng] + 1];
        if (!(lo <= hi && hi <= g.CH)) {  // a range past the chunk is a corrupt index
          return InvalidArg("corrupt index offsets (row " + std::to_string(b) + ", KV head " +
                            std::to_string(h) + ", chunk " + std::to_string(c) + ")");
        }
        rng[2 * next_rng] = static_cast<int32_t>(lo);
        rng[2 * next_rng + 1] = static_cast<int32_t>(hi);
        const uint16_t* first = idc + next_rng * g.CH + lo;
        PrefetchL1(first);
        if (hi - lo > 32) PrefetchL1(first + 32);
      }
      const uint16_t* lst = idc + l * g.CH;
      int64_t j0 = rng[2 * l], j1 = rng[2 * l + 1];
      // A long bucket is cut to the piece's ids by binary search; a short one is walked whole
      // (WalkBucket counts the ids outside the piece but keeps none of them), which costs
      // less than the two searches.
      if (part && j1 - j0 > kSearchBucket) {
        auto below = [](uint16_t id, int64_t bound) { return int64_t{id} < bound; };
        j0 = std::lower_bound(lst + j0, lst + j1, lo_ok, below) - lst;
        j1 = std::lower_bound(lst + j0, lst + j1, hi_ok, below) - lst;
      }
      int32_t* out = list + m_all;
      const int64_t m = WalkBucket(lst + j0, lst + j1, filled, lo_ok, hi_ok, base, once, twice, out);
      m_all += m;
      // Request this bucket's new candidates' K and V rows into L2 now (prefetcht1), so that
      // their reads from memory overlap the rest of the walk, which needs only the bitsets (L1)
      // and the bucket lists; the attention then finds them in cache (a head at 128K samples
      // about 2K rows, 1 MiB of K and V in bfloat16, within the L2). A/B in docs/host_op.md.
      PrefetchRows(out, m, row_bytes, kbytes, vbytes);
    }
    s.cand.insert(s.cand.end(), list, list + m_all);
  }
  // Open chunk: linear scan of the codes of its positions [o0, o1) in the piece.
  const int64_t o0 = std::max(sealed, plo);
  const int64_t n_open = std::max<int64_t>(0, std::min({end, len, phi}) - o0);
  if (n_open > 0) {
    if (static_cast<int64_t>(s.hits.size()) < n_open) s.hits.resize(n_open);
    const uint16_t* ob = a.open + bh * g.L * g.OPEN + (o0 - sealed);
#ifdef MAGICPIG_HAVE_AVX2_PATH
    if (a.avx2) {
      OpenHitsAvx2(ob, g.L, g.OPEN, n_open, qc, s.hits.data());
    } else
#endif
    {
      OpenHitsScalar(ob, g.L, g.OPEN, n_open, qc, s.hits.data());
    }
    for (int64_t i = 0; i < n_open; ++i) {
      if (s.hits[i] >= 2) s.cand.push_back(static_cast<int32_t>(o0 + i));
    }
  }
  return ffi::Error::Success();
}

// Softmax attention of query q over the candidate rows s.cand of kb/vb: o [D] and *lse; o = 0,
// *lse = -inf when the sum is not positive. The first n_sampled candidates are sampled (logit
// q.k/sqrt(D) - log u), the rest exact static keys (logit q.k/sqrt(D)).
//
// One pass in blocks of kBlock candidates (an online softmax): a block's K rows give its logits
// and log u, then its V rows, requested with the K rows and still in L1/L2, are summed with the
// running maximum. Two passes over all the candidates read every V row twice from memory once
// they outgrow the L2 (a head at 128K samples about 2K rows: 1 MiB of K and V in bfloat16).
//
// AttendCandidates is in attend_candidates.inc, built twice: plain (the scalar kernels) and with
// AVX2 and FMA enabled, so that the AVX2 kernels inline into its loop over the candidates.
constexpr int64_t kBlock = 32;  // a multiple of 8: the AVX2 log u takes the same 8-lane groups

namespace candidates_scalar {
#define MAGICPIG_CANDIDATES_FN
#define MAGICPIG_CANDIDATES_AVX2 0
#include "attend_candidates.inc"
#undef MAGICPIG_CANDIDATES_AVX2
#undef MAGICPIG_CANDIDATES_FN
}  // namespace candidates_scalar
#ifdef MAGICPIG_HAVE_AVX2_PATH
namespace candidates_avx2 {
#define MAGICPIG_CANDIDATES_FN __attribute__((target("avx2,fma")))
#define MAGICPIG_CANDIDATES_AVX2 1
#include "attend_candidates.inc"
#undef MAGICPIG_CANDIDATES_AVX2
#undef MAGICPIG_CANDIDATES_FN
}  // namespace candidates_avx2
#endif

// Work item (row b, query head hq, positions [plo, phi)): the sampled keys, the unhashed keys the
// caller's window does not cover (exact), then attention over them, into o [D], *lse and *nsamp.
// T is float (float32 K/V) or uint16_t (bf16). The whole head is the piece [0, Nmax).
template <typename T>
ffi::Error AttendPiece(const AttendArgs& a, int64_t b, int64_t hq, int64_t plo, int64_t phi, float* o,
                       float* lse, int32_t* nsamp) {
  const Geometry& g = a.g;
  const int64_t G = a.Hq / g.Hkv;
  const int64_t h = hq / G;
  const int64_t bh = b * g.Hkv + h;
  const int64_t item = b * a.Hq + hq;
  const uint32_t* qc = a.q_codes + item * g.L;
  const int64_t len = std::min<int64_t>(std::max<int32_t>(a.lengths[b], 0), a.Nmax);
  const int64_t start = a.bounds[3 * b], end = a.bounds[3 * b + 1];
  const int64_t nb = g.NB - 1;
  for (int64_t l = 0; l < g.L; ++l) {
    if (qc[l] >= static_cast<uint64_t>(nb)) {
      return InvalidArg("query code " + std::to_string(qc[l]) + " does not fit in K=" + std::to_string(g.K) +
                        " bits");
    }
  }
  Scratch& s = ThreadScratch();
  if (static_cast<int64_t>(s.once.size()) * 64 < g.CH) {
    s.once.assign((g.CH + 63) / 64, 0);
    s.twice.assign((g.CH + 63) / 64, 0);
  }
  if (static_cast<int64_t>(s.range.size()) < 2 * g.L) s.range.resize(2 * g.L);
  s.cand.clear();
  if (auto e = CollectSampled(a, b, h, qc, len, plo, phi, s); !e.success()) return e;
  const int32_t n_sampled = static_cast<int32_t>(s.cand.size());
  // The sinks, when the caller leaves them to the op: exact.
  if (a.sinks) {
    for (int64_t pos = std::max<int64_t>(plo, 0); pos < std::min({start, len, phi}); ++pos) {
      s.cand.push_back(static_cast<int32_t>(pos));
    }
  }
  // Unhashed keys past the index that the JAX static window does not cover: exact.
  const int64_t over_hi = std::min({std::max(end, len - std::max<int64_t>(a.window, 0)), len, phi});
  for (int64_t pos = std::max({end, start, plo}); pos < over_hi; ++pos) {
    s.cand.push_back(static_cast<int32_t>(pos));
  }
  if (a.mask != nullptr) {
    uint8_t* mrow = a.mask + item * a.Nmax;
    std::memset(mrow + plo, 0, phi - plo);
    for (int32_t i = 0; i < n_sampled; ++i) mrow[s.cand[i]] = 1;
  }
  *nsamp = n_sampled;
  if (s.cand.empty()) {
    std::fill(o, o + a.D, 0.0f);
    *lse = -INFINITY;
    return ffi::Error::Success();
  }
  const T* kb = static_cast<const T*>(a.k) + bh * a.Nmax * a.D;
  const T* vb = static_cast<const T*>(a.v) + bh * a.Nmax * a.D;
#ifdef MAGICPIG_HAVE_AVX2_PATH
  if (a.avx2) {
    candidates_avx2::AttendCandidates<T>(a, a.q + item * a.D, a.mean + bh * a.D, kb, vb, n_sampled, s, o, lse);
  } else
#endif
  {
    candidates_scalar::AttendCandidates<T>(a, a.q + item * a.D, a.mean + bh * a.D, kb, vb, n_sampled, s, o, lse);
  }
  return ffi::Error::Success();
}

// A non-finite key in a head's hashed range makes its mean non-finite and every centered key's
// code 0, so the sampled part would be silently wrong; a non-finite query has no code (a NaN
// projection gives bit 0) and samples keys by chance, or none, which would read as an empty row
// when the static set is empty. Either way the head's out and lse become NaN, as
// magicpig_attention (the pure-JAX reference) gives.
void NanIfNotFinite(const AttendArgs& a, int64_t item, float* o, float* lse) {
  const int64_t b = item / a.Hq, h = (item % a.Hq) / (a.Hq / a.g.Hkv);
  const float* m = a.mean + (b * a.g.Hkv + h) * a.D;
  const float* q = a.q + item * a.D;
  for (int64_t d = 0; d < a.D; ++d) {
    if (!std::isfinite(m[d]) || !std::isfinite(q[d])) {
      magicpig::Poison(o, a.D, lse);
      return;
    }
  }
}

// How the B*Hq heads become work items: one item per head when there are at least as many
// heads as threads (dynamic scheduling leaves at most one head of imbalance); else every head
// in P pieces of its positions (P >= 2, each at least kMinPiece positions), so that the pieces
// spread over all the threads. A piece walks its head's L buckets again (each table's offsets,
// and every id of a short bucket), so splitting heads that could run whole costs more than it
// balances (docs/benchmarks.md, "Splitting heads").
constexpr int64_t kMinPiece = 1024;

struct HeadSplit {
  int64_t whole = 0;  // heads [0, whole) are single items
  int64_t P = 1;      // pieces of each head in [whole, heads)
};

HeadSplit SplitHeads(int64_t heads, int64_t threads, int64_t max_len) {
  if (threads <= 1 || heads <= 0 || heads >= threads) return {heads, 1};
  const int64_t P = std::min(threads / std::gcd(heads, threads), max_len / kMinPiece);
  if (P < 2) return {heads, 1};
  return {0, P};
}

// The LSE merge of a head's P pieces: out = sum_p exp(lse_p - lse) o_p, lse = log sum_p exp(lse_p);
// out 0 and lse -inf when every piece is empty; NaN when a piece is NaN (a non-finite key).
void MergePieces(int64_t P, int64_t D, const float* o, const float* lse, const int32_t* ns, float* out,
                 float* out_lse, int32_t* out_ns) {
  float mx = -INFINITY;
  int32_t n = 0;
  bool nan = false;
  for (int64_t p = 0; p < P; ++p) {
    mx = std::max(mx, lse[p]);
    n += ns[p];
    nan |= std::isnan(lse[p]);
  }
  *out_ns = n;
  if (nan) {
    magicpig::Poison(out, D, out_lse);
    return;
  }
  std::fill(out, out + D, 0.0f);
  if (!std::isfinite(mx)) {
    *out_lse = -INFINITY;
    return;
  }
  double tot = 0.0;
  for (int64_t p = 0; p < P; ++p) {
    if (!std::isfinite(lse[p])) continue;
    const float w = std::exp(lse[p] - mx);
    tot += w;
    for (int64_t d = 0; d < D; ++d) out[d] += w * o[p * D + d];
  }
  const float inv = static_cast<float>(1.0 / tot);
  for (int64_t d = 0; d < D; ++d) out[d] *= inv;
  *out_lse = mx + static_cast<float>(std::log(tot));
}

ffi::Future AttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::U32> q_codes,
                          ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::U16> ids,
                          ffi::Buffer<ffi::U16> offsets, ffi::Buffer<ffi::U16> open,
                          ffi::Buffer<ffi::S32> bounds, ffi::Buffer<ffi::F32> mean,
                          ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::U32> table,
                          ffi::Result<ffi::Buffer<ffi::F32>> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                          ffi::Result<ffi::Buffer<ffi::S32>> nsamp, ffi::Result<ffi::Buffer<ffi::U8>> mask,
                          int64_t K, int64_t window, int64_t sinks, int64_t impl, int64_t max_threads,
                          float softcap) {
  Geometry g;
  if (auto e = IndexGeometry(K, ids.dimensions(), offsets.dimensions(), open.dimensions(),
                             bounds.dimensions(), &g);
      !e.success()) {
    return ReadyFuture(e);
  }
  auto qd = q.dimensions();
  if (qd.size() != 3 || qd[0] != g.B) {
    return ReadyFuture(InvalidArg("q must be float32 [B, Hq, D] with B=" + std::to_string(g.B) + ", got " +
                                  Shape(qd)));
  }
  const int64_t Hq = qd[1], D = qd[2];
  if (Hq < 1 || Hq % g.Hkv != 0) {
    return ReadyFuture(InvalidArg("Hq (" + std::to_string(Hq) + ") must be a positive multiple of Hkv (" +
                                  std::to_string(g.Hkv) + ")"));
  }
  auto qcd = q_codes.dimensions();
  if (qcd.size() != 3 || qcd[0] != g.B || qcd[1] != Hq || qcd[2] != g.L) {
    return ReadyFuture(InvalidArg("q_codes must be uint32 [B, Hq, L], got " + Shape(qcd)));
  }
  auto kd = k.dimensions();
  if (kd.size() != 4 || kd[0] != g.B || kd[1] != g.Hkv || kd[3] != D) {
    return ReadyFuture(InvalidArg("k must be [B, Hkv, Nmax, D] = [" + std::to_string(g.B) + ", " +
                                  std::to_string(g.Hkv) + ", Nmax, " + std::to_string(D) + "], got " +
                                  Shape(kd)));
  }
  const int64_t Nmax = kd[2];
  auto vd = v.dimensions();
  if (vd.size() != 4 || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2] || vd[3] != kd[3]) {
    return ReadyFuture(InvalidArg("v must have the shape of k " + Shape(kd) + ", got " + Shape(vd)));
  }
  if (k.element_type() != v.element_type() ||
      (k.element_type() != ffi::F32 && k.element_type() != ffi::BF16)) {
    return ReadyFuture(InvalidArg("k and v must both be float32 or both bfloat16"));
  }
  auto md = mean.dimensions();
  if (md.size() != 3 || md[0] != g.B || md[1] != g.Hkv || md[2] != D) {
    return ReadyFuture(InvalidArg("mean must be float32 [B, Hkv, D], got " + Shape(md)));
  }
  if (lengths.dimensions().size() != 1 || lengths.dimensions()[0] != g.B) {
    return ReadyFuture(InvalidArg("lengths must be int32 [B], got " + Shape(lengths.dimensions())));
  }
  int64_t TT = 0;
  if (auto e = CheckTable(table, &TT); !e.success()) return ReadyFuture(e);
  auto od = out->dimensions();
  if (od.size() != 3 || od[0] != g.B || od[1] != Hq || od[2] != D || lse->element_count() != size_t(g.B * Hq) ||
      nsamp->element_count() != size_t(g.B * Hq)) {
    return ReadyFuture(InvalidArg("outputs must be out [B, Hq, D], lse [B, Hq], num_sampled [B, Hq]"));
  }
  const bool want_mask = mask->element_count() != 0;
  if (want_mask && mask->element_count() != size_t(g.B * Hq * Nmax)) {
    return ReadyFuture(InvalidArg("mask output must be uint8 [B, Hq, Nmax] or empty"));
  }
  for (int64_t b = 0; b < g.B; ++b) {
    const int32_t* bd = bounds.typed_data() + 3 * b;
    if (auto e = CheckBounds(g, b, bd[0], bd[1], bd[2]); !e.success()) return ReadyFuture(e);
  }
  if (impl < 0 || impl > 2) return ReadyFuture(InvalidArg("impl must be 0 (auto), 1 (scalar) or 2 (avx2)"));
  if (impl == 2 && !CpuHasAvx2()) return ReadyFuture(InvalidArg("impl=avx2 requested but the CPU lacks AVX2/FMA"));
  if (auto e = CheckSoftcap(softcap); !e.success()) return ReadyFuture(e);
  const bool avx2 = (impl == 0 || impl == 2) && CpuHasAvx2();
  const bool bf16 = k.element_type() == ffi::BF16;
  AttendArgs a;
  a.g = g;
  a.Hq = Hq;
  a.D = D;
  a.Nmax = Nmax;
  a.q = q.typed_data();
  a.q_codes = q_codes.typed_data();
  a.k = k.untyped_data();
  a.v = v.untyped_data();
  a.ids = ids.typed_data();
  a.offsets = offsets.typed_data();
  a.open = open.typed_data();
  a.bounds = bounds.typed_data();
  a.mean = mean.typed_data();
  a.lengths = lengths.typed_data();
  a.window = window;
  a.sinks = sinks != 0;
  a.softcap = softcap;
  a.table = reinterpret_cast<const double*>(table.untyped_data());
  a.T = TT;
  a.avx2 = avx2;
  a.elem_bytes = bf16 ? 2 : 4;
  a.out = out->typed_data();
  a.lse = lse->typed_data();
  a.nsamp = nsamp->typed_data();
  a.mask = want_mask ? mask->typed_data() : nullptr;
  const int64_t heads = g.B * Hq;
  int64_t threads = pool.num_threads();
  if (max_threads > 0) threads = std::min(threads, max_threads);
  int64_t max_len = 0;
  for (int64_t b = 0; b < g.B; ++b) {
    max_len = std::max<int64_t>(max_len, std::clamp<int64_t>(a.lengths[b], 0, Nmax));
  }
  const HeadSplit split = SplitHeads(heads, threads, max_len);
  const int64_t whole = split.whole, P = split.P, rest = heads - whole;
  // The pieces' partial results; the worker that finishes a head's last piece merges them.
  struct Pieces {
    std::vector<float> o, lse;
    std::vector<int32_t> ns;
    std::unique_ptr<std::atomic<int64_t>[]> done;
  };
  auto pc = std::make_shared<Pieces>();
  pc->o.assign(rest * P * D, 0.0f);
  pc->lse.assign(rest * P, -INFINITY);
  pc->ns.assign(rest * P, 0);
  pc->done.reset(new std::atomic<int64_t>[std::max<int64_t>(rest, 1)]);
  for (int64_t i = 0; i < rest; ++i) pc->done[i].store(0, std::memory_order_relaxed);
  return RunParallel(pool, whole + rest * P, max_threads, [a, bf16, pc, whole, P](int64_t w) -> ffi::Error {
    if (w < whole) {  // a whole head
      const int64_t b = w / a.Hq, hq = w % a.Hq;
      float* o = a.out + w * a.D;
      ffi::Error e = bf16 ? AttendPiece<uint16_t>(a, b, hq, 0, a.Nmax, o, a.lse + w, a.nsamp + w)
                          : AttendPiece<float>(a, b, hq, 0, a.Nmax, o, a.lse + w, a.nsamp + w);
      if (e.success()) NanIfNotFinite(a, w, o, a.lse + w);
      return e;
    }
    // Piece p of head `item`: [0, len) split evenly, the last piece up to Nmax.
    const int64_t k = w - whole, r = k / P, p = k % P, item = whole + r;
    const int64_t b = item / a.Hq, hq = item % a.Hq;
    const int64_t len = std::clamp<int64_t>(a.lengths[b], 0, a.Nmax);
    const int64_t plo = len * p / P, phi = p + 1 == P ? a.Nmax : len * (p + 1) / P;
    float* o = pc->o.data() + k * a.D;
    ffi::Error e = bf16 ? AttendPiece<uint16_t>(a, b, hq, plo, phi, o, &pc->lse[k], &pc->ns[k])
                        : AttendPiece<float>(a, b, hq, plo, phi, o, &pc->lse[k], &pc->ns[k]);
    if (!e.success()) return e;
    if (pc->done[r].fetch_add(1, std::memory_order_acq_rel) == P - 1) {
      MergePieces(P, a.D, pc->o.data() + r * P * a.D, pc->lse.data() + r * P, pc->ns.data() + r * P,
                  a.out + item * a.D, a.lse + item, a.nsamp + item);
      NanIfNotFinite(a, item, a.out + item * a.D, a.lse + item);
    }
    return ffi::Error::Success();
  });
}

// Test hook: log u of the given cosines through the same interpolation as the attention kernel.
ffi::Error LogUImpl(ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::U32> table,
                    ffi::Result<ffi::Buffer<ffi::F32>> out, int64_t K, int64_t impl) {
  if (auto e = CheckK(K); !e.success()) return e;
  int64_t TT = 0;
  if (auto e = CheckTable(table, &TT); !e.success()) return e;
  if (out->element_count() != cos.element_count()) return InvalidArg("log_u output size mismatch");
  if (impl < 0 || impl > 2) return InvalidArg("impl must be 0 (auto), 1 (scalar) or 2 (avx2)");
  if (impl == 2 && !CpuHasAvx2()) return InvalidArg("impl=avx2 requested but the CPU lacks AVX2/FMA");
  const double* tab = reinterpret_cast<const double*>(table.untyped_data());
  const float* c = cos.typed_data();
  float* o = out->typed_data();
  const int64_t n = static_cast<int64_t>(cos.element_count());
#ifdef MAGICPIG_HAVE_AVX2_PATH
  if (impl != 1 && CpuHasAvx2()) {
    LogUBatchAvx2(c, n, static_cast<int>(K), tab, TT, o);
    return ffi::Error::Success();
  }
#endif
  for (int64_t i = 0; i < n; ++i) o[i] = LogU(c[i], static_cast<int>(K), tab, TT);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MagicpigBuild, BuildImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::U16>>()
                                  .Ret<ffi::Buffer<ffi::U16>>()
                                  .Ret<ffi::Buffer<ffi::U16>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("K")
                                  .Attr<int64_t>("max_threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MagicpigAppend, AppendImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::U16>>()
                                  .Ret<ffi::Buffer<ffi::U16>>()
                                  .Ret<ffi::Buffer<ffi::U16>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("K")
                                  .Attr<int64_t>("max_threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MagicpigAttention, AttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Attr<int64_t>("K")
                                  .Attr<int64_t>("window")
                                  .Attr<int64_t>("sinks")
                                  .Attr<int64_t>("impl")
                                  .Attr<int64_t>("max_threads")
                                  .Attr<float>("softcap"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MagicpigLogU, LogUImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("K")
                                  .Attr<int64_t>("impl"));
