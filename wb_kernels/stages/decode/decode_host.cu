// Split-KV decoding in CUDA C++ (lesson 07): one new query per sequence against a paged KV cache, GQA-aware.
//
// The numba kernel (kernel.py) teaches the algorithm; this one is shaped for what decode is bound by, memory
// bandwidth (Dao, Haziza, Massa, Sizov, "Flash-Decoding for long-context inference", 2023):
// - every byte of K and V is read once per KV head: the block's query rows are the query heads of one KV group
//   (GQA), held in registers, so the cache is not re-read per query head;
// - 16-byte loads: a key's D halves are spread over D / 8 lanes, each loading one uint4 (8 values);
// - several keys' K and V in flight per thread before any of them is used (the loads of KEYS_IN_FLIGHT steps are
//   issued together), so each SM keeps tens of KB of requests outstanding, what HBM needs to reach full bandwidth;
// - no shared memory on the way: each lane keeps its own online-softmax state (max, sum, 8 output columns) for the
//   keys it saw; the states are merged once per block at the end (shuffles, then shared memory across warps);
// - the splits of one sequence are merged exactly, through their log-sum-exps, by the last of its blocks to finish
//   (a counter per sequence and group, counted with release/acquire ordering, zeroed by the call that uses it), or,
//   with WB_DECODE_FUSED_MERGE=0 or very many splits, by a second small kernel; a sequence's only split writes the
//   answer itself (no partial result, no counter, no merge);
// - nothing depends on the lengths' values on the host, and every buffer comes from PyTorch's caching allocator, so a
//   call can be captured in a CUDA graph and replayed with other lengths: the last split of a sequence reads every
//   key past the others' (a length beyond the launch's max_seqlen costs time, never keys), and lengths the kernel
//   had to clamp or extend are flagged in a status word the host reads when it chooses (wb.decode_problems).
// The caches are read through their strides (HND, NHD, a slice of a longer cache: no copy); D is contiguous.
// notebooks/07_decode.ipynb shows the kernels region by region (// region: NAME), each device function before
// its caller.
// Scores are kept in log2 units (scale * log2(e) folded into q), so exp2f is one MUFU.EX2 instruction.
// NaN and Inf give what PyTorch's SDPA gives, computed here, on the GPU, without a pass on the host: a score that is
// NaN or +Inf turns its row's running sum into NaN (exp2(NaN) = NaN, exp2(Inf - Inf) = NaN), a query holding a NaN
// or an Inf poisons its row outright, and a poisoned split poisons the merged row (output and LSE NaN). A NaN or an
// Inf in V reaches the output columns it is in through P V. A sequence with no keys still gives 0 and LSE -inf.
// The files: decode_params.cuh (parameters, guards, 16-byte loads), decode_merge.cuh (the merges),
// decode_split_kernel.cuh (the split kernel), decode_mma_kernel.cuh (the tensor-core kernel): device code that
// another kernel can include. This file is the host's side: which kernels the extension holds, their launches
// and the torch entry points.

#include "decode_params.cuh"
#include "decode_merge.cuh"
#include "decode_split_kernel.cuh"
#include "decode_mma_kernel.cuh"

#ifndef WB_DECODE_FUSED_MERGE
#define WB_DECODE_FUSED_MERGE 1  // 1: the last block of a sequence's splits merges them (no second kernel)
#endif

// The launcher's choices, in one list: (head dim, query rows per block)
#define WB_FOR_EACH_DECODE_VARIANT(X) X(64, 1) X(64, 2) X(64, 4) X(128, 1) X(128, 2) X(128, 4)
// The launch configuration; a tuning run (tune.py) builds other values with -D flags.
#ifndef WB_DECODE_WARPS
#define WB_DECODE_WARPS 8
#endif
#ifndef WB_KEYS_IN_FLIGHT
#define WB_KEYS_IN_FLIGHT 2
#endif
constexpr int kDecodeWarps = WB_DECODE_WARPS;  // warps per block of the split kernel
constexpr int kKeysInFlight = WB_KEYS_IN_FLIGHT;  // key steps whose loads a lane issues before using the first

#ifdef WB_KERNEL_ONLY
// Without torch (the compile check): instantiate every kernel the launcher can choose.
#define WB_INSTANTIATE_SPLIT(D, ROWS)                                                                            \
    template __global__ void wb::decode_split_kernel<__half, D, ROWS, kDecodeWarps, kKeysInFlight, true>(const wb::DecodeParams); \
    template __global__ void wb::decode_split_kernel<__nv_bfloat16, D, ROWS, kDecodeWarps, kKeysInFlight, true>(const wb::DecodeParams); \
    template __global__ void wb::decode_split_kernel<__half, D, ROWS, kDecodeWarps, kKeysInFlight, false>(const wb::DecodeParams); \
    template __global__ void wb::decode_split_kernel<__nv_bfloat16, D, ROWS, kDecodeWarps, kKeysInFlight, false>(const wb::DecodeParams);
WB_FOR_EACH_DECODE_VARIANT(WB_INSTANTIATE_SPLIT)
#define WB_INSTANTIATE_MERGE(T, D) \
    template __global__ void wb::decode_merge_kernel<T, D>(const float*, const float*, T*, float*, int, int);
WB_INSTANTIATE_MERGE(__half, 64) WB_INSTANTIATE_MERGE(__half, 128)
WB_INSTANTIATE_MERGE(__nv_bfloat16, 64) WB_INSTANTIATE_MERGE(__nv_bfloat16, 128)
#define WB_INSTANTIATE_MMA_MERGE(T, D) \
    template __global__ void wb::decode_mma_merge_kernel<T, D>(const float*, const float*, T*, float*, int, int);
WB_INSTANTIATE_MMA_MERGE(__half, 64) WB_INSTANTIATE_MMA_MERGE(__half, 128)
WB_INSTANTIATE_MMA_MERGE(__nv_bfloat16, 64) WB_INSTANTIATE_MMA_MERGE(__nv_bfloat16, 128)
// the tensor-core kernel for large groups: 1, 2 and 4 row tiles
#define WB_INSTANTIATE_MMA(T, D, M) \
    template __global__ void wb::decode_mma_kernel<T, D, M, true>(const wb::DecodeParams); \
    template __global__ void wb::decode_mma_kernel<T, D, M, false>(const wb::DecodeParams);
#define WB_INSTANTIATE_MMA_TILES(T, D) WB_INSTANTIATE_MMA(T, D, 1) WB_INSTANTIATE_MMA(T, D, 2) WB_INSTANTIATE_MMA(T, D, 4)
WB_INSTANTIATE_MMA_TILES(__half, 64) WB_INSTANTIATE_MMA_TILES(__half, 128)
WB_INSTANTIATE_MMA_TILES(__nv_bfloat16, 64) WB_INSTANTIATE_MMA_TILES(__nv_bfloat16, 128)
#else
// region: launch_split_kernel
// c10's headers rather than ATen/cuda/CUDAContext.h (which pulls in cuBLAS): the whole file then compiles against a
// CPU build of torch's headers too, so a machine without a GPU checks it
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <algorithm>
#include <optional>

namespace wb {

template <typename T, int D, int ROWS>
void launch_decode(const DecodeParams& params, cudaStream_t stream) {
    const int group = params.H / params.Hk;
    // (sequence, KV head) in x: up to 2^31 - 1 blocks, where y and z stop at 65,535 (num_splits <= 12288: checked below)
    const dim3 grid(params.B * params.Hk, params.num_splits, (group + ROWS - 1) / ROWS);
    if (params.block_table != nullptr)
        decode_split_kernel<T, D, ROWS, kDecodeWarps, kKeysInFlight, true><<<grid, kDecodeWarps * 32, 0, stream>>>(params);
    else
        decode_split_kernel<T, D, ROWS, kDecodeWarps, kKeysInFlight, false><<<grid, kDecodeWarps * 32, 0, stream>>>(params);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (params.counters != nullptr || params.num_splits == 1) return;  // merged by its last blocks, or one split
    decode_merge_kernel<T, D><<<params.B * params.H, D, params.num_splits * sizeof(float), stream>>>(
        params.part_out, params.part_lse, static_cast<T*>(params.out), params.lse, params.B * params.H,
        params.num_splits);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ROWS: query heads per block, the group size up to 4 (more rows would not fit in registers without spilling;
// larger groups, as in MQA, take several blocks per KV head, which re-read the cache, mostly from L2)
template <typename T, int D>
void launch_rows(const DecodeParams& params, cudaStream_t stream) {
    const int group = params.H / params.Hk;
    if (group == 1) return launch_decode<T, D, 1>(params, stream);
    if (group == 2) return launch_decode<T, D, 2>(params, stream);
    return launch_decode<T, D, 4>(params, stream);
}

// The cache is read in place through its strides: copying it would cost a whole cache's bandwidth every step, so what
// the kernel's 16-byte loads and 32-bit offsets within a page cannot read is refused, saying what to do.
void check_cache_layout(const torch::Tensor& k_pages, const torch::Tensor& v_pages) {
    for (const torch::Tensor* cache : {&k_pages, &v_pages}) {
        bool aligned = reinterpret_cast<uintptr_t>(cache->data_ptr()) % 16 == 0 && cache->stride(3) == 1;
        for (int i = 0; i < 3; ++i) aligned = aligned && cache->stride(i) % 8 == 0 && cache->stride(i) >= 0;
        TORCH_CHECK_VALUE(aligned, "flash_decode: the cache is read 8 values (16 bytes) at a time, so its head dim "
                          "must be contiguous (stride 1), its other strides multiples of 8 and its data 16-byte "
                          "aligned. Allocate the cache once in that form (a fresh tensor is), rather than copying it "
                          "every step");
    }
    // (no numbers in these messages: formatting one inside this extension crashed the process on the H100 host,
    // in libstdc++'s stream insertion; wb.decode checks the same in Python first and says what it found)
    TORCH_CHECK_VALUE(v_pages.strides() == k_pages.strides(), "flash_decode: k and v caches must have the same "
                      "strides (one offset per key serves both). Allocate both caches alike");
    const int64_t span = (k_pages.size(1) - 1) * k_pages.stride(1) + (k_pages.size(2) - 1) * k_pages.stride(2);
    TORCH_CHECK_VALUE(span + k_pages.size(3) <= INT32_MAX && k_pages.stride(0) <= INT32_MAX, "flash_decode: one "
                      "page of the cache (a sequence of a contiguous one) must span fewer than 2^31 elements. Use a "
                      "paged cache for longer ones");
}

// endregion

// region: merge_counters_and_occupancy
// The fused merge's counters, one per (sequence, KV head, chunk of rows), are this call's own: the tail of the call's
// workspace (from PyTorch's caching allocator, so a CUDA graph's capture takes it from the graph's pool), zeroed on
// the call's stream by a memset that a capture records too. Two calls, on two streams or in two graphs, never share
// one, and nothing outlives the tensors it points into.
int* merge_counters(torch::Tensor& workspace, int64_t offset_bytes, int64_t needed, cudaStream_t stream) {
    int* counters = reinterpret_cast<int*>(static_cast<char*>(workspace.data_ptr()) + offset_bytes);
    C10_CUDA_CHECK(cudaMemsetAsync(counters, 0, needed * sizeof(int), stream));
    return counters;
}

template <typename T, int D, int ROWS>
int occupancy_of_rows(bool paged) {
    int blocks = 0;
    const int threads = kDecodeWarps * 32;
    if (paged)
        C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &blocks, decode_split_kernel<T, D, ROWS, kDecodeWarps, kKeysInFlight, true>, threads, 0));
    else
        C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &blocks, decode_split_kernel<T, D, ROWS, kDecodeWarps, kKeysInFlight, false>, threads, 0));
    return blocks;
}

template <typename T, int D>
int split_kernel_occupancy(int group, bool paged) {
    if (group == 1) return occupancy_of_rows<T, D, 1>(paged);
    if (group == 2) return occupancy_of_rows<T, D, 2>(paged);
    return occupancy_of_rows<T, D, 4>(paged);
}

}  // namespace wb

// How many blocks of the split kernel that launch_rows picks for (dtype, D, group size, paged or not) one SM holds at
// once, as the CUDA runtime computes it from the kernel's registers, shared memory and threads (on the current GPU).
// The launcher counts whole waves of them when it picks the number of splits (splitkv.choose_num_splits).
int64_t flash_decode_blocks_per_sm(bool bf16, int64_t head_dim, int64_t group, bool paged) {
    TORCH_CHECK(head_dim == 64 || head_dim == 128, "flash_decode: head dim must be 64 or 128, got ", head_dim);
    TORCH_CHECK(group >= 1, "flash_decode: the group size must be >= 1, got ", group);
    const int g = static_cast<int>(group);
    if (bf16) return head_dim == 64 ? wb::split_kernel_occupancy<__nv_bfloat16, 64>(g, paged)
                                    : wb::split_kernel_occupancy<__nv_bfloat16, 128>(g, paged);
    return head_dim == 64 ? wb::split_kernel_occupancy<__half, 64>(g, paged)
                          : wb::split_kernel_occupancy<__half, 128>(g, paged);
}

// endregion

// region: decode_inputs_and_params
namespace wb {
// What both entry points check and prepare first (their other checks differ): q, the caches and the status word on
// the GPU in one 16-bit dtype, q (B, H, D) made contiguous and 16-byte aligned (a copy only when it is not: q is
// small; the cache is read in place), the cache's layout, the lengths and the block table as int32 on q's device.
// `entry` names the caller; each message is one string, built only when its check fails (see check_cache_layout).
void prepare_decode_inputs(torch::Tensor& q, const torch::Tensor& k_pages, const torch::Tensor& v_pages,
                           const std::optional<torch::Tensor>& block_table, torch::Tensor& seq_lens,
                           torch::Tensor& table, const torch::Tensor& status, const char* entry) {
    TORCH_CHECK(q.is_cuda() && k_pages.is_cuda() && v_pages.is_cuda() && status.is_cuda(),
                std::string(entry) + ": q, the cache and the status word must be on the GPU");
    TORCH_CHECK(q.scalar_type() == torch::kHalf || q.scalar_type() == torch::kBFloat16,
                std::string(entry) + ": dtype must be float16 or bfloat16");
    TORCH_CHECK(k_pages.scalar_type() == q.scalar_type() && v_pages.scalar_type() == q.scalar_type(),
                std::string(entry) + ": q and the cache must have one dtype");
    TORCH_CHECK(q.dim() == 3 && k_pages.dim() == 4 && v_pages.sizes() == k_pages.sizes(),
                std::string(entry) + ": q (B, H, D), pages (num_pages, Hk, page_size, D)");
    q = q.contiguous();
    if (reinterpret_cast<uintptr_t>(q.data_ptr()) % 16 != 0) q = q.clone();
    check_cache_layout(k_pages, v_pages);
    seq_lens = seq_lens.to(q.device(), torch::kInt32).contiguous();
    if (block_table.has_value()) table = block_table->to(q.device(), torch::kInt32).contiguous();
}

// The kernels' parameters for one call, filled once for both entry points: q, the caches read in place through their
// strides, the lengths and block table (nullptr: a contiguous cache), the workspace (the splits' outputs, then their
// LSEs), the status word and the answer's tensors; no counters (the entry point zeroes them where its kernel merges)
DecodeParams decode_params(const torch::Tensor& q, const torch::Tensor& k_pages, const torch::Tensor& v_pages,
                           const torch::Tensor* table, const torch::Tensor& seq_lens, const torch::Tensor& workspace,
                           const torch::Tensor& status, const torch::Tensor& out, const torch::Tensor& lse,
                           int64_t keys_per_split, int64_t num_splits, double scale) {
    const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
    DecodeParams params;
    params.q = q.data_ptr();
    params.k_pages = k_pages.data_ptr();
    params.v_pages = v_pages.data_ptr();
    for (int i = 0; i < 3; ++i) params.strides[i] = static_cast<unsigned>(k_pages.stride(i));
    params.block_table = table != nullptr ? table->data_ptr<int>() : nullptr;
    params.seq_lens = seq_lens.data_ptr<int>();
    params.part_out = workspace.data_ptr<float>();
    params.part_lse = params.part_out + num_splits * B * H * D;
    params.status = status.data_ptr<int>();
    params.B = static_cast<int>(B);
    params.H = static_cast<int>(H);
    params.Hk = static_cast<int>(k_pages.size(1));
    params.page_size = static_cast<int>(k_pages.size(2));
    params.pages_per_seq = table != nullptr ? static_cast<int>(table->size(1)) : 1;
    params.num_pages = static_cast<int>(k_pages.size(0));
    params.keys_per_split = static_cast<int>(keys_per_split);
    params.num_splits = static_cast<int>(num_splits);
    params.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
    params.out = out.data_ptr();
    params.lse = lse.data_ptr<float>();
    params.counters = nullptr;
    return params;
}
}  // namespace wb
// endregion

// region: forward_inputs
// Returns [out (B, H, D) in q's dtype, lse (B, H) float32]. The inputs were validated by wb.decode; the checks here
// guard the raw pointers, and each says what to do.
std::vector<torch::Tensor> flash_decode_forward(torch::Tensor q, torch::Tensor k_pages, torch::Tensor v_pages,
                                                std::optional<torch::Tensor> block_table, torch::Tensor seq_lens,
                                                torch::Tensor status, int64_t keys_per_split, int64_t num_splits,
                                                double scale) {
    torch::Tensor table;  // the block table as int32 on q's device; undefined for a contiguous cache
    wb::prepare_decode_inputs(q, k_pages, v_pages, block_table, seq_lens, table, status, "flash_decode");
    const bool is_half = q.scalar_type() == torch::kHalf, paged = block_table.has_value();
    const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hk = k_pages.size(1);
    TORCH_CHECK(D == 64 || D == 128, "flash_decode: head dim must be 64 or 128, got ", D);
    TORCH_CHECK(k_pages.size(3) == D && H % Hk == 0, "flash_decode: the cache's D must be q's, and Hk divide H");
    TORCH_CHECK(seq_lens.numel() == B && (!paged || (table.dim() == 2 && table.size(0) == B && table.size(1) >= 1)),
                "flash_decode: block_table (B, pages >= 1) and seq_lens (B,)");
    TORCH_CHECK(paged || k_pages.size(0) == B, "flash_decode: a contiguous cache has B = q's batch sequences");
    TORCH_CHECK(status.scalar_type() == torch::kInt32 && status.numel() >= 1, "flash_decode: status: one int32");
    TORCH_CHECK(num_splits >= 1 && keys_per_split >= 1, "flash_decode: need num_splits >= 1, keys_per_split >= 1");
    // the merge kernel keeps one float per split in shared memory (48 KB without opting in to more)
    TORCH_CHECK_VALUE(num_splits <= 12288, "flash_decode: at most 12288 splits, got ", num_splits);
    TORCH_CHECK_VALUE((paged ? table.size(1) * k_pages.size(2) : k_pages.size(2)) <= INT32_MAX,
                      "flash_decode: at most 2^31 - 1 keys per sequence");
    const c10::cuda::CUDAGuard guard(q.device());
    auto out = torch::empty_like(q);
    auto lse = torch::empty({B, H}, q.options().dtype(torch::kFloat32));
    // one workspace per call: the splits' outputs, their LSEs, then the fused merge's counters
    const int64_t group = H / Hk, rows = group == 1 ? 1 : group == 2 ? 2 : 4;  // as launch_rows picks
    const int64_t counters = B * Hk * ((group + rows - 1) / rows);
    const int64_t part_floats = num_splits * B * H * (D + 1);
    auto workspace = torch::empty({part_floats + counters}, q.options().dtype(torch::kFloat32));

    // endregion

    // region: forward_launch
    wb::DecodeParams params = wb::decode_params(q, k_pages, v_pages, paged ? &table : nullptr, seq_lens, workspace,
                                                status, out, lse, keys_per_split, num_splits, scale);

    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    // fused merge: the split kernel's s_acc holds the weights of up to kDecodeWarps * D splits per row (one split
    // needs no merge, so no counters to zero)
    if (WB_DECODE_FUSED_MERGE && num_splits > 1 && num_splits <= kDecodeWarps * D)
        params.counters = wb::merge_counters(workspace, part_floats * sizeof(float), counters, stream);
    if (is_half) {
        if (D == 64) wb::launch_rows<__half, 64>(params, stream);
        else wb::launch_rows<__half, 128>(params, stream);
    } else {
        if (D == 64) wb::launch_rows<__nv_bfloat16, 64>(params, stream);
        else wb::launch_rows<__nv_bfloat16, 128>(params, stream);
    }
    return {out, lse};
}
// endregion

// --- mma_launch
#include <atomic>

// The tensor-core kernel for a group's query heads in one block (decode_mma_kernel), chosen by the launcher
// (launcher.cuda_kernel_for: groups from MMA_MIN_GROUP to 64 query heads per KV head). Same inputs, workspace and
// status word as flash_decode_forward; its last blocks merge (one counter per (sequence, KV head)) where a group's
// splits are few, else its own merge kernel (decode_mma_merge_kernel) follows as a programmatic dependent.
namespace wb {

// row tiles of 16 query heads for a group: 1, 2 or 4 (the warps split evenly)
inline int mma_row_tiles(int64_t group) { return group <= 16 ? 1 : group <= 32 ? 2 : 4; }

// Above 48 KB of dynamic shared memory a kernel must opt in, once per device (the attribute is the context's).
// The flag that remembers it lives in an unnamed namespace: a function-local static of a template (or inline)
// function with external linkage is one object for the whole process (g++ emits it as a "unique" symbol, merged
// across shared libraries), so a second build of this file (a tuning variant, a lesson's edited source) loaded next
// to the package's would find the flag set by the package's kernel and launch its own without the opt-in: "invalid
// argument" (every -D build of the H100 sweeps of 2026-11-26 failed so, until this change).
namespace {
// Programmatic dependent launch (the merge kernel after the mma kernel) needs sm_90; asked once per device
bool programmatic_launch_supported() {
    static std::atomic<uint64_t> known{0}, capable{0};  // a bit per device index below 64; this build's own
    int device = 0;
    C10_CUDA_CHECK(cudaGetDevice(&device));
    if (device >= 64) return false;
    const uint64_t bit = uint64_t{1} << device;
    if (!(known.load() & bit)) {
        int major = 0;
        C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
        if (major >= 9) capable.fetch_or(bit);
        known.fetch_or(bit);
    }
    return capable.load() & bit;
}

template <typename T, int D, int M_TILES, bool PAGED>
void allow_mma_shared_memory() {
    static std::atomic<uint64_t> done{0};  // a bit per device index below 64; this build's own
    int device = 0;
    C10_CUDA_CHECK(cudaGetDevice(&device));
    const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
    if (bit != 0 && (done.load() & bit)) return;
    C10_CUDA_CHECK(cudaFuncSetAttribute(decode_mma_kernel<T, D, M_TILES, PAGED>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        mma_dynamic_smem_bytes<T, D, M_TILES>()));
    done.fetch_or(bit);
}
}  // namespace

template <typename T, int D, int M_TILES, bool PAGED>
void launch_mma_variant(const DecodeParams& params, cudaStream_t stream) {
    allow_mma_shared_memory<T, D, M_TILES, PAGED>();
    const dim3 grid(params.B * params.Hk, params.num_splits, 1);
    decode_mma_kernel<T, D, M_TILES, PAGED><<<grid, MmaShape<M_TILES>::WARPS * 32, mma_dynamic_smem_bytes<T, D, M_TILES>(),
                                               stream>>>(params);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int D>
void launch_mma(const DecodeParams& params, cudaStream_t stream) {
    const int tiles = mma_row_tiles(params.H / params.Hk);
    const bool paged = params.block_table != nullptr;
    if (tiles == 1) paged ? launch_mma_variant<T, D, 1, true>(params, stream) : launch_mma_variant<T, D, 1, false>(params, stream);
    else if (tiles == 2) paged ? launch_mma_variant<T, D, 2, true>(params, stream) : launch_mma_variant<T, D, 2, false>(params, stream);
    else paged ? launch_mma_variant<T, D, 4, true>(params, stream) : launch_mma_variant<T, D, 4, false>(params, stream);
    if (params.counters != nullptr || params.num_splits == 1) return;  // merged by its last blocks, or one split
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(params.B * params.H);
    config.blockDim = dim3(D / 4 * kMmaMergeLanes);
    config.dynamicSmemBytes = params.num_splits * sizeof(float);
    config.stream = stream;
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;  // may start before the mma kernel ends
    attribute[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attribute;
    config.numAttrs = programmatic_launch_supported() ? 1 : 0;
    C10_CUDA_CHECK(cudaLaunchKernelEx(&config, decode_mma_merge_kernel<T, D>, static_cast<const float*>(params.part_out),
                                      static_cast<const float*>(params.part_lse), static_cast<T*>(params.out),
                                      params.lse, params.B * params.H, params.num_splits));
}

template <typename T, int D, int M_TILES>
int mma_occupancy_of(bool paged) {
    int blocks = 0;
    if (paged) {
        allow_mma_shared_memory<T, D, M_TILES, true>();
        C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &blocks, decode_mma_kernel<T, D, M_TILES, true>, MmaShape<M_TILES>::WARPS * 32,
            mma_dynamic_smem_bytes<T, D, M_TILES>()));
    } else {
        allow_mma_shared_memory<T, D, M_TILES, false>();
        C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &blocks, decode_mma_kernel<T, D, M_TILES, false>, MmaShape<M_TILES>::WARPS * 32,
            mma_dynamic_smem_bytes<T, D, M_TILES>()));
    }
    return blocks;
}

template <typename T, int D>
int mma_occupancy(int64_t group, bool paged) {
    const int tiles = mma_row_tiles(group);
    return tiles == 1 ? mma_occupancy_of<T, D, 1>(paged) : tiles == 2 ? mma_occupancy_of<T, D, 2>(paged)
                                                                      : mma_occupancy_of<T, D, 4>(paged);
}

// the stages' shared memory of the kernel for a group (2-byte types: float16 and bfloat16 alike)
inline int64_t mma_smem_bytes(int64_t D, int64_t group) {
    const int tiles = mma_row_tiles(group);
    if (D == 64) return tiles == 1 ? mma_dynamic_smem_bytes<__half, 64, 1>() : tiles == 2 ? mma_dynamic_smem_bytes<__half, 64, 2>()
                                                                                         : mma_dynamic_smem_bytes<__half, 64, 4>();
    return tiles == 1 ? mma_dynamic_smem_bytes<__half, 128, 1>() : tiles == 2 ? mma_dynamic_smem_bytes<__half, 128, 2>()
                                                                               : mma_dynamic_smem_bytes<__half, 128, 4>();
}

}  // namespace wb

// Blocks of decode_mma_kernel one SM holds for (dtype, D, group, paged), as the CUDA runtime computes it. The
// launcher validated the arguments (no numbers in these messages: see check_cache_layout).
int64_t flash_decode_mma_blocks_per_sm(bool bf16, int64_t head_dim, int64_t group, bool paged) {
    TORCH_CHECK_VALUE(head_dim == 64 || head_dim == 128, "flash_decode_mma: head dim must be 64 or 128");
    TORCH_CHECK_VALUE(group >= 1 && group <= wb::kMmaMaxGroup, "flash_decode_mma: the group must be 1 to 64 heads");
    if (bf16) return head_dim == 64 ? wb::mma_occupancy<__nv_bfloat16, 64>(group, paged)
                                    : wb::mma_occupancy<__nv_bfloat16, 128>(group, paged);
    return head_dim == 64 ? wb::mma_occupancy<__half, 64>(group, paged) : wb::mma_occupancy<__half, 128>(group, paged);
}

// Returns [out (B, H, D) in q's dtype, lse (B, H) float32], as flash_decode_forward; the inputs were validated by
// wb.decode and the launcher (launcher.check_cache_layout), these checks guard the raw pointers.
std::vector<torch::Tensor> flash_decode_mma_forward(torch::Tensor q, torch::Tensor k_pages, torch::Tensor v_pages,
                                                    std::optional<torch::Tensor> block_table, torch::Tensor seq_lens,
                                                    torch::Tensor status, int64_t keys_per_split, int64_t num_splits,
                                                    double scale) {
    torch::Tensor table;  // the block table as int32 on q's device; undefined for a contiguous cache
    wb::prepare_decode_inputs(q, k_pages, v_pages, block_table, seq_lens, table, status, "flash_decode_mma");
    const bool is_half = q.scalar_type() == torch::kHalf, paged = block_table.has_value();
    const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hk = k_pages.size(1);
    TORCH_CHECK_VALUE(D == 64 || D == 128, "flash_decode_mma: head dim must be 64 or 128");
    TORCH_CHECK_VALUE(k_pages.size(3) == D && H % Hk == 0 && H / Hk <= wb::kMmaMaxGroup,
                      "flash_decode_mma: the cache's D must be q's, Hk divide H, and the group be at most 64 heads");
    TORCH_CHECK_VALUE(seq_lens.numel() == B && (!paged || (table.dim() == 2 && table.size(0) == B && table.size(1) >= 1)),
                      "flash_decode_mma: block_table (B, pages >= 1) and seq_lens (B,)");
    TORCH_CHECK_VALUE(paged || k_pages.size(0) == B, "flash_decode_mma: a contiguous cache has B = q's batch sequences");
    TORCH_CHECK_VALUE(status.scalar_type() == torch::kInt32 && status.numel() >= 1, "flash_decode_mma: status: one int32");
    // at most 8192 splits: the merge kernel's weights (a float each) and its 4 KB of column sums within 48 KB
    TORCH_CHECK_VALUE(num_splits >= 1 && num_splits <= 8192 && keys_per_split >= 1,
                      "flash_decode_mma: need 1 to 8192 splits and keys_per_split >= 1");
    TORCH_CHECK_VALUE((paged ? table.size(1) * k_pages.size(2) : k_pages.size(2)) <= INT32_MAX,
                      "flash_decode_mma: at most 2^31 - 1 keys per sequence");
    const c10::cuda::CUDAGuard guard(q.device());
    auto out = torch::empty_like(q);
    auto lse = torch::empty({B, H}, q.options().dtype(torch::kFloat32));
    const int64_t group = H / Hk, counters = B * Hk;  // one counter per (sequence, KV head)
    const int64_t part_floats = num_splits * B * H * (D + 1);
    auto workspace = torch::empty({part_floats + counters}, q.options().dtype(torch::kFloat32));

    wb::DecodeParams params = wb::decode_params(q, k_pages, v_pages, paged ? &table : nullptr, seq_lens, workspace,
                                                status, out, lse, keys_per_split, num_splits, scale);

    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    // fused merge where the stages' shared memory holds the group's weights for every split (else a second kernel)
    const int64_t weights = wb::mma_smem_bytes(D, group) / 4;
    // ... and where the one block that merges does no more than the split kernel's does (4 rows x 64 splits): the
    // last block of a group reads group x splits x D floats alone, 1 MB for MQA's 32 heads at 64 splits, D = 128, which
    // one block reads far slower than the second kernel's B x H blocks do (on an H100, MQA B1 Lk32768 took 97 us fused)
    constexpr int64_t kMostFusedRowSplits = WB_DECODE_MMA_FUSED_ROW_SPLITS;
    if (WB_DECODE_FUSED_MERGE && num_splits > 1 && group * num_splits <= weights &&
        group * num_splits <= kMostFusedRowSplits)
        params.counters = wb::merge_counters(workspace, part_floats * sizeof(float), counters, stream);
    if (is_half) {
        if (D == 64) wb::launch_mma<__half, 64>(params, stream);
        else wb::launch_mma<__half, 128>(params, stream);
    } else {
        if (D == 64) wb::launch_mma<__nv_bfloat16, 64>(params, stream);
        else wb::launch_mma<__nv_bfloat16, 128>(params, stream);
    }
    return {out, lse};
}
#endif  // WB_KERNEL_ONLY
