// Hopper's primitives, one small kernel each, before any attention uses them (rung "hopper", version v0): the
// primitives lab. Device code only, so that another kernel can include it (hopper_attention.cuh does);
// hopper_host.cu includes it and holds the torch entry points that launch its kernels (wb_kernels/stages/hopper/lab.py
// runs each, checked against torch / NumPy by tests/test_hopper.py on a GPU, in a subprocess under a time limit: a
// wrong barrier hangs, it does not fail).
//
// The pieces, each a few lines, each named after its PTX instruction (PTX ISA 8.x: "mbarrier",
// "cp.async.bulk.tensor", "Asynchronous Warpgroup Level Matrix Multiply-Accumulate (wgmma)"):
//   region mbarrier          mbarrier.init / arrive.expect_tx / arrive / try_wait.parity, and the watchdog
//   region tma               cp.async.bulk.tensor.2d: one tile from global to shared memory, completing on an mbarrier
//   region wgmma_descriptor  the 64-bit shared-memory matrix descriptor of a 128-byte-swizzled operand
//   region wgmma             wgmma.fence / mma_async (SS: A and B in shared memory; RS: A in registers) /
//                            commit_group / wait_group
//   region tma_tile_kernel   (a) one TMA tile, copied back byte for byte: the 128-byte swizzle as the copy engine
//                            writes it, compared with a NumPy model (swizzle.py of the mma rung)
//   region gemm_kernel       (b, c) C (64 x N, fp32) = A (64 x K) B (K x N), K <= 64, one warpgroup, B K-major
//                            or MN-major, A from shared memory (SS) or registers (RS)
//   region setmaxnreg        setmaxnreg.inc / .dec: warpgroups trade registers through the block's pool
//   region named_barrier     bar.sync / bar.arrive with a barrier index and a thread count
//   region register_split_kernel  (d) setmaxnreg alone: one warpgroup gives registers back, two use 240 each
//   region named_barrier_kernel   (e) two warpgroups taking turns through named barriers (v3's ping-pong)
//
// Build options: -DWB_WATCHDOG_NS=<n> makes every barrier wait trap after n nanoseconds instead of spinning for ever
// (no printf: a printf in a kernel with wgmma makes ptxas serialize the wgmma, a C7510/C7520 note, and build.py
// refuses a source whose wgmma ptxas serialized).
#pragma once

#include <cuda.h>  // CUtensorMap and its enums (types only; the encoder is looked up at run time)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#ifndef WB_WATCHDOG_NS
#define WB_WATCHDOG_NS 0  // 0: a barrier wait spins until the phase completes, however long that takes
#endif

namespace wb {

__device__ __forceinline__ uint32_t smem_address(const void* pointer) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// region: mbarrier
// An mbarrier is a 64-bit word in shared memory that counts arrivals and transaction bytes for its current phase.
// A phase completes when `count` threads have arrived AND every byte announced with expect_tx has landed; then the
// phase bit flips (0, 1, 0, ...) and the counts start over. Waiting means "until the phase with this parity is over".
__device__ __forceinline__ void mbarrier_init(uint64_t* barrier, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_address(barrier)), "r"(count) : "memory");
}

// Makes the initialised barrier visible to the copy engine (the async proxy) before any copy signals it.
__device__ __forceinline__ void fence_barrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One arrival that also announces `bytes` more transaction bytes for this phase (the producer's arrival).
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* barrier, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_address(barrier)), "r"(bytes)
                 : "memory");
}

// A plain arrival (a consumer saying "this slot is free again").
__device__ __forceinline__ void mbarrier_arrive(uint64_t* barrier) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_address(barrier)) : "memory");
}

// True once the phase of parity `parity` has completed; false after a bounded, hardware-chosen wait.
__device__ __forceinline__ bool mbarrier_try_wait(uint64_t* barrier, uint32_t parity) {
    uint32_t done;
    asm volatile(
        "{\n"
        ".reg .pred complete;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 complete, [%1], %2;\n"
        "selp.u32 %0, 1, 0, complete;\n"
        "}\n"
        : "=r"(done)
        : "r"(smem_address(barrier)), "r"(parity)
        : "memory");
    return done != 0;
}

__device__ __forceinline__ uint64_t global_nanoseconds() {
    uint64_t now;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(now));
    return now;
}

// The wait every kernel of the rung uses. A wrong parity or a wrong byte count never completes the phase: the
// watchdog build (-DWB_WATCHDOG_NS) turns that hang into a trap (a launch failure). The clock is read only after a
// failed first try: a wait that succeeds at once reads no %globaltimer (the timed kernels are the watchdog build).
__device__ __forceinline__ void mbarrier_wait(uint64_t* barrier, uint32_t parity) {
#if WB_WATCHDOG_NS > 0
    if (mbarrier_try_wait(barrier, parity)) return;
    const uint64_t start = global_nanoseconds();
    while (!mbarrier_try_wait(barrier, parity)) {
        if (global_nanoseconds() - start > static_cast<uint64_t>(WB_WATCHDOG_NS)) __trap();
    }
#else
    while (!mbarrier_try_wait(barrier, parity)) {
    }
#endif
}
// endregion

// region: tma
// The copy engine (TMA) moves one box of a tensor, described by a tensor map the host encoded, from global to shared
// memory and then signals `barrier` with the box's bytes (complete_tx). Coordinates are in elements, innermost
// first: (column, row). Elements outside the tensor arrive as zeros and still count as bytes.
__device__ __forceinline__ void tma_load_2d(void* destination, const CUtensorMap* map, int column, int row,
                                            uint64_t* barrier) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
        ::"r"(smem_address(destination)), "l"(reinterpret_cast<uint64_t>(map)), "r"(column), "r"(row),
        "r"(smem_address(barrier))
        : "memory");
}
// endregion

// region: wgmma_descriptor
// wgmma reads an operand in shared memory through a 64-bit descriptor (PTX ISA, "Matrix Descriptor Format"):
//   bits  0-13  start address >> 4
//   bits 16-29  leading-dimension byte offset >> 4 (LBO)
//   bits 32-45  stride-dimension byte offset >> 4 (SBO)
//   bits 62-63  swizzle mode: 1 = 128-byte swizzle
// The 128-byte swizzle's unit is 8 rows of 128 bytes (1024 bytes, aligned to 1024): chunk c (16 bytes) of row r
// sits at position c ^ (r % 8), exactly as the TMA writes a box with CU_TENSOR_MAP_SWIZZLE_128B.
//   K-major operand (rows along M or N, 64 16-bit elements of K per row): SBO = 1024, the step from one group of 8
//     rows to the next; LBO is not used (K never leaves the 128-byte row within one k16 step). The k-th 16-wide
//     slice starts 32 k bytes into the row: the hardware applies the XOR to the address it forms.
//   MN-major operand (rows along K, 64 elements of M or N per row): SBO = 1024, the step from 8 rows of K to the
//     next 8; LBO = the step from one 64-wide block of N to the next.
__device__ __forceinline__ uint64_t smem_descriptor(uint32_t address, uint32_t leading_bytes, uint32_t stride_bytes) {
    return static_cast<uint64_t>((address & 0x3FFFF) >> 4) |
           static_cast<uint64_t>((leading_bytes & 0x3FFFF) >> 4) << 16 |
           static_cast<uint64_t>((stride_bytes & 0x3FFFF) >> 4) << 32 | static_cast<uint64_t>(1) << 62;
}
// endregion

// region: wgmma
// A warpgroup (4 consecutive warps, the first one's index divisible by 4) computes D (64 x N, fp32) (+)= A (64 x 16)
// B (16 x N) with one wgmma.mma_async. It is asynchronous: the instruction returns at once, the accumulator registers
// belong to the tensor cores until wait_group says the group is done. The order, always:
//   wgmma_fence()                 registers written before (accumulators, A fragments) are ready for the tensor cores
//   wgmma_*(...) x k              issued back to back
//   wgmma_commit_group()          closes the group of the wgmmas issued since the last commit
//   wgmma_wait_group<n>()         waits until at most n groups are still in flight
// Accumulator layout (per warp w of the group: rows 16 w .. 16 w + 15, the layout of mma.m16n8k16's C per 8 columns):
//   d[4 j + 2 h + e] = D[16 w + lane / 4 + 8 h][8 j + 2 (lane % 4) + e]
// A fragment of the RS form (per warp, the layout of mma.m16n8k16's A): a[i] holds two 16-bit values,
//   A[16 w + lane / 4 + 8 (i % 2)][2 (lane % 4) + 8 (i / 2) + {0, 1}]
// scale-d (`accumulate`): 0 ignores D's old value (D = A B), 1 adds to it. TRANS_B: 0 = B K-major, 1 = MN-major.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit_group() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void wgmma_wait_group() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(PENDING) : "memory");
}

// Keeps the compiler from moving ordinary instructions that touch the accumulators across the asynchronous region
// (which would make ptxas serialize the wgmma, warning C7510).
template <int R>
__device__ __forceinline__ void fence_accumulators(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

template <int R>
__device__ __forceinline__ void zero_accumulators(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) d[i] = 0.0f;
    fence_accumulators(d);
}

// endregion

// region: wgmma_asm
#define WB_ACC32 "{" \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define WB_ACC32_OPERANDS \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define WB_ACC64 "{" \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define WB_ACC64_OPERANDS \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// SS: A and B both through descriptors. Operands after the accumulators: %R desc_a, %R+1 desc_b, %R+2 accumulate,
// %R+3 TRANS_B (R = number of accumulator registers). The two 1s are imm-scale-a/b (no negation), the 0 is
// imm-trans-a (A K-major).
#define WB_WGMMA_SS(SHAPE, TYPE, ACC, ACC_OPERANDS, I_DESC_A, I_DESC_B, I_ACCUMULATE, I_TRANS_B)               \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" I_ACCUMULATE ", 0;\n"                                   \
                 "wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE " " ACC ", %" I_DESC_A ", %"     \
                 I_DESC_B ", p, 1, 1, 0, %" I_TRANS_B ";\n}\n"                                                 \
                 : ACC_OPERANDS                                                                               \
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TRANS_B))
// RS: A from four registers per thread. Operands after the accumulators: four A registers, desc_b, accumulate,
// TRANS_B (the RS form has no imm-trans-a).
#define WB_WGMMA_RS(SHAPE, TYPE, ACC, ACC_OPERANDS, I_A0, I_A1, I_A2, I_A3, I_DESC_B, I_ACCUMULATE, I_TRANS_B)  \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" I_ACCUMULATE ", 0;\n"                                   \
                 "wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE " " ACC ", {%" I_A0 ", %" I_A1    \
                 ", %" I_A2 ", %" I_A3 "}, %" I_DESC_B ", p, 1, 1, %" I_TRANS_B ";\n}\n"                        \
                 : ACC_OPERANDS                                                                               \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate), "n"(TRANS_B))

// endregion

// region: wgmma_products
template <typename T> constexpr bool is_half = false;
template <> constexpr bool is_half<__half> = true;

// D (64 x N) (+)= A B, A and B in shared memory. N = 64 or 128 (32 or 64 fp32 registers per thread).
template <typename T, int TRANS_B, int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b, int accumulate) {
    static_assert(N == 64 || N == 128, "this lab instantiates wgmma for N = 64 and 128");
    if constexpr (N == 64 && is_half<T>) WB_WGMMA_SS("m64n64k16", "f16", WB_ACC32, WB_ACC32_OPERANDS, "32", "33", "34", "35");
    if constexpr (N == 64 && !is_half<T>) WB_WGMMA_SS("m64n64k16", "bf16", WB_ACC32, WB_ACC32_OPERANDS, "32", "33", "34", "35");
    if constexpr (N == 128 && is_half<T>) WB_WGMMA_SS("m64n128k16", "f16", WB_ACC64, WB_ACC64_OPERANDS, "64", "65", "66", "67");
    if constexpr (N == 128 && !is_half<T>) WB_WGMMA_SS("m64n128k16", "bf16", WB_ACC64, WB_ACC64_OPERANDS, "64", "65", "66", "67");
}

// D (64 x N) (+)= A B, A from registers (four 32-bit registers per thread: the warpgroup's 64 x 16 slice of A).
template <typename T, int TRANS_B, int N>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b, int accumulate) {
    static_assert(N == 64 || N == 128, "this lab instantiates wgmma for N = 64 and 128");
    if constexpr (N == 64 && is_half<T>) WB_WGMMA_RS("m64n64k16", "f16", WB_ACC32, WB_ACC32_OPERANDS, "32", "33", "34", "35", "36", "37", "38");
    if constexpr (N == 64 && !is_half<T>) WB_WGMMA_RS("m64n64k16", "bf16", WB_ACC32, WB_ACC32_OPERANDS, "32", "33", "34", "35", "36", "37", "38");
    if constexpr (N == 128 && is_half<T>) WB_WGMMA_RS("m64n128k16", "f16", WB_ACC64, WB_ACC64_OPERANDS, "64", "65", "66", "67", "68", "69", "70");
    if constexpr (N == 128 && !is_half<T>) WB_WGMMA_RS("m64n128k16", "bf16", WB_ACC64, WB_ACC64_OPERANDS, "64", "65", "66", "67", "68", "69", "70");
}
// endregion

// Byte offset of element (row, column) in a 128-byte-swizzled tile of 128-byte rows (64 16-bit elements): the
// XOR of swizzle.py's swizzled_offset, in bytes.
__device__ __forceinline__ uint32_t swizzled_byte_offset(int row, int column) {
    return row * 128 + ((((column >> 3) ^ (row & 7)) << 4) | ((column & 7) << 1));
}

// region: tma_tile_kernel
constexpr int TILE_ROWS = 64;          // rows of the box the TMA lab copies
constexpr int TILE_ROW_BYTES = 128;    // 64 16-bit elements: the span of the 128-byte swizzle
constexpr int WARPGROUP = 128;         // threads

// (a) One TMA box of TILE_ROWS x 64 16-bit elements, starting at (row0, column0) of a 2-D tensor, lands in shared
// memory swizzled; the block copies the raw bytes back, so the host sees the layout the copy engine wrote.
// expect_bytes is normally the box's size; a test passes a wrong one to see the watchdog catch the hang.
__global__ void __launch_bounds__(WARPGROUP) tma_tile_kernel(const __grid_constant__ CUtensorMap map, int row0,
                                                           int column0, uint32_t expect_bytes, uint4* __restrict__ dump) {
    __shared__ __align__(1024) uint4 tile[TILE_ROWS * TILE_ROW_BYTES / 16];  // 8 KB, 1024-aligned for the swizzle
    __shared__ __align__(8) uint64_t loaded;
    if (threadIdx.x == 0) {
        mbarrier_init(&loaded, 1);  // one arrival (thread 0's) + the bytes it announces
        fence_barrier_init();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        mbarrier_arrive_expect_tx(&loaded, expect_bytes);
        tma_load_2d(tile, &map, column0, row0, &loaded);
    }
    mbarrier_wait(&loaded, 0);  // the first phase has parity 0
    for (int i = threadIdx.x; i < TILE_ROWS * TILE_ROW_BYTES / 16; i += WARPGROUP) dump[i] = tile[i];
}
// endregion

// region: gemm_kernel
// (b, c) C (64 x N, fp32, row-major) = A (64 x K) B (K x N), K <= 16 K_STEPS <= 64, one warpgroup, one block.
// The TMA loads A (64 x K, row-major: K-major) as one 64 x 64 box and B as N x 64 (B_MN_MAJOR false: B given as
// its transpose, N x K row-major, K-major) or N / 64 boxes of 64 (K) x 64 (N) (B_MN_MAJOR: B as K x N row-major);
// columns or rows past K arrive as zeros, so a K below 64 costs no special case.
template <typename T, int N, int K_STEPS, bool A_IN_REGISTERS, bool B_MN_MAJOR>
__global__ void __launch_bounds__(WARPGROUP) wgmma_gemm_kernel(const __grid_constant__ CUtensorMap a_map,
                                                             const __grid_constant__ CUtensorMap b_map,
                                                             float* __restrict__ c) {
    constexpr int A_BYTES = 64 * TILE_ROW_BYTES;
    constexpr int B_BYTES = N * TILE_ROW_BYTES;  // N rows of 64 K, or N / 64 blocks of 64 K rows
    __shared__ __align__(1024) uint8_t a_tile[A_BYTES];
    __shared__ __align__(1024) uint8_t b_tile[B_BYTES];
    __shared__ __align__(8) uint64_t loaded;
    if (threadIdx.x == 0) {
        mbarrier_init(&loaded, 1);
        fence_barrier_init();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        mbarrier_arrive_expect_tx(&loaded, A_BYTES + B_BYTES);
        tma_load_2d(a_tile, &a_map, 0, 0, &loaded);
        if constexpr (B_MN_MAJOR) {
#pragma unroll
            for (int block = 0; block < N / 64; ++block) tma_load_2d(b_tile + block * 64 * TILE_ROW_BYTES, &b_map, 64 * block, 0, &loaded);
        } else {
            tma_load_2d(b_tile, &b_map, 0, 0, &loaded);
        }
    }
    mbarrier_wait(&loaded, 0);

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    uint32_t a_fragments[K_STEPS][4];  // the RS form's A, read from the swizzled tile before the first wgmma
    if constexpr (A_IN_REGISTERS) {
#pragma unroll
        for (int step = 0; step < K_STEPS; ++step) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int row = 16 * warp + lane / 4 + 8 * (i % 2), column = 16 * step + 2 * (lane % 4) + 8 * (i / 2);
                a_fragments[step][i] = *reinterpret_cast<const uint32_t*>(a_tile + swizzled_byte_offset(row, column));
            }
        }
    }
    float d[N / 2];
    zero_accumulators(d);
    wgmma_fence();
#pragma unroll
    for (int step = 0; step < K_STEPS; ++step) {
        // K-major B: the step's 16 K columns start 32 bytes into each row; MN-major B: its 16 K rows start
        // 16 x 128 bytes further, and the next 64 columns of N lie 64 x 128 bytes on (LBO)
        const uint64_t desc_b = B_MN_MAJOR ? smem_descriptor(smem_address(b_tile) + step * 16 * TILE_ROW_BYTES, 64 * TILE_ROW_BYTES, 1024)
                                           : smem_descriptor(smem_address(b_tile) + step * 32, 16, 1024);
        if constexpr (A_IN_REGISTERS) {
            wgmma_rs<T, B_MN_MAJOR ? 1 : 0, N>(d, a_fragments[step], desc_b, step > 0);
        } else {
            wgmma_ss<T, B_MN_MAJOR ? 1 : 0, N>(d, smem_descriptor(smem_address(a_tile) + step * 32, 16, 1024), desc_b, step > 0);
        }
    }
    wgmma_commit_group();
    wgmma_wait_group<0>();
    fence_accumulators(d);
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = 16 * warp + lane / 4 + 8 * h, column = 8 * j + 2 * (lane % 4);
            *reinterpret_cast<float2*>(c + row * N + column) = make_float2(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
        }
    }
}
// endregion

// region: setmaxnreg
// A warp-specialized block launches every warp with the same register count; `setmaxnreg` lets each warpgroup trade
// registers through the block's pool (PTX ISA, "setmaxnreg"): `.dec` gives registers back, `.inc` blocks until the
// pool has enough and takes them. All four warps of a warpgroup execute the same one (`.sync.aligned`), the count is
// a multiple of 8 in 24 .. 256, and a new register's content is undefined. ptxas compiles the code after each one
// for its count, so a branch that raised its limit can keep more values live than the launch allows.
// The split the rung uses: a block of 3 warpgroups at __launch_bounds__(384, 1) gets 65536 / 384 = 170 -> 168
// registers per thread (a multiple of 8); the producer keeps 24, the two consumers take 240:
// 24 + 2 x 240 = 504 = 3 x 168, so both consumers' .inc are served by what the producer's .dec returned.
constexpr int SPLIT_THREADS = 3 * WARPGROUP;
constexpr int REGISTERS_AT_LAUNCH = 168;
constexpr int PRODUCER_REGISTERS = 24;
constexpr int CONSUMER_REGISTERS = 240;
static_assert(PRODUCER_REGISTERS + 2 * CONSUMER_REGISTERS <= 3 * REGISTERS_AT_LAUNCH,
              "the consumers' registers must come from what the producer gives back");
static_assert(REGISTERS_AT_LAUNCH * SPLIT_THREADS <= 65536, "one block of 384 threads fills the register file");

template <int REGISTERS>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGISTERS));
}
template <int REGISTERS>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGISTERS));
}
// endregion

// region: named_barrier
// Sixteen hardware barriers per block; __syncthreads is barrier 0 over every thread. `bar.sync id, count` waits until
// `count` threads (a multiple of 32) have reached barrier `id`; `bar.arrive id, count` counts this thread without
// waiting. A producer of some event arrives, its consumer syncs: with count = 256 and one warpgroup on each side,
// the barrier's generation completes when both warpgroups are there, and only the syncing one waits. Arrivals and
// syncs order the memory accesses of the threads that take part (PTX ISA, "bar, barrier").
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(uint32_t id, uint32_t threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// endregion

// region: register_split_kernel
// (d) setmaxnreg alone: warpgroup 0 gives registers back and doubles its 128 inputs; warpgroups 1 and 2 take 240
// each and keep SPLIT_LIVE values per thread live at once (a max over all of them, then a sum that starts from the
// last: nothing can be dropped early), which would spill at the 168 the block launches with. The compile report
// shows it: no spills, registers above R168 in the SASS; the GPU check compares the outputs with NumPy.
constexpr int SPLIT_LIVE = 200;

__global__ void __launch_bounds__(SPLIT_THREADS, 1) register_split_kernel(const float* __restrict__ x,
                                                                          float* __restrict__ out) {
    const int warpgroup = threadIdx.x / WARPGROUP, t = threadIdx.x % WARPGROUP;
    if (warpgroup == 0) {
        setmaxnreg_dec<PRODUCER_REGISTERS>();
        out[threadIdx.x] = 2.0f * x[t];
    } else {
        setmaxnreg_inc<CONSUMER_REGISTERS>();
        const float* mine = x + (warpgroup - 1) * SPLIT_LIVE * WARPGROUP;  // (2, SPLIT_LIVE, 128)
        float v[SPLIT_LIVE];
#pragma unroll
        for (int i = 0; i < SPLIT_LIVE; ++i) v[i] = mine[i * WARPGROUP + t];
        float largest = v[0];
#pragma unroll
        for (int i = 1; i < SPLIT_LIVE; ++i) largest = fmaxf(largest, v[i]);
        float total = 0.0f;
#pragma unroll
        for (int i = SPLIT_LIVE - 1; i >= 0; --i) total = 0.5f * total + (v[i] - largest);
        out[threadIdx.x] = total;
    }
}
// endregion

// region: named_barrier_kernel
// (e) Named barriers as v3's two consumers use them: warpgroups 0 and 1 take turns, each waiting on its own barrier
// (1 + w) and arriving at the other's, 256 threads each. Warpgroup 0 goes first without waiting; warpgroup 1 skips
// its last arrival, so every generation has one arrival from each side and none is left open at the end. In its
// turn a warpgroup appends its index to a log; warpgroup 0 sleeps first, so turns that are not enforced show as a
// log that is not 0, 1, 0, 1, ...
constexpr int TURN_THREADS = 2 * WARPGROUP;
constexpr uint32_t FIRST_TURN_BARRIER = 1;  // barrier 0 is __syncthreads'

__global__ void __launch_bounds__(TURN_THREADS) named_barrier_kernel(int rounds, int* __restrict__ log) {
    __shared__ int written;
    const int warpgroup = threadIdx.x / WARPGROUP;
    if (threadIdx.x == 0) written = 0;
    __syncthreads();
    for (int round = 0; round < rounds; ++round) {
        if (warpgroup == 1 || round > 0) named_barrier_sync(FIRST_TURN_BARRIER + warpgroup, TURN_THREADS);
        if (warpgroup == 0) __nanosleep(2000);
        if (threadIdx.x % WARPGROUP == 0) {
            volatile int* count = &written;
            log[*count] = warpgroup;
            *count = *count + 1;
        }
        __syncwarp();
        if (warpgroup == 0 || round + 1 < rounds) named_barrier_arrive(FIRST_TURN_BARRIER + 1 - warpgroup, TURN_THREADS);
    }
}
// endregion

}  // namespace wb
