// A model of nvcuda::wmma that runs on the CPU (lesson 05's tile puzzle, graded on a laptop).
//
// The host C++ compiler builds the learner's wmma_tile_kernel against this header instead of <mma.h>, and
// tile.py runs it once per lane of the warp. What the model keeps of WMMA is what the product depends on:
// which matrix each call names, the fragment's layout (row_major / col_major), the leading dimension, and
// that a fragment holds garbage until it is filled or loaded. What it leaves out is where the 256 elements
// live among the 32 lanes: a fragment here holds the whole 16 x 16 matrix, as the warp does together.
//
//   - a fragment starts as NaN (registers hold whatever was there before): an accumulator never zeroed shows;
//   - load/store index element (i, j) at ptr[i * ldm + j] (row major) or ptr[i + j * ldm] (column major),
//     and every address is checked against the three 16 x 16 matrices: a wrong ldm that reads past them stops;
//   - mma_sync(d, a, b, c): d = a b + c with fp16 products (exact in fp32) and fp32 sums.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <type_traits>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline

struct wb_dim3 { unsigned x = 0, y = 0, z = 0; };
static wb_dim3 threadIdx, blockIdx, blockDim{32, 1, 1}, gridDim{1, 1, 1};
inline void __syncwarp(unsigned = 0xffffffffu) {}
inline void __syncthreads() {}

// fp16 storage: the model holds the (exactly representable) value as a float
struct __half {
    float value;
    __half() = default;
    __half(float v) : value(v) {}
    operator float() const { return value; }
};
typedef __half half;
inline __half __float2half(float v) { return __half(v); }
inline float __half2float(__half h) { return h.value; }

namespace wb_host {
struct Buffer { const void* begin; std::size_t bytes; const char* name; };
static Buffer buffers[3];
inline void check_address(const void* p, std::size_t bytes) {
    const char* c = static_cast<const char*>(p);
    for (const Buffer& b : buffers) {
        const char* begin = static_cast<const char*>(b.begin);
        if (c >= begin && c + bytes <= begin + b.bytes) return;
    }
    std::printf("OUT_OF_BOUNDS\n");  // tile.py turns this into the learner's message
    std::exit(3);
}
}  // namespace wb_host

namespace nvcuda {
namespace wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
    static_assert(M == 16 && N == 16 && K == 16, "the host model knows only the 16 x 16 x 16 shape");
    static constexpr int num_elements = 256;  // here the whole matrix; on the GPU each lane holds 8 of them
    T x[256];
    fragment() {
        for (T& e : x) e = T(std::numeric_limits<float>::quiet_NaN());
    }
};

template <typename Use, typename T, typename Layout>
inline void fill_fragment(fragment<Use, 16, 16, 16, T, Layout>& f, float value) {
    for (T& e : f.x) e = T(value);
}

template <typename T>
inline float element(const T* p, int i, int j, unsigned ldm, bool row_major) {
    const T* address = row_major ? p + static_cast<std::size_t>(i) * ldm + j : p + i + static_cast<std::size_t>(j) * ldm;
    wb_host::check_address(address, sizeof(T));
    return float(*address);
}

template <typename Use, typename T, typename Layout, typename U>
inline void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout>& f, const U* p, unsigned ldm) {
    static_assert(!std::is_same<Use, accumulator>::value, "an accumulator load names its memory layout");
    for (int i = 0; i < 16; ++i)
        for (int j = 0; j < 16; ++j) f.x[i * 16 + j] = T(element(p, i, j, ldm, std::is_same<Layout, row_major>::value));
}

template <typename T>
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, T, void>& f, const float* p, unsigned ldm, layout_t layout) {
    for (int i = 0; i < 16; ++i)
        for (int j = 0; j < 16; ++j) f.x[i * 16 + j] = element(p, i, j, ldm, layout == mem_row_major);
}

template <typename T>
inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, T, void>& f, unsigned ldm, layout_t layout) {
    for (int i = 0; i < 16; ++i)
        for (int j = 0; j < 16; ++j) {
            float* address = layout == mem_row_major ? p + static_cast<std::size_t>(i) * ldm + j
                                                     : p + i + static_cast<std::size_t>(j) * ldm;
            wb_host::check_address(address, sizeof(float));
            *address = f.x[i * 16 + j];
        }
}

template <typename TA, typename LA, typename TB, typename LB, typename TC>
inline void mma_sync(fragment<accumulator, 16, 16, 16, TC, void>& d, const fragment<matrix_a, 16, 16, 16, TA, LA>& a,
                     const fragment<matrix_b, 16, 16, 16, TB, LB>& b, const fragment<accumulator, 16, 16, 16, TC, void>& c) {
    float result[256];
    for (int i = 0; i < 16; ++i)
        for (int j = 0; j < 16; ++j) {
            float sum = c.x[i * 16 + j];
            for (int k = 0; k < 16; ++k) sum += float(a.x[i * 16 + k]) * float(b.x[k * 16 + j]);
            result[i * 16 + j] = sum;
        }
    for (int e = 0; e < 256; ++e) d.x[e] = result[e];
}
}  // namespace wmma
}  // namespace nvcuda

// The learner's kernel is appended after this header; tile.py adds the driver (wb_host_main) after it.
