// FlashAttention-2 forward by hand on tensor cores: PTX mma.sync, ldmatrix, swizzled shared memory (lesson 06_mma).
//
// The one CUDA source of the "mma" stage. Used by:
//   - wb_kernels/stages/mma/build.py: torch load_inline builds it on a GPU machine; without a GPU it is compiled
//     with nvcc for sm_80 and sm_90 (-DWB_KERNEL_ONLY) to report registers, shared memory, spills and the
//     machine code of the key loop;
//   - wb_kernels/stages/mma/launcher.py: the "mma" stage of wb_kernels.attention();
//   - notebooks/06_mma.ipynb shows it region by region (// region: NAME).
//
// What changes from lesson 05's WMMA kernel: the register layout of every tensor-core operand is documented
// (PTX ISA, "Matrix Fragments for mma.m16n8k16"), so
//   - S = Q K^T stays in the accumulator registers: the online softmax works on them directly, a row's max and
//     sum taking two shuffles within the four lanes that hold the row;
//   - P is rounded to 16 bits in registers and is, register for register, the A operand of O += P V;
//   - O stays in registers until the end.
// No score or probability goes through shared memory. Shared memory holds only the Q, K and V tiles, unpadded and
// XOR-swizzled so that ldmatrix reads them without bank conflicts, with K and V double-buffered by cp.async.
//
// One thread block = NUM_WARPS warps of one (batch, head); each warp owns ROW_TILES x 16 query rows and walks
// the keys in tiles of BLOCK_N. Inputs: q (B, H, Lq, D), k and v (B, Hk, Lk, D) with Hk dividing H, contiguous,
// fp16 or bf16, D in {64, 128}.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace wb {

// region: flash_params
struct FlashParams {
    const void* q;            // (B, H, Lq, D)
    const void* k;            // (B, Hk, Lk, D)
    const void* v;            // (B, Hk, Lk, D)
    void* out;                // (B, H, Lq, D), same dtype as q
    float* lse;               // (B, H, Lq), natural-log log-sum-exp of the scaled scores
    const uint8_t* key_keep;  // (B, Lk), 1 = key takes part; nullptr = no padding mask
    int B, H, Lq, Lk, kv_group;  // kv_group = H / Hk: query head h reads K/V head h / kv_group (GQA)
    float scale_log2;         // scale * log2(e) > 0: softmax runs in base 2 (the launcher makes the scale positive)
    int causal, causal_offset;  // query i sees keys j <= i + causal_offset (0: top-left, Lk - Lq: bottom-right)
};
// endregion

// region: mma_and_ldmatrix
// One warp-wide tensor-core product D (16 x 8, fp32) += A (16 x 16) B (16 x 8), A and B fp16 or bf16.
// Each lane passes four 32-bit registers of A (eight 16-bit values), two of B and four fp32 of D; which element
// sits in which register is fixed by the PTX ISA (wb_kernels/stages/mma/fragments.py models it).
template <typename T> struct Mma;
template <> struct Mma<__half> {
    static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    // Two fp32 values rounded to 16 bits and packed in one register, the lower column in the lower half.
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __half2 pair = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&pair);
    }
};
template <> struct Mma<__nv_bfloat16> {
    static __device__ __forceinline__ void run(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&pair);
    }
};

// ldmatrix: the warp reads four 8 x 8 matrices of 16-bit values from shared memory; lanes 8i .. 8i+7 give the
// addresses of matrix i's eight rows (16 bytes each), and lane l receives, in register i, row l / 4, columns
// 2 (l % 4) and 2 (l % 4) + 1 of matrix i: exactly an mma operand's layout. ".trans" delivers each matrix
// transposed, which turns V's rows (keys) into the B operand's columns. volatile: shared memory changes
// between calls with the same address (the next tile), so two calls must never be merged.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}
// endregion

// region: swizzle
// A tile in shared memory: rows of HEAD_DIM 16-bit elements, no padding, each row cut into 16-byte chunks
// (8 elements). One ldmatrix phase reads one chunk from each of 8 consecutive rows. Unpadded, those 8 chunks
// sit at the same offset of rows 128 or 256 bytes apart: the same 4 banks, an 8-way conflict. Lesson 05 padded
// each row by 16 bytes; here chunk c of row r is stored at chunk position c ^ (r % 8) instead: the 8 rows of a
// phase land on 8 different chunk positions, all 32 banks once, and no byte is wasted.
template <int HEAD_DIM>
__device__ __forceinline__ int swizzled_offset(int row, int chunk) {  // in elements
    return row * HEAD_DIM + ((chunk ^ (row & 7)) << 3);
}
// endregion

// region: async_tile_copy
// cp.async copies 16 bytes global -> shared without passing through registers, so a tile can load while the
// warps compute on another. A row past the end is zero-filled (src-size 0): no garbage (or NaN) enters a product.
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, bool in_bounds) {
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
    const int src_bytes = in_bounds ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory"); }

// Rows [row0, row0 + ROWS) of a (L, HEAD_DIM) matrix into a swizzled shared tile; every thread of the block
// takes part, one 16-byte chunk per copy, consecutive threads on consecutive chunks (coalesced reads). A thread
// keeps one chunk column and steps down by ROWS_PER_PASS rows, a multiple of 8: its swizzled column never
// changes, and all its addresses are one register plus constant offsets.
template <typename T, int HEAD_DIM, int ROWS, int THREADS>
__device__ __forceinline__ void load_tile_async(T* smem, const T* gmem, int row0, int L) {
    constexpr int CHUNKS_PER_ROW = HEAD_DIM / 8;
    constexpr int ROWS_PER_PASS = THREADS / CHUNKS_PER_ROW;
    static_assert(ROWS_PER_PASS % 8 == 0 && ROWS % ROWS_PER_PASS == 0, "whole passes of whole swizzle periods");
    const int r0 = threadIdx.x / CHUNKS_PER_ROW;
    const int c = threadIdx.x % CHUNKS_PER_ROW;
    const T* src = gmem + static_cast<size_t>(row0 + r0) * HEAD_DIM + c * 8;
    T* dst = smem + swizzled_offset<HEAD_DIM>(r0, c);
#pragma unroll
    for (int i = 0; i < ROWS / ROWS_PER_PASS; ++i) {
        const bool in_bounds = row0 + r0 + i * ROWS_PER_PASS < L;
        cp_async_16(dst + i * ROWS_PER_PASS * HEAD_DIM, in_bounds ? src + i * ROWS_PER_PASS * HEAD_DIM : gmem,
                    in_bounds);
    }
}
// endregion

// region: online_softmax_fragments
// The online softmax on S's accumulator registers. Lane l holds, for each 16 x 8 tile n of a row tile, four
// scores: row g = l / 4 in s[n][0..1] and row g + 8 in s[n][2..3] (columns 2 (l % 4) and +1). A row is spread
// over the four lanes of a quad: each lane reduces its own values, then two shuffles (xor 1, xor 2) combine the
// quad. On return s holds the unnormalised probabilities p = 2^(scale_log2 * s - m) in fp32, alpha the factor
// 2^(m_old - m_new) by which each row's O must be rescaled. l_run stays a per-lane partial sum (every lane of a
// quad rescales its part by the same alpha), combined across the quad once, at the end.
template <int N_TILES>
__device__ __forceinline__ void online_softmax(float (&s)[N_TILES][4], float (&m_run)[2], float (&l_run)[2],
                                               float (&alpha)[2], float scale_log2) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // h = 0: row g (registers 0, 1); h = 1: row g + 8 (registers 2, 3)
        float row_max = m_run[h];  // in units of raw scores: scale_log2 > 0 keeps the order
#pragma unroll
        for (int n = 0; n < N_TILES; ++n) row_max = fmaxf(row_max, fmaxf(s[n][2 * h], s[n][2 * h + 1]));
        row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 1));
        row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, 2));
        // A row that has seen no key yet keeps max = -inf; subtracting 0 instead avoids inf - inf = NaN.
        const float max_scaled = row_max == -INFINITY ? 0.0f : row_max * scale_log2;
        alpha[h] = exp2f(m_run[h] * scale_log2 - max_scaled);
        float sum = 0.0f;
#pragma unroll
        for (int n = 0; n < N_TILES; ++n) {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                // one fused multiply-add and one exp2 per score: scale and log2(e) are folded into scale_log2
                const float p = exp2f(fmaf(s[n][2 * h + j], scale_log2, -max_scaled));
                s[n][2 * h + j] = p;
                sum += p;  // the sum uses fp32 p, as FlashAttention-2 does; P V uses the rounded p
            }
        }
        l_run[h] = l_run[h] * alpha[h] + sum;
        m_run[h] = row_max;
    }
}

// Masked scores become -inf, by select and not by adding a bias (NaN + -inf = NaN: a NaN score at a masked key
// must not leak into the row). Called only for tiles that need it: the ragged last tile, tiles crossing the
// causal diagonal, and every tile when a key padding mask is given. last_key: the last key the lane's row g may see
// under the causal mask (its query index + causal_offset); row g + 8 sees 8 more.
template <int N_TILES>
__device__ __forceinline__ void mask_scores(float (&s)[N_TILES][4], int key0, int last_key, const FlashParams& p,
                                            int batch) {
    const int t = threadIdx.x % 4;
#pragma unroll
    for (int n = 0; n < N_TILES; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int key = key0 + 8 * n + 2 * t + (i & 1);
            const int row_last_key = last_key + (i >= 2 ? 8 : 0);
            bool keep = key < p.Lk;
            if (keep && p.key_keep != nullptr) keep = p.key_keep[static_cast<size_t>(batch) * p.Lk + key] != 0;
            if (p.causal && key > row_last_key) keep = false;
            if (!keep) s[n][i] = -INFINITY;
        }
    }
}
// endregion

// region: layout
template <int HEAD_DIM, int NUM_WARPS, int ROW_TILES, int BLOCK_N>
struct Layout {
    static constexpr int WARP_ROWS = ROW_TILES * 16;                // query rows per warp
    static constexpr int BLOCK_M = NUM_WARPS * WARP_ROWS;           // query rows per block
    static constexpr int KV_TILE = BLOCK_N * HEAD_DIM;              // elements of one K (or V) tile
    // bytes: Q tile (also the output's staging area at the end) | 2 stages x (K, V) tiles
    static constexpr int Q_BYTES = BLOCK_M * HEAD_DIM * 2;
    static constexpr int KV_BYTES = 2 * 2 * KV_TILE * 2;
    static constexpr int SMEM_BYTES = Q_BYTES + KV_BYTES;
    static_assert(HEAD_DIM % 16 == 0 && BLOCK_N % 16 == 0, "mma.sync steps are 16 deep");
    static_assert(HEAD_DIM / 8 >= 8, "the swizzle permutes 8 chunks of 16 bytes: rows of at least 128 bytes");
};
// endregion

// region: non_finite_queries
// NaN and Inf, as PyTorch's SDPA has them, without a pass on the host. A query row holding a NaN or an Inf must give
// a NaN row if it sees any key. Rewriting such a row to all-NaN in the Q tile does it: every score it then makes
// with a key is NaN, its running sum becomes NaN (2^NaN = NaN), and the epilogue writes a NaN row; masked keys
// are replaced by -inf with a select, so a row that sees no key still gets 0. Keys holding NaN or Inf need nothing
// here: their scores are NaN, +Inf (both poison the sum: 2^(Inf - Inf) = NaN) or -Inf (the key drops out), as in
// SDPA. The tests are on the bits, which no fast-math flag can assume away.
__device__ __forceinline__ bool is_nan_bits(float x) { return (__float_as_uint(x) & 0x7fffffffu) > 0x7f800000u; }

template <typename T> struct Bits;  // a 16-bit type's exponent field (all ones: Inf or NaN) and a quiet NaN
template <> struct Bits<__half> { static constexpr uint32_t kExponent = 0x7c00u, kNaN = 0x7e00u; };
template <> struct Bits<__nv_bfloat16> { static constexpr uint32_t kExponent = 0x7f80u, kNaN = 0x7fc0u; };

template <typename T>
__device__ __forceinline__ bool any_non_finite(const uint4& chunk) {  // eight 16-bit values
    const uint32_t e = Bits<T>::kExponent;
    const uint32_t words[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
    bool bad = false;
#pragma unroll
    for (int i = 0; i < 4; ++i) bad |= (words[i] & e) == e || ((words[i] >> 16) & e) == e;
    return bad;
}

// Every thread of the block, after the Q tile has landed and before any of it is read into fragments.
template <typename T, int HEAD_DIM, int ROWS, int THREADS>
__device__ __forceinline__ void poison_non_finite_query_rows(T* q_tile) {
    constexpr int CHUNKS_PER_ROW = HEAD_DIM / 8;
    const uint32_t nan2 = Bits<T>::kNaN | (Bits<T>::kNaN << 16);
    for (int i = threadIdx.x; i < ROWS * CHUNKS_PER_ROW; i += THREADS) {
        const int row = i / CHUNKS_PER_ROW;
        const T* chunk = q_tile + swizzled_offset<HEAD_DIM>(row, i % CHUNKS_PER_ROW);
        if (!any_non_finite<T>(*reinterpret_cast<const uint4*>(chunk))) continue;
        // threads that find the same row write the same bits; one that reads a chunk already rewritten finds NaN
        for (int c = 0; c < CHUNKS_PER_ROW; ++c)
            *reinterpret_cast<uint4*>(q_tile + swizzled_offset<HEAD_DIM>(row, c)) = make_uint4(nan2, nan2, nan2, nan2);
    }
}
// endregion

// region: kernel_setup
template <typename T, int HEAD_DIM, int NUM_WARPS, int ROW_TILES, int BLOCK_N, bool Q_IN_REGISTERS>
__global__ void __launch_bounds__(NUM_WARPS * 32)
flash_mma_kernel(const FlashParams p) {
    using L = Layout<HEAD_DIM, NUM_WARPS, ROW_TILES, BLOCK_N>;
    constexpr int THREADS = NUM_WARPS * 32;
    constexpr int K_STEPS = HEAD_DIM / 16;  // 16-deep steps of S = Q K^T
    constexpr int N_TILES = BLOCK_N / 8;    // 16 x 8 accumulator tiles of S across a key tile
    constexpr int PV_STEPS = BLOCK_N / 16;  // 16-deep steps of O = P V
    constexpr int D_TILES = HEAD_DIM / 8;   // 16 x 8 accumulator tiles of O across the head dim

    extern __shared__ __align__(128) unsigned char smem[];
    T* q_tile = reinterpret_cast<T*>(smem);                  // [BLOCK_M][HEAD_DIM], swizzled
    T* kv_tiles = reinterpret_cast<T*>(smem + L::Q_BYTES);   // [stage][K, V][BLOCK_N][HEAD_DIM], swizzled
    const uint32_t q_base = static_cast<uint32_t>(__cvta_generic_to_shared(q_tile));
    const uint32_t kv_base = static_cast<uint32_t>(__cvta_generic_to_shared(kv_tiles));

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
    // Causal: query i sees keys j <= i + causal_offset, so this warp's row r sees keys up to warp_last_key + r.
    const int warp_last_key = m0 + warp * L::WARP_ROWS + p.causal_offset;
    const int local_row0 = warp * L::WARP_ROWS;  // this warp's first row in the Q tile

    auto k_stage = [&](int stage) { return kv_tiles + stage * 2 * L::KV_TILE; };
    auto k_address = [&](int stage) { return kv_base + stage * 2 * L::KV_TILE * 2; };  // bytes
    auto v_address = [&](int stage) { return kv_base + (stage * 2 + 1) * L::KV_TILE * 2; };
    // endregion

    // region: kernel_prologue
    // Prologue. cp.async groups in issue order: {Q, K0}, {V0}, then per tile {K(t+1)}, {V(t+1)}. Waiting until
    // at most one group is pending therefore means "K of this tile has landed" or "V of this tile has landed".
    load_tile_async<T, HEAD_DIM, L::BLOCK_M, THREADS>(q_tile, q, m0, p.Lq);
    if (num_tiles > 0) load_tile_async<T, HEAD_DIM, BLOCK_N, THREADS>(k_stage(0), k, 0, p.Lk);
    cp_async_commit();
    if (num_tiles > 0) load_tile_async<T, HEAD_DIM, BLOCK_N, THREADS>(k_stage(0) + L::KV_TILE, v, 0, p.Lk);
    cp_async_commit();

    // Lane l's ldmatrix row and the swizzle term: every tile's rows start at a multiple of 8, so row % 8 of the
    // row a lane points at is always lane % 8.
    const int lane_row = lane % 8;
    const int swz = lane % 8;
    auto tile_address = [&](uint32_t base, int row, int chunk) {  // bytes, row % 8 == lane % 8
        return base + (row * HEAD_DIM + ((chunk ^ swz) << 3)) * 2;
    };

    // Q's A fragments: matrix i = lane / 8 of an ldmatrix.x4 covers rows (i % 2) * 8 .. +7, columns (i / 2) * 8.
    constexpr int Q_KEPT = Q_IN_REGISTERS ? K_STEPS : 1;
    uint32_t q_frag[ROW_TILES][Q_KEPT][4];
    auto load_q = [&](uint32_t (&frag)[4], int row_tile, int k_step) {
        const int row = local_row0 + row_tile * 16 + (lane / 8 % 2) * 8 + lane_row;
        ldmatrix_x4(frag, tile_address(q_base, row, 2 * k_step + lane / 16));
    };
    if constexpr (Q_IN_REGISTERS) {
        cp_async_wait<1>();
        __syncthreads();
        poison_non_finite_query_rows<T, HEAD_DIM, L::BLOCK_M, THREADS>(q_tile);
        __syncthreads();
#pragma unroll
        for (int r = 0; r < ROW_TILES; ++r)
#pragma unroll
            for (int ks = 0; ks < K_STEPS; ++ks) load_q(q_frag[r][ks], r, ks);
    }

    float o[ROW_TILES][D_TILES][4];
    float m_run[ROW_TILES][2], l_run[ROW_TILES][2];
#pragma unroll
    for (int r = 0; r < ROW_TILES; ++r) {
#pragma unroll
        for (int d = 0; d < D_TILES; ++d) o[r][d][0] = o[r][d][1] = o[r][d][2] = o[r][d][3] = 0.0f;
        m_run[r][0] = m_run[r][1] = -INFINITY;
        l_run[r][0] = l_run[r][1] = 0.0f;
    }
    // endregion

    // region: kernel_loop_scores
    for (int tile = 0; tile < num_tiles; ++tile) {
        const int stage = tile & 1;
        const int key0 = tile * BLOCK_N;
        cp_async_wait<1>();  // K of this tile has landed (V may still be in flight)
        __syncthreads();     // ... for every thread's copies; and everyone is done with S of the previous tile
        if (!Q_IN_REGISTERS && tile == 0) {  // Q landed with K0: rewrite its non-finite rows before the first read
            poison_non_finite_query_rows<T, HEAD_DIM, L::BLOCK_M, THREADS>(q_tile);
            __syncthreads();
        }
        if (tile + 1 < num_tiles)
            load_tile_async<T, HEAD_DIM, BLOCK_N, THREADS>(k_stage(stage ^ 1), k, key0 + BLOCK_N, p.Lk);
        cp_async_commit();  // (an empty group at the last tile keeps the counting uniform)

        // Causal: a warp whose rows all see only keys before this tile has nothing to add (it still takes part in
        // the syncs).
        const bool active = !p.causal || key0 <= warp_last_key + L::WARP_ROWS - 1;
        uint32_t p_frag[ROW_TILES][PV_STEPS][4];  // P, 16-bit, as A operands of O += P V
        if (active) {
            // S = Q K^T: BLOCK_N keys x WARP_ROWS rows, in registers
            float s[ROW_TILES][N_TILES][4];
#pragma unroll
            for (int r = 0; r < ROW_TILES; ++r)
#pragma unroll
                for (int n = 0; n < N_TILES; ++n) s[r][n][0] = s[r][n][1] = s[r][n][2] = s[r][n][3] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < K_STEPS; ++ks) {
                if constexpr (!Q_IN_REGISTERS) {
#pragma unroll
                    for (int r = 0; r < ROW_TILES; ++r) load_q(q_frag[r][0], r, ks);
                }
#pragma unroll
                for (int np = 0; np < N_TILES / 2; ++np) {
                    // B operands of two 16 x 8 tiles: matrix i covers keys 16 np + (i / 2) * 8 .., chunk 2 ks + i % 2
                    uint32_t kb[4];
                    ldmatrix_x4(kb, tile_address(k_address(stage), 16 * np + (lane / 16) * 8 + lane_row,
                                                 2 * ks + lane / 8 % 2));
#pragma unroll
                    for (int r = 0; r < ROW_TILES; ++r) {
                        const uint32_t(&a)[4] = q_frag[r][Q_IN_REGISTERS ? ks : 0];
                        Mma<T>::run(s[r][2 * np], a, kb[0], kb[1]);
                        Mma<T>::run(s[r][2 * np + 1], a, kb[2], kb[3]);
                    }
                }
            }

            // endregion

            // region: kernel_loop_softmax
            // Masks only where a tile needs them; everywhere else the softmax runs on the raw scores.
            const bool needs_mask = p.key_keep != nullptr || key0 + BLOCK_N > p.Lk ||
                                    (p.causal && key0 + BLOCK_N - 1 > warp_last_key);
#pragma unroll
            for (int r = 0; r < ROW_TILES; ++r) {
                if (needs_mask) mask_scores(s[r], key0, warp_last_key + r * 16 + lane / 4, p, batch);
                float alpha[2];
                online_softmax(s[r], m_run[r], l_run[r], alpha, p.scale_log2);
#pragma unroll
                for (int d = 0; d < D_TILES; ++d) {
                    o[r][d][0] *= alpha[0], o[r][d][1] *= alpha[0];
                    o[r][d][2] *= alpha[1], o[r][d][3] *= alpha[1];
                }
                // The C fragments of S tiles 2 kk and 2 kk + 1 are the A fragment of P's 16 x 16 tile kk.
#pragma unroll
                for (int kk = 0; kk < PV_STEPS; ++kk) {
                    p_frag[r][kk][0] = Mma<T>::pack(s[r][2 * kk][0], s[r][2 * kk][1]);
                    p_frag[r][kk][1] = Mma<T>::pack(s[r][2 * kk][2], s[r][2 * kk][3]);
                    p_frag[r][kk][2] = Mma<T>::pack(s[r][2 * kk + 1][0], s[r][2 * kk + 1][1]);
                    p_frag[r][kk][3] = Mma<T>::pack(s[r][2 * kk + 1][2], s[r][2 * kk + 1][3]);
                }
            }
        }
        // endregion

        // region: kernel_loop_pv
        cp_async_wait<1>();  // V of this tile has landed (the next K may still be in flight)
        __syncthreads();     // ... for every thread's copies; and everyone is done with V of the previous tile
        if (tile + 1 < num_tiles)
            load_tile_async<T, HEAD_DIM, BLOCK_N, THREADS>(k_stage(stage ^ 1) + L::KV_TILE, v, key0 + BLOCK_N, p.Lk);
        cp_async_commit();

        if (active) {
            // O += P V; V's B operands by ldmatrix.trans: matrix i covers keys 16 kk + (i % 2) * 8 .., chunk 2 dp + i / 2
#pragma unroll
            for (int kk = 0; kk < PV_STEPS; ++kk) {
#pragma unroll
                for (int dp = 0; dp < D_TILES / 2; ++dp) {
                    uint32_t vb[4];
                    ldmatrix_x4_trans(vb, tile_address(v_address(stage), 16 * kk + (lane / 8 % 2) * 8 + lane_row,
                                                       2 * dp + lane / 16));
#pragma unroll
                    for (int r = 0; r < ROW_TILES; ++r) {
                        Mma<T>::run(o[r][2 * dp], p_frag[r][kk], vb[0], vb[1]);
                        Mma<T>::run(o[r][2 * dp + 1], p_frag[r][kk], vb[2], vb[3]);
                    }
                }
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();  // with no key tile at all (no row of the block sees a key), copies of Q may still be landing
    // endregion

    // region: kernel_epilogue
    // Epilogue: combine each row's partial sums across its quad, O /= l, LSE = ln(2) * (m * scale_log2 + log2 l);
    // rows that saw no key get 0 and -inf. O goes through this warp's rows of the Q tile (its own rows only, so
    // a warp-level sync suffices) and leaves in 16-byte stores, consecutive lanes on consecutive bytes.
    T* out = static_cast<T*>(p.out) + static_cast<size_t>(bh) * p.Lq * HEAD_DIM;
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int r = 0; r < ROW_TILES; ++r) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float l = l_run[r][h];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const bool row_has_keys = l > 0.0f;
            const bool poisoned = is_nan_bits(l);  // a NaN or +Inf score, or a non-finite query (see above)
            const float inv_l = poisoned ? __int_as_float(0x7fc00000) : row_has_keys ? 1.0f / l : 0.0f;
            const int local_row = local_row0 + r * 16 + g + 8 * h;
            const int query = m0 + local_row;
            if (t == 0 && query < p.Lq)
                p.lse[static_cast<size_t>(bh) * p.Lq + query] =
                    poisoned       ? __int_as_float(0x7fc00000)
                    : row_has_keys ? (m_run[r][h] * p.scale_log2 + __log2f(l)) * 0.69314718055994531f
                                   : -INFINITY;
#pragma unroll
            for (int d = 0; d < D_TILES; ++d) {
                const uint32_t pair = Mma<T>::pack(o[r][d][2 * h] * inv_l, o[r][d][2 * h + 1] * inv_l);
                *reinterpret_cast<uint32_t*>(q_tile + swizzled_offset<HEAD_DIM>(local_row, d) + 2 * t) = pair;
            }
        }
    }
    __syncwarp();
    constexpr int CHUNKS_PER_ROW = HEAD_DIM / 8;
#pragma unroll
    for (int i = lane; i < L::WARP_ROWS * CHUNKS_PER_ROW; i += 32) {
        const int local_row = local_row0 + i / CHUNKS_PER_ROW;
        const int c = i % CHUNKS_PER_ROW;
        if (m0 + local_row < p.Lq)
            *reinterpret_cast<uint4*>(out + static_cast<size_t>(m0 + local_row) * HEAD_DIM + c * 8) =
                *reinterpret_cast<const uint4*>(q_tile + swizzled_offset<HEAD_DIM>(local_row, c));
    }
}
// endregion

// region: variants
template <int HEAD_DIM, int NUM_WARPS, int ROW_TILES, int BLOCK_N>
constexpr int smem_bytes() { return Layout<HEAD_DIM, NUM_WARPS, ROW_TILES, BLOCK_N>::SMEM_BYTES; }

// Every launch variant (head dim, warps, 16-row tiles per warp, keys per tile, Q in registers);
// wb_kernels/stages/mma/build.py lists the same. X is a macro taking the five.
#define WB_FOR_EACH_MMA_VARIANT(X)                                                                       \
    X(64, 4, 1, 64, true) X(64, 4, 2, 64, true) X(64, 4, 1, 128, true) X(64, 4, 2, 128, false)              \
    X(64, 8, 1, 128, true)                                                                                  \
    X(128, 4, 1, 64, true) X(128, 4, 2, 64, false) X(128, 8, 1, 64, true) X(128, 4, 1, 128, true)
// endregion

}  // namespace wb

#ifdef WB_KERNEL_ONLY
// Without torch (the compile check): instantiate every variant the launcher can choose.
#define WB_INSTANTIATE(T, D, W, RT, BN, QR) \
    template __global__ void wb::flash_mma_kernel<T, D, W, RT, BN, QR>(const wb::FlashParams);
#define WB_INSTANTIATE_BOTH(D, W, RT, BN, QR) \
    WB_INSTANTIATE(__half, D, W, RT, BN, QR) WB_INSTANTIATE(__nv_bfloat16, D, W, RT, BN, QR)
WB_FOR_EACH_MMA_VARIANT(WB_INSTANTIATE_BOTH)
#else
// region: torch_launch_variant
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "../host_checks.cuh"

namespace wb {

template <typename T, int HEAD_DIM, int NUM_WARPS, int ROW_TILES, int BLOCK_N, bool Q_IN_REGISTERS>
void launch_flash_mma(const FlashParams& params, cudaStream_t stream) {
    constexpr int smem = smem_bytes<HEAD_DIM, NUM_WARPS, ROW_TILES, BLOCK_N>();
    auto kernel = flash_mma_kernel<T, HEAD_DIM, NUM_WARPS, ROW_TILES, BLOCK_N, Q_IN_REGISTERS>;
    if (smem > 48 * 1024) {  // above 48 KB a kernel must opt in to dynamic shared memory
        C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    }
    constexpr int block_m = NUM_WARPS * ROW_TILES * 16;
    // (batch, head) in x, which allows 2^31 - 1 blocks; the query blocks in y, which allows 65,535
    const int64_t m_blocks = (static_cast<int64_t>(params.Lq) + block_m - 1) / block_m;
    TORCH_CHECK_VALUE(m_blocks <= 65535, "flash_mma: Lq = ", params.Lq, " needs ", m_blocks, " blocks of ", block_m,
                      " query rows in gridDim.y, over CUDA's limit of 65,535: Lq <= ", 65535 * block_m);
    const dim3 grid(params.B * params.H, static_cast<unsigned>(m_blocks));
    kernel<<<grid, NUM_WARPS * 32, smem, stream>>>(params);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void launch_variant(const FlashParams& params, int64_t head_dim, int64_t num_warps, int64_t row_tiles,
                    int64_t block_n, bool q_in_registers, cudaStream_t stream) {
#define WB_LAUNCH_IF(D, W, RT, BN, QR)                                                                   \
    if (head_dim == D && num_warps == W && row_tiles == RT && block_n == BN && q_in_registers == QR)     \
        return launch_flash_mma<T, D, W, RT, BN, QR>(params, stream);
    WB_FOR_EACH_MMA_VARIANT(WB_LAUNCH_IF)
#undef WB_LAUNCH_IF
    TORCH_CHECK(false, "flash_mma: no variant head_dim=", head_dim, " num_warps=", num_warps, " row_tiles=",
                row_tiles, " block_n=", block_n, " q_in_registers=", q_in_registers);
}

}  // namespace wb
// endregion

// region: torch_entry_point
// Returns [out (B, H, Lq, D) in q's dtype, lse (B, H, Lq) float32].
std::vector<torch::Tensor> flash_mma_forward(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                             torch::Tensor key_keep, bool causal, int64_t causal_offset, double scale,
                                             int64_t num_warps, int64_t row_tiles, int64_t block_n,
                                             bool q_in_registers) {
    TORCH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda(), "flash_mma: q, k, v must be CUDA tensors");
    TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
                "flash_mma: q, k, v must have one dtype");
    const bool is_half = q.scalar_type() == torch::kHalf;
    TORCH_CHECK(is_half || q.scalar_type() == torch::kBFloat16,
                "flash_mma: dtype must be float16 or bfloat16, got ", q.scalar_type());
    TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "flash_mma: q, k, v must be (B, H, L, D)");
    TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "flash_mma: inputs must be contiguous");
    const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), D = q.size(3), Lk = k.size(2);
    TORCH_CHECK(D == 64 || D == 128, "flash_mma: head dim must be 64 or 128, got ", D);
    TORCH_CHECK(k.size(0) == B && k.size(1) > 0 && H % k.size(1) == 0 && k.size(3) == D && v.sizes() == k.sizes(),
                "flash_mma: k and v must be (B, Hk, Lk, D) with q's B and D, and Hk dividing H");
    TORCH_CHECK(scale > 0, "flash_mma: the launcher passes a positive scale (got ", scale, ")");
    const uint8_t* keep = wb::key_keep_pointer(key_keep, B, Lk, "flash_mma");  // nullptr: no mask
    const c10::cuda::CUDAGuard guard(q.device());
    auto out = torch::empty_like(q);
    auto lse = torch::empty({B, H, Lq}, q.options().dtype(torch::kFloat32));
    if (out.numel() == 0) return {out, lse};

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
    if (is_half) wb::launch_variant<__half>(params, D, num_warps, row_tiles, block_n, q_in_registers, stream);
    else wb::launch_variant<__nv_bfloat16>(params, D, num_warps, row_tiles, block_n, q_in_registers, stream);
    return {out, lse};
}
// endregion
#endif
