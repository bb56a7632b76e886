// SimHash codes of rows against the hyperplanes of K bits x L tables (XLA FFI, CPU).
//
// Source: arXiv 2410.16179, Section 4.2 (SimHash, Charikar 2002). Bit j of table l of row m is 1
// iff (x[m] - center[m / R]) . P[:, l*K + j] > 0, R = M / G (an exact zero or a NaN gives 0), as
// magicpig_jax.lsh.simhash_codes of the centered rows.
//
//   x       float32 or bfloat16 [M, D]   rows: a decode step's queries (M = B * Hq), or the keys
//                                        of a layer (M = B * Hkv * N)
//   center  float32 [G, D]               the mean subtracted from each run of R = M / G rows
//                                        (the keys' mean per row and KV head; zeros for queries)
//   P       float32 [D, K*L]             the hyperplanes of one layer
//   codes   uint32  [M, L]               bits 0..K-1 of table l in codes[m, l]
//
// Why a kernel: a decode step hashes every query head against K*L hyperplanes in every sparse
// layer: a few rows against a matrix of D*K*L floats, which XLA's dot streams slowly. Work items
// are a tile of rows (centered and widened once into a float32 buffer) times a run of tables;
// each group of 16 hyperplanes is read once per 4 rows, in registers, and only the signs are
// kept. The products are summed in another order than XLA's: a product within float32 rounding
// of 0 can take the other sign.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "ffi_util.h"
#include "handlers.h"

namespace ffi = xla::ffi;

namespace {

using magicpig::CpuHasAvx2;
using magicpig::InvalidArg;
using magicpig::Load;
using magicpig::PrefetchL2;
using magicpig::ReadyFuture;
using magicpig::RunParallel;
using magicpig::Shape;

constexpr int64_t kWord = 64;      // hyperplanes per uint64 of a row's bit set
constexpr int64_t kTileRows = 64;  // rows per work item at most (tiles of equal size)
constexpr int64_t kMaxTables = int64_t{1} << 24;

// Sign bits of the tile's rows xt [R, D] against columns [c0, c1) of P into word w of each
// row's bit set (bits [R, words]), c1 - c0 <= 64.
void SignBitsScalar(const float* xt, int64_t R, const float* P, int64_t D, int64_t C, int64_t c0, int64_t c1,
                    uint64_t* bits, int64_t words, int64_t w) {
  for (int64_t m = 0; m < R; ++m) {
    const float* xm = xt + m * D;
    uint64_t word = 0;
    for (int64_t c = c0; c < c1; ++c) {
      float s = 0.f;
      for (int64_t d = 0; d < D; ++d) s += xm[d] * P[d * C + c];
      if (s > 0.f) word |= uint64_t{1} << (c - c0);
    }
    bits[m * words + w] = word;
  }
}

#ifdef MAGICPIG_HAVE_AVX2_PATH
// The 16-bit mask of lo > 0 (bits 0-7) and hi > 0 (bits 8-15). _CMP_GT_OQ: a NaN compares false,
// so a NaN product gives bit 0 as JAX's x > 0 does.
__attribute__((target("avx2,fma"))) inline uint32_t Positive16(__m256 lo, __m256 hi) {
  const __m256 z = _mm256_setzero_ps();
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(lo, z, _CMP_GT_OQ))) |
         (static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(hi, z, _CMP_GT_OQ))) << 8);
}

// NR rows (1..4) of x [NR, D] against the 16 columns of P from c: each row's 16-bit sign mask.
// kPartial: only the columns before C exist (masked loads; the missing lanes read 0, bit 0).
template <int NR, bool kPartial>
__attribute__((target("avx2,fma"))) inline void Signs16(const float* x, const float* P, int64_t D, int64_t C,
                                                        int64_t c, uint32_t* mask) {
  __m256i m0 = _mm256_setzero_si256(), m1 = m0;
  if constexpr (kPartial) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i n = _mm256_set1_epi32(static_cast<int>(C - c));
    m0 = _mm256_cmpgt_epi32(n, lane);
    m1 = _mm256_cmpgt_epi32(n, _mm256_add_epi32(lane, _mm256_set1_epi32(8)));
  }
  // Eight named accumulators (GCC keeps an array of them in memory).
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00,
         a31 = a00;
  const float* pc = P + c;
  for (int64_t d = 0; d < D; ++d) {
    __m256 p0, p1;
    if constexpr (kPartial) {
      p0 = _mm256_maskload_ps(pc + d * C, m0);
      p1 = _mm256_maskload_ps(pc + d * C + 8, m1);
    } else {
      p0 = _mm256_loadu_ps(pc + d * C);
      p1 = _mm256_loadu_ps(pc + d * C + 8);
    }
    __m256 xv = _mm256_broadcast_ss(x + d);
    a00 = _mm256_fmadd_ps(xv, p0, a00);
    a01 = _mm256_fmadd_ps(xv, p1, a01);
    if constexpr (NR > 1) {
      xv = _mm256_broadcast_ss(x + D + d);
      a10 = _mm256_fmadd_ps(xv, p0, a10);
      a11 = _mm256_fmadd_ps(xv, p1, a11);
    }
    if constexpr (NR > 2) {
      xv = _mm256_broadcast_ss(x + 2 * D + d);
      a20 = _mm256_fmadd_ps(xv, p0, a20);
      a21 = _mm256_fmadd_ps(xv, p1, a21);
    }
    if constexpr (NR > 3) {
      xv = _mm256_broadcast_ss(x + 3 * D + d);
      a30 = _mm256_fmadd_ps(xv, p0, a30);
      a31 = _mm256_fmadd_ps(xv, p1, a31);
    }
  }
  mask[0] = Positive16(a00, a01);
  if constexpr (NR > 1) mask[1] = Positive16(a10, a11);
  if constexpr (NR > 2) mask[2] = Positive16(a20, a21);
  if constexpr (NR > 3) mask[3] = Positive16(a30, a31);
  _mm256_zeroupper();
}

template <int NR>
__attribute__((target("avx2,fma"))) inline void Signs16Any(const float* x, const float* P, int64_t D, int64_t C,
                                                           int64_t c, uint32_t* mask) {
  if (c + 16 <= C) {
    Signs16<NR, false>(x, P, D, C, c, mask);
  } else {
    Signs16<NR, true>(x, P, D, C, c, mask);
  }
}

// As SignBitsScalar, c0 a multiple of 16.
__attribute__((target("avx2,fma"))) void SignBitsAvx2(const float* xt, int64_t R, const float* P, int64_t D,
                                                      int64_t C, int64_t c0, int64_t c1, uint64_t* bits,
                                                      int64_t words, int64_t w) {
  for (int64_t m = 0; m < R; m += 4) {
    const int64_t r = std::min<int64_t>(4, R - m);
    const float* xm = xt + m * D;
    uint64_t word[4] = {0, 0, 0, 0};
    for (int64_t q = 0; c0 + 16 * q < c1; ++q) {
      uint32_t mask[4] = {0, 0, 0, 0};
      const int64_t c = c0 + 16 * q;
      switch (r) {
        case 4: Signs16Any<4>(xm, P, D, C, c, mask); break;
        case 3: Signs16Any<3>(xm, P, D, C, c, mask); break;
        case 2: Signs16Any<2>(xm, P, D, C, c, mask); break;
        default: Signs16Any<1>(xm, P, D, C, c, mask); break;
      }
      for (int64_t i = 0; i < r; ++i) word[i] |= uint64_t{mask[i]} << (16 * q);
    }
    for (int64_t i = 0; i < r; ++i) bits[(m + i) * words + w] = word[i];
  }
}
#endif

// One work item: rows [m0, m0 + R) and tables [l0, l1).
template <typename T>
void HashItem(const T* x, const float* center, int64_t rows_per_center, const float* P, int64_t D, int64_t K,
              int64_t C, int64_t m0, int64_t R, int64_t l0, int64_t l1, bool avx2, uint32_t* codes, int64_t L) {
  // The rows, centered and widened to float32, exactly as JAX's x.astype(float32) - mean, then
  // scaled by the power of two that brings each row's largest magnitude into [1, 2), as
  // magicpig_jax.lsh.exponent_scaled: the signs are kept, and a tiny row's products no longer
  // fall below float32's normal range (flushed to zero under FTZ) nor a huge row's overflow.
  std::vector<float> xt(static_cast<size_t>(R * D));
  for (int64_t i = 0; i < R; ++i) {
    const T* xr = x + (m0 + i) * D;
    const float* cr = center + ((m0 + i) / rows_per_center) * D;
    float* row = xt.data() + i * D;
    float top = 0.0f;
    bool finite = true;  // a row with a NaN or an infinity is left unscaled, as in JAX
    for (int64_t d = 0; d < D; ++d) {
      row[d] = Load(xr, d) - cr[d];
      finite = finite && std::isfinite(row[d]);
      top = std::max(top, std::fabs(row[d]));
    }
    if (finite && top > 0.0f) {
      int e = 0;
      std::frexp(top, &e);  // top = m 2^e, m in [0.5, 1)
      for (int64_t d = 0; d < D; ++d) row[d] = std::ldexp(row[d], 1 - e);
    }
  }
  // Columns [cb, ce): from the 16-aligned column at or before table l0's first to table l1's end.
  const int64_t cb = (l0 * K) / 16 * 16, ce = l1 * K;
  const int64_t words = (ce - cb + kWord - 1) / kWord + 1;  // + 1: a code may end in the next word
  std::vector<uint64_t> bits(static_cast<size_t>(R * words), 0);
  for (int64_t w = 0; w + 1 < words; ++w) {
    // The columns of the word two ahead into L2: a word's columns are D strided pieces of P,
    // more streams than the hardware prefetcher follows.
    const int64_t pa = cb + (w + 2) * kWord;
    if (pa < ce) {
      for (int64_t d = 0; d < D; ++d) {
        for (int64_t c = pa; c < std::min(ce, pa + kWord); c += 16) PrefetchL2(P + d * C + c);
      }
    }
    const int64_t c0 = cb + w * kWord, c1 = std::min(ce, c0 + kWord);
#ifdef MAGICPIG_HAVE_AVX2_PATH
    if (avx2) {
      SignBitsAvx2(xt.data(), R, P, D, C, c0, c1, bits.data(), words, w);
      continue;
    }
#endif
    (void)avx2;
    SignBitsScalar(xt.data(), R, P, D, C, c0, c1, bits.data(), words, w);
  }
  // Table l's code: bits [l*K - cb, l*K - cb + K) of the row's bit set (K <= 32: two words at most).
  const uint64_t low = (K == 32) ? 0xffffffffull : ((uint64_t{1} << K) - 1);
  for (int64_t i = 0; i < R; ++i) {
    const uint64_t* b = bits.data() + i * words;
    for (int64_t l = l0; l < l1; ++l) {
      const int64_t o = l * K - cb, j = o / kWord, sh = o % kWord;
      uint64_t v = b[j] >> sh;
      if (sh + K > kWord) v |= b[j + 1] << (kWord - sh);
      codes[(m0 + i) * L + l] = static_cast<uint32_t>(v & low);
    }
  }
}

ffi::Future SimhashCodesImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> center,
                             ffi::Buffer<ffi::F32> P, ffi::ResultBuffer<ffi::U32> codes, int64_t K, int64_t L,
                             int64_t impl, int64_t max_threads) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) return ReadyFuture(InvalidArg("x must be [M, D], got " + Shape(xd)));
  if (x.element_type() != ffi::F32 && x.element_type() != ffi::BF16) {
    return ReadyFuture(InvalidArg("x must be float32 or bfloat16"));
  }
  const int64_t M = xd[0], D = xd[1];
  if (K < 1 || K > 32) return ReadyFuture(InvalidArg("K must be in [1, 32], got " + std::to_string(K)));
  if (L < 1 || L > kMaxTables) {
    return ReadyFuture(InvalidArg("L must be in [1, " + std::to_string(kMaxTables) + "], got " + std::to_string(L)));
  }
  const int64_t C = K * L;
  const auto pd = P.dimensions();
  if (pd.size() != 2 || pd[0] != D || pd[1] != C) {
    return ReadyFuture(InvalidArg("projections must be float32 [D, K*L] = [" + std::to_string(D) + ", " +
                                  std::to_string(C) + "], got " + Shape(pd)));
  }
  const auto gd = center.dimensions();
  if (gd.size() != 2 || gd[1] != D || gd[0] < 1 || M % gd[0] != 0) {
    return ReadyFuture(InvalidArg("center must be float32 [G, D] with D=" + std::to_string(D) +
                                  " and G >= 1 dividing M=" + std::to_string(M) + ", got " + Shape(gd)));
  }
  const auto cd = codes->dimensions();
  if (cd.size() != 2 || cd[0] != M || cd[1] != L) {
    return ReadyFuture(InvalidArg("codes must be uint32 [M, L] = [" + std::to_string(M) + ", " +
                                  std::to_string(L) + "], got " + Shape(cd)));
  }
  if (impl < 0 || impl > 2) return ReadyFuture(InvalidArg("impl must be 0 (auto), 1 (scalar) or 2 (avx2)"));
  if (impl == 2 && !CpuHasAvx2()) return ReadyFuture(InvalidArg("impl=avx2 requested but the CPU lacks AVX2/FMA"));
  if (M == 0 || D == 0) {
    std::fill(codes->typed_data(), codes->typed_data() + M * L, 0u);
    return ReadyFuture(ffi::Error::Success());
  }
  const bool avx2 = impl != 1 && CpuHasAvx2();
  const bool bf16 = x.element_type() == ffi::BF16;
  const void* xp = x.untyped_data();
  const float* gp = center.typed_data();
  const float* pp = P.typed_data();
  uint32_t* out = codes->typed_data();
  const int64_t rows_per_center = M / gd[0];
  // Tiles of rows, each split into runs of tables: a multiple of the thread count, so the items
  // balance whatever the number of tiles (a decode step's queries are one tile or a few), with at
  // least 4 words of hyperplanes per run where there are enough.
  const int64_t tiles = (M + kTileRows - 1) / kTileRows;
  int64_t nt = pool.num_threads();
  if (max_threads > 0) nt = std::min(nt, max_threads);
  nt = std::max<int64_t>(1, nt);
  const int64_t per = std::max<int64_t>(1, std::min<int64_t>(4, C / (4 * kWord * nt)));
  const int64_t runs = std::min<int64_t>(L, nt * per);
  return RunParallel(pool, tiles * runs, max_threads, [=](int64_t i) -> ffi::Error {
    const int64_t t = i / runs, r = i % runs;
    const int64_t m0 = M * t / tiles, R = M * (t + 1) / tiles - m0;  // 1..64 rows
    const int64_t l0 = L * r / runs, l1 = L * (r + 1) / runs;
    if (bf16) {
      HashItem(static_cast<const uint16_t*>(xp), gp, rows_per_center, pp, D, K, C, m0, R, l0, l1, avx2, out, L);
    } else {
      HashItem(static_cast<const float*>(xp), gp, rows_per_center, pp, D, K, C, m0, R, l0, l1, avx2, out, L);
    }
    return ffi::Error::Success();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MagicpigSimhashCodes, SimhashCodesImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::U32>>()
                                  .Attr<int64_t>("K")
                                  .Attr<int64_t>("L")
                                  .Attr<int64_t>("impl")
                                  .Attr<int64_t>("max_threads"));
