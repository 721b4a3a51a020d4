// The backward pass of attention on tensor cores: PTX mma.sync, ldmatrix, swizzled shared memory (lesson 08_backward).
//
// The one CUDA source of the mma stage's gradients. Used by:
//   - wb_kernels/stages/backward/build.py: torch load_inline builds it on a GPU machine; without a GPU it is
//     compiled with nvcc (-DWB_KERNEL_ONLY) to report registers, shared memory and spills. build.py puts the
//     forward's tensor-core, ldmatrix, swizzle and cp.async helpers where the "wb:shared-regions" line stands
//     (regions of wb_kernels/stages/mma/flash_mma.cu: one source of truth for them);
//   - wb_kernels/stages/backward/launcher.py: mma_gradients(), the Backward of the "mma" stage.
//
// With S = scale Q K^T (masked), P = softmax(S) = exp(S - LSE) (LSE: the forward's, natural log), O = P V:
//     dV = P^T dO     dP = dO V^T     Delta_i = sum_d dO_id O_id     dS = P * (dP - Delta)
//     dQ = scale dS K                 dK = scale dS^T Q
// Version 1 (deterministic, no atomics) runs three kernels:
//   1. preprocess_kernel: Delta = rowsum(dO * O) in fp32, one warp per query row;
//   2. dkdv_kernel (KV-stationary): a block owns 64 keys of one K/V head, each of its 4 warps 16 of them; it walks
//      every query tile of every query head of the GQA group and computes S^T = K Q^T, so that P^T and dS^T come
//      out of the tensor cores as accumulators in the layout of an A operand: dV += P^T dO and dK += dS^T Q
//      straight from registers. The group's heads are summed in registers, so no two blocks write one dK row;
//   3. dq_kernel (Q-stationary): a block owns 64 query rows, each warp 16; it walks the key tiles, recomputes
//      S, P, dP, dS and accumulates dQ += dS K in registers.
// S and dP are recomputed twice (once per kernel): the price of writing every gradient exactly once.
// Version 2 (FlashAttention-2's single kernel; not bitwise reproducible) runs the same preprocess, then dkdv_kernel
// with ATOMIC_DQ: after its dK, dV products each warp writes its dS^T to shared memory, and the block adds
// dS K (its keys' share of dQ) to an fp32 buffer with atomicAdd; a last kernel scales that buffer and rounds it to
// the input dtype. S and dP are computed once; the order of the atomic additions varies from run to run.
//
// Inputs: q, out, dout (B, H, Lq, D); k, v (B, Hk, Lk, D), Hk dividing H; lse (B, H, Lq) fp32; contiguous; fp16
// or bf16; D in {64, 128}. (batch, head) and the tile index share gridDim.x (up to 2^31 - 1 blocks).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace wb {

// wb:shared-regions mma_and_ldmatrix swizzle async_tile_copy

// region: backward_params
struct BackwardParams {
    const void* q;            // (B, H, Lq, D)
    const void* k;            // (B, Hk, Lk, D)
    const void* v;            // (B, Hk, Lk, D)
    const void* out;          // (B, H, Lq, D): the forward's output
    const void* dout;         // (B, H, Lq, D): dL/d(out)
    const float* lse;         // (B, H, Lq): the forward's natural-log LSE of the scaled scores; -inf: no key seen
    float* delta;             // (B, H, Lq): Delta_i = sum_d dO_id O_id, written by preprocess_kernel
    void* dq;                 // (B, H, Lq, D): v1 q's dtype; v2 fp32, zeroed, the atomics' target, which
                              // convert_dq_kernel turns into q's dtype (no extra field: with one more pointer
                              // here ptxas spilled v1's D = 128 kernels, nvcc 13.0)
    void* dk;                 // (B, Hk, Lk, D)
    void* dv;                 // (B, Hk, Lk, D)
    const uint8_t* key_keep;  // (B, Lk), 1 = key takes part; nullptr = no padding mask
    int B, H, Lq, Lk, kv_group;  // kv_group = H / Hk: query head h reads K/V head h / kv_group (GQA)
    float scale;              // any finite value: nothing here depends on its sign (no running maximum)
    float scale_log2;         // scale * log2(e): P = 2^(scale_log2 s - LSE log2(e))
    int causal, causal_offset;  // query i sees keys j <= i + causal_offset
};
// endregion

// region: preprocess
// 16-bit to fp32 by intrinsic: torch builds extensions with __CUDA_NO_HALF_CONVERSIONS__ (and the bf16 one), which
// removes the implicit conversions.
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// Delta_i = sum_d dO_id O_id, the softmax Jacobian's one number per row, in fp32 from the 16-bit O and dO (as
// FlashAttention-2 does). One warp per row: lane l reads the pairs 2l, 2l + 64, ..., a shuffle tree sums them.
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(128) preprocess_kernel(const BackwardParams p) {
    const int64_t row = static_cast<int64_t>(blockIdx.x) * 4 + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (row >= static_cast<int64_t>(p.B) * p.H * p.Lq) return;  // a whole warp leaves together
    const T* o = static_cast<const T*>(p.out) + row * HEAD_DIM;
    const T* d_o = static_cast<const T*>(p.dout) + row * HEAD_DIM;
    float sum = 0.0f;
#pragma unroll
    for (int c = 2 * lane; c < HEAD_DIM; c += 64)
        sum += to_float(o[c]) * to_float(d_o[c]) + to_float(o[c + 1]) * to_float(d_o[c + 1]);
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane == 0) p.delta[row] = sum;
}
// endregion

// region: warp_products
// The two shapes of product every step below is made of, for one warp and 16 rows.
//
// rows_times_tile_t: C (16 x COLS, fp32) = A B^T, where A is 16 rows of a swizzled (rows x HEAD_DIM) tile and B
// a swizzled (COLS x HEAD_DIM) tile: both row-major with HEAD_DIM contiguous, as Q K^T in the forward. Used for
// S^T = K Q^T and dP^T = V dO^T (dkdv_kernel), and S = Q K^T and dP = dO V^T (dq_kernel).
template <typename T, int HEAD_DIM, int COLS>
__device__ __forceinline__ void rows_times_tile_t(float (&c)[COLS / 8][4], uint32_t a_tile, int a_row0,
                                                  uint32_t b_tile) {
    const int lane = threadIdx.x % 32;
    const int swz = lane % 8;  // every row a lane points at is = lane (mod 8): its chunk's swizzle term
    auto address = [&](uint32_t base, int row, int chunk) { return base + (row * HEAD_DIM + ((chunk ^ swz) << 3)) * 2; };
#pragma unroll
    for (int n = 0; n < COLS / 8; ++n) c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < HEAD_DIM / 16; ++ks) {
        uint32_t a[4];  // matrix i = lane / 8: rows (i % 2) * 8 .., chunk 2 ks + i / 2
        ldmatrix_x4(a, address(a_tile, a_row0 + (lane / 8 % 2) * 8 + lane % 8, 2 * ks + lane / 16));
#pragma unroll
        for (int np = 0; np < COLS / 16; ++np) {
            uint32_t b[4];  // matrix i: B rows 16 np + (i / 2) * 8 .., chunk 2 ks + i % 2
            ldmatrix_x4(b, address(b_tile, 16 * np + (lane / 16) * 8 + lane % 8, 2 * ks + lane / 8 % 2));
            Mma<T>::run(c[2 * np], a, b[0], b[1]);
            Mma<T>::run(c[2 * np + 1], a, b[2], b[3]);
        }
    }
}

// accumulate_times_tile: ACC (16 x HEAD_DIM, fp32) += X (16 x K_COLS) Y, where X is a 16 x K_COLS accumulator
// (fp32, the layout rows_times_tile_t returns) and Y a swizzled (K_COLS x HEAD_DIM) row-major tile. X's C
// fragments of tiles 2 kk and 2 kk + 1, rounded to 16 bits, are register for register the A fragment of its
// 16 x 16 slice kk (the forward's P V trick); Y's B operands come by ldmatrix.trans. Used for dV += P^T dO and
// dK += dS^T Q (dkdv_kernel) and dQ += dS K (dq_kernel).
template <typename T, int HEAD_DIM, int K_COLS>
__device__ __forceinline__ void accumulate_times_tile(float (&acc)[HEAD_DIM / 8][4], const float (&x)[K_COLS / 8][4],
                                                      uint32_t y_tile) {
    const int lane = threadIdx.x % 32;
    const int swz = lane % 8;
    auto address = [&](uint32_t base, int row, int chunk) { return base + (row * HEAD_DIM + ((chunk ^ swz) << 3)) * 2; };
#pragma unroll
    for (int kk = 0; kk < K_COLS / 16; ++kk) {
        const uint32_t a[4] = {Mma<T>::pack(x[2 * kk][0], x[2 * kk][1]), Mma<T>::pack(x[2 * kk][2], x[2 * kk][3]),
                               Mma<T>::pack(x[2 * kk + 1][0], x[2 * kk + 1][1]),
                               Mma<T>::pack(x[2 * kk + 1][2], x[2 * kk + 1][3])};
#pragma unroll
        for (int dp = 0; dp < HEAD_DIM / 16; ++dp) {
            uint32_t b[4];  // matrix i: Y rows 16 kk + (i % 2) * 8 .., chunk 2 dp + i / 2, transposed
            ldmatrix_x4_trans(b, address(y_tile, 16 * kk + (lane / 8 % 2) * 8 + lane % 8, 2 * dp + lane / 16));
            Mma<T>::run(acc[2 * dp], a, b[0], b[1]);
            Mma<T>::run(acc[2 * dp + 1], a, b[2], b[3]);
        }
    }
}
// endregion

// region: probabilities_and_ds
// From the scores s and dP of a 16 x COLS tile (accumulator layout: lane holds rows g = lane / 4 and g + 8,
// columns 8 n + 2 (lane % 4) + {0, 1}), P = 2^(scale_log2 s - lse2) in s, dS = P (dP - Delta) in dp.
// KEYS_IN_ROWS: the tile is transposed (rows are keys, columns queries: dkdv_kernel). lse2 and delta are in shared
// memory, indexed by the query's place in its tile; lse2 is LSE log2(e), or +inf for a row that sees no key (or
// lies past Lq), which makes every P of it 2^-inf = 0 and never NaN (the forward's -inf would give 2^+inf).
// Masked entries become exactly 0 by a select on the exponent (-inf), whatever the score or the scale's sign.
template <bool KEYS_IN_ROWS, int COLS>
__device__ __forceinline__ void probabilities_and_ds(float (&s)[COLS / 8][4], float (&dp)[COLS / 8][4], int row0,
                                                     int col0, const float* lse2, const float* delta, int query0,
                                                     const BackwardParams& p, int batch) {
    const int lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int n = 0; n < COLS / 8; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int row = row0 + g + (i >= 2 ? 8 : 0);
            const int col = col0 + 8 * n + 2 * t + (i & 1);
            const int query = KEYS_IN_ROWS ? col : row;
            const int key = KEYS_IN_ROWS ? row : col;
            const int local_query = query - query0;
            bool keep = key < p.Lk;
            if (keep && p.key_keep != nullptr) keep = p.key_keep[static_cast<size_t>(batch) * p.Lk + key] != 0;
            if (p.causal && key > query + p.causal_offset) keep = false;
            const float exponent = keep ? s[n][i] * p.scale_log2 - lse2[local_query] : -INFINITY;
            const float prob = exp2f(exponent);
            s[n][i] = prob;
            dp[n][i] = prob * (dp[n][i] - delta[local_query]);
        }
    }
}
// endregion

// region: row_stats_and_stores
// Each query row's LSE (base 2, +inf for no key) and Delta into shared memory, for a tile of ROWS query rows.
template <int ROWS, int THREADS>
__device__ __forceinline__ void load_row_stats(float* lse2, float* delta, const BackwardParams& p, int64_t bh_row0,
                                               int query0) {
    for (int i = threadIdx.x; i < ROWS; i += THREADS) {
        const bool in_bounds = query0 + i < p.Lq;
        const float lse = in_bounds ? p.lse[bh_row0 + query0 + i] : -INFINITY;
        lse2[i] = lse == -INFINITY ? INFINITY : lse * 1.4426950408889634f;
        delta[i] = in_bounds ? p.delta[bh_row0 + query0 + i] : 0.0f;
    }
}

// A warp's 16 x HEAD_DIM fp32 accumulator, times `factor`, rounded to T, to rows [row0, row0 + 16) of a
// (L, HEAD_DIM) matrix; rows past L are not written. Each quad writes 16 contiguous bytes of a row.
template <typename T, int HEAD_DIM>
__device__ __forceinline__ void store_rows(T* dst, const float (&acc)[HEAD_DIM / 8][4], int row0, int L, float factor) {
    const int lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = row0 + g + 8 * h;
        if (row >= L) continue;
#pragma unroll
        for (int d = 0; d < HEAD_DIM / 8; ++d)
            *reinterpret_cast<uint32_t*>(dst + static_cast<size_t>(row) * HEAD_DIM + 8 * d + 2 * t) =
                Mma<T>::pack(acc[d][2 * h] * factor, acc[d][2 * h + 1] * factor);
    }
}
// endregion

// region: atomic_dq
// v2's dQ step, for one query tile of BLOCK_M rows and the block's BLOCK_N keys: dQ_tile += dS K.
// The warps hold dS^T (keys in rows), but dS K needs dS with queries in rows as an A operand, and dQ rows need
// all the block's keys: so dS goes through shared memory, transposed on the way in. Each lane stores its 16-bit
// values one by one into ds_tile[query][key] (swizzled like every tile: the lanes of one store hit 4 different
// chunk positions of 8 rows, no bank conflict), then after a barrier warp w computes a 16-row x COLS slice of
// the tile's dQ (plain ldmatrix for dS, ldmatrix.trans for K, as accumulate_times_tile) and adds it to the fp32
// buffer with atomicAdd: other blocks (the other key tiles) add to the same rows at the same time.
template <typename T, int BLOCK_M, int BLOCK_N>
__device__ __forceinline__ void store_ds_transposed(T* ds_tile, const float (&ds)[BLOCK_M / 8][4], int key0) {
    const int lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    uint16_t* tile = reinterpret_cast<uint16_t*>(ds_tile);
#pragma unroll
    for (int n = 0; n < BLOCK_M / 8; ++n) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int key = key0 + g + 8 * h;
            const uint32_t pair = Mma<T>::pack(ds[n][2 * h], ds[n][2 * h + 1]);  // queries 8 n + 2 t, + 1
            const int query = 8 * n + 2 * t;
            tile[swizzled_offset<BLOCK_N>(query, key / 8) + key % 8] = static_cast<uint16_t>(pair & 0xffffu);
            tile[swizzled_offset<BLOCK_N>(query + 1, key / 8) + key % 8] = static_cast<uint16_t>(pair >> 16);
        }
    }
}
// endregion

// region: add_ds_times_k
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NUM_WARPS>
__device__ __forceinline__ void add_ds_times_k(float* dq_accum, uint32_t ds_tile, uint32_t k_tile, int m0, int Lq) {
    constexpr int ROW_BLOCKS = BLOCK_M / 16, SLICES = NUM_WARPS / ROW_BLOCKS, COLS = HEAD_DIM / SLICES;
    static_assert(NUM_WARPS % ROW_BLOCKS == 0 && COLS % 16 == 0, "the warps split the dQ tile evenly");
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row_block = warp % ROW_BLOCKS, chunk0 = (warp / ROW_BLOCKS) * COLS / 8;
    float acc[COLS / 8][4];
#pragma unroll
    for (int d = 0; d < COLS / 8; ++d) acc[d][0] = acc[d][1] = acc[d][2] = acc[d][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
        uint32_t a[4];  // dS rows 16 row_block + (i % 2) * 8 .., key chunk 2 kk + i / 2
        ldmatrix_x4(a, ds_tile + 2 * swizzled_offset<BLOCK_N>(16 * row_block + (lane / 8 % 2) * 8 + lane % 8,
                                                              2 * kk + lane / 16));
#pragma unroll
        for (int dp = 0; dp < COLS / 16; ++dp) {
            uint32_t b[4];  // K rows 16 kk + (i % 2) * 8 .., chunk chunk0 + 2 dp + i / 2, transposed
            ldmatrix_x4_trans(b, k_tile + 2 * swizzled_offset<HEAD_DIM>(16 * kk + (lane / 8 % 2) * 8 + lane % 8,
                                                                        chunk0 + 2 * dp + lane / 16));
            Mma<T>::run(acc[2 * dp], a, b[0], b[1]);
            Mma<T>::run(acc[2 * dp + 1], a, b[2], b[3]);
        }
    }
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = m0 + 16 * row_block + g + 8 * h;
        if (row >= Lq) continue;
#pragma unroll
        for (int d = 0; d < COLS / 8; ++d) {
            float* dst = dq_accum + static_cast<size_t>(row) * HEAD_DIM + chunk0 * 8 + 8 * d + 2 * t;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
            // one 8-byte atomic for the pair (sm_90 and newer)
            atomicAdd(reinterpret_cast<float2*>(dst), make_float2(acc[d][2 * h], acc[d][2 * h + 1]));
#else
            atomicAdd(dst, acc[d][2 * h]);
            atomicAdd(dst + 1, acc[d][2 * h + 1]);
#endif
        }
    }
}
// endregion

// region: convert_dq
// v2's last step: dQ = scale * the fp32 buffer, rounded to T; 4 elements per thread (HEAD_DIM is a multiple of 4).
template <typename T>
__global__ void __launch_bounds__(256) convert_dq_kernel(const float* accum, T* dq, int64_t n, float scale) {
    const int64_t i = (static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x) * 4;
    if (i >= n) return;
    const float4 x = *reinterpret_cast<const float4*>(accum + i);
    *reinterpret_cast<uint2*>(dq + i) = make_uint2(Mma<T>::pack(x.x * scale, x.y * scale),
                                                   Mma<T>::pack(x.z * scale, x.w * scale));
}
// endregion

// region: dkdv_kernel
// KV-stationary: one block = NUM_WARPS warps = BLOCK_N = 16 NUM_WARPS keys of one (batch, K/V head); warp w owns
// keys 16 w .. 16 w + 15 (v1: 4 warps). Per query tile of BLOCK_M rows (of each query head of the GQA group):
// S^T = K Q^T, dP^T = V dO^T, then P^T, dS^T in registers, dV += P^T dO, dK += dS^T Q, and with ATOMIC_DQ (v2)
// dQ += dS K by atomics. Shared memory: K, V (the block's), Q, dO (the current query tile), each swizzled, v2's
// dS tile, and the tile's LSE and Delta.
template <typename T, int HEAD_DIM, int BLOCK_M, int NUM_WARPS, bool ATOMIC_DQ>
__global__ void __launch_bounds__(32 * NUM_WARPS) dkdv_kernel(const BackwardParams p) {
    constexpr int THREADS = 32 * NUM_WARPS, BLOCK_N = 16 * NUM_WARPS;
    extern __shared__ __align__(128) unsigned char smem[];
    T* k_tile = reinterpret_cast<T*>(smem);              // [BLOCK_N][HEAD_DIM]
    T* v_tile = k_tile + BLOCK_N * HEAD_DIM;             // [BLOCK_N][HEAD_DIM]
    T* q_tile = v_tile + BLOCK_N * HEAD_DIM;             // [BLOCK_M][HEAD_DIM]
    T* do_tile = q_tile + BLOCK_M * HEAD_DIM;            // [BLOCK_M][HEAD_DIM]
    T* ds_tile = do_tile + BLOCK_M * HEAD_DIM;           // [BLOCK_M][BLOCK_N], v2 only
    float* lse2 = reinterpret_cast<float*>(ds_tile + (ATOMIC_DQ ? BLOCK_M * BLOCK_N : 0));  // [BLOCK_M]
    float* delta = lse2 + BLOCK_M;                                                          // [BLOCK_M]
    auto shared = [](const void* ptr) { return static_cast<uint32_t>(__cvta_generic_to_shared(ptr)); };

    const int warp = threadIdx.x / 32;
    const int num_n_blocks = (p.Lk + BLOCK_N - 1) / BLOCK_N;
    const int bhk = blockIdx.x / num_n_blocks;  // b * Hk + kv head
    const int n0 = (blockIdx.x % num_n_blocks) * BLOCK_N;
    const int Hk = p.H / p.kv_group;
    const int batch = bhk / Hk;
    const size_t kv_offset = static_cast<size_t>(bhk) * p.Lk * HEAD_DIM;

    load_tile_async<T, HEAD_DIM, BLOCK_N, THREADS>(k_tile, static_cast<const T*>(p.k) + kv_offset, n0, p.Lk);
    load_tile_async<T, HEAD_DIM, BLOCK_N, THREADS>(v_tile, static_cast<const T*>(p.v) + kv_offset, n0, p.Lk);
    cp_async_commit();

    float dk[HEAD_DIM / 8][4], dv[HEAD_DIM / 8][4];
#pragma unroll
    for (int d = 0; d < HEAD_DIM / 8; ++d)
#pragma unroll
        for (int i = 0; i < 4; ++i) dk[d][i] = dv[d][i] = 0.0f;
    // endregion

    // region: dkdv_query_loop
    // Causal: query i sees key j only if i >= j - causal_offset; earlier query tiles see none of these keys.
    const int first_query = p.causal ? max(0, n0 - p.causal_offset) : 0;
    const int m_begin = first_query >= p.Lq ? p.Lq : first_query / BLOCK_M * BLOCK_M;
    const int key_row0 = n0 + warp * 16;  // this warp's first key
    for (int h = 0; h < p.kv_group; ++h) {
        const int64_t bh = static_cast<int64_t>(bhk) * p.kv_group + h;  // b * H + query head
        const T* q = static_cast<const T*>(p.q) + bh * p.Lq * HEAD_DIM;
        const T* d_o = static_cast<const T*>(p.dout) + bh * p.Lq * HEAD_DIM;
        for (int m0 = m_begin; m0 < p.Lq; m0 += BLOCK_M) {
            __syncthreads();  // everyone is done with the previous tile
            load_tile_async<T, HEAD_DIM, BLOCK_M, THREADS>(q_tile, q, m0, p.Lq);
            load_tile_async<T, HEAD_DIM, BLOCK_M, THREADS>(do_tile, d_o, m0, p.Lq);
            cp_async_commit();
            load_row_stats<BLOCK_M, THREADS>(lse2, delta, p, bh * p.Lq, m0);
            cp_async_wait<0>();
            __syncthreads();

            float s[BLOCK_M / 8][4], dp[BLOCK_M / 8][4];  // S^T and dP^T: 16 keys x BLOCK_M queries
            rows_times_tile_t<T, HEAD_DIM, BLOCK_M>(s, shared(k_tile), warp * 16, shared(q_tile));
            rows_times_tile_t<T, HEAD_DIM, BLOCK_M>(dp, shared(v_tile), warp * 16, shared(do_tile));
            probabilities_and_ds<true, BLOCK_M>(s, dp, key_row0, m0, lse2, delta, m0, p, batch);
            accumulate_times_tile<T, HEAD_DIM, BLOCK_M>(dv, s, shared(do_tile));  // dV += P^T dO
            accumulate_times_tile<T, HEAD_DIM, BLOCK_M>(dk, dp, shared(q_tile));  // dK += dS^T Q
            if constexpr (ATOMIC_DQ) {  // v2: dQ += dS K (unscaled; convert_dq_kernel scales)
                store_ds_transposed<T, BLOCK_M, BLOCK_N>(ds_tile, dp, warp * 16);
                __syncthreads();  // every warp's dS^T is in ds_tile
                float* dq_accum = static_cast<float*>(p.dq) + bh * p.Lq * HEAD_DIM;  // v2: p.dq is fp32
                add_ds_times_k<T, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS>(dq_accum, shared(ds_tile), shared(k_tile),
                                                                      m0, p.Lq);
            }
        }
    }
    cp_async_wait<0>();  // no query tile at all: K and V may still be landing
    store_rows<T, HEAD_DIM>(static_cast<T*>(p.dk) + kv_offset, dk, key_row0, p.Lk, p.scale);
    store_rows<T, HEAD_DIM>(static_cast<T*>(p.dv) + kv_offset, dv, key_row0, p.Lk, 1.0f);
}
// endregion

// region: dq_kernel
// Q-stationary: one block = 4 warps = 64 query rows of one (batch, head); warp w owns rows 16 w .. 16 w + 15. Per
// key tile of BLOCK_N keys: S = Q K^T, dP = dO V^T, P and dS in registers, dQ += dS K.
template <typename T, int HEAD_DIM, int BLOCK_N>
__global__ void __launch_bounds__(128) dq_kernel(const BackwardParams p) {
    constexpr int NUM_WARPS = 4, THREADS = 128, BLOCK_M = 16 * NUM_WARPS;
    extern __shared__ __align__(128) unsigned char smem[];
    T* q_tile = reinterpret_cast<T*>(smem);              // [BLOCK_M][HEAD_DIM]
    T* do_tile = q_tile + BLOCK_M * HEAD_DIM;            // [BLOCK_M][HEAD_DIM]
    T* k_tile = do_tile + BLOCK_M * HEAD_DIM;            // [BLOCK_N][HEAD_DIM]
    T* v_tile = k_tile + BLOCK_N * HEAD_DIM;             // [BLOCK_N][HEAD_DIM]
    float* lse2 = reinterpret_cast<float*>(v_tile + BLOCK_N * HEAD_DIM);  // [BLOCK_M]
    float* delta = lse2 + BLOCK_M;                                         // [BLOCK_M]
    auto shared = [](const void* ptr) { return static_cast<uint32_t>(__cvta_generic_to_shared(ptr)); };

    const int warp = threadIdx.x / 32;
    const int num_m_blocks = (p.Lq + BLOCK_M - 1) / BLOCK_M;
    const int64_t bh = blockIdx.x / num_m_blocks;  // b * H + query head
    const int m0 = (blockIdx.x % num_m_blocks) * BLOCK_M;
    const int batch = static_cast<int>(bh / p.H);
    const size_t q_offset = static_cast<size_t>(bh) * p.Lq * HEAD_DIM;
    const size_t kv_offset = static_cast<size_t>(bh / p.kv_group) * p.Lk * HEAD_DIM;
    const T* k = static_cast<const T*>(p.k) + kv_offset;
    const T* v = static_cast<const T*>(p.v) + kv_offset;

    load_tile_async<T, HEAD_DIM, BLOCK_M, THREADS>(q_tile, static_cast<const T*>(p.q) + q_offset, m0, p.Lq);
    load_tile_async<T, HEAD_DIM, BLOCK_M, THREADS>(do_tile, static_cast<const T*>(p.dout) + q_offset, m0, p.Lq);
    cp_async_commit();
    load_row_stats<BLOCK_M, THREADS>(lse2, delta, p, bh * p.Lq, m0);

    float dq[HEAD_DIM / 8][4];
#pragma unroll
    for (int d = 0; d < HEAD_DIM / 8; ++d) dq[d][0] = dq[d][1] = dq[d][2] = dq[d][3] = 0.0f;

    // Causal: keys past the last one the block's last row sees are masked for every row.
    const int key_end = p.causal ? max(0, min(p.Lk, m0 + BLOCK_M + p.causal_offset)) : p.Lk;
    for (int n0 = 0; n0 < key_end; n0 += BLOCK_N) {
        __syncthreads();  // everyone is done with the previous key tile
        load_tile_async<T, HEAD_DIM, BLOCK_N, THREADS>(k_tile, k, n0, p.Lk);
        load_tile_async<T, HEAD_DIM, BLOCK_N, THREADS>(v_tile, v, n0, p.Lk);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();

        float s[BLOCK_N / 8][4], dp[BLOCK_N / 8][4];  // S and dP: 16 queries x BLOCK_N keys
        rows_times_tile_t<T, HEAD_DIM, BLOCK_N>(s, shared(q_tile), warp * 16, shared(k_tile));
        rows_times_tile_t<T, HEAD_DIM, BLOCK_N>(dp, shared(do_tile), warp * 16, shared(v_tile));
        probabilities_and_ds<false, BLOCK_N>(s, dp, m0 + warp * 16, n0, lse2, delta, m0, p, batch);
        accumulate_times_tile<T, HEAD_DIM, BLOCK_N>(dq, dp, shared(k_tile));  // dQ += dS K
    }
    cp_async_wait<0>();  // no key tile at all: Q and dO may still be landing
    store_rows<T, HEAD_DIM>(static_cast<T*>(p.dq) + q_offset, dq, m0 + warp * 16, p.Lq, p.scale);
}
// endregion

// region: variants
// Shared memory per block: four 16-bit tiles (K, V and Q, dO), v2's dS tile and two fp32 rows of statistics.
template <int HEAD_DIM, int KV_ROWS, int Q_ROWS, bool DS_TILE>
constexpr int backward_smem_bytes() {
    return 2 * (KV_ROWS + Q_ROWS) * HEAD_DIM * 2 + (DS_TILE ? Q_ROWS * KV_ROWS * 2 : 0) + 2 * Q_ROWS * 4;
}

// Every launch configuration (version, head dim, query rows per step of dkdv_kernel, and keys: per step of v1's
// dq_kernel, per block of v2's single kernel, 16 per warp); wb_kernels/stages/backward/build.py lists the same.
// X is a macro taking the four. At D = 128 the dK/dV kernel takes 32 query rows per step: with 64, ptxas (sm_80,
// sm_90) needs 255 registers and spills 8 to 12 bytes.
#define WB_FOR_EACH_BACKWARD_VARIANT(X) \
    X(1, 64, 64, 64) X(1, 128, 32, 64) X(2, 64, 64, 128) X(2, 128, 32, 128) X(2, 64, 64, 64) X(2, 128, 32, 64)

// v1's dK/dV kernel has 4 warps; v2's single kernel one warp per 16 of its BLOCK_N keys.
#define WB_DKDV_KERNEL(T, V, D, BM, BN) dkdv_kernel<T, D, BM, (V == 1 ? 4 : BN / 16), V == 2>
// endregion

}  // namespace wb

#ifdef WB_KERNEL_ONLY
// Without torch (the compile check): instantiate every kernel the launcher can choose (dq_kernel: v1 only).
#define WB_DQ_KERNEL_1(T, D, BN) template __global__ void wb::dq_kernel<T, D, BN>(const wb::BackwardParams);
#define WB_DQ_KERNEL_2(T, D, BN)
#define WB_INSTANTIATE(T, V, D, BM, BN)                                                 \
    template __global__ void wb::WB_DKDV_KERNEL(T, V, D, BM, BN)(const wb::BackwardParams); \
    WB_DQ_KERNEL_##V(T, D, BN)
#define WB_INSTANTIATE_BOTH(V, D, BM, BN) \
    WB_INSTANTIATE(__half, V, D, BM, BN) WB_INSTANTIATE(__nv_bfloat16, V, D, BM, BN)
WB_FOR_EACH_BACKWARD_VARIANT(WB_INSTANTIATE_BOTH)
template __global__ void wb::preprocess_kernel<__half, 64>(const wb::BackwardParams);
template __global__ void wb::preprocess_kernel<__half, 128>(const wb::BackwardParams);
template __global__ void wb::preprocess_kernel<__nv_bfloat16, 64>(const wb::BackwardParams);
template __global__ void wb::preprocess_kernel<__nv_bfloat16, 128>(const wb::BackwardParams);
template __global__ void wb::convert_dq_kernel<__half>(const float*, __half*, int64_t, float);
template __global__ void wb::convert_dq_kernel<__nv_bfloat16>(const float*, __nv_bfloat16*, int64_t, float);
#else
// region: torch_launch
// c10's headers rather than ATen/cuda/CUDAContext.h (which pulls in cuBLAS and cuSPARSE): the whole file, launcher
// included, then compiles against a CPU build of torch's headers too, so a machine without a GPU checks it.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "../host_checks.cuh"

namespace wb {

template <typename Kernel>
void launch_with_smem(Kernel kernel, int64_t blocks, int threads, int smem, const BackwardParams& params,
                      cudaStream_t stream) {
    TORCH_CHECK(blocks <= 2147483647LL, "flash_backward: ", blocks, " blocks exceed gridDim.x's limit");
    if (blocks == 0) return;
    if (smem > 48 * 1024) {  // above 48 KB a kernel must opt in to dynamic shared memory
        C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    }
    kernel<<<static_cast<unsigned>(blocks), threads, smem, stream>>>(params);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int VERSION, typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N>
void launch_version(const BackwardParams& p, T* dq, cudaStream_t stream) {
    const int64_t rows = static_cast<int64_t>(p.B) * p.H * p.Lq;
    launch_with_smem(preprocess_kernel<T, HEAD_DIM>, (rows + 3) / 4, 128, 0, p, stream);
    const int64_t kv_heads = static_cast<int64_t>(p.B) * (p.H / p.kv_group);
    constexpr int DKDV_KEYS = VERSION == 1 ? 64 : BLOCK_N;  // keys per dK/dV block, 16 per warp
    launch_with_smem(WB_DKDV_KERNEL(T, VERSION, HEAD_DIM, BLOCK_M, BLOCK_N),
                     kv_heads * ((p.Lk + DKDV_KEYS - 1) / DKDV_KEYS), 2 * DKDV_KEYS,
                     backward_smem_bytes<HEAD_DIM, DKDV_KEYS, BLOCK_M, VERSION == 2>(), p, stream);
    if constexpr (VERSION == 1) {
        launch_with_smem(dq_kernel<T, HEAD_DIM, BLOCK_N>, static_cast<int64_t>(p.B) * p.H * ((p.Lq + 63) / 64), 128,
                         backward_smem_bytes<HEAD_DIM, BLOCK_N, 64, false>(), p, stream);
    } else {
        const int64_t n = rows * HEAD_DIM;  // a multiple of 4: each thread converts 4 elements
        const int64_t blocks = (n / 4 + 255) / 256;
        TORCH_CHECK(blocks <= 2147483647LL, "flash_backward: ", blocks, " blocks exceed gridDim.x's limit");
        convert_dq_kernel<T><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(static_cast<const float*>(p.dq), dq,
                                                                               n, p.scale);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
}

// dq: where the gradient goes in q's dtype (v1: p.dq itself; v2: p.dq is the fp32 buffer).
template <typename T>
void launch_variant(const BackwardParams& p, void* dq, int64_t version, int64_t head_dim, int64_t block_m,
                    int64_t block_n, cudaStream_t stream) {
#define WB_LAUNCH_IF(V, D, BM, BN)                                         \
    if (version == V && head_dim == D && block_m == BM && block_n == BN) \
        return launch_version<V, T, D, BM, BN>(p, static_cast<T*>(dq), stream);
    WB_FOR_EACH_BACKWARD_VARIANT(WB_LAUNCH_IF)
#undef WB_LAUNCH_IF
    TORCH_CHECK(false, "flash_backward: no variant version=", version, " head_dim=", head_dim, " block_m=", block_m,
                " block_n=", block_n);
}

}  // namespace wb
// endregion

// region: torch_entry_point
// Returns [dq (B, H, Lq, D), dk, dv (B, Hk, Lk, D)] in q's dtype.
std::vector<torch::Tensor> flash_backward(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor out,
                                          torch::Tensor lse, torch::Tensor dout, torch::Tensor key_keep, bool causal,
                                          int64_t causal_offset, double scale, int64_t version, int64_t block_m,
                                          int64_t block_n) {
    for (const auto& x : {q, k, v, out, dout}) {
        TORCH_CHECK(x.is_cuda() && x.is_contiguous() && x.dim() == 4 && x.scalar_type() == q.scalar_type(),
                    "flash_backward: q, k, v, out, dout must be contiguous 4-d CUDA tensors of one dtype");
    }
    const bool is_half = q.scalar_type() == torch::kHalf;
    TORCH_CHECK(is_half || q.scalar_type() == torch::kBFloat16,
                "flash_backward: dtype must be float16 or bfloat16, got ", q.scalar_type());
    const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), D = q.size(3), Hk = k.size(1), Lk = k.size(2);
    TORCH_CHECK(D == 64 || D == 128, "flash_backward: head dim must be 64 or 128, got ", D);
    TORCH_CHECK(k.size(0) == B && Hk > 0 && H % Hk == 0 && k.size(3) == D && v.sizes() == k.sizes(),
                "flash_backward: k and v must be (B, Hk, Lk, D) with q's B and D, and Hk dividing H");
    TORCH_CHECK(out.sizes() == q.sizes() && dout.sizes() == q.sizes(), "flash_backward: out and dout must be q's shape");
    TORCH_CHECK(lse.is_cuda() && lse.is_contiguous() && lse.scalar_type() == torch::kFloat32 && lse.dim() == 3 &&
                lse.size(0) == B && lse.size(1) == H && lse.size(2) == Lq,
                "flash_backward: lse must be a contiguous CUDA float32 tensor (B, H, Lq)");
    TORCH_CHECK(std::isfinite(scale), "flash_backward: the scale must be finite (got ", scale, ")");
    const uint8_t* keep = wb::key_keep_pointer(key_keep, B, Lk, "flash_backward");  // nullptr: no mask
    const c10::cuda::CUDAGuard guard(q.device());
    auto dq = torch::empty_like(q);
    auto dk = torch::empty_like(k);
    auto dv = torch::empty_like(v);
    auto delta = torch::empty({B, H, Lq}, q.options().dtype(torch::kFloat32));
    TORCH_CHECK(version == 1 || version == 2, "flash_backward: version must be 1 or 2, got ", version);
    // v2 adds every key block's share of dQ into this fp32 buffer, so it starts at zero
    auto dq_accum = version == 2 ? torch::zeros_like(q, q.options().dtype(torch::kFloat32)) : torch::Tensor();
    if (Lk == 0 || Lq == 0) {  // nothing sees anything: every gradient is zero
        dq.zero_(), dk.zero_(), dv.zero_();
        return {dq, dk, dv};
    }
    if (q.numel() == 0) return {dq, dk, dv};
    // endregion

    // region: torch_entry_launch
    wb::BackwardParams params;
    params.q = q.data_ptr();
    params.k = k.data_ptr();
    params.v = v.data_ptr();
    params.out = out.data_ptr();
    params.dout = dout.data_ptr();
    params.lse = lse.data_ptr<float>();
    params.delta = delta.data_ptr<float>();
    params.dq = version == 2 ? dq_accum.data_ptr() : dq.data_ptr();
    params.dk = dk.data_ptr();
    params.dv = dv.data_ptr();
    params.key_keep = keep;
    params.B = static_cast<int>(B);
    params.H = static_cast<int>(H);
    params.Lq = static_cast<int>(Lq);
    params.Lk = static_cast<int>(Lk);
    params.kv_group = static_cast<int>(H / Hk);
    params.scale = static_cast<float>(scale);
    params.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
    params.causal = causal ? 1 : 0;
    params.causal_offset = static_cast<int>(causal_offset);

    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    if (is_half) wb::launch_variant<__half>(params, dq.data_ptr(), version, D, block_m, block_n, stream);
    else wb::launch_variant<__nv_bfloat16>(params, dq.data_ptr(), version, D, block_m, block_n, stream);
    return {dq, dk, dv};
}
// endregion
#endif
