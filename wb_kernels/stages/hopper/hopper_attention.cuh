// The Hopper rung's attention versions v1-v4 (lesson 09), built on the primitives lab (hopper_primitives_lab.cuh: the
// mbarrier, TMA, wgmma, setmaxnreg and named-barrier wrappers, and the constants of its unit kernels: WARPGROUP,
// TILE_ROW_BYTES, TURN_THREADS). Device code only, so that another kernel can include it; hopper_host.cu includes it
// and holds the launches (FlashParams filled from torch tensors, one tensor map per operand).
//
//   region flash_tile_steps  what every attention version does per key tile: the tile count, the mask decision, S by
//                            SS wgmma, the online softmax, P packed as the RS operand, O += P V, the epilogue
//   region flash_v1_kernel   v1 (the stage at D = 64): one warpgroup per 64 query rows, K/V tiles by TMA in a 2-slot
//                            ring (lab.flash_v1; gpu_checks "attention")
//   region flash_ws_*        v2, v3 and v4 (v4: the stage at D = 128): a producer warpgroup (TMA into a full/empty
//                            ring) and two consumer warpgroups of 64 rows, registers split by setmaxnreg; v3's
//                            consumers take turns on the tensor cores through named barriers, v4 also runs each
//                            tile's softmax under its own P V (lab.flash_v2 / v3 / v4; gpu_checks "v2", "v3", "v4")
#pragma once

#include "hopper_primitives_lab.cuh"

namespace wb {

// region: tma_3d
// The same copy over a rank-3 tensor map (column, row, head): a box never crosses into the next head, and rows past
// the head's length arrive as zeros. v1 views q, k, v (B, H, L, D) as (B H, L, D).
__device__ __forceinline__ void tma_load_3d(void* destination, const CUtensorMap* map, int column, int row, int head,
                                            uint64_t* barrier) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
        ::"r"(smem_address(destination)), "l"(reinterpret_cast<uint64_t>(map)), "r"(column), "r"(row), "r"(head),
        "r"(smem_address(barrier))
        : "memory");
}
// endregion

// region: flash_params
struct FlashParams {
    void* out;                // (B, H, Lq, D), q's dtype
    float* lse;               // (B, H, Lq), natural log
    const uint8_t* key_keep;  // (B, Lk), 1 = key takes part; nullptr = no padding mask
    int B, H, Lq, Lk, kv_group;  // query head h reads K/V head h / kv_group
    float scale_log2;         // scale * log2(e) > 0
    int causal, causal_offset;  // query i sees keys j <= i + causal_offset
};
// endregion

// region: flash_helpers
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

template <typename T>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
    if constexpr (is_half<T>) {
        __half2 pair = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&pair);
    } else {
        __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&pair);
    }
}

// endregion

// region: flash_tile_steps
// The pieces every version runs per key tile, for one warpgroup's 64 query rows. A thread holds two rows, query0 and
// query0 + 8 (query0 = the warpgroup's first row + 16 warp + lane / 4), and in S's accumulators
// s[4 j + 2 r + e] = S[row r][8 j + 2 (lane % 4) + e].

// How many key tiles of BLOCK_N the query rows m0 .. m0 + BLOCK_M - 1 need: all keys, or under the causal mask up to
// the last row's diagonal. In v2, v3 and v4 the producer and both consumers call it with the block's m0: they must agree.
template <int BLOCK_M, int BLOCK_N>
__device__ __forceinline__ int key_tile_count(const FlashParams& params, int m0) {
    int kv_end = params.Lk;
    if (params.causal) kv_end = max(0, min(params.Lk, min(m0 + BLOCK_M, params.Lq) + params.causal_offset));
    return (kv_end + BLOCK_N - 1) / BLOCK_N;
}

// Whether the tile of keys n0 .. n0 + BLOCK_N - 1 needs the mask for rows first_row, first_row + 1, ...: keys past
// Lk (zero-filled by the TMA), key padding, or keys past the first row's causal diagonal.
template <int BLOCK_N>
__device__ __forceinline__ bool tile_needs_mask(const FlashParams& params, const uint8_t* keep, int n0, int first_row) {
    const bool needs_mask = n0 + BLOCK_N > params.Lk || keep != nullptr ||
                            (params.causal && n0 + BLOCK_N - 1 > first_row + params.causal_offset);
    return needs_mask;
}

// endregion

// region: flash_products
// S (64 x BLOCK_N, fp32) = Q K^T by HEAD_DIM / 16 SS wgmma, both operands K-major (issued only: the caller fences,
// commits and waits). q: this warpgroup's 64 rows; k: a tile of BLOCK_N rows; in both, the 64-wide column blocks of
// D lie *_block_bytes apart and k-step `step` starts 32 bytes on within its block.
template <typename T, int HEAD_DIM, int BLOCK_N>
__device__ __forceinline__ void issue_scores(float (&s)[BLOCK_N / 2], uint32_t q, uint32_t q_block_bytes, uint32_t k,
                                             uint32_t k_block_bytes) {
#pragma unroll
    for (int step = 0; step < HEAD_DIM / 16; ++step) {
        wgmma_ss<T, 0, BLOCK_N>(s, smem_descriptor(q + (step / 4) * q_block_bytes + (step % 4) * 32, 16, 1024),
                                smem_descriptor(k + (step / 4) * k_block_bytes + (step % 4) * 32, 16, 1024), step > 0);
    }
}

// O (64 x HEAD_DIM) += P V by BLOCK_N / 16 RS wgmma, V MN-major: k-step t is 16 key rows further (16 x 128 bytes),
// the 64-wide blocks of D lie v_block_bytes apart (the descriptor's LBO). Issued only.
template <typename T, int HEAD_DIM, int BLOCK_N>
__device__ __forceinline__ void issue_output(float (&o)[HEAD_DIM / 2], const uint32_t (&p)[BLOCK_N / 16][4], uint32_t v,
                                             uint32_t v_block_bytes) {
#pragma unroll
    for (int t = 0; t < BLOCK_N / 16; ++t) {
        wgmma_rs<T, 1, HEAD_DIM>(o, p[t], smem_descriptor(v + t * 16 * TILE_ROW_BYTES, v_block_bytes, 1024), 1);
    }
}

// endregion

// region: flash_online_softmax
// The online softmax of one tile in base 2, on S's registers, in three pieces:
//   mask_scores   ragged keys and the causal diagonal as one bound per row (a compare and a select per score, no
//                 branch), key padding by one byte load per key;
//   softmax_rows  the max on the raw scores (the scale is positive: the same order), the scale folded into the
//                 exponent's one FFMA, p = 2^(s * scale_log2 - max) (FlashAttention-3's form); max and sum as two
//                 partial chains per row, half as long; alpha = the factor O must be scaled by; S becomes P (fp32,
//                 not normalised). A row with no key so far subtracts 0: its P is 0, not NaN;
//   online_softmax  both, for a tile that needs a mask or not.
// Round 4's code masked inside the max loop with a per-score `if`: ptxas made it a branch and a convergence barrier
// (BSSY / BSYNC) around every score of every tile. Removing that took v2 from 352 to 529 TFLOP/s (H100, fp16, D=128).
template <int BLOCK_N>
__device__ __forceinline__ void mask_scores(float (&s)[BLOCK_N / 2], const FlashParams& params, const uint8_t* keep,
                                            int n0, int query0, int lane) {
    // s[i] = S[row query0 + 8 r][key n0 + 2 (lane % 4) + column], r = (i / 2) % 2, column = 8 (i / 4) + i % 2 (a
    // constant once unrolled). Ragged keys and the causal diagonal are one bound per row, compared with the
    // column: a compare and a select per score, no branch, nothing else kept live.
    int bound[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        int keys_end = params.Lk;
        if (params.causal) keys_end = min(keys_end, query0 + 8 * r + params.causal_offset + 1);
        bound[r] = keys_end - n0 - 2 * (lane % 4);
    }
#pragma unroll
    for (int i = 0; i < BLOCK_N / 2; ++i) s[i] = 8 * (i / 4) + i % 2 < bound[(i / 2) % 2] ? s[i] : -INFINITY;
    if (keep != nullptr) {  // key padding: the two keys of a column pair are adjacent bytes, read one pair at a time
        const uint8_t* pairs = keep + n0 + 2 * (lane % 4);
#pragma unroll
        for (int j = 0; j < BLOCK_N / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const bool inside = n0 + 8 * j + 2 * (lane % 4) + e < params.Lk;
                const uint8_t kept = inside ? pairs[8 * j + e] : 0;
                s[4 * j + e] = kept != 0 ? s[4 * j + e] : -INFINITY;      // row query0
                s[4 * j + 2 + e] = kept != 0 ? s[4 * j + 2 + e] : -INFINITY;  // row query0 + 8: the same key
            }
        }
    }
}

// endregion

// region: flash_softmax_rows
template <int BLOCK_N>
__device__ __forceinline__ void softmax_rows(float (&s)[BLOCK_N / 2], float (&row_max)[2], float (&row_sum)[2],
                                             float (&alpha)[2], float scale_log2) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float partial[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int j = 0; j < BLOCK_N / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) partial[e] = fmaxf(partial[e], s[4 * j + 2 * r + e]);
        }
        const float new_max = fmaxf(row_max[r], quad_max(fmaxf(partial[0], partial[1])) * scale_log2);
        const float base = new_max == -INFINITY ? 0.0f : new_max;  // a row with no key so far subtracts 0
        alpha[r] = exp2f(row_max[r] - base);  // exp2(-inf) = 0 for the first tile
        row_max[r] = new_max;
        float sum[2] = {0.0f, 0.0f};
#pragma unroll
        for (int j = 0; j < BLOCK_N / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float p = exp2f(fmaf(s[4 * j + 2 * r + e], scale_log2, -base));
                s[4 * j + 2 * r + e] = p;
                sum[e] += p;
            }
        }
        row_sum[r] = row_sum[r] * alpha[r] + (sum[0] + sum[1]);  // each lane its part; the quad adds them at the end
    }
}

// endregion

// region: flash_softmax_mask_branch
// MASK_BRANCH: true skips the masking of tiles that need none behind one (uniform) branch, the cheaper code for v1
// and v2; false masks every tile branch-free (a bound no key reaches leaves the scores as they are), which v3 and
// v4 need: with any branch around the softmax ptxas serialized their wgmma (C7512, "insufficient register
// resources"; the compile report checks it).
template <int BLOCK_N, bool MASK_BRANCH>
__device__ __forceinline__ void online_softmax(float (&s)[BLOCK_N / 2], float (&row_max)[2], float (&row_sum)[2],
                                               float (&alpha)[2], const FlashParams& params, const uint8_t* keep,
                                               int n0, int query0, bool needs_mask, int lane) {
    if constexpr (MASK_BRANCH) {
        if (needs_mask) {
            mask_scores<BLOCK_N>(s, params, keep, n0, query0, lane);
            softmax_rows<BLOCK_N>(s, row_max, row_sum, alpha, params.scale_log2);
        } else {
            softmax_rows<BLOCK_N>(s, row_max, row_sum, alpha, params.scale_log2);
        }
    } else {
        mask_scores<BLOCK_N>(s, params, needs_mask ? keep : nullptr, n0, query0, lane);
        softmax_rows<BLOCK_N>(s, row_max, row_sum, alpha, params.scale_log2);
    }
}

// endregion

// region: flash_softmax_step
template <int HEAD_DIM>
__device__ __forceinline__ void rescale_output(float (&o)[HEAD_DIM / 2], const float (&alpha)[2]) {
#pragma unroll
    for (int j = 0; j < HEAD_DIM / 8; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) o[4 * j + i] *= alpha[i / 2];
    }
}

// P as the RS form's A: k-step t covers keys 16 t .. 16 t + 15, a[i] = s[8 t + 2 i], s[8 t + 2 i + 1] (no data
// moves between threads: wgmma_fragments.py)
template <typename T, int BLOCK_N>
__device__ __forceinline__ void pack_probabilities(const float (&s)[BLOCK_N / 2], uint32_t (&p)[BLOCK_N / 16][4]) {
#pragma unroll
    for (int t = 0; t < BLOCK_N / 16; ++t) {
#pragma unroll
        for (int i = 0; i < 4; ++i) p[t][i] = pack_pair<T>(s[8 * t + 2 * i], s[8 * t + 2 * i + 1]);
    }
}

// Everything between the two products of a tile: the softmax on S's registers (masked where the tile needs it), O
// rescaled, P packed for the RS wgmma.
template <typename T, int HEAD_DIM, int BLOCK_N, bool MASK_BRANCH>
__device__ __forceinline__ void softmax_step(float (&s)[BLOCK_N / 2], uint32_t (&p)[BLOCK_N / 16][4],
                                             float (&o)[HEAD_DIM / 2], float (&row_max)[2], float (&row_sum)[2],
                                             const FlashParams& params, const uint8_t* keep, int n0, int first_row,
                                             int query0, int lane) {
    float alpha[2];
    online_softmax<BLOCK_N, MASK_BRANCH>(s, row_max, row_sum, alpha, params, keep, n0, query0,
                                         tile_needs_mask<BLOCK_N>(params, keep, n0, first_row), lane);
    rescale_output<HEAD_DIM>(o, alpha);
    pack_probabilities<T, BLOCK_N>(s, p);
}

// endregion

// region: flash_store_rows
// The epilogue: O / l for the thread's two rows, rows past Lq dropped; a row with no key gives 0 and LSE -inf.
template <typename T, int HEAD_DIM>
__device__ __forceinline__ void store_rows(const float (&o)[HEAD_DIM / 2], const float (&row_max)[2],
                                           const float (&row_sum)[2], const FlashParams& params, int bh, int query0,
                                           int lane) {
    T* out = static_cast<T*>(params.out) + static_cast<int64_t>(bh) * params.Lq * HEAD_DIM;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int query = query0 + 8 * r;
        const float total = quad_sum(row_sum[r]);
        const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
        if (query < params.Lq) {
#pragma unroll
            for (int j = 0; j < HEAD_DIM / 8; ++j) {
                *reinterpret_cast<uint32_t*>(out + static_cast<int64_t>(query) * HEAD_DIM + 8 * j + 2 * (lane % 4)) =
                    pack_pair<T>(o[4 * j + 2 * r] * inverse, o[4 * j + 2 * r + 1] * inverse);
            }
            if (lane % 4 == 0) {
                params.lse[static_cast<int64_t>(bh) * params.Lq + query] =
                    total > 0.0f ? (row_max[r] + log2f(total)) * 0.6931471805599453f : -INFINITY;
            }
        }
    }
}
// endregion

// region: flash_v1_kernel
constexpr int V1_BLOCK_M = 64;   // query rows per block: one warpgroup, 16 per warp
constexpr int V1_BLOCK_N = 64;   // keys per tile
constexpr int V1_STAGES = 2;     // K/V tiles in flight

template <int HEAD_DIM>
constexpr int v1_smem_bytes() {  // Q, then STAGES x (K, V); each tile HEAD_DIM / 64 swizzled blocks of 64 x 128 bytes
    return 1024 /* alignment slack */ + (1 + 2 * V1_STAGES) * 64 * HEAD_DIM * 2;
}

// v1: one warpgroup per 64 query rows of one (batch, head). Thread 0 loads Q and K/V tiles by TMA into a ring of
// V1_STAGES slots, each with a full barrier; the block's __syncthreads at the end of a tile is the "empty" signal
// (v2 replaces it with empty barriers and a producer warpgroup). Per key tile:
//   S (64 x 64, fp32 registers) = Q K^T       SS wgmma, HEAD_DIM / 16 k-steps, both operands K-major
//   online softmax on S's registers           a row lives in the 4 lanes of a quad: two shuffles
//   P packed to 16 bits in registers          S's accumulator layout is, per warp, the RS form's A layout
//   O (64 x HEAD_DIM) += P V                  RS wgmma, 4 k-steps over the keys, V MN-major (imm-trans-b)
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(WARPGROUP) flash_v1_kernel(const __grid_constant__ CUtensorMap q_map,
                                                           const __grid_constant__ CUtensorMap k_map,
                                                           const __grid_constant__ CUtensorMap v_map,
                                                           const FlashParams params) {
    constexpr int TILE_BYTES = 64 * HEAD_DIM * 2;
    constexpr int COLUMN_BLOCKS = HEAD_DIM / 64;  // 64-wide blocks of D: the 128-byte swizzle's span each
    constexpr int BLOCK_BYTES = 64 * TILE_ROW_BYTES;
    extern __shared__ uint8_t raw_smem[];
    uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw_smem) + 1023) & ~uintptr_t(1023));
    uint8_t* q_tile = smem;
    uint8_t* k_tiles = smem + TILE_BYTES;                       // slot s at k_tiles + s * TILE_BYTES
    uint8_t* v_tiles = smem + (1 + V1_STAGES) * TILE_BYTES;
    __shared__ __align__(8) uint64_t q_full, kv_full[V1_STAGES];

    const int m_block = blockIdx.x, bh = blockIdx.y;
    const int b = bh / params.H, h = bh % params.H;
    const int kv_head = b * (params.H / params.kv_group) + h / params.kv_group;
    const int m0 = m_block * V1_BLOCK_M;
    const int n_tiles = key_tile_count<V1_BLOCK_M, V1_BLOCK_N>(params, m0);

    // endregion

    // region: flash_v1_prologue
    if (threadIdx.x == 0) {
        mbarrier_init(&q_full, 1);
        for (int s = 0; s < V1_STAGES; ++s) mbarrier_init(&kv_full[s], 1);
        fence_barrier_init();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        mbarrier_arrive_expect_tx(&q_full, TILE_BYTES);
        for (int c = 0; c < COLUMN_BLOCKS; ++c) tma_load_3d(q_tile + c * BLOCK_BYTES, &q_map, 64 * c, m0, bh, &q_full);
        if (n_tiles > 0) {
            mbarrier_arrive_expect_tx(&kv_full[0], 2 * TILE_BYTES);
            for (int c = 0; c < COLUMN_BLOCKS; ++c) {
                tma_load_3d(k_tiles + c * BLOCK_BYTES, &k_map, 64 * c, 0, kv_head, &kv_full[0]);
                tma_load_3d(v_tiles + c * BLOCK_BYTES, &v_map, 64 * c, 0, kv_head, &kv_full[0]);
            }
        }
    }

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int query0 = m0 + 16 * warp + lane / 4;  // and + 8: this thread's two rows
    float o[HEAD_DIM / 2];
    zero_accumulators(o);
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
    const uint8_t* keep = params.key_keep ? params.key_keep + static_cast<int64_t>(b) * params.Lk : nullptr;

    // endregion

    // region: flash_v1_tile_loop
    mbarrier_wait(&q_full, 0);
    for (int tile = 0; tile < n_tiles; ++tile) {
        const int slot = tile % V1_STAGES;
        if (threadIdx.x == 0 && tile + 1 < n_tiles) {  // the next tile's slot was released by the last __syncthreads
            const int next = (tile + 1) % V1_STAGES;
            mbarrier_arrive_expect_tx(&kv_full[next], 2 * TILE_BYTES);
            for (int c = 0; c < COLUMN_BLOCKS; ++c) {
                tma_load_3d(k_tiles + next * TILE_BYTES + c * BLOCK_BYTES, &k_map, 64 * c, (tile + 1) * V1_BLOCK_N, kv_head, &kv_full[next]);
                tma_load_3d(v_tiles + next * TILE_BYTES + c * BLOCK_BYTES, &v_map, 64 * c, (tile + 1) * V1_BLOCK_N, kv_head, &kv_full[next]);
            }
        }
        mbarrier_wait(&kv_full[slot], (tile / V1_STAGES) & 1);

        float s[V1_BLOCK_N / 2];
        zero_accumulators(s);
        wgmma_fence();
        issue_scores<T, HEAD_DIM, V1_BLOCK_N>(s, smem_address(q_tile), BLOCK_BYTES,
                                              smem_address(k_tiles + slot * TILE_BYTES), BLOCK_BYTES);
        wgmma_commit_group();
        wgmma_wait_group<0>();
        fence_accumulators(s);

        uint32_t p[V1_BLOCK_N / 16][4];
        softmax_step<T, HEAD_DIM, V1_BLOCK_N, true>(s, p, o, row_max, row_sum, params, keep, tile * V1_BLOCK_N, m0, query0,
                                              lane);

        fence_accumulators(o);
        wgmma_fence();
        issue_output<T, HEAD_DIM, V1_BLOCK_N>(o, p, smem_address(v_tiles + slot * TILE_BYTES), BLOCK_BYTES);
        wgmma_commit_group();
        wgmma_wait_group<0>();
        fence_accumulators(o);
        __syncthreads();  // every warp is done with this slot: thread 0 may refill it
    }
    store_rows<T, HEAD_DIM>(o, row_max, row_sum, params, bh, query0, lane);
}
// endregion

// region: flash_ws_layout
// v2, v3 and v4: warp specialization. A block of 3 warpgroups owns 128 query rows of one (batch, head):
//   warpgroup   role                                     registers   waits on                  arrives at
//   0           producer: one thread issues every TMA       24        kv_empty[s] (parity ^ 1)  q_full, kv_full[s] (expect_tx)
//   1, 2        consumer c = 0, 1: query rows 64 c ..      240        q_full, kv_full[s]        kv_empty[s] (one thread per warp)
//               64 c + 63 of the block                               v3: turn barrier 1 + c     v3: turn barrier 2 - c
// Shared memory (each tile is HEAD_DIM / 64 column blocks of 128 rows x 128 bytes, 128-byte swizzled):
//   Q 128 x HEAD_DIM once, then STAGES slots of K and V tiles (128 keys x HEAD_DIM each):
//   D = 64:  16 KB + 4 x (16 + 16) KB = 144 KB;  D = 128: 32 KB + 3 x (32 + 32) KB = 224 KB (the H100 allows 227 KB
//   per block; 1 KB more is the slack to align the tiles to 1024 bytes). One block per SM either way: 384 threads at
//   168 registers fill the register file.
// The producer's ring (barrier_ring.py models it, line for line): for tile t in 0 .. n_tiles - 1, slot
// s = t % STAGES, phase = (t / STAGES) % 2: wait kv_empty[s] with parity phase ^ 1 (the first lap returns at once),
// arrive.expect_tx(kv_full[s], K + V bytes: whole boxes, rows past Lk are zero-filled and counted), two TMA loads
// per column block. A consumer waits kv_full[s] with parity phase, computes, and each of its 4 warps arrives once on
// kv_empty[s] after its own wgmma.wait_group: kv_empty counts 8 arrivals.
constexpr int WS_BLOCK_M = 128;  // query rows per block: two consumer warpgroups of 64
constexpr int WS_BLOCK_N = 128;  // keys per tile
constexpr int WS_CONSUMERS = 2;
constexpr int WS_THREADS = (1 + WS_CONSUMERS) * WARPGROUP;
constexpr int WS_EMPTY_ARRIVALS = 4 * WS_CONSUMERS;  // one per consumer warp
static_assert(WS_THREADS == SPLIT_THREADS, "the register split of the lab (24 / 240 / 240) is this block's");

template <int HEAD_DIM>
__host__ __device__ constexpr int ws_stages() {
    return HEAD_DIM == 64 ? 4 : 3;
}
template <int HEAD_DIM>
constexpr int ws_smem_bytes() {  // alignment slack, Q, STAGES x (K, V)
    return 1024 + (WS_BLOCK_M + 2 * ws_stages<HEAD_DIM>() * WS_BLOCK_N) * HEAD_DIM * 2;
}
static_assert(ws_smem_bytes<64>() == 1024 + 144 * 1024 && ws_smem_bytes<128>() == 1024 + 224 * 1024,
              "the arithmetic above");
static_assert(ws_smem_bytes<128>() + 64 <= 227 * 1024, "an H100 block gets at most 227 KB of shared memory");
// endregion

// region: flash_ws_producer
// One thread of warpgroup 0: Q (both consumers' 128 rows, one barrier), then the K/V tiles through the ring.
template <int HEAD_DIM>
__device__ __forceinline__ void produce_tiles(const CUtensorMap* q_map, const CUtensorMap* k_map,
                                              const CUtensorMap* v_map, uint8_t* q_tile, uint8_t* k_tiles,
                                              uint8_t* v_tiles, uint64_t* q_full, uint64_t* kv_full,
                                              uint64_t* kv_empty, int m0, int bh, int kv_head, int n_tiles) {
    constexpr int STAGES = ws_stages<HEAD_DIM>();
    constexpr int COLUMN_BLOCKS = HEAD_DIM / 64;
    constexpr int Q_BLOCK_BYTES = WS_BLOCK_M * TILE_ROW_BYTES, KV_BLOCK_BYTES = WS_BLOCK_N * TILE_ROW_BYTES;
    constexpr int KV_TILE_BYTES = COLUMN_BLOCKS * KV_BLOCK_BYTES;
    mbarrier_arrive_expect_tx(q_full, COLUMN_BLOCKS * Q_BLOCK_BYTES);
    for (int c = 0; c < COLUMN_BLOCKS; ++c) tma_load_3d(q_tile + c * Q_BLOCK_BYTES, q_map, 64 * c, m0, bh, q_full);
    int stage = 0;
    uint32_t phase = 0;
    for (int tile = 0; tile < n_tiles; ++tile) {
        mbarrier_wait(&kv_empty[stage], phase ^ 1);
        mbarrier_arrive_expect_tx(&kv_full[stage], 2 * KV_TILE_BYTES);
        for (int c = 0; c < COLUMN_BLOCKS; ++c) {
            tma_load_3d(k_tiles + stage * KV_TILE_BYTES + c * KV_BLOCK_BYTES, k_map, 64 * c, tile * WS_BLOCK_N, kv_head,
                        &kv_full[stage]);
            tma_load_3d(v_tiles + stage * KV_TILE_BYTES + c * KV_BLOCK_BYTES, v_map, 64 * c, tile * WS_BLOCK_N, kv_head,
                        &kv_full[stage]);
        }
        if (++stage == STAGES) {
            stage = 0;
            phase ^= 1;
        }
    }
}
// endregion

// region: flash_v2_consumer
// What a consumer warpgroup needs to know about its block and its rows.
struct ConsumerRows {
    int m0;        // the block's first query row
    int first_row;  // this warpgroup's first row: m0 + 64 c
    int query0;    // this thread's first row (and + 8)
    int bh, n_tiles, lane;
    const uint8_t* keep;  // the batch's key_keep row, or nullptr
};

// v2's consumer loop: v1's tile step on the ring. Each tile: wait for the slot, S = Q K^T, the softmax, O += P V,
// wait for both products, and release the slot (one arrival per warp).
template <typename T, int HEAD_DIM>
__device__ __forceinline__ void consume_tiles_v2(const ConsumerRows& rows, const FlashParams& params, uint32_t q_rows,
                                                 const uint8_t* k_tiles, const uint8_t* v_tiles, uint64_t* kv_full,
                                                 uint64_t* kv_empty, float (&o)[HEAD_DIM / 2], float (&row_max)[2],
                                                 float (&row_sum)[2]) {
    constexpr int STAGES = ws_stages<HEAD_DIM>();
    constexpr int KV_BLOCK_BYTES = WS_BLOCK_N * TILE_ROW_BYTES, KV_TILE_BYTES = HEAD_DIM / 64 * KV_BLOCK_BYTES;
    int stage = 0;
    uint32_t phase = 0;
    for (int tile = 0; tile < rows.n_tiles; ++tile) {
        mbarrier_wait(&kv_full[stage], phase);
        float s[WS_BLOCK_N / 2];
        zero_accumulators(s);
        wgmma_fence();
        issue_scores<T, HEAD_DIM, WS_BLOCK_N>(s, q_rows, WS_BLOCK_M * TILE_ROW_BYTES,
                                              smem_address(k_tiles + stage * KV_TILE_BYTES), KV_BLOCK_BYTES);
        wgmma_commit_group();
        wgmma_wait_group<0>();
        fence_accumulators(s);

        uint32_t p[WS_BLOCK_N / 16][4];
        softmax_step<T, HEAD_DIM, WS_BLOCK_N, true>(s, p, o, row_max, row_sum, params, rows.keep, tile * WS_BLOCK_N,
                                              rows.first_row, rows.query0, rows.lane);

        fence_accumulators(o);
        wgmma_fence();
        issue_output<T, HEAD_DIM, WS_BLOCK_N>(o, p, smem_address(v_tiles + stage * KV_TILE_BYTES), KV_BLOCK_BYTES);
        wgmma_commit_group();
        wgmma_wait_group<0>();
        fence_accumulators(o);
        if (rows.lane == 0) mbarrier_arrive(&kv_empty[stage]);  // this warp's wgmma no longer read the slot
        if (++stage == STAGES) {
            stage = 0;
            phase ^= 1;
        }
    }
}
// endregion

// region: flash_v3_consumer
// v3's consumer loop: ping-pong (FlashAttention-3, section 3.1). The two consumers take turns on the tensor cores
// through two named barriers of 256 threads: consumer c waits on barrier 1 + c before it issues wgmma and arrives
// at the other's barrier 2 - c right after committing them, so one consumer's softmax runs while the other's GEMMs
// do. For the GEMMs of a turn to sit together, a turn issues O += P V of the previous tile and S = Q K^T of this
// one; the last turn only P V. So consumer c has n_tiles + 1 turns; consumer 0 takes its first without waiting and
// consumer 1 does not arrive after its last: every generation of a barrier has one arrival from each consumer, and
// no generation is left open. A slot is released after the turn that read its V: a consumer holds two slots at once
// (K of this tile, V of the last), so v3 needs STAGES >= 2 (barrier_ring.py: one stage deadlocks).
constexpr uint32_t TURN_THREADS_V3 = 2 * WARPGROUP;

template <typename T, int HEAD_DIM>
__device__ __forceinline__ void consume_tiles_v3(const ConsumerRows& rows, int consumer, const FlashParams& params,
                                                 uint32_t q_rows, const uint8_t* k_tiles, const uint8_t* v_tiles,
                                                 uint64_t* kv_full, uint64_t* kv_empty, float (&o)[HEAD_DIM / 2],
                                                 float (&row_max)[2], float (&row_sum)[2]) {
    constexpr int STAGES = ws_stages<HEAD_DIM>();
    static_assert(STAGES >= 2, "a v3 consumer holds two slots at once");
    constexpr int KV_BLOCK_BYTES = WS_BLOCK_N * TILE_ROW_BYTES, KV_TILE_BYTES = HEAD_DIM / 64 * KV_BLOCK_BYTES;
    const uint32_t my_turn = FIRST_TURN_BARRIER + consumer, other_turn = FIRST_TURN_BARRIER + 1 - consumer;
    if (rows.n_tiles == 0) return;
    // The first turn: S of tile 0 only. (A wgmma under `if (tile > 0)` inside the loop made ptxas serialize every
    // wgmma, C7519: so the first and the last turn stand outside the loop.)
    int stage = 0;
    uint32_t phase = 0;
    mbarrier_wait(&kv_full[stage], phase);
    if (consumer == 1) named_barrier_sync(my_turn, TURN_THREADS_V3);
    float s[WS_BLOCK_N / 2];
    zero_accumulators(s);
    wgmma_fence();
    issue_scores<T, HEAD_DIM, WS_BLOCK_N>(s, q_rows, WS_BLOCK_M * TILE_ROW_BYTES,
                                          smem_address(k_tiles + stage * KV_TILE_BYTES), KV_BLOCK_BYTES);
    wgmma_commit_group();
    named_barrier_arrive(other_turn, TURN_THREADS_V3);  // the other consumer's turn: its wgmma queue behind these
    wgmma_wait_group<0>();
    fence_accumulators(s);
    uint32_t p[WS_BLOCK_N / 16][4];  // the last softmax's P, multiplied by V in the next turn
    softmax_step<T, HEAD_DIM, WS_BLOCK_N, false>(s, p, o, row_max, row_sum, params, rows.keep, 0, rows.first_row, rows.query0,
                                          rows.lane);
    int held = stage;  // the slot whose V the next turn reads
    if (++stage == STAGES) {
        stage = 0;
        phase ^= 1;
    }
    // endregion

    // region: flash_v3_turn
    for (int tile = 1; tile < rows.n_tiles; ++tile) {  // a turn: P V of the previous tile, S of this one
        mbarrier_wait(&kv_full[stage], phase);
        named_barrier_sync(my_turn, TURN_THREADS_V3);
        zero_accumulators(s);
        fence_accumulators(o);
        wgmma_fence();
        issue_output<T, HEAD_DIM, WS_BLOCK_N>(o, p, smem_address(v_tiles + held * KV_TILE_BYTES), KV_BLOCK_BYTES);
        issue_scores<T, HEAD_DIM, WS_BLOCK_N>(s, q_rows, WS_BLOCK_M * TILE_ROW_BYTES,
                                              smem_address(k_tiles + stage * KV_TILE_BYTES), KV_BLOCK_BYTES);
        wgmma_commit_group();
        named_barrier_arrive(other_turn, TURN_THREADS_V3);
        wgmma_wait_group<0>();
        fence_accumulators(s);
        fence_accumulators(o);
        if (rows.lane == 0) mbarrier_arrive(&kv_empty[held]);  // this warp has read the previous tile's V
        softmax_step<T, HEAD_DIM, WS_BLOCK_N, false>(s, p, o, row_max, row_sum, params, rows.keep, tile * WS_BLOCK_N,
                                              rows.first_row, rows.query0, rows.lane);
        held = stage;
        if (++stage == STAGES) {
            stage = 0;
            phase ^= 1;
        }
    }
    // the last turn: the last tile's P V; consumer 1 arrives nowhere after it (consumer 0 has no turn left)
    named_barrier_sync(my_turn, TURN_THREADS_V3);
    fence_accumulators(o);
    wgmma_fence();
    issue_output<T, HEAD_DIM, WS_BLOCK_N>(o, p, smem_address(v_tiles + held * KV_TILE_BYTES), KV_BLOCK_BYTES);
    wgmma_commit_group();
    if (consumer == 0) named_barrier_arrive(other_turn, TURN_THREADS_V3);
    wgmma_wait_group<0>();
    fence_accumulators(o);
    if (rows.lane == 0) mbarrier_arrive(&kv_empty[held]);
}
// endregion

// region: flash_v4_consumer
// v4's consumer loop: v3's turns, and inside each turn the softmax of this tile under the P V of the last
// (FlashAttention-3, section 3.2, Algorithm 2). A turn issues S = Q K^T of this tile and O += P V of the previous
// one as two commit groups, S first; wgmma.wait_group 1 returns once S is done, the softmax runs on S's registers
// while P V still runs on the tensor cores, and wait_group 0 comes only before O is rescaled and the new P packed
// (P V reads P's registers and writes O's until then). Registers: S (fp32), P of the last tile (16-bit, packed) and
// O, as in v3. The first turn (S of tile 0) and the last (P V of the last tile) are v3's, outside the loop.
template <typename T, int HEAD_DIM>
__device__ __forceinline__ void consume_tiles_v4(const ConsumerRows& rows, int consumer, const FlashParams& params,
                                                 uint32_t q_rows, const uint8_t* k_tiles, const uint8_t* v_tiles,
                                                 uint64_t* kv_full, uint64_t* kv_empty, float (&o)[HEAD_DIM / 2],
                                                 float (&row_max)[2], float (&row_sum)[2]) {
    constexpr int STAGES = ws_stages<HEAD_DIM>();
    static_assert(STAGES >= 2, "a v4 consumer holds two slots at once");
    constexpr int KV_BLOCK_BYTES = WS_BLOCK_N * TILE_ROW_BYTES, KV_TILE_BYTES = HEAD_DIM / 64 * KV_BLOCK_BYTES;
    const uint32_t my_turn = FIRST_TURN_BARRIER + consumer, other_turn = FIRST_TURN_BARRIER + 1 - consumer;
    if (rows.n_tiles == 0) return;
    int stage = 0;
    uint32_t phase = 0;
    mbarrier_wait(&kv_full[stage], phase);
    if (consumer == 1) named_barrier_sync(my_turn, TURN_THREADS_V3);
    float s[WS_BLOCK_N / 2];
    zero_accumulators(s);
    wgmma_fence();
    issue_scores<T, HEAD_DIM, WS_BLOCK_N>(s, q_rows, WS_BLOCK_M * TILE_ROW_BYTES,
                                          smem_address(k_tiles + stage * KV_TILE_BYTES), KV_BLOCK_BYTES);
    wgmma_commit_group();
    named_barrier_arrive(other_turn, TURN_THREADS_V3);
    wgmma_wait_group<0>();
    fence_accumulators(s);
    uint32_t p[WS_BLOCK_N / 16][4];
    softmax_step<T, HEAD_DIM, WS_BLOCK_N, false>(s, p, o, row_max, row_sum, params, rows.keep, 0, rows.first_row, rows.query0,
                                          rows.lane);
    int held = stage;
    if (++stage == STAGES) {
        stage = 0;
        phase ^= 1;
    }
    // endregion

    // region: flash_v4_turn
    for (int tile = 1; tile < rows.n_tiles; ++tile) {
        mbarrier_wait(&kv_full[stage], phase);
        named_barrier_sync(my_turn, TURN_THREADS_V3);
        zero_accumulators(s);
        wgmma_fence();
        issue_scores<T, HEAD_DIM, WS_BLOCK_N>(s, q_rows, WS_BLOCK_M * TILE_ROW_BYTES,
                                              smem_address(k_tiles + stage * KV_TILE_BYTES), KV_BLOCK_BYTES);
        wgmma_commit_group();  // group 1: S of this tile
        fence_accumulators(o);
        issue_output<T, HEAD_DIM, WS_BLOCK_N>(o, p, smem_address(v_tiles + held * KV_TILE_BYTES), KV_BLOCK_BYTES);
        wgmma_commit_group();  // group 2: P V of the previous tile
        named_barrier_arrive(other_turn, TURN_THREADS_V3);
        wgmma_wait_group<1>();  // S is done; P V may still run
        fence_accumulators(s);
        float alpha[2];
        online_softmax<WS_BLOCK_N, false>(s, row_max, row_sum, alpha, params, rows.keep, tile * WS_BLOCK_N, rows.query0,
                                   tile_needs_mask<WS_BLOCK_N>(params, rows.keep, tile * WS_BLOCK_N, rows.first_row),
                                   rows.lane);
        fence_accumulators(s);  // the softmax's results before the wait: else the compiler sinks half of it below
        fence_accumulators(row_sum);
        fence_accumulators(alpha);
        wgmma_wait_group<0>();  // P V is done: O and P are this warpgroup's again, the previous tile's V is read
        fence_accumulators(o);
        if (rows.lane == 0) mbarrier_arrive(&kv_empty[held]);
        rescale_output<HEAD_DIM>(o, alpha);
        pack_probabilities<T, WS_BLOCK_N>(s, p);
        held = stage;
        if (++stage == STAGES) {
            stage = 0;
            phase ^= 1;
        }
    }
    named_barrier_sync(my_turn, TURN_THREADS_V3);  // the last turn, as v3's
    fence_accumulators(o);
    wgmma_fence();
    issue_output<T, HEAD_DIM, WS_BLOCK_N>(o, p, smem_address(v_tiles + held * KV_TILE_BYTES), KV_BLOCK_BYTES);
    wgmma_commit_group();
    if (consumer == 0) named_barrier_arrive(other_turn, TURN_THREADS_V3);
    wgmma_wait_group<0>();
    fence_accumulators(o);
    if (rows.lane == 0) mbarrier_arrive(&kv_empty[held]);
}
// endregion

// region: flash_ws_kernel
// v2 (VERSION 2), v3 (3) and v4 (4): the block's setup, the role split with setmaxnreg, the producer, and the
// consumers' loop of their version; the epilogue stores from registers as v1 does.
template <typename T, int HEAD_DIM, int VERSION>
__global__ void __launch_bounds__(WS_THREADS, 1) flash_ws_kernel(const __grid_constant__ CUtensorMap q_map,
                                                               const __grid_constant__ CUtensorMap k_map,
                                                               const __grid_constant__ CUtensorMap v_map,
                                                               const FlashParams params) {
    constexpr int STAGES = ws_stages<HEAD_DIM>();
    constexpr int Q_TILE_BYTES = WS_BLOCK_M * HEAD_DIM * 2, KV_TILE_BYTES = WS_BLOCK_N * HEAD_DIM * 2;
    extern __shared__ uint8_t raw_smem[];
    uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw_smem) + 1023) & ~uintptr_t(1023));
    uint8_t* q_tile = smem;
    uint8_t* k_tiles = smem + Q_TILE_BYTES;  // slot s at k_tiles + s * KV_TILE_BYTES
    uint8_t* v_tiles = k_tiles + STAGES * KV_TILE_BYTES;
    __shared__ __align__(8) uint64_t q_full, kv_full[STAGES], kv_empty[STAGES];

    const int bh = blockIdx.y, b = bh / params.H, h = bh % params.H;
    const int kv_head = b * (params.H / params.kv_group) + h / params.kv_group;
    const int m0 = blockIdx.x * WS_BLOCK_M;
    const int n_tiles = key_tile_count<WS_BLOCK_M, WS_BLOCK_N>(params, m0);  // the producer's and the consumers'

    if (threadIdx.x == 0) {
        mbarrier_init(&q_full, 1);
        for (int s = 0; s < STAGES; ++s) {
            mbarrier_init(&kv_full[s], 1);                   // the producer's arrive.expect_tx + the bytes
            mbarrier_init(&kv_empty[s], WS_EMPTY_ARRIVALS);  // every consumer warp
        }
        fence_barrier_init();
    }
    __syncthreads();  // the last block-wide barrier: from here on the warpgroups meet only at mbarriers

    // endregion

    // region: flash_ws_roles
    const int warpgroup = threadIdx.x / WARPGROUP;
    if (warpgroup == 0) {
        setmaxnreg_dec<PRODUCER_REGISTERS>();  // all four warps; three of them then have nothing to do
        if (threadIdx.x == 0) {
            produce_tiles<HEAD_DIM>(&q_map, &k_map, &v_map, q_tile, k_tiles, v_tiles, &q_full, kv_full, kv_empty, m0,
                                    bh, kv_head, n_tiles);
        }
        return;
    }
    setmaxnreg_inc<CONSUMER_REGISTERS>();
    const int consumer = warpgroup - 1, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    ConsumerRows rows;
    rows.m0 = m0;
    rows.first_row = m0 + 64 * consumer;
    rows.query0 = rows.first_row + 16 * warp + lane / 4;
    rows.bh = bh;
    rows.n_tiles = n_tiles;
    rows.lane = lane;
    rows.keep = params.key_keep ? params.key_keep + static_cast<int64_t>(b) * params.Lk : nullptr;
    // this consumer's 64 rows of Q: 64 x 128 bytes into each column block (a multiple of the swizzle's 1024)
    const uint32_t q_rows = smem_address(q_tile) + consumer * 64 * TILE_ROW_BYTES;

    float o[HEAD_DIM / 2];
    zero_accumulators(o);
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
    mbarrier_wait(&q_full, 0);  // always, even without tiles: no copy may be in flight when the block exits
    static_assert(VERSION >= 2 && VERSION <= 4, "flash_ws_kernel runs v2, v3 and v4");
    if constexpr (VERSION == 4) {
        consume_tiles_v4<T, HEAD_DIM>(rows, consumer, params, q_rows, k_tiles, v_tiles, kv_full, kv_empty, o, row_max,
                                      row_sum);
    } else if constexpr (VERSION == 3) {
        consume_tiles_v3<T, HEAD_DIM>(rows, consumer, params, q_rows, k_tiles, v_tiles, kv_full, kv_empty, o, row_max,
                                      row_sum);
    } else {
        consume_tiles_v2<T, HEAD_DIM>(rows, params, q_rows, k_tiles, v_tiles, kv_full, kv_empty, o, row_max, row_sum);
    }
    store_rows<T, HEAD_DIM>(o, row_max, row_sum, params, bh, rows.query0, lane);
}
// endregion

}  // namespace wb
