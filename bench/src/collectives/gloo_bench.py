# Peer measurement for `ferl-bench collectives`: torch.distributed's gloo backend, 2 processes on loopback, fp32, the
# same sizes, iteration counts and bus-bandwidth formula as the ferl side. Prints `ROW name value unit` from rank 0.
# Usage: python gloo_bench.py LABEL=BYTES [LABEL=BYTES ...]   (run inside `unshare -n` so it only sees loopback)
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def iterations(nbytes):
    return max(5, min(2000, (256 << 20) // nbytes))


def timed(fn, nbytes):
    for _ in range(20 if nbytes <= (64 << 10) else 2):
        fn()
    dist.barrier()
    iters = iterations(nbytes)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def run(rank, sizes):
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29500", rank=rank, world_size=WORLD)
    for label, nbytes in sizes:
        n = nbytes // 4
        t = torch.ones(n)
        part = torch.ones(n // WORLD)
        full = torch.empty(n)
        out = torch.empty(n // WORLD)
        results = {
            "all_reduce": (timed(lambda: dist.all_reduce(t), nbytes), 2 * (WORLD - 1) / WORLD),
            "all_gather": (timed(lambda: dist.all_gather_into_tensor(full, part), nbytes), (WORLD - 1) / WORLD),
            "reduce_scatter": (timed(lambda: dist.reduce_scatter_tensor(out, t), nbytes), (WORLD - 1) / WORLD),
        }
        if rank == 0:
            for op, (seconds, factor) in results.items():
                print(f"ROW {op}_{label}_GBps {nbytes / seconds * factor / 1e9} GB/s", flush=True)
                if nbytes <= (64 << 10):
                    print(f"ROW {op}_{label}_us {seconds * 1e6} us", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    parsed = [(a.split("=")[0], int(a.split("=")[1])) for a in sys.argv[1:]]
    mp.spawn(run, args=(parsed,), nprocs=WORLD)
