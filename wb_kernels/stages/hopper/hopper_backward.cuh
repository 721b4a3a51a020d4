// The Hopper rung's backward (issue 47): FlashAttention-3's backward pass by hand, on the forward's primitives
// (hopper_primitives_lab.cuh: mbarrier with the watchdog, TMA with the 128-byte swizzle, wgmma SS/RS, setmaxnreg,
// named barriers; hopper_attention.cuh: the 3-D TMA load, issue_scores / issue_output, pack_pair). Device code
// only; hopper_host.cu includes it and holds the launches. Written from the FlashAttention-2 paper (Dao 2023,
// Algorithm 2: key/value-stationary backward, D = rowsum(dO o O)), the FlashAttention-3 paper (Shah et al. 2024,
// section 3 and Appendix B: warp specialization, dQ accumulated in float32 through global memory, a deterministic
// mode with semaphores) and the PTX ISA (wgmma, cp.async.bulk, ld.acquire / red.release).
// wb_kernels/stages/hopper/backward_model.py is this file's schedule in NumPy (tiles, masks, GQA, dQ's order).
//
// Three kernels, one launch each (hopper_host.cu, hopper_flash_backward):
//   region backward_preprocess   D_i = rowsum(dO o O) in float32, LSE * log2(e) (a row without keys: +inf, so its
//                                P is 0), both padded to whole 64-row query tiles; the float32 dQ accumulator zeroed
//   region backward_main_*       one CTA per (batch, key/value head, 128 keys): K and V stay in shared memory, the
//                                query tiles of every query head of the group stream past them (Q, dO, LSE, D by a
//                                producer thread through a full/empty mbarrier ring); two consumer warpgroups, 64
//                                keys each, accumulate dK and dV in registers and add dQ to global memory
//   region backward_convert_dq   dQ (float32) * scale -> q's dtype
//
// The products of one (query tile, key block) step, per consumer warpgroup c (keys 64 c .. 64 c + 63 of the block,
// queries m0 .. m0 + 63). The consumer holds everything with KEYS as rows, so that its registers are directly the A
// operand of the two key-side products (FlashAttention-3 keeps P and dS in registers for dV and dK the same way):
//   S^T  (64 keys x 64 q)   = K Q^T          SS wgmma, A = K (K-major), B = Q (K-major)           D/16 k-steps
//   dP^T (64 keys x 64 q)   = V dO^T         SS wgmma, A = V (K-major), B = dO (K-major)          D/16 k-steps
//   P^T = exp2(S^T scale log2 e - LSE log2 e)  (masked: 0)    dS^T = P^T o (dP^T - D)    on the accumulators
//   dV (64 keys x D)       += P^T dO         RS wgmma, A = P^T from registers, B = dO (MN-major)   4 k-steps
//   dK (64 keys x D)       += dS^T Q         RS wgmma, A = dS^T from registers, B = Q (MN-major)   4 k-steps
//   dQ (64 q x D/2)        = dS K[:, half c] SS wgmma, A = dS from SHARED memory (M-major: transposed), B = K
//                                            (MN-major), 8 k-steps over the block's 128 keys
// dQ needs dS with QUERIES as rows: the transpose of what the registers hold. The register form of wgmma's A has
// no transpose (PTX: imm-trans-a exists only for A in shared memory), and a transpose through shuffles would cost
// more than a store: each consumer stores its dS^T (16-bit, 64 keys x 64 queries) to shared memory in the 128-byte
// swizzle, and the dQ product reads it as an M-major A (imm-trans-a = 1). Both consumers' halves together are the
// 128 keys dQ sums over; consumer c computes columns c D/2 .. c D/2 + D/2 - 1 of dQ, so the two never add to the
// same element (that is what makes the deterministic mode's order a property of the key blocks alone).
//
// dQ across key blocks (the CTAs of one (batch, head group)): each CTA adds its (64 x D) float32 partial for each
// query tile to a float32 accumulator in global memory, (B, H, Lq padded to 64, D), with atomics (red.global.add
// on float2). The order of those adds is the order in which CTAs get there: float32 addition is not associative, so
// dQ may differ in its last bits from run to run. The deterministic mode (torch.use_deterministic_algorithms) adds a
// semaphore per (batch, head, query tile) in global memory: key block j waits until it reads j (every key block
// before it has added; under the causal mask the key blocks that visit a query tile are always 0 .. j_last, so "j
// blocks before me" is exactly the count), adds, and then releases with red.release.gpu.add 1. The adds then
// happen in key-block order on every run: bit-identical dQ. It relies on CTA j - 1 being resident or finished while
// CTA j waits: the grid numbers key blocks along blockIdx.x, which the hardware dispatches in increasing order (the
// same assumption FlashAttention-3's deterministic mode makes); every such wait is under the watchdog.
//
// Every barrier wait (mbarrier, semaphore) is under the watchdog (-DWB_WATCHDOG_NS): a wrong phase traps.
#pragma once

#include "hopper_attention.cuh"

namespace wb {

// region: backward_params
struct BackwardParams {
    float* dq_accum;          // (B, H, Lq_pad, D) float32, zeroed by the preprocessing kernel; atomics add dQ / scale
    const float* lse_log2;    // (B, H, Lq_pad): LSE * log2(e); +inf for rows past Lq and rows without keys
    const float* dot;         // (B, H, Lq_pad): D_i = rowsum(dO o O); 0 past Lq
    void* dk;                 // (B, Hk, Lk, D), q's dtype
    void* dv;                 // (B, Hk, Lk, D)
    const uint8_t* key_keep;  // (B, Lk), 1 = key takes part; nullptr = no padding mask
    int* semaphore;           // (B, H, Lq_pad / 64) int32 zeros (deterministic mode), else nullptr
    int B, H, Hk, Lq, Lk, Lq_pad, kv_group;  // query head h reads K/V head h / kv_group
    float scale, scale_log2;  // scale > 0 and scale * log2(e)
    int causal, causal_offset;  // query i sees keys j <= i + causal_offset
    int deterministic;        // 1: dQ added in key-block order (semaphores)
};
// endregion

// region: backward_preprocess
// One warp per padded query row (B H Lq_pad rows): D_i, LSE in base 2, and the row of the dQ accumulator zeroed.
constexpr int BWD_PRE_THREADS = 256;
constexpr int BWD_BLOCK_M = 64;    // query rows per tile (the consumers' N of S^T and dP^T)
constexpr float LOG2_E = 1.4426950408889634f;
constexpr int NO_QUERY = 0x7fffffff;          // a key's first query when no query sees it (padded, past Lk)
constexpr int EVERY_QUERY = -0x7fffffff - 1;  // ... when every query does (not causal)

template <typename T>
__global__ void __launch_bounds__(BWD_PRE_THREADS) backward_preprocess_kernel(
        const T* __restrict__ out, const T* __restrict__ dout, const float* __restrict__ lse,
        float* __restrict__ lse_log2, float* __restrict__ dot, float* __restrict__ dq_accum, int64_t padded_rows,
        int Lq, int Lq_pad, int D) {
    const int lane = threadIdx.x % 32;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * (BWD_PRE_THREADS / 32) + threadIdx.x / 32;
    if (row >= padded_rows) return;
    const int64_t bh = row / Lq_pad;
    const int i = static_cast<int>(row % Lq_pad);
    float sum = 0.0f;
    if (i < Lq) {
        const int64_t base = (bh * Lq + i) * D;
        for (int d = 2 * lane; d < D; d += 64) {  // pairs: one 32-bit load of each
            float2 o, g;
            if constexpr (is_half<T>) {
                o = __half22float2(*reinterpret_cast<const __half2*>(out + base + d));
                g = __half22float2(*reinterpret_cast<const __half2*>(dout + base + d));
            } else {
                o = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(out + base + d));
                g = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(dout + base + d));
            }
            sum = fmaf(o.x, g.x, fmaf(o.y, g.y, sum));
        }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    for (int d = 2 * lane; d < D; d += 64) *reinterpret_cast<float2*>(dq_accum + row * D + d) = make_float2(0.0f, 0.0f);
    if (lane == 0) {
        dot[row] = i < Lq ? sum : 0.0f;
        const float l = i < Lq ? lse[bh * Lq + i] : -INFINITY;
        // a row that saw no key has LSE -inf and P = 0 everywhere: +inf makes exp2(s - lse) 0 instead of inf
        lse_log2[row] = l == -INFINITY ? INFINITY : l * LOG2_E;
    }
}
// endregion

// region: backward_convert_dq
// dQ = scale * (the accumulated dS K), rows past Lq dropped, rounded once to q's dtype.
template <typename T>
__global__ void backward_convert_dq_kernel(const float* __restrict__ dq_accum, T* __restrict__ dq, int64_t pairs,
                                           int Lq, int Lq_pad, int D, float scale) {
    for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < pairs;
         p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
        const int64_t element = 2 * p, row = element / D;  // row of (B H Lq)
        const int d = static_cast<int>(element % D);
        const int64_t bh = row / Lq, i = row % Lq;
        const float2 x = *reinterpret_cast<const float2*>(dq_accum + (bh * Lq_pad + i) * D + d);
        *reinterpret_cast<uint32_t*>(dq + element) = pack_pair<T>(x.x * scale, x.y * scale);
    }
}
// endregion

// region: backward_primitives
// cp.async.bulk (not .tensor): a contiguous run of bytes, global -> shared, completing on an mbarrier like a TMA
// box. The LSE and D rows of a query tile are 64 float32 = 256 bytes; the preprocessing kernel pads every row to a
// multiple of 64, so each run is 16-byte aligned as the instruction requires, and needs no tensor map.
__device__ __forceinline__ void bulk_load(void* destination, const void* source, uint32_t bytes, uint64_t* barrier) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(smem_address(destination)), "l"(reinterpret_cast<uint64_t>(source)), "r"(bytes),
                 "r"(smem_address(barrier))
                 : "memory");
}

// Ordinary stores to shared memory (the generic proxy) become visible to wgmma's reads (the async proxy) only after
// this fence (PTX ISA, "Memory consistency model: proxies"); then a barrier makes them the other warpgroup's too.
__device__ __forceinline__ void fence_proxy_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// The deterministic mode's semaphore: an acquire load (the adds of the key blocks that released it are visible
// after it) and a release add (this block's adds are visible before the count moves on).
__device__ __forceinline__ int load_acquire(const int* address) {
    int value;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(value) : "l"(address) : "memory");
    return value;
}
__device__ __forceinline__ void add_release(int* address, int value) {
    asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(address), "r"(value) : "memory");
}

// The watchdog's trap, out of line. The forward's mbarrier_wait traps inline; in this kernel a __trap() anywhere on
// the consumers' path made ptxas allocate their code for the launch's 168 registers instead of setmaxnreg's 240
// (nvcc 13.0: 56 bytes of spills at D = 64; 464 bytes and every wgmma serialized, C7512, at D = 128). A call to a
// function that traps leaves the consumers' allocation alone: no spills, nothing serialized.
__device__ __noinline__ void watchdog_trap() { __trap(); }

// Spin until done() holds; past WB_WATCHDOG_NS the out-of-line trap. The clock is read only after a failed first
// try, as in the forward's mbarrier_wait.
template <typename Done>
__device__ __forceinline__ void wait_watched(Done done) {
    if (done()) return;
#if WB_WATCHDOG_NS > 0
    const uint64_t start = global_nanoseconds();
    while (!done()) {
        if (global_nanoseconds() - start > static_cast<uint64_t>(WB_WATCHDOG_NS)) watchdog_trap();
    }
#else
    while (!done()) {
    }
#endif
}

// Every mbarrier wait of the backward (producer and consumers), and the deterministic mode's semaphore wait
// (until *semaphore == target).
__device__ __forceinline__ void mbarrier_wait_watched(uint64_t* barrier, uint32_t parity) {
    wait_watched([&] { return mbarrier_try_wait(barrier, parity); });
}
__device__ __forceinline__ void semaphore_wait(const int* semaphore, int target) {
    wait_watched([&] { return load_acquire(semaphore) == target; });
}
// endregion

// region: backward_wgmma_transposed_a
// D (64 x N) (+)= A B with A in shared memory M-MAJOR (imm-trans-a = 1: A's 64 rows of M are contiguous, as dS^T
// stored key by key gives dS) and B MN-major (imm-trans-b = 1: K stored key by key). N = 32 or 64: dQ's half of D.
#define WB_ACC16 "{" \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define WB_ACC16_OPERANDS \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define WB_WGMMA_SS_TT(SHAPE, TYPE, ACC, ACC_OPERANDS, I_DESC_A, I_DESC_B, I_ACCUMULATE)                       \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" I_ACCUMULATE ", 0;\n"                                   \
                 "wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE " " ACC ", %" I_DESC_A ", %"     \
                 I_DESC_B ", p, 1, 1, 1, 1;\n}\n"                                                              \
                 : ACC_OPERANDS                                                                               \
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate))

template <typename T, int N>
__device__ __forceinline__ void wgmma_ss_transposed(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b,
                                                    int accumulate) {
    static_assert(N == 32 || N == 64, "dQ's half of D: 32 or 64 columns");
    if constexpr (N == 32 && is_half<T>) WB_WGMMA_SS_TT("m64n32k16", "f16", WB_ACC16, WB_ACC16_OPERANDS, "16", "17", "18");
    if constexpr (N == 32 && !is_half<T>) WB_WGMMA_SS_TT("m64n32k16", "bf16", WB_ACC16, WB_ACC16_OPERANDS, "16", "17", "18");
    if constexpr (N == 64 && is_half<T>) WB_WGMMA_SS_TT("m64n64k16", "f16", WB_ACC32, WB_ACC32_OPERANDS, "32", "33", "34");
    if constexpr (N == 64 && !is_half<T>) WB_WGMMA_SS_TT("m64n64k16", "bf16", WB_ACC32, WB_ACC32_OPERANDS, "32", "33", "34");
}
// endregion

// region: backward_main_layout
// One CTA of 3 warpgroups per (batch, key/value head, block of 128 keys):
//   warpgroup   role                                          registers   waits on                 arrives at
//   0           producer: one thread issues every copy            24       q_empty[s] (parity ^ 1)  kv_full, q_full[s]
//   1, 2        consumer c = 0, 1: keys 64 c .. 64 c + 63         240       kv_full, q_full[s],      q_empty[s] (a thread a warp),
//               of the block: dK, dV in registers                           bar 1 (both dS^T halves)  bar 1, bar 2
// Shared memory, each 16-bit tile in column blocks of 64 (128-byte rows, 128-byte swizzle, as the forward's):
//   K, V          128 keys x D each, loaded once                           D = 64: 16 + 16 KB;  D = 128: 32 + 32 KB
//   Q, dO         STAGES slots of 64 queries x D each                      D = 64: 3 x 16 KB;   D = 128: 2 x 32 KB
//   dS^T          2 buffers of 128 keys x 64 queries (one per tile parity)  32 KB
//   LSE, D        STAGES x 2 x 256 bytes
// Tiles: for each query head h of the group (GQA: dK, dV sum over them in registers, no second pass), for each
// query tile m from the first one the block's causal diagonal reaches: fully masked tiles are never loaded.
constexpr int BWD_BLOCK_N = 128;  // keys per CTA: two consumers of 64
constexpr int BWD_CONSUMERS = 2;
constexpr int BWD_THREADS = (1 + BWD_CONSUMERS) * WARPGROUP;
constexpr int BWD_EMPTY_ARRIVALS = 4 * BWD_CONSUMERS;  // one per consumer warp
constexpr uint32_t BWD_DS_BARRIER = 1;    // named barrier: both halves of dS^T are in shared memory
constexpr uint32_t BWD_ADDED_BARRIER = 2;  // named barrier: every consumer thread has added its dQ (deterministic)
constexpr uint32_t BWD_CONSUMER_THREADS = BWD_CONSUMERS * WARPGROUP;
static_assert(BWD_THREADS == SPLIT_THREADS, "the lab's register split (24 / 240 / 240) is this block's");

template <int HEAD_DIM>
__host__ __device__ constexpr int bwd_stages() {
    return HEAD_DIM == 64 ? 3 : 2;
}
template <int HEAD_DIM>
__host__ __device__ constexpr int bwd_q_tile_bytes() {
    return BWD_BLOCK_M * HEAD_DIM * 2;
}
template <int HEAD_DIM>
__host__ __device__ constexpr int bwd_kv_tile_bytes() {
    return BWD_BLOCK_N * HEAD_DIM * 2;
}
constexpr int BWD_DS_BYTES = BWD_BLOCK_N * BWD_BLOCK_M * 2;  // one dS^T buffer: 128 keys x 64 queries, 16-bit
constexpr int BWD_ROW_BYTES = BWD_BLOCK_M * 4;               // one tile's LSE or D: 64 float32
template <int HEAD_DIM>
constexpr int bwd_smem_bytes() {  // alignment slack, K, V, STAGES x (Q, dO), 2 dS^T, STAGES x (LSE, D)
    return 1024 + 2 * bwd_kv_tile_bytes<HEAD_DIM>() + 2 * bwd_stages<HEAD_DIM>() * bwd_q_tile_bytes<HEAD_DIM>() +
           2 * BWD_DS_BYTES + 2 * bwd_stages<HEAD_DIM>() * BWD_ROW_BYTES;
}
static_assert(bwd_smem_bytes<128>() + 64 <= 227 * 1024, "an H100 block gets at most 227 KB of shared memory");

// The query tiles key block n0 .. n0 + 127 visits, for each head of the group: first_query_tile .. n_tiles - 1.
// Causal: key j is seen by queries i >= j - causal_offset, so the block's first key decides where tiles start; a
// block past every query's diagonal visits none (its dK and dV are zero). The producer and both consumers call it.
__device__ __forceinline__ int first_query_tile(const BackwardParams& params, int n0) {
    if (!params.causal) return 0;
    const int first_query = max(0, n0 - params.causal_offset);
    return min(first_query, params.Lq_pad) / BWD_BLOCK_M;
}
// endregion

// region: backward_main_producer
// One thread of warpgroup 0: K and V once, then per tile Q and dO (TMA boxes of 64 rows) and the tile's LSE and D
// rows (bulk copies), all four on the slot's full barrier.
template <int HEAD_DIM>
__device__ __forceinline__ void produce_backward_tiles(const CUtensorMap* q_map, const CUtensorMap* do_map,
                                                       const CUtensorMap* k_map, const CUtensorMap* v_map,
                                                       const BackwardParams& params, uint8_t* k_tile, uint8_t* v_tile,
                                                       uint8_t* q_tiles, uint8_t* do_tiles, float* lse_rows,
                                                       float* dot_rows, uint64_t* kv_full, uint64_t* q_full,
                                                       uint64_t* q_empty, int b, int kv_head, int n0) {
    constexpr int STAGES = bwd_stages<HEAD_DIM>();
    constexpr int COLUMN_BLOCKS = HEAD_DIM / 64;
    constexpr int KV_BLOCK_BYTES = BWD_BLOCK_N * TILE_ROW_BYTES, Q_BLOCK_BYTES = BWD_BLOCK_M * TILE_ROW_BYTES;
    constexpr int Q_TILE_BYTES = bwd_q_tile_bytes<HEAD_DIM>();
    const int bhk = b * params.Hk + kv_head;
    mbarrier_arrive_expect_tx(kv_full, 2 * bwd_kv_tile_bytes<HEAD_DIM>());
    for (int c = 0; c < COLUMN_BLOCKS; ++c) {
        tma_load_3d(k_tile + c * KV_BLOCK_BYTES, k_map, 64 * c, n0, bhk, kv_full);
        tma_load_3d(v_tile + c * KV_BLOCK_BYTES, v_map, 64 * c, n0, bhk, kv_full);
    }
    const int m_first = first_query_tile(params, n0), m_tiles = params.Lq_pad / BWD_BLOCK_M;
    int stage = 0;
    uint32_t phase = 0;
    for (int g = 0; g < params.kv_group; ++g) {
        const int bh = b * params.H + kv_head * params.kv_group + g;
        for (int m = m_first; m < m_tiles; ++m) {
            mbarrier_wait_watched(&q_empty[stage], phase ^ 1);
            mbarrier_arrive_expect_tx(&q_full[stage], 2 * Q_TILE_BYTES + 2 * BWD_ROW_BYTES);
            for (int c = 0; c < COLUMN_BLOCKS; ++c) {
                tma_load_3d(q_tiles + stage * Q_TILE_BYTES + c * Q_BLOCK_BYTES, q_map, 64 * c, m * BWD_BLOCK_M, bh,
                            &q_full[stage]);
                tma_load_3d(do_tiles + stage * Q_TILE_BYTES + c * Q_BLOCK_BYTES, do_map, 64 * c, m * BWD_BLOCK_M, bh,
                            &q_full[stage]);
            }
            const int64_t row = static_cast<int64_t>(bh) * params.Lq_pad + m * BWD_BLOCK_M;
            bulk_load(lse_rows + stage * BWD_BLOCK_M, params.lse_log2 + row, BWD_ROW_BYTES, &q_full[stage]);
            bulk_load(dot_rows + stage * BWD_BLOCK_M, params.dot + row, BWD_ROW_BYTES, &q_full[stage]);
            if (++stage == STAGES) {
                stage = 0;
                phase ^= 1;
            }
        }
    }
}
// endregion

// region: backward_main_softmax
// P^T and dS^T on S^T's and dP^T's accumulators. Thread (warp w, lane) of consumer c holds keys
// key0 = n0 + 64 c + 16 w + lane / 4 and key0 + 8 (r = 0, 1) and queries m0 + 8 j + 2 (lane % 4) + e:
//   s[4 j + 2 r + e] = S^T[key0 + 8 r][m0 + 8 j + 2 (lane % 4) + e].
// A key's mask is one bound on the query: it is seen by queries >= first_query[r] (its causal diagonal), or by none
// (past Lk, padded out: a bound no query reaches). One compare and select per element, no branch: any branch
// around the wgmma's operands risks ptxas serializing them (the forward's v3/v4 learned it, C7512).
template <typename T>
__device__ __forceinline__ void backward_probabilities(float (&s)[32], float (&dp)[32], const int (&first_query)[2],
                                                       const float* lse_row, const float* dot_row, int m0, int lane,
                                                       float scale_log2) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int column = 8 * j + 2 * (lane % 4);
        const float2 lse = *reinterpret_cast<const float2*>(lse_row + column);
        const float2 dot = *reinterpret_cast<const float2*>(dot_row + column);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int i = 4 * j + 2 * r + e;
                const bool seen = m0 + column + e >= first_query[r];
                const float p = seen ? exp2f(fmaf(s[i], scale_log2, -(e ? lse.y : lse.x))) : 0.0f;
                s[i] = p;                                 // P^T (fp32; rounded to 16 bits when packed)
                dp[i] = p * (dp[i] - (e ? dot.y : dot.x));  // dS^T = P^T o (dP^T - D)
            }
        }
    }
}

// dS^T's 16-bit pairs (packed as the RS operand: ds[t][i] = dS^T[row 8 (i % 2)][column 16 t + 8 (i / 2)]) to this
// consumer's 64 rows of the shared dS^T buffer, in the 128-byte swizzle the dQ product's descriptor expects.
__device__ __forceinline__ void store_transposed_scores(const uint32_t (&ds)[4][4], uint8_t* buffer, int key_row,
                                                        int lane) {
#pragma unroll
    for (int t = 0; t < 4; ++t) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int row = key_row + 8 * (i % 2), column = 16 * t + 8 * (i / 2) + 2 * (lane % 4);
            *reinterpret_cast<uint32_t*>(buffer + swizzled_byte_offset(row, column)) = ds[t][i];
        }
    }
}
// endregion

// region: backward_main_dq
// dQ (64 queries x D / 2, this consumer's columns) = dS K over the block's 128 keys: 8 SS k-steps of 16 keys. A
// (dS, M-major): k-step t starts 16 rows of dS^T further; B (K, MN-major): the same 16 key rows of K, from column
// c D / 2 (for D = 64 that is 64 bytes into the 128-byte row: the swizzle is applied to the address the hardware
// forms, as for a K-major operand's k-steps 32 bytes apart). Issued only.
template <typename T, int HEAD_DIM>
__device__ __forceinline__ void issue_dq(float (&dq)[HEAD_DIM / 4], uint32_t ds_buffer, uint32_t k_tile,
                                         int consumer) {
    constexpr int N = HEAD_DIM / 2, KV_BLOCK_BYTES = BWD_BLOCK_N * TILE_ROW_BYTES;
    const uint32_t k_columns = k_tile + (consumer * N / 64) * KV_BLOCK_BYTES + (consumer * N % 64) * 2;
#pragma unroll
    for (int t = 0; t < BWD_BLOCK_N / 16; ++t) {
        wgmma_ss_transposed<T, N>(dq, smem_descriptor(ds_buffer + t * 16 * TILE_ROW_BYTES, 64 * TILE_ROW_BYTES, 1024),
                                  smem_descriptor(k_columns + t * 16 * TILE_ROW_BYTES, KV_BLOCK_BYTES, 1024), t > 0);
    }
}

// This consumer's dQ partial added to the float32 accumulator: rows m0 + 16 w + lane / 4 (+ 8), columns
// c D / 2 + 8 j + 2 (lane % 4) (+ 1), one float2 atomic per pair (red.global.add.v2.f32 on sm_90).
template <int HEAD_DIM>
__device__ __forceinline__ void add_dq(const float (&dq)[HEAD_DIM / 4], float* dq_rows, int warp, int lane,
                                       int consumer) {
#pragma unroll
    for (int j = 0; j < HEAD_DIM / 16; ++j) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = 16 * warp + lane / 4 + 8 * r, column = consumer * HEAD_DIM / 2 + 8 * j + 2 * (lane % 4);
            atomicAdd(reinterpret_cast<float2*>(dq_rows + row * HEAD_DIM + column),
                      make_float2(dq[4 * j + 2 * r], dq[4 * j + 2 * r + 1]));
        }
    }
}
// endregion

// the dQ product kernel's dynamic shared memory: A^T's tile, B's HEAD_DIM / 64 tiles, and 1 KB to align them
template <int HEAD_DIM>
constexpr int dq_product_smem_bytes() { return (1 + HEAD_DIM / 64) * BWD_BLOCK_N * TILE_ROW_BYTES + 1024; }

// region: backward_dq_product_kernel
// issue_dq alone, before the backward relies on it (the lab's gemm check runs B transposed, never A): one warpgroup,
// C (64 x HEAD_DIM / 2, fp32) = A B[:, consumer HEAD_DIM / 2 ...] with A given as its transpose A^T (128 x 64,
// row-major: what the consumers store as dS^T) and B (128 x HEAD_DIM, row-major: the K tile), both by 2-D TMA boxes
// of 128 rows in the 128-byte swizzle. The GPU check compares C with float64 (gpu_checks "dq_product").
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(WARPGROUP) dq_product_kernel(const __grid_constant__ CUtensorMap a_t_map,
                                                             const __grid_constant__ CUtensorMap b_map, int consumer,
                                                             float* __restrict__ c) {
    constexpr int BLOCK_BYTES = BWD_BLOCK_N * TILE_ROW_BYTES;  // 128 rows x 64 16-bit columns
    // dynamic shared memory (dq_product_smem_bytes, with the launch's opt-in): at D = 128 the tiles are 48 KB, and a
    // block's static shared memory may not exceed 48 KB in all (ptxas for sm_90a accepts more without a word)
    extern __shared__ uint8_t raw_smem[];
    uint8_t* a_t_tile = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw_smem) + 1023) & ~uintptr_t(1023));
    uint8_t* b_tile = a_t_tile + BLOCK_BYTES;
    __shared__ __align__(8) uint64_t loaded;
    if (threadIdx.x == 0) {  // the thread that initialises the barrier may use it at once; the others after the sync
        mbarrier_init(&loaded, 1);
        fence_barrier_init();
        mbarrier_arrive_expect_tx(&loaded, (1 + HEAD_DIM / 64) * BLOCK_BYTES);
        tma_load_2d(a_t_tile, &a_t_map, 0, 0, &loaded);
        for (int block = 0; block < HEAD_DIM / 64; ++block) {
            tma_load_2d(b_tile + block * BLOCK_BYTES, &b_map, 64 * block, 0, &loaded);
        }
    }
    __syncthreads();
    mbarrier_wait_watched(&loaded, 0);
    float d[HEAD_DIM / 4];
    zero_accumulators(d);
    wgmma_fence();
    issue_dq<T, HEAD_DIM>(d, smem_address(a_t_tile), smem_address(b_tile), consumer);
    wgmma_commit_group();
    wgmma_wait_group<0>();
    fence_accumulators(d);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int j = 0; j < HEAD_DIM / 16; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = 16 * warp + lane / 4 + 8 * h, column = 8 * j + 2 * (lane % 4);
            *reinterpret_cast<float2*>(c + row * HEAD_DIM / 2 + column) = make_float2(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
        }
    }
}
// endregion

// region: backward_main_epilogue
// dK (times scale: the products used S = Q K^T unscaled) and dV from registers to global memory, keys past Lk
// dropped.
template <typename T, int HEAD_DIM>
__device__ __forceinline__ void store_key_rows(const float (&dk)[HEAD_DIM / 2], const float (&dv)[HEAD_DIM / 2],
                                               const BackwardParams& params, int bhk, int key0, int lane) {
    T* dk_rows = static_cast<T*>(params.dk) + static_cast<int64_t>(bhk) * params.Lk * HEAD_DIM;
    T* dv_rows = static_cast<T*>(params.dv) + static_cast<int64_t>(bhk) * params.Lk * HEAD_DIM;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = key0 + 8 * r;
        if (key < params.Lk) {
#pragma unroll
            for (int j = 0; j < HEAD_DIM / 8; ++j) {
                const int64_t at = static_cast<int64_t>(key) * HEAD_DIM + 8 * j + 2 * (lane % 4);
                *reinterpret_cast<uint32_t*>(dk_rows + at) =
                    pack_pair<T>(dk[4 * j + 2 * r] * params.scale, dk[4 * j + 2 * r + 1] * params.scale);
                *reinterpret_cast<uint32_t*>(dv_rows + at) = pack_pair<T>(dv[4 * j + 2 * r], dv[4 * j + 2 * r + 1]);
            }
        }
    }
}
// endregion

// region: backward_main_kernel
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(BWD_THREADS, 1) flash_backward_kernel(const __grid_constant__ CUtensorMap q_map,
                                                                      const __grid_constant__ CUtensorMap do_map,
                                                                      const __grid_constant__ CUtensorMap k_map,
                                                                      const __grid_constant__ CUtensorMap v_map,
                                                                      const BackwardParams params) {
    constexpr int STAGES = bwd_stages<HEAD_DIM>();
    constexpr int Q_TILE_BYTES = bwd_q_tile_bytes<HEAD_DIM>(), KV_TILE_BYTES = bwd_kv_tile_bytes<HEAD_DIM>();
    constexpr int KV_BLOCK_BYTES = BWD_BLOCK_N * TILE_ROW_BYTES, Q_BLOCK_BYTES = BWD_BLOCK_M * TILE_ROW_BYTES;
    extern __shared__ uint8_t raw_smem[];
    uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw_smem) + 1023) & ~uintptr_t(1023));
    uint8_t* k_tile = smem;
    uint8_t* v_tile = k_tile + KV_TILE_BYTES;
    uint8_t* q_tiles = v_tile + KV_TILE_BYTES;  // slot s at q_tiles + s * Q_TILE_BYTES
    uint8_t* do_tiles = q_tiles + STAGES * Q_TILE_BYTES;
    uint8_t* ds_buffers = do_tiles + STAGES * Q_TILE_BYTES;  // buffer t % 2 for the CTA's t-th tile
    float* lse_rows = reinterpret_cast<float*>(ds_buffers + 2 * BWD_DS_BYTES);
    float* dot_rows = lse_rows + STAGES * BWD_BLOCK_M;
    __shared__ __align__(8) uint64_t kv_full, q_full[STAGES], q_empty[STAGES];

    const int n_block = blockIdx.x, n0 = n_block * BWD_BLOCK_N;
    const int bhk = blockIdx.y, b = bhk / params.Hk, kv_head = bhk % params.Hk;

    if (threadIdx.x == 0) {
        mbarrier_init(&kv_full, 1);
        for (int s = 0; s < STAGES; ++s) {
            mbarrier_init(&q_full[s], 1);                    // the producer's arrive.expect_tx + the bytes
            mbarrier_init(&q_empty[s], BWD_EMPTY_ARRIVALS);  // every consumer warp
        }
        fence_barrier_init();
    }
    __syncthreads();  // from here on the warpgroups meet only at mbarriers and named barriers 1 and 2

    const int warpgroup = threadIdx.x / WARPGROUP;
    if (warpgroup == 0) {
        setmaxnreg_dec<PRODUCER_REGISTERS>();  // one thread of the four warps issues copies; 24 registers do
        if (threadIdx.x == 0) {
            produce_backward_tiles<HEAD_DIM>(&q_map, &do_map, &k_map, &v_map, params, k_tile, v_tile, q_tiles,
                                             do_tiles, lse_rows, dot_rows, &kv_full, q_full, q_empty, b, kv_head, n0);
        }
        return;
    }
    setmaxnreg_inc<CONSUMER_REGISTERS>();  // dK, dV (64 x D each), S^T, dP^T and dQ's half in registers
    // endregion

    // region: backward_main_consumer
    const int consumer = warpgroup - 1, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int key_row = 64 * consumer + 16 * warp + lane / 4;  // this thread's first key within the block (and + 8)
    const int key0 = n0 + key_row;
    int first_query[2];  // per key row: the first query that sees it, or one no query reaches
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int key = key0 + 8 * r;
        const bool kept = key < params.Lk &&
                          (params.key_keep == nullptr || params.key_keep[static_cast<int64_t>(b) * params.Lk + key] != 0);
        first_query[r] = !kept ? NO_QUERY : params.causal ? key - params.causal_offset : EVERY_QUERY;
    }
    const uint32_t k_rows = smem_address(k_tile) + 64 * consumer * TILE_ROW_BYTES;  // A of S^T: this consumer's keys
    const uint32_t v_rows = smem_address(v_tile) + 64 * consumer * TILE_ROW_BYTES;
    const bool semaphore_thread = consumer == 0 && threadIdx.x % WARPGROUP == 0;

    float dk[HEAD_DIM / 2], dv[HEAD_DIM / 2];
    zero_accumulators(dk);
    zero_accumulators(dv);
    mbarrier_wait_watched(&kv_full, 0);  // always, even without tiles: no copy may be in flight when the block exits
    const int m_first = first_query_tile(params, n0), m_tiles = params.Lq_pad / BWD_BLOCK_M;
    int stage = 0, tile = 0;
    uint32_t phase = 0;
    for (int g = 0; g < params.kv_group; ++g) {
        const int bh = b * params.H + kv_head * params.kv_group + g;
        for (int m = m_first; m < m_tiles; ++m, ++tile) {
            const int m0 = m * BWD_BLOCK_M;
            const uint32_t q_tile = smem_address(q_tiles + stage * Q_TILE_BYTES);
            const uint32_t do_tile = smem_address(do_tiles + stage * Q_TILE_BYTES);
            uint8_t* ds_buffer = ds_buffers + (tile % 2) * BWD_DS_BYTES;
            mbarrier_wait_watched(&q_full[stage], phase);

            // S^T = K Q^T and dP^T = V dO^T, one commit group
            float s[32], dp[32];
            zero_accumulators(s);
            zero_accumulators(dp);
            wgmma_fence();
            issue_scores<T, HEAD_DIM, BWD_BLOCK_M>(s, k_rows, KV_BLOCK_BYTES, q_tile, Q_BLOCK_BYTES);
            issue_scores<T, HEAD_DIM, BWD_BLOCK_M>(dp, v_rows, KV_BLOCK_BYTES, do_tile, Q_BLOCK_BYTES);
            wgmma_commit_group();
            wgmma_wait_group<0>();
            fence_accumulators(s);
            fence_accumulators(dp);

            backward_probabilities<T>(s, dp, first_query, lse_rows + stage * BWD_BLOCK_M,
                                      dot_rows + stage * BWD_BLOCK_M, m0, lane, params.scale_log2);
            uint32_t p[4][4], ds[4][4];
            pack_probabilities<T, BWD_BLOCK_M>(s, p);
            pack_probabilities<T, BWD_BLOCK_M>(dp, ds);
            store_transposed_scores(ds, ds_buffer, key_row, lane);
            fence_proxy_async_shared();

            // dV += P^T dO and dK += dS^T Q: P^T and dS^T straight from registers (RS), dO and Q MN-major
            fence_accumulators(dv);
            fence_accumulators(dk);
            wgmma_fence();
            issue_output<T, HEAD_DIM, BWD_BLOCK_M>(dv, p, do_tile, Q_BLOCK_BYTES);
            issue_output<T, HEAD_DIM, BWD_BLOCK_M>(dk, ds, q_tile, Q_BLOCK_BYTES);
            wgmma_commit_group();

            // dQ = dS K once both halves of dS^T are stored; in the deterministic mode also once every earlier key
            // block has added its part for this (head, query tile): one thread waits, the barrier tells the rest
            int* semaphore = params.deterministic ? params.semaphore + static_cast<int64_t>(bh) * m_tiles + m : nullptr;
            if (semaphore != nullptr && semaphore_thread) semaphore_wait(semaphore, n_block);
            named_barrier_sync(BWD_DS_BARRIER, BWD_CONSUMER_THREADS);
            float dq[HEAD_DIM / 4];
            zero_accumulators(dq);
            wgmma_fence();
            issue_dq<T, HEAD_DIM>(dq, smem_address(ds_buffer), smem_address(k_tile), consumer);
            wgmma_commit_group();
            wgmma_wait_group<0>();
            fence_accumulators(dq);
            fence_accumulators(dv);
            fence_accumulators(dk);
            if (lane == 0) mbarrier_arrive(&q_empty[stage]);  // this warp's wgmma no longer read Q, dO (LSE, D read)

            add_dq<HEAD_DIM>(dq, params.dq_accum + (static_cast<int64_t>(bh) * params.Lq_pad + m0) * HEAD_DIM, warp,
                             lane, consumer);
            if (semaphore != nullptr) {
                __threadfence();
                named_barrier_sync(BWD_ADDED_BARRIER, BWD_CONSUMER_THREADS);
                if (semaphore_thread) add_release(semaphore, 1);
            }
            if (++stage == STAGES) {
                stage = 0;
                phase ^= 1;
            }
        }
    }
    store_key_rows<T, HEAD_DIM>(dk, dv, params, bhk, key0, lane);
}
// endregion

}  // namespace wb
