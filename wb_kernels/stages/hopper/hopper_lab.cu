// Hopper's primitives, one small kernel each, before any attention uses them (rung "hopper", version v0).
//
// The one CUDA source of the rung so far (the primitives lab, v1, v2 and v3). Used by:
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
//   region setmaxnreg        setmaxnreg.inc / .dec: warpgroups trade registers through the block's pool
//   region named_barrier     bar.sync / bar.arrive with a barrier index and a thread count
//   region register_split_kernel  (d) setmaxnreg alone: one warpgroup gives registers back, two use 240 each
//   region named_barrier_kernel   (e) two warpgroups taking turns through named barriers (v3's ping-pong)
//   region flash_tile_steps  what every attention version does per key tile: the tile count, the mask decision, S by
//                            SS wgmma, the online softmax, P packed as the RS operand, O += P V, the epilogue
//   region flash_v1_kernel   v1 (the stage at D = 64): one warpgroup per 64 query rows, K/V tiles by TMA in a 2-slot
//                            ring (lab.flash_v1; gpu_checks "attention")
//   region flash_ws_*        v2, v3 and v4 (v4: the stage at D = 128): a producer warpgroup (TMA into a full/empty
//                            ring) and two consumer warpgroups of 64 rows, registers split by setmaxnreg; v3's
//                            consumers take turns on the tensor cores through named barriers, v4 also runs each
//                            tile's softmax under its own P V (lab.flash_v2 / v3 / v4; gpu_checks "v2", "v3", "v4")
//
// Build options: -DWB_WATCHDOG_NS=<n> makes every barrier wait trap after n nanoseconds instead of spinning for ever
// (no printf: a printf in a kernel with wgmma makes ptxas serialize the wgmma, a C7510/C7520 note, and build.py
// refuses a source whose wgmma ptxas serialized).

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
// the last row's diagonal. In v2 and v3 the producer and both consumers call it with the block's m0: they must agree.
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
// v2 and v3: warp specialization. A block of 3 warpgroups owns 128 query rows of one (batch, head):
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
#define WB_INSTANTIATE_V1(T, D)                                                                                     \
    template __global__ void wb::flash_v1_kernel<T, D>(const __grid_constant__ CUtensorMap,                       \
                                                       const __grid_constant__ CUtensorMap,                       \
                                                       const __grid_constant__ CUtensorMap, const wb::FlashParams);
WB_INSTANTIATE_V1(__half, 64) WB_INSTANTIATE_V1(__half, 128) WB_INSTANTIATE_V1(__nv_bfloat16, 64)
WB_INSTANTIATE_V1(__nv_bfloat16, 128)
#define WB_INSTANTIATE_WS(T, D, VERSION)                                                                            \
    template __global__ void wb::flash_ws_kernel<T, D, VERSION>(const __grid_constant__ CUtensorMap,              \
                                                                const __grid_constant__ CUtensorMap,              \
                                                                const __grid_constant__ CUtensorMap, const wb::FlashParams);
#define WB_INSTANTIATE_WS_ALL(VERSION)                                                                              \
    WB_INSTANTIATE_WS(__half, 64, VERSION) WB_INSTANTIATE_WS(__half, 128, VERSION)                                 \
    WB_INSTANTIATE_WS(__nv_bfloat16, 64, VERSION) WB_INSTANTIATE_WS(__nv_bfloat16, 128, VERSION)
WB_INSTANTIATE_WS_ALL(2) WB_INSTANTIATE_WS_ALL(3) WB_INSTANTIATE_WS_ALL(4)
#else
// region: tensor_map
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <limits>

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
// (d) setmaxnreg: x (2, SPLIT_LIVE, 128) float32, the two consumers' values (warpgroup 0 doubles x's first 128);
// returns the 384 outputs, one per thread.
torch::Tensor hopper_register_split(torch::Tensor x) {
    TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kFloat32 && x.is_contiguous() &&
                x.numel() == 2 * wb::SPLIT_LIVE * wb::WARPGROUP,
                "hopper_register_split: x must be a contiguous CUDA float32 tensor of 2 x ", wb::SPLIT_LIVE,
                " x 128 elements");
    const c10::cuda::CUDAGuard guard(x.device());
    auto out = torch::empty({wb::SPLIT_THREADS}, x.options());
    wb::register_split_kernel<<<1, wb::SPLIT_THREADS, 0, c10::cuda::getCurrentCUDAStream()>>>(
        x.data_ptr<float>(), out.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return out;
}

// (e) Named barriers: the order in which two warpgroups took `rounds` turns each (int32, 2 x rounds entries).
torch::Tensor hopper_named_barrier_turns(int64_t rounds, torch::Tensor device_like) {
    TORCH_CHECK(device_like.is_cuda(), "hopper_named_barrier_turns: device_like must be a CUDA tensor");
    TORCH_CHECK(rounds > 0 && rounds <= 1024, "hopper_named_barrier_turns: rounds must be in 1..1024");
    const c10::cuda::CUDAGuard guard(device_like.device());
    auto log = torch::full({2 * rounds}, -1, device_like.options().dtype(torch::kInt32));
    wb::named_barrier_kernel<<<1, wb::TURN_THREADS, 0, c10::cuda::getCurrentCUDAStream()>>>(
        static_cast<int>(rounds), log.data_ptr<int>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return log;
}
// endregion

// region: flash_entry_point
namespace wb {
// A rank-3 tensor map over x (B, Hx, L, D), contiguous, viewed as (B Hx, L, D): boxes of box_rows rows x 64 elements
// of one head, the 128-byte swizzle, rows past L zero-filled (and counted in the barrier's bytes).
CUtensorMap head_map_3d(const torch::Tensor& x, uint32_t box_rows) {
    const int64_t D = x.size(3), L = x.size(2), heads = x.size(0) * x.size(1);
    CUtensorMap map;
    const cuuint64_t dims[3] = {static_cast<cuuint64_t>(D), static_cast<cuuint64_t>(L), static_cast<cuuint64_t>(heads)};
    const cuuint64_t strides[2] = {static_cast<cuuint64_t>(D * 2), static_cast<cuuint64_t>(L * D * 2)};
    const cuuint32_t box[3] = {64, box_rows, 1};
    const cuuint32_t element_strides[3] = {1, 1, 1};
    const CUresult result = tensor_map_encoder()(
        &map, x.scalar_type() == torch::kHalf ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        3, x.data_ptr(), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
        CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    TORCH_CHECK(result == CUDA_SUCCESS, "hopper: cuTensorMapEncodeTiled failed (CUresult ", static_cast<int>(result), ")");
    return map;
}

template <typename T, int HEAD_DIM>
void launch_flash_v1(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const FlashParams& params,
                     cudaStream_t stream) {
    constexpr int smem = v1_smem_bytes<HEAD_DIM>();
    auto kernel = flash_v1_kernel<T, HEAD_DIM>;
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const dim3 grid((params.Lq + V1_BLOCK_M - 1) / V1_BLOCK_M, params.B * params.H);
    kernel<<<grid, WARPGROUP, smem, stream>>>(head_map_3d(q, V1_BLOCK_M), head_map_3d(k, V1_BLOCK_N),
                                              head_map_3d(v, V1_BLOCK_N), params);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// v2, v3 and v4 (VERSION): 384 threads, 128 query rows per block, Q and K/V boxes of 128 rows
template <typename T, int HEAD_DIM, int VERSION>
void launch_flash_ws(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const FlashParams& params,
                     cudaStream_t stream) {
    constexpr int smem = ws_smem_bytes<HEAD_DIM>();
    auto kernel = flash_ws_kernel<T, HEAD_DIM, VERSION>;
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const dim3 grid((params.Lq + WS_BLOCK_M - 1) / WS_BLOCK_M, params.B * params.H);
    kernel<<<grid, WS_THREADS, smem, stream>>>(head_map_3d(q, WS_BLOCK_M), head_map_3d(k, WS_BLOCK_N),
                                               head_map_3d(v, WS_BLOCK_N), params);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int HEAD_DIM>
void launch_flash(int version, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                  const FlashParams& params, cudaStream_t stream) {
    if (version == 1) launch_flash_v1<T, HEAD_DIM>(q, k, v, params, stream);
    else if (version == 2) launch_flash_ws<T, HEAD_DIM, 2>(q, k, v, params, stream);
    else if (version == 3) launch_flash_ws<T, HEAD_DIM, 3>(q, k, v, params, stream);
    else launch_flash_ws<T, HEAD_DIM, 4>(q, k, v, params, stream);
}
}  // namespace wb

// endregion

// region: flash_torch_entry
// Returns [out (B, H, Lq, D) in q's dtype, lse (B, H, Lq) float32]. version 1, 2, 3 or 4 (work in progress, not a
// registered stage).
std::vector<torch::Tensor> hopper_flash_forward(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                                torch::Tensor key_keep, bool causal, int64_t causal_offset,
                                                double scale, int64_t version) {
    TORCH_CHECK(version >= 1 && version <= 4, "hopper_flash: version must be 1, 2, 3 or 4, got ", version);
    TORCH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda(), "hopper_flash: q, k, v must be CUDA tensors");
    TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                (q.scalar_type() == torch::kHalf || q.scalar_type() == torch::kBFloat16),
                "hopper_flash: q, k, v must be all float16 or all bfloat16");
    TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.is_contiguous() && k.is_contiguous() &&
                v.is_contiguous(), "hopper_flash: q, k, v must be contiguous (B, H, L, D)");
    const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), D = q.size(3), Lk = k.size(2);
    TORCH_CHECK(D == 64 || D == 128, "hopper_flash: head dim must be 64 or 128, got ", D);
    TORCH_CHECK(k.size(0) == B && k.size(1) > 0 && H % k.size(1) == 0 && k.size(3) == D && v.sizes() == k.sizes(),
                "hopper_flash: k and v must be (B, Hk, Lk, D) with q's B and D, and Hk dividing H");
    TORCH_CHECK(scale > 0, "hopper_flash: the launcher passes a positive scale (got ", scale, ")");
    TORCH_CHECK(B * H <= 65535, "hopper_flash: B * H = ", B * H, " is over gridDim.y's 65,535");
    const bool has_mask = key_keep.numel() > 0;
    if (has_mask) {
        TORCH_CHECK(key_keep.is_cuda() && key_keep.scalar_type() == torch::kUInt8 && key_keep.is_contiguous() &&
                    key_keep.dim() == 2 && key_keep.size(0) == B && key_keep.size(1) == Lk,
                    "hopper_flash: key_keep must be a contiguous CUDA uint8 tensor (B, Lk)");
    }
    const c10::cuda::CUDAGuard guard(q.device());
    auto out = torch::empty_like(q);
    auto lse = torch::empty({B, H, Lq}, q.options().dtype(torch::kFloat32));
    if (out.numel() == 0) return {out, lse};
    if (Lk == 0) {  // no key at all: a tensor map cannot have an empty dimension
        out.zero_();
        lse.fill_(-std::numeric_limits<float>::infinity());
        return {out, lse};
    }
    wb::FlashParams params;
    params.out = out.data_ptr();
    params.lse = lse.data_ptr<float>();
    params.key_keep = has_mask ? key_keep.data_ptr<uint8_t>() : nullptr;
    params.B = static_cast<int>(B);
    params.H = static_cast<int>(H);
    params.Lq = static_cast<int>(Lq);
    params.Lk = static_cast<int>(Lk);
    params.kv_group = static_cast<int>(H / k.size(1));
    params.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
    params.causal = causal ? 1 : 0;
    params.causal_offset = static_cast<int>(causal_offset);
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    const int which = static_cast<int>(version);
    const bool is_half = q.scalar_type() == torch::kHalf;
    if (D == 64) {
        if (is_half) wb::launch_flash<__half, 64>(which, q, k, v, params, stream);
        else wb::launch_flash<__nv_bfloat16, 64>(which, q, k, v, params, stream);
    } else {
        if (is_half) wb::launch_flash<__half, 128>(which, q, k, v, params, stream);
        else wb::launch_flash<__nv_bfloat16, 128>(which, q, k, v, params, stream);
    }
    return {out, lse};
}
// endregion
#endif
