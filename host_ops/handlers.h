// The XLA FFI handlers of the host op (one per jax.ffi.ffi_call target), for the module that
// registers them (module.cc), and the index limits they share with it.
#pragma once

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace magicpig {

constexpr int kMaxK = 16;             // bucket offsets are 2^K + 1 uint16 per chunk and table
constexpr int64_t kMaxL = 4096;       // tables
constexpr int64_t kMaxChunk = 65535;  // positions per chunk (uint16 token ids and bucket offsets)

}  // namespace magicpig

// magicpig_host.cc: the LSH index and the sampled attention (arXiv 2410.16179, Sections 4.2-4.3).
XLA_FFI_DECLARE_HANDLER_SYMBOL(MagicpigBuild);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MagicpigAppend);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MagicpigAttention);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MagicpigLogU);
// simhash.cc: SimHash codes of rows (a decode step's queries) against one layer's hyperplanes.
XLA_FFI_DECLARE_HANDLER_SYMBOL(MagicpigSimhashCodes);
// quant_matvec.cc: the decode matvec on GGUF rows (F16, BF16, Q4_0 .. Q8_0, Q4_K, Q5_K, Q6_K)
// and their dequantization.
XLA_FFI_DECLARE_HANDLER_SYMBOL(MagicpigQuantMatvec);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MagicpigDequantize);
// exact_attention.cc: exact attention of the dense layers.
XLA_FFI_DECLARE_HANDLER_SYMBOL(MagicpigExactAttention);
// topk_attention.cc, quest_attention.cc: the TopK and Quest baselines on the host cache.
XLA_FFI_DECLARE_HANDLER_SYMBOL(MagicpigTopkAttention);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MagicpigQuestAttention);
