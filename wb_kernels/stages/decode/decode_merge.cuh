// Split-KV decoding (lesson 07): merging a sequence's splits through their log-sum-exps. merge_splits (the split
// kernel's fused merge, and its second kernel decode_merge_kernel), and the tensor-core kernel's own two:
// mma_fused_merge and decode_mma_merge_kernel.
// Device code only (no torch), so that another kernel can include it; decode_host.cu includes it and holds the
// launches. Lesson 07 shows its regions (// region: NAME) with the file named in each cell.
#pragma once

#include "decode_params.cuh"

#ifndef WB_DECODE_MERGE_VECTOR
#define WB_DECODE_MERGE_VECTOR 1  // 1: the merge sums 4 columns a thread with 16-byte loads, several lanes per column
#endif
#ifndef WB_DECODE_MERGE_UNROLL
#define WB_DECODE_MERGE_UNROLL 8  // the merge's 16-byte loads in flight per thread (16: no faster on the H100)
#endif

namespace wb {

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
        float top = -INFINITY;
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
        s_weight[e] = s_weight[e] == -INFINITY ? 0.f : __expf(s_weight[e] - s_top[e / num_splits]);
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
        float top = -INFINITY;
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
            weight[s] = weight[s] == -INFINITY ? 0.f : __expf(weight[s] - top);
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
        float top = -INFINITY;
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
        s_weight[s] = s_weight[s] == -INFINITY ? 0.f : __expf(s_weight[s] - top);
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
