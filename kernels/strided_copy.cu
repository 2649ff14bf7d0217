// Batched strided copy of fixed-size byte blocks: item (i, r) copies `nbytes` from
// src + src_index[i]*src_stride + r*src_row_stride to the same span of dst at dst_index[i].
//
// Loaded by kernels/copy.py through cupy.RawModule (NVRTC) and compiled by `python -m
// kernels.build --check` (nvcc) in CI, so it includes no headers: both compilers must accept it.
//
// Launch: grid = (items, chunks), block = (TS_THREADS). blockIdx.x strides over the items
// (i, r) and blockIdx.y over the chunks of TS_THREADS * TS_UNROLL words inside one item.
// Pointers arrive as 64-bit integers (device addresses; mapped pinned host memory works the
// same way) into pointer parameters, which nvcc treats as global memory: loads of the source go
// through the read-only path. Within one launch no byte is both read by one item and written by
// another (the caller stages such batches), so __restrict__ holds. An index that is negative or not below its slot count skips the item, so a
// kernel never touches memory outside the two buffers.

#define TS_THREADS 256
#define TS_UNROLL 4

typedef unsigned long long u64;
typedef long long i64;

struct alignas(16) Word16 {
    unsigned int x, y, z, w;
};

// Copies bytes [begin, end) of one item with threads of every chunk block; W-sized words in
// the middle, single bytes for the unaligned head and tail. src and dst must share their
// misalignment modulo sizeof(W).
template <typename W>
__device__ __forceinline__ void copy_span(const unsigned char* __restrict__ src,
                                          unsigned char* __restrict__ dst, i64 nbytes) {
    const i64 wsize = (i64)sizeof(W);
    i64 head = (wsize - (i64)((u64)src & (u64)(wsize - 1))) & (wsize - 1);
    if (head > nbytes) head = nbytes;
    const i64 nwords = (nbytes - head) / wsize;
    const i64 tail_begin = head + nwords * wsize;
    if (blockIdx.y == 0) {
        const i64 t = (i64)threadIdx.x;
        if (t < head) dst[t] = src[t];
        if (tail_begin + t < nbytes) dst[tail_begin + t] = src[tail_begin + t];
    }
    const W* __restrict__ ws = reinterpret_cast<const W*>(src + head);
    W* __restrict__ wd = reinterpret_cast<W*>(dst + head);
    const i64 per_chunk = (i64)TS_THREADS * TS_UNROLL;
    for (i64 base = (i64)blockIdx.y * per_chunk; base < nwords; base += (i64)gridDim.y * per_chunk) {
        W regs[TS_UNROLL];
        // All loads before any store: TS_UNROLL requests in flight per thread.
#pragma unroll
        for (int u = 0; u < TS_UNROLL; ++u) {
            const i64 k = base + (i64)u * TS_THREADS + threadIdx.x;
            if (k < nwords) regs[u] = ws[k];
        }
#pragma unroll
        for (int u = 0; u < TS_UNROLL; ++u) {
            const i64 k = base + (i64)u * TS_THREADS + threadIdx.x;
            if (k < nwords) wd[k] = regs[u];
        }
    }
}

extern "C" __global__ void __launch_bounds__(TS_THREADS)
strided_copy(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
             const i64* __restrict__ sidx, const i64* __restrict__ didx, i64 num_blocks,
             i64 rows, i64 nbytes, i64 src_stride, i64 dst_stride, i64 src_row_stride,
             i64 dst_row_stride, i64 src_slots, i64 dst_slots) {
    const i64 items = num_blocks * rows;
    for (i64 item = blockIdx.x; item < items; item += gridDim.x) {
        const i64 i = item / rows;
        const i64 r = item - i * rows;
        const i64 s = sidx[i];
        const i64 d = didx[i];
        // Uniform across the thread block: every thread takes the same branch.
        if (s < 0 || d < 0 || s >= src_slots || d >= dst_slots) continue;
        const unsigned char* sp = src + (s * src_stride + r * src_row_stride);
        unsigned char* dp = dst + (d * dst_stride + r * dst_row_stride);
        const u64 skew = (u64)sp ^ (u64)dp;
        if ((skew & 15) == 0) {
            copy_span<Word16>(sp, dp, nbytes);
        } else if ((skew & 3) == 0) {
            copy_span<unsigned int>(sp, dp, nbytes);
        } else {
            copy_span<unsigned char>(sp, dp, nbytes);
        }
    }
}
