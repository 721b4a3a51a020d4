// FlashAttention-2 forward on tensor cores with nvcuda::wmma (lesson 05_wmma).
//
// The one CUDA source of the tensor-core stage. Used by:
//   - wb_kernels/cuda_build.py: torch load_inline builds it on a GPU machine; without a GPU it is
//     compiled with nvcc for sm_80 and sm_90 (-DWB_KERNEL_ONLY) to report registers, shared memory,
//     spills and the HMMA instructions in the SASS;
//   - wb_kernels/stages/wmma/launcher.py: the "wmma" stage of wb_kernels.attention();
//   - notebooks/05_wmma.ipynb shows it region by region (// region: NAME), the kernel in consecutive pieces.
//
// Structure (one thread block = NUM_WARPS warps of one (batch, head)):
//   - each warp owns ROW_FRAGS x 16 query rows; their Q fragments stay in registers for the whole key
//     loop (or are re-read from a shared Q tile, Q_IN_REGISTERS = false, when registers run short);
//   - K and V tiles of 64 keys are staged in padded shared memory by cp.async, double-buffered, so
//     the next tile loads while this one is computed;
//   - S = Q K^T on tensor cores (fp16/bf16 in, fp32 accumulate), stored to a per-warp shared scratch
//     because a WMMA accumulator's element layout is opaque: the online softmax needs whole rows;
//   - online softmax in fp32 (exp2 with log2(e) folded into the scale), P rounded to fp16/bf16 and
//     re-loaded as a matrix_a fragment for O += P V on tensor cores;
//   - O stays in fp32 accumulator fragments; rows are rescaled through a row-index map read once
//     from a fragment loaded with known values (layout-agnostic); O and LSE are written once.
// Inputs: q (B, H, Lq, D), k and v (B, Hk, Lk, D) with Hk dividing H, contiguous, fp16 or bf16, D in {64, 128}.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>
#include <stdint.h>

namespace wb {

using namespace nvcuda;

constexpr int BLOCK_N = 64;  // keys per K/V tile
constexpr int FRAG = 16;     // WMMA m16n16k16
constexpr int ROW_PAD = 8;   // extra elements per shared-memory row: keeps fragment loads free of bank conflicts

// region: flash_params_and_pack
struct FlashParams {
    const void* q;                 // (B, H, Lq, D)
    const void* k;                 // (B, Hk, Lk, D)
    const void* v;                 // (B, Hk, Lk, D)
    void* out;                     // (B, H, Lq, D), same dtype as q
    float* lse;                    // (B, H, Lq), natural-log log-sum-exp of the scaled scores
    const uint8_t* key_keep;       // (B, Lk), 1 = key takes part; nullptr = no padding mask
    int B, H, Lq, Lk, kv_group;    // kv_group = H / Hk: query head h reads K/V head h / kv_group (GQA)
    float scale_log2;              // scale * log2(e): softmax runs in base 2
    int causal, causal_offset;     // query i sees keys j <= i + causal_offset (0: top-left, Lk - Lq: bottom-right)
};

// Conversions between fp32 and the 16-bit input type, two values at a time.
template <typename T> struct Pack;
template <> struct Pack<__half> {
    using T2 = __half2;
    static __device__ __forceinline__ T2 from_floats(float a, float b) { return __floats2half2_rn(a, b); }
};
template <> struct Pack<__nv_bfloat16> {
    using T2 = __nv_bfloat162;
    static __device__ __forceinline__ T2 from_floats(float a, float b) { return __floats2bfloat162_rn(a, b); }
};
// endregion

// region: shared_layout
template <int HEAD_DIM, int NUM_WARPS, bool Q_IN_REGISTERS, int ROW_FRAGS>
struct Layout {
    static constexpr int WARP_ROWS = ROW_FRAGS * FRAG;         // query rows per warp
    static constexpr int BLOCK_M = NUM_WARPS * WARP_ROWS;      // query rows per block
    static constexpr int KV_STRIDE = HEAD_DIM + ROW_PAD;      // elements per K/V/Q row in shared memory
    static constexpr int S_STRIDE = BLOCK_N + ROW_PAD;        // floats per row of a warp's S scratch
    static constexpr int P_STRIDE = BLOCK_N + ROW_PAD;        // 16-bit elements per row of a warp's P scratch
    static constexpr int KV_TILE = BLOCK_N * KV_STRIDE;       // elements of one K (or V) tile
    // bytes: 2 stages x (K, V) tiles | S scratch | P scratch | key bias (2 stages) | row factors | Q tile
    static constexpr int KV_BYTES = 2 * 2 * KV_TILE * 2;
    static constexpr int S_BYTES = BLOCK_M * S_STRIDE * 4;
    static constexpr int P_BYTES = BLOCK_M * P_STRIDE * 2;
    static constexpr int BIAS_BYTES = 2 * BLOCK_N * 4;
    static constexpr int ROW_BYTES = BLOCK_M * 4;
    // Keeping Q's fragments in registers costs 8 registers per thread per 16 x 16 piece (64 for 16
    // rows at D = 128); the alternative re-reads them from a shared-memory Q tile on every key tile.
    static constexpr int Q_BYTES = Q_IN_REGISTERS ? 0 : BLOCK_M * KV_STRIDE * 2;
    static constexpr int SMEM_BYTES = KV_BYTES + S_BYTES + P_BYTES + BIAS_BYTES + ROW_BYTES + Q_BYTES;
    static_assert(!Q_IN_REGISTERS || BLOCK_M <= 2 * BLOCK_N, "the Q tile is staged in the second K/V stage");
    static_assert(HEAD_DIM % 64 == 0, "the epilogue writes O 64 columns at a time");
};
// endregion

// region: load_fragment
// Fragment loads from shared memory. For fp16, wmma::load_matrix_sync compiles to ldmatrix. The
// bf16 overloads take generic pointers and compile to generic loads plus movmatrix transposes
// (measured: about 1.4x slower kernels), so for bf16 the same PTX wmma.load is issued with the
// .shared state space spelled out. Both fill the fragment exactly as the API does.
template <typename Frag, typename T>
__device__ __forceinline__ void load_fragment(Frag& frag, const T* smem, unsigned ldm) {
    wmma::load_matrix_sync(frag, smem, ldm);
}
#define WB_BF16_SHARED_LOAD(USE, LAYOUT, PTX_USE, PTX_LAYOUT)                                               \
    template <>                                                                                            \
    __device__ __forceinline__ void load_fragment(                                                         \
        wmma::fragment<wmma::USE, 16, 16, 16, __nv_bfloat16, wmma::LAYOUT>& frag, const __nv_bfloat16* smem, \
        unsigned ldm) {                                                                                    \
        unsigned* r = reinterpret_cast<unsigned*>(&frag.x[0]);                                             \
        const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(smem));                    \
        asm volatile("wmma.load." PTX_USE ".sync.aligned." PTX_LAYOUT ".m16n16k16.shared.bf16 "             \
                     "{%0, %1, %2, %3}, [%4], %5;\n"                                                       \
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])                                       \
                     : "r"(address), "r"(ldm));                                                            \
    }
WB_BF16_SHARED_LOAD(matrix_a, row_major, "a", "row")
WB_BF16_SHARED_LOAD(matrix_b, row_major, "b", "row")
WB_BF16_SHARED_LOAD(matrix_b, col_major, "b", "col")
#undef WB_BF16_SHARED_LOAD
// endregion

// region: async_tile_copy
// cp.async copies 16 bytes global -> shared without passing through registers, so a tile can load
// while the warps compute on the other stage. A row past the end is zero-filled (src-size 0).
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, bool in_bounds) {
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
    const int src_bytes = in_bounds ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING)); }

// Copies rows [row0, row0 + ROWS) of a (L, HEAD_DIM) matrix into shared memory with row stride
// HEAD_DIM + ROW_PAD; all threads of the block take part, 8 elements (16 bytes) per copy.
template <typename T, int HEAD_DIM, int ROWS, int THREADS>
__device__ __forceinline__ void load_tile_async(T* smem, const T* gmem, int row0, int L) {
    constexpr int CHUNKS_PER_ROW = HEAD_DIM / 8;
    for (int chunk = threadIdx.x; chunk < ROWS * CHUNKS_PER_ROW; chunk += THREADS) {
        const int r = chunk / CHUNKS_PER_ROW;
        const int c = (chunk % CHUNKS_PER_ROW) * 8;
        const bool in_bounds = row0 + r < L;
        const T* src = in_bounds ? gmem + static_cast<size_t>(row0 + r) * HEAD_DIM + c : gmem;
        cp_async_16(smem + r * (HEAD_DIM + ROW_PAD) + c, src, in_bounds);
    }
}
// endregion

// region: online_softmax_rows
// One warp turns its 16 x 64 block of raw scores S (fp32, in shared memory) into P (fp16/bf16, in
// shared memory) and updates the running max m and sum l of its rows. Two lanes share a row, each
// taking 32 of the 64 columns (interleaved by 4 so that float4 reads hit different banks).
// Returns the factor alpha = 2^(m_old - m_new) by which the row's O must be rescaled.
template <typename T>
__device__ __forceinline__ float online_softmax_rows(
    const float* s_rows, int s_stride,       // this warp's S scratch (16 x 64 fp32)
    T* p_rows, int p_stride,                 // this warp's P scratch (16 x 64 fp16/bf16)
    const float* key_bias,                   // (64,) 0 for a key that takes part, -inf otherwise
    float scale_log2,                        // scale * log2(e)
    int last_key, int key0, bool causal_tile,  // the row's last visible key; causal_tile: the tile crosses the diagonal
    float& m_run, float& l_run) {            // running max (base 2) and sum of the row, both lanes
    using T2 = typename Pack<T>::T2;
    const int lane = threadIdx.x % 32;
    const int row = lane >> 1;
    const int col0 = (lane & 1) * 4;
    float x[32];
    float tile_max = -INFINITY;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const float4 s4 = *reinterpret_cast<const float4*>(s_rows + row * s_stride + col0 + 8 * j);
        const float s[4] = {s4.x, s4.y, s4.z, s4.w};
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const int col = col0 + 8 * j + t;
            // select, not add: a NaN score at a masked key must not leak into the row (NaN + -inf = NaN)
            float xi = key_bias[col] == 0.0f ? s[t] * scale_log2 : -INFINITY;
            if (causal_tile && key0 + col > last_key) xi = -INFINITY;
            x[4 * j + t] = xi;
            tile_max = fmaxf(tile_max, xi);
        }
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    const float m_new = fmaxf(m_run, tile_max);
    // A row that has seen no key yet keeps m = -inf; subtracting 0 instead avoids inf - inf = NaN.
    const float m_use = (m_new == -INFINITY) ? 0.0f : m_new;
    const float alpha = exp2f(m_run - m_use);
    float tile_sum = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        float p[4];
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            p[t] = exp2f(x[4 * j + t] - m_use);
            tile_sum += p[t];  // the sum uses fp32 p, as FlashAttention-2 does; PV uses the rounded p
        }
        T2 pair[2] = {Pack<T>::from_floats(p[0], p[1]), Pack<T>::from_floats(p[2], p[3])};
        *reinterpret_cast<uint2*>(p_rows + row * p_stride + col0 + 8 * j) = *reinterpret_cast<uint2*>(pair);
    }
    tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, 1);
    l_run = l_run * alpha + tile_sum;
    m_run = m_new;
    return alpha;
}
// endregion

// region: kernel_setup
template <typename T, int HEAD_DIM, int NUM_WARPS, bool Q_IN_REGISTERS, int ROW_FRAGS>
__global__ void __launch_bounds__(NUM_WARPS * 32)
flash_wmma_kernel(const FlashParams p) {
    using L = Layout<HEAD_DIM, NUM_WARPS, Q_IN_REGISTERS, ROW_FRAGS>;
    constexpr int THREADS = NUM_WARPS * 32;
    constexpr int D_FRAGS = HEAD_DIM / FRAG;  // fragments across the head dim
    constexpr int N_FRAGS = BLOCK_N / FRAG;   // fragments across a key tile
    using FragA = wmma::fragment<wmma::matrix_a, FRAG, FRAG, FRAG, T, wmma::row_major>;
    using FragKt = wmma::fragment<wmma::matrix_b, FRAG, FRAG, FRAG, T, wmma::col_major>;  // K^T
    using FragV = wmma::fragment<wmma::matrix_b, FRAG, FRAG, FRAG, T, wmma::row_major>;
    using FragAcc = wmma::fragment<wmma::accumulator, FRAG, FRAG, FRAG, float>;

    extern __shared__ __align__(128) unsigned char smem[];
    T* kv_tiles = reinterpret_cast<T*>(smem);                                   // [stage][K, V][64][KV_STRIDE]
    float* s_scratch = reinterpret_cast<float*>(smem + L::KV_BYTES);            // [BLOCK_M][S_STRIDE]
    T* p_scratch = reinterpret_cast<T*>(smem + L::KV_BYTES + L::S_BYTES);       // [BLOCK_M][P_STRIDE]
    float* key_bias = reinterpret_cast<float*>(smem + L::KV_BYTES + L::S_BYTES + L::P_BYTES);  // [stage][64]
    float* row_factor = key_bias + 2 * BLOCK_N;                                 // [BLOCK_M]
    T* q_tile = reinterpret_cast<T*>(row_factor + L::BLOCK_M);                  // [BLOCK_M][KV_STRIDE] or unused

    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int num_m_blocks = (p.Lq + L::BLOCK_M - 1) / L::BLOCK_M;
    // Causal blocks further down have more keys: start those first so the tail of the grid is short. Blocks start in
    // x-fastest order, so every (batch, head)'s heaviest block starts before any head's second heaviest.
    const int m_block = p.causal ? num_m_blocks - 1 - blockIdx.y : blockIdx.y;
    const int bh = blockIdx.x;  // (batch, head) in x, the one grid dimension past 65,535 blocks
    const int batch = bh / p.H;
    const int m0 = m_block * L::BLOCK_M;
    const T* q = static_cast<const T*>(p.q) + static_cast<size_t>(bh) * p.Lq * HEAD_DIM;
    // GQA: query head h of batch b (bh = b * H + h) reads K/V head b * Hk + h / kv_group = bh / kv_group.
    const T* k = static_cast<const T*>(p.k) + static_cast<size_t>(bh / p.kv_group) * p.Lk * HEAD_DIM;
    const T* v = static_cast<const T*>(p.v) + static_cast<size_t>(bh / p.kv_group) * p.Lk * HEAD_DIM;
    // Causal: keys past the last one the block's last row sees are masked for every row, so those tiles are
    // skipped (all of them when no row of the block sees a key: bottom-right alignment with Lq > Lk).
    const int key_end = p.causal ? max(0, min(p.Lk, m0 + L::BLOCK_M + p.causal_offset)) : p.Lk;
    const int num_tiles = (key_end + BLOCK_N - 1) / BLOCK_N;
    // endregion

    // region: kernel_prologue
    auto load_kv_stage = [&](int tile, int stage) {
        T* k_dst = kv_tiles + stage * 2 * L::KV_TILE;
        load_tile_async<T, HEAD_DIM, BLOCK_N, THREADS>(k_dst, k, tile * BLOCK_N, p.Lk);
        load_tile_async<T, HEAD_DIM, BLOCK_N, THREADS>(k_dst + L::KV_TILE, v, tile * BLOCK_N, p.Lk);
        if (threadIdx.x < BLOCK_N) {  // padding mask and the ragged end, as an additive bias per key
            const int key = tile * BLOCK_N + threadIdx.x;
            const bool keep = key < p.Lk && (p.key_keep == nullptr || p.key_keep[batch * p.Lk + key]);
            key_bias[stage * BLOCK_N + threadIdx.x] = keep ? 0.0f : -INFINITY;
        }
    };

    // Prologue: the Q tile goes through stage 1's space (or its own tile), K/V tile 0 into stage 0.
    T* q_stage = Q_IN_REGISTERS ? kv_tiles + 2 * L::KV_TILE : q_tile;
    load_tile_async<T, HEAD_DIM, L::BLOCK_M, THREADS>(q_stage, q, m0, p.Lq);
    load_kv_stage(0, 0);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    // Warp w owns query rows m0 + w * WARP_ROWS ... as ROW_FRAGS fragments of 16 rows: every K and V
    // fragment it loads from shared memory then feeds ROW_FRAGS tensor-core operations.
    const T* my_q = q_stage + warp * L::WARP_ROWS * L::KV_STRIDE;
    constexpr int Q_KEPT = Q_IN_REGISTERS ? D_FRAGS : 1;
    FragA q_frag[ROW_FRAGS][Q_KEPT];  // in registers for the whole loop (if kept)
    if constexpr (Q_IN_REGISTERS) {
#pragma unroll
        for (int r = 0; r < ROW_FRAGS; ++r)
#pragma unroll
            for (int d = 0; d < D_FRAGS; ++d)
                load_fragment(q_frag[r][d], my_q + r * FRAG * L::KV_STRIDE + d * FRAG, L::KV_STRIDE);
    }
    // endregion

    // region: kernel_row_probe
    // Which row of the 16 does accumulator element i hold? The layout is opaque, so ask it: load a
    // matrix whose entries are their own row numbers and read the elements back.
    float* my_s = s_scratch + warp * L::WARP_ROWS * L::S_STRIDE;
    T* my_p = p_scratch + warp * L::WARP_ROWS * L::P_STRIDE;
    float* my_row_factor = row_factor + warp * L::WARP_ROWS;
    for (int i = lane; i < FRAG * FRAG; i += 32) my_s[(i / FRAG) * L::S_STRIDE + i % FRAG] = static_cast<float>(i / FRAG);
    __syncwarp();
    FragAcc row_probe;
    wmma::load_matrix_sync(row_probe, my_s, L::S_STRIDE, wmma::mem_row_major);
    int frag_row[FragAcc::num_elements];
#pragma unroll
    for (int i = 0; i < FragAcc::num_elements; ++i) frag_row[i] = static_cast<int>(row_probe.x[i]);
    __syncthreads();  // every warp has its Q fragments before stage 1 is reused for K/V

    FragAcc o_frag[ROW_FRAGS][D_FRAGS];
#pragma unroll
    for (int r = 0; r < ROW_FRAGS; ++r)
#pragma unroll
        for (int d = 0; d < D_FRAGS; ++d) wmma::fill_fragment(o_frag[r][d], 0.0f);
    float m_run[ROW_FRAGS], l_run[ROW_FRAGS];  // per row of each 16-row fragment (two lanes share a row)
#pragma unroll
    for (int r = 0; r < ROW_FRAGS; ++r) m_run[r] = -INFINITY, l_run[r] = 0.0f;
    const int warp_row0 = m0 + warp * L::WARP_ROWS;
    // endregion

    // region: kernel_scores
    for (int tile = 0; tile < num_tiles; ++tile) {
        const int stage = tile & 1;
        if (tile + 1 < num_tiles) load_kv_stage(tile + 1, stage ^ 1);
        cp_async_commit();
        cp_async_wait<1>();  // this tile has landed; the next one may still be in flight
        __syncthreads();

        const int key0 = tile * BLOCK_N;
        // Causal: a warp whose rows all see only keys before this tile has nothing to add (but still syncs).
        if (!p.causal || key0 <= warp_row0 + L::WARP_ROWS - 1 + p.causal_offset) {
            const T* k_tile = kv_tiles + stage * 2 * L::KV_TILE;
            const T* v_tile = k_tile + L::KV_TILE;

            // S = Q K^T for WARP_ROWS rows x 64 keys, on tensor cores
            FragAcc s_frag[ROW_FRAGS][N_FRAGS];
#pragma unroll
            for (int r = 0; r < ROW_FRAGS; ++r)
#pragma unroll
                for (int n = 0; n < N_FRAGS; ++n) wmma::fill_fragment(s_frag[r][n], 0.0f);
#pragma unroll
            for (int d = 0; d < D_FRAGS; ++d) {
                if constexpr (!Q_IN_REGISTERS) {
#pragma unroll
                    for (int r = 0; r < ROW_FRAGS; ++r)
                        load_fragment(q_frag[r][0], my_q + r * FRAG * L::KV_STRIDE + d * FRAG, L::KV_STRIDE);
                }
#pragma unroll
                for (int n = 0; n < N_FRAGS; ++n) {
                    FragKt kt;
                    load_fragment(kt, k_tile + n * FRAG * L::KV_STRIDE + d * FRAG, L::KV_STRIDE);
#pragma unroll
                    for (int r = 0; r < ROW_FRAGS; ++r)
                        wmma::mma_sync(s_frag[r][n], q_frag[r][Q_IN_REGISTERS ? d : 0], kt, s_frag[r][n]);
                }
            }
            // endregion

            // region: kernel_softmax
            // The WMMA limit: the softmax needs whole rows, the accumulator's layout is opaque,
            // so S takes a round trip through shared memory.
#pragma unroll
            for (int r = 0; r < ROW_FRAGS; ++r)
#pragma unroll
                for (int n = 0; n < N_FRAGS; ++n)
                    wmma::store_matrix_sync(my_s + r * FRAG * L::S_STRIDE + n * FRAG, s_frag[r][n], L::S_STRIDE,
                                            wmma::mem_row_major);
            __syncwarp();

#pragma unroll
            for (int r = 0; r < ROW_FRAGS; ++r) {
                const int row0 = warp_row0 + r * FRAG;
                const bool causal_tile = p.causal && key0 + BLOCK_N - 1 > row0 + p.causal_offset;
                const float alpha = online_softmax_rows<T>(
                    my_s + r * FRAG * L::S_STRIDE, L::S_STRIDE, my_p + r * FRAG * L::P_STRIDE, L::P_STRIDE,
                    key_bias + stage * BLOCK_N, p.scale_log2, row0 + (lane >> 1) + p.causal_offset, key0, causal_tile,
                    m_run[r], l_run[r]);
                if ((lane & 1) == 0) my_row_factor[r * FRAG + (lane >> 1)] = alpha;
            }
            __syncwarp();
            // endregion

            // region: kernel_pv
            // O *= alpha per row, then O += P V on tensor cores
#pragma unroll
            for (int r = 0; r < ROW_FRAGS; ++r) {
                float factor[FragAcc::num_elements];
#pragma unroll
                for (int i = 0; i < FragAcc::num_elements; ++i) factor[i] = my_row_factor[r * FRAG + frag_row[i]];
#pragma unroll
                for (int d = 0; d < D_FRAGS; ++d)
#pragma unroll
                    for (int i = 0; i < FragAcc::num_elements; ++i) o_frag[r][d].x[i] *= factor[i];
            }
#pragma unroll
            for (int kk = 0; kk < N_FRAGS; ++kk) {
                FragA p_frag[ROW_FRAGS];
#pragma unroll
                for (int r = 0; r < ROW_FRAGS; ++r)
                    load_fragment(p_frag[r], my_p + r * FRAG * L::P_STRIDE + kk * FRAG, L::P_STRIDE);
#pragma unroll
                for (int d = 0; d < D_FRAGS; ++d) {
                    FragV v_frag;
                    load_fragment(v_frag, v_tile + kk * FRAG * L::KV_STRIDE + d * FRAG, L::KV_STRIDE);
#pragma unroll
                    for (int r = 0; r < ROW_FRAGS; ++r) wmma::mma_sync(o_frag[r][d], p_frag[r], v_frag, o_frag[r][d]);
                }
            }
        }
        __syncthreads();  // everyone is done with this stage before it is refilled
    }
    // endregion

    // region: kernel_epilogue
    // Epilogue: O /= l, LSE = ln(2) * (m + log2 l); rows that saw no key get 0 and -inf.
    T* out = static_cast<T*>(p.out) + static_cast<size_t>(bh) * p.Lq * HEAD_DIM;
    using T2 = typename Pack<T>::T2;
#pragma unroll
    for (int r = 0; r < ROW_FRAGS; ++r) {
        const int query_index = warp_row0 + r * FRAG + (lane >> 1);
        const bool row_has_keys = l_run[r] > 0.0f;
        if ((lane & 1) == 0) {
            my_row_factor[r * FRAG + (lane >> 1)] = row_has_keys ? 1.0f / l_run[r] : 0.0f;
            if (query_index < p.Lq)
                p.lse[static_cast<size_t>(bh) * p.Lq + query_index] =
                    row_has_keys ? (m_run[r] + __log2f(l_run[r])) * 0.69314718055994531f : -INFINITY;
        }
        __syncwarp();
        float inv_l[FragAcc::num_elements];
#pragma unroll
        for (int i = 0; i < FragAcc::num_elements; ++i) inv_l[i] = my_row_factor[r * FRAG + frag_row[i]];
#pragma unroll
        for (int chunk = 0; chunk < HEAD_DIM / 64; ++chunk) {  // 64 output columns per pass through the scratch
#pragma unroll
            for (int n = 0; n < 4; ++n) {
                FragAcc& o = o_frag[r][chunk * 4 + n];
#pragma unroll
                for (int i = 0; i < FragAcc::num_elements; ++i) o.x[i] *= inv_l[i];
                wmma::store_matrix_sync(my_s + n * FRAG, o, L::S_STRIDE, wmma::mem_row_major);
            }
            __syncwarp();
            if (query_index < p.Lq) {
                const int col0 = (lane & 1) * 32;
                const float* src = my_s + (lane >> 1) * L::S_STRIDE + col0;
                T* dst = out + static_cast<size_t>(query_index) * HEAD_DIM + chunk * 64 + col0;
#pragma unroll
                for (int c = 0; c < 32; c += 8) {
                    T2 packed[4];
#pragma unroll
                    for (int t = 0; t < 4; ++t) packed[t] = Pack<T>::from_floats(src[c + 2 * t], src[c + 2 * t + 1]);
                    *reinterpret_cast<uint4*>(dst + c) = *reinterpret_cast<uint4*>(packed);
                }
            }
            __syncwarp();
        }
    }
}
// endregion

template <int HEAD_DIM, int NUM_WARPS, bool Q_IN_REGISTERS, int ROW_FRAGS>
constexpr int smem_bytes() { return Layout<HEAD_DIM, NUM_WARPS, Q_IN_REGISTERS, ROW_FRAGS>::SMEM_BYTES; }

// Every launch variant (num_warps, Q in registers, 16-row fragments per warp); wb_kernels.cuda_build.VARIANTS
// lists the same. X is a macro taking the three.
#define WB_FOR_EACH_VARIANT(X) X(4, true, 1) X(8, true, 1) X(4, false, 1) X(8, false, 1) X(4, true, 2) X(4, false, 2)

}  // namespace wb

#ifdef WB_KERNEL_ONLY
// Without torch (the compile check): instantiate every variant the launcher can choose.
#define WB_INSTANTIATE(T, D, W, QR, RF) template __global__ void wb::flash_wmma_kernel<T, D, W, QR, RF>(const wb::FlashParams);
#define WB_INSTANTIATE_ALL(W, QR, RF)                                                               \
    WB_INSTANTIATE(__half, 64, W, QR, RF) WB_INSTANTIATE(__nv_bfloat16, 64, W, QR, RF)              \
    WB_INSTANTIATE(__half, 128, W, QR, RF) WB_INSTANTIATE(__nv_bfloat16, 128, W, QR, RF)
WB_FOR_EACH_VARIANT(WB_INSTANTIATE_ALL)
#else
// region: torch_launch_variants
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "../host_checks.cuh"

namespace wb {

template <typename T, int HEAD_DIM, int NUM_WARPS, bool Q_IN_REGISTERS, int ROW_FRAGS>
void launch_flash_wmma(const FlashParams& params, cudaStream_t stream) {
    constexpr int smem = smem_bytes<HEAD_DIM, NUM_WARPS, Q_IN_REGISTERS, ROW_FRAGS>();
    auto kernel = flash_wmma_kernel<T, HEAD_DIM, NUM_WARPS, Q_IN_REGISTERS, ROW_FRAGS>;
    if (smem > 48 * 1024) {  // above 48 KB a kernel must opt in to dynamic shared memory
        C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    }
    constexpr int block_m = NUM_WARPS * ROW_FRAGS * FRAG;
    // (batch, head) in x, which allows 2^31 - 1 blocks; the query blocks in y, which allows 65,535
    const int64_t m_blocks = (static_cast<int64_t>(params.Lq) + block_m - 1) / block_m;
    TORCH_CHECK_VALUE(m_blocks <= 65535, "flash_wmma: Lq = ", params.Lq, " needs ", m_blocks, " blocks of ", block_m,
                      " query rows in gridDim.y, over CUDA's limit of 65,535: Lq <= ", 65535 * block_m);
    const dim3 grid(params.B * params.H, static_cast<unsigned>(m_blocks));
    kernel<<<grid, NUM_WARPS * 32, smem, stream>>>(params);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int HEAD_DIM>
void launch_variant(const FlashParams& params, int64_t num_warps, bool q_in_registers, int64_t row_frags,
                    cudaStream_t stream) {
#define WB_LAUNCH_IF(W, QR, RF)                                                  \
    if (num_warps == W && q_in_registers == QR && row_frags == RF)               \
        return launch_flash_wmma<T, HEAD_DIM, W, QR, RF>(params, stream);
    WB_FOR_EACH_VARIANT(WB_LAUNCH_IF)
#undef WB_LAUNCH_IF
    TORCH_CHECK(false, "flash_wmma: no variant num_warps=", num_warps, " q_in_registers=", q_in_registers,
                " row_frags=", row_frags);
}

}  // namespace wb
// endregion

// region: torch_forward
// Returns [out (B, H, Lq, D) in q's dtype, lse (B, H, Lq) float32].
std::vector<torch::Tensor> flash_wmma_forward(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                              torch::Tensor key_keep, bool causal, int64_t causal_offset, double scale,
                                              int64_t num_warps, bool q_in_registers, int64_t row_frags) {
    TORCH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda(), "flash_wmma: q, k, v must be CUDA tensors");
    TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
                "flash_wmma: q, k, v must have one dtype");
    const bool is_half = q.scalar_type() == torch::kHalf;
    TORCH_CHECK(is_half || q.scalar_type() == torch::kBFloat16,
                "flash_wmma: dtype must be float16 or bfloat16, got ", q.scalar_type());
    TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "flash_wmma: q, k, v must be (B, H, L, D)");
    TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "flash_wmma: inputs must be contiguous");
    const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), D = q.size(3), Lk = k.size(2);
    TORCH_CHECK(D == 64 || D == 128, "flash_wmma: head dim must be 64 or 128, got ", D);
    TORCH_CHECK(k.size(0) == B && k.size(1) > 0 && H % k.size(1) == 0 && k.size(3) == D && v.sizes() == k.sizes(),
                "flash_wmma: k and v must be (B, Hk, Lk, D) with q's B and D, and Hk dividing H");
    const uint8_t* keep = wb::key_keep_pointer(key_keep, B, Lk, "flash_wmma");  // nullptr: no mask
    const c10::cuda::CUDAGuard guard(q.device());
    auto out = torch::empty_like(q);
    auto lse = torch::empty({B, H, Lq}, q.options().dtype(torch::kFloat32));

    wb::FlashParams params;
    params.q = q.data_ptr();
    params.k = k.data_ptr();
    params.v = v.data_ptr();
    params.out = out.data_ptr();
    params.lse = lse.data_ptr<float>();
    params.key_keep = keep;
    params.B = static_cast<int>(B);
    params.H = static_cast<int>(H);
    params.Lq = static_cast<int>(Lq);
    params.Lk = static_cast<int>(Lk);
    params.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
    params.kv_group = static_cast<int>(H / k.size(1));
    params.causal = causal ? 1 : 0;
    params.causal_offset = static_cast<int>(causal_offset);

    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    if (is_half) {
        if (D == 64) wb::launch_variant<__half, 64>(params, num_warps, q_in_registers, row_frags, stream);
        else wb::launch_variant<__half, 128>(params, num_warps, q_in_registers, row_frags, stream);
    } else {
        if (D == 64) wb::launch_variant<__nv_bfloat16, 64>(params, num_warps, q_in_registers, row_frags, stream);
        else wb::launch_variant<__nv_bfloat16, 128>(params, num_warps, q_in_registers, row_frags, stream);
    }
    return {out, lse};
}
// endregion
#endif
