// Helpers shared by the host-op translation units: error values, the parallel driver over
// XLA's intra-op thread pool, run-time CPU feature checks, and K/V element loads.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#if defined(__x86_64__)
#include <immintrin.h>
#define MAGICPIG_HAVE_AVX2_PATH 1
#endif

#include "xla/ffi/api/ffi.h"

namespace magicpig {

namespace ffi = xla::ffi;

// "[d0, d1, ...]" of a buffer's dimensions, for error messages.
inline std::string Shape(ffi::Span<const int64_t> d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

inline ffi::Error InvalidArg(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "magicpig host op: " + msg);
}

// A score or logit that only a non-finite q or k gives (NaN, +inf).
inline bool Corrupt(float score) { return score != score || score == INFINITY; }

// Gemma 2's attention logit soft-capping (transformers' attn_logit_softcapping): c * tanh(x / c) for a
// finite logit x, x itself for +-inf and NaN (so a non-finite q or k still poisons the head). c > 0.
inline float SoftCap(float x, float c) { return std::isfinite(x) ? c * std::tanh(x / c) : x; }

inline void SoftCapInPlace(float* x, int64_t n, float c) {
  for (int64_t j = 0; j < n; ++j) x[j] = SoftCap(x[j], c);
}

// The softcap attribute: 0 (none) or c in [1e-3, 1e6] (SOFTCAP_RANGE of attention/_common.py: c, x / c
// and c * tanh(x / c) stay normal float32 numbers). "None" is the bits of +0 exactly: XLA's CPU threads
// flush denormals to zero, where a subnormal c compares equal to 0 and the op would run uncapped.
inline ffi::Error CheckSoftcap(float c) {
  uint32_t bits;
  std::memcpy(&bits, &c, sizeof bits);
  if (!(bits == 0u || (c >= 1e-3f && c <= 1e6f))) {
    char shown[32];
    std::snprintf(shown, sizeof shown, "%.9g", static_cast<double>(c));
    return InvalidArg(std::string("softcap must be 0 (none) or in [0.001, 1e6], got ") + shown);
  }
  return ffi::Error::Success();
}

// The result of a head that read a non-finite q or key: out and lse NaN, never a finite or
// empty-looking head (as dense attention gives).
inline void Poison(float* out, int64_t D, float* lse) {
  std::fill(out, out + D, NAN);
  *lse = NAN;
}

// The result of a head with keys whose logits are all -inf (a -inf in q, or in every key): its
// partition function is 0, so its LSE is -inf, and its out is 0/0, NaN. Merged with another part it
// weighs 0 (as those keys do in one softmax over the union); alone, or with only such parts, it is
// NaN, never an empty-looking head (an empty one has out 0 and lse -inf).
inline void AllMinusInf(float* out, int64_t D, float* lse) {
  std::fill(out, out + D, NAN);
  *lse = -INFINITY;
}

// Software prefetches of the cache line holding p: into L1 (prefetcht0) and into L2
// (prefetcht1). Inline asm: GCC 12 dropped __builtin_prefetch calls that sit in lambdas and
// inlined helpers of the sampled attention (none of them was in the built module's
// disassembly), so those lines were never requested. A prefetch never faults.
template <bool kIntoL1>
inline void Prefetch(const void* p) {
#if defined(__x86_64__)
  if constexpr (kIntoL1) {
    asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
  } else {
    asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
  }
#else
  __builtin_prefetch(p, 0, kIntoL1 ? 3 : 2);
#endif
}

inline void PrefetchL1(const void* p) { Prefetch<true>(p); }
inline void PrefetchL2(const void* p) { Prefetch<false>(p); }

// Requests the cache lines of [p, p + bytes) that lie before `end` into L1: a sequential K or V
// stream read a few rows ahead of use (the exact and TopK ops).
template <typename T>
inline void PrefetchStream(const T* p, const T* end, int64_t bytes) {
  const char* c = reinterpret_cast<const char*>(p);
  const char* e = std::min(c + bytes, reinterpret_cast<const char*>(end));
  for (; c < e; c += 64) PrefetchL1(c);
}

// ---------------------------------------------------------------------------------------------
// Parallel driver: split `n` work items over XLA's intra-op pool; never blocks on the tasks it
// schedules (returns a future that completes when the last worker is done).
// ---------------------------------------------------------------------------------------------

inline ffi::Future ReadyFuture(const ffi::Error& err) {
  ffi::Promise promise;
  ffi::Future future(promise);
  if (err.success()) {
    promise.SetAvailable();
  } else {
    promise.SetError(err);
  }
  return future;
}

// Runs work(i) for i in [0, n) on at most max_threads (<= 0: all) threads of `pool`, the
// calling thread included. `work` returns an ffi::Error; the first failure stops the rest.
template <typename Work>
ffi::Future RunParallel(ffi::ThreadPool& pool, int64_t n, int64_t max_threads, Work work) {
  if (n <= 0) return ReadyFuture(ffi::Error::Success());
  int64_t nt = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), n));
  if (max_threads > 0) nt = std::min(nt, max_threads);
  struct Shared {
    explicit Shared(Work w) : work(std::move(w)) {}
    std::atomic<int64_t> next{0};
    Work work;
  };
  auto shared = std::make_shared<Shared>(std::move(work));
  ffi::CountDownPromise promise(nt);
  ffi::Future future(promise);
  auto worker = [shared, promise, n]() mutable {
    ffi::Error err = ffi::Error::Success();
    for (;;) {
      int64_t i = shared->next.fetch_add(1, std::memory_order_relaxed);
      if (i >= n) break;
      ffi::Error e = shared->work(i);
      if (!e.success()) {
        err = e;
        shared->next.store(n, std::memory_order_relaxed);  // stop the others early
        break;
      }
    }
    promise.CountDown(err);
  };
  for (int64_t t = 1; t < nt; ++t) {
    auto copy = worker;
    pool.Schedule(std::move(copy));
  }
  worker();
  return future;
}

// ---------------------------------------------------------------------------------------------
// CPU features, checked at run time (the library is built without -march flags).
// ---------------------------------------------------------------------------------------------

#ifdef MAGICPIG_HAVE_AVX2_PATH
// AVX2 + FMA + F16C (every AVX2 CPU made so far has F16C; it is checked all the same).
inline bool CpuHasAvx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  return has;
}

// exp of 8 floats (Cephes expf: range reduction by ln 2 in two parts, degree-5 polynomial;
// relative error about 2e-7 on [-87, 88]). x < -87.3 gives 0, x > 88.7 gives +inf, NaN stays NaN.
__attribute__((target("avx2,fma"))) inline __m256 Exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.7f), lo = _mm256_set1_ps(-87.3f);
  const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // 2^n (n in [-126, 128]): n = 128 is split as 2^127 * 2 so the exponent never overflows.
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_min_epi32(ni, _mm256_set1_epi32(127));
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, _mm256_set1_epi32(127)), 23));
  const __m256 s2 = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, n1), _mm256_set1_epi32(127)), 23));
  __m256 e = _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
  e = _mm256_blendv_ps(e, _mm256_setzero_ps(), _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
  e = _mm256_blendv_ps(e, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x, hi, _CMP_GT_OQ));
  return _mm256_blendv_ps(e, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));  // NaN in, NaN out
}

__attribute__((target("avx2,fma"), always_inline)) inline float Hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  __m128 sh = _mm_movehdup_ps(lo);
  __m128 s = _mm_add_ps(lo, sh);
  sh = _mm_movehl_ps(sh, s);
  s = _mm_add_ss(s, sh);
  return _mm_cvtss_f32(s);
}
#else
inline bool CpuHasAvx2() { return false; }
#endif

// ---------------------------------------------------------------------------------------------
// K/V row elements: float32, or bfloat16 stored as uint16 (exact widening to float32).
// ---------------------------------------------------------------------------------------------

inline float Bf16ToF32(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline float Load(const float* p, int64_t i) { return p[i]; }
inline float Load(const uint16_t* p, int64_t i) { return Bf16ToF32(p[i]); }

// acc[0:D] += w * v[0:D].
template <typename T>
void AxpyScalar(float w, const T* v, float* acc, int64_t D) {
  for (int64_t d = 0; d < D; ++d) acc[d] += w * Load(v, d);
}

#ifdef MAGICPIG_HAVE_AVX2_PATH
// Eight consecutive elements as float32.
__attribute__((target("avx2,fma"))) inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma"))) inline __m256 Load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Logits of one query q [D] against 8 consecutive key rows k [8, D]: out[j] = q . k[j]
// (D % 8 == 0). Each row is summed in its own 8-lane accumulator, then the eight are
// transpose-reduced (one horizontal sum per 8 rows instead of one per row).
template <typename T>
__attribute__((target("avx2,fma"))) inline void Dot8Avx2(const float* q, const T* k, int64_t D, float* out) {
  // Eight named accumulators (an array of them is kept in memory by GCC, four times slower).
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    const T* kd = k + d;
    a0 = _mm256_fmadd_ps(qv, Load8(kd), a0);
    a1 = _mm256_fmadd_ps(qv, Load8(kd + D), a1);
    a2 = _mm256_fmadd_ps(qv, Load8(kd + 2 * D), a2);
    a3 = _mm256_fmadd_ps(qv, Load8(kd + 3 * D), a3);
    a4 = _mm256_fmadd_ps(qv, Load8(kd + 4 * D), a4);
    a5 = _mm256_fmadd_ps(qv, Load8(kd + 5 * D), a5);
    a6 = _mm256_fmadd_ps(qv, Load8(kd + 6 * D), a6);
    a7 = _mm256_fmadd_ps(qv, Load8(kd + 7 * D), a7);
  }
  // Transpose-reduce: lane j of the result is the sum of aj.
  const __m256 t0 = _mm256_hadd_ps(a0, a1), t1 = _mm256_hadd_ps(a2, a3);
  const __m256 t2 = _mm256_hadd_ps(a4, a5), t3 = _mm256_hadd_ps(a6, a7);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  const __m256 r = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  _mm256_storeu_ps(out, r);
  _mm256_zeroupper();
}

// The logit of one key row k [D] (D % 8 == 0) computed as Dot8Avx2 computes each of its rows: the same
// per-lane fused multiply-adds, then the lanes reduced in the order of its transpose-reduce, so that a
// row scores bit for bit the same in a block of 8 or alone (equal keys then tie exactly, and a
// selection's tie rule holds whatever the blocking or the thread split).
template <typename T>
__attribute__((target("avx2,fma"))) inline float Dot1Avx2As8(const float* q, const T* k, int64_t D) {
  __m256 a = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), Load8(k + d), a);
  alignas(32) float l[8];
  _mm256_store_ps(l, a);
  _mm256_zeroupper();
  return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}
#endif

}  // namespace magicpig
