// Hand-written matrix-vector products for the decode step (issue 48, first step): y = W x with W row-major (N, K)
// in float16 or bfloat16, float32 accumulation. Device code only (no torch), so that a persistent kernel can include
// it later; gemv_host.cu holds the launches and the torch entry points.
//
// At batch 1 a product reads every byte of W once and does two flops per 2-byte weight: it is bound by how fast HBM
// delivers W, and the copy of W's bytes is its ceiling. What the kernels do for that:
// - 16-byte loads: a lane reads 8 consecutive values of a row (one LDG.E.128), a warp 512 contiguous bytes;
// - several independent loads per lane before the first is used (UNROLL chunks per row, several rows per warp), so
//   that each SM keeps tens of KB of requests outstanding: HBM's latency (about a microsecond under load) times its
//   bandwidth per SM (3 TB/s / 132 SMs) is about 20 KB per SM that must be in flight (work_split.py counts it);
// - W through the read-only path without L1 allocation (it is read once: no line of it is worth keeping), x through
//   L1 (every warp of the block reads all of it);
// - each lane accumulates its own columns in float32 and the warp adds its 32 partial sums with shuffles;
// - split-K (gridDim.y > 1): a matrix with too few rows to keep every SM busy is also cut along K; each block writes
//   its partial sums, and the last block of a row tile to finish adds the splits in the order 0, 1, 2, ... (the same
//   order whoever finishes last: the result does not depend on timing);
// - small batches (B <= 16): one read of a weight chunk serves every row of x (the accumulators are BATCH wide);
// - fusions where bytes are saved: RMSNorm of x in the product that follows it (its scale 1 / rms(x) factors out of
//   the dot product, so the sum of squares is accumulated in the same pass and applied at the end), SiLU(gate) * up
//   for the MLP's fused gate/up matrix (both rows read in one pass, only the product written), the residual add in the
//   output product's epilogue.
// Every lane's order of accumulation is fixed (its chunks in order of k, 8 values each in order), so that the NumPy
// model in work_split.py (emulate) computes the same float32 sums, bit for bit where no approximate function enters.
#pragma once

// from the decode rung: to_float8 and from_float (16-bit values <-> float), count_finished (release/acquire)
#include "../decode/decode_params.cuh"

namespace wb {
namespace gemv {

constexpr int kWarps = 4;  // warps per block: 128 threads; small blocks spread a short matrix over more SMs
constexpr int kChunk = 8;  // values per 16-byte load
constexpr int kWarpStep = 32 * kChunk;  // values of a row that one warp-wide load covers: 256 (512 bytes)
constexpr int kV1Unroll = 8;  // v1: loads in flight per lane (its whole row at K = 2048)

// region: load_weights
// A weight's 16 bytes, through the read-only path and not kept in L1 (each byte is read once). volatile: an asm
// without it is a pure function to the compiler, which sank each load down to its first use, so that a lane issued
// one or two loads and then waited for them (the SASS showed it); volatile statements keep their order, so every
// load of a trip is issued before the first multiply-add that needs one.
__device__ __forceinline__ uint4 load_weights(const void* address) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(address));
    return r;
}
// endregion

// region: warp_sum
// The 32 lanes' partial sums added by a butterfly: after the five steps every lane holds the same total (a + b is
// b + a in floating point, so both lanes of a pair compute the same bits).
__device__ __forceinline__ float warp_sum(float value) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
    return value;
}
// endregion

// region: gemv_v1
// v1: batch 1, a warp per row. Each trip round the loop a lane issues kV1Unroll 16-byte loads of its row (and of x)
// before using the first: 4 KB per warp in flight, the row's bytes contiguous across the warp. Only the last trip
// tests its columns against K: a test before each load would make each a branch, and the compiler would no longer
// issue them together.
template <typename T, bool CHECKED>
__device__ __forceinline__ void v1_trip(const T* w_row, const T* x, int k0, int K, int lane, float& acc) {
    uint4 w_raw[kV1Unroll], x_raw[kV1Unroll];
#pragma unroll
    for (int u = 0; u < kV1Unroll; ++u) {  // every load first: they are independent, so all are in flight at once
        const int k = k0 + u * kWarpStep + lane * kChunk;
        const bool inside = !CHECKED || k < K;
        w_raw[u] = inside ? load_weights(w_row + k) : make_uint4(0, 0, 0, 0);
        x_raw[u] = inside ? *reinterpret_cast<const uint4*>(x + k) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kV1Unroll; ++u) {
        float wf[8], xf[8];
        to_float8<T>(w_raw[u], wf);
        to_float8<T>(x_raw[u], xf);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc = fmaf(wf[e], xf[e], acc);
    }
}

template <typename T>
__global__ void __launch_bounds__(kWarps * 32, 1) gemv_v1_kernel(const T* __restrict__ w, const T* __restrict__ x,
                                                               T* __restrict__ y, int N, int K) {
    const int lane = threadIdx.x % 32;
    const int row = blockIdx.x * kWarps + threadIdx.x / 32;
    if (row >= N) return;  // the whole warp: no shuffle below misses a lane
    const T* w_row = w + static_cast<size_t>(row) * K;
    float acc = 0.0f;
    int k0 = 0;
    for (; k0 + kV1Unroll * kWarpStep <= K; k0 += kV1Unroll * kWarpStep) v1_trip<T, false>(w_row, x, k0, K, lane, acc);
    if (k0 < K) v1_trip<T, true>(w_row, x, k0, K, lane, acc);
    acc = warp_sum(acc);
    if (lane == 0) y[row] = from_float<T>(acc);
}
// endregion

// region: gemv_shapes
// What fuses into a product: before it (the prologue) and after it (the epilogue).
enum Prologue { kPlainInput = 0, kRmsNorm = 1 };  // kRmsNorm: x is RMS-normalized and scaled by a weight first
enum Epilogue { kStore = 0, kResidual = 1, kSiluMul = 2 };  // y; residual + y; SiLU(gate) * up of row pairs

// Per batch width (the template's BATCH: the next power of two >= the call's batch): weight rows per warp and
// 16-byte loads per row and lane in flight. Wider batches keep more accumulators (ROWS x BATCH per lane), so fewer
// loads; more rows per warp reuse each x load (from L1) ROWS times, which the L1's bandwidth needs at B = 8 and 16.
// work_split.py's SHAPES holds the same table (a test compares them).
template <int BATCH> struct GemvShape;
// 1: each warp issues its next trip's loads before this trip's arithmetic (twice the weight registers), at batch
// widths up to 4; a build variant (build.VARIANTS "prefetch"), not the package's default until the H100 says it pays
#ifndef WB_GEMV_PREFETCH
#define WB_GEMV_PREFETCH 0
#endif
// batch 1, the issue's bar: bench.py --variants builds other values of it with -D flags (build.VARIANTS)
#ifndef WB_GEMV_B1_ROWS
#define WB_GEMV_B1_ROWS 2
#endif
#ifndef WB_GEMV_B1_UNROLL
#define WB_GEMV_B1_UNROLL 4
#endif
#ifndef WB_GEMV_B1_MIN_BLOCKS
#define WB_GEMV_B1_MIN_BLOCKS 4
#endif
template <> struct GemvShape<1> {
    static constexpr int ROWS = WB_GEMV_B1_ROWS, UNROLL = WB_GEMV_B1_UNROLL, MIN_BLOCKS = WB_GEMV_B1_MIN_BLOCKS;
};
template <> struct GemvShape<2> { static constexpr int ROWS = 2, UNROLL = 4, MIN_BLOCKS = 4; };
template <> struct GemvShape<4> { static constexpr int ROWS = 4, UNROLL = 2, MIN_BLOCKS = 3; };
template <> struct GemvShape<8> { static constexpr int ROWS = 4, UNROLL = 2, MIN_BLOCKS = 3; };
template <> struct GemvShape<16> { static constexpr int ROWS = 4, UNROLL = 1, MIN_BLOCKS = 2; };

struct GemvParams {
    const void* w;  // (N_w, K) row-major; N_w = N_out, or 2 N_out for kSiluMul (the gate's rows, then the up's)
    const void* x;  // (batch, K) contiguous
    const void* norm_weight;  // (K,) for kRmsNorm, else nullptr
    const void* residual;  // (batch, N_out) for kResidual, else nullptr (may be out itself: updated in place)
    void* out;  // (batch, N_out)
    float* partial;  // split-K: (splits, batch, N_w) float32 partial sums
    float* partial_squares;  // split-K with kRmsNorm: (splits, tiles, batch) partial sums of x^2
    int* counters;  // split-K: (tiles) zeros; the last block of a tile sets its counter back to 0
    int N_out, K, batch, splits, k_per_split;  // k_per_split: a multiple of kWarpStep
    float inv_K, eps;  // RMSNorm: mean = sum * inv_K; eps inside the square root
};
// endregion

// region: gemv_epilogue
// One output value: the row sum (times 1 / rms(x) under kRmsNorm), then the fused epilogue, rounded once to T.
template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T, int EPILOGUE>
__device__ __forceinline__ void store_output(const GemvParams& p, int row, int b, float value, float up) {
    const size_t at = static_cast<size_t>(b) * p.N_out + row;
    if (EPILOGUE == kResidual) value += to_float<T>(static_cast<const T*>(p.residual)[at]);
    if (EPILOGUE == kSiluMul) value = value / (1.0f + __expf(-value)) * up;  // SiLU(gate) * up
    static_cast<T*>(p.out)[at] = from_float<T>(value);
}

__device__ __forceinline__ float rms_scale(float sum_of_squares, const GemvParams& p) {
    return rsqrtf(sum_of_squares * p.inv_K + p.eps);
}
// endregion

// region: split_k_reduction
// Split-K: every block of a row tile has written its partial sums; the last one to finish (a counter per tile, with
// release/acquire ordering: decode_params.cuh's count_finished) adds them in the order 0, 1, ..., splits - 1 and runs
// the epilogue. The partial sums are read with __ldcg (from L2, past this SM's L1, which may hold stale lines).
template <typename T, int PROLOGUE, int EPILOGUE, int ROWS_PER_BLOCK>
__device__ void finish_split_tile(const GemvParams& p, int tile) {
    __shared__ int s_last;
    __syncthreads();  // every warp's partial sums written
    if (threadIdx.x == 0) {
        __threadfence();
        s_last = count_finished(p.counters + tile) == p.splits - 1;
    }
    __syncthreads();
    if (!s_last) return;
    constexpr int HALVES = EPILOGUE == kSiluMul ? 2 : 1;
    const int N_w = p.N_out * HALVES;
    for (int item = threadIdx.x; item < ROWS_PER_BLOCK * p.batch; item += blockDim.x) {
        const int row = tile * ROWS_PER_BLOCK + item % ROWS_PER_BLOCK, b = item / ROWS_PER_BLOCK;
        if (row >= p.N_out) continue;
        float sums[HALVES];
#pragma unroll
        for (int h = 0; h < HALVES; ++h) {
            const float* part = p.partial + static_cast<size_t>(b) * N_w + row + h * p.N_out;
            float total = __ldcg(part);
            for (int s = 1; s < p.splits; ++s) total += __ldcg(part + static_cast<size_t>(s) * p.batch * N_w);
            sums[h] = total;
        }
        float scale = 1.0f;
        if (PROLOGUE == kRmsNorm) {
            const size_t tiles = gridDim.x;
            float squares = __ldcg(p.partial_squares + static_cast<size_t>(tile) * p.batch + b);
            for (int s = 1; s < p.splits; ++s)
                squares += __ldcg(p.partial_squares + (s * tiles + tile) * p.batch + b);
            scale = rms_scale(squares, p);
        }
        store_output<T, EPILOGUE>(p, row, b, sums[0] * scale, HALVES == 2 ? sums[HALVES - 1] * scale : 0.0f);
    }
    if (threadIdx.x == 0) p.counters[tile] = 0;  // ready for the next call on this stream
}
// endregion

// region: gemv_trip
// One trip of a warp over UNROLL x 256 columns of its ROWS weight rows: the weights' ROWS x UNROLL 16-byte loads
// (load_trip), then for each chunk and each row of x, 8 fused multiply-adds per weight row (use_trip). Rows of x past
// the batch read its last row again (their sums are never stored): no test, so no branch between the loads. Only the
// last trip of a split tests its columns (CHECKED).
template <typename T, int ROWS, int UNROLL, bool CHECKED>
__device__ __forceinline__ void load_trip(const T* const (&w_rows)[ROWS], int k0, int k_end, int lane,
                                          uint4 (&w_raw)[ROWS][UNROLL]) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const int k = k0 + u * kWarpStep + lane * kChunk;
        const bool inside = !CHECKED || k < k_end;
#pragma unroll
        for (int i = 0; i < ROWS; ++i) w_raw[i][u] = inside ? load_weights(w_rows[i] + k) : make_uint4(0, 0, 0, 0);
    }
}

template <typename T, int BATCH, int PROLOGUE, int ROWS, int UNROLL, bool CHECKED>
__device__ __forceinline__ void use_trip(const uint4 (&w_raw)[ROWS][UNROLL], const T* x, const T* g, int K, int batch,
                                         int k0, int k_end, int lane, float (&acc)[ROWS][BATCH],
                                         float (&squares)[BATCH]) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const int k = k0 + u * kWarpStep + lane * kChunk;
        const bool inside = !CHECKED || k < k_end;
        float wf[ROWS][8], gf[8];
#pragma unroll
        for (int i = 0; i < ROWS; ++i) to_float8<T>(w_raw[i][u], wf[i]);
        if (PROLOGUE == kRmsNorm)
            to_float8<T>(inside ? *reinterpret_cast<const uint4*>(g + k) : make_uint4(0, 0, 0, 0), gf);
#pragma unroll
        for (int b = 0; b < BATCH; ++b) {
            const T* x_row = x + static_cast<size_t>(min(b, batch - 1)) * K;
            float xf[8];
            to_float8<T>(inside ? *reinterpret_cast<const uint4*>(x_row + k) : make_uint4(0, 0, 0, 0), xf);
            if (PROLOGUE == kRmsNorm) {
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    squares[b] = fmaf(xf[e], xf[e], squares[b]);
                    xf[e] *= gf[e];  // exact in float32: two 16-bit values' product fits its 24 bits
                }
            }
#pragma unroll
            for (int i = 0; i < ROWS; ++i)
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[i][b] = fmaf(wf[i][e], xf[e], acc[i][b]);
        }
    }
}
// endregion

// region: gemv_kernel
// v2 (split-K), v3 (batches) and the fused products: one kernel. Block (tile, split): kWarps warps, each ROWS weight
// rows (under kSiluMul: ROWS / 2 output rows, each a gate row and its up row) over columns [k_begin, k_end).
template <typename T, int BATCH, int PROLOGUE, int EPILOGUE>
__global__ void __launch_bounds__(kWarps * 32, GemvShape<BATCH>::MIN_BLOCKS) gemv_kernel(const GemvParams p) {
    constexpr int HALVES = EPILOGUE == kSiluMul ? 2 : 1;
    constexpr int ROWS = GemvShape<BATCH>::ROWS, UNROLL = GemvShape<BATCH>::UNROLL;
    constexpr int OUT_ROWS = ROWS / HALVES;  // output rows per warp
    constexpr int ROWS_PER_BLOCK = kWarps * OUT_ROWS;
    static_assert(ROWS % HALVES == 0, "a warp holds whole (gate, up) pairs");
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int tile = blockIdx.x, split = blockIdx.y;
    const int row0 = tile * ROWS_PER_BLOCK + warp * OUT_ROWS;
    const int k_begin = split * p.k_per_split, k_end = min(p.K, k_begin + p.k_per_split);

    const T* w_rows[ROWS];  // weight row i: output row row0 + i % OUT_ROWS, half i / OUT_ROWS (gate 0, up 1)
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {  // rows past the end read the last row (loads stay in bounds), never stored
        const int row = min(row0 + i % OUT_ROWS, p.N_out - 1) + (i / OUT_ROWS) * p.N_out;
        w_rows[i] = static_cast<const T*>(p.w) + static_cast<size_t>(row) * p.K;
    }
    const T* x = static_cast<const T*>(p.x);
    float acc[ROWS][BATCH], squares[BATCH];
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
        squares[b] = 0.0f;
#pragma unroll
        for (int i = 0; i < ROWS; ++i) acc[i][b] = 0.0f;
    }

    const T* g = static_cast<const T*>(p.norm_weight);
    constexpr int STEP = UNROLL * kWarpStep;
    uint4 w_raw[ROWS][UNROLL];
    int k0 = k_begin;
    constexpr bool PREFETCH = WB_GEMV_PREFETCH && BATCH <= 4;  // wider batches have no registers to spare
    if (PREFETCH && k0 + STEP <= k_end) {
        // the next trip's loads issued before this trip's multiply-adds: they are used only after the loop turns, so
        // no compiler can sink them behind the arithmetic, and a warp keeps a trip in flight while it computes
        load_trip<T, ROWS, UNROLL, false>(w_rows, k0, k_end, lane, w_raw);
        for (; k0 + 2 * STEP <= k_end; k0 += STEP) {
            uint4 next[ROWS][UNROLL];
            load_trip<T, ROWS, UNROLL, false>(w_rows, k0 + STEP, k_end, lane, next);
            use_trip<T, BATCH, PROLOGUE, ROWS, UNROLL, false>(w_raw, x, g, p.K, p.batch, k0, k_end, lane, acc, squares);
#pragma unroll
            for (int i = 0; i < ROWS; ++i)
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) w_raw[i][u] = next[i][u];
        }
        use_trip<T, BATCH, PROLOGUE, ROWS, UNROLL, false>(w_raw, x, g, p.K, p.batch, k0, k_end, lane, acc, squares);
        k0 += STEP;
    }
    for (; k0 + STEP <= k_end; k0 += STEP) {  // (without prefetch: every whole trip here)
        load_trip<T, ROWS, UNROLL, false>(w_rows, k0, k_end, lane, w_raw);
        use_trip<T, BATCH, PROLOGUE, ROWS, UNROLL, false>(w_raw, x, g, p.K, p.batch, k0, k_end, lane, acc, squares);
    }
    if (k0 < k_end) {
        load_trip<T, ROWS, UNROLL, true>(w_rows, k0, k_end, lane, w_raw);
        use_trip<T, BATCH, PROLOGUE, ROWS, UNROLL, true>(w_raw, x, g, p.K, p.batch, k0, k_end, lane, acc, squares);
    }

#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
        if (PROLOGUE == kRmsNorm) squares[b] = warp_sum(squares[b]);
#pragma unroll
        for (int i = 0; i < ROWS; ++i) acc[i][b] = warp_sum(acc[i][b]);
    }

    if (p.splits == 1) {  // the whole of K: this warp's sums are the answer
#pragma unroll
        for (int b = 0; b < BATCH; ++b) {
            const float scale = PROLOGUE == kRmsNorm ? rms_scale(squares[b], p) : 1.0f;
#pragma unroll
            for (int r = 0; r < OUT_ROWS; ++r)  // the values spread over the lanes, one store each
                if (lane == (r * BATCH + b) % 32 && row0 + r < p.N_out && b < p.batch)
                    store_output<T, EPILOGUE>(p, row0 + r, b, acc[r][b] * scale,
                                              HALVES == 2 ? acc[r + OUT_ROWS][b] * scale : 0.0f);
        }
        return;
    }
    const int N_w = p.N_out * HALVES;
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
#pragma unroll
        for (int i = 0; i < ROWS; ++i) {
            const int row = row0 + i % OUT_ROWS;
            if (lane == (i * BATCH + b) % 32 && row < p.N_out && b < p.batch)
                p.partial[(static_cast<size_t>(split) * p.batch + b) * N_w + row + (i / OUT_ROWS) * p.N_out] = acc[i][b];
        }
        if (PROLOGUE == kRmsNorm && warp == 0 && lane == b % 32 && b < p.batch)  // every warp has the same sums
            p.partial_squares[(static_cast<size_t>(split) * gridDim.x + tile) * p.batch + b] = squares[b];
    }
    finish_split_tile<T, PROLOGUE, EPILOGUE, ROWS_PER_BLOCK>(p, tile);
}
// endregion

}  // namespace gemv
}  // namespace wb
