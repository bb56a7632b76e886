// Exact (dense) decode attention over the host KV cache (XLA FFI, CPU).
//
// MagicPIG keeps a few layers dense (arXiv 2410.16179, Section 5: layers 0 and 16 of
// Llama-3.1-8B; here {0, num_layers // 2}). With the KV cache in host memory those layers
// read every cached key once per step, so their cost is the bytes of K and V. This op
// computes o = softmax(q K^T / sqrt(D)) V for the G query heads of each KV head in one pass
// over its keys (each K and V row is read once for the G heads, as in flash decoding), with
// the online softmax of Milakov & Gimelshein (2018) over blocks of keys. It equals
// magicpig_jax.attention.dense_attention up to float32 summation order.
//
// Operands: q float32 [B, Hq, D]; k, v float32 or bfloat16 [B, Hkv, N, D]; lengths int32 [B]
// (valid keys per row, clipped to [0, N]); starts int32 [B] (the first valid key per row,
// clipped to [0, lengths]: a sliding-window layer's window start, 0 otherwise). Results: out float32 [B, Hq, D] and lse float32
// [B, Hq] (natural log); a row with no valid key gives out = 0 and lse = -inf. A NaN or +inf
// logit (a non-finite q or k) gives out and lse NaN for the head: corrupt input is never read as
// an empty row (it used to be, silently).
// Every shape is validated; bad input returns an ffi::Error (never a crash or a stray read).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <cstdint>
#include <cstring>
#include <string>
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
using magicpig::PrefetchStream;
using magicpig::InvalidArg;
using magicpig::Load;
using magicpig::ReadyFuture;
using magicpig::RunParallel;
using magicpig::Shape;
using magicpig::SoftCap;
using magicpig::SoftCapInPlace;
using magicpig::CheckSoftcap;

constexpr int64_t kBlock = 128;   // keys per online-softmax block
constexpr int64_t kSpan = 2048;   // keys per work item when there are enough of them
constexpr int64_t kMinSpan = 256;  // the fewest keys per work item
constexpr int64_t kAheadRows = 32;  // K/V rows requested ahead of use
constexpr int64_t kMaxG = 64;    // query heads per KV head

template <typename T>
float DotScalar(const float* q, const T* k, int64_t D) {
  float s = 0.f;
  for (int64_t d = 0; d < D; ++d) s += q[d] * Load(k, d);
  return s;
}

// x[j] *= scale for j < n; returns the largest x[j] (NaNs ignored; -inf when there is none) and
// sets *nan when some x[j] is NaN.
inline float ScaleMaxScalar(float* x, int64_t n, float scale, bool* nan) {
  float m = -INFINITY;
  bool seen = false;  // a local flag: no store through the pointer per element
  for (int64_t j = 0; j < n; ++j) {
    const float y = x[j] * scale;
    x[j] = y;
    m = m < y ? y : m;
    seen |= y != y;
  }
  *nan |= seen;
  return m;
}

#ifdef MAGICPIG_HAVE_AVX2_PATH
using magicpig::Hsum;
using magicpig::Dot8Avx2;
using magicpig::Load8;

__attribute__((target("avx2,fma"))) float ScaleMaxAvx2(float* x, int64_t n, float scale, bool* nan) {
  const __m256 sv = _mm256_set1_ps(scale);
  __m256 mv = _mm256_set1_ps(-INFINITY);
  __m256 nv = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 y = _mm256_mul_ps(_mm256_loadu_ps(x + j), sv);
    _mm256_storeu_ps(x + j, y);
    mv = _mm256_max_ps(y, mv);  // the second operand is kept when either is NaN
    nv = _mm256_or_ps(nv, _mm256_cmp_ps(y, y, _CMP_UNORD_Q));
  }
  *nan |= _mm256_movemask_ps(nv) != 0;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mv);
  _mm256_zeroupper();
  float m = ScaleMaxScalar(x + j, n - j, scale, nan);
  for (float l : lanes) m = m < l ? l : m;
  return m;
}

template <typename T>
__attribute__((target("avx2,fma"))) float DotAvx2(const float* q, const T* k, int64_t D) {
  __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), Load8(k + d), a);
    b = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), Load8(k + d + 8), b);
  }
  for (; d + 8 <= D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), Load8(k + d), a);
  float s = Hsum(_mm256_add_ps(a, b));
  for (; d < D; ++d) s += q[d] * Load(k, d);
  _mm256_zeroupper();
  return s;
}

// acc[0:D] += sum_j e[j] * v[j, 0:D] over n rows, 32 columns at a time in registers.
template <typename T>
__attribute__((target("avx2,fma"))) void AccumulateAvx2(const float* e, const T* v, int64_t n, int64_t D,
                                                        float* acc) {
  int64_t d = 0;
  for (; d + 32 <= D; d += 32) {
    __m256 a0 = _mm256_loadu_ps(acc + d), a1 = _mm256_loadu_ps(acc + d + 8);
    __m256 a2 = _mm256_loadu_ps(acc + d + 16), a3 = _mm256_loadu_ps(acc + d + 24);
    for (int64_t j = 0; j < n; ++j) {
      const __m256 w = _mm256_set1_ps(e[j]);
      const T* r = v + j * D + d;
      a0 = _mm256_fmadd_ps(w, Load8(r), a0);
      a1 = _mm256_fmadd_ps(w, Load8(r + 8), a1);
      a2 = _mm256_fmadd_ps(w, Load8(r + 16), a2);
      a3 = _mm256_fmadd_ps(w, Load8(r + 24), a3);
    }
    _mm256_storeu_ps(acc + d, a0);
    _mm256_storeu_ps(acc + d + 8, a1);
    _mm256_storeu_ps(acc + d + 16, a2);
    _mm256_storeu_ps(acc + d + 24, a3);
  }
  for (; d + 8 <= D; d += 8) {
    __m256 a0 = _mm256_loadu_ps(acc + d);
    for (int64_t j = 0; j < n; ++j) a0 = _mm256_fmadd_ps(_mm256_set1_ps(e[j]), Load8(v + j * D + d), a0);
    _mm256_storeu_ps(acc + d, a0);
  }
  for (; d < D; ++d) {
    float a = acc[d];
    for (int64_t j = 0; j < n; ++j) a += e[j] * Load(v, j * D + d);
    acc[d] = a;
  }
  _mm256_zeroupper();
}

// e[j] = exp(x[j] - m) for j < n (in place).
__attribute__((target("avx2,fma"))) void ExpShiftAvx2(float* x, int64_t n, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(x + j, Exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), mv)));
  for (; j < n; ++j) x[j] = std::exp(x[j] - m);
  _mm256_zeroupper();
}
#endif  // MAGICPIG_HAVE_AVX2_PATH

// Partial softmax of the G query heads q [G, D] over n consecutive key rows k, v [n, D]:
// m[g] the max logit, sum[g] = sum_j exp(logit_j - m[g]), acc[g] = sum_j exp(logit_j - m[g]) v_j
// (acc zeroed and m = -inf on entry). Online softmax over blocks of kBlock keys.
template <typename T>
void PartialKvHead(const float* q, const T* k, const T* v, int64_t n, int64_t G, int64_t D, bool avx2,
                   float softcap, float* acc, float* m, double* sum) {
  thread_local std::vector<float> logit;
  logit.resize(G * kBlock);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
    const int64_t nb = std::min(kBlock, n - j0);
    int64_t j = 0;
#ifdef MAGICPIG_HAVE_AVX2_PATH
    if (avx2 && D % 8 == 0) {
      for (; j + 8 <= nb; j += 8) {
        PrefetchStream(k + (j0 + j) * D + kAheadRows * D, k + n * D, 8 * D * sizeof(T));
        for (int64_t g = 0; g < G; ++g) Dot8Avx2(q + g * D, k + (j0 + j) * D, D, &logit[g * kBlock + j]);
      }
    }
#endif
    for (; j < nb; ++j) {
      const T* kr = k + (j0 + j) * D;
      for (int64_t g = 0; g < G; ++g) {
#ifdef MAGICPIG_HAVE_AVX2_PATH
        logit[g * kBlock + j] = avx2 ? DotAvx2(q + g * D, kr, D) : DotScalar(q + g * D, kr, D);
#else
        logit[g * kBlock + j] = DotScalar(q + g * D, kr, D);
#endif
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float* lg = &logit[g * kBlock];
      bool nan = false;
#ifdef MAGICPIG_HAVE_AVX2_PATH
      const float bm_raw = avx2 ? ScaleMaxAvx2(lg, nb, scale, &nan) : ScaleMaxScalar(lg, nb, scale, &nan);
#else
      const float bm_raw = ScaleMaxScalar(lg, nb, scale, &nan);
#endif
      // Soft-capping is monotone: the capped maximum is the maximum's cap (and +inf stays +inf).
      const float bm = softcap > 0.0f ? SoftCap(bm_raw, softcap) : bm_raw;
      if (softcap > 0.0f) SoftCapInPlace(lg, nb, softcap);
      const float nm = m[g] < bm ? bm : m[g];
      if (nan || nm == INFINITY) {  // a NaN or +inf logit (non-finite q or k): poison the sum, the merge gives NaN
        m[g] = 0.0f;
        sum[g] = NAN;
        continue;
      }
      if (!std::isfinite(nm)) continue;  // only -inf logits so far: nothing to rescale
      if (nm > m[g]) {
        const float c = std::isfinite(m[g]) ? std::exp(m[g] - nm) : 0.0f;
        for (int64_t d = 0; d < D; ++d) acc[g * D + d] *= c;
        sum[g] *= c;
        m[g] = nm;
      }
#ifdef MAGICPIG_HAVE_AVX2_PATH
      if (avx2) {
        ExpShiftAvx2(&logit[g * kBlock], nb, nm);
        continue;
      }
#endif
      for (int64_t j = 0; j < nb; ++j) logit[g * kBlock + j] = std::exp(logit[g * kBlock + j] - nm);
    }
    for (int64_t j = 0; j < nb; j += 8) PrefetchStream(v + (j0 + j) * D + kAheadRows * D, v + n * D, 8 * D * sizeof(T));
    for (int64_t g = 0; g < G; ++g) {
      if (!std::isfinite(m[g])) continue;
      const float* e = &logit[g * kBlock];
      double bs = 0.0;
      for (int64_t j = 0; j < nb; ++j) bs += e[j];
      sum[g] += bs;
#ifdef MAGICPIG_HAVE_AVX2_PATH
      if (avx2) {
        AccumulateAvx2(e, v + j0 * D, nb, D, acc + g * D);
        continue;
      }
#endif
      for (int64_t j = 0; j < nb; ++j) AxpyScalar(e[j], v + (j0 + j) * D, acc + g * D, D);
    }
  }
}

// Keys per work item: kSpan, or fewer (down to kMinSpan, a multiple of kBlock) when the KV heads
// of the call would otherwise give fewer than 8 work items per thread, so that one row on two
// cores (or B * Hkv not a multiple of the threads) still keeps every thread busy.
int64_t SpanKeys(int64_t heads, int64_t threads, int64_t max_len) {
  const int64_t want_items = 8 * std::max<int64_t>(1, threads);
  if (threads <= 1 || heads * ((max_len + kSpan - 1) / kSpan) >= want_items) return kSpan;
  const int64_t per_head = (want_items + heads - 1) / heads;     // spans per KV head
  int64_t span = (max_len + per_head - 1) / per_head;
  span = (span + kBlock - 1) / kBlock * kBlock;
  return std::clamp(span, kMinSpan, kSpan);
}

// out[g] = (sum_s w_s acc_s[g]) / (sum_s w_s sum_s[g]), w_s = exp(m_s[g] - max_s m_s[g]), and
// lse[g] = max m + log(total), over the S partials of one KV head; NaN and NaN when a partial is
// poisoned (a NaN or +inf logit); NaN and -inf when the head has keys whose logits are all -inf (a
// -inf in q or in every key: AllMinusInf); else 0 and -inf when it has none.
void MergePartials(int64_t S, int64_t G, int64_t D, const float* acc, const float* m, const double* sum,
                   bool has_keys, float* out, float* lse) {
  for (int64_t g = 0; g < G; ++g) {
    float mx = -INFINITY;
    for (int64_t s = 0; s < S; ++s) mx = std::max(mx, m[s * G + g]);
    double tot = 0.0;
    float* o = out + g * D;
    std::fill(o, o + D, 0.0f);
    if (std::isfinite(mx)) {
      for (int64_t s = 0; s < S; ++s) {
        if (!std::isfinite(m[s * G + g])) continue;  // an empty partial
        const float w = std::exp(m[s * G + g] - mx);
        tot += w * sum[s * G + g];
        const float* a = acc + (s * G + g) * D;
        for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
      }
    }
    if (tot > 0.0 && std::isfinite(tot)) {
      const float inv = static_cast<float>(1.0 / tot);
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
      lse[g] = mx + static_cast<float>(std::log(tot));
    } else if (std::isnan(tot)) {
      magicpig::Poison(o, D, lse + g);
    } else if (has_keys) {
      magicpig::AllMinusInf(o, D, lse + g);
    } else {
      std::fill(o, o + D, 0.0f);
      lse[g] = -INFINITY;
    }
  }
}

ffi::Future ExactAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                               ffi::AnyBuffer v, ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> starts,
                               ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse, int64_t impl,
                               int64_t max_threads, float softcap) {
  const auto qd = q.dimensions();
  if (qd.size() != 3) return ReadyFuture(InvalidArg("q must be float32 [B, Hq, D], got " + Shape(qd)));
  const int64_t B = qd[0], Hq = qd[1], D = qd[2];
  const auto kd = k.dimensions();
  if (kd.size() != 4 || kd[0] != B || kd[3] != D) {
    return ReadyFuture(InvalidArg("k must be [B, Hkv, N, D] with B=" + std::to_string(B) + ", D=" +
                                  std::to_string(D) + ", got " + Shape(kd)));
  }
  const int64_t Hkv = kd[1], N = kd[2];
  const auto vd = v.dimensions();
  if (vd.size() != 4 || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2] || vd[3] != kd[3]) {
    return ReadyFuture(InvalidArg("v must have the shape of k " + Shape(kd) + ", got " + Shape(vd)));
  }
  if (k.element_type() != v.element_type() || (k.element_type() != ffi::F32 && k.element_type() != ffi::BF16)) {
    return ReadyFuture(InvalidArg("k and v must both be float32 or both bfloat16"));
  }
  if (Hkv < 1 || Hq % Hkv != 0 || Hq / Hkv > kMaxG) {
    return ReadyFuture(InvalidArg("Hq (" + std::to_string(Hq) + ") must be a multiple of Hkv (" +
                                  std::to_string(Hkv) + ") with G = Hq/Hkv <= " + std::to_string(kMaxG)));
  }
  if (lengths.dimensions().size() != 1 || lengths.dimensions()[0] != B) {
    return ReadyFuture(InvalidArg("lengths must be int32 [B], got " + Shape(lengths.dimensions())));
  }
  if (starts.dimensions().size() != 1 || starts.dimensions()[0] != B) {
    return ReadyFuture(InvalidArg("starts must be int32 [B], got " + Shape(starts.dimensions())));
  }
  const auto od = out->dimensions();
  if (od.size() != 3 || od[0] != B || od[1] != Hq || od[2] != D || lse->element_count() != size_t(B * Hq)) {
    return ReadyFuture(InvalidArg("outputs must be out float32 [B, Hq, D] and lse float32 [B, Hq]"));
  }
  if (impl < 0 || impl > 2) return ReadyFuture(InvalidArg("impl must be 0 (auto), 1 (scalar) or 2 (avx2)"));
  if (impl == 2 && !CpuHasAvx2()) return ReadyFuture(InvalidArg("impl=avx2 requested but the CPU lacks AVX2/FMA"));
  if (auto e = CheckSoftcap(softcap); !e.success()) return ReadyFuture(e);
  if (B == 0 || Hq == 0) return ReadyFuture(ffi::Error::Success());
  const bool avx2 = impl != 1 && CpuHasAvx2();
  const bool bf16 = k.element_type() == ffi::BF16;
  const int64_t G = Hq / Hkv;
  const float* qp = q.typed_data();
  const void* kp = k.untyped_data();
  const void* vp = v.untyped_data();
  const int32_t* lp = lengths.typed_data();
  const int32_t* sp = starts.typed_data();
  float* op = out->typed_data();
  float* lp_out = lse->typed_data();
  // Work items: (KV head, span of keys), so that a few KV heads still fill the pool; the worker
  // that finishes the last item merges the partials (before the op's future completes).
  const int64_t heads = B * Hkv;
  int64_t threads = pool.num_threads();
  if (max_threads > 0) threads = std::min(threads, max_threads);
  // Row b's keys are [first, end): end = lengths clipped to [0, N], first = starts clipped to [0, end].
  auto end_of = [=](int64_t b) { return std::clamp<int64_t>(lp[b], 0, N); };
  auto first_of = [=](int64_t b) { return std::clamp<int64_t>(sp[b], 0, end_of(b)); };
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) max_len = std::max<int64_t>(max_len, end_of(b) - first_of(b));
  const int64_t span = SpanKeys(heads, threads, max_len);
  const int64_t S = std::max<int64_t>(1, (max_len + span - 1) / span);
  struct Partials {
    std::vector<float> acc, m;
    std::vector<double> sum;
    std::atomic<int64_t> done{0};
  };
  auto part = std::make_shared<Partials>();
  part->acc.assign(heads * S * G * D, 0.0f);
  part->m.assign(heads * S * G, -INFINITY);
  part->sum.assign(heads * S * G, 0.0);
  const int64_t items = heads * S;
  return RunParallel(pool, items, max_threads, [=](int64_t item) -> ffi::Error {
    const int64_t bh = item / S, s = item % S;
    const int64_t b = bh / Hkv;
    const int64_t n = end_of(b);
    const int64_t j0 = std::min(n, first_of(b) + s * span), j1 = std::min(n, j0 + span);
    const int64_t row = (bh * N + j0) * D;  // key j0 of KV head (b, h) in [B, Hkv, N, D]
    const float* qh = qp + bh * G * D;      // query heads h*G .. h*G+G-1 of row b
    float* acc = part->acc.data() + item * G * D;
    float* m = part->m.data() + item * G;
    double* sum = part->sum.data() + item * G;
    if (j1 > j0) {
      if (bf16) {
        PartialKvHead(qh, static_cast<const uint16_t*>(kp) + row, static_cast<const uint16_t*>(vp) + row, j1 - j0,
                      G, D, avx2, softcap, acc, m, sum);
      } else {
        PartialKvHead(qh, static_cast<const float*>(kp) + row, static_cast<const float*>(vp) + row, j1 - j0, G, D,
                      avx2, softcap, acc, m, sum);
      }
    }
    if (part->done.fetch_add(1, std::memory_order_acq_rel) == items - 1) {
      for (int64_t h = 0; h < heads; ++h) {
        MergePartials(S, G, D, part->acc.data() + h * S * G * D, part->m.data() + h * S * G,
                      part->sum.data() + h * S * G, end_of(h / Hkv) > first_of(h / Hkv), op + h * G * D,
                      lp_out + h * G);
      }
    }
    return ffi::Error::Success();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MagicpigExactAttention, ExactAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("impl")
                                  .Attr<int64_t>("max_threads")
                                  .Attr<float>("softcap"));
