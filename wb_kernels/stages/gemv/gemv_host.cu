// The GEMV kernels' host side (gemv.cuh holds the device code): which kernels the extension holds, their launches and
// the torch entry points. launcher.py validates every call first and says what is wrong in Python; the checks here
// guard the raw pointers. (No numbers in these messages: formatting one inside an extension crashed the process on
// the H100 host, decode_host.cu says.)

#include "gemv.cuh"

// The batch widths the kernel is built for (a call's batch takes the next one up) and the fused forms the launcher
// offers, as (prologue, epilogue): plain, RMSNorm -> product, product + residual, RMSNorm -> gate/up -> SiLU * up.
#define WB_FOR_EACH_GEMV_BATCH(X, T) X(T, 1) X(T, 2) X(T, 4) X(T, 8) X(T, 16)
#define WB_FOR_EACH_GEMV_FORM(X, T, B) X(T, B, 0, 0) X(T, B, 1, 0) X(T, B, 0, 1) X(T, B, 1, 2)

#ifdef WB_KERNEL_ONLY
// Without torch (the compile check): every kernel the launcher can choose.
template __global__ void wb::gemv::gemv_v1_kernel<__half>(const __half*, const __half*, __half*, int, int);
template __global__ void wb::gemv::gemv_v1_kernel<__nv_bfloat16>(const __nv_bfloat16*, const __nv_bfloat16*,
                                                                  __nv_bfloat16*, int, int);
#define WB_INSTANTIATE_GEMV_FORM(T, B, PRO, EPI) \
    template __global__ void wb::gemv::gemv_kernel<T, B, PRO, EPI>(const wb::gemv::GemvParams);
#define WB_INSTANTIATE_GEMV_BATCH(T, B) WB_FOR_EACH_GEMV_FORM(WB_INSTANTIATE_GEMV_FORM, T, B)
WB_FOR_EACH_GEMV_BATCH(WB_INSTANTIATE_GEMV_BATCH, __half)
WB_FOR_EACH_GEMV_BATCH(WB_INSTANTIATE_GEMV_BATCH, __nv_bfloat16)
#else
// region: gemv_launch
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <optional>

namespace wb {
namespace gemv {

enum Form { kPlain = 0, kNormProduct = 1, kResidualProduct = 2, kNormGateUp = 3 };  // launcher.FORMS, in order

template <typename T, int BATCH, int PROLOGUE, int EPILOGUE>
void launch(const GemvParams& p, int tiles, cudaStream_t stream) {
    // row tiles in x (up to 2^31 - 1 blocks: the LM head has 16,032), splits in y (at most K / 256)
    gemv_kernel<T, BATCH, PROLOGUE, EPILOGUE><<<dim3(tiles, p.splits), kWarps * 32, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int BATCH>
void launch_form(const GemvParams& p, int tiles, int form, cudaStream_t stream) {
    if (form == kPlain) launch<T, BATCH, kPlainInput, kStore>(p, tiles, stream);
    else if (form == kNormProduct) launch<T, BATCH, kRmsNorm, kStore>(p, tiles, stream);
    else if (form == kResidualProduct) launch<T, BATCH, kPlainInput, kResidual>(p, tiles, stream);
    else launch<T, BATCH, kRmsNorm, kSiluMul>(p, tiles, stream);
}

// The kernel's batch width for a call's batch: the next of 1, 2, 4, 8, 16 (rows past the batch are zeros, not stored)
inline int batch_width(int batch) { return batch <= 1 ? 1 : batch <= 2 ? 2 : batch <= 4 ? 4 : batch <= 8 ? 8 : 16; }

inline int rows_per_warp(int width) {
    switch (width) {
        case 1: return GemvShape<1>::ROWS;
        case 2: return GemvShape<2>::ROWS;
        case 4: return GemvShape<4>::ROWS;
        case 8: return GemvShape<8>::ROWS;
        default: return GemvShape<16>::ROWS;
    }
}

template <typename T>
void launch_batch(const GemvParams& p, int tiles, int form, cudaStream_t stream) {
    switch (batch_width(p.batch)) {
        case 1: return launch_form<T, 1>(p, tiles, form, stream);
        case 2: return launch_form<T, 2>(p, tiles, form, stream);
        case 4: return launch_form<T, 4>(p, tiles, form, stream);
        case 8: return launch_form<T, 8>(p, tiles, form, stream);
        default: return launch_form<T, 16>(p, tiles, form, stream);
    }
}

void check_operand(const torch::Tensor& t, const torch::Tensor& w, const char* message) {
    TORCH_CHECK_VALUE(t.is_cuda() && t.device() == w.device() && t.scalar_type() == w.scalar_type() &&
                      t.is_contiguous() && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, message);
}

}  // namespace gemv
}  // namespace wb
// endregion

// v1: y (1, N) = x (1, K) W^T for W (N, K), batch 1, no split, no fusion.
torch::Tensor gemv_v1(torch::Tensor w, torch::Tensor x) {
    TORCH_CHECK_VALUE(w.is_cuda() && w.dim() == 2 && (w.scalar_type() == torch::kHalf || w.scalar_type() == torch::kBFloat16),
                      "gemv_v1: W must be a 2-D float16 or bfloat16 tensor on the GPU");
    wb::gemv::check_operand(w, w, "gemv_v1: W must be contiguous and 16-byte aligned");
    wb::gemv::check_operand(x, w, "gemv_v1: x must be contiguous, 16-byte aligned, on W's device, in W's dtype");
    const int64_t N = w.size(0), K = w.size(1);
    TORCH_CHECK_VALUE(x.numel() == K && K % 8 == 0 && N >= 1 && N < INT32_MAX,
                      "gemv_v1: x must hold K values, K a multiple of 8 (16-byte loads)");
    const c10::cuda::CUDAGuard guard(w.device());
    auto y = torch::empty({1, N}, w.options());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    const unsigned blocks = static_cast<unsigned>((N + wb::gemv::kWarps - 1) / wb::gemv::kWarps);
    if (w.scalar_type() == torch::kHalf)
        wb::gemv::gemv_v1_kernel<__half><<<blocks, wb::gemv::kWarps * 32, 0, stream>>>(
            static_cast<const __half*>(w.data_ptr()), static_cast<const __half*>(x.data_ptr()),
            static_cast<__half*>(y.data_ptr()), static_cast<int>(N), static_cast<int>(K));
    else
        wb::gemv::gemv_v1_kernel<__nv_bfloat16><<<blocks, wb::gemv::kWarps * 32, 0, stream>>>(
            static_cast<const __nv_bfloat16*>(w.data_ptr()), static_cast<const __nv_bfloat16*>(x.data_ptr()),
            static_cast<__nv_bfloat16*>(y.data_ptr()), static_cast<int>(N), static_cast<int>(K));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return y;
}

// region: gemv_forward
// v2 / v3 / the fused forms: out (batch, N_out) from W (N_w, K) and x (batch, K). form: launcher.FORMS' index;
// splits x k_per_split covers K (k_per_split a multiple of 256); partial: float32 workspace of at least
// splits * batch * N_w + splits * tiles * batch values (unused with one split); counters: int32 zeros, one per row
// tile (each call leaves them zero again). out: where to write (may be the residual itself), or a new tensor.
torch::Tensor gemv_forward(torch::Tensor w, torch::Tensor x, std::optional<torch::Tensor> norm_weight,
                           std::optional<torch::Tensor> residual, int64_t form, double eps, int64_t splits,
                           int64_t k_per_split, torch::Tensor partial, torch::Tensor counters,
                           std::optional<torch::Tensor> out) {
    using namespace wb::gemv;
    TORCH_CHECK_VALUE(w.is_cuda() && w.dim() == 2 && (w.scalar_type() == torch::kHalf || w.scalar_type() == torch::kBFloat16),
                      "gemv_forward: W must be a 2-D float16 or bfloat16 tensor on the GPU");
    check_operand(w, w, "gemv_forward: W must be contiguous and 16-byte aligned");
    check_operand(x, w, "gemv_forward: x must be contiguous, 16-byte aligned, on W's device, in W's dtype");
    TORCH_CHECK_VALUE(form >= kPlain && form <= kNormGateUp, "gemv_forward: unknown form");
    const int64_t K = w.size(1), batch = x.dim() == 1 ? 1 : x.size(0);
    const bool gate_up = form == kNormGateUp, normed = form == kNormProduct || form == kNormGateUp;
    const int64_t N_out = gate_up ? w.size(0) / 2 : w.size(0);
    TORCH_CHECK_VALUE(x.dim() <= 2 && x.size(-1) == K && K % 8 == 0 && batch >= 1 && batch <= 16,
                      "gemv_forward: x (batch <= 16, K), K a multiple of 8");
    TORCH_CHECK_VALUE(N_out >= 1 && (!gate_up || w.size(0) % 2 == 0) && w.size(0) < INT32_MAX,
                      "gemv_forward: W's rows (an even count for gate/up)");
    TORCH_CHECK_VALUE(normed == norm_weight.has_value(), "gemv_forward: a norm weight exactly for the normed forms");
    if (normed) {
        check_operand(*norm_weight, w, "gemv_forward: the norm weight must be contiguous, on W's device, in W's dtype");
        TORCH_CHECK_VALUE(norm_weight->numel() == K, "gemv_forward: the norm weight must hold K values");
    }
    TORCH_CHECK_VALUE((form == kResidualProduct) == residual.has_value(), "gemv_forward: a residual exactly for that form");
    if (residual.has_value()) {
        check_operand(*residual, w, "gemv_forward: the residual must be contiguous, on W's device, in W's dtype");
        TORCH_CHECK_VALUE(residual->numel() == batch * N_out, "gemv_forward: the residual must be (batch, N)");
    }
    TORCH_CHECK_VALUE(k_per_split >= 1 && k_per_split % kWarpStep == 0 && splits >= 1 &&
                      (splits - 1) * k_per_split < K && splits * k_per_split >= K,
                      "gemv_forward: splits x k_per_split must cover K, k_per_split a multiple of 256");
    const int width = batch_width(static_cast<int>(batch));
    const int64_t rows_per_block = kWarps * rows_per_warp(width) / (gate_up ? 2 : 1);
    const int64_t tiles = (N_out + rows_per_block - 1) / rows_per_block;
    if (splits > 1) {
        TORCH_CHECK_VALUE(partial.is_cuda() && partial.device() == w.device() && partial.scalar_type() == torch::kFloat32 &&
                          partial.is_contiguous() && partial.numel() >= splits * batch * (w.size(0) + tiles),
                          "gemv_forward: the workspace must be float32 on W's device, splits x batch x (rows + tiles)");
        TORCH_CHECK_VALUE(counters.is_cuda() && counters.device() == w.device() && counters.scalar_type() == torch::kInt32 &&
                          counters.is_contiguous() && counters.numel() >= tiles,
                          "gemv_forward: the counters must be int32 zeros on W's device, one per row tile");
    }
    const c10::cuda::CUDAGuard guard(w.device());
    torch::Tensor y = out.has_value() ? *out : torch::empty({batch, N_out}, w.options());
    check_operand(y, w, "gemv_forward: out must be contiguous, 16-byte aligned, on W's device, in W's dtype");
    TORCH_CHECK_VALUE(y.numel() == batch * N_out, "gemv_forward: out must be (batch, N)");

    GemvParams p;
    p.w = w.data_ptr();
    p.x = x.data_ptr();
    p.norm_weight = normed ? norm_weight->data_ptr() : nullptr;
    p.residual = residual.has_value() ? residual->data_ptr() : nullptr;
    p.out = y.data_ptr();
    p.partial = splits > 1 ? partial.data_ptr<float>() : nullptr;
    p.partial_squares = splits > 1 ? p.partial + splits * batch * w.size(0) : nullptr;
    p.counters = splits > 1 ? counters.data_ptr<int>() : nullptr;
    p.N_out = static_cast<int>(N_out);
    p.K = static_cast<int>(K);
    p.batch = static_cast<int>(batch);
    p.splits = static_cast<int>(splits);
    p.k_per_split = static_cast<int>(k_per_split);
    p.inv_K = static_cast<float>(1.0 / static_cast<double>(K));
    p.eps = static_cast<float>(eps);
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    if (w.scalar_type() == torch::kHalf) launch_batch<__half>(p, static_cast<int>(tiles), static_cast<int>(form), stream);
    else launch_batch<__nv_bfloat16>(p, static_cast<int>(tiles), static_cast<int>(form), stream);
    return y;
}
// endregion
#endif  // WB_KERNEL_ONLY
