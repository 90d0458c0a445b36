// A vector-Jacobian product with explicit output gradients, which tch does not expose (its `run_backward` takes
// scalar roots only): `torch.autograd.grad(outputs, inputs, grad_outputs)`. Unlike seeding with `(out * grad).sum()`,
// it never reads the outputs' values, so a caller may free them between forward and backward.
#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/autograd.h>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <vector>

extern "C" {

// The gradients of `outputs` (`n` of them, weighted by `grads`) with respect to `inputs` (`m`, each requiring grad),
// the graph freed afterwards: `out[i]` receives a new tensor (undefined where `inputs[i]` is unused). Returns null on
// success or a malloc'd message (freed by ferl_storage_message_free).
char *ferl_vjp(const at::Tensor *const *outputs, const at::Tensor *const *grads, int64_t n,
               const at::Tensor *const *inputs, int64_t m, at::Tensor **out) {
    try {
        std::vector<at::Tensor> outs, gs, ins;
        for (int64_t i = 0; i < n; ++i) {
            outs.push_back(*outputs[i]);
            gs.push_back(*grads[i]);
        }
        for (int64_t i = 0; i < m; ++i) {
            ins.push_back(*inputs[i]);
        }
        auto result = torch::autograd::grad(outs, ins, gs, /*retain_graph=*/false, /*create_graph=*/false,
                                            /*allow_unused=*/true);
        for (int64_t i = 0; i < m; ++i) {
            out[i] = new at::Tensor(result[i]);
        }
        return nullptr;
    } catch (const std::exception &e) {
        return strdup(e.what());
    }
}

}  // extern "C"
