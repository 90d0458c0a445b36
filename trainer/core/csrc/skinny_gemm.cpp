// `W·xᵀ` for a decode step: a weight matrix `W` `[m, k]` against a few rows `x` `[n, k]` (n is the batch of
// sequences, up to 64), fp32 on the CPU. MKL's sgemm tiles `W` for large products and, against a matrix that does not
// fit the caches, reads it well below the memory's streaming rate. Here `W` is read once, a tile of 4 to 16 rows at a
// time, front to back: each element of `W` is broadcast and multiplied into 16 columns of `xᵀ` (the batch in the
// vector lanes, `xᵀ` in the L1/L2 caches), so the sums need no horizontal additions and each output row is stored
// whole; software prefetches keep the tile's row streams ahead of it. The rows of `W` are split over torch's intra-op threads (`at::parallel_for`, the pool torch's own ops use).
// Each output is the same products as sgemm's, added in order of `k`.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>

namespace {

// Elements of `W` a thread's share holds at least, so that small matrices stay on one thread.
constexpr int64_t kMinShare = 1 << 16;
// Rows of `W` per tile for 1 block of 16 columns, for 2, and for 3 or 4 (16 accumulators or fewer).
constexpr int kRowsOne = 16;
constexpr int kRowsTwo = 8;
constexpr int kRowsWide = 4;
// Rows of at most this many elements prefetch the next tile rather than further along their own row.
constexpr int64_t kShortRow = 256;

// `y[r * n + c] = Σ_i w[r * k + i] * xt[i * np + c]` for the R rows of `w` given and the G blocks of 16 columns from
// `c0`: the sums of 16 columns sit in the lanes of one register, so no horizontal sums are needed. `xt` is `xᵀ` padded
// with zeros to `np` columns (a multiple of 16); columns from `n` on are not stored.
template <int R, int G>
__attribute__((target("avx512f"))) void tile(const float *w, int64_t k, const float *xt, int64_t np, float *y,
                                             int64_t n, int64_t c0) {
    __m512 acc[R][G];
    for (int r = 0; r < R; ++r) {
        for (int g = 0; g < G; ++g) {
            acc[r][g] = _mm512_setzero_ps();
        }
    }
    // The hardware prefetchers miss the tile's R row streams: every 16 steps, ask for what comes next — the rows'
    // bytes 256 ahead, or for short rows the next tile, R floats per step (`w` is contiguous across tiles).
    const bool short_rows = k <= kShortRow;
    for (int64_t i0 = 0; i0 < k; i0 += 16) {
        if (short_rows) {
            for (int64_t j = 0; j < 16; j += std::max(1, 16 / R)) {
                _mm_prefetch(reinterpret_cast<const char *>(w + R * k + (i0 + j) * R), _MM_HINT_T0);
            }
        } else {
            for (int r = 0; r < R; ++r) {
                _mm_prefetch(reinterpret_cast<const char *>(w + r * k + i0 + 64), _MM_HINT_T0);
            }
        }
        const int64_t end = std::min<int64_t>(i0 + 16, k);
        for (int64_t i = i0; i < end; ++i) {
            __m512 xv[G];
            for (int g = 0; g < G; ++g) {
                xv[g] = _mm512_loadu_ps(xt + i * np + c0 + 16 * g);
            }
            for (int r = 0; r < R; ++r) {
                const __m512 wv = _mm512_set1_ps(w[r * k + i]);
                for (int g = 0; g < G; ++g) {
                    acc[r][g] = _mm512_fmadd_ps(wv, xv[g], acc[r][g]);
                }
            }
        }
    }
    for (int g = 0; g < G; ++g) {
        const int64_t c = c0 + 16 * g;
        const int64_t lanes = std::min<int64_t>(16, n - c);
        const __mmask16 mask = static_cast<__mmask16>((1u << lanes) - 1);
        for (int r = 0; r < R; ++r) {
            _mm512_mask_storeu_ps(y + r * n + c, mask, acc[r][g]);
        }
    }
}

// Rows `[r0, r1)` of `W` against the G column blocks from `c0`.
template <int G>
void row_range(const float *w, int64_t k, const float *xt, int64_t np, float *y, int64_t n, int64_t r0, int64_t r1,
               int64_t c0) {
    constexpr int R = G == 1 ? kRowsOne : G == 2 ? kRowsTwo : kRowsWide;
    int64_t r = r0;
    for (; r + R <= r1; r += R) {
        tile<R, G>(w + r * k, k, xt, np, y + r * n, n, c0);
    }
    for (; r < r1; ++r) {
        tile<1, G>(w + r * k, k, xt, np, y + r * n, n, c0);
    }
}

// Rows `[r0, r1)` of `W` against every column, four blocks of 16 at a time.
void rows(const float *w, int64_t k, const float *xt, int64_t np, float *y, int64_t n, int64_t r0, int64_t r1) {
    for (int64_t c0 = 0; c0 < n; c0 += 64) {
        switch (std::min<int64_t>(4, (n - c0 + 15) / 16)) {
        case 1: row_range<1>(w, k, xt, np, y, n, r0, r1, c0); break;
        case 2: row_range<2>(w, k, xt, np, y, n, r0, r1, c0); break;
        case 3: row_range<3>(w, k, xt, np, y, n, r0, r1, c0); break;
        default: row_range<4>(w, k, xt, np, y, n, r0, r1, c0); break;
        }
    }
}

} // namespace
#endif

extern "C" {

// Whether this CPU runs the kernel (AVX-512F; never off x86-64).
int ferl_w_xt_supported() {
#if defined(__x86_64__)
    return __builtin_cpu_supports("avx512f") ? 1 : 0;
#else
    return 0;
#endif
}

// `out = w · xᵀ` for fp32 CPU tensors `w` `[m, k]` and `out` `[m, n]`, contiguous, and `x` `[n, k]`, any strides (a
// decode step's activations are often transposed views). Returns null on
// success or a malloc'd message (freed by ferl_storage_message_free).
char *ferl_w_xt(const at::Tensor *w, const at::Tensor *x, const at::Tensor *out) {
    try {
        TORCH_CHECK(ferl_w_xt_supported(), "w_xt: this CPU has no AVX-512F");
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
        at::parallel_for(0, m, grain, [&](int64_t r0, int64_t r1) { rows(wp, k, xtp, np, yp, n, r0, r1); });
#endif
        return nullptr;
    } catch (const std::exception &e) {
        return strdup(e.what());
    }
}
}
