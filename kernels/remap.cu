// Virtual id -> physical slot translation, per page or per token, in one launch.
//
// out[k] for k < num_ids * page_size: id = ids[k / page_size], t = k % page_size;
//   slot = table[id] when 0 <= id < table_len, else -1;
//   out[k] = slot * page_size + t when slot >= 0, else sink.
// Loaded by kernels/remap.py through cupy.RawModule (NVRTC) and compiled by nvcc in CI, so it
// includes no headers. One entry point per (table, ids, out) dtype triple, named
// remap_t<bits>_i<bits>_o<bits>. Reads never leave [0, table_len) and [0, num_ids).

#define TS_REMAP_THREADS 256

typedef long long i64;

template <typename T, typename I, typename O>
__device__ __forceinline__ void remap_impl(const T* __restrict__ tab, const I* __restrict__ vid,
                                           O* __restrict__ res, i64 table_len, i64 num_ids,
                                           i64 page_size, i64 sink) {
    const i64 total = num_ids * page_size;
    const i64 step = (i64)gridDim.x * blockDim.x;
    for (i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += step) {
        const i64 n = page_size == 1 ? k : k / page_size;
        const i64 id = (i64)vid[n];
        const i64 slot = (id >= 0 && id < table_len) ? (i64)tab[id] : -1;
        res[k] = slot >= 0 ? (O)(slot * page_size + (k - n * page_size)) : (O)sink;
    }
}

#define TS_REMAP_ENTRY(NAME, T, I, O)                                                        \
    extern "C" __global__ void __launch_bounds__(TS_REMAP_THREADS)                         \
    NAME(const T* __restrict__ table, const I* __restrict__ ids, O* __restrict__ out,      \
         i64 table_len, i64 num_ids, i64 page_size, i64 sink) {                               \
        remap_impl<T, I, O>(table, ids, out, table_len, num_ids, page_size, sink);            \
    }

TS_REMAP_ENTRY(remap_t64_i64_o64, long long, long long, long long)
TS_REMAP_ENTRY(remap_t64_i64_o32, long long, long long, int)
TS_REMAP_ENTRY(remap_t64_i32_o64, long long, int, long long)
TS_REMAP_ENTRY(remap_t64_i32_o32, long long, int, int)
TS_REMAP_ENTRY(remap_t32_i64_o64, int, long long, long long)
TS_REMAP_ENTRY(remap_t32_i64_o32, int, long long, int)
TS_REMAP_ENTRY(remap_t32_i32_o64, int, int, long long)
TS_REMAP_ENTRY(remap_t32_i32_o32, int, int, int)
