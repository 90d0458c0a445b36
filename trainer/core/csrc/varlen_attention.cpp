// torch's variable-length attention kernels for packed sequences (CUDA), which tch 0.24 does not expose: flash
// attention (`_flash_attention_forward`, bf16/fp16) and memory-efficient attention (`_efficient_attention_forward`,
// also fp32). Both go through the dispatcher, so autograd records them with their backward formulas.
#include <ATen/core/Tensor.h>
#include <ATen/ops/_efficient_attention_forward.h>
#include <ATen/ops/_flash_attention_forward.h>
#include <cstdlib>
#include <cstring>
#include <exception>

extern "C" {

// Causal attention of each packed sequence to itself. `q` [T, H, D], `k`/`v` [T, Hk, D] (flash: H a multiple of Hk;
// efficient: Hk == H), `cu` int32 [n + 1] cumulative lengths on the device, `max_len` the longest sequence. On
// success stores a new tensor [T, H, D] in `*out` and returns null; on failure returns a malloc'd message.
char *ferl_varlen_attention(const at::Tensor *q, const at::Tensor *k, const at::Tensor *v, const at::Tensor *cu,
                            int64_t max_len, int flash, at::Tensor **out) {
    try {
        at::Tensor o;
        if (flash) {
            o = std::get<0>(at::_flash_attention_forward(*q, *k, *v, *cu, *cu, max_len, max_len, 0.0,
                                                         /*is_causal=*/true, /*return_debug_mask=*/false));
        } else {
            // custom_mask_type 1: causal from the top left of each sequence.
            o = std::get<0>(at::_efficient_attention_forward(q->unsqueeze(0), k->unsqueeze(0), v->unsqueeze(0),
                                                             std::nullopt, *cu, *cu, max_len, max_len, 0.0, 1,
                                                             /*compute_log_sumexp=*/true))
                    .squeeze(0);
        }
        *out = new at::Tensor(std::move(o));
        return nullptr;
    } catch (const std::exception &e) {
        return strdup(e.what());
    }
}
}
