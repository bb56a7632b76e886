// The Python module magicpig_jax._host_ops (nanobind): the capsules of the XLA FFI handlers,
// which magicpig_jax.host._ext registers with jax.ffi.register_ffi_target(..., platform="cpu")
// on the first host call, and the huge-pages advice of magicpig_jax.host.advise_huge_pages.

#include <cstddef>
#include <cstdint>

#include <nanobind/nanobind.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "ffi_util.h"
#include "handlers.h"

namespace nb = nanobind;

namespace {

template <typename T>
nb::capsule Capsule(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

// Back [ptr, ptr + nbytes) with 2 MiB transparent huge pages where the kernel allows it
// (madvise MADV_HUGEPAGE, then MADV_COLLAPSE for pages already present, Linux >= 6.1).
// The op reads KV rows and buckets at random places of arrays of hundreds of MB: with 4 KiB
// pages nearly every row costs a TLB miss. Returns the bytes collapsed (0 where unsupported;
// never fails: the advice only changes the page size, not the contents).
size_t AdviseHugePages(uintptr_t ptr, size_t nbytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const uintptr_t lo = (ptr + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t hi = (ptr + nbytes) & ~(kHuge - 1);
  if (ptr == 0 || hi <= lo) return 0;
  void* base = reinterpret_cast<void*>(lo);
  if (madvise(base, hi - lo, MADV_HUGEPAGE) != 0) return 0;
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif
  return madvise(base, hi - lo, MADV_COLLAPSE) == 0 ? static_cast<size_t>(hi - lo) : 0;
#else
  (void)ptr;
  (void)nbytes;
  return 0;
#endif
}

}  // namespace

NB_MODULE(_host_ops, m) {
  m.doc() = "MagicPIG host-memory LSH index, sampled and exact attention, and quantized matvec (XLA FFI handlers, CPU).";
  m.def("registrations", []() {
    nb::dict d;
    d["magicpig_host_build"] = Capsule(MagicpigBuild);
    d["magicpig_host_append"] = Capsule(MagicpigAppend);
    d["magicpig_host_attention"] = Capsule(MagicpigAttention);
    d["magicpig_host_log_u"] = Capsule(MagicpigLogU);
    d["magicpig_simhash_codes"] = Capsule(MagicpigSimhashCodes);
    d["magicpig_quant_matvec"] = Capsule(MagicpigQuantMatvec);
    d["magicpig_dequantize"] = Capsule(MagicpigDequantize);
    d["magicpig_exact_attention"] = Capsule(MagicpigExactAttention);
    d["magicpig_topk_attention"] = Capsule(MagicpigTopkAttention);
    d["magicpig_quest_attention"] = Capsule(MagicpigQuestAttention);
    return d;
  });
  m.def("has_avx2", []() { return magicpig::CpuHasAvx2(); });
  m.def("advise_huge_pages", &AdviseHugePages, nb::arg("ptr"), nb::arg("nbytes"));
  m.attr("MAX_K") = magicpig::kMaxK;
  m.attr("MAX_L") = magicpig::kMaxL;
  m.attr("MAX_CHUNK") = magicpig::kMaxChunk;
}
