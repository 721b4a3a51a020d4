// Host checks that the CUDA C++ rungs' torch entry points share (flash_wmma.cu, flash_mma.cu, flash_backward.cu,
// hopper's attention host file): written once, included by each (#include "../host_checks.cuh"), so that a mask is
// refused alike, with the same words, whichever kernel runs. Host code: it needs torch's headers.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <string>

namespace wb {

// The key-padding mask as the kernels read it: (B, Lk) uint8 on the GPU, contiguous, 1 = the key takes part; an empty
// tensor is no mask (nullptr). `entry` names the caller in the error ("flash_mma: key_keep must be ..."), one string
// built only when the check fails and handed over whole (no stream formatting, which crashed an extension on the H100
// host: decode_host.cu's check_cache_layout). static: each extension keeps its own copy (a learner's edited build
// loaded beside the package's shares nothing).
static inline const uint8_t* key_keep_pointer(const torch::Tensor& key_keep, int64_t B, int64_t Lk, const char* entry) {
    if (key_keep.numel() == 0) return nullptr;
    TORCH_CHECK(key_keep.is_cuda() && key_keep.scalar_type() == torch::kUInt8 && key_keep.is_contiguous() &&
                    key_keep.dim() == 2 && key_keep.size(0) == B && key_keep.size(1) == Lk,
                std::string(entry) + ": key_keep must be a contiguous CUDA uint8 tensor (B, Lk)");
    return key_keep.data_ptr<uint8_t>();
}

}  // namespace wb
