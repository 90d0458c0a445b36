"""GPU check of trainer/core/csrc/storage.cpp (FULL_SHARD's free-after-forward, design note 14) on CUDA.

Compiles the C++ file with torch's extension builder (ninja, g++; no CUDA code in it) and, on a CUDA device:
1. builds a two-layer graph whose weights are views of one flat "gathered" buffer, keeps it, frees the buffer's
   bytes (the caching allocator's allocated bytes must fall by the buffer's size), refills it from a fresh buffer
   (the allocation moves over: no new bytes), and back-propagates: gradients bit-identical to never freeing;
2. the same with a refill that must copy (source a view of a larger buffer);
3. runs 8 "layers" keeping their graphs, with and without freeing each layer's buffer after its forward: with every
   graph alive, the allocator holds exactly the 8 layers' parameter bytes less when they were freed.
Prints `STORAGE GPU CHECK PASSED` or raises. Usage: python3 trainer/py/storage_gpu_check.py
"""

import os
import sys

import torch
from torch.utils.cpp_extension import load_inline

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = open(os.path.join(HERE, "..", "csrc", "storage.cpp")).read()
BINDINGS = r"""
int64_t nbytes(const at::Tensor& t) { return ferl_storage_nbytes(&t); }
int64_t free_(const at::Tensor& t) { return ferl_storage_free(&t); }
bool refill(const at::Tensor& dst, const at::Tensor& src) {
    int stolen = 0;
    char* err = ferl_storage_refill(&dst, &src, &stolen);
    if (err) { std::string m(err); ferl_storage_message_free(err); throw std::runtime_error(m); }
    return stolen != 0;
}
"""


def build():
    return load_inline(
        name="ferl_storage_check",
        cpp_sources=[SRC + BINDINGS],
        functions=["nbytes", "free_", "refill"],
        extra_cflags=["-O1"],
        verbose=False,
    )


def forward(flat, x):
    w1 = flat[:4096].view(64, 64).detach().requires_grad_(True)
    w2 = flat[4096:8192].view(64, 64).detach().requires_grad_(True)
    y = torch.tanh(x @ w1) @ w2
    return (y * y).sum(), [w1, w2]


def kept_layers(ext, layers, x, free):
    """Bytes allocated with every layer's graph kept (each layer's buffer freed after its forward when `free`), and
    the layers' gradients."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    h, kept = x, []
    for v in layers:
        flat = v.clone()
        w1 = flat[:4096].view(64, 64).detach().requires_grad_(True)
        w2 = flat[4096:].view(64, 64).detach().requires_grad_(True)
        out = torch.tanh(h.detach().requires_grad_(True) @ w1) @ w2
        if free:
            ext.free_(flat)
        kept.append((out, w1, w2, flat, v))
        h = out
    held = torch.cuda.memory_allocated() - base
    grads = []
    for out, w1, w2, flat, v in reversed(kept):
        if free:
            assert ext.refill(flat, v.clone())
        grads += torch.autograd.grad(out.sum(), [w1, w2])
    return held, grads


def main():
    assert torch.cuda.is_available(), "no CUDA device"
    ext = build()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    values = torch.randn(8192, device=dev)
    x = torch.randn(32, 64, device=dev)
    loss, leaves = forward(values.clone(), x)
    want = torch.autograd.grad(loss, leaves)
    for steal in (True, False):
        flat = values.clone()
        loss, leaves = forward(flat, x)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        assert ext.free_(flat) == 8192 * 4
        after = torch.cuda.memory_allocated()
        assert ext.nbytes(leaves[0]) == 0
        assert before - after == 8192 * 4, f"freeing released {before - after} bytes, not {8192 * 4}"
        src = values.clone() if steal else torch.cat([values, values])[8192:]
        assert ext.refill(flat, src) == steal
        del src
        got = torch.autograd.grad(loss, leaves)
        for g, w in zip(got, want):
            assert torch.equal(g, w), f"steal={steal}: gradients differ after free + refill"
        print(f"steal={steal}: freed {before - after} bytes under a kept graph; gradients bit-identical")
    # Eight layers with kept graphs, each freed after its forward (or not) and refilled for its backward.
    layers = [torch.randn(8192, device=dev) for _ in range(8)]
    (kept, want), (freed, got) = (kept_layers(ext, layers, x, free) for free in (False, True))
    assert all(torch.equal(g, w) for g, w in zip(got, want)), "8 layers: gradients differ after free + refill"
    held = {False: kept, True: freed}
    params = 8 * 8192 * 4
    print(f"8 layers' graphs kept: {held[False]} bytes held without freeing, {held[True]} with ({params} of parameters)")
    assert held[False] - held[True] == params, "freeing under kept graphs did not release every layer's parameters"
    print("STORAGE GPU CHECK PASSED")


if __name__ == "__main__":
    sys.exit(main())
