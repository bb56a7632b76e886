// Quest decode attention over the host KV cache (XLA FFI, CPU): the page-selection baseline of
// MagicPIG's comparison (Tang et al., ICML 2024, arXiv 2406.10774, Section 3.2, Algorithm 1), at
// its best implementation on the host.
//
// The range [start, end) of each row is cut into pages of `page_size` consecutive positions,
// page j = [start + j*page_size, start + (j+1)*page_size) ∩ [start, end). Per page and KV head
// the caller keeps the elementwise min and max of the page's keys (float32 [B, Hkv, P, D] each,
// maintained with the cache: magicpig_jax/host/quest.py builds them after prefill and extends
// them when keys join the range). Per query head this op scores every page by the upper bound
// sum_d max(q_d kmin_d, q_d kmax_d) / sqrt(D) of q·k/sqrt(D) over the page,
// keeps the `pages` best (std::nth_element on 64-bit keys: descending score, ties by the
// smaller page; not a sort) and attends exactly over their keys. It reads the page bounds of
// the range and the K and V rows of the kept pages only. It computes the function of
// magicpig_jax.attention.quest_attention on the range (same pages up to float32 summation order,
// same output to float32 rounding).
//
// Operands: q float32 [B, Hq, D]; k, v float32 or bfloat16 [B, Hkv, N, D]; kmin, kmax float32
// [B, Hkv, P, D]; start, end int32 [B] (clipped to [0, N]; ceil((end - start) / page_size) <= P);
// pages int32 [B] (pages kept per query head, clipped to [0, pages in range]); context int32 [B]
// (with_static: the keys [0, start) and [end, context) are attended exactly too, in the same
// softmax: a decoder's sinks and unhashed tail). Results: out float32 [B, Hq, D], lse float32
// [B, Hq] (natural log); no key gives out = 0, lse = -inf; a NaN or +inf page bound or logit (a
// non-finite q or k) gives out and lse NaN for the head.
// Attributes: page_size (>= 1), with_static (0 or 1), impl (0 auto, 1 scalar, 2 avx2),
// max_threads (0: the pool), softcap (float32: 0 for none, or c in [0.001, 1e6]: each kept logit
// becomes c tanh(logit / c), Gemma 2's attention logit soft-capping; the pages are ranked by the
// uncapped bound, which the monotone cap orders the same way).
// Every shape is validated; bad input returns an ffi::Error (never a crash or a stray read).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "ffi_util.h"
#include "handlers.h"
#include "selected_attention.h"

namespace ffi = xla::ffi;

namespace {

using magicpig::CpuHasAvx2;
using magicpig::InvalidArg;
using magicpig::ReadyFuture;
using magicpig::RunParallel;
using magicpig::Shape;
namespace sel = magicpig::selected;

constexpr int64_t kMaxG = 64;

// Quest's bound for query q over one page: sum_d max(q_d kmin_d, q_d kmax_d), as quest_page_scores.
// Per dimension, not as q+ . kmax + q- . kmin: with q_d < 0 and kmax_d = +inf (a key with an
// infinite component, whose logit is then -inf) the latter is 0 * inf = NaN, the former finite.
// A NaN product (q_d = 0 against an infinite bound, or a NaN) stays NaN and poisons the head.
inline float PageBound(const float* q, const float* kmin, const float* kmax, int64_t D) {
  float bound = 0.f;
  for (int64_t d = 0; d < D; ++d) {
    const float a = q[d] * kmin[d], b = q[d] * kmax[d];
    bound += (a == a && b == b) ? (a > b ? a : b) : a + b;  // NaN if either is
  }
  return bound;
}

template <typename T>
void QuestKvHead(const float* q, const T* k, const T* v, const float* kmin, const float* kmax, int64_t s,
                 int64_t n, int64_t pages, int64_t ctx, int64_t page_size, int64_t G, int64_t D, bool avx2,
                 float softcap, float* out, float* lse) {
  thread_local std::vector<uint64_t> keys;
  thread_local std::vector<float> kept_logit;
  thread_local std::vector<const T*> kept_rows;
  const float sqrt_d = static_cast<float>(std::sqrt(static_cast<double>(D)));
  const int64_t P = (n + page_size - 1) / page_size;
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = q + g * D;
    keys.resize(P);
    bool corrupt = false;  // a page bound NaN or +inf (a non-finite q or key): the head is NaN
    for (int64_t p = 0; p < P; ++p) {
      const float bound = PageBound(qg, kmin + p * D, kmax + p * D, D) / sqrt_d;
      corrupt |= sel::Corrupt(bound);
      keys[p] = sel::RankKey(bound, static_cast<uint32_t>(p));
    }
    if (corrupt) {
      sel::Poison(out + g * D, D, lse + g);
      continue;
    }
    sel::SelectTop(keys, pages);
    kept_logit.clear();
    kept_rows.clear();
    for (int64_t i = 0; i < pages; ++i) {
      const int64_t p = sel::RankPos(keys[i]);
      const int64_t j1 = std::min(n, (p + 1) * page_size);
      for (int64_t j = p * page_size; j < j1; ++j) {
        kept_logit.push_back(sel::Dot(qg, k + (s + j) * D, D, avx2) / sqrt_d);
        kept_rows.push_back(v + (s + j) * D);
      }
    }
    if (ctx > 0) sel::AppendStatic(qg, k, v, s, s + n, ctx, D, avx2, sqrt_d, kept_logit, kept_rows);
    sel::SoftmaxOverRows(kept_logit.data(), kept_rows.data(), static_cast<int64_t>(kept_logit.size()), D, avx2,
                         softcap, out + g * D, lse + g);
  }
}

ffi::Future QuestAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                               ffi::Buffer<ffi::F32> kmin, ffi::Buffer<ffi::F32> kmax, ffi::Buffer<ffi::S32> start,
                               ffi::Buffer<ffi::S32> end, ffi::Buffer<ffi::S32> pages, ffi::Buffer<ffi::S32> context,
                               ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse, int64_t page_size,
                               int64_t with_static, int64_t impl, int64_t max_threads, float softcap) {
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
  if (page_size < 1) return ReadyFuture(InvalidArg("page_size must be >= 1, got " + std::to_string(page_size)));
  if (auto e = magicpig::CheckSoftcap(softcap); !e.success()) return ReadyFuture(e);
  const auto md = kmin.dimensions();
  if (md.size() != 4 || md[0] != B || md[1] != Hkv || md[3] != D || kmax.dimensions().size() != 4 ||
      kmax.dimensions()[0] != md[0] || kmax.dimensions()[1] != md[1] || kmax.dimensions()[2] != md[2] ||
      kmax.dimensions()[3] != md[3]) {
    return ReadyFuture(InvalidArg("kmin and kmax must both be float32 [B, Hkv, P, D] = [" + std::to_string(B) + ", " +
                                  std::to_string(Hkv) + ", P, " + std::to_string(D) + "], got " + Shape(md) +
                                  " and " + Shape(kmax.dimensions())));
  }
  const int64_t P = md[2];
  if (N > (int64_t{1} << 31)) return ReadyFuture(InvalidArg("N must be < 2^31, got " + std::to_string(N)));
  for (auto* b : {&start, &end, &pages, &context}) {
    if (b->dimensions().size() != 1 || b->dimensions()[0] != B) {
      return ReadyFuture(InvalidArg("start, end, pages and context must be int32 [B], got " + Shape(b->dimensions())));
    }
  }
  if (with_static != 0 && with_static != 1) return ReadyFuture(InvalidArg("with_static must be 0 or 1"));
  const auto od = out->dimensions();
  if (od.size() != 3 || od[0] != B || od[1] != Hq || od[2] != D || lse->element_count() != size_t(B * Hq)) {
    return ReadyFuture(InvalidArg("outputs must be out float32 [B, Hq, D] and lse float32 [B, Hq]"));
  }
  if (impl < 0 || impl > 2) return ReadyFuture(InvalidArg("impl must be 0 (auto), 1 (scalar) or 2 (avx2)"));
  if (impl == 2 && !CpuHasAvx2()) return ReadyFuture(InvalidArg("impl=avx2 requested but the CPU lacks AVX2/FMA"));
  const int32_t* sp = start.typed_data();
  const int32_t* ep = end.typed_data();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t s = std::clamp<int64_t>(sp[b], 0, N);
    const int64_t n = std::clamp<int64_t>(ep[b], s, N) - s;
    if ((n + page_size - 1) / page_size > P) {
      return ReadyFuture(InvalidArg("row " + std::to_string(b) + ": the range [" + std::to_string(s) + ", " +
                                    std::to_string(s + n) + ") has more pages of " + std::to_string(page_size) +
                                    " than the bounds hold (P = " + std::to_string(P) + ")"));
    }
  }
  if (B == 0 || Hq == 0) return ReadyFuture(ffi::Error::Success());
  const bool avx2 = impl != 1 && CpuHasAvx2();
  const bool bf16 = k.element_type() == ffi::BF16;
  const int64_t G = Hq / Hkv;
  const float* qp = q.typed_data();
  const void* kp = k.untyped_data();
  const void* vp = v.untyped_data();
  const float* mnp = kmin.typed_data();
  const float* mxp = kmax.typed_data();
  const int32_t* pp = pages.typed_data();
  const int32_t* cp = context.typed_data();
  float* op = out->typed_data();
  float* lp = lse->typed_data();
  return RunParallel(pool, B * Hkv, max_threads, [=](int64_t bh) -> ffi::Error {
    const int64_t b = bh / Hkv;
    const int64_t s = std::clamp<int64_t>(sp[b], 0, N);
    const int64_t n = std::clamp<int64_t>(ep[b], s, N) - s;
    const int64_t kept = std::clamp<int64_t>(pp[b], 0, (n + page_size - 1) / page_size);
    const int64_t ctx = with_static ? std::clamp<int64_t>(cp[b], s + n, N) : 0;
    const int64_t base = bh * N * D;
    const float* mn = mnp + bh * P * D;
    const float* mx = mxp + bh * P * D;
    if (bf16) {
      QuestKvHead(qp + bh * G * D, static_cast<const uint16_t*>(kp) + base, static_cast<const uint16_t*>(vp) + base,
                  mn, mx, s, n, kept, ctx, page_size, G, D, avx2, softcap, op + bh * G * D, lp + bh * G);
    } else {
      QuestKvHead(qp + bh * G * D, static_cast<const float*>(kp) + base, static_cast<const float*>(vp) + base, mn,
                  mx, s, n, kept, ctx, page_size, G, D, avx2, softcap, op + bh * G * D, lp + bh * G);
    }
    return ffi::Error::Success();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MagicpigQuestAttention, QuestAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("page_size")
                                  .Attr<int64_t>("with_static")
                                  .Attr<int64_t>("impl")
                                  .Attr<int64_t>("max_threads")
                                  .Attr<float>("softcap"));
