// Matrix-vector products that read GGUF-quantized weight rows in place (XLA FFI, CPU).
//
// Decoding one token multiplies each weight matrix by a single activation vector: the cost is
// the bytes of the weights. A float32 copy of SmolLM2-135M is 540 MB per token; its GGUF blocks
// (Q4_1 projections, Q8_0 embedding) are 96 MB. This op computes y = W x straight from the
// blocks, dequantizing them in registers in float32 exactly as ggml's dequantize_row_* (and
// gguf-py's gguf.quants.dequantize) do, so y equals the float32 product up to summation order.
// Activations stay float32 (llama.cpp instead rounds them to 8 bits).
//
// Block formats (ggml-common.h; a row of `in` weights is in/32 consecutive blocks):
//   Q4_1 (ggml type 3), 20 bytes: f16 d, f16 m, uint8 qs[16];
//        w[j] = d * (qs[j] & 15) + m,  w[j + 16] = d * (qs[j] >> 4) + m   (j < 16)
//   Q8_0 (ggml type 8), 34 bytes: f16 d, int8 qs[32];  w[j] = d * qs[j]
//
// Operands: x float32 [M, In], w uint8 [Out, In/32 * block bytes]; result float32 [M, Out].
// Every shape is validated; bad input returns an ffi::Error (never a crash or a stray read).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "ffi_util.h"
#include "handlers.h"

namespace ffi = xla::ffi;

namespace {

using magicpig::CpuHasAvx2;
using magicpig::InvalidArg;
using magicpig::ReadyFuture;
using magicpig::RunParallel;
using magicpig::Shape;

constexpr int64_t kQK = 32;       // weights per block (QK4_1 == QK8_0 == 32)
constexpr int64_t kTypeQ4_1 = 3;  // ggml_type ids
constexpr int64_t kTypeQ8_0 = 8;

int64_t BlockBytes(int64_t qtype) {
  if (qtype == kTypeQ4_1) return 20;
  if (qtype == kTypeQ8_0) return 34;
  return 0;
}

// IEEE half -> float, exact for every value (normal, subnormal, zero, inf, NaN).
inline float HalfToFloat(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    const float f = std::ldexp(static_cast<float>(man), -24);  // zero or subnormal
    return sign ? -f : f;
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Scalar kernels: one row (nb blocks) against one activation vector x [nb*32].
// xsum[b] = sum of x over block b (Q4_1's "+ m" term is m * xsum[b]).
float DotQ4_1Scalar(const uint8_t* row, const float* x, const float* xsum, int64_t nb) {
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * 20;
    const float d = HalfToFloat(blk), m = HalfToFloat(blk + 2);
    const uint8_t* qs = blk + 4;
    const float* xb = x + b * kQK;
    float s = 0.0f;
    for (int j = 0; j < 16; ++j) {
      s += static_cast<float>(qs[j] & 15) * xb[j] + static_cast<float>(qs[j] >> 4) * xb[j + 16];
    }
    acc += d * s + m * xsum[b];
  }
  return acc;
}

float DotQ8_0Scalar(const uint8_t* row, const float* x, const float*, int64_t nb) {
  float acc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * 34;
    const float d = HalfToFloat(blk);
    const int8_t* qs = reinterpret_cast<const int8_t*>(blk + 2);
    const float* xb = x + b * kQK;
    float s = 0.0f;
    for (int j = 0; j < 32; ++j) s += static_cast<float>(qs[j]) * xb[j];
    acc += d * s;
  }
  return acc;
}

#ifdef MAGICPIG_HAVE_AVX2_PATH
using magicpig::Hsum;

__attribute__((target("avx2,fma,f16c"))) inline float HalfToFloatF16c(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Four groups of 8 uint8/int8 lanes -> float32 vectors.
__attribute__((target("avx2,fma,f16c"))) inline __m256 U8ToF32(__m128i v) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
}
__attribute__((target("avx2,fma,f16c"))) inline __m256 I8ToF32(__m128i v) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
}

// The AVX2 Q4_1 kernels avoid byte shuffles (the bottleneck port of a cvtepu8 unpacking):
// the 16 bytes of a block are broadcast to both 128-bit lanes, and vector k (k = 0..3) keeps
// one nibble of each 32-bit lane with an AND, leaving q * 2^s in the lane, s its bit position.
// Lane i (i < 4) of vector k then holds weight 4i + k (low nibble of byte 4i + k); lane 4 + i
// holds weight 4i + k + 16 (its high nibble). The activations are permuted to that order and
// scaled by 2^-s once per call (PermuteQ4_1), so (q 2^s)(x 2^-s) = q x exactly: powers of two.
// Vector 3 is shifted right by 4 first, so no lane keeps bit 31 (int32 -> float stays exact).
constexpr int kQ4Shift[4][2] = {{0, 4}, {8, 12}, {16, 20}, {20, 24}};  // s of lanes 0-3, 4-7

// xp [nb * 32] = the activations of x [nb * 32] in the lane order above, scaled by 2^-s.
void PermuteQ4_1(const float* x, int64_t nb, float* xp) {
  for (int64_t b = 0; b < nb; ++b) {
    for (int k = 0; k < 4; ++k) {
      for (int i = 0; i < 4; ++i) {
        xp[b * kQK + 8 * k + i] = std::ldexp(x[b * kQK + 4 * i + k], -kQ4Shift[k][0]);
        xp[b * kQK + 8 * k + 4 + i] = std::ldexp(x[b * kQK + 4 * i + k + 16], -kQ4Shift[k][1]);
      }
    }
  }
}

struct Q4Masks {
  __m256i m[4];
};

__attribute__((target("avx2,fma,f16c"))) inline Q4Masks MakeQ4Masks() {
  Q4Masks q;
  for (int k = 0; k < 4; ++k) {
    const int lo = 0xf << kQ4Shift[k][0], hi = 0xf << kQ4Shift[k][1];
    q.m[k] = _mm256_setr_epi32(lo, lo, lo, lo, hi, hi, hi, hi);
  }
  return q;
}

// s = sum over the block of q_j * x_j (x permuted and scaled by PermuteQ4_1).
__attribute__((target("avx2,fma,f16c"))) inline __m256 BlockQ4(const uint8_t* qs, const Q4Masks& mk,
                                                               __m256 x0, __m256 x1, __m256 x2, __m256 x3) {
  const __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  const __m256i q4 = _mm256_srli_epi32(q, 4);
  __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q, mk.m[0])), x0);
  s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q, mk.m[1])), x1, s);
  s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q, mk.m[2])), x2, s);
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q4, mk.m[3])), x3, s);
}

// Four rows at a time: the activation block is loaded once for the four, and the four
// accumulator chains are independent (one row alone is bound by the latency of its chain).
// xp: activations permuted by PermuteQ4_1.
__attribute__((target("avx2,fma,f16c"))) void DotQ4_1Avx2x4(const uint8_t* row0, int64_t stride,
                                                            const float* xp, const float* xsum, int64_t nb,
                                                            float* out) {
  const Q4Masks mk = MakeQ4Masks();
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  float macc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = xp + b * kQK;
    const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8);
    const __m256 x2 = _mm256_loadu_ps(xb + 16), x3 = _mm256_loadu_ps(xb + 24);
    const float xs = xsum[b];
    for (int r = 0; r < 4; ++r) {
      const uint8_t* blk = row0 + r * stride + b * 20;
      const __m256 s = BlockQ4(blk + 4, mk, x0, x1, x2, x3);
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(HalfToFloatF16c(blk)), s, acc[r]);
      macc[r] += HalfToFloatF16c(blk + 2) * xs;
    }
  }
  for (int r = 0; r < 4; ++r) out[r] = Hsum(acc[r]) + macc[r];
  _mm256_zeroupper();
}

// One row; xp permuted by PermuteQ4_1.
__attribute__((target("avx2,fma,f16c"))) float DotQ4_1Avx2(const uint8_t* row, const float* xp,
                                                           const float* xsum, int64_t nb) {
  const Q4Masks mk = MakeQ4Masks();
  __m256 acc = _mm256_setzero_ps();
  float macc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * 20;
    const float* xb = xp + b * kQK;
    const __m256 s = BlockQ4(blk + 4, mk, _mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8),
                             _mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24));
    acc = _mm256_fmadd_ps(_mm256_set1_ps(HalfToFloatF16c(blk)), s, acc);
    macc += HalfToFloatF16c(blk + 2) * xsum[b];
  }
  const float r = Hsum(acc) + macc;
  _mm256_zeroupper();
  return r;
}

__attribute__((target("avx2,fma,f16c"))) float DotQ8_0Avx2(const uint8_t* row, const float* x,
                                                           const float*, int64_t nb) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * 34;
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
    const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18));
    const float* xb = x + b * kQK;
    __m256 s = _mm256_mul_ps(I8ToF32(q0), _mm256_loadu_ps(xb));
    s = _mm256_fmadd_ps(I8ToF32(_mm_srli_si128(q0, 8)), _mm256_loadu_ps(xb + 8), s);
    s = _mm256_fmadd_ps(I8ToF32(q1), _mm256_loadu_ps(xb + 16), s);
    s = _mm256_fmadd_ps(I8ToF32(_mm_srli_si128(q1, 8)), _mm256_loadu_ps(xb + 24), s);
    acc = _mm256_fmadd_ps(_mm256_set1_ps(HalfToFloatF16c(blk)), s, acc);
  }
  const float r = Hsum(acc);
  _mm256_zeroupper();
  return r;
}
#endif  // MAGICPIG_HAVE_AVX2_PATH

// Bytes of weights kept requested ahead of the kernels (software prefetch). Measured on the
// 2-core machine, decoding SmolLM2 at 256 tokens of context: 18.0 ms/token without, 16.1 with
// 4096 (2048 and 8192 within noise of it, 16384 worse).
constexpr int64_t kPrefetchAhead = 4096;

using DotFn = float (*)(const uint8_t*, const float*, const float*, int64_t);

DotFn PickKernel(int64_t qtype, bool avx2) {
#ifdef MAGICPIG_HAVE_AVX2_PATH
  if (avx2) return qtype == kTypeQ4_1 ? DotQ4_1Avx2 : DotQ8_0Avx2;
#endif
  (void)avx2;
  return qtype == kTypeQ4_1 ? DotQ4_1Scalar : DotQ8_0Scalar;
}

ffi::Future QuantMatvecImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                            ffi::ResultBuffer<ffi::F32> y, int64_t qtype, int64_t impl,
                            int64_t max_threads) {
  const int64_t bb = BlockBytes(qtype);
  if (bb == 0) {
    return ReadyFuture(InvalidArg("qtype must be 3 (Q4_1) or 8 (Q8_0), got " + std::to_string(qtype)));
  }
  if (impl < 0 || impl > 2) return ReadyFuture(InvalidArg("impl must be 0 (auto), 1 (scalar) or 2 (avx2)"));
  if (impl == 2 && !CpuHasAvx2()) {
    return ReadyFuture(InvalidArg("impl=avx2 requested but the CPU lacks AVX2/FMA/F16C"));
  }
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2) return ReadyFuture(InvalidArg("x must be float32 [M, In], got " + Shape(xd)));
  const int64_t M = xd[0], In = xd[1];
  if (In <= 0 || In % kQK) {
    return ReadyFuture(InvalidArg("In (the last dim of x) must be a positive multiple of 32, got " +
                                  std::to_string(In)));
  }
  const int64_t nb = In / kQK;
  if (wd.size() != 2 || wd[1] != nb * bb) {
    return ReadyFuture(InvalidArg("w must be uint8 [Out, In/32*" + std::to_string(bb) + "] = [Out, " +
                                  std::to_string(nb * bb) + "] for In=" + std::to_string(In) + ", got " +
                                  Shape(wd)));
  }
  const int64_t Out = wd[0];
  if (yd.size() != 2 || yd[0] != M || yd[1] != Out) {
    return ReadyFuture(InvalidArg("the result must be float32 [M, Out] = [" + std::to_string(M) + ", " +
                                  std::to_string(Out) + "], got " + Shape(yd)));
  }
  if (M == 0 || Out == 0) return ReadyFuture(ffi::Error::Success());
  const bool avx2 = impl != 1 && CpuHasAvx2();
  const DotFn dot = PickKernel(qtype, avx2);
  const bool four = avx2 && qtype == kTypeQ4_1;  // the four-row Q4_1 kernel
  const float* xp = x.typed_data();
  const uint8_t* wp = w.typed_data();
  float* yp = y->typed_data();

  // Per call, shared by the workers (kept alive by the lambda until the last one is done):
  // block sums of x (Q4_1's offset term) and, for the AVX2 Q4_1 kernels, x permuted and
  // scaled (PermuteQ4_1).
  struct Prepared {
    std::vector<float> xsum, xperm;
  };
  auto prep = std::make_shared<Prepared>();
  prep->xsum.assign(M * nb, 0.0f);
  for (int64_t t = 0; t < M; ++t) {
    for (int64_t b = 0; b < nb; ++b) {
      float s = 0.0f;
      for (int64_t j = 0; j < kQK; ++j) s += xp[t * In + b * kQK + j];
      prep->xsum[t * nb + b] = s;
    }
  }
  const bool permuted = avx2 && qtype == kTypeQ4_1;
  if (permuted) {
    prep->xperm.resize(M * In);
    for (int64_t t = 0; t < M; ++t) PermuteQ4_1(xp + t * In, nb, prep->xperm.data() + t * In);
  }
  // Work items of about 64 KiB of weights, so small matrices run on the calling thread.
  const int64_t row_bytes = nb * bb;
  const int64_t rows_per_item = std::max<int64_t>(8, (int64_t{64} << 10) / row_bytes / 4 * 4);
  const int64_t items = (Out + rows_per_item - 1) / rows_per_item;
  const uint8_t* w_end = wp + Out * row_bytes;
  return RunParallel(pool, items, max_threads,
                     [=](int64_t item) -> ffi::Error {
                       const float* xk = permuted ? prep->xperm.data() : xp;  // what the kernels read
                       const float* xsum = prep->xsum.data();
                       const int64_t r0 = item * rows_per_item;
                       const int64_t r1 = std::min(Out, r0 + rows_per_item);
                       int64_t r = r0;
                       // The weights are read once per token, so they come from DRAM: request
                       // the first lines of the item, then keep kPrefetchAhead bytes in flight.
                       const uint8_t* pf = wp + r0 * row_bytes;
                       const uint8_t* pf_end = std::min(w_end, wp + r1 * row_bytes);
                       const uint8_t* pf_stop = std::min(pf_end, pf + kPrefetchAhead);
                       for (; pf < pf_stop; pf += 64) __builtin_prefetch(pf);
                       auto keep_ahead = [&](int64_t row) {
                         const uint8_t* want = std::min(pf_end, wp + row * row_bytes + kPrefetchAhead);
                         for (; pf < want; pf += 64) __builtin_prefetch(pf);
                       };
#ifdef MAGICPIG_HAVE_AVX2_PATH
                       if (four) {
                         float y4[4];
                         for (; r + 4 <= r1; r += 4) {
                           keep_ahead(r + 4);
                           for (int64_t t = 0; t < M; ++t) {
                             DotQ4_1Avx2x4(wp + r * row_bytes, row_bytes, xk + t * In, xsum + t * nb,
                                           nb, y4);
                             for (int k = 0; k < 4; ++k) yp[t * Out + r + k] = y4[k];
                           }
                         }
                       }
#endif
                       for (; r < r1; ++r) {
                         keep_ahead(r + 1);
                         const uint8_t* row = wp + r * row_bytes;
                         for (int64_t t = 0; t < M; ++t) {
                           yp[t * Out + r] = dot(row, xk + t * In, xsum + t * nb, nb);
                         }
                       }
                       return ffi::Error::Success();
                     });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MagicpigQuantMatvec, QuantMatvecImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("qtype")
                                  .Attr<int64_t>("impl")
                                  .Attr<int64_t>("max_threads"));
