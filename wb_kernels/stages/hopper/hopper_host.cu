// The Hopper rung's extension (rung "hopper"): the torch entry points of the primitives lab
// (hopper_primitives_lab.cuh), of the attention versions v1-v4 (hopper_attention.cuh) and of the backward
// (hopper_backward.cuh, issue 47: work in progress, not yet the stage's backward), built as one extension.
// Used by:
//   - wb_kernels/stages/hopper/build.py: torch load_inline builds it on a Hopper GPU with
//     -gencode arch=compute_90a,code=sm_90a (wgmma exists only on that target); without a GPU nvcc compiles it for
//     sm_90a (-DWB_KERNEL_ONLY) and the compile report shows HGMMA (wgmma) and UTMALDG (the TMA load) in the SASS;
//   - wb_kernels/stages/hopper/lab.py (the lab's launchers) and launcher.py (the stage: v1 at D = 64, v4 at D = 128).
//
// Build options: -DWB_WATCHDOG_NS=<n> makes every barrier wait trap after n nanoseconds instead of spinning for ever
// (no printf: a printf in a kernel with wgmma makes ptxas serialize the wgmma, a C7510/C7520 note, and build.py
// refuses a source whose wgmma ptxas serialized).

#include "hopper_primitives_lab.cuh"
#include "hopper_attention.cuh"
#include "hopper_backward.cuh"

// Every GEMM variant the launcher can choose: X(N, K_STEPS, A_IN_REGISTERS, B_MN_MAJOR), each for fp16 and bf16.
#define WB_FOR_EACH_GEMM_VARIANT(X)                                                                               \
    X(64, 1, false, false) X(64, 4, false, false) X(128, 4, false, false) X(64, 1, true, false)                  \
    X(64, 4, true, false) X(128, 4, true, false) X(64, 4, false, true) X(128, 4, false, true)                   \
    X(64, 4, true, true) X(128, 4, true, true)

#if defined(WB_KERNEL_ONLY) && defined(WB_BACKWARD_ONLY)
// The backward's compile report (build.nvcc_compile_report(part="backward")): its kernels alone, so that the
// forward's report does not wait for them
#define WB_INSTANTIATE_BACKWARD(T, D)                                                                               \
    template __global__ void wb::flash_backward_kernel<T, D>(                                                      \
        const __grid_constant__ CUtensorMap, const __grid_constant__ CUtensorMap, const __grid_constant__ CUtensorMap, \
        const __grid_constant__ CUtensorMap, const wb::BackwardParams);
WB_INSTANTIATE_BACKWARD(__half, 64) WB_INSTANTIATE_BACKWARD(__half, 128) WB_INSTANTIATE_BACKWARD(__nv_bfloat16, 64)
WB_INSTANTIATE_BACKWARD(__nv_bfloat16, 128)
#define WB_INSTANTIATE_BACKWARD_EDGES(T)                                                                            \
    template __global__ void wb::backward_preprocess_kernel<T>(const T*, const T*, const float*, float*, float*,     \
                                                               float*, int64_t, int, int, int);                    \
    template __global__ void wb::backward_convert_dq_kernel<T>(const float*, T*, int64_t, int, int, int, float);
WB_INSTANTIATE_BACKWARD_EDGES(__half) WB_INSTANTIATE_BACKWARD_EDGES(__nv_bfloat16)
#define WB_INSTANTIATE_DQ_PRODUCT(T, D)                                                                             \
    template __global__ void wb::dq_product_kernel<T, D>(const __grid_constant__ CUtensorMap,                      \
                                                         const __grid_constant__ CUtensorMap, int, float*);
WB_INSTANTIATE_DQ_PRODUCT(__half, 64) WB_INSTANTIATE_DQ_PRODUCT(__half, 128) WB_INSTANTIATE_DQ_PRODUCT(__nv_bfloat16, 64)
WB_INSTANTIATE_DQ_PRODUCT(__nv_bfloat16, 128)
#elif defined(WB_KERNEL_ONLY)
#define WB_INSTANTIATE(T, N, KS, RS, MN) \
    template __global__ void wb::wgmma_gemm_kernel<T, N, KS, RS, MN>(const __grid_constant__ CUtensorMap, const __grid_constant__ CUtensorMap, float*);
#define WB_INSTANTIATE_BOTH(N, KS, RS, MN) WB_INSTANTIATE(__half, N, KS, RS, MN) WB_INSTANTIATE(__nv_bfloat16, N, KS, RS, MN)
WB_FOR_EACH_GEMM_VARIANT(WB_INSTANTIATE_BOTH)
#define WB_INSTANTIATE_V1(T, D)                                                                                     \
    template __global__ void wb::flash_v1_kernel<T, D>(const __grid_constant__ CUtensorMap,                       \
                                                       const __grid_constant__ CUtensorMap,                       \
                                                       const __grid_constant__ CUtensorMap, const wb::FlashParams);
WB_INSTANTIATE_V1(__half, 64) WB_INSTANTIATE_V1(__half, 128) WB_INSTANTIATE_V1(__nv_bfloat16, 64)
WB_INSTANTIATE_V1(__nv_bfloat16, 128)
#define WB_INSTANTIATE_WS(T, D, VERSION)                                                                            \
    template __global__ void wb::flash_ws_kernel<T, D, VERSION>(const __grid_constant__ CUtensorMap,              \
                                                                const __grid_constant__ CUtensorMap,              \
                                                                const __grid_constant__ CUtensorMap, const wb::FlashParams);
#define WB_INSTANTIATE_WS_ALL(VERSION)                                                                              \
    WB_INSTANTIATE_WS(__half, 64, VERSION) WB_INSTANTIATE_WS(__half, 128, VERSION)                                 \
    WB_INSTANTIATE_WS(__nv_bfloat16, 64, VERSION) WB_INSTANTIATE_WS(__nv_bfloat16, 128, VERSION)
WB_INSTANTIATE_WS_ALL(2) WB_INSTANTIATE_WS_ALL(3) WB_INSTANTIATE_WS_ALL(4)
#else
// region: tensor_map
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "../host_checks.cuh"

#include <algorithm>
#include <limits>

namespace wb {

// cuTensorMapEncodeTiled is a driver function; the runtime hands out its address, so the extension needs no
// -lcuda. The 12000 asks for the signature as CUDA 12.0 defined it.
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiled tensor_map_encoder() {
    static const EncodeTiled encode = [] {
        void* function = nullptr;
        cudaDriverEntryPointQueryResult found;
        C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000,
                                                        cudaEnableDefault, &found));
        TORCH_CHECK(found == cudaDriverEntryPointSuccess && function != nullptr,
                    "hopper: the driver has no cuTensorMapEncodeTiled (needs a CUDA 12 driver or newer)");
        return reinterpret_cast<EncodeTiled>(function);
    }();
    return encode;
}

// A tensor map for a 2-D, row-major, 16-bit tensor x (rows, columns): boxes of box_rows x 64 elements (128-byte rows),
// written to shared memory with the 128-byte swizzle; what lies outside x arrives as zeros.
CUtensorMap tile_map_2d(const torch::Tensor& x, uint32_t box_rows) {
    TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "hopper: the tensor map wants a 2-D row-major tensor");
    TORCH_CHECK(x.scalar_type() == torch::kHalf || x.scalar_type() == torch::kBFloat16,
                "hopper: dtype must be float16 or bfloat16, got ", x.scalar_type());
    TORCH_CHECK((x.stride(0) * 2) % 16 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
                "hopper: the TMA needs 16-byte aligned rows (a row of a multiple of 8 elements)");
    CUtensorMap map;
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(x.size(1)), static_cast<cuuint64_t>(x.size(0))};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(x.stride(0) * 2)};  // bytes, every dim but the first
    const cuuint32_t box[2] = {TILE_ROW_BYTES / 2, box_rows};
    const cuuint32_t element_strides[2] = {1, 1};
    const CUresult result = tensor_map_encoder()(
        &map, x.scalar_type() == torch::kHalf ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        2, x.data_ptr(), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
        CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    TORCH_CHECK(result == CUDA_SUCCESS, "hopper: cuTensorMapEncodeTiled failed (CUresult ", static_cast<int>(result), ")");
    return map;
}

}  // namespace wb
// endregion

// region: torch_entry_points
// (a) The raw shared-memory bytes of one TMA box (64 x 64 elements from (row0, column0) of x), as x's dtype, flat.
torch::Tensor hopper_tma_tile(torch::Tensor x, int64_t row0, int64_t column0, int64_t expect_bytes) {
    TORCH_CHECK(x.is_cuda(), "hopper_tma_tile: x must be a CUDA tensor");
    const c10::cuda::CUDAGuard guard(x.device());
    const CUtensorMap map = wb::tile_map_2d(x, wb::TILE_ROWS);
    auto dump = torch::empty({wb::TILE_ROWS * wb::TILE_ROW_BYTES / 2}, x.options());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    wb::tma_tile_kernel<<<1, wb::WARPGROUP, 0, stream>>>(map, static_cast<int>(row0), static_cast<int>(column0),
                                                         static_cast<uint32_t>(expect_bytes),
                                                         reinterpret_cast<uint4*>(dump.data_ptr()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return dump;
}

// (b, c) C = A B in fp32 by one warpgroup: a (64, K); b (N, K) when K-major (b_mn_major false), (K, N) when MN-major.
torch::Tensor hopper_wgmma_gemm(torch::Tensor a, torch::Tensor b, bool a_in_registers, bool b_mn_major) {
    TORCH_CHECK(a.is_cuda() && b.is_cuda() && a.scalar_type() == b.scalar_type(),
                "hopper_wgmma_gemm: a and b must be CUDA tensors of one dtype");
    TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && a.dim() == 2 && b.dim() == 2, "hopper_wgmma_gemm: 2-D, contiguous");
    const int64_t K = a.size(1), N = b_mn_major ? b.size(1) : b.size(0);
    TORCH_CHECK(a.size(0) == 64 && K >= 8 && K <= 64 && K % 8 == 0 && (b_mn_major ? b.size(0) : b.size(1)) == K,
                "hopper_wgmma_gemm: a must be (64, K) with K in 8..64 a multiple of 8, b (N, K) or (K, N)");
    TORCH_CHECK(N == 64 || N == 128, "hopper_wgmma_gemm: N must be 64 or 128, got ", N);
    const c10::cuda::CUDAGuard guard(a.device());
    const CUtensorMap a_map = wb::tile_map_2d(a, 64);
    const CUtensorMap b_map = wb::tile_map_2d(b, b_mn_major ? 64 : static_cast<uint32_t>(N));
    auto c = torch::empty({64, N}, a.options().dtype(torch::kFloat32));
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    const int k_steps = (K <= 16 && N == 64 && !b_mn_major) ? 1 : 4;  // one k16 step, or four over a zero-filled 64
    const bool is_half = a.scalar_type() == torch::kHalf;
#define WB_LAUNCH_IF(N_, KS, RS, MN)                                                                              \
    if (N == N_ && k_steps == KS && a_in_registers == RS && b_mn_major == MN) {                                 \
        if (is_half) wb::wgmma_gemm_kernel<__half, N_, KS, RS, MN><<<1, wb::WARPGROUP, 0, stream>>>(a_map, b_map, c.data_ptr<float>()); \
        else wb::wgmma_gemm_kernel<__nv_bfloat16, N_, KS, RS, MN><<<1, wb::WARPGROUP, 0, stream>>>(a_map, b_map, c.data_ptr<float>()); \
        C10_CUDA_KERNEL_LAUNCH_CHECK();                                                                          \
        return c;                                                                                                \
    }
    WB_FOR_EACH_GEMM_VARIANT(WB_LAUNCH_IF)
#undef WB_LAUNCH_IF
    TORCH_CHECK(false, "hopper_wgmma_gemm: no variant N=", N, " K=", K, " a_in_registers=", a_in_registers,
                " b_mn_major=", b_mn_major);
    return c;
}
// (d) setmaxnreg: x (2, SPLIT_LIVE, 128) float32, the two consumers' values (warpgroup 0 doubles x's first 128);
// returns the 384 outputs, one per thread.
torch::Tensor hopper_register_split(torch::Tensor x) {
    TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kFloat32 && x.is_contiguous() &&
                x.numel() == 2 * wb::SPLIT_LIVE * wb::WARPGROUP,
                "hopper_register_split: x must be a contiguous CUDA float32 tensor of 2 x ", wb::SPLIT_LIVE,
                " x 128 elements");
    const c10::cuda::CUDAGuard guard(x.device());
    auto out = torch::empty({wb::SPLIT_THREADS}, x.options());
    wb::register_split_kernel<<<1, wb::SPLIT_THREADS, 0, c10::cuda::getCurrentCUDAStream()>>>(
        x.data_ptr<float>(), out.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return out;
}

// (e) Named barriers: the order in which two warpgroups took `rounds` turns each (int32, 2 x rounds entries).
torch::Tensor hopper_named_barrier_turns(int64_t rounds, torch::Tensor device_like) {
    TORCH_CHECK(device_like.is_cuda(), "hopper_named_barrier_turns: device_like must be a CUDA tensor");
    TORCH_CHECK(rounds > 0 && rounds <= 1024, "hopper_named_barrier_turns: rounds must be in 1..1024");
    const c10::cuda::CUDAGuard guard(device_like.device());
    auto log = torch::full({2 * rounds}, -1, device_like.options().dtype(torch::kInt32));
    wb::named_barrier_kernel<<<1, wb::TURN_THREADS, 0, c10::cuda::getCurrentCUDAStream()>>>(
        static_cast<int>(rounds), log.data_ptr<int>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return log;
}
// endregion

// region: flash_entry_point
namespace wb {
// A rank-3 tensor map over x (B, Hx, L, D), contiguous, viewed as (B Hx, L, D): boxes of box_rows rows x 64 elements
// of one head, the 128-byte swizzle, rows past L zero-filled (and counted in the barrier's bytes).
CUtensorMap head_map_3d(const torch::Tensor& x, uint32_t box_rows) {
    const int64_t D = x.size(3), L = x.size(2), heads = x.size(0) * x.size(1);
    CUtensorMap map;
    const cuuint64_t dims[3] = {static_cast<cuuint64_t>(D), static_cast<cuuint64_t>(L), static_cast<cuuint64_t>(heads)};
    const cuuint64_t strides[2] = {static_cast<cuuint64_t>(D * 2), static_cast<cuuint64_t>(L * D * 2)};
    const cuuint32_t box[3] = {64, box_rows, 1};
    const cuuint32_t element_strides[3] = {1, 1, 1};
    const CUresult result = tensor_map_encoder()(
        &map, x.scalar_type() == torch::kHalf ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        3, x.data_ptr(), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
        CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    TORCH_CHECK(result == CUDA_SUCCESS, "hopper: cuTensorMapEncodeTiled failed (CUresult ", static_cast<int>(result), ")");
    return map;
}

template <typename T, int HEAD_DIM>
void launch_flash_v1(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const FlashParams& params,
                     cudaStream_t stream) {
    constexpr int smem = v1_smem_bytes<HEAD_DIM>();
    auto kernel = flash_v1_kernel<T, HEAD_DIM>;
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const dim3 grid((params.Lq + V1_BLOCK_M - 1) / V1_BLOCK_M, params.B * params.H);
    kernel<<<grid, WARPGROUP, smem, stream>>>(head_map_3d(q, V1_BLOCK_M), head_map_3d(k, V1_BLOCK_N),
                                              head_map_3d(v, V1_BLOCK_N), params);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// v2, v3 and v4 (VERSION): 384 threads, 128 query rows per block, Q and K/V boxes of 128 rows
template <typename T, int HEAD_DIM, int VERSION>
void launch_flash_ws(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const FlashParams& params,
                     cudaStream_t stream) {
    constexpr int smem = ws_smem_bytes<HEAD_DIM>();
    auto kernel = flash_ws_kernel<T, HEAD_DIM, VERSION>;
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const dim3 grid((params.Lq + WS_BLOCK_M - 1) / WS_BLOCK_M, params.B * params.H);
    kernel<<<grid, WS_THREADS, smem, stream>>>(head_map_3d(q, WS_BLOCK_M), head_map_3d(k, WS_BLOCK_N),
                                               head_map_3d(v, WS_BLOCK_N), params);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int HEAD_DIM>
void launch_flash(int version, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                  const FlashParams& params, cudaStream_t stream) {
    if (version == 1) launch_flash_v1<T, HEAD_DIM>(q, k, v, params, stream);
    else if (version == 2) launch_flash_ws<T, HEAD_DIM, 2>(q, k, v, params, stream);
    else if (version == 3) launch_flash_ws<T, HEAD_DIM, 3>(q, k, v, params, stream);
    else launch_flash_ws<T, HEAD_DIM, 4>(q, k, v, params, stream);
}
}  // namespace wb

// endregion

// region: flash_torch_entry
// Returns [out (B, H, Lq, D) in q's dtype, lse (B, H, Lq) float32]. version 1, 2, 3 or 4 (work in progress, not a
// registered stage).
std::vector<torch::Tensor> hopper_flash_forward(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                                torch::Tensor key_keep, bool causal, int64_t causal_offset,
                                                double scale, int64_t version) {
    TORCH_CHECK(version >= 1 && version <= 4, "hopper_flash: version must be 1, 2, 3 or 4, got ", version);
    TORCH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda(), "hopper_flash: q, k, v must be CUDA tensors");
    TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                (q.scalar_type() == torch::kHalf || q.scalar_type() == torch::kBFloat16),
                "hopper_flash: q, k, v must be all float16 or all bfloat16");
    TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.is_contiguous() && k.is_contiguous() &&
                v.is_contiguous(), "hopper_flash: q, k, v must be contiguous (B, H, L, D)");
    const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), D = q.size(3), Lk = k.size(2);
    TORCH_CHECK(D == 64 || D == 128, "hopper_flash: head dim must be 64 or 128, got ", D);
    TORCH_CHECK(k.size(0) == B && k.size(1) > 0 && H % k.size(1) == 0 && k.size(3) == D && v.sizes() == k.sizes(),
                "hopper_flash: k and v must be (B, Hk, Lk, D) with q's B and D, and Hk dividing H");
    TORCH_CHECK(scale > 0, "hopper_flash: the launcher passes a positive scale (got ", scale, ")");
    TORCH_CHECK(B * H <= 65535, "hopper_flash: B * H = ", B * H, " is over gridDim.y's 65,535");
    const uint8_t* keep = wb::key_keep_pointer(key_keep, B, Lk, "hopper_flash");  // nullptr: no mask
    const c10::cuda::CUDAGuard guard(q.device());
    auto out = torch::empty_like(q);
    auto lse = torch::empty({B, H, Lq}, q.options().dtype(torch::kFloat32));
    if (out.numel() == 0) return {out, lse};
    if (Lk == 0) {  // no key at all: a tensor map cannot have an empty dimension
        out.zero_();
        lse.fill_(-std::numeric_limits<float>::infinity());
        return {out, lse};
    }
    wb::FlashParams params;
    params.out = out.data_ptr();
    params.lse = lse.data_ptr<float>();
    params.key_keep = keep;
    params.B = static_cast<int>(B);
    params.H = static_cast<int>(H);
    params.Lq = static_cast<int>(Lq);
    params.Lk = static_cast<int>(Lk);
    params.kv_group = static_cast<int>(H / k.size(1));
    params.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
    params.causal = causal ? 1 : 0;
    params.causal_offset = static_cast<int>(causal_offset);
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    const int which = static_cast<int>(version);
    const bool is_half = q.scalar_type() == torch::kHalf;
    if (D == 64) {
        if (is_half) wb::launch_flash<__half, 64>(which, q, k, v, params, stream);
        else wb::launch_flash<__nv_bfloat16, 64>(which, q, k, v, params, stream);
    } else {
        if (is_half) wb::launch_flash<__half, 128>(which, q, k, v, params, stream);
        else wb::launch_flash<__nv_bfloat16, 128>(which, q, k, v, params, stream);
    }
    return {out, lse};
}
// endregion

// region: backward_entry_point
namespace wb {
template <typename T, int HEAD_DIM>
void launch_flash_backward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                           const torch::Tensor& dout, const BackwardParams& params, cudaStream_t stream) {
    constexpr int smem = bwd_smem_bytes<HEAD_DIM>();
    auto kernel = flash_backward_kernel<T, HEAD_DIM>;
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    // key blocks along x: the deterministic mode's order assumes block j - 1 is dispatched before block j
    const dim3 grid((params.Lk + BWD_BLOCK_N - 1) / BWD_BLOCK_N, params.B * params.Hk);
    kernel<<<grid, BWD_THREADS, smem, stream>>>(head_map_3d(q, BWD_BLOCK_M), head_map_3d(dout, BWD_BLOCK_M),
                                                head_map_3d(k, BWD_BLOCK_N), head_map_3d(v, BWD_BLOCK_N), params);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void run_flash_backward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& out, const torch::Tensor& lse, const torch::Tensor& dout,
                        torch::Tensor& dq, BackwardParams& params, torch::Tensor& lse_log2, torch::Tensor& dot,
                        torch::Tensor& dq_accum, cudaStream_t stream) {
    const int D = static_cast<int>(q.size(3));
    const int64_t padded_rows = static_cast<int64_t>(params.B) * params.H * params.Lq_pad;
    const int rows_per_block = BWD_PRE_THREADS / 32;
    backward_preprocess_kernel<T><<<static_cast<unsigned>((padded_rows + rows_per_block - 1) / rows_per_block),
                                    BWD_PRE_THREADS, 0, stream>>>(
        static_cast<const T*>(out.data_ptr()), static_cast<const T*>(dout.data_ptr()), lse.data_ptr<float>(),
        lse_log2.data_ptr<float>(), dot.data_ptr<float>(), dq_accum.data_ptr<float>(), padded_rows, params.Lq,
        params.Lq_pad, D);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (D == 64) launch_flash_backward<T, 64>(q, k, v, dout, params, stream);
    else launch_flash_backward<T, 128>(q, k, v, dout, params, stream);
    const int64_t pairs = dq.numel() / 2;
    const int64_t blocks = std::min<int64_t>((pairs + 255) / 256, 65536);
    backward_convert_dq_kernel<T><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
        dq_accum.data_ptr<float>(), static_cast<T*>(dq.data_ptr()), pairs, params.Lq, params.Lq_pad, D, params.scale);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}
}  // namespace wb
// endregion

// region: backward_dq_product_entry
namespace wb {
// the dQ product alone: its tiles are dynamic shared memory (48 KB and more at D = 128 need the kernel's opt-in)
template <typename T, int HEAD_DIM>
void launch_dq_product(const CUtensorMap& a_map, const CUtensorMap& b_map, int consumer, float* c, cudaStream_t stream) {
    constexpr int smem = dq_product_smem_bytes<HEAD_DIM>();
    auto kernel = dq_product_kernel<T, HEAD_DIM>;
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    kernel<<<1, WARPGROUP, smem, stream>>>(a_map, b_map, consumer, c);
}
}  // namespace wb

// The dQ product alone (dq_product_kernel): a_t (128, 64), b (128, D) 16-bit, D = 64 or 128, consumer 0 or 1;
// returns (64, D / 2) float32 = a_t^T b[:, consumer D / 2 : (consumer + 1) D / 2].
torch::Tensor hopper_backward_dq_product(torch::Tensor a_t, torch::Tensor b, int64_t consumer) {
    TORCH_CHECK(a_t.is_cuda() && b.is_cuda() && a_t.scalar_type() == b.scalar_type() && a_t.is_contiguous() &&
                b.is_contiguous(), "hopper_backward_dq_product: contiguous CUDA tensors of one dtype");
    TORCH_CHECK(a_t.dim() == 2 && a_t.size(0) == 128 && a_t.size(1) == 64 && b.dim() == 2 && b.size(0) == 128 &&
                (b.size(1) == 64 || b.size(1) == 128) && (consumer == 0 || consumer == 1),
                "hopper_backward_dq_product: a_t (128, 64), b (128, 64 or 128), consumer 0 or 1");
    const c10::cuda::CUDAGuard guard(a_t.device());
    const int64_t D = b.size(1);
    auto c = torch::empty({64, D / 2}, a_t.options().dtype(torch::kFloat32));
    const CUtensorMap a_map = wb::tile_map_2d(a_t, 128), b_map = wb::tile_map_2d(b, 128);
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    const bool is_half = a_t.scalar_type() == torch::kHalf;
    const int which = static_cast<int>(consumer);
    float* out = c.data_ptr<float>();
    if (D == 64) {
        if (is_half) wb::launch_dq_product<__half, 64>(a_map, b_map, which, out, stream);
        else wb::launch_dq_product<__nv_bfloat16, 64>(a_map, b_map, which, out, stream);
    } else {
        if (is_half) wb::launch_dq_product<__half, 128>(a_map, b_map, which, out, stream);
        else wb::launch_dq_product<__nv_bfloat16, 128>(a_map, b_map, which, out, stream);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return c;
}
// endregion

// region: backward_torch_entry
// Returns [dq (B, H, Lq, D), dk, dv (B, Hk, Lk, D)] in q's dtype; dk and dv summed over each group of query heads.
// out and lse are the forward's; deterministic: dQ added in key-block order (bit-identical across runs).
// Work in progress (issue 47): not yet the stage's backward.
std::vector<torch::Tensor> hopper_flash_backward(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor out,
                                                 torch::Tensor lse, torch::Tensor dout, torch::Tensor key_keep,
                                                 bool causal, int64_t causal_offset, double scale, bool deterministic) {
    TORCH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda() && out.is_cuda() && lse.is_cuda() && dout.is_cuda(),
                "hopper_backward: every tensor must be a CUDA tensor");
    TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                q.scalar_type() == out.scalar_type() && q.scalar_type() == dout.scalar_type() &&
                (q.scalar_type() == torch::kHalf || q.scalar_type() == torch::kBFloat16),
                "hopper_backward: q, k, v, out, dout must be all float16 or all bfloat16");
    TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.is_contiguous() && k.is_contiguous() &&
                v.is_contiguous() && out.is_contiguous() && dout.is_contiguous() && out.sizes() == q.sizes() &&
                dout.sizes() == q.sizes(), "hopper_backward: q, k, v, out, dout must be contiguous (B, H, L, D)");
    const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), D = q.size(3), Hk = k.size(1), Lk = k.size(2);
    TORCH_CHECK(D == 64 || D == 128, "hopper_backward: head dim must be 64 or 128, got ", D);
    TORCH_CHECK(k.size(0) == B && Hk > 0 && H % Hk == 0 && k.size(3) == D && v.sizes() == k.sizes(),
                "hopper_backward: k and v must be (B, Hk, Lk, D) with q's B and D, and Hk dividing H");
    TORCH_CHECK(lse.scalar_type() == torch::kFloat32 && lse.is_contiguous() && lse.dim() == 3 && lse.size(0) == B &&
                lse.size(1) == H && lse.size(2) == Lq, "hopper_backward: lse must be contiguous float32 (B, H, Lq)");
    TORCH_CHECK(scale > 0, "hopper_backward: the launcher passes a positive scale (got ", scale, ")");
    TORCH_CHECK(B * Hk <= 65535, "hopper_backward: B * Hk = ", B * Hk, " is over gridDim.y's 65,535");
    const uint8_t* keep = wb::key_keep_pointer(key_keep, B, Lk, "hopper_backward");
    const c10::cuda::CUDAGuard guard(q.device());
    auto dq = torch::empty_like(q);
    auto dk = torch::empty_like(k);  // every key row is written: each (batch, head, key block) has its CTA
    auto dv = torch::empty_like(v);
    if (Lq == 0 || Lk == 0 || B * H == 0) {  // nothing to multiply; a tensor map cannot have an empty dimension
        dq.zero_();
        dk.zero_();
        dv.zero_();
        return {dq, dk, dv};
    }
    const int64_t Lq_pad = (Lq + wb::BWD_BLOCK_M - 1) / wb::BWD_BLOCK_M * wb::BWD_BLOCK_M;
    const auto floats = q.options().dtype(torch::kFloat32);
    auto lse_log2 = torch::empty({B, H, Lq_pad}, floats);
    auto dot = torch::empty({B, H, Lq_pad}, floats);
    auto dq_accum = torch::empty({B, H, Lq_pad, D}, floats);  // zeroed by the preprocessing kernel
    auto semaphore = deterministic ? torch::zeros({B, H, Lq_pad / wb::BWD_BLOCK_M}, q.options().dtype(torch::kInt32))
                                   : torch::empty({0}, q.options().dtype(torch::kInt32));
    wb::BackwardParams params;
    params.dq_accum = dq_accum.data_ptr<float>();
    params.lse_log2 = lse_log2.data_ptr<float>();
    params.dot = dot.data_ptr<float>();
    params.dk = dk.data_ptr();
    params.dv = dv.data_ptr();
    params.key_keep = keep;
    params.semaphore = deterministic ? semaphore.data_ptr<int>() : nullptr;
    params.B = static_cast<int>(B);
    params.H = static_cast<int>(H);
    params.Hk = static_cast<int>(Hk);
    params.Lq = static_cast<int>(Lq);
    params.Lk = static_cast<int>(Lk);
    params.Lq_pad = static_cast<int>(Lq_pad);
    params.kv_group = static_cast<int>(H / Hk);
    params.scale = static_cast<float>(scale);
    params.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
    params.causal = causal ? 1 : 0;
    params.causal_offset = static_cast<int>(causal_offset);
    params.deterministic = deterministic ? 1 : 0;
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    if (q.scalar_type() == torch::kHalf) {
        wb::run_flash_backward<__half>(q, k, v, out, lse, dout, dq, params, lse_log2, dot, dq_accum, stream);
    } else {
        wb::run_flash_backward<__nv_bfloat16>(q, k, v, out, lse, dout, dq, params, lse_log2, dot, dq_accum, stream);
    }
    return {dq, dk, dv};
}
// endregion
#endif
