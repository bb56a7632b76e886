// Products with GGUF weights read in place, and their dequantization (XLA FFI, CPU).
//
// Decoding one token multiplies each weight matrix by a single activation vector: the cost is
// the bytes of the weights. The model keeps every matrix in its file's own format (no float32
// copy), and this op computes y = W x straight from the rows: blocks are dequantized in
// registers in float32 as ggml's dequantize_row_* (and gguf-py's gguf.quants.dequantize) do, so
// y equals x @ dequantize(W).T up to float32 summation order. Activations stay float32
// (llama.cpp instead rounds them to 8 bits).
//
// Types (ggml ids; the layouts are in magicpig_jax/io/gguf_blocks.py and ggml-common.h):
//   F16 (1), Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7), Q8_0 (8), Q4_K (12), Q5_K (13), Q6_K (14),
//   BF16 (30). A row of `In` weights is In / block_weights blocks of block_bytes each.
//
// Targets:
//   magicpig_quant_matvec: x float32 [M, In], w uint8 [Out, RB] -> y float32 [M, Out]
//   magicpig_dequantize:   w uint8 [R, RB] -> float32 [R, In], bit-equal to gguf-py's
//                          dequantization (the float32 operations in its order, no FMA).
// Every shape is validated; bad input returns an ffi::Error (never a crash or a stray read).
// This file is compiled with -ffp-contract=off (CMakeLists.txt), so that the scalar
// dequantization keeps gguf-py's roundings on every target; the AVX2 kernels use FMA explicitly.

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

constexpr int64_t kQK = 32;   // weights per legacy block, and per sub-block of Q4_K / Q5_K
constexpr int64_t kQKK = 256; // weights per K-quant super-block

enum QType : int64_t {
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kBF16 = 30,
};

struct TypeInfo {
  int64_t block_weights = 0, block_bytes = 0;
  bool has_min = false;  // w = d q + m form: the kernels need the sums of x per 32 weights
};

TypeInfo Info(int64_t qtype) {
  switch (qtype) {
    case kF16: return {1, 2, false};
    case kBF16: return {1, 2, false};
    case kQ4_0: return {32, 18, false};
    case kQ4_1: return {32, 20, true};
    case kQ5_0: return {32, 22, false};
    case kQ5_1: return {32, 24, true};
    case kQ8_0: return {32, 34, false};
    case kQ4_K: return {256, 144, true};
    case kQ5_K: return {256, 176, true};
    case kQ6_K: return {256, 210, false};
    default: return {};
  }
}

const char* kTypeList = "1 (F16), 2 (Q4_0), 3 (Q4_1), 6 (Q5_0), 7 (Q5_1), 8 (Q8_0), 12 (Q4_K), 13 (Q5_K), "
                        "14 (Q6_K) or 30 (BF16)";

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

inline float Bf16ToFloat(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return magicpig::Bf16ToF32(h);
}

inline uint32_t LoadU32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K super-block (ggml get_scale_min_k4).
inline void ScaleMinK4(int j, const uint8_t* q, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// ---------------------------------------------------------------------------------------------
// Scalar dequantization of one block, in gguf-py's float32 operations and order (no FMA: this
// file is compiled with -ffp-contract=off). y receives Info(qtype).block_weights values.
// ---------------------------------------------------------------------------------------------
void DequantBlock(int64_t qtype, const uint8_t* b, float* y) {
  switch (qtype) {
    case kF16:
      y[0] = HalfToFloat(b);
      return;
    case kBF16:
      y[0] = Bf16ToFloat(b);
      return;
    case kQ4_0: {
      const float d = HalfToFloat(b);
      const uint8_t* qs = b + 2;
      for (int j = 0; j < 16; ++j) {
        y[j] = d * static_cast<float>((qs[j] & 15) - 8);
        y[j + 16] = d * static_cast<float>((qs[j] >> 4) - 8);
      }
      return;
    }
    case kQ4_1: {
      const float d = HalfToFloat(b), m = HalfToFloat(b + 2);
      const uint8_t* qs = b + 4;
      for (int j = 0; j < 16; ++j) {
        y[j] = d * static_cast<float>(qs[j] & 15) + m;
        y[j + 16] = d * static_cast<float>(qs[j] >> 4) + m;
      }
      return;
    }
    case kQ5_0:
    case kQ5_1: {
      const bool q51 = qtype == kQ5_1;
      const float d = HalfToFloat(b), m = q51 ? HalfToFloat(b + 2) : 0.0f;
      const uint32_t qh = LoadU32(b + (q51 ? 4 : 2));
      const uint8_t* qs = b + (q51 ? 8 : 6);
      for (int j = 0; j < 16; ++j) {
        const int lo = (qs[j] & 15) | static_cast<int>(((qh >> j) & 1u) << 4);
        const int hi = (qs[j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1u) << 4);
        if (q51) {
          y[j] = d * static_cast<float>(lo) + m;
          y[j + 16] = d * static_cast<float>(hi) + m;
        } else {
          y[j] = d * static_cast<float>(lo - 16);
          y[j + 16] = d * static_cast<float>(hi - 16);
        }
      }
      return;
    }
    case kQ8_0: {
      const float d = HalfToFloat(b);
      const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
      for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(qs[j]) * d;
      return;
    }
    case kQ4_K:
    case kQ5_K: {
      const bool q5 = qtype == kQ5_K;
      const float d = HalfToFloat(b), dmin = HalfToFloat(b + 2);
      const uint8_t* scales = b + 4;
      const uint8_t* qh = b + 16;               // Q5_K only
      const uint8_t* qs = b + (q5 ? 48 : 16);
      for (int i = 0; i < 8; ++i) {
        int sc, m;
        ScaleMinK4(i, scales, &sc, &m);
        const float d1 = d * static_cast<float>(sc), m1 = dmin * static_cast<float>(m);
        const uint8_t* q = qs + 32 * (i / 2);
        const int shift = (i & 1) * 4;
        for (int l = 0; l < 32; ++l) {
          int v = (q[l] >> shift) & 15;
          if (q5) v |= ((qh[l] >> i) & 1) << 4;
          y[32 * i + l] = d1 * static_cast<float>(v) - m1;
        }
      }
      return;
    }
    case kQ6_K: {
      const float d = HalfToFloat(b + 208);
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      for (int h = 0; h < 2; ++h) {
        const uint8_t* ql = b + 64 * h;
        const uint8_t* qh = b + 128 + 32 * h;
        const int8_t* s = sc + 8 * h;
        float* yh = y + 128 * h;
        for (int l = 0; l < 32; ++l) {
          const int is = l / 16;
          const int q1 = ((ql[l] & 15) | (((qh[l] >> 0) & 3) << 4)) - 32;
          const int q2 = ((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32;
          const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
          const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
          yh[l] = (d * static_cast<float>(s[is + 0])) * static_cast<float>(q1);
          yh[l + 32] = (d * static_cast<float>(s[is + 2])) * static_cast<float>(q2);
          yh[l + 64] = (d * static_cast<float>(s[is + 4])) * static_cast<float>(q3);
          yh[l + 96] = (d * static_cast<float>(s[is + 6])) * static_cast<float>(q4);
        }
      }
      return;
    }
    default:
      return;
  }
}

void DequantRow(int64_t qtype, const uint8_t* row, int64_t In, float* y) {
  const TypeInfo t = Info(qtype);
  if (qtype == kF16) {
    for (int64_t j = 0; j < In; ++j) y[j] = HalfToFloat(row + 2 * j);
  } else if (qtype == kBF16) {
    for (int64_t j = 0; j < In; ++j) y[j] = Bf16ToFloat(row + 2 * j);
  } else {
    for (int64_t b = 0; b < In / t.block_weights; ++b) {
      DequantBlock(qtype, row + b * t.block_bytes, y + b * t.block_weights);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Dot kernels: one row of `In` weights against one activation vector. xsum[g] = the sum of
// x over weights 32g .. 32g+31 (the "+ m" terms of the types with a min); xp = x, or for the
// AVX2 Q4_1 kernels x permuted by PermuteQ4_1.
// ---------------------------------------------------------------------------------------------
using DotFn = float (*)(const uint8_t* row, const float* xp, const float* xsum, int64_t In);

// Portable: each block dequantized exactly (DequantBlock), then summed in float32.
template <int64_t kType>
float DotScalar(const uint8_t* row, const float* x, const float*, int64_t In) {
  const TypeInfo t = Info(kType);
  float acc = 0.0f;
  if (kType == kF16 || kType == kBF16) {
    for (int64_t j = 0; j < In; ++j) {
      acc += (kType == kF16 ? HalfToFloat(row + 2 * j) : Bf16ToFloat(row + 2 * j)) * x[j];
    }
    return acc;
  }
  float w[kQKK];
  for (int64_t b = 0; b < In / t.block_weights; ++b) {
    DequantBlock(kType, row + b * t.block_bytes, w);
    const float* xb = x + b * t.block_weights;
    float s = 0.0f;
    for (int64_t j = 0; j < t.block_weights; ++j) s += w[j] * xb[j];
    acc += s;
  }
  return acc;
}

// The original Q4_1 scalar kernel (d * sum(q x) + m * sum(x) per block).
float DotQ4_1Scalar(const uint8_t* row, const float* x, const float* xsum, int64_t In) {
  const int64_t nb = In / kQK;
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

#ifdef MAGICPIG_HAVE_AVX2_PATH
using magicpig::Hsum;

#define AVX2_FN __attribute__((target("avx2,fma,f16c")))
// The small helpers of the kernels are always inlined: GCC kept BlockQ4 out of line, and a call
// in the block loop spills every ymm accumulator (all caller-saved) to the stack and back, which
// made the Q4_1 kernel latency-bound (docs/benchmarks.md).
#define AVX2_INLINE __attribute__((target("avx2,fma,f16c"), always_inline)) inline

AVX2_INLINE float HalfToFloatF16c(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

AVX2_INLINE __m256 I8ToF32(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }
// 8 bytes -> 8 int32 lanes.
AVX2_INLINE __m256i U8x8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
AVX2_INLINE __m256 Cvt(__m256i v) { return _mm256_cvtepi32_ps(v); }

// The AVX2 Q4_1 kernels avoid byte shuffles (the bottleneck port of a cvtepu8 unpacking):
// the 16 bytes of a block are broadcast to both 128-bit lanes, and vector k (k = 0..3) keeps
// one nibble of each 32-bit lane with an AND, leaving q * 2^s in the lane, s its bit position.
// Lane i (i < 4) of vector k then holds weight 4i + k (low nibble of byte 4i + k); lane 4 + i
// holds weight 4i + k + 16 (its high nibble). The activations are permuted to that order and
// scaled by 2^-s once per call (PermuteQ4_1), so (q 2^s)(x 2^-s) = q x exactly: powers of two.
// Vector 3 is shifted right by 4 first, so no lane keeps bit 31 (int32 -> float stays exact).
constexpr int kQ4Shift[4][2] = {{0, 4}, {8, 12}, {16, 20}, {20, 24}};  // s of lanes 0-3, 4-7

// 2^-s as a float: a product with it is rounded once, like std::ldexp(x, -s), without the call
// (a libc call per activation showed in the one-token profile).
constexpr float Pow2Neg(int s) { return s == 0 ? 1.0f : 0.5f * Pow2Neg(s - 1); }
constexpr float kQ4Scale[4][2] = {{Pow2Neg(0), Pow2Neg(4)}, {Pow2Neg(8), Pow2Neg(12)},
                                  {Pow2Neg(16), Pow2Neg(20)}, {Pow2Neg(20), Pow2Neg(24)}};  // 2^-kQ4Shift
static_assert(kQ4Scale[3][1] * 16777216.0f == 1.0f, "kQ4Scale must be 2^-kQ4Shift");

// xp [nb * 32] = the activations of x [nb * 32] in the lane order above, scaled by 2^-s.
void PermuteQ4_1(const float* x, int64_t nb, float* xp) {
  for (int64_t b = 0; b < nb; ++b) {
    for (int k = 0; k < 4; ++k) {
      for (int i = 0; i < 4; ++i) {
        xp[b * kQK + 8 * k + i] = x[b * kQK + 4 * i + k] * kQ4Scale[k][0];
        xp[b * kQK + 8 * k + 4 + i] = x[b * kQK + 4 * i + k + 16] * kQ4Scale[k][1];
      }
    }
  }
}

struct Q4Masks {
  __m256i m[4];
};

AVX2_INLINE Q4Masks MakeQ4Masks() {
  Q4Masks q;
  for (int k = 0; k < 4; ++k) {
    const int lo = 0xf << kQ4Shift[k][0], hi = 0xf << kQ4Shift[k][1];
    q.m[k] = _mm256_setr_epi32(lo, lo, lo, lo, hi, hi, hi, hi);
  }
  return q;
}

// s = sum over the block of q_j * x_j (x permuted and scaled by PermuteQ4_1).
AVX2_INLINE __m256 BlockQ4(const uint8_t* qs, const Q4Masks& mk, __m256 x0, __m256 x1, __m256 x2, __m256 x3) {
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
AVX2_FN void DotQ4_1Avx2x4(const uint8_t* row0, int64_t stride, const float* xp, const float* xsum, int64_t nb,
                           float* out) {
  const Q4Masks mk = MakeQ4Masks();
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  float macc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = xp + b * kQK;
    const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8);
    const __m256 x2 = _mm256_loadu_ps(xb + 16), x3 = _mm256_loadu_ps(xb + 24);
    const float xs = xsum[b];
    #pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      const uint8_t* blk = row0 + r * stride + b * 20;
      const __m256 s = BlockQ4(blk + 4, mk, x0, x1, x2, x3);
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(HalfToFloatF16c(blk)), s, acc[r]);
      macc[r] += HalfToFloatF16c(blk + 2) * xs;
    }
  }
  #pragma GCC unroll 4
  for (int r = 0; r < 4; ++r) out[r] = Hsum(acc[r]) + macc[r];
  _mm256_zeroupper();
}

// One row; xp permuted by PermuteQ4_1.
AVX2_FN float DotQ4_1Avx2(const uint8_t* row, const float* xp, const float* xsum, int64_t In) {
  const int64_t nb = In / kQK;
  const Q4Masks mk = MakeQ4Masks();
  __m256 acc = _mm256_setzero_ps();
  float macc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * 20;
    const float* xb = xp + b * kQK;
    const __m256 s = BlockQ4(blk + 4, mk, _mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8), _mm256_loadu_ps(xb + 16),
                             _mm256_loadu_ps(xb + 24));
    acc = _mm256_fmadd_ps(_mm256_set1_ps(HalfToFloatF16c(blk)), s, acc);
    macc += HalfToFloatF16c(blk + 2) * xsum[b];
  }
  const float r = Hsum(acc) + macc;
  _mm256_zeroupper();
  return r;
}

// Q4_K with the same AND-mask kernel (BlockQ4): the 16 bytes of half h of group g hold weight
// 16h + j of sub-block 2g (low nibble of byte j) and of sub-block 2g + 1 (high nibble), so in
// each vector lanes 0-3 belong to sub-block 2g and lanes 4-7 to 2g + 1, and one FMA applies
// both sub-blocks' scales. xp: x permuted by PermuteQ4K.
void PermuteQ4K(const float* x, int64_t ngroups, float* xp) {
  for (int64_t g = 0; g < ngroups; ++g) {
    const float* xg = x + 64 * g;
    float* pg = xp + 64 * g;
    for (int h = 0; h < 2; ++h) {
      for (int k = 0; k < 4; ++k) {
        for (int i = 0; i < 4; ++i) {
          pg[32 * h + 8 * k + i] = xg[16 * h + 4 * i + k] * kQ4Scale[k][0];
          pg[32 * h + 8 * k + 4 + i] = xg[32 + 16 * h + 4 * i + k] * kQ4Scale[k][1];
        }
      }
    }
  }
}

// The eight sub-block scales d * sc and mins dmin * m of a Q4_K / Q5_K super-block (ScaleMinK4
// for all eight at once, four bytes per 32-bit word), rounded as gguf-py rounds them.
AVX2_INLINE void ScalesMinsK4Avx2(const uint8_t* blk, __m256* dsc, __m256* dm) {
  uint32_t w[3];
  std::memcpy(w, blk + 4, 12);
  const uint64_t sc = (w[0] & 0x3f3f3f3fu) |
                      (static_cast<uint64_t>((w[2] & 0x0f0f0f0fu) | ((w[0] >> 2) & 0x30303030u)) << 32);
  const uint64_t mn = (w[1] & 0x3f3f3f3fu) |
                      (static_cast<uint64_t>(((w[2] >> 4) & 0x0f0f0f0fu) | ((w[1] >> 2) & 0x30303030u)) << 32);
  const __m128i sc8 = _mm_cvtsi64_si128(static_cast<long long>(sc));
  const __m128i mn8 = _mm_cvtsi64_si128(static_cast<long long>(mn));
  *dsc = _mm256_mul_ps(_mm256_set1_ps(HalfToFloatF16c(blk)), Cvt(_mm256_cvtepu8_epi32(sc8)));
  *dm = _mm256_mul_ps(_mm256_set1_ps(HalfToFloatF16c(blk + 2)), Cvt(_mm256_cvtepu8_epi32(mn8)));
}

// R rows at a time (R = 1 or 4), as DotQ4_1Avx2x4. Per row and super-block the scales are
// decoded once; the mins meet the sums of x per sub-block (xsum) in one 8-lane FMA.
template <int R>
AVX2_FN void DotQ4KAvx2Rows(const uint8_t* row0, int64_t stride, const float* xp, const float* xsum, int64_t In,
                            float* out) {
  const Q4Masks mk = MakeQ4Masks();
  const int64_t nb = In / kQKK;
  __m256 acc[R], macc[R];
  #pragma GCC unroll 4
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), macc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m256 xs = _mm256_loadu_ps(xsum + b * 8);
    __m256 dsc[R];
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      __m256 dm;
      ScalesMinsK4Avx2(row0 + r * stride + b * 144, &dsc[r], &dm);
      macc[r] = _mm256_fmadd_ps(dm, xs, macc[r]);
    }
    for (int g = 0; g < 4; ++g) {
      // lanes 0-3: the scale of sub-block 2g, lanes 4-7: of 2g + 1
      const __m256i pick = _mm256_setr_epi32(2 * g, 2 * g, 2 * g, 2 * g, 2 * g + 1, 2 * g + 1, 2 * g + 1, 2 * g + 1);
      const float* xg = xp + b * kQKK + 64 * g;
      __m256 scale[R];
      #pragma GCC unroll 4
      for (int r = 0; r < R; ++r) scale[r] = _mm256_permutevar8x32_ps(dsc[r], pick);
      for (int h = 0; h < 2; ++h) {
        const __m256 x0 = _mm256_loadu_ps(xg + 32 * h), x1 = _mm256_loadu_ps(xg + 32 * h + 8);
        const __m256 x2 = _mm256_loadu_ps(xg + 32 * h + 16), x3 = _mm256_loadu_ps(xg + 32 * h + 24);
        #pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const uint8_t* q = row0 + r * stride + b * 144 + 16 + 32 * g + 16 * h;
          acc[r] = _mm256_fmadd_ps(scale[r], BlockQ4(q, mk, x0, x1, x2, x3), acc[r]);
        }
      }
    }
  }
  #pragma GCC unroll 4
  for (int r = 0; r < R; ++r) out[r] = Hsum(acc[r]) - Hsum(macc[r]);
  _mm256_zeroupper();
}

AVX2_FN float DotQ4KAvx2(const uint8_t* row, const float* xp, const float* xsum, int64_t In) {
  float y;
  DotQ4KAvx2Rows<1>(row, 0, xp, xsum, In, &y);
  return y;
}

// Token-blocked kernels (token_kernels.inc): one row against T <= kTokenBlock tokens. A
// block's weights are unpacked and converted to float once and meet every token's activations,
// instead of once per token (a batched decode step multiplies each weight by B token rows). Per
// token the operations and their order are those of the one-token kernels (DotQ4_1Avx2,
// DotQ4KAvx2Rows, DotQ8_0Avx2, DotQ6KAvx2Perm), so each token's result is bit-identical to computing it
// alone (this file is compiled without FP contraction): a batch row does not depend on the others.
constexpr int kTokenBlock = 8;

AVX2_FN float DotQ8_0Avx2(const uint8_t* row, const float* x, const float*, int64_t In) {
  const int64_t nb = In / kQK;
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

// sum_j q_j x_j over 32 weights given as four vectors of 8 int32 lanes in weight order.
AVX2_INLINE __m256 Dot32(__m256i q0, __m256i q1, __m256i q2, __m256i q3, const float* x) {
  __m256 s = _mm256_mul_ps(Cvt(q0), _mm256_loadu_ps(x));
  s = _mm256_fmadd_ps(Cvt(q1), _mm256_loadu_ps(x + 8), s);
  s = _mm256_fmadd_ps(Cvt(q2), _mm256_loadu_ps(x + 16), s);
  return _mm256_fmadd_ps(Cvt(q3), _mm256_loadu_ps(x + 24), s);
}

// Q4_0 / Q5_0 / Q5_1: the nibbles of 16 bytes (byte j: weights j and j + 16), the fifth bits
// from a 32-bit qh (bit j: weight j), minus `offset` (8, 16, or 0 for Q5_1, whose min is
// added through xsum). The integer lanes are exact, so each product q x is exact.
template <int64_t kType>
AVX2_FN float DotLegacyAvx2(const uint8_t* row, const float* x, const float* xsum, int64_t In) {
  constexpr bool kHasQh = kType == kQ5_0 || kType == kQ5_1;
  constexpr bool kHasMin = kType == kQ5_1;
  constexpr int64_t kBB = kType == kQ4_0 ? 18 : kType == kQ5_0 ? 22 : 24;
  constexpr int kQhAt = kHasMin ? 4 : 2;
  constexpr int kQsAt = kType == kQ4_0 ? 2 : kHasMin ? 8 : 6;
  const __m256i offset = _mm256_set1_epi32(kType == kQ4_0 ? 8 : kType == kQ5_0 ? 16 : 0);
  const __m256i low4 = _mm256_set1_epi32(15), one = _mm256_set1_epi32(1);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i sh8 = _mm256_set1_epi32(8);
  const int64_t nb = In / kQK;
  __m256 acc = _mm256_setzero_ps();
  float macc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * kBB;
    const uint8_t* qs = blk + kQsAt;
    const __m256i a = U8x8(qs), c = U8x8(qs + 8);
    __m256i q0 = _mm256_and_si256(a, low4), q1 = _mm256_and_si256(c, low4);
    __m256i q2 = _mm256_srli_epi32(a, 4), q3 = _mm256_srli_epi32(c, 4);
    if (kHasQh) {
      const __m256i qh = _mm256_set1_epi32(static_cast<int>(LoadU32(blk + kQhAt)));
      const __m256i s0 = lane, s1 = _mm256_add_epi32(lane, sh8);
      const __m256i s2 = _mm256_add_epi32(s1, sh8), s3 = _mm256_add_epi32(s2, sh8);
      q0 = _mm256_or_si256(q0, _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(qh, s0), one), 4));
      q1 = _mm256_or_si256(q1, _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(qh, s1), one), 4));
      q2 = _mm256_or_si256(q2, _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(qh, s2), one), 4));
      q3 = _mm256_or_si256(q3, _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(qh, s3), one), 4));
    }
    if (!kHasMin) {
      q0 = _mm256_sub_epi32(q0, offset);
      q1 = _mm256_sub_epi32(q1, offset);
      q2 = _mm256_sub_epi32(q2, offset);
      q3 = _mm256_sub_epi32(q3, offset);
    }
    const __m256 s = Dot32(q0, q1, q2, q3, x + b * kQK);
    acc = _mm256_fmadd_ps(_mm256_set1_ps(HalfToFloatF16c(blk)), s, acc);
    if (kHasMin) macc += HalfToFloatF16c(blk + 2) * xsum[b];
  }
  const float r = Hsum(acc) + macc;
  _mm256_zeroupper();
  return r;
}

// (bit c of each lane) << 4.
AVX2_INLINE __m256i FifthBit(__m256i hv, __m128i c, __m256i one) {
  return _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(hv, c), one), 4);
}

// Q5_K (and the plain form of Q4_K): per super-block, eight sub-blocks of 32 with their own
// scale d*sc and min dmin*m (the min term through xsum). Bytes 32g..32g+31 hold sub-block 2g (low nibbles) and
// 2g + 1 (high nibbles); Q5_K's bit i of qh[l] is the fifth bit of weight l of sub-block i.
template <bool kQ5>
AVX2_FN float DotQ45KAvx2(const uint8_t* row, const float* x, const float* xsum, int64_t In) {
  constexpr int64_t kBB = kQ5 ? 176 : 144;
  const __m256i low4 = _mm256_set1_epi32(15), one = _mm256_set1_epi32(1);
  const int64_t nb = In / kQKK;
  __m256 acc = _mm256_setzero_ps();
  float macc = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * kBB;
    const float d = HalfToFloatF16c(blk), dmin = HalfToFloatF16c(blk + 2);
    const uint8_t* scales = blk + 4;
    const uint8_t* qs = blk + (kQ5 ? 48 : 16);
    const float* xb = x + b * kQKK;
    const float* xs = xsum + b * 8;
    __m256i h[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
    if (kQ5) {
      for (int k = 0; k < 4; ++k) h[k] = U8x8(blk + 16 + 8 * k);
    }
    float mins = 0.0f;
    for (int g = 0; g < 4; ++g) {
      int sc0, m0, sc1, m1;
      ScaleMinK4(2 * g, scales, &sc0, &m0);
      ScaleMinK4(2 * g + 1, scales, &sc1, &m1);
      const uint8_t* q = qs + 32 * g;
      const __m256i a0 = U8x8(q), a1 = U8x8(q + 8), a2 = U8x8(q + 16), a3 = U8x8(q + 24);
      __m256i l0 = _mm256_and_si256(a0, low4), l1 = _mm256_and_si256(a1, low4);
      __m256i l2 = _mm256_and_si256(a2, low4), l3 = _mm256_and_si256(a3, low4);
      __m256i u0 = _mm256_srli_epi32(a0, 4), u1 = _mm256_srli_epi32(a1, 4);
      __m256i u2 = _mm256_srli_epi32(a2, 4), u3 = _mm256_srli_epi32(a3, 4);
      if (kQ5) {
        const __m128i cl = _mm_cvtsi32_si128(2 * g), cu = _mm_cvtsi32_si128(2 * g + 1);
        l0 = _mm256_or_si256(l0, FifthBit(h[0], cl, one));
        l1 = _mm256_or_si256(l1, FifthBit(h[1], cl, one));
        l2 = _mm256_or_si256(l2, FifthBit(h[2], cl, one));
        l3 = _mm256_or_si256(l3, FifthBit(h[3], cl, one));
        u0 = _mm256_or_si256(u0, FifthBit(h[0], cu, one));
        u1 = _mm256_or_si256(u1, FifthBit(h[1], cu, one));
        u2 = _mm256_or_si256(u2, FifthBit(h[2], cu, one));
        u3 = _mm256_or_si256(u3, FifthBit(h[3], cu, one));
      }
      const float* xg = xb + 64 * g;
      const __m256 sl = Dot32(l0, l1, l2, l3, xg);
      const __m256 su = Dot32(u0, u1, u2, u3, xg + 32);
      acc = _mm256_fmadd_ps(_mm256_set1_ps(d * static_cast<float>(sc0)), sl, acc);
      acc = _mm256_fmadd_ps(_mm256_set1_ps(d * static_cast<float>(sc1)), su, acc);
      mins += (dmin * static_cast<float>(m0)) * xs[2 * g] + (dmin * static_cast<float>(m1)) * xs[2 * g + 1];
    }
    macc -= mins;
  }
  const float r = Hsum(acc) + macc;
  _mm256_zeroupper();
  return r;
}

// Q6_K without byte shuffles, as BlockQ4: 32 bytes of ql (l = 0..31), of ql + 32 and of qh are
// loaded as eight 32-bit lanes (lane i holds bytes 4i..4i+3), and vector k (k = 0..3) keeps byte
// 4i + k of each lane with AND masks: for the four weight groups g of a half (weights 32g + l),
//   g = 0: ql[l] & 15 | (qh[l] & 3) << 4        g = 1: ql[l+32] & 15 | (qh[l] >> 2 & 3) << 4
//   g = 2: ql[l] >> 4 | (qh[l] >> 4 & 3) << 4   g = 3: ql[l+32] >> 4 | (qh[l] >> 6) << 4
// each left at bit 8k of the lane, minus 32 << 8k: exact integers (q - 32) 2^8k. The activations
// are permuted to that order and scaled by 2^-8k once per call (PermuteQ6K). Lanes 0-3 are l < 16
// (scale index 2g of the half) and lanes 4-7 l >= 16 (2g + 1): one FMA applies both scales.
constexpr float kQ6Scale[4] = {Pow2Neg(0), Pow2Neg(8), Pow2Neg(16), Pow2Neg(24)};  // 2^-8k
void PermuteQ6K(const float* x, int64_t nhalves, float* xp) {
  for (int64_t h = 0; h < nhalves; ++h) {
    for (int g = 0; g < 4; ++g) {
      for (int k = 0; k < 4; ++k) {
        for (int i = 0; i < 8; ++i) {
          xp[128 * h + 32 * g + 8 * k + i] = x[128 * h + 32 * g + 4 * i + k] * kQ6Scale[k];
        }
      }
    }
  }
}

// Half h of a Q6_K super-block: d * sc of its eight 16-weight groups (gguf-py's float32
// product), and in v every byte of its four groups, the nibble in bits 0-3 and its two high
// bits in bits 4-5.
AVX2_INLINE __m256 Q6KHalf(const uint8_t* blk, int h, __m256 d, __m128i sc16, __m256i v[4]) {
  const __m256i m4 = _mm256_set1_epi32(0x0f0f0f0f), m2 = _mm256_set1_epi32(0x30303030);
  const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h));
  const __m256i qlb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * h + 32));
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
  v[0] = _mm256_or_si256(_mm256_and_si256(ql, m4), _mm256_and_si256(_mm256_slli_epi32(qh, 4), m2));
  v[1] = _mm256_or_si256(_mm256_and_si256(qlb, m4), _mm256_and_si256(_mm256_slli_epi32(qh, 2), m2));
  v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(ql, 4), m4), _mm256_and_si256(qh, m2));
  v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(qlb, 4), m4),
                         _mm256_and_si256(_mm256_srli_epi32(qh, 2), m2));
  return _mm256_mul_ps(d, Cvt(_mm256_cvtepi8_epi32(h ? _mm_srli_si128(sc16, 8) : sc16)));
}

AVX2_FN float DotQ6KAvx2Perm(const uint8_t* row, const float* xp, const float*, int64_t In) {
  const int64_t nb = In / kQKK;
  __m256i pick[4], mask[4], off[4];  // per group g: the scales' lanes; per byte k: its mask and 32 << 8k
  for (int i = 0; i < 4; ++i) {
    pick[i] = _mm256_setr_epi32(2 * i, 2 * i, 2 * i, 2 * i, 2 * i + 1, 2 * i + 1, 2 * i + 1, 2 * i + 1);
    mask[i] = _mm256_set1_epi32(0x3f << (8 * i));
    off[i] = _mm256_set1_epi32(32 << (8 * i));
  }
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * 210;
    const __m256 d = _mm256_set1_ps(HalfToFloatF16c(blk + 208));
    const __m128i sc16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
    for (int h = 0; h < 2; ++h) {
      __m256i v[4];
      const __m256 dsc = Q6KHalf(blk, h, d, sc16, v);
      const float* xh = xp + b * kQKK + 128 * h;
      for (int g = 0; g < 4; ++g) {
        const __m256 scale = _mm256_permutevar8x32_ps(dsc, pick[g]);
        const float* xg = xh + 32 * g;
        // two chains of two products (latency), summed
        __m256 t0 = _mm256_mul_ps(Cvt(_mm256_sub_epi32(_mm256_and_si256(v[g], mask[0]), off[0])), _mm256_loadu_ps(xg));
        __m256 t1 = _mm256_mul_ps(Cvt(_mm256_sub_epi32(_mm256_and_si256(v[g], mask[1]), off[1])),
                                  _mm256_loadu_ps(xg + 8));
        t0 = _mm256_fmadd_ps(Cvt(_mm256_sub_epi32(_mm256_and_si256(v[g], mask[2]), off[2])), _mm256_loadu_ps(xg + 16),
                             t0);
        t1 = _mm256_fmadd_ps(Cvt(_mm256_sub_epi32(_mm256_and_si256(v[g], mask[3]), off[3])), _mm256_loadu_ps(xg + 24),
                             t1);
        const __m256 t = _mm256_add_ps(t0, t1);
        if (g & 1) {
          acc1 = _mm256_fmadd_ps(scale, t, acc1);
        } else {
          acc0 = _mm256_fmadd_ps(scale, t, acc0);
        }
      }
    }
  }
  const float r = Hsum(_mm256_add_ps(acc0, acc1));
  _mm256_zeroupper();
  return r;
}

// F16 / BF16 rows: 32 weights per iteration in four independent chains, then a scalar tail.
template <int64_t kType>
AVX2_INLINE __m256 Load8Half(const uint8_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if (kType == kF16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <int64_t kType>
AVX2_FN float DotHalfAvx2(const uint8_t* row, const float* x, const float*, int64_t In) {
#define load8(j) Load8Half<kType>(row + 2 * (j))
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= In; j += 32) {
    a0 = _mm256_fmadd_ps(load8(j), _mm256_loadu_ps(x + j), a0);
    a1 = _mm256_fmadd_ps(load8(j + 8), _mm256_loadu_ps(x + j + 8), a1);
    a2 = _mm256_fmadd_ps(load8(j + 16), _mm256_loadu_ps(x + j + 16), a2);
    a3 = _mm256_fmadd_ps(load8(j + 24), _mm256_loadu_ps(x + j + 24), a3);
  }
  for (; j + 8 <= In; j += 8) a0 = _mm256_fmadd_ps(load8(j), _mm256_loadu_ps(x + j), a0);
  float r = Hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; j < In; ++j) r += (kType == kF16 ? HalfToFloatF16c(row + 2 * j) : Bf16ToFloat(row + 2 * j)) * x[j];
  _mm256_zeroupper();
  return r;
#undef load8
}
// ---------------------------------------------------------------------------------------------
// AVX2 dequantization of a row, bit-equal to DequantBlock: the same float32 operations (a
// product, then a sum or difference, never fused), 8 weights at a time. Types without a
// vector path return false (the caller uses the scalar one).
// ---------------------------------------------------------------------------------------------
AVX2_INLINE void Store4(float* y, __m256 a, __m256 b, __m256 c, __m256 d) {
  _mm256_storeu_ps(y, a);
  _mm256_storeu_ps(y + 8, b);
  _mm256_storeu_ps(y + 16, c);
  _mm256_storeu_ps(y + 24, d);
}

AVX2_FN bool DequantRowAvx2(int64_t qtype, const uint8_t* row, int64_t In, float* y) {
  const __m256i low4 = _mm256_set1_epi32(15);
  switch (qtype) {
    case kF16:
    case kBF16: {
      int64_t j = 0;
      for (; j + 8 <= In; j += 8) {
        _mm256_storeu_ps(y + j, qtype == kF16 ? Load8Half<kF16>(row + 2 * j) : Load8Half<kBF16>(row + 2 * j));
      }
      for (; j < In; ++j) y[j] = qtype == kF16 ? HalfToFloat(row + 2 * j) : Bf16ToFloat(row + 2 * j);
      return true;
    }
    case kQ4_0:
    case kQ4_1: {
      const bool q41 = qtype == kQ4_1;
      const int64_t bb = q41 ? 20 : 18;
      const __m256i off = _mm256_set1_epi32(q41 ? 0 : 8);
      for (int64_t b = 0; b < In / kQK; ++b) {
        const uint8_t* blk = row + b * bb;
        const __m256 d = _mm256_set1_ps(HalfToFloatF16c(blk));
        const __m256 m = _mm256_set1_ps(q41 ? HalfToFloatF16c(blk + 2) : 0.0f);
        const uint8_t* qs = blk + (q41 ? 4 : 2);
        const __m256i a = U8x8(qs), c = U8x8(qs + 8);
        const __m256i q[4] = {_mm256_and_si256(a, low4), _mm256_and_si256(c, low4), _mm256_srli_epi32(a, 4),
                              _mm256_srli_epi32(c, 4)};
        __m256 w[4];
        for (int k = 0; k < 4; ++k) {
          w[k] = q41 ? _mm256_add_ps(_mm256_mul_ps(d, Cvt(q[k])), m) : _mm256_mul_ps(d, Cvt(_mm256_sub_epi32(q[k], off)));
        }
        Store4(y + b * kQK, w[0], w[1], w[2], w[3]);
      }
      return true;
    }
    case kQ8_0: {
      for (int64_t b = 0; b < In / kQK; ++b) {
        const uint8_t* blk = row + b * 34;
        const __m256 d = _mm256_set1_ps(HalfToFloatF16c(blk));
        const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
        const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18));
        Store4(y + b * kQK, _mm256_mul_ps(I8ToF32(q0), d), _mm256_mul_ps(I8ToF32(_mm_srli_si128(q0, 8)), d),
               _mm256_mul_ps(I8ToF32(q1), d), _mm256_mul_ps(I8ToF32(_mm_srli_si128(q1, 8)), d));
      }
      return true;
    }
    case kQ4_K: {
      for (int64_t b = 0; b < In / kQKK; ++b) {
        const uint8_t* blk = row + b * 144;
        __m256 dsc, dm;
        ScalesMinsK4Avx2(blk, &dsc, &dm);
        alignas(32) float d1[8], m1[8];
        _mm256_store_ps(d1, dsc);
        _mm256_store_ps(m1, dm);
        for (int g = 0; g < 4; ++g) {
          const uint8_t* q = blk + 16 + 32 * g;
          const __m256i a[4] = {U8x8(q), U8x8(q + 8), U8x8(q + 16), U8x8(q + 24)};
          const __m256 dl = _mm256_set1_ps(d1[2 * g]), ml = _mm256_set1_ps(m1[2 * g]);
          const __m256 du = _mm256_set1_ps(d1[2 * g + 1]), mu = _mm256_set1_ps(m1[2 * g + 1]);
          float* yg = y + b * kQKK + 64 * g;
          for (int k = 0; k < 4; ++k) {
            _mm256_storeu_ps(yg + 8 * k, _mm256_sub_ps(_mm256_mul_ps(dl, Cvt(_mm256_and_si256(a[k], low4))), ml));
            _mm256_storeu_ps(yg + 32 + 8 * k, _mm256_sub_ps(_mm256_mul_ps(du, Cvt(_mm256_srli_epi32(a[k], 4))), mu));
          }
        }
      }
      return true;
    }
    case kQ6_K: {
      const __m256i three = _mm256_set1_epi32(3), c32 = _mm256_set1_epi32(32);
      for (int64_t b = 0; b < In / kQKK; ++b) {
        const uint8_t* blk = row + b * 210;
        const __m256 d = _mm256_set1_ps(HalfToFloatF16c(blk + 208));
        const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
        alignas(32) float dsc[16];
        _mm256_store_ps(dsc, _mm256_mul_ps(d, Cvt(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc))))));
        _mm256_store_ps(dsc + 8,
                        _mm256_mul_ps(d, Cvt(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 8))))));
        for (int h = 0; h < 2; ++h) {
          const uint8_t* ql = blk + 64 * h;
          const uint8_t* qh = blk + 128 + 32 * h;
          float* yh = y + b * kQKK + 128 * h;
          for (int k = 0; k < 4; ++k) {  // l = 8k .. 8k + 7, scale index 8h + l / 16 + 2g
            const int l = 8 * k, is = 8 * h + l / 16;
            const __m256i a = U8x8(ql + l), c = U8x8(ql + l + 32), hh = U8x8(qh + l);
            const __m256i q[4] = {
                _mm256_or_si256(_mm256_and_si256(a, low4), _mm256_slli_epi32(_mm256_and_si256(hh, three), 4)),
                _mm256_or_si256(_mm256_and_si256(c, low4),
                                _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hh, 2), three), 4)),
                _mm256_or_si256(_mm256_srli_epi32(a, 4),
                                _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hh, 4), three), 4)),
                _mm256_or_si256(_mm256_srli_epi32(c, 4), _mm256_slli_epi32(_mm256_srli_epi32(hh, 6), 4))};
            for (int g = 0; g < 4; ++g) {
              const __m256 w = _mm256_mul_ps(_mm256_set1_ps(dsc[is + 2 * g]), Cvt(_mm256_sub_epi32(q[g], c32)));
              _mm256_storeu_ps(yh + 32 * g + l, w);
            }
          }
        }
      }
      return true;
    }
    default:
      return false;
  }
}

#define MAGICPIG_UNROLL_TOKENS _Pragma("GCC unroll 8")
namespace tokens_avx2 {
#define MAGICPIG_TOKENS_FN __attribute__((target("avx2,fma,f16c")))
#include "token_kernels.inc"
#undef MAGICPIG_TOKENS_FN
}  // namespace tokens_avx2
namespace tokens_wide {
#define MAGICPIG_TOKENS_FN __attribute__((target("avx2,fma,f16c,avx512f,avx512vl")))
#include "token_kernels.inc"
#undef MAGICPIG_TOKENS_FN
}  // namespace tokens_wide
#undef MAGICPIG_UNROLL_TOKENS

// AVX-512F + VL: the wide build of the token-blocked kernels (32 registers) runs.
inline bool CpuHasAvx512Vl() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
  return has;
}

// Kernel::Run<T>(args...) for a run-time T in [1, kTokenBlock], from the wide build or the AVX2 one.
template <class Wide, class Avx2, class... A>
void RunTokens(bool wide, int T, A... a) {
  static_assert(kTokenBlock == 8, "RunTokens dispatches T = 1..8");
  switch (T) {
    case 1: return wide ? Wide::template Run<1>(a...) : Avx2::template Run<1>(a...);
    case 2: return wide ? Wide::template Run<2>(a...) : Avx2::template Run<2>(a...);
    case 3: return wide ? Wide::template Run<3>(a...) : Avx2::template Run<3>(a...);
    case 4: return wide ? Wide::template Run<4>(a...) : Avx2::template Run<4>(a...);
    case 5: return wide ? Wide::template Run<5>(a...) : Avx2::template Run<5>(a...);
    case 6: return wide ? Wide::template Run<6>(a...) : Avx2::template Run<6>(a...);
    case 7: return wide ? Wide::template Run<7>(a...) : Avx2::template Run<7>(a...);
    default: return wide ? Wide::template Run<8>(a...) : Avx2::template Run<8>(a...);
  }
}
#endif  // MAGICPIG_HAVE_AVX2_PATH

// Bytes of weights kept requested ahead of the kernels (software prefetch). Measured on the
// 2-core machine, decoding SmolLM2 at 256 tokens of context: 18.0 ms/token without, 16.1 with
// 4096 (2048 and 8192 within noise of it, 16384 worse).
constexpr int64_t kPrefetchAhead = 4096;

DotFn PickKernel(int64_t qtype, bool avx2) {
#ifdef MAGICPIG_HAVE_AVX2_PATH
  if (avx2) {
    switch (qtype) {
      case kF16: return DotHalfAvx2<kF16>;
      case kBF16: return DotHalfAvx2<kBF16>;
      case kQ4_0: return DotLegacyAvx2<kQ4_0>;
      case kQ4_1: return DotQ4_1Avx2;
      case kQ5_0: return DotLegacyAvx2<kQ5_0>;
      case kQ5_1: return DotLegacyAvx2<kQ5_1>;
      case kQ8_0: return DotQ8_0Avx2;
      case kQ4_K: return DotQ4KAvx2;
      case kQ5_K: return DotQ45KAvx2<true>;
      case kQ6_K: return DotQ6KAvx2Perm;
      default: return nullptr;
    }
  }
#endif
  (void)avx2;
  switch (qtype) {
    case kF16: return DotScalar<kF16>;
    case kBF16: return DotScalar<kBF16>;
    case kQ4_0: return DotScalar<kQ4_0>;
    case kQ4_1: return DotQ4_1Scalar;
    case kQ5_0: return DotScalar<kQ5_0>;
    case kQ5_1: return DotScalar<kQ5_1>;
    case kQ8_0: return DotScalar<kQ8_0>;
    case kQ4_K: return DotScalar<kQ4_K>;
    case kQ5_K: return DotScalar<kQ5_K>;
    case kQ6_K: return DotScalar<kQ6_K>;
    default: return nullptr;
  }
}

// Checks qtype and the packed row width against In; returns an empty string when they agree.
std::string CheckRows(int64_t qtype, int64_t In, ffi::Span<const int64_t> wd, const char* what) {
  const TypeInfo t = Info(qtype);
  if (t.block_bytes == 0) return std::string("qtype must be ") + kTypeList + ", got " + std::to_string(qtype);
  if (In <= 0 || In % t.block_weights) {
    return "In must be a positive multiple of " + std::to_string(t.block_weights) + " for qtype " +
           std::to_string(qtype) + ", got " + std::to_string(In);
  }
  const int64_t rb = In / t.block_weights * t.block_bytes;
  if (wd.size() != 2 || wd[1] != rb) {
    return std::string(what) + " must be uint8 [Out, In/" + std::to_string(t.block_weights) + "*" +
           std::to_string(t.block_bytes) + "] = [Out, " + std::to_string(rb) + "] for In=" + std::to_string(In) +
           ", got " + Shape(wd);
  }
  return "";
}

ffi::Future QuantMatvecImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                            ffi::ResultBuffer<ffi::F32> y, int64_t qtype, int64_t impl, int64_t max_threads) {
  if (impl < 0 || impl > 2) return ReadyFuture(InvalidArg("impl must be 0 (auto), 1 (scalar) or 2 (avx2)"));
  if (impl == 2 && !CpuHasAvx2()) {
    return ReadyFuture(InvalidArg("impl=avx2 requested but the CPU lacks AVX2/FMA/F16C"));
  }
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto yd = y->dimensions();
  if (Info(qtype).block_bytes == 0) {
    return ReadyFuture(InvalidArg(std::string("qtype must be ") + kTypeList + ", got " + std::to_string(qtype)));
  }
  if (xd.size() != 2) return ReadyFuture(InvalidArg("x must be float32 [M, In], got " + Shape(xd)));
  const int64_t M = xd[0], In = xd[1];
  const std::string bad = CheckRows(qtype, In, wd, "w");
  if (!bad.empty()) return ReadyFuture(InvalidArg(bad + " (In is the last dim of x)"));
  const TypeInfo info = Info(qtype);
  const int64_t Out = wd[0];
  if (yd.size() != 2 || yd[0] != M || yd[1] != Out) {
    return ReadyFuture(InvalidArg("the result must be float32 [M, Out] = [" + std::to_string(M) + ", " +
                                  std::to_string(Out) + "], got " + Shape(yd)));
  }
  if (M == 0 || Out == 0) return ReadyFuture(ffi::Error::Success());
  const bool avx2 = impl != 1 && CpuHasAvx2();
#ifdef MAGICPIG_HAVE_AVX2_PATH
  // auto: the token-blocked kernels' 32-register build where the CPU has AVX-512VL; avx2: the
  // 16-register one (the same bits).
  const bool wide = impl == 0 && avx2 && CpuHasAvx512Vl();
#endif
  const DotFn dot = PickKernel(qtype, avx2);
  const bool permuted = avx2 && (qtype == kQ4_1 || qtype == kQ4_K || qtype == kQ6_K);  // x permuted for these
  const float* xp = x.typed_data();
  const uint8_t* wp = w.typed_data();
  float* yp = y->typed_data();

  // Per call, shared by the workers (kept alive by the lambda until the last one is done):
  // sums of x per 32 weights (the "+ m" terms) and, for the AVX2 Q4_1 kernels, x permuted
  // and scaled (PermuteQ4_1).
  struct Prepared {
    std::vector<float> xsum, xperm, xsum_t;  // xsum_t: per kTokenBlock tokens, [ng, kTokenBlock]
  };
  auto prep = std::make_shared<Prepared>();
  const int64_t ng = info.has_min ? In / kQK : 0;
  prep->xsum.assign(std::max<int64_t>(1, M * ng), 0.0f);
  for (int64_t t = 0; t < M && ng; ++t) {
    for (int64_t g = 0; g < ng; ++g) {
      float s = 0.0f;
      for (int64_t j = 0; j < kQK; ++j) s += xp[t * In + g * kQK + j];
      prep->xsum[t * ng + g] = s;
    }
  }
  // More than one token row: Q4_1, Q4_K, Q6_K and Q8_0 run the token-blocked kernels.
  const bool token_blocked =
      avx2 && M > 1 && (qtype == kQ4_1 || qtype == kQ4_K || qtype == kQ6_K || qtype == kQ8_0);
#ifdef MAGICPIG_HAVE_AVX2_PATH
  if (token_blocked && qtype == kQ4_1) {  // the Q4_1 token kernels read the sums token-minor
    prep->xsum_t.assign((M + kTokenBlock - 1) / kTokenBlock * ng * kTokenBlock, 0.0f);
    for (int64_t t = 0; t < M; ++t) {
      for (int64_t g = 0; g < ng; ++g) {
        prep->xsum_t[((t / kTokenBlock) * ng + g) * kTokenBlock + t % kTokenBlock] = prep->xsum[t * ng + g];
      }
    }
  }
  if (permuted) {
    prep->xperm.resize(M * In);
    for (int64_t t = 0; t < M; ++t) {
      if (qtype == kQ4_1) {
        PermuteQ4_1(xp + t * In, In / kQK, prep->xperm.data() + t * In);
      } else if (qtype == kQ4_K) {
        PermuteQ4K(xp + t * In, In / 64, prep->xperm.data() + t * In);
      } else {
        PermuteQ6K(xp + t * In, In / 128, prep->xperm.data() + t * In);
      }
    }
  }
#endif
  // Work items of about 64 KiB of weights, so small matrices run on the calling thread.
  const int64_t row_bytes = wd[1];
  const int64_t rows_per_item = std::max<int64_t>(8, (int64_t{64} << 10) / row_bytes / 4 * 4);
  const int64_t items = (Out + rows_per_item - 1) / rows_per_item;
  const uint8_t* w_end = wp + Out * row_bytes;
  return RunParallel(pool, items, max_threads, [=](int64_t item) -> ffi::Error {
    const float* xk = permuted ? prep->xperm.data() : xp;  // what the kernels read
    const float* xsum = prep->xsum.data();
    const int64_t r0 = item * rows_per_item;
    const int64_t r1 = std::min(Out, r0 + rows_per_item);
    int64_t r = r0;
    // The weights are read once per token, so they come from DRAM: request the first lines
    // of the item, then keep kPrefetchAhead bytes in flight.
    const uint8_t* pf = wp + r0 * row_bytes;
    const uint8_t* pf_end = std::min(w_end, wp + r1 * row_bytes);
    const uint8_t* pf_stop = std::min(pf_end, pf + kPrefetchAhead);
    for (; pf < pf_stop; pf += 64) __builtin_prefetch(pf);
    auto keep_ahead = [&](int64_t row) {
      const uint8_t* want = std::min(pf_end, wp + row * row_bytes + kPrefetchAhead);
      for (; pf < want; pf += 64) __builtin_prefetch(pf);
    };
#ifdef MAGICPIG_HAVE_AVX2_PATH
    if (token_blocked) {  // a batch: the token-blocked kernels
      float yt[kTokenBlock];
      for (; r < r1; ++r) {
        keep_ahead(r + 1);
        const uint8_t* row = wp + r * row_bytes;
        for (int64_t t0 = 0; t0 < M; t0 += kTokenBlock) {
          const int T = static_cast<int>(std::min<int64_t>(kTokenBlock, M - t0));
          if (qtype == kQ4_1) {
            RunTokens<tokens_wide::Q4_1Tokens, tokens_avx2::Q4_1Tokens>(
                wide, T, row, xk + t0 * In, prep->xsum_t.data() + t0 * ng, In, yt);
          } else if (qtype == kQ4_K) {
            RunTokens<tokens_wide::Q4KTokens, tokens_avx2::Q4KTokens>(wide, T, row, xk + t0 * In, xsum + t0 * ng,
                                                                      In, yt);
          } else if (qtype == kQ6_K) {
            RunTokens<tokens_wide::Q6KTokens, tokens_avx2::Q6KTokens>(wide, T, row, xk + t0 * In, In, yt);
          } else {
            RunTokens<tokens_wide::Q8_0Tokens, tokens_avx2::Q8_0Tokens>(wide, T, row, xk + t0 * In, In, yt);
          }
          for (int k = 0; k < T; ++k) yp[(t0 + k) * Out + r] = yt[k];
        }
      }
    }
    if (permuted && qtype != kQ6_K) {  // the four-row Q4_1 / Q4_K kernels (one token)
      float y4[4];
      for (; r + 4 <= r1; r += 4) {
        keep_ahead(r + 4);
        for (int64_t t = 0; t < M; ++t) {
          if (qtype == kQ4_1) {
            DotQ4_1Avx2x4(wp + r * row_bytes, row_bytes, xk + t * In, xsum + t * ng, In / kQK, y4);
          } else {
            DotQ4KAvx2Rows<4>(wp + r * row_bytes, row_bytes, xk + t * In, xsum + t * ng, In, y4);
          }
          for (int k = 0; k < 4; ++k) yp[t * Out + r + k] = y4[k];
        }
      }
    }
#endif
    for (; r < r1; ++r) {
      keep_ahead(r + 1);
      const uint8_t* row = wp + r * row_bytes;
      for (int64_t t = 0; t < M; ++t) yp[t * Out + r] = dot(row, xk + t * In, xsum + t * ng, In);
    }
    return ffi::Error::Success();
  });
}

ffi::Future DequantizeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> w, ffi::ResultBuffer<ffi::F32> y,
                           int64_t qtype, int64_t impl, int64_t max_threads) {
  if (impl < 0 || impl > 2) return ReadyFuture(InvalidArg("impl must be 0 (auto), 1 (scalar) or 2 (avx2)"));
  if (impl == 2 && !CpuHasAvx2()) {
    return ReadyFuture(InvalidArg("impl=avx2 requested but the CPU lacks AVX2/FMA/F16C"));
  }
  const bool avx2 = impl != 1 && CpuHasAvx2();
  const auto wd = w.dimensions();
  const auto yd = y->dimensions();
  if (yd.size() != 2) return ReadyFuture(InvalidArg("the result must be float32 [R, In], got " + Shape(yd)));
  const std::string bad = CheckRows(qtype, yd[1], wd, "w");
  if (!bad.empty()) return ReadyFuture(InvalidArg(bad + " (In is the last dim of the result)"));
  if (yd[0] != wd[0]) {
    return ReadyFuture(InvalidArg("the result must have as many rows as w: " + Shape(yd) + " vs " + Shape(wd)));
  }
  const int64_t R = wd[0], In = yd[1], row_bytes = wd[1];
  if (R == 0) return ReadyFuture(ffi::Error::Success());
  (void)avx2;
  const uint8_t* wp = w.typed_data();
  float* yp = y->typed_data();
  const int64_t rows_per_item = std::max<int64_t>(1, (int64_t{64} << 10) / row_bytes);
  const int64_t items = (R + rows_per_item - 1) / rows_per_item;
  return RunParallel(pool, items, max_threads, [=](int64_t item) -> ffi::Error {
    const int64_t r1 = std::min(R, (item + 1) * rows_per_item);
    for (int64_t r = item * rows_per_item; r < r1; ++r) {
#ifdef MAGICPIG_HAVE_AVX2_PATH
      if (avx2 && DequantRowAvx2(qtype, wp + r * row_bytes, In, yp + r * In)) continue;
#endif
      DequantRow(qtype, wp + r * row_bytes, In, yp + r * In);
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(MagicpigDequantize, DequantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("qtype")
                                  .Attr<int64_t>("impl")
                                  .Attr<int64_t>("max_threads"));
