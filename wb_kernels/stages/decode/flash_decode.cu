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
//   had to clamp or extend are flagged in a status word the host reads when it chooses (wb.decoding.decode_problems).
// The caches are read through their strides (HND, NHD, a slice of a longer cache: no copy); D is contiguous.
// notebooks/07_decode.ipynb shows it region by region (// region: NAME), each device function before its caller.
// Scores are kept in log2 units (scale * log2(e) folded into q), so exp2f is one MUFU.EX2 instruction.
// NaN and Inf give what PyTorch's SDPA gives, computed here, on the GPU, without a pass on the host: a score that is
// NaN or +Inf turns its row's running sum into NaN (exp2(NaN) = NaN, exp2(Inf - Inf) = NaN), a query holding a NaN
// or an Inf poisons its row outright, and a poisoned split poisons the merged row (output and LSE NaN). A NaN or an
// Inf in V reaches the output columns it is in through P V. A sequence with no keys still gives 0 and LSE -inf.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

#ifndef WB_DECODE_PREFETCH
#define WB_DECODE_PREFETCH 1  // 1: the next trip's loads are issued before this trip's arithmetic (see the loop)
#endif
#ifndef WB_DECODE_FUSED_MERGE
#define WB_DECODE_FUSED_MERGE 1  // 1: the last block of a sequence's splits merges them (no second kernel)
#endif
#ifndef WB_PAGED_TABLE_AHEAD
#define WB_PAGED_TABLE_AHEAD 1  // 1: the paged 4-row loop reads its page-table entries a trip before their loads
#endif
#ifndef WB_DECODE_KV_NC
#define WB_DECODE_KV_NC 1  // 1: K and V through the read-only path, not kept in L1 (ld.global.nc.L1::no_allocate)
#endif
#ifndef WB_DECODE_MERGE_VECTOR
#define WB_DECODE_MERGE_VECTOR 1  // 1: the merge sums 4 columns a thread with 16-byte loads, several lanes per column
#endif
#ifndef WB_DECODE_MERGE_UNROLL
#define WB_DECODE_MERGE_UNROLL 8  // the merge's 16-byte loads in flight per thread (16: no faster on the H100)
#endif
#ifndef WB_DECODE_CHUNKED_SOFTMAX
#define WB_DECODE_CHUNKED_SOFTMAX 1  // 1: one online-softmax rescale per trip of KEYS_IN_FLIGHT keys, not per key
#endif

namespace wb {

// region: params_and_guards
constexpr float kNegBig = -1.0e30f;  // a finite minus infinity: masked scores, empty states
constexpr float kNegHalf = -0.5e30f;  // below this: masked / empty

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
    float* part_lse;  // (splits, B, H) float32, natural log; kNegBig for an empty split (unused with one split)
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

// region: merge_split_weights
// The first half of merging the splits of `rows` consecutive query rows (row0 .. row0 + rows - 1 of the B * H):
// out = sum_s exp(lse_s - lse) out_s / sum_s exp(lse_s - lse), lse = log sum_s exp(lse_s). The splits' LSEs go into
// shared memory (`s_weight`, rows * num_splits floats), each row's largest (`s_top`) and whether a split made it NaN
// (`s_poisoned`, see the file's header) are found by a warp, then each LSE becomes its weight exp(lse_s - top) in
// place, once, rather than once per column. The partial results are read with __ldcg (from L2, past the SM's L1): in
// the fused path other blocks wrote them during this same launch, and L1 is not kept coherent with them.
template <int MAX_ROWS>
__device__ __forceinline__ void merge_split_weights(const float* part_lse, int total_rows, int row0, int rows,
                                                    int num_splits, float* s_weight, float* s_top, int* s_poisoned) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    for (int e = threadIdx.x; e < rows * num_splits; e += blockDim.x)
        s_weight[e] = __ldcg(part_lse + (size_t)(e % num_splits) * total_rows + row0 + e / num_splits);
    __syncthreads();
    for (int r = warp; r < rows; r += warps) {  // a warp per row: its largest LSE, and whether any is NaN
        float top = kNegBig;
        bool poisoned = false;
        for (int s = lane; s < num_splits; s += 32) {
            top = fmaxf(top, s_weight[r * num_splits + s]);  // fmaxf passes over a NaN; poisoned catches it
            poisoned |= is_nan(s_weight[r * num_splits + s]);
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, offset));
        poisoned = __any_sync(0xffffffffu, poisoned);
        if (lane == 0) {
            s_top[r] = top;
            s_poisoned[r] = poisoned;
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < rows * num_splits; e += blockDim.x)  // an empty split weighs 0
        s_weight[e] = s_weight[e] <= kNegHalf ? 0.f : __expf(s_weight[e] - s_top[e / num_splits]);
    __syncthreads();
}
// endregion

// region: merge_columns_by_four
// The second half in the 4-row kernels: a thread sums 4 columns of one row, one 16-byte load per split, and `parts`
// adjacent lanes share those columns, each taking every parts-th split, so that all of a thread's loads are in flight
// at once, in one or two round trips (a column a thread, below, made 8 at 32 splits; the H100: decode NOTES, v17).
template <typename T, int D>
__device__ __forceinline__ void merge_columns_by_four(const float* part_out, T* out, float* lse, int total_rows,
                                                      int row0, int rows, int num_splits, const float* s_weight,
                                                      const float* s_top, const int* s_poisoned) {
    constexpr int UNROLL = WB_DECODE_MERGE_UNROLL;
    const int pairs = rows * (D / 4);  // (row, 4 columns)
    int parts = 1;
    while (parts < 32 && parts * 2 * pairs <= (int)blockDim.x) parts *= 2;
    const int work = (pairs * parts + 31) / 32 * 32;  // whole warps: the shuffles below need every lane
    for (int e = threadIdx.x; e < work; e += blockDim.x) {
        const int pair = e / parts, part = e % parts;
        const bool mine = pair < pairs;
        const int r = mine ? pair / (D / 4) : 0, d = (pair % (D / 4)) * 4;
        const size_t row = (size_t)row0 + r;
        float total = 0.f, value[4] = {0.f, 0.f, 0.f, 0.f};
        // UNROLL splits' loads issued together (a loop that tests its bound per split waits for each load in turn)
        for (int s0 = part; mine && !s_poisoned[r] && s0 < num_splits; s0 += UNROLL * parts) {
            float4 o[UNROLL];
#pragma unroll
            for (int i = 0; i < UNROLL; ++i)  // past the last split: 0, not a split read again (its 0 weight x Inf)
                o[i] = s0 + i * parts < num_splits
                           ? __ldcg(reinterpret_cast<const float4*>(part_out + ((size_t)(s0 + i * parts) * total_rows + row) * D + d))
                           : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int i = 0; i < UNROLL; ++i) {
                const float w = s0 + i * parts < num_splits ? s_weight[r * num_splits + s0 + i * parts] : 0.f;
                total += w;
                value[0] += w * o[i].x, value[1] += w * o[i].y, value[2] += w * o[i].z, value[3] += w * o[i].w;
            }
        }
        for (int offset = parts / 2; offset > 0; offset /= 2) {  // the parts' sums, within their lanes
            total += __shfl_xor_sync(0xffffffffu, total, offset);
#pragma unroll
            for (int i = 0; i < 4; ++i) value[i] += __shfl_xor_sync(0xffffffffu, value[i], offset);
        }
        if (!mine || part != 0) continue;
        const float nan = __int_as_float(0x7fc00000);
#pragma unroll
        for (int i = 0; i < 4; ++i)
            out[row * D + d + i] = from_float<T>(s_poisoned[r] ? nan : total > 0.f ? value[i] / total : 0.f);
        if (d == 0) lse[row] = s_poisoned[r] ? nan : total > 0.f ? s_top[r] + logf(total) : -INFINITY;
    }
}
// endregion

// region: merge_splits
// Merges the splits of `rows` rows with the block's threads: the weights, then the columns, by four in the 4-row
// kernels (at 1 and 2 rows, whose kernels fit more blocks on an SM, its registers would cost occupancy) or one a
// thread, every column summing its splits with independent loads.
template <typename T, int D, int MAX_ROWS>
__device__ __forceinline__ void merge_splits(const float* part_out, const float* part_lse, T* out, float* lse,
                                             int total_rows, int row0, int rows, int num_splits, float* s_weight) {
    __shared__ float s_top[MAX_ROWS];
    __shared__ int s_poisoned[MAX_ROWS];
    merge_split_weights<MAX_ROWS>(part_lse, total_rows, row0, rows, num_splits, s_weight, s_top, s_poisoned);
    if constexpr (WB_DECODE_MERGE_VECTOR && MAX_ROWS >= 4) {
        merge_columns_by_four<T, D>(part_out, out, lse, total_rows, row0, rows, num_splits, s_weight, s_top,
                                    s_poisoned);
        return;
    }
    for (int e = threadIdx.x; e < rows * D; e += blockDim.x) {
        const int r = e / D, d = e % D;
        const size_t row = (size_t)row0 + r;
        if (s_poisoned[r]) {
            out[row * D + d] = from_float<T>(__int_as_float(0x7fc00000));
            if (d == 0) lse[row] = __int_as_float(0x7fc00000);
            continue;
        }
        const float* weight = s_weight + r * num_splits;
        float total = 0.f, value = 0.f;
#pragma unroll 8
        for (int s = 0; s < num_splits; ++s) {
            total += weight[s];
            value += weight[s] * __ldcg(part_out + ((size_t)s * total_rows + row) * D + d);  // an empty split's is 0
        }
        out[row * D + d] = from_float<T>(total > 0.f ? value / total : 0.f);
        if (d == 0) lse[row] = total > 0.f ? s_top[r] + logf(total) : -INFINITY;
    }
}
// endregion

// region: decode_merge_kernel
// The second kernel, where the split kernel does not merge (WB_DECODE_FUSED_MERGE=0, or more splits than its shared
// memory holds weights for): one block of D threads per query row.
template <typename T, int D>
__global__ void decode_merge_kernel(const float* part_out, const float* part_lse, T* out, float* lse, int rows,
                                    int num_splits) {
    extern __shared__ float s_weight[];  // [num_splits]
    merge_splits<T, D, 1>(part_out, part_lse, out, lse, rows, blockIdx.x, 1, num_splits, s_weight);
}
// endregion

// region: split_kernel_setup
// Grid: (B * Hk, splits, ceil(G / ROWS)): (sequence, KV head) in x, the one dimension past 65,535 blocks. Block:
// NUM_WARPS warps. LANES_PER_KEY = D / 8 lanes share a key, so a warp reads 32 / LANES_PER_KEY keys per step and a
// block NUM_WARPS times that.
// PAGED: keys through the block table; otherwise a contiguous cache, sequence b one page of L keys (no table to read,
// no division per key); kMinBlocks (above, with the parameters) is its occupancy.
template <typename T, int D, int ROWS, int NUM_WARPS, int KEYS_IN_FLIGHT, bool PAGED>
__global__ void __launch_bounds__(NUM_WARPS * 32, (kMinBlocks<ROWS, PAGED>)) decode_split_kernel(const DecodeParams p) {
    constexpr int LANES_PER_KEY = D / 8;
    constexpr int KEYS_PER_WARP = 32 / LANES_PER_KEY;
    constexpr int KEYS_PER_STEP = KEYS_PER_WARP * NUM_WARPS;
    WB_SPLIT_TRACE(0);  // a profiling build's stamps (WB_DECODE_SPLIT_TRACE): entry, loads issued, loop end, ...

    const int b = blockIdx.x / p.Hk, kv_head = blockIdx.x % p.Hk;
    const int split = blockIdx.y;
    const int group = p.H / p.Hk;
    const int head0 = kv_head * group + blockIdx.z * ROWS;  // this block's first query head
    const int rows = min(ROWS, kv_head * group + group - head0);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int key_lane = lane / LANES_PER_KEY;  // which of the warp's keys this lane reads
    const int col = (lane % LANES_PER_KEY) * 8;  // the 8 columns it reads of that key

    // the lengths on the device are clamped to the cache, so a wrong value cannot read outside it, and flagged
    const int capacity = p.pages_per_seq * p.page_size;
    const int asked = p.seq_lens[b];
    const int length = min(max(asked, 0), capacity);
    const int start = split * p.keys_per_split;
    // the last split reads every key past the others', so a length beyond the launch's splits loses none
    const int stop = split == p.num_splits - 1 ? length : min(start + p.keys_per_split, length);
    if (threadIdx.x == 0 && split == p.num_splits - 1 && kv_head == 0 && blockIdx.z == 0) {
        const int flags = (asked != length ? 1 : 0) | (length - start > p.keys_per_split ? 2 : 0);
        if (flags) atomicOr(p.status, flags);
    }

    float q[ROWS][8];  // this lane's 8 columns of each query row, times scale * log2(e)
    bool q_bad[ROWS];  // the row's query holds a NaN or an Inf (any column: the warp's lanes cover all D)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        uint4 raw = make_uint4(0, 0, 0, 0);
        if (r < rows) raw = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.q) + ((size_t)b * p.H + head0 + r) * D + col);
        to_float8<T>(raw, q[r]);
        bool bad = false;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            bad |= !is_finite(q[r][i]);
            q[r][i] *= p.scale_log2;
        }
        q_bad[r] = __any_sync(0xffffffffu, bad);
    }
    float m[ROWS], l[ROWS], acc[ROWS][8];  // this lane's online-softmax state per row, over the keys it saw
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        m[r] = kNegBig;
        l[r] = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[r][i] = 0.f;
    }

// endregion

    // region: split_kernel_loads
    // this KV head's column `col` (and for a contiguous cache, sequence b's page); a key adds its page's and slot's
    // offsets, in 32 bits within a page (the launcher checks that a page spans fewer than 2^31 elements)
    const size_t head = (size_t)(unsigned)kv_head * p.strides[1] + col + (PAGED ? 0 : (size_t)(unsigned)b * p.strides[0]);
    const T* k_base = static_cast<const T*>(p.k_pages) + head;
    const T* v_base = static_cast<const T*>(p.v_pages) + head;
    const int* table = p.block_table + (PAGED ? (size_t)b * p.pages_per_seq : 0);
    // key / page_size as a multiply and a shift (Granlund and Montgomery, "Division by invariant integers using
    // multiplication", 1994): with shift = 31 + ceil(log2 page_size) and magic = ceil(2^shift / page_size), it is exact
    // for every key below 2^31. A division by a value known only at run time is some 20 dependent instructions
    // (I2F, MUFU.RCP, F2I, fix-ups) between a key and its page-table read; this is three.
    const int page_shift = 31 + (32 - __clz(p.page_size - 1));
    const unsigned page_magic = (unsigned)(((1ull << page_shift) + p.page_size - 1) / (unsigned)p.page_size);
    auto page_of = [&](int key) { return (int)(((unsigned long long)(unsigned)key * page_magic) >> page_shift); };
    constexpr int STRIDE = KEYS_PER_STEP * KEYS_IN_FLIGHT;  // keys the block covers per trip round the loop
    // the loads of KEYS_IN_FLIGHT steps from key0 on (zeros past the split's end), in two parts. read_pages: every
    // step's page-table entry (an index past the sequence's row is clamped into it; that entry goes unused);
    // load: with those entries, every address, then the keys' and values' loads, issued together
    int page[KEYS_IN_FLIGHT];
    auto read_pages = [&](int key0) {
        if constexpr (PAGED) {
#pragma unroll
            for (int s = 0; s < KEYS_IN_FLIGHT; ++s)
                page[s] = table[min(page_of(key0 + s * KEYS_PER_STEP + key_lane), p.pages_per_seq - 1)];
        }
    };
    auto load = [&](int key0, uint4 (&k_raw)[KEYS_IN_FLIGHT], uint4 (&v_raw)[KEYS_IN_FLIGHT]) {
        // every offset before any load: a table read pending behind the loads would be waited for with them (loads
        // share the counters that track their registers); an entry outside the pool reads the nearest page (status 4)
        size_t offset[KEYS_IN_FLIGHT];
#pragma unroll
        for (int s = 0; s < KEYS_IN_FLIGHT; ++s) {
            const int key = key0 + s * KEYS_PER_STEP + key_lane;
            offset[s] = (size_t)(unsigned)key * p.strides[2];
            if constexpr (PAGED) {
                const int slot = key - page_of(key) * p.page_size;
                // a 32 x 32 -> 64-bit product (one IMAD.WIDE.U32): the pool may hold more than 2^32 elements
                offset[s] = (size_t)(unsigned)min(max(page[s], 0), p.num_pages - 1) * p.strides[0] +
                            (unsigned)slot * p.strides[2];
            }
        }
#pragma unroll
        for (int s = 0; s < KEYS_IN_FLIGHT; ++s) {
            k_raw[s] = v_raw[s] = make_uint4(0, 0, 0, 0);
            if (key0 + s * KEYS_PER_STEP + key_lane < stop) {
                k_raw[s] = load_streamed(k_base + offset[s]);
                v_raw[s] = load_streamed(v_base + offset[s]);
            }
        }
    };
    // endregion

    // region: split_kernel_first_trip
    // TABLE_AHEAD: a trip's loads use entries read a trip earlier, so none waits behind a table read. It won on the
    // H100 for 4-row blocks only (and ends their spill); at 1 and 2 rows it costs registers (decode NOTES, version 16)
    constexpr bool TABLE_AHEAD = PAGED && ROWS == 4 && WB_PAGED_TABLE_AHEAD;
    // one trip's loads, in the one order of this build: its entries, then its loads; or, reading ahead, its loads
    // (with the entries read a trip earlier), then the next trip's entries
    auto load_trip = [&](int trip0, uint4 (&k_raw)[KEYS_IN_FLIGHT], uint4 (&v_raw)[KEYS_IN_FLIGHT]) {
        if constexpr (!TABLE_AHEAD) read_pages(trip0);
        load(trip0, k_raw, v_raw);
        if constexpr (TABLE_AHEAD) read_pages(trip0 + STRIDE);
    };
    uint4 k_raw[KEYS_IN_FLIGHT], v_raw[KEYS_IN_FLIGHT];
    int key0 = start + warp * KEYS_PER_WARP;
    if constexpr (TABLE_AHEAD) read_pages(key0);  // the first trip's entries: no trip before it read them
    load_trip(key0, k_raw, v_raw);
    WB_SPLIT_TRACE(1);
    // endregion

    // region: split_kernel_trip_scores
    for (; key0 < stop; key0 += STRIDE) {
#if WB_DECODE_PREFETCH
        // the next trip's loads go out before this trip's arithmetic, so memory is never idle while a warp computes
        // (twice the registers for the raw data)
        uint4 k_next[KEYS_IN_FLIGHT], v_next[KEYS_IN_FLIGHT];
        load_trip(key0 + STRIDE, k_next, v_next);
#endif
#if WB_DECODE_CHUNKED_SOFTMAX
        // The online softmax once per trip rather than once per key: the trip's KEYS_IN_FLIGHT scores per row first,
        // then one rescale of the state by their maximum, then their weights added. The per-key form (below) pays
        // 8 multiplies per row and key to rescale acc, and an extra exp2.
        float kx[KEYS_IN_FLIGHT][8], score[KEYS_IN_FLIGHT][ROWS];
        bool valid[KEYS_IN_FLIGHT];
#pragma unroll
        for (int s = 0; s < KEYS_IN_FLIGHT; ++s) {
            valid[s] = key0 + s * KEYS_PER_STEP + key_lane < stop;
            to_float8<T>(k_raw[s], kx[s]);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                float dot = 0.f;
#pragma unroll
                for (int i = 0; i < 8; ++i) dot = fmaf(q[r][i], kx[s][i], dot);
                // the D / 8 lanes of one key hold partial dot products: add them up (lanes of a key are adjacent)
#pragma unroll
                for (int offset = LANES_PER_KEY / 2; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
                score[s][r] = valid[s] ? dot : kNegBig;  // a NaN score stays NaN (see the header)
            }
        }
        // endregion

        // region: split_kernel_trip_softmax
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            float new_max = m[r];
#pragma unroll
            for (int s = 0; s < KEYS_IN_FLIGHT; ++s) new_max = fmaxf(new_max, score[s][r]);
            const float alpha = exp2f(m[r] - new_max);  // 1 when the maximum did not move
            l[r] *= alpha;
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[r][i] *= alpha;
            m[r] = new_max;
        }
#pragma unroll
        for (int s = 0; s < KEYS_IN_FLIGHT; ++s) {
            float vx[8];
            to_float8<T>(v_raw[s], vx);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                // a key past the split's end weighs 0 (exp2 of kNegBig - m would be 1 while m is still kNegBig)
                const float weight = valid[s] ? exp2f(score[s][r] - m[r]) : 0.f;
                l[r] += weight;
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[r][i] = fmaf(weight, vx[i], acc[r][i]);
            }
        }
        // endregion

        // region: split_kernel_per_key_and_next_trip
#else
#pragma unroll
        for (int s = 0; s < KEYS_IN_FLIGHT; ++s) {
            const bool valid = key0 + s * KEYS_PER_STEP + key_lane < stop;
            float kx[8], vx[8];
            to_float8<T>(k_raw[s], kx);
            to_float8<T>(v_raw[s], vx);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                float score = 0.f;
#pragma unroll
                for (int i = 0; i < 8; ++i) score = fmaf(q[r][i], kx[i], score);
                // the D / 8 lanes of one key hold partial dot products: add them up (lanes of a key are adjacent)
#pragma unroll
                for (int offset = LANES_PER_KEY / 2; offset > 0; offset /= 2)
                    score += __shfl_xor_sync(0xffffffffu, score, offset);
                if (!valid) continue;
                const float new_max = fmaxf(m[r], score);
                const float alpha = exp2f(m[r] - new_max);  // 0 while m[r] is kNegBig and score is not
                const float weight = exp2f(score - new_max);
                l[r] = l[r] * alpha + weight;
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[r][i] = fmaf(weight, vx[i], acc[r][i] * alpha);
                m[r] = new_max;
            }
        }
#endif
#if WB_DECODE_PREFETCH
#pragma unroll
        for (int s = 0; s < KEYS_IN_FLIGHT; ++s) {
            k_raw[s] = k_next[s];
            v_raw[s] = v_next[s];
        }
#else
        load_trip(key0 + STRIDE, k_raw, v_raw);
#endif
    }
    if constexpr (PAGED) {
        // status bit 4: an entry of this split's pages outside the pool (the loads read the nearest page), looked for
        // once per block after its loop, where the entries are in cache, rather than once per key inside it
        if (blockIdx.z == 0 && stop > start) {
            bool outside = false;
            for (int i = start / p.page_size + threadIdx.x; i <= (stop - 1) / p.page_size; i += NUM_WARPS * 32)
                outside |= table[i] < 0 || table[i] >= p.num_pages;
            if (outside) atomicOr(p.status, 4);
        }
    }
    WB_SPLIT_TRACE(4);

    // endregion

    // region: split_kernel_block_merge
    // merge the states of the warp's KEYS_PER_WARP key lanes (same columns, different keys): xor over key bits
#pragma unroll
    for (int offset = LANES_PER_KEY; offset < 32; offset *= 2) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const float m_other = __shfl_xor_sync(0xffffffffu, m[r], offset);
            const float l_other = __shfl_xor_sync(0xffffffffu, l[r], offset);
            const float new_max = fmaxf(m[r], m_other);
            // an empty state has l = 0 and acc = 0, so its weight does not matter, even exp2(0) = 1
            const float mine = exp2f(m[r] - new_max), theirs = exp2f(m_other - new_max);
            l[r] = l[r] * mine + l_other * theirs;
#pragma unroll
            for (int i = 0; i < 8; ++i)
                acc[r][i] = acc[r][i] * mine + __shfl_xor_sync(0xffffffffu, acc[r][i], offset) * theirs;
            m[r] = new_max;
        }
    }

    // endregion

    // region: split_kernel_write
    // then across warps, through shared memory: lanes 0 .. LANES_PER_KEY-1 of each warp hold its state
    __shared__ float s_m[NUM_WARPS][ROWS], s_l[NUM_WARPS][ROWS], s_acc[NUM_WARPS][ROWS][D];
    if (key_lane == 0) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            if (col == 0) {
                s_m[warp][r] = m[r];
                s_l[warp][r] = l[r];
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) s_acc[warp][r][col + i] = acc[r][i];
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < rows * D; e += NUM_WARPS * 32) {
        const int r = e / D, d = e % D;
        float top = kNegBig;
        for (int w = 0; w < NUM_WARPS; ++w) top = fmaxf(top, s_m[w][r]);
        float total = 0.f, value = 0.f;
        for (int w = 0; w < NUM_WARPS; ++w) {
            const float weight = exp2f(s_m[w][r] - top);
            total += s_l[w][r] * weight;
            value += s_acc[w][r][d] * weight;
        }
        const size_t row = ((size_t)split * p.B + b) * p.H + head0 + r;
        // q_bad is the same in every warp; the split poisons its row only if it holds keys (a row that sees no
        // key stays 0, whatever its query)
        const bool poisoned = is_nan(total) || (q_bad[r] && stop > start);
        const bool seen = total > 0.f;
        const float nan = __int_as_float(0x7fc00000), result = poisoned ? nan : seen ? value / total : 0.f;
        const float row_lse = poisoned ? nan : seen ? (top + log2f(total)) * 0.6931471805599453f : kNegBig;
        if (p.num_splits == 1) {  // the one split's result is the answer: written as the merge of one split would
            static_cast<T*>(p.out)[row * D + d] = from_float<T>(result);
            if (d == 0) p.lse[row] = row_lse == kNegBig ? -INFINITY : row_lse;
        } else {
            p.part_out[row * D + d] = result;
            if (d == 0) p.part_lse[row] = row_lse;
        }
    }
    WB_SPLIT_TRACE(5);
    // endregion

    // region: split_kernel_fused_merge
    // nothing to merge with one split; with more, a second kernel merges them unless the counters are passed
    if (p.num_splits == 1 || p.counters == nullptr) return;

    // The last of the group's split blocks to finish merges them, in this launch: no second kernel to wait for, and
    // the partial results are read back from L2 while they are still there. Every thread's writes happen before the
    // __syncthreads, and thread 0 counts the block done with a release at GPU scope; the block that counts last
    // acquires, so after its own __syncthreads all its threads see every split's results.
    __syncthreads();  // also: every thread is done with s_acc, which the merge reuses for the splits' weights
    __shared__ bool s_last;
    int* counter = p.counters + (size_t)blockIdx.x * gridDim.z + blockIdx.z;  // one per (sequence, KV head, rows)
    if (threadIdx.x == 0) s_last = count_finished(counter) == p.num_splits - 1;
    __syncthreads();
    if (!s_last) return;
    merge_splits<T, D, ROWS>(p.part_out, p.part_lse, static_cast<T*>(p.out), p.lse, p.B * p.H, b * p.H + head0, rows,
                             p.num_splits, &s_acc[0][0][0]);  // room for NUM_WARPS * D splits' weights per row
    WB_SPLIT_TRACE(6);
}
// endregion

// --- mma_decode_operands (parts of the tensor-core kernel, marked "// ---", not regions: lesson 07 does not show
// them yet, and it shows every region of this file)
// MQA and large groups on tensor cores. The split kernel above holds at most 4 query heads of a group per block, so a
// group of 32 (MQA on 32 query heads) takes 8 blocks per split, each reading the same keys. The kernel below holds
// the whole group in one block: the group's query heads are the M dimension (16 rows per tile, padded with zero rows)
// of mma.sync.aligned.m16n8k16 (PTX ISA, "Warp-level matrix multiply-accumulate instructions"; lesson 06), so each
// split's keys come from memory once, whatever the group size (up to 64: 4 tiles of 16 rows).
// Which element of A, B and C each lane holds is fixed by the PTX ISA (wb_kernels/stages/mma/fragments.py models it).
// fp32 accumulators; P rounded to the inputs' 16-bit type before P V, as FlashAttention-2 does.
template <typename T> struct DecodeMma;
template <> struct DecodeMma<__half> {
    static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {  // lo in the lower half (lower column)
        const __half2 pair = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<const uint32_t*>(&pair);
    }
};
template <> struct DecodeMma<__nv_bfloat16> {
    static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<const uint32_t*>(&pair);
    }
};

// ldmatrix: four 8 x 8 matrices of 16-bit values from shared memory, lanes 8i .. 8i+7 addressing matrix i's rows;
// lane l receives row l / 4, columns 2 (l % 4) and +1 of each: an mma operand's layout. ".trans" transposes each
// matrix, which turns V's rows (keys) into the B operand's columns. volatile: the same address holds the next tile.
__device__ __forceinline__ void decode_ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}
__device__ __forceinline__ void decode_ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}

// cp.async: 16 bytes global -> shared without registers, so the next tiles load while the warps compute on this one.
// A key past the split's end is zero-filled (src-size 0, nothing read): no garbage, or NaN, enters a product.
__device__ __forceinline__ void decode_cp_async_16(void* shared_dst, const void* global_src, bool in_bounds) {
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(shared_dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(global_src), "r"(in_bounds ? 16 : 0));
}
__device__ __forceinline__ void decode_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void decode_cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory"); }

// A tile in shared memory: rows of D 16-bit values, each cut into 16-byte chunks, chunk c of row r stored at chunk
// position c ^ (r % 8), so that the 8 rows one ldmatrix phase reads land on 8 different groups of banks.
template <int D>
__device__ __forceinline__ int decode_swizzled(int row, int chunk) { return row * D + ((chunk ^ (row & 7)) << 3); }

// --- mma_decode_shape
// Block: WARPS warps; tiles of KEYS keys stream through STAGES shared-memory stages. Warp w takes row tile
// w % M_TILES and, of each key tile, the keys of slice w / M_TILES: SLICES = WARPS / M_TILES warps share a row tile,
// each on its own WARP_KEYS = KEYS / SLICES keys (at least 16: one k step of P V). Shared memory: the stages (dynamic,
// opted in above 48 KB), reused after the loop for the slices' outputs and the fused merge's weights.
// Why 8 warps (the H100's ncu, MQA B8 Lk8192 at one block per SM, 2026-11-26): with 4 warps each scheduler held one
// warp, which issued an instruction every 4.8 cycles, and the SMs sat waiting on that one warp's latency (DRAM at
// 41 % of its peak); 8 warps halve each warp's share of a tile and give each scheduler a second warp. With one row
// tile, 8 slices of 16 keys make 128-key tiles (two stages fit where three of 64 keys did).
#ifndef WB_DECODE_MMA_WARPS
#define WB_DECODE_MMA_WARPS 8
#endif
constexpr int kMmaMaxGroup = 64;  // 4 row tiles; larger groups take the split kernel
template <int M_TILES>
struct MmaShape {
    static constexpr int WARPS = WB_DECODE_MMA_WARPS;
    static constexpr int SLICES = WARPS / M_TILES;
    static constexpr int KEYS = SLICES * 16 > 64 ? SLICES * 16 : 64;
    static constexpr int WARP_KEYS = KEYS / SLICES;
};
// (Query head, split) pairs up to which the last block of a group merges them (the host's choice; past it the merge
// kernel does): one block reads them alone, at the latency of a memory still busy with the other blocks' streams, and
// at 1024 pairs (tune.py's fused1024) MQA was slower at every shape (decode NOTES, 2026-11-27)
#ifndef WB_DECODE_MMA_FUSED_ROW_SPLITS
#define WB_DECODE_MMA_FUSED_ROW_SPLITS 256
#endif
// Stages of the tile pipeline: 2 of 128-key tiles or 3 of 64 (128 or 96 KB at D = 128), unless WB_DECODE_MMA_SMEM_KB
// (a tuning knob: tune.py's MMA_VARIANTS) gives them that many kilobytes (2 to 8 stages), to try more tiles in flight
#ifndef WB_DECODE_MMA_SMEM_KB
#define WB_DECODE_MMA_SMEM_KB 0
#endif
template <typename T, int D, int M_TILES>
struct MmaStages {
    static constexpr int STAGE_BYTES = 2 * MmaShape<M_TILES>::KEYS * D * (int)sizeof(T);
    static constexpr int ASKED = WB_DECODE_MMA_SMEM_KB * 1024 / STAGE_BYTES;
    static constexpr int VALUE = WB_DECODE_MMA_SMEM_KB == 0 ? (MmaShape<M_TILES>::KEYS > 64 ? 2 : 3)
                                                            : ASKED < 2 ? 2 : ASKED > 8 ? 8 : ASKED;
};
template <typename T, int D, int M_TILES>
constexpr int mma_dynamic_smem_bytes() {
    return MmaStages<T, D, M_TILES>::VALUE * MmaStages<T, D, M_TILES>::STAGE_BYTES;
}

// --- mma_decode_fused_merge
// The mma path's fused merge: the block that finished a group's last split merges every split's partial results
// for the group's rows (merge_splits' arithmetic: weights from the LSEs, NaN poisoning, an empty split weighs 0),
// with its loads spread for one block of THREADS: each thread owns up to ITEMS (row, 4 columns) items and walks the
// splits for all of them at once, 16-byte loads, several splits unrolled, so that about 16 loads are in flight per
// thread instead of one per split (merge_splits' column loop). Still one block: where the pairs are many, the second
// kernel merges instead (WB_DECODE_MMA_FUSED_ROW_SPLITS).
template <typename T, int D, int ROWS, int THREADS>
__device__ __forceinline__ void mma_fused_merge(const DecodeParams& p, int row0, int rows, float* s_weight) {
    constexpr int COLUMNS = D / 4, ITEMS = (ROWS * COLUMNS + THREADS - 1) / THREADS;
    constexpr int UNROLL = ITEMS >= 8 ? 2 : 4;  // splits a trip: about 16 loads in flight a thread, no spills
    __shared__ float s_top[ROWS], s_total[ROWS];
    __shared__ int s_poisoned[ROWS];
    const int total_rows = p.B * p.H, splits = p.num_splits;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int e = threadIdx.x; e < rows * splits; e += THREADS)
        s_weight[e] = __ldcg(p.part_lse + (size_t)(e % splits) * total_rows + row0 + e / splits);
    __syncthreads();
    for (int r = warp; r < rows; r += THREADS / 32) {  // a warp per row: its largest LSE, NaN, weights, their sum
        float* weight = s_weight + r * splits;
        float top = kNegBig;
        bool poisoned = false;
        for (int s = lane; s < splits; s += 32) {
            top = fmaxf(top, weight[s]);  // fmaxf passes over a NaN; poisoned catches it
            poisoned |= is_nan(weight[s]);
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, offset));
        poisoned = __any_sync(0xffffffffu, poisoned);
        float total = 0.f;
        for (int s = lane; s < splits; s += 32) {  // each lane rewrites only the entries it read
            weight[s] = weight[s] <= kNegHalf ? 0.f : __expf(weight[s] - top);
            total += weight[s];
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) total += __shfl_xor_sync(0xffffffffu, total, offset);
        if (lane == 0) {
            s_top[r] = top;
            s_total[r] = total;
            s_poisoned[r] = poisoned;
        }
    }
    __syncthreads();
    float4 value[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) value[i] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll UNROLL
    for (int s = 0; s < splits; ++s) {
        const float4* split = reinterpret_cast<const float4*>(p.part_out + ((size_t)s * total_rows + row0) * D);
#pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
            const int e = threadIdx.x + i * THREADS;
            if (e < rows * COLUMNS) {
                const float weight = s_weight[(e / COLUMNS) * splits + s];
                const float4 x = __ldcg(split + e);  // row e / COLUMNS, columns 4 (e % COLUMNS) ..: rows are D apart
                value[i].x += weight * x.x;
                value[i].y += weight * x.y;
                value[i].z += weight * x.z;
                value[i].w += weight * x.w;
            }
        }
    }
    T* out = static_cast<T*>(p.out);
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int e = threadIdx.x + i * THREADS;
        if (e >= rows * COLUMNS) continue;
        const int r = e / COLUMNS, c = 4 * (e % COLUMNS);
        const size_t row = (size_t)row0 + r;
        const float total = s_total[r];
        const float nan = __int_as_float(0x7fc00000);
        const float4 v = s_poisoned[r] ? make_float4(nan, nan, nan, nan)
                         : total > 0.f ? make_float4(value[i].x / total, value[i].y / total, value[i].z / total,
                                                     value[i].w / total)
                                       : make_float4(0.f, 0.f, 0.f, 0.f);
        out[row * D + c] = from_float<T>(v.x);
        out[row * D + c + 1] = from_float<T>(v.y);
        out[row * D + c + 2] = from_float<T>(v.z);
        out[row * D + c + 3] = from_float<T>(v.w);
        if (c == 0) p.lse[row] = s_poisoned[r] ? nan : total > 0.f ? s_top[r] + logf(total) : -INFINITY;
    }
}

// --- mma_decode_setup
template <typename T, int D, int M_TILES, bool PAGED>
__global__ void __launch_bounds__(MmaShape<M_TILES>::WARPS * 32) decode_mma_kernel(const DecodeParams p) {
    using Shape = MmaShape<M_TILES>;
    constexpr int THREADS = Shape::WARPS * 32, KEYS = Shape::KEYS, STAGES = MmaStages<T, D, M_TILES>::VALUE;
    constexpr int ROWS = 16 * M_TILES;  // the group, padded to whole row tiles
    constexpr int SLICES = Shape::SLICES;  // warps per row tile, each on its own keys of every tile
    constexpr int WARP_KEYS = Shape::WARP_KEYS;
    constexpr int N_TILES = WARP_KEYS / 8;  // S tiles of 16 rows x 8 keys per warp and key tile
    constexpr int PV_STEPS = WARP_KEYS / 16;  // k steps of O += P V
    constexpr int K_STEPS = D / 16;  // k steps of S = Q K^T
    constexpr int D_TILES = D / 8;  // O tiles of 16 rows x 8 columns
    constexpr int CHUNKS = D / 8;  // 16-byte chunks per key
    constexpr int ROWS_PER_PASS = THREADS / CHUNKS;  // keys a pass of cp.async covers: 32 at D = 64, 16 at D = 128
    constexpr int TILE = KEYS * D;  // elements of one K or V tile
    // the slices' outputs, rows D + 8 floats apart: a warp's float2 stores (8 rows x 4 column pairs) then fall on
    // 32 different banks per half warp (at D floats apart every row starts on bank 0: a 7-way conflict in ncu)
    constexpr int O_STRIDE = D + 8;
    static_assert(Shape::WARPS % M_TILES == 0 && WARP_KEYS % 16 == 0, "whole k steps of P V per warp");
    static_assert(ROWS_PER_PASS % 8 == 0 && KEYS % ROWS_PER_PASS == 0, "whole passes of whole swizzle periods");
    static_assert(SLICES * ROWS * O_STRIDE <= STAGES * 2 * TILE * (int)sizeof(T) / 4, "the slices' outputs fit");

    extern __shared__ __align__(16) unsigned char s_dynamic[];
    T* s_kv = reinterpret_cast<T*>(s_dynamic);  // [stage][K, V][KEYS][D], swizzled
    __shared__ __align__(16) T s_q[ROWS * D];  // the group's query rows, swizzled, zero past the group
    __shared__ int s_q_bad[ROWS];  // the row's query holds a NaN or an Inf

    const int b = blockIdx.x / p.Hk, kv_head = blockIdx.x % p.Hk, split = blockIdx.y;
    const int group = p.H / p.Hk, head0 = kv_head * group;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row_tile = warp % M_TILES, slice = warp / M_TILES;
    WB_MMA_TRACE(0);  // (a profiling build's stamps: see WB_DECODE_MMA_TRACE)

    // lengths as the split kernel takes them: clamped to the cache and flagged; the last split reads every key past
    // the others'
    const int capacity = p.pages_per_seq * p.page_size;
    const int asked = p.seq_lens[b];
    const int length = min(max(asked, 0), capacity);
    const int start = split * p.keys_per_split;
    const int stop = split == p.num_splits - 1 ? length : min(start + p.keys_per_split, length);
    if (threadIdx.x == 0 && split == p.num_splits - 1 && kv_head == 0) {
        const int flags = (asked != length ? 1 : 0) | (length - start > p.keys_per_split ? 2 : 0);
        if (flags) atomicOr(p.status, flags);
    }

    // --- mma_decode_tile_loads
    // Keys through the strides (and the block table when PAGED), as the split kernel reads them; thread i copies
    // chunk i % CHUNKS of keys i / CHUNKS + j * ROWS_PER_PASS, consecutive threads on consecutive 16 bytes of a key.
    // A table entry outside the pool is clamped to it and flagged (status bit 4).
    const size_t head = (size_t)(unsigned)kv_head * p.strides[1] + (PAGED ? 0 : (size_t)(unsigned)b * p.strides[0]);
    const int chunk = threadIdx.x % CHUNKS, first_row = threadIdx.x / CHUNKS;
    const T* k_head = static_cast<const T*>(p.k_pages) + head + chunk * 8;
    const T* v_head = static_cast<const T*>(p.v_pages) + head + chunk * 8;
    const int* table = p.block_table + (PAGED ? (size_t)b * p.pages_per_seq : 0);
    bool bad_page = false;
    auto load_tile = [&](int stage, int key0) {
        T* k_dst = s_kv + stage * 2 * TILE;
#pragma unroll
        for (int j = 0; j < KEYS / ROWS_PER_PASS; ++j) {
            const int row = first_row + j * ROWS_PER_PASS, key = key0 + row;
            const bool in_bounds = key < stop;
            size_t offset = 0;
            if (in_bounds) {
                offset = (size_t)(unsigned)key * p.strides[2];
                if constexpr (PAGED) {
                    const int entry = table[key / p.page_size];
                    const int page = min(max(entry, 0), p.num_pages - 1);
                    bad_page |= page != entry;
                    offset = (size_t)(unsigned)page * p.strides[0] + (unsigned)(key % p.page_size) * p.strides[2];
                }
            }
            const int dst = decode_swizzled<D>(row, chunk);
            decode_cp_async_16(k_dst + dst, k_head + offset, in_bounds);
            decode_cp_async_16(k_dst + TILE + dst, v_head + offset, in_bounds);
        }
    };
    const int tiles = stop > start ? (stop - start + KEYS - 1) / KEYS : 0;
    // cp.async groups in issue order, one per tile (empty past the last): waiting until at most STAGES - 2 are
    // pending means this tile has landed
#pragma unroll
    for (int t = 0; t < STAGES - 1; ++t) {
        if (t < tiles) load_tile(t, start + t * KEYS);
        decode_cp_async_commit();
    }
    WB_MMA_TRACE(1);
    // q after the first tiles are asked for: its round trip to memory overlaps theirs instead of preceding it
    for (int r = threadIdx.x; r < ROWS; r += THREADS) s_q_bad[r] = 0;
    __syncthreads();
    for (int e = threadIdx.x; e < ROWS * CHUNKS; e += THREADS) {  // q is (B, H, D), contiguous (the host's copy)
        const int r = e / CHUNKS, c = e % CHUNKS;
        uint4 raw = make_uint4(0, 0, 0, 0);
        if (r < group)
            raw = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.q) + ((size_t)b * p.H + head0 + r) * D + c * 8);
        float x[8];
        to_float8<T>(raw, x);
        bool bad = false;
#pragma unroll
        for (int i = 0; i < 8; ++i) bad |= !is_finite(x[i]);
        if (bad) s_q_bad[r] = 1;
        *reinterpret_cast<uint4*>(s_q + decode_swizzled<D>(r, c)) = raw;
    }
    __syncthreads();  // s_q and s_q_bad are written
    WB_MMA_TRACE(2);

    // Q's A fragments, once: matrix i = lane / 8 of an ldmatrix.x4 covers rows (i % 2) * 8 .. +7, chunk 2 ks + i / 2.
    // Every address's row % 8 is lane % 8 (tiles start at multiples of 8), which is the swizzle term.
    const uint32_t q_base = static_cast<uint32_t>(__cvta_generic_to_shared(s_q));
    const uint32_t kv_base = static_cast<uint32_t>(__cvta_generic_to_shared(s_kv));
    const int lane_row = lane % 8;
    auto address = [&](uint32_t base, int row, int c) { return base + (row * D + ((c ^ lane_row) << 3)) * 2; };
    uint32_t q_frag[K_STEPS][4];
#pragma unroll
    for (int ks = 0; ks < K_STEPS; ++ks)
        decode_ldmatrix_x4(q_frag[ks], address(q_base, row_tile * 16 + (lane / 8 % 2) * 8 + lane_row, 2 * ks + lane / 16));
    float o[D_TILES][4];
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};  // rows lane / 4 and lane / 4 + 8
#pragma unroll
    for (int d = 0; d < D_TILES; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
    const int warp_key0 = slice * WARP_KEYS;  // this warp's first key (row) in every tile

    // --- mma_decode_scores
    for (int tile = 0; tile < tiles; ++tile) {
        decode_cp_async_wait<STAGES - 2>();
        __syncthreads();  // this tile has landed for every thread; every warp is done with the stage loaded next
#ifdef WB_DECODE_MMA_TRACE
        if (tile == 0) WB_MMA_TRACE(3);
#endif
        const int next = tile + STAGES - 1;
        if (next < tiles) load_tile(next % STAGES, start + next * KEYS);
        decode_cp_async_commit();
        const uint32_t k_tile = kv_base + (tile % STAGES) * 2 * TILE * 2, v_tile = k_tile + TILE * 2;

        // S = Q K^T for the warp's 16 rows and WARP_KEYS keys; K's B operands: matrix i covers keys
        // 16 np + (i / 2) * 8 .., chunk 2 ks + i % 2
        float s[N_TILES][4];
#pragma unroll
        for (int n = 0; n < N_TILES; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < K_STEPS; ++ks) {
#pragma unroll
            for (int np = 0; np < N_TILES / 2; ++np) {
                uint32_t kb[4];
                decode_ldmatrix_x4(kb, address(k_tile, warp_key0 + 16 * np + (lane / 16) * 8 + lane_row, 2 * ks + lane / 8 % 2));
                DecodeMma<T>::run(s[2 * np], q_frag[ks], kb[0], kb[1]);
                DecodeMma<T>::run(s[2 * np + 1], q_frag[ks], kb[2], kb[3]);
            }
        }

        // --- mma_decode_softmax
        // Scores in log2 units (times scale * log2 e, any sign); keys past the split's end -inf by selection (a NaN
        // there must not leak). Lane l holds rows l / 4 (registers 0, 1) and l / 4 + 8 (2, 3), keys 2 (l % 4) and
        // +1 of each 8-key tile; a row's maximum takes two shuffles within its four lanes. A row that has seen no key
        // keeps m = -inf and subtracts 0 instead (no inf - inf).
        const int key0 = start + tile * KEYS + warp_key0;
        const bool ragged = start + (tile + 1) * KEYS > stop;
#pragma unroll
        for (int n = 0; n < N_TILES; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                s[n][i] *= p.scale_log2;
                if (ragged && key0 + 8 * n + 2 * (lane % 4) + (i & 1) >= stop) s[n][i] = -INFINITY;
            }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float row_max = m_run[h];
#pragma unroll
            for (int n = 0; n < N_TILES; ++n) row_max = fmaxf(row_max, fmaxf(s[n][2 * h], s[n][2 * h + 1]));
            row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 1));
            row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 2));
            const float subtract = row_max == -INFINITY ? 0.f : row_max;
            const float alpha = exp2f(m_run[h] - subtract);  // 0 while the row had seen no key
            float sum = 0.f;
#pragma unroll
            for (int n = 0; n < N_TILES; ++n)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    s[n][2 * h + j] = exp2f(s[n][2 * h + j] - subtract);
                    sum += s[n][2 * h + j];  // fp32 p in the sum; P V uses the rounded p
                }
            l_run[h] = l_run[h] * alpha + sum;  // this lane's part of the row's sum (its keys), added up at the end
            m_run[h] = row_max;
#pragma unroll
            for (int d = 0; d < D_TILES; ++d) o[d][2 * h] *= alpha, o[d][2 * h + 1] *= alpha;
        }

        // --- mma_decode_pv
        // The C fragments of S tiles 2 kk and 2 kk + 1 are the A fragment of P's 16 x 16 tile kk; V's B operands by
        // ldmatrix.trans: matrix i covers keys 16 kk + (i % 2) * 8 .., chunk 2 dp + i / 2
#pragma unroll
        for (int kk = 0; kk < PV_STEPS; ++kk) {
            const uint32_t pa[4] = {DecodeMma<T>::pack(s[2 * kk][0], s[2 * kk][1]),
                                    DecodeMma<T>::pack(s[2 * kk][2], s[2 * kk][3]),
                                    DecodeMma<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                    DecodeMma<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int dp = 0; dp < D_TILES / 2; ++dp) {
                uint32_t vb[4];
                decode_ldmatrix_x4_trans(vb, address(v_tile, warp_key0 + 16 * kk + (lane / 8 % 2) * 8 + lane_row, 2 * dp + lane / 16));
                DecodeMma<T>::run(o[2 * dp], pa, vb[0], vb[1]);
                DecodeMma<T>::run(o[2 * dp + 1], pa, vb[2], vb[3]);
            }
        }
    }
    decode_cp_async_wait<0>();
    WB_MMA_TRACE(4);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // the merge kernel (launched as a programmatic dependent: PTX ISA, "griddepcontrol") may now be scheduled beside
    // this grid's epilogues; it waits for the whole grid and its memory before it reads a partial result
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    // every warp is done with the stages (reused below); one flag for the block's clamped table entries
    if (__syncthreads_or(bad_page) && threadIdx.x == 0) atomicOr(p.status, 4);

    // --- mma_decode_slices_merge
    // Each row's state: m shared by its four lanes, l a part per lane (added with two shuffles), O's columns spread
    // over the lanes: 2 (l % 4) and +1 of each 8-column tile. The slices of a row tile (warps that saw different
    // keys) are merged through shared memory, then the block writes its split's normalised output and LSE as the
    // split kernel does, so the same merge follows.
    __shared__ float s_m[SLICES][ROWS], s_l[SLICES][ROWS];
    float* s_o = reinterpret_cast<float*>(s_dynamic);  // [SLICES][ROWS][O_STRIDE]
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 1);
        l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 2);
        const int row = row_tile * 16 + lane / 4 + 8 * h;
        if (lane % 4 == 0) {
            s_m[slice][row] = m_run[h] == -INFINITY ? kNegBig : m_run[h];  // finite: no inf - inf below
            s_l[slice][row] = l_run[h];
        }
#pragma unroll
        for (int d = 0; d < D_TILES; ++d)
            *reinterpret_cast<float2*>(s_o + (slice * ROWS + row) * O_STRIDE + 8 * d + 2 * (lane % 4)) =
                make_float2(o[d][2 * h], o[d][2 * h + 1]);
    }
    __syncthreads();
    // Per row, once: the slices' weights (each slice's exp2(m - top), over the row's total, so that the columns below
    // need one multiply-add per slice) and the split's LSE. Done per column until 2026-11-27, the weights cost
    // 4 exp2f per output value: 3.6 us of a block's 17 us at MQA B8 Lk8192 (the trace build's stamps, H100).
    __shared__ float s_weight[SLICES][ROWS];
    for (int r = threadIdx.x; r < group; r += THREADS) {
        float top = kNegBig;
#pragma unroll
        for (int w = 0; w < SLICES; ++w) top = fmaxf(top, s_m[w][r]);
        float total = 0.f;
#pragma unroll
        for (int w = 0; w < SLICES; ++w) total += s_l[w][r] * exp2f(s_m[w][r] - top);
        const bool poisoned = is_nan(total) || (s_q_bad[r] && stop > start);  // as in the split kernel
        const bool seen = total > 0.f;
        const float nan = __int_as_float(0x7fc00000);
#pragma unroll
        for (int w = 0; w < SLICES; ++w)  // a poisoned row's weights are NaN, an unseen row's 0 (its outputs then 0)
            s_weight[w][r] = poisoned ? nan : seen ? exp2f(s_m[w][r] - top) / total : 0.f;
        const float row_lse = poisoned ? nan : seen ? (top + log2f(total)) * 0.6931471805599453f : kNegBig;
        const size_t row = ((size_t)split * p.B + b) * p.H + head0 + r;
        if (p.num_splits == 1) p.lse[row] = row_lse == kNegBig ? -INFINITY : row_lse;  // one split: the answer
        else p.part_lse[row] = row_lse;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < group * (D / 4); e += THREADS) {  // 4 columns a thread: 16-byte loads and stores
        const int r = e / (D / 4), c = 4 * (e % (D / 4));
        float4 value = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int w = 0; w < SLICES; ++w) {
            const float weight = s_weight[w][r];
            const float4 x = *reinterpret_cast<const float4*>(s_o + (w * ROWS + r) * O_STRIDE + c);
            value.x += weight * x.x;  // (a row that saw no key: O and the weights are 0)
            value.y += weight * x.y;
            value.z += weight * x.z;
            value.w += weight * x.w;
        }
        const size_t row = ((size_t)split * p.B + b) * p.H + head0 + r;
        if (p.num_splits == 1) {  // the one split's result is the answer, as the merge of one split would write it
            T* out = static_cast<T*>(p.out) + row * D + c;
            out[0] = from_float<T>(value.x), out[1] = from_float<T>(value.y);
            out[2] = from_float<T>(value.z), out[3] = from_float<T>(value.w);
        } else {
            *reinterpret_cast<float4*>(p.part_out + row * D + c) = value;
        }
    }

    WB_MMA_TRACE(5);
    // the fused merge, as the split kernel's (one counter per (sequence, KV head): gridDim.z is 1); none for one split
    if (p.num_splits == 1 || p.counters == nullptr) return;
    __syncthreads();  // also: every thread is done with s_o, which the merge reuses for the splits' weights
    __shared__ bool s_last;
    if (threadIdx.x == 0) s_last = count_finished(p.counters + blockIdx.x) == p.num_splits - 1;
    __syncthreads();
    if (!s_last) return;
    mma_fused_merge<T, D, ROWS, THREADS>(p, b * p.H + head0, group, reinterpret_cast<float*>(s_dynamic));
    WB_MMA_TRACE(6);
}

// --- mma_decode_merge_kernel
// The mma path's second kernel, where its blocks do not merge (more (query head, split) pairs than one block merges
// quickly): one block per query row, merge_splits's arithmetic with the sums spread wider. kMmaMergeLanes threads
// share each 4 columns, each summing every kMmaMergeLanes-th split with 16-byte loads, so a long sequence's 128
// splits cost 16 rounds of loads per thread, not 128 (on the H100, MQA B1 Lk32768: the row-per-thread merge took
// 8 us of a 25 us call). Launched as a programmatic dependent of the mma kernel on sm_90 (the host's launch_mma): it
// is scheduled while the mma kernel's blocks finish, and griddepcontrol.wait holds it until their writes are visible.
constexpr int kMmaMergeLanes = 8;
template <typename T, int D>
__global__ void __launch_bounds__(D / 4 * kMmaMergeLanes) decode_mma_merge_kernel(const float* part_out,
                                                                                 const float* part_lse, T* out,
                                                                                 float* lse, int rows, int num_splits) {
    extern __shared__ float s_weight[];  // [num_splits]
    constexpr int COLUMNS = D / 4;  // float4 columns
    __shared__ float4 s_part[kMmaMergeLanes][COLUMNS];
    __shared__ float s_top, s_total;
    __shared__ int s_poisoned;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    const int row = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int s = threadIdx.x; s < num_splits; s += blockDim.x) s_weight[s] = __ldcg(part_lse + (size_t)s * rows + row);
    __syncthreads();
    if (warp == 0) {  // the largest LSE, and whether any split is NaN (as merge_splits)
        float top = kNegBig;
        bool poisoned = false;
        for (int s = lane; s < num_splits; s += 32) {
            top = fmaxf(top, s_weight[s]);
            poisoned |= is_nan(s_weight[s]);
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, offset));
        poisoned = __any_sync(0xffffffffu, poisoned);
        if (lane == 0) {
            s_top = top;
            s_poisoned = poisoned;
        }
    }
    __syncthreads();
    const float top = s_top;
    for (int s = threadIdx.x; s < num_splits; s += blockDim.x)  // an empty split weighs 0
        s_weight[s] = s_weight[s] <= kNegHalf ? 0.f : __expf(s_weight[s] - top);
    __syncthreads();
    if (warp == 0) {
        float total = 0.f;
        for (int s = lane; s < num_splits; s += 32) total += s_weight[s];
#pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) total += __shfl_xor_sync(0xffffffffu, total, offset);
        if (lane == 0) s_total = total;
    }
    const int column = threadIdx.x % COLUMNS, part = threadIdx.x / COLUMNS;
    float4 value = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
    for (int s = part; s < num_splits; s += kMmaMergeLanes) {  // an empty split's output is 0
        const float weight = s_weight[s];
        const float4 x = __ldcg(reinterpret_cast<const float4*>(part_out + ((size_t)s * rows + row) * D) + column);
        value.x += weight * x.x;
        value.y += weight * x.y;
        value.z += weight * x.z;
        value.w += weight * x.w;
    }
    s_part[part][column] = value;
    __syncthreads();  // also: s_total is written
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        if (s_poisoned) {
            out[(size_t)row * D + d] = from_float<T>(__int_as_float(0x7fc00000));
            if (d == 0) lse[row] = __int_as_float(0x7fc00000);
            continue;
        }
        float sum = 0.f;
#pragma unroll
        for (int q = 0; q < kMmaMergeLanes; ++q) sum += reinterpret_cast<const float*>(&s_part[q][0])[d];
        const float total = s_total;
        out[(size_t)row * D + d] = from_float<T>(total > 0.f ? sum / total : 0.f);
        if (d == 0) lse[row] = total > 0.f ? top + logf(total) : -INFINITY;
    }
}


}  // namespace wb

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

// region: forward_inputs
// Returns [out (B, H, D) in q's dtype, lse (B, H) float32]. The inputs were validated by wb.decode; the checks here
// guard the raw pointers, and each says what to do.
std::vector<torch::Tensor> flash_decode_forward(torch::Tensor q, torch::Tensor k_pages, torch::Tensor v_pages,
                                                std::optional<torch::Tensor> block_table, torch::Tensor seq_lens,
                                                torch::Tensor status, int64_t keys_per_split, int64_t num_splits,
                                                double scale) {
    TORCH_CHECK(q.is_cuda() && k_pages.is_cuda() && v_pages.is_cuda() && status.is_cuda(),
                "flash_decode: q, the cache and the status word must be on the GPU");
    const bool is_half = q.scalar_type() == torch::kHalf;
    TORCH_CHECK(is_half || q.scalar_type() == torch::kBFloat16, "flash_decode: dtype must be float16 or bfloat16");
    TORCH_CHECK(k_pages.scalar_type() == q.scalar_type() && v_pages.scalar_type() == q.scalar_type(),
                "flash_decode: q and the cache must have one dtype");
    TORCH_CHECK(q.dim() == 3 && k_pages.dim() == 4 && v_pages.sizes() == k_pages.sizes(),
                "flash_decode: q (B, H, D), pages (num_pages, Hk, page_size, D)");
    // q is small: made contiguous and 16-byte aligned here (a copy only when it is not); the cache is read in place
    q = q.contiguous();
    if (reinterpret_cast<uintptr_t>(q.data_ptr()) % 16 != 0) q = q.clone();
    wb::check_cache_layout(k_pages, v_pages);
    const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hk = k_pages.size(1);
    seq_lens = seq_lens.to(q.device(), torch::kInt32).contiguous();
    const bool paged = block_table.has_value();
    torch::Tensor table;
    if (paged) table = block_table->to(q.device(), torch::kInt32).contiguous();
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
    wb::DecodeParams params;
    params.q = q.data_ptr();
    params.k_pages = k_pages.data_ptr();
    params.v_pages = v_pages.data_ptr();
    for (int i = 0; i < 3; ++i) params.strides[i] = static_cast<unsigned>(k_pages.stride(i));
    params.block_table = paged ? table.data_ptr<int>() : nullptr;
    params.seq_lens = seq_lens.data_ptr<int>();
    params.part_out = workspace.data_ptr<float>();
    params.part_lse = params.part_out + num_splits * B * H * D;
    params.status = status.data_ptr<int>();
    params.B = static_cast<int>(B);
    params.H = static_cast<int>(H);
    params.Hk = static_cast<int>(Hk);
    params.page_size = static_cast<int>(k_pages.size(2));
    params.pages_per_seq = paged ? static_cast<int>(table.size(1)) : 1;
    params.num_pages = static_cast<int>(k_pages.size(0));
    params.keys_per_split = static_cast<int>(keys_per_split);
    params.num_splits = static_cast<int>(num_splits);
    params.scale_log2 = static_cast<float>(scale * 1.4426950408889634);

    params.out = out.data_ptr();
    params.lse = lse.data_ptr<float>();

    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    // fused merge: the split kernel's s_acc holds the weights of up to kDecodeWarps * D splits per row (one split
    // needs no merge, so no counters to zero)
    params.counters = nullptr;
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
    TORCH_CHECK(q.is_cuda() && k_pages.is_cuda() && v_pages.is_cuda() && status.is_cuda(),
                "flash_decode_mma: q, the cache and the status word must be on the GPU");
    const bool is_half = q.scalar_type() == torch::kHalf;
    TORCH_CHECK(is_half || q.scalar_type() == torch::kBFloat16, "flash_decode_mma: dtype must be float16 or bfloat16");
    TORCH_CHECK(k_pages.scalar_type() == q.scalar_type() && v_pages.scalar_type() == q.scalar_type(),
                "flash_decode_mma: q and the cache must have one dtype");
    TORCH_CHECK(q.dim() == 3 && k_pages.dim() == 4 && v_pages.sizes() == k_pages.sizes(),
                "flash_decode_mma: q (B, H, D), pages (num_pages, Hk, page_size, D)");
    q = q.contiguous();
    if (reinterpret_cast<uintptr_t>(q.data_ptr()) % 16 != 0) q = q.clone();
    wb::check_cache_layout(k_pages, v_pages);
    const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hk = k_pages.size(1);
    seq_lens = seq_lens.to(q.device(), torch::kInt32).contiguous();
    const bool paged = block_table.has_value();
    torch::Tensor table;
    if (paged) table = block_table->to(q.device(), torch::kInt32).contiguous();
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

    wb::DecodeParams params;
    params.q = q.data_ptr();
    params.k_pages = k_pages.data_ptr();
    params.v_pages = v_pages.data_ptr();
    for (int i = 0; i < 3; ++i) params.strides[i] = static_cast<unsigned>(k_pages.stride(i));
    params.block_table = paged ? table.data_ptr<int>() : nullptr;
    params.seq_lens = seq_lens.data_ptr<int>();
    params.part_out = workspace.data_ptr<float>();
    params.part_lse = params.part_out + num_splits * B * H * D;
    params.status = status.data_ptr<int>();
    params.B = static_cast<int>(B);
    params.H = static_cast<int>(H);
    params.Hk = static_cast<int>(Hk);
    params.page_size = static_cast<int>(k_pages.size(2));
    params.pages_per_seq = paged ? static_cast<int>(table.size(1)) : 1;
    params.num_pages = static_cast<int>(k_pages.size(0));
    params.keys_per_split = static_cast<int>(keys_per_split);
    params.num_splits = static_cast<int>(num_splits);
    params.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
    params.out = out.data_ptr();
    params.lse = lse.data_ptr<float>();

    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    // fused merge where the stages' shared memory holds the group's weights for every split (else a second kernel)
    const int64_t weights = wb::mma_smem_bytes(D, group) / 4;
    // ... and where the one block that merges does no more than the split kernel's does (4 rows x 64 splits): the
    // last block of a group reads group x splits x D floats alone, 1 MB for MQA's 32 heads at 64 splits, D = 128, which
    // one block reads far slower than the second kernel's B x H blocks do (on an H100, MQA B1 Lk32768 took 97 us fused)
    constexpr int64_t kMostFusedRowSplits = WB_DECODE_MMA_FUSED_ROW_SPLITS;
    params.counters = nullptr;
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
