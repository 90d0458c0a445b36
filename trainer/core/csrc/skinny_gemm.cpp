// `W·xᵀ` for a decode step: a weight matrix `W` `[m, k]` against a few rows `x` `[n, k]` (n is the batch of
// sequences, up to 64), fp32 on the CPU. MKL's sgemm tiles `W` for large products and, against a matrix that does not
// fit the caches, reads it well below the memory's streaming rate. Here `W` is read once, a tile of rows at a time,
// front to back: each element of `W` is broadcast and multiplied into a vector of columns of `xᵀ` (the batch in the
// vector lanes, `xᵀ` in the L1/L2 caches), so the sums need no horizontal additions and each output row is stored
// whole; software prefetches keep the tile's row streams ahead of it. The rows of `W` are split over torch's intra-op
// threads (`at::parallel_for`, the pool torch's own ops use). The tiles (`skinny_tiles.inc`) are written once and
// compiled twice, for AVX-512F (16 lanes, 32 registers) and for AVX2 with FMA (8 lanes, 16 registers); the caller
// picks one the CPU has. Each output is the same products as sgemm's, added in order of `k`.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>

// Elements of `W` a thread's share holds at least, so that small matrices stay on one thread.
constexpr int64_t kMinShare = 1 << 16;

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
namespace avx512 {
using Vec = __m512;
constexpr int kLanes = 16;
// 16 accumulators or fewer of the 32 registers: 16 rows for one block of columns, 8 for two, 4 for three or four.
constexpr int rows_for(int g) { return g == 1 ? 16 : g == 2 ? 8 : 4; }
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float *p) { return _mm512_loadu_ps(p); }
inline Vec vset1(float v) { return _mm512_set1_ps(v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstore(float *p, Vec v, int64_t lanes) {
    _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << lanes) - 1), v);
}
#include "skinny_tiles.inc"
} // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
using Vec = __m256;
constexpr int kLanes = 8;
// Accumulators, the G column vectors and the broadcast within the 16 registers: 12 rows for one block of columns, 6
// for two, 4 for three, 2 for four.
constexpr int rows_for(int g) { return g == 1 ? 12 : g == 2 ? 6 : g == 3 ? 4 : 2; }
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float *p) { return _mm256_loadu_ps(p); }
inline Vec vset1(float v) { return _mm256_set1_ps(v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstore(float *p, Vec v, int64_t lanes) {
    if (lanes == kLanes) {
        _mm256_storeu_ps(p, v);
        return;
    }
    alignas(32) float tail[kLanes];
    _mm256_store_ps(tail, v);
    std::memcpy(p, tail, static_cast<size_t>(lanes) * sizeof(float));
}
#include "skinny_tiles.inc"
} // namespace avx2
#pragma GCC pop_options

#endif

extern "C" {

// The widest kernel this CPU runs: 2 with AVX-512F, 1 with AVX2 and FMA, 0 without either (and never off x86-64).
int ferl_w_xt_isa() {
#if defined(__x86_64__)
    if (__builtin_cpu_supports("avx512f")) {
        return 2;
    }
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1 : 0;
#else
    return 0;
#endif
}

// `out = w · xᵀ` for fp32 CPU tensors `w` `[m, k]` and `out` `[m, n]`, contiguous, and `x` `[n, k]`, any strides (a
// decode step's activations are often transposed views), with the tiles of `isa` (2: AVX-512F, 1: AVX2; at most
// `ferl_w_xt_isa()`). Returns null on success or a malloc'd message (freed by ferl_storage_message_free).
char *ferl_w_xt(const at::Tensor *w, const at::Tensor *x, const at::Tensor *out, int isa) {
    try {
        TORCH_CHECK(isa >= 1 && isa <= ferl_w_xt_isa(), "w_xt: this CPU cannot run kernel ", isa, " (it has ",
                    ferl_w_xt_isa(), ")");
#if defined(__x86_64__)
        for (const at::Tensor *t : {w, x, out}) {
            TORCH_CHECK(t->defined() && t->dim() == 2 && t->scalar_type() == at::kFloat && t->device().is_cpu() &&
                            (t == x || t->is_contiguous()),
                        "w_xt: tensors must be 2-D fp32 CPU tensors, W and out contiguous");
        }
        const int64_t m = w->size(0), k = w->size(1), n = x->size(0);
        TORCH_CHECK(x->size(1) == k, "w_xt: x has ", x->size(1), " features, W ", k);
        TORCH_CHECK(out->size(0) == m && out->size(1) == n, "w_xt: out is ", out->sizes(), ", not [", m, ", ", n,
                    "]");
        const float *wp = w->const_data_ptr<float>();
        const float *xp = x->const_data_ptr<float>();
        const int64_t row_stride = x->stride(0), col_stride = x->stride(1);
        float *yp = out->mutable_data_ptr<float>();
        // xᵀ, padded with zero columns to a multiple of 16, in this thread's buffer (kept: a decode step makes a few
        // hundred of these calls, and a fresh buffer of 100s of KB each time would fault in new pages).
        const int64_t np = (n + 15) / 16 * 16;
        thread_local std::vector<float> xt;
        xt.assign(static_cast<size_t>(k * np), 0.0f);
        for (int64_t c = 0; c < n; ++c) {
            for (int64_t i = 0; i < k; ++i) {
                xt[i * np + c] = xp[c * row_stride + i * col_stride];
            }
        }
        const int64_t grain = std::max<int64_t>(1, kMinShare / std::max<int64_t>(k, 1));
        // The pointer, not the name: inside the lambda `xt` would be each worker thread's own (empty) buffer.
        const float *xtp = xt.data();
        at::parallel_for(0, m, grain, [&](int64_t r0, int64_t r1) {
            if (isa == 2) {
                avx512::rows(wp, k, xtp, np, yp, n, r0, r1);
            } else {
                avx2::rows(wp, k, xtp, np, yp, n, r0, r1);
            }
        });
#endif
        return nullptr;
    } catch (const std::exception &e) {
        return strdup(e.what());
    }
}
}
