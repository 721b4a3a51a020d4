// Split-KV decoding (lesson 07): what both decode kernels and their merges share. The parameters of a call
// (DecodeParams), the NaN / Inf tests on the bits, the fused merge's counter, the split kernel's occupancy, the
// profiling builds' stamps, and the 16-byte loads and conversions.
// Device code only (no torch), so that another kernel can include it; decode_host.cu includes it and holds the
// launches. Lesson 07 shows its regions (// region: NAME) with the file named in each cell.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

#ifndef WB_DECODE_KV_NC
#define WB_DECODE_KV_NC 1  // 1: K and V through the read-only path, not kept in L1 (ld.global.nc.L1::no_allocate)
#endif

namespace wb {

// region: params_and_guards
// The running maximum before any key, and a masked score: the lowest finite float. Not -inf, so that exp2f(m - max)
// stays defined (no inf - inf); not a large finite number such as -1e30, below which a row's every score may lie (a
// large scale or large inputs), and which made such a row pass for one that saw no key (zeros and LSE -inf where
// the reference averages V). A state that saw no key has l = 0; a split or row that saw none has LSE -inf.
constexpr float kLowest = -3.402823466e38f;

// NaN and Inf tests on the bits, which no compiler flag can assume away
__device__ __forceinline__ bool is_nan(float x) { return (__float_as_uint(x) & 0x7fffffffu) > 0x7f800000u; }
__device__ __forceinline__ bool is_finite(float x) { return (__float_as_uint(x) & 0x7fffffffu) < 0x7f800000u; }

struct DecodeParams {
    const void* q;  // (B, H, D)
    const void* k_pages;  // (num_pages, Hk, page_size, D) through the strides below; a contiguous cache is (B, Hk, L, D)
    const void* v_pages;
    unsigned strides[3];  // elements between pages, heads and slots in both K and V (D's stride is 1), < 2^31
    const int* block_table;  // (B, pages_per_seq); nullptr: a contiguous cache, sequence b is page b
    const int* seq_lens;  // (B,)
    float* part_out;  // (splits, B, H, D) float32, normalised per split (unused with one split)
    float* part_lse;  // (splits, B, H) float32, natural log; -inf for an empty split (unused with one split)
    void* out;  // (B, H, D) in q's dtype: the merged output, written by the last block of each group when fused
    float* lse;  // (B, H) float32
    int* counters;  // (B * Hk * chunks) zeros: splits finished per group; nullptr: a second kernel merges, or one split
    int* status;  // flags for the host: 1 a length clamped to the cache, 2 a length past the splits' keys,
                  // 4 a page number outside the pool
    int B, H, Hk, page_size, pages_per_seq, num_pages, keys_per_split, num_splits;
    float scale_log2;  // softmax scale * log2(e)
};

// The fused merge's count of finished splits: a release (this block's partial results, written by all its threads
// before the __syncthreads that precedes it, are visible before the count) and an acquire (the block that counts last
// sees every other block's results), at GPU scope, as CUTLASS's semaphores pair them.
__device__ __forceinline__ int count_finished(int* counter) {
    int before;
    asm volatile("atom.add.acq_rel.gpu.global.s32 %0, [%1], 1;" : "=r"(before) : "l"(counter) : "memory");
    return before;
}

// Blocks per SM the split kernel asks the compiler to fit: the contiguous one (PAGED false) 4, 3 and 2 at 1, 2 and 4
// rows (64, 80 and 128 registers, no spills on sm_90; sm_80 would spill at 2 rows), the occupancy the kernel had
// before it read strides; left alone, ptxas gives it up to 80, 103 and 128. The paged one is left alone (0: no
// minimum) but for its 4-row blocks (WB_PAGED_FOUR_ROW_BLOCKS): left alone, that loop takes 150-161 registers, one
// block per SM where the contiguous one has two; asked for two, nvcc spilled 20 bytes a thread, and on the H100 the
// two blocks won by about a sixth at the paged GQA-8 shapes (2026-11-27, decode NOTES, version 15). Since the loop
// reads the page table a trip ahead (split_kernel_first_trip, version 16), it fits 128 registers without a spill.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
constexpr int kContiguousTwoRowBlocks = 0;
#else
constexpr int kContiguousTwoRowBlocks = 3;
#endif
#ifndef WB_PAGED_FOUR_ROW_BLOCKS
#define WB_PAGED_FOUR_ROW_BLOCKS 2
#endif
template <int ROWS, bool PAGED>
constexpr int kMinBlocks = PAGED ? (ROWS == 4 ? WB_PAGED_FOUR_ROW_BLOCKS : 0)
                                 : ROWS == 1 ? 4 : ROWS == 2 ? kContiguousTwoRowBlocks : 2;
// endregion

// WB_DECODE_MMA_TRACE and WB_DECODE_SPLIT_TRACE (profiling builds, never the package's): thread 0 of each block of
// the tensor-core kernel or of the split kernel stamps its progress into the status tensor past its first 4 words, 16
// words of 64 bits per block (the block's index in its grid, x fastest, then y, then z): words 0-6 %globaltimer (ns)
// at the kernel's phases (6: the fused merge done, in the block that merged; a phase a kernel does not stamp stays
// 0), 7 the SM, 8-14 clock64 at the same phases. The caller passes a status tensor that large (tune.py --mma-trace,
// --split-trace), so that a block's life (start, first tile, loop, epilogue) can be read off one call.
#if defined(WB_DECODE_MMA_TRACE) || defined(WB_DECODE_SPLIT_TRACE)
#define WB_TRACE_STAMP(PHASE)                                                                                        \
    if (threadIdx.x == 0) {                                                                                          \
        unsigned long long* slot = reinterpret_cast<unsigned long long*>(p.status + 4) +                             \
                                   16 * (((size_t)blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x);    \
        unsigned long long now;                                                                                      \
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));                                                       \
        slot[PHASE] = now;                                                                                           \
        slot[8 + PHASE] = clock64();                                                                                 \
        if (PHASE == 0) {                                                                                            \
            unsigned sm;                                                                                             \
            asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));                                                           \
            slot[7] = sm;                                                                                            \
        }                                                                                                            \
    }
#endif
#ifdef WB_DECODE_MMA_TRACE
#define WB_MMA_TRACE(PHASE) WB_TRACE_STAMP(PHASE)
#else
#define WB_MMA_TRACE(PHASE)
#endif
#ifdef WB_DECODE_SPLIT_TRACE
#define WB_SPLIT_TRACE(PHASE) WB_TRACE_STAMP(PHASE)
#else
#define WB_SPLIT_TRACE(PHASE)
#endif

// region: vector_loads
// Eight 16-bit values <-> floats. A uint4 is 16 bytes: one load instruction (LDG.E.128) per lane.
template <typename T> __device__ __forceinline__ void to_float8(const uint4& raw, float (&x)[8]);
template <> __device__ __forceinline__ void to_float8<__half>(const uint4& raw, float (&x)[8]) {
    const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __half22float2(h[i]);
        x[2 * i] = f.x;
        x[2 * i + 1] = f.y;
    }
}
template <> __device__ __forceinline__ void to_float8<__nv_bfloat16>(const uint4& raw, float (&x)[8]) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(h[i]);
        x[2 * i] = f.x;
        x[2 * i + 1] = f.y;
    }
}
// A key's or value's 16 bytes. K and V are read once per block and never written during the launch, so they may go
// through the read-only path without taking L1 lines that the page table and the query could use (on the H100: the
// paged GQA-8 bar shapes 2-5 % faster, contiguous within 1 %; decode NOTES, version 16)
__device__ __forceinline__ uint4 load_streamed(const void* address) {
#if WB_DECODE_KV_NC
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(address));
    return r;
#else
    return *reinterpret_cast<const uint4*>(address);
#endif
}
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
// endregion

}  // namespace wb
