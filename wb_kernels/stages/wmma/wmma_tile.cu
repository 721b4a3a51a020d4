// Lesson 05's first step: one 16 x 16 x 16 product on the tensor cores, C = A B, by one warp.
//
// A and B are 16 x 16 fp16 matrices in row-major order; C is fp32. The 32 threads of the warp hold the three
// matrices together in *fragments*; which thread holds which element is up to the hardware (WMMA does not say),
// so all three calls below are made by the whole warp at once. The rest of the lesson builds FlashAttention out
// of this one product. Built like flash_wmma.cu: nvcc alone for the compile report (-DWB_KERNEL_ONLY), and
// load_inline with the torch launcher on a GPU.

#include <cuda_fp16.h>
#include <mma.h>

// region: wmma_tile_kernel
__global__ void wmma_tile_kernel(const half* a, const half* b, float* c) {
    using namespace nvcuda;
    wmma::fragment<wmma::matrix_a, 16, 16, 16, half, wmma::row_major> a_frag;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::row_major> b_frag;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> c_frag;
    wmma::fill_fragment(c_frag, 0.0f);
    wmma::load_matrix_sync(a_frag, a, 16);  // 16: the distance between rows, in elements
    wmma::load_matrix_sync(b_frag, b, 16);
    wmma::mma_sync(c_frag, a_frag, b_frag, c_frag);  // c_frag = a_frag * b_frag + c_frag, on the tensor cores
    wmma::store_matrix_sync(c, c_frag, 16, wmma::mem_row_major);
}
// endregion

#ifndef WB_KERNEL_ONLY
// region: tile_launcher
#include <ATen/cuda/CUDAContext.h>
#include <torch/extension.h>

// C (16, 16) float32 = A (16, 16) float16 @ B (16, 16) float16, with one warp.
torch::Tensor wmma_tile(torch::Tensor a, torch::Tensor b) {
    TORCH_CHECK(a.is_cuda() && b.is_cuda(), "wmma_tile: a and b must be CUDA tensors");
    TORCH_CHECK(a.scalar_type() == torch::kHalf && b.scalar_type() == torch::kHalf, "wmma_tile: float16 inputs");
    TORCH_CHECK(a.sizes() == torch::IntArrayRef({16, 16}) && b.sizes() == torch::IntArrayRef({16, 16}),
                "wmma_tile: a and b must be 16 x 16");
    auto a_ = a.contiguous(), b_ = b.contiguous();
    auto c = torch::empty({16, 16}, a.options().dtype(torch::kFloat));
    wmma_tile_kernel<<<1, 32, 0, at::cuda::getCurrentCUDAStream()>>>(
        reinterpret_cast<const half*>(a_.data_ptr<at::Half>()), reinterpret_cast<const half*>(b_.data_ptr<at::Half>()),
        c.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return c;
}
// endregion
#endif
