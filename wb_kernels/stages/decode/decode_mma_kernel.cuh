// Split-KV decoding (lesson 07): the tensor-core kernel for MQA and large groups, decode_mma_kernel. A block
// holds a whole KV group's query heads as the M dimension of mma.sync, so each split's keys come from memory
// once whatever the group size. Marked in parts (// --- NAME), not regions: the lesson does not show it yet.
// Device code only (no torch), so that another kernel can include it; decode_host.cu includes it and holds the
// launches. Lesson 07 shows its regions (// region: NAME) with the file named in each cell.
#pragma once

#include "decode_params.cuh"
#include "decode_merge.cuh"

namespace wb {

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
            s_m[slice][row] = m_run[h] == -INFINITY ? kLowest : m_run[h];  // finite: no inf - inf below
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
        float top = kLowest;
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
        const float row_lse = poisoned ? nan : seen ? (top + log2f(total)) * 0.6931471805599453f : -INFINITY;
        const size_t row = ((size_t)split * p.B + b) * p.H + head0 + r;
        if (p.num_splits == 1) p.lse[row] = row_lse;  // one split: the answer
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

}  // namespace wb
