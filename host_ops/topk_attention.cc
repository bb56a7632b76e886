// Exact TopK decode attention over the host KV cache (XLA FFI, CPU): the baseline MagicPIG is
// compared with (arXiv 2410.16179, Section 3.1), at its best implementation on the host.
//
// TopK must score every key of the range to know its top set, so its cost is the bytes of K of
// the whole range plus the V rows it keeps. Per (row, KV head) this op reads each K row once for
// the G query heads that share it (in spans of keys over the threads when there are few KV heads,
// as the exact op does), then, per query head, keeps the `keep` highest logits with a
// partial selection (a radix select on the logits' rank bits, ties by the smaller position;
// linear, not a sort: selected_attention.h) and attends exactly over them (softmax, V rows
// gathered). It computes the function of magicpig_jax.attention.topk_attention on the range:
// the same kept set (up to the float32 summation order of the logits, which can only matter
// for logits equal to the last bit) and the same output to float32 rounding.
//
// Operands: q float32 [B, Hq, D]; k, v float32 or bfloat16 [B, Hkv, N, D]; start, end int32
// [B] (the range [start, end) of each row, clipped to [0, N]); keep int32 [B] (keys kept per
// query head, clipped to [0, end - start]); context int32 [B] (with_static: the keys [0, start)
// and [end, context) are attended exactly too, in the same softmax: a decoder's sinks and
// unhashed tail, so that no second pass and no merge is needed). Results: out float32
// [B, Hq, D], lse float32 [B, Hq] (natural log); no key gives out = 0, lse = -inf; a NaN or +inf
// logit (a non-finite q or k) gives out and lse NaN for the head.
// Attributes: with_static (0 or 1), impl (0 auto, 1 scalar, 2 avx2), max_threads (0: the pool), softcap
// (float32: 0 for none, or c in [0.001, 1e6]: each kept logit becomes c tanh(logit / c), Gemma 2's attention
// logit soft-capping; the monotone cap leaves the kept set unchanged). Every shape is validated; bad input
// returns an ffi::Error (never a crash or a stray read).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "ffi_util.h"
#include "handlers.h"
#include "selected_attention.h"

namespace ffi = xla::ffi;

namespace {

using magicpig::CpuHasAvx2;
using magicpig::InvalidArg;
using magicpig::PrefetchStream;
using magicpig::ReadyFuture;
using magicpig::RunParallel;
using magicpig::Shape;
namespace sel = magicpig::selected;

constexpr int64_t kMaxG = 64;  // query heads per KV head

// Logits of the G query heads q [G, D] over the keys [s + j0, s + j1) of k [N, D]:
// logit[g * stride + j] for j in [j0, j1). K is read once for the G heads: with AVX2 in blocks of
// 8 rows (Dot8Avx2 per head: one transpose-reduce per 8 rows instead of a horizontal sum per row,
// the block's rows in L1 for the G heads), the rows kAheadRows ahead requested into L1, as the
// exact op reads them; the rows left over one at a time, with the block's arithmetic (Dot1Avx2As8).
constexpr int64_t kAheadRows = 32;

template <typename T>
void ScoreKeys(const float* q, const T* k, int64_t s, int64_t j0, int64_t j1, int64_t G, int64_t D, bool avx2,
               float* logit, int64_t stride) {
  const float sqrt_d = static_cast<float>(std::sqrt(static_cast<double>(D)));
  int64_t j = j0;
#ifdef MAGICPIG_HAVE_AVX2_PATH
  if (avx2 && D % 8 == 0) {
    const T* end = k + (s + j1) * D;
    for (; j + 8 <= j1; j += 8) {
      const T* kr = k + (s + j) * D;
      PrefetchStream(kr + kAheadRows * D, end, 8 * D * static_cast<int64_t>(sizeof(T)));
      for (int64_t g = 0; g < G; ++g) {
        float* lg = logit + g * stride + j;
        magicpig::Dot8Avx2(q + g * D, kr, D, lg);
        for (int i = 0; i < 8; ++i) lg[i] /= sqrt_d;
      }
    }
  }
  if (avx2 && D % 8 == 0) {  // the rows left over, as a block scores them (equal keys tie exactly)
    for (; j < j1; ++j) {
      const T* kr = k + (s + j) * D;
      for (int64_t g = 0; g < G; ++g) logit[g * stride + j] = magicpig::Dot1Avx2As8(q + g * D, kr, D) / sqrt_d;
    }
  }
#endif
  for (; j < j1; ++j) {
    const T* kr = k + (s + j) * D;
    for (int64_t g = 0; g < G; ++g) logit[g * stride + j] = sel::Dot(q + g * D, kr, D, avx2) / sqrt_d;
  }
}

// One query head q [D] with the logits lg [n] of the keys [s, s + n): keeps the `keep` highest
// (partial selection), adds the static keys [0, s) and [s + n, ctx) when ctx > 0, and attends
// exactly over them into out [D] and *lse.
template <typename T>
void SelectAndAttend(const float* q, const float* lg, const T* k, const T* v, int64_t s, int64_t n, int64_t keep,
                     int64_t ctx, int64_t D, bool avx2, float softcap, float* out, float* lse) {
  thread_local std::vector<uint32_t> kept;
  thread_local std::vector<float> kept_logit;
  thread_local std::vector<const T*> kept_rows;
  const float sqrt_d = static_cast<float>(std::sqrt(static_cast<double>(D)));
  bool corrupt = false;  // a key of the range scored NaN or +inf: which keys are the top is undefined
  for (int64_t j = 0; j < n; ++j) corrupt |= sel::Corrupt(lg[j]);
  if (corrupt) {
    sel::Poison(out, D, lse);
    return;
  }
  kept.clear();
  sel::SelectTopPositions(lg, n, keep, kept);
  kept_logit.resize(kept.size());
  kept_rows.resize(kept.size());
  for (size_t i = 0; i < kept.size(); ++i) {
    kept_logit[i] = lg[kept[i]];
    kept_rows[i] = v + (s + kept[i]) * D;
  }
  if (ctx > 0) sel::AppendStatic(q, k, v, s, s + n, ctx, D, avx2, sqrt_d, kept_logit, kept_rows);
  sel::SoftmaxOverRows(kept_logit.data(), kept_rows.data(), static_cast<int64_t>(kept_logit.size()), D, avx2,
                       softcap, out, lse);
}

// One (row, KV head) as one work item: the G query heads q [G, D] over keys [s, s + n) of k, v [N, D].
template <typename T>
void TopkKvHead(const float* q, const T* k, const T* v, int64_t s, int64_t n, int64_t keep, int64_t ctx, int64_t G,
                int64_t D, bool avx2, float softcap, float* out, float* lse) {
  thread_local std::vector<float> logit;
  logit.resize(G * n);
  ScoreKeys(q, k, s, 0, n, G, D, avx2, logit.data(), n);
  for (int64_t g = 0; g < G; ++g) {
    SelectAndAttend(q + g * D, logit.data() + g * n, k, v, s, n, keep, ctx, D, avx2, softcap, out + g * D, lse + g);
  }
}

// Scoring spans: with fewer than 8 (row, KV head) items per thread (one row on two cores: 3 KV
// heads of SmolLM2), whole KV heads as work items would leave threads idle while one scores its
// keys; the keys are then scored in spans of kSpan (at least kMinSpan, for 8 spans per thread)
// into one shared buffer, and the selection runs per query head afterwards. Only when that
// buffer (B*Hq*N float32) stays under kMaxSharedLogits.
constexpr int64_t kSpan = 2048;
constexpr int64_t kMinSpan = 256;
constexpr int64_t kMaxSharedLogits = int64_t{1} << 25;  // floats (128 MiB)

ffi::Future TopkAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                              ffi::Buffer<ffi::S32> start, ffi::Buffer<ffi::S32> end, ffi::Buffer<ffi::S32> keep,
                              ffi::Buffer<ffi::S32> context, ffi::ResultBuffer<ffi::F32> out,
                              ffi::ResultBuffer<ffi::F32> lse, int64_t with_static, int64_t impl, int64_t max_threads,
                              float softcap) {
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
  if (N > (int64_t{1} << 31)) return ReadyFuture(InvalidArg("N must be < 2^31, got " + std::to_string(N)));
  for (auto* b : {&start, &end, &keep, &context}) {
    if (b->dimensions().size() != 1 || b->dimensions()[0] != B) {
      return ReadyFuture(InvalidArg("start, end, keep and context must be int32 [B], got " + Shape(b->dimensions())));
    }
  }
  if (with_static != 0 && with_static != 1) return ReadyFuture(InvalidArg("with_static must be 0 or 1"));
  if (auto e = magicpig::CheckSoftcap(softcap); !e.success()) return ReadyFuture(e);
  const auto od = out->dimensions();
  if (od.size() != 3 || od[0] != B || od[1] != Hq || od[2] != D || lse->element_count() != size_t(B * Hq)) {
    return ReadyFuture(InvalidArg("outputs must be out float32 [B, Hq, D] and lse float32 [B, Hq]"));
  }
  if (impl < 0 || impl > 2) return ReadyFuture(InvalidArg("impl must be 0 (auto), 1 (scalar) or 2 (avx2)"));
  if (impl == 2 && !CpuHasAvx2()) return ReadyFuture(InvalidArg("impl=avx2 requested but the CPU lacks AVX2/FMA"));
  if (B == 0 || Hq == 0) return ReadyFuture(ffi::Error::Success());
  const bool avx2 = impl != 1 && CpuHasAvx2();
  const bool bf16 = k.element_type() == ffi::BF16;
  const int64_t G = Hq / Hkv;
  const float* qp = q.typed_data();
  const void* kp = k.untyped_data();
  const void* vp = v.untyped_data();
  const int32_t* sp = start.typed_data();
  const int32_t* ep = end.typed_data();
  const int32_t* np_ = keep.typed_data();
  const int32_t* cp = context.typed_data();
  float* op = out->typed_data();
  float* lp = lse->typed_data();
  const int64_t heads = B * Hkv;
  int64_t threads = pool.num_threads();
  if (max_threads > 0) threads = std::min(threads, max_threads);
  int64_t max_n = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t s = std::clamp<int64_t>(sp[b], 0, N);
    max_n = std::max<int64_t>(max_n, std::clamp<int64_t>(ep[b], s, N) - s);
  }
  if (threads <= 1 || heads >= 8 * threads || heads * G * max_n > kMaxSharedLogits) {
    return RunParallel(pool, heads, max_threads, [=](int64_t bh) -> ffi::Error {
      const int64_t b = bh / Hkv;
      const int64_t s = std::clamp<int64_t>(sp[b], 0, N);
      const int64_t e = std::clamp<int64_t>(ep[b], s, N);
      const int64_t n = e - s;
      const int64_t kept = std::clamp<int64_t>(np_[b], 0, n);
      const int64_t ctx = with_static ? std::clamp<int64_t>(cp[b], e, N) : 0;
      const int64_t base = bh * N * D;  // KV head (b, h) of [B, Hkv, N, D]
      const float* qh = qp + bh * G * D;
      float* oh = op + bh * G * D;
      float* lh = lp + bh * G;
      if (bf16) {
        TopkKvHead(qh, static_cast<const uint16_t*>(kp) + base, static_cast<const uint16_t*>(vp) + base, s, n, kept,
                   ctx, G, D, avx2, softcap, oh, lh);
      } else {
        TopkKvHead(qh, static_cast<const float*>(kp) + base, static_cast<const float*>(vp) + base, s, n, kept, ctx,
                   G, D, avx2, softcap, oh, lh);
      }
      return ffi::Error::Success();
    });
  }
  // Work items in the order the pool takes them: heads * S scoring items (KV head, span of its
  // keys), then B * Hq selection items (row, query head). A selection item is taken only after
  // every scoring item was taken, so it waits only for scoring items that are running; it
  // yields until its KV head's S spans are done.
  const int64_t per_head = (8 * threads + heads - 1) / heads;
  const int64_t span = std::clamp<int64_t>((max_n + per_head - 1) / per_head, kMinSpan, kSpan);
  const int64_t S = std::max<int64_t>(1, (max_n + span - 1) / span);
  struct Shared {
    // [heads, G, max_n], not zero-filled: a row's scoring items write every logit [0, n) that its
    // selection items read.
    std::unique_ptr<float[]> logit;
    std::unique_ptr<std::atomic<int64_t>[]> done;
  };
  auto sh = std::make_shared<Shared>();
  sh->logit.reset(new float[heads * G * max_n]);
  sh->done.reset(new std::atomic<int64_t>[heads]);
  for (int64_t i = 0; i < heads; ++i) sh->done[i].store(0, std::memory_order_relaxed);
  const int64_t scoring = heads * S;
  return RunParallel(pool, scoring + B * Hq, max_threads, [=](int64_t item) -> ffi::Error {
    if (item < scoring) {
      const int64_t bh = item / S, span_i = item % S, b = bh / Hkv;
      const int64_t s = std::clamp<int64_t>(sp[b], 0, N);
      const int64_t n = std::clamp<int64_t>(ep[b], s, N) - s;
      const int64_t j0 = std::min(n, span_i * span), j1 = std::min(n, j0 + span);
      const int64_t base = bh * N * D;
      float* lg = sh->logit.get() + bh * G * max_n;
      if (bf16) {
        ScoreKeys(qp + bh * G * D, static_cast<const uint16_t*>(kp) + base, s, j0, j1, G, D, avx2, lg, max_n);
      } else {
        ScoreKeys(qp + bh * G * D, static_cast<const float*>(kp) + base, s, j0, j1, G, D, avx2, lg, max_n);
      }
      sh->done[bh].fetch_add(1, std::memory_order_release);
      return ffi::Error::Success();
    }
    const int64_t row = item - scoring, b = row / Hq, hq = row % Hq, bh = b * Hkv + hq / G, g = hq % G;
    while (sh->done[bh].load(std::memory_order_acquire) < S) std::this_thread::yield();
    const int64_t s = std::clamp<int64_t>(sp[b], 0, N);
    const int64_t e = std::clamp<int64_t>(ep[b], s, N);
    const int64_t n = e - s;
    const int64_t kept = std::clamp<int64_t>(np_[b], 0, n);
    const int64_t ctx = with_static ? std::clamp<int64_t>(cp[b], e, N) : 0;
    const int64_t base = bh * N * D;
    const float* lg = sh->logit.get() + (bh * G + g) * max_n;
    if (bf16) {
      SelectAndAttend(qp + row * D, lg, static_cast<const uint16_t*>(kp) + base, static_cast<const uint16_t*>(vp) + base,
                      s, n, kept, ctx, D, avx2, softcap, op + row * D, lp + row);
    } else {
      SelectAndAttend(qp + row * D, lg, static_cast<const float*>(kp) + base, static_cast<const float*>(vp) + base, s,
                      n, kept, ctx, D, avx2, softcap, op + row * D, lp + row);
    }
    return ffi::Error::Success();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MagicpigTopkAttention, TopkAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("with_static")
                                  .Attr<int64_t>("impl")
                                  .Attr<int64_t>("max_threads")
                                  .Attr<float>("softcap"));
