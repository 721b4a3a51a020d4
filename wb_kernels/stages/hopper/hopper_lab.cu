// Hopper's primitives, one small kernel each, before any attention uses them (rung "hopper", version v0).
//
// The one CUDA source of the rung's primitives lab. Used by:
//   - wb_kernels/stages/hopper/build.py: torch load_inline builds it on a Hopper GPU with
//     -gencode arch=compute_90a,code=sm_90a (wgmma exists only on that target); without a GPU nvcc compiles it for
//     sm_90a (-DWB_KERNEL_ONLY) and the compile report shows HGMMA (wgmma) and UTMALDG (the TMA load) in the SASS;
//   - wb_kernels/stages/hopper/lab.py: the Python launchers, each checked against torch / NumPy by
//     tests/test_hopper.py on a GPU, in a subprocess under a time limit (a wrong barrier hangs, it does not fail).
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
//
// Build options: -DWB_WATCHDOG_NS=<n> makes every barrier wait trap after n nanoseconds instead of spinning for ever
// (no printf: a printf in a kernel with wgmma makes ptxas serialize the wgmma, warning C7510, and the build treats
// ptxas warnings as errors).

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
// watchdog build (-DWB_WATCHDOG_NS) turns that hang into a trap, which the host sees as a launch failure.
__device__ __forceinline__ void mbarrier_wait(uint64_t* barrier, uint32_t parity) {
#if WB_WATCHDOG_NS > 0
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

constexpr int TILE_ROWS = 64;          // rows of the box the TMA lab copies
constexpr int TILE_ROW_BYTES = 128;    // 64 16-bit elements: the span of the 128-byte swizzle
constexpr int WARPGROUP = 128;         // threads

// region: tma_tile_kernel
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
#pragma unroll
    for (int i = 0; i < N / 2; ++i) d[i] = 0.0f;
    fence_accumulators(d);
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

}  // namespace wb

// Every GEMM variant the launcher can choose: X(N, K_STEPS, A_IN_REGISTERS, B_MN_MAJOR), each for fp16 and bf16.
#define WB_FOR_EACH_GEMM_VARIANT(X)                                                                               \
    X(64, 1, false, false) X(64, 4, false, false) X(128, 4, false, false) X(64, 1, true, false)                  \
    X(64, 4, true, false) X(128, 4, true, false) X(64, 4, false, true) X(128, 4, false, true)                   \
    X(64, 4, true, true) X(128, 4, true, true)

#ifdef WB_KERNEL_ONLY
#define WB_INSTANTIATE(T, N, KS, RS, MN) \
    template __global__ void wb::wgmma_gemm_kernel<T, N, KS, RS, MN>(const __grid_constant__ CUtensorMap, const __grid_constant__ CUtensorMap, float*);
#define WB_INSTANTIATE_BOTH(N, KS, RS, MN) WB_INSTANTIATE(__half, N, KS, RS, MN) WB_INSTANTIATE(__nv_bfloat16, N, KS, RS, MN)
WB_FOR_EACH_GEMM_VARIANT(WB_INSTANTIATE_BOTH)
#else
// region: tensor_map
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

namespace wb {

// cuTensorMapEncodeTiled is a driver function; the runtime hands out its address, so the extension needs no
// -lcuda. The 12000 asks for the signature as CUDA 12.0 defined it.
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiled tensor_map_encoder() {
    static const EncodeTiled encode = [] {
        void* function = nullptr;
        cudaDriverEntryPointQueryResult found;
        C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000,
                                                        cudaEnableDefault, &found));
        TORCH_CHECK(found == cudaDriverEntryPointSuccess && function != nullptr,
                    "hopper: the driver has no cuTensorMapEncodeTiled (needs a CUDA 12 driver or newer)");
        return reinterpret_cast<EncodeTiled>(function);
    }();
    return encode;
}

// A tensor map for a 2-D, row-major, 16-bit tensor x (rows, columns): boxes of box_rows x 64 elements (128-byte rows),
// written to shared memory with the 128-byte swizzle; what lies outside x arrives as zeros.
CUtensorMap tile_map_2d(const torch::Tensor& x, uint32_t box_rows) {
    TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "hopper: the tensor map wants a 2-D row-major tensor");
    TORCH_CHECK(x.scalar_type() == torch::kHalf || x.scalar_type() == torch::kBFloat16,
                "hopper: dtype must be float16 or bfloat16, got ", x.scalar_type());
    TORCH_CHECK((x.stride(0) * 2) % 16 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
                "hopper: the TMA needs 16-byte aligned rows (a row of a multiple of 8 elements)");
    CUtensorMap map;
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(x.size(1)), static_cast<cuuint64_t>(x.size(0))};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(x.stride(0) * 2)};  // bytes, every dim but the first
    const cuuint32_t box[2] = {TILE_ROW_BYTES / 2, box_rows};
    const cuuint32_t element_strides[2] = {1, 1};
    const CUresult result = tensor_map_encoder()(
        &map, x.scalar_type() == torch::kHalf ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        2, x.data_ptr(), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
        CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    TORCH_CHECK(result == CUDA_SUCCESS, "hopper: cuTensorMapEncodeTiled failed (CUresult ", static_cast<int>(result), ")");
    return map;
}

}  // namespace wb
// endregion

// region: torch_entry_points
// (a) The raw shared-memory bytes of one TMA box (64 x 64 elements from (row0, column0) of x), as x's dtype, flat.
torch::Tensor hopper_tma_tile(torch::Tensor x, int64_t row0, int64_t column0, int64_t expect_bytes) {
    TORCH_CHECK(x.is_cuda(), "hopper_tma_tile: x must be a CUDA tensor");
    const c10::cuda::CUDAGuard guard(x.device());
    const CUtensorMap map = wb::tile_map_2d(x, wb::TILE_ROWS);
    auto dump = torch::empty({wb::TILE_ROWS * wb::TILE_ROW_BYTES / 2}, x.options());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    wb::tma_tile_kernel<<<1, wb::WARPGROUP, 0, stream>>>(map, static_cast<int>(row0), static_cast<int>(column0),
                                                         static_cast<uint32_t>(expect_bytes),
                                                         reinterpret_cast<uint4*>(dump.data_ptr()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return dump;
}

// (b, c) C = A B in fp32 by one warpgroup: a (64, K); b (N, K) when K-major (b_mn_major false), (K, N) when MN-major.
torch::Tensor hopper_wgmma_gemm(torch::Tensor a, torch::Tensor b, bool a_in_registers, bool b_mn_major) {
    TORCH_CHECK(a.is_cuda() && b.is_cuda() && a.scalar_type() == b.scalar_type(),
                "hopper_wgmma_gemm: a and b must be CUDA tensors of one dtype");
    TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && a.dim() == 2 && b.dim() == 2, "hopper_wgmma_gemm: 2-D, contiguous");
    const int64_t K = a.size(1), N = b_mn_major ? b.size(1) : b.size(0);
    TORCH_CHECK(a.size(0) == 64 && K >= 8 && K <= 64 && K % 8 == 0 && (b_mn_major ? b.size(0) : b.size(1)) == K,
                "hopper_wgmma_gemm: a must be (64, K) with K in 8..64 a multiple of 8, b (N, K) or (K, N)");
    TORCH_CHECK(N == 64 || N == 128, "hopper_wgmma_gemm: N must be 64 or 128, got ", N);
    const c10::cuda::CUDAGuard guard(a.device());
    const CUtensorMap a_map = wb::tile_map_2d(a, 64);
    const CUtensorMap b_map = wb::tile_map_2d(b, b_mn_major ? 64 : static_cast<uint32_t>(N));
    auto c = torch::empty({64, N}, a.options().dtype(torch::kFloat32));
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    const int k_steps = (K <= 16 && N == 64 && !b_mn_major) ? 1 : 4;  // one k16 step, or four over a zero-filled 64
    const bool is_half = a.scalar_type() == torch::kHalf;
#define WB_LAUNCH_IF(N_, KS, RS, MN)                                                                              \
    if (N == N_ && k_steps == KS && a_in_registers == RS && b_mn_major == MN) {                                 \
        if (is_half) wb::wgmma_gemm_kernel<__half, N_, KS, RS, MN><<<1, wb::WARPGROUP, 0, stream>>>(a_map, b_map, c.data_ptr<float>()); \
        else wb::wgmma_gemm_kernel<__nv_bfloat16, N_, KS, RS, MN><<<1, wb::WARPGROUP, 0, stream>>>(a_map, b_map, c.data_ptr<float>()); \
        C10_CUDA_KERNEL_LAUNCH_CHECK();                                                                          \
        return c;                                                                                                \
    }
    WB_FOR_EACH_GEMM_VARIANT(WB_LAUNCH_IF)
#undef WB_LAUNCH_IF
    TORCH_CHECK(false, "hopper_wgmma_gemm: no variant N=", N, " K=", K, " a_in_registers=", a_in_registers,
                " b_mn_major=", b_mn_major);
    return c;
}
// endregion
#endif
