// Packed attention on the CPU as one autograd op: each run of consecutive equal-length sequences of a packed row
// attends causally to itself through torch's CPU flash-attention kernel (forward and backward called directly), and
// every result is written in place into one row-sized tensor: the output in forward; the gradients of q, k and v in
// backward. What autograd keeps is the inputs, that output and the log-sum-exp (`[heads, T]`), so a packed layer's
// attention holds its output once (per-sequence SDPA calls and a `cat` would hold it twice, and their backward would
// make each gradient twice over: once per sequence, once concatenated).
//
// KV heads fewer than query heads (GQA) are repeated per run for the kernel, and their gradients summed back over
// each group, the same products as SDPA's `enable_gqa`.
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward.h>
#include <torch/csrc/autograd/custom_function.h>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <vector>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Rows `start .. start + n·len` of `x` `[1, h, T, D]` as `[n, h, len, D]` (a view), unit stride in `D`.
at::Tensor run_rows(const at::Tensor &x, int64_t start, int64_t len, int64_t n) {
    const int64_t h = x.size(1), d = x.size(3);
    at::Tensor rows = x.narrow(2, start, n * len).reshape({h, n, len, d}).transpose(0, 1);
    return rows.stride(3) == 1 ? rows : rows.contiguous();
}

// KV rows `[n, hk, len, D]` repeated to `heads` heads (each KV head serves `heads / hk` consecutive query heads).
at::Tensor repeat_kv(const at::Tensor &x, int64_t heads) {
    const int64_t hk = x.size(1);
    return hk == heads ? x : x.repeat_interleave(heads / hk, 1);
}

// A repeated KV gradient `[n, heads, len, D]` summed back over each group to `[n, hk, len, D]`.
at::Tensor fold_kv(const at::Tensor &g, int64_t hk) {
    const int64_t n = g.size(0), heads = g.size(1), len = g.size(2), d = g.size(3);
    return hk == heads ? g : g.reshape({n, hk, heads / hk, len, d}).sum(2);
}

// The rows `start .. start + n·len` of a `[1, T, h, D]` buffer, written from `[n, h, len, D]` values.
void store_rows(const at::Tensor &buffer, int64_t start, int64_t len, int64_t n, const at::Tensor &values) {
    const int64_t h = buffer.size(2), d = buffer.size(3);
    buffer.narrow(1, start, n * len).view({n, len, h, d}).copy_(values.transpose(1, 2));
}

// The log-sum-exp rows of a run, `[n, h, len]`, as a view of the row's `[h, T]`.
at::Tensor lse_rows(const at::Tensor &lse, int64_t start, int64_t len, int64_t n) {
    return lse.narrow(1, start, n * len).view({lse.size(0), n, len}).transpose(0, 1);
}

struct PackedAttention : public torch::autograd::Function<PackedAttention> {
    // `q` `[1, h, T, D]`, `k`/`v` `[1, hk, T, D]`, `runs` the `(length, count)` pairs in row order.
    static at::Tensor forward(AutogradContext *ctx, const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                              const std::vector<int64_t> &runs) {
        const int64_t h = q.size(1), t = q.size(2), d = q.size(3);
        at::Tensor out = at::empty({1, t, h, d}, q.options());
        at::Tensor lse;
        int64_t start = 0;
        for (size_t i = 0; i + 1 < runs.size(); i += 2) {
            const int64_t len = runs[i], n = runs[i + 1];
            auto [o, l] = at::_scaled_dot_product_flash_attention_for_cpu(
                run_rows(q, start, len, n), repeat_kv(run_rows(k, start, len, n), h),
                repeat_kv(run_rows(v, start, len, n), h), 0.0, /*is_causal=*/true);
            store_rows(out, start, len, n, o);
            if (!lse.defined()) {
                lse = at::empty({h, t}, l.options());
            }
            lse_rows(lse, start, len, n).copy_(l);
            start += n * len;
        }
        at::Tensor result = out.transpose(1, 2);
        ctx->save_for_backward({q, k, v, result, lse});
        ctx->saved_data["runs"] = runs;
        return result;
    }

    static variable_list backward(AutogradContext *ctx, variable_list grads) {
        const variable_list saved = ctx->get_saved_variables();
        const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
        const std::vector<int64_t> runs = ctx->saved_data["runs"].toIntVector();
        const at::Tensor &g = grads[0];
        const int64_t h = q.size(1), hk = k.size(1), t = q.size(2), d = q.size(3);
        at::Tensor dq = at::empty({1, t, h, d}, q.options());
        at::Tensor dk = at::empty({1, t, hk, d}, k.options());
        at::Tensor dv = at::empty({1, t, hk, d}, v.options());
        int64_t start = 0;
        for (size_t i = 0; i + 1 < runs.size(); i += 2) {
            const int64_t len = runs[i], n = runs[i + 1];
            auto [gq, gk, gv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
                run_rows(g, start, len, n), run_rows(q, start, len, n), repeat_kv(run_rows(k, start, len, n), h),
                repeat_kv(run_rows(v, start, len, n), h), run_rows(out, start, len, n),
                lse_rows(lse, start, len, n), 0.0, /*is_causal=*/true);
            store_rows(dq, start, len, n, gq);
            store_rows(dk, start, len, n, fold_kv(gk, hk));
            store_rows(dv, start, len, n, fold_kv(gv, hk));
            start += n * len;
        }
        return {dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), at::Tensor()};
    }
};

} // namespace

extern "C" {

// Packed causal attention of `q` `[1, h, T, D]` to `k`/`v` `[1, hk, T, D]` (CPU tensors, `h` a multiple of `hk`) over
// the `n_runs` runs `runs[2i]` (length) × `runs[2i + 1]` (count) that tile `T` in order. On success stores a new tensor
// `[1, h, T, D]` in `*out` (recorded by autograd when an input requires grad) and returns null; on failure returns a
// malloc'd message (freed by `ferl_storage_message_free`).
char *ferl_packed_attention_cpu(const at::Tensor *q, const at::Tensor *k, const at::Tensor *v, const int64_t *runs,
                                int64_t n_runs, at::Tensor **out) {
    try {
        std::vector<int64_t> pairs(runs, runs + 2 * n_runs);
        *out = new at::Tensor(PackedAttention::apply(*q, *k, *v, pairs));
        return nullptr;
    } catch (const std::exception &e) {
        return strdup(e.what());
    }
}
}
