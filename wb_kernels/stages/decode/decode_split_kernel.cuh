// Split-KV decoding (lesson 07): the split kernel, decode_split_kernel. A block reads one split of one
// sequence's keys for up to 4 query heads of a KV group, each lane keeping its own online-softmax state, and
// writes the split's result, or the answer where it is the only split; the last block of a sequence's splits
// merges them (decode_merge.cuh).
// Device code only (no torch), so that another kernel can include it; decode_host.cu includes it and holds the
// launches. Lesson 07 shows its regions (// region: NAME) with the file named in each cell.
#pragma once

#include "decode_params.cuh"
#include "decode_merge.cuh"

#ifndef WB_DECODE_PREFETCH
#define WB_DECODE_PREFETCH 1  // 1: the next trip's loads are issued before this trip's arithmetic (see the loop)
#endif
#ifndef WB_PAGED_TABLE_AHEAD
#define WB_PAGED_TABLE_AHEAD 1  // 1: the paged 4-row loop reads its page-table entries a trip before their loads
#endif
#ifndef WB_DECODE_CHUNKED_SOFTMAX
#define WB_DECODE_CHUNKED_SOFTMAX 1  // 1: one online-softmax rescale per trip of KEYS_IN_FLIGHT keys, not per key
#endif

namespace wb {

// region: split_kernel_setup
// Grid: (B * Hk, splits, ceil(G / ROWS)): (sequence, KV head) in x, the one dimension past 65,535 blocks. Block:
// NUM_WARPS warps. LANES_PER_KEY = D / 8 lanes share a key, so a warp reads 32 / LANES_PER_KEY keys per step and a
// block NUM_WARPS times that.
// PAGED: keys through the block table; otherwise a contiguous cache, sequence b one page of L keys (no table to read,
// no division per key); kMinBlocks (above, with the parameters) is its occupancy.
template <typename T, int D, int ROWS, int NUM_WARPS, int KEYS_IN_FLIGHT, bool PAGED>
__global__ void __launch_bounds__(NUM_WARPS * 32, (kMinBlocks<ROWS, PAGED>)) decode_split_kernel(const DecodeParams p) {
    constexpr int LANES_PER_KEY = D / 8;
    constexpr int KEYS_PER_WARP = 32 / LANES_PER_KEY;
    constexpr int KEYS_PER_STEP = KEYS_PER_WARP * NUM_WARPS;
    WB_SPLIT_TRACE(0);  // a profiling build's stamps (WB_DECODE_SPLIT_TRACE): entry, loads issued, loop end, ...

    const int b = blockIdx.x / p.Hk, kv_head = blockIdx.x % p.Hk;
    const int split = blockIdx.y;
    const int group = p.H / p.Hk;
    const int head0 = kv_head * group + blockIdx.z * ROWS;  // this block's first query head
    const int rows = min(ROWS, kv_head * group + group - head0);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int key_lane = lane / LANES_PER_KEY;  // which of the warp's keys this lane reads
    const int col = (lane % LANES_PER_KEY) * 8;  // the 8 columns it reads of that key

    // the lengths on the device are clamped to the cache, so a wrong value cannot read outside it, and flagged
    const int capacity = p.pages_per_seq * p.page_size;
    const int asked = p.seq_lens[b];
    const int length = min(max(asked, 0), capacity);
    const int start = split * p.keys_per_split;
    // the last split reads every key past the others', so a length beyond the launch's splits loses none
    const int stop = split == p.num_splits - 1 ? length : min(start + p.keys_per_split, length);
    if (threadIdx.x == 0 && split == p.num_splits - 1 && kv_head == 0 && blockIdx.z == 0) {
        const int flags = (asked != length ? 1 : 0) | (length - start > p.keys_per_split ? 2 : 0);
        if (flags) atomicOr(p.status, flags);
    }

    float q[ROWS][8];  // this lane's 8 columns of each query row, times scale * log2(e)
    bool q_bad[ROWS];  // the row's query holds a NaN or an Inf (any column: the warp's lanes cover all D)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        uint4 raw = make_uint4(0, 0, 0, 0);
        if (r < rows) raw = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.q) + ((size_t)b * p.H + head0 + r) * D + col);
        to_float8<T>(raw, q[r]);
        bool bad = false;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            bad |= !is_finite(q[r][i]);
            q[r][i] *= p.scale_log2;
        }
        q_bad[r] = __any_sync(0xffffffffu, bad);
    }
    float m[ROWS], l[ROWS], acc[ROWS][8];  // this lane's online-softmax state per row, over the keys it saw
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        m[r] = kLowest;
        l[r] = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[r][i] = 0.f;
    }

// endregion

    // region: split_kernel_loads
    // this KV head's column `col` (and for a contiguous cache, sequence b's page); a key adds its page's and slot's
    // offsets, in 32 bits within a page (the launcher checks that a page spans fewer than 2^31 elements)
    const size_t head = (size_t)(unsigned)kv_head * p.strides[1] + col + (PAGED ? 0 : (size_t)(unsigned)b * p.strides[0]);
    const T* k_base = static_cast<const T*>(p.k_pages) + head;
    const T* v_base = static_cast<const T*>(p.v_pages) + head;
    const int* table = p.block_table + (PAGED ? (size_t)b * p.pages_per_seq : 0);
    // key / page_size as a multiply and a shift (Granlund and Montgomery, "Division by invariant integers using
    // multiplication", 1994): with shift = 31 + ceil(log2 page_size) and magic = ceil(2^shift / page_size), it is exact
    // for every key below 2^31. A division by a value known only at run time is some 20 dependent instructions
    // (I2F, MUFU.RCP, F2I, fix-ups) between a key and its page-table read; this is three.
    const int page_shift = 31 + (32 - __clz(p.page_size - 1));
    const unsigned page_magic = (unsigned)(((1ull << page_shift) + p.page_size - 1) / (unsigned)p.page_size);
    auto page_of = [&](int key) { return (int)(((unsigned long long)(unsigned)key * page_magic) >> page_shift); };
    constexpr int STRIDE = KEYS_PER_STEP * KEYS_IN_FLIGHT;  // keys the block covers per trip round the loop
    // the loads of KEYS_IN_FLIGHT steps from key0 on (zeros past the split's end), in two parts. read_pages: every
    // step's page-table entry (an index past the sequence's row is clamped into it; that entry goes unused);
    // load: with those entries, every address, then the keys' and values' loads, issued together
    int page[KEYS_IN_FLIGHT];
    auto read_pages = [&](int key0) {
        if constexpr (PAGED) {
#pragma unroll
            for (int s = 0; s < KEYS_IN_FLIGHT; ++s)
                page[s] = table[min(page_of(key0 + s * KEYS_PER_STEP + key_lane), p.pages_per_seq - 1)];
        }
    };
    auto load = [&](int key0, uint4 (&k_raw)[KEYS_IN_FLIGHT], uint4 (&v_raw)[KEYS_IN_FLIGHT]) {
        // every offset before any load: a table read pending behind the loads would be waited for with them (loads
        // share the counters that track their registers); an entry outside the pool reads the nearest page (status 4)
        size_t offset[KEYS_IN_FLIGHT];
#pragma unroll
        for (int s = 0; s < KEYS_IN_FLIGHT; ++s) {
            const int key = key0 + s * KEYS_PER_STEP + key_lane;
            offset[s] = (size_t)(unsigned)key * p.strides[2];
            if constexpr (PAGED) {
                const int slot = key - page_of(key) * p.page_size;
                // a 32 x 32 -> 64-bit product (one IMAD.WIDE.U32): the pool may hold more than 2^32 elements
                offset[s] = (size_t)(unsigned)min(max(page[s], 0), p.num_pages - 1) * p.strides[0] +
                            (unsigned)slot * p.strides[2];
            }
        }
#pragma unroll
        for (int s = 0; s < KEYS_IN_FLIGHT; ++s) {
            k_raw[s] = v_raw[s] = make_uint4(0, 0, 0, 0);
            if (key0 + s * KEYS_PER_STEP + key_lane < stop) {
                k_raw[s] = load_streamed(k_base + offset[s]);
                v_raw[s] = load_streamed(v_base + offset[s]);
            }
        }
    };
    // endregion

    // region: split_kernel_first_trip
    // TABLE_AHEAD: a trip's loads use entries read a trip earlier, so none waits behind a table read. It won on the
    // H100 for 4-row blocks only (and ends their spill); at 1 and 2 rows it costs registers (decode NOTES, version 16)
    constexpr bool TABLE_AHEAD = PAGED && ROWS == 4 && WB_PAGED_TABLE_AHEAD;
    // one trip's loads, in the one order of this build: its entries, then its loads; or, reading ahead, its loads
    // (with the entries read a trip earlier), then the next trip's entries
    auto load_trip = [&](int trip0, uint4 (&k_raw)[KEYS_IN_FLIGHT], uint4 (&v_raw)[KEYS_IN_FLIGHT]) {
        if constexpr (!TABLE_AHEAD) read_pages(trip0);
        load(trip0, k_raw, v_raw);
        if constexpr (TABLE_AHEAD) read_pages(trip0 + STRIDE);
    };
    uint4 k_raw[KEYS_IN_FLIGHT], v_raw[KEYS_IN_FLIGHT];
    int key0 = start + warp * KEYS_PER_WARP;
    if constexpr (TABLE_AHEAD) read_pages(key0);  // the first trip's entries: no trip before it read them
    load_trip(key0, k_raw, v_raw);
    WB_SPLIT_TRACE(1);
    // endregion

    // region: split_kernel_trip_scores
    for (; key0 < stop; key0 += STRIDE) {
#if WB_DECODE_PREFETCH
        // the next trip's loads go out before this trip's arithmetic, so memory is never idle while a warp computes
        // (twice the registers for the raw data)
        uint4 k_next[KEYS_IN_FLIGHT], v_next[KEYS_IN_FLIGHT];
        load_trip(key0 + STRIDE, k_next, v_next);
#endif
#if WB_DECODE_CHUNKED_SOFTMAX
        // The online softmax once per trip rather than once per key: the trip's KEYS_IN_FLIGHT scores per row first,
        // then one rescale of the state by their maximum, then their weights added. The per-key form (below) pays
        // 8 multiplies per row and key to rescale acc, and an extra exp2.
        float kx[KEYS_IN_FLIGHT][8], score[KEYS_IN_FLIGHT][ROWS];
        bool valid[KEYS_IN_FLIGHT];
#pragma unroll
        for (int s = 0; s < KEYS_IN_FLIGHT; ++s) {
            valid[s] = key0 + s * KEYS_PER_STEP + key_lane < stop;
            to_float8<T>(k_raw[s], kx[s]);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                float dot = 0.f;
#pragma unroll
                for (int i = 0; i < 8; ++i) dot = fmaf(q[r][i], kx[s][i], dot);
                // the D / 8 lanes of one key hold partial dot products: add them up (lanes of a key are adjacent)
#pragma unroll
                for (int offset = LANES_PER_KEY / 2; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
                score[s][r] = valid[s] ? dot : kLowest;  // a NaN score stays NaN (see the header)
            }
        }
        // endregion

        // region: split_kernel_trip_softmax
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            float new_max = m[r];
#pragma unroll
            for (int s = 0; s < KEYS_IN_FLIGHT; ++s) new_max = fmaxf(new_max, score[s][r]);
            const float alpha = exp2f(m[r] - new_max);  // 1 when the maximum did not move
            l[r] *= alpha;
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[r][i] *= alpha;
            m[r] = new_max;
        }
#pragma unroll
        for (int s = 0; s < KEYS_IN_FLIGHT; ++s) {
            float vx[8];
            to_float8<T>(v_raw[s], vx);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                // a key past the split's end weighs 0 (exp2 of kLowest - m would be 1 while m is still kLowest)
                const float weight = valid[s] ? exp2f(score[s][r] - m[r]) : 0.f;
                l[r] += weight;
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[r][i] = fmaf(weight, vx[i], acc[r][i]);
            }
        }
        // endregion

        // region: split_kernel_per_key_and_next_trip
#else
#pragma unroll
        for (int s = 0; s < KEYS_IN_FLIGHT; ++s) {
            const bool valid = key0 + s * KEYS_PER_STEP + key_lane < stop;
            float kx[8], vx[8];
            to_float8<T>(k_raw[s], kx);
            to_float8<T>(v_raw[s], vx);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                float score = 0.f;
#pragma unroll
                for (int i = 0; i < 8; ++i) score = fmaf(q[r][i], kx[i], score);
                // the D / 8 lanes of one key hold partial dot products: add them up (lanes of a key are adjacent)
#pragma unroll
                for (int offset = LANES_PER_KEY / 2; offset > 0; offset /= 2)
                    score += __shfl_xor_sync(0xffffffffu, score, offset);
                if (!valid) continue;
                const float new_max = fmaxf(m[r], score);
                const float alpha = exp2f(m[r] - new_max);  // 0 while m[r] is kLowest and score is not
                const float weight = exp2f(score - new_max);
                l[r] = l[r] * alpha + weight;
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[r][i] = fmaf(weight, vx[i], acc[r][i] * alpha);
                m[r] = new_max;
            }
        }
#endif
#if WB_DECODE_PREFETCH
#pragma unroll
        for (int s = 0; s < KEYS_IN_FLIGHT; ++s) {
            k_raw[s] = k_next[s];
            v_raw[s] = v_next[s];
        }
#else
        load_trip(key0 + STRIDE, k_raw, v_raw);
#endif
    }
    if constexpr (PAGED) {
        // status bit 4: an entry of this split's pages outside the pool (the loads read the nearest page), looked for
        // once per block after its loop, where the entries are in cache, rather than once per key inside it
        if (blockIdx.z == 0 && stop > start) {
            bool outside = false;
            for (int i = start / p.page_size + threadIdx.x; i <= (stop - 1) / p.page_size; i += NUM_WARPS * 32)
                outside |= table[i] < 0 || table[i] >= p.num_pages;
            if (outside) atomicOr(p.status, 4);
        }
    }
    WB_SPLIT_TRACE(4);

    // endregion

    // region: split_kernel_block_merge
    // merge the states of the warp's KEYS_PER_WARP key lanes (same columns, different keys): xor over key bits
#pragma unroll
    for (int offset = LANES_PER_KEY; offset < 32; offset *= 2) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const float m_other = __shfl_xor_sync(0xffffffffu, m[r], offset);
            const float l_other = __shfl_xor_sync(0xffffffffu, l[r], offset);
            const float new_max = fmaxf(m[r], m_other);
            // an empty state has l = 0 and acc = 0, so its weight does not matter, even exp2(0) = 1
            const float mine = exp2f(m[r] - new_max), theirs = exp2f(m_other - new_max);
            l[r] = l[r] * mine + l_other * theirs;
#pragma unroll
            for (int i = 0; i < 8; ++i)
                acc[r][i] = acc[r][i] * mine + __shfl_xor_sync(0xffffffffu, acc[r][i], offset) * theirs;
            m[r] = new_max;
        }
    }

    // endregion

    // region: split_kernel_write
    // then across warps, through shared memory: lanes 0 .. LANES_PER_KEY-1 of each warp hold its state
    __shared__ float s_m[NUM_WARPS][ROWS], s_l[NUM_WARPS][ROWS], s_acc[NUM_WARPS][ROWS][D];
    if (key_lane == 0) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            if (col == 0) {
                s_m[warp][r] = m[r];
                s_l[warp][r] = l[r];
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) s_acc[warp][r][col + i] = acc[r][i];
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < rows * D; e += NUM_WARPS * 32) {
        const int r = e / D, d = e % D;
        float top = kLowest;
        for (int w = 0; w < NUM_WARPS; ++w) top = fmaxf(top, s_m[w][r]);
        float total = 0.f, value = 0.f;
        for (int w = 0; w < NUM_WARPS; ++w) {
            const float weight = exp2f(s_m[w][r] - top);
            total += s_l[w][r] * weight;
            value += s_acc[w][r][d] * weight;
        }
        const size_t row = ((size_t)split * p.B + b) * p.H + head0 + r;
        // q_bad is the same in every warp; the split poisons its row only if it holds keys (a row that sees no
        // key stays 0, whatever its query)
        const bool poisoned = is_nan(total) || (q_bad[r] && stop > start);
        const bool seen = total > 0.f;
        const float nan = __int_as_float(0x7fc00000), result = poisoned ? nan : seen ? value / total : 0.f;
        const float row_lse = poisoned ? nan : seen ? (top + log2f(total)) * 0.6931471805599453f : -INFINITY;
        if (p.num_splits == 1) {  // the one split's result is the answer: written as the merge of one split would
            static_cast<T*>(p.out)[row * D + d] = from_float<T>(result);
            if (d == 0) p.lse[row] = row_lse;
        } else {
            p.part_out[row * D + d] = result;
            if (d == 0) p.part_lse[row] = row_lse;
        }
    }
    WB_SPLIT_TRACE(5);
    // endregion

    // region: split_kernel_fused_merge
    // nothing to merge with one split; with more, a second kernel merges them unless the counters are passed
    if (p.num_splits == 1 || p.counters == nullptr) return;

    // The last of the group's split blocks to finish merges them, in this launch: no second kernel to wait for, and
    // the partial results are read back from L2 while they are still there. Every thread's writes happen before the
    // __syncthreads, and thread 0 counts the block done with a release at GPU scope; the block that counts last
    // acquires, so after its own __syncthreads all its threads see every split's results.
    __syncthreads();  // also: every thread is done with s_acc, which the merge reuses for the splits' weights
    __shared__ bool s_last;
    int* counter = p.counters + (size_t)blockIdx.x * gridDim.z + blockIdx.z;  // one per (sequence, KV head, rows)
    if (threadIdx.x == 0) s_last = count_finished(counter) == p.num_splits - 1;
    __syncthreads();
    if (!s_last) return;
    merge_splits<T, D, ROWS>(p.part_out, p.part_lse, static_cast<T*>(p.out), p.lse, p.B * p.H, b * p.H + head0, rows,
                             p.num_splits, &s_acc[0][0][0]);  // room for NUM_WARPS * D splits' weights per row
    WB_SPLIT_TRACE(6);
}
// endregion

}  // namespace wb
