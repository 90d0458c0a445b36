"""PyTorch FSDP2 peer of `ferl-bench train --nproc-per-node N` (CPU, gloo backend).

  python fsdp2_reference.py --world N --model DIR --data FILE --settings FILE --out-dir DIR --threads T

starts N ranks (this script again, with torchrun's RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT variables; run it inside
`unshare -n` so the ranks' sockets stay in a private network namespace). Every rank:
- loads the same Hugging Face model (fp32) and shards it with `torch.distributed.fsdp.fully_shard`: each decoder
  layer, then the root (embedding, final norm and the tied output matrix), on a 1-D CPU mesh over gloo;
- trains on its contiguous slice of each global batch (the split ferl's data loader makes), in micro-batches, with the
  loss summed over targets and divided by the global batch's target count; FSDP2 averages gradients over ranks, so the
  loss is multiplied by the world size to keep the exact global token-mean (what ferl computes);
- clips the global gradient norm, steps AdamW (constant lr), and writes DIR/rank_R.json with per-step wall times, the
  global batch's real tokens, the global loss, and the process's peak resident set (`ru_maxrss`, KiB).
The launcher (no --rank-child) waits for the ranks and fails if any fails.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from parity_reference import micro_batch_loss  # noqa: E402


def rank_slice(n, rank, world):
    """Contiguous split of n items over world ranks, the first n % world ranks one longer (ferl's rank_shard)."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def rank_main(a):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(a.threads)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    s = json.load(open(a.settings))
    samples = json.load(open(a.data))
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    if s.get("gradient_checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(
        model.parameters(), lr=s["lr"], betas=tuple(s["betas"]), weight_decay=s["weight_decay"], eps=1e-8
    )
    bs, mbs = s["train_batch_size"], s["micro_batch_size"]
    out = {"tokens": [], "step_s": [], "loss": []}
    for step in range(s["total_steps"]):
        batch = samples[step * bs : (step + 1) * bs]
        targets = sum(sum(x["loss_mask"][1:]) for x in batch)
        tokens = sum(len(x["input_ids"]) for x in batch)
        lo, hi = rank_slice(len(batch), rank, world)
        mine = batch[lo:hi]
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = 0.0
        for i in range(0, len(mine), mbs):
            l, _ = micro_batch_loss(model, mine[i : i + mbs], targets)
            (l * world).backward()
            loss += l.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), s["clip_grad"])
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        if torch.isfinite(norm):
            opt.step()
        total = torch.tensor([loss], dtype=torch.float64)
        dist.all_reduce(total)
        out["step_s"].append(time.perf_counter() - t0)
        out["tokens"].append(tokens)
        out["loss"].append(float(total[0]))
    out["peak_rss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with open(os.path.join(a.out_dir, f"rank_{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def launch(a):
    procs = []
    for rank in range(a.world):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(a.world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(a.port),
        )
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank-child", *sys.argv[1:]], env=env))
    codes = [p.wait() for p in procs]
    if any(codes):
        sys.exit(f"fsdp2_reference: rank exit codes {codes}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--settings", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--rank-child", action="store_true")
    a = p.parse_args()
    if a.rank_child:
        rank_main(a)
    else:
        launch(a)


if __name__ == "__main__":
    main()
