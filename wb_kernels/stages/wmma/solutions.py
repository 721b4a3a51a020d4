"""Worked solutions to lesson 05's exercises and its puzzle. Try them first: the lesson's check cells tell you when you
are right."""

answer_1 = 2 * (64 // 16 * 64 // 16 + 64 // 16 * 64 // 16)  # S and PV: 16 WMMAs each at D = 64, 2 HMMA per WMMA
answer_2 = (2 * 2 * 64 * (256 + 8) * 2      # two stages of K and V tiles, rows padded by 8 elements, 2 bytes each
            + 64 * (64 + 8) * (4 + 2)       # the S scratch (fp32) and the P scratch (16-bit) of 64 query rows
            + 2 * 64 * 4 + 64 * 4)          # the key bias (two stages) and the row factors
answer_3 = 2.0 ** -7  # bf16 has 8 significant bits: the next number after 1 is 1 + 2^-7

# The puzzle: one tile of S = Q K^T. K is stored row by row, as Q is; read as a column-major matrix_b, the same
# memory is K^T, so only the b fragment's layout differs from the lesson's C = A B.
tile_kernel = r"""__global__ void wmma_tile_kernel(const half* a, const half* b, float* c) {
    using namespace nvcuda;
    wmma::fragment<wmma::matrix_a, 16, 16, 16, half, wmma::row_major> a_frag;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::col_major> b_frag;  // B^T: element (k, n) at b[n * 16 + k]
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> c_frag;
    wmma::fill_fragment(c_frag, 0.0f);
    wmma::load_matrix_sync(a_frag, a, 16);
    wmma::load_matrix_sync(b_frag, b, 16);  // column-major: 16 elements from one column to the next
    wmma::mma_sync(c_frag, a_frag, b_frag, c_frag);
    wmma::store_matrix_sync(c, c_frag, 16, wmma::mem_row_major);
}"""
