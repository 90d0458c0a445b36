"""PyTorch/transformers reference for ferl's parity tests and the train benchmark.

Subcommands (all deterministic, threads set by --threads):
  make    --out DIR --vocab V --hidden H --layers L --heads N --kv-heads K --tie 0|1 --seed S --samples M
          writes a tiny Qwen2, Qwen3 or Llama (--arch; transformers, randomly initialised then perturbed so norms and
          biases are not trivial) to DIR/model and random SFT samples (input_ids, loss_mask) to DIR/data.json.
          Optional: --head-dim D, --init-range R, --rope JSON (rope_scaling, e.g. {"rope_type": "llama3", ...}),
          --legacy-rope 1 (rewrite config.json as `rope_scaling` with `type` + top-level `rope_theta`, the pre-5
          form), --max-shard-size S (sharded safetensors), --min-len/--max-len (sample lengths)
  train   --model DIR --data FILE --settings FILE --out FILE
          trains with a plain PyTorch loop (same batches, micro-batching, token-mean loss over the global batch,
          AdamW, verl's schedule, clipping) and writes per-step loss / grad_norm / lr as JSON.
          Optional: --lora-rank R [--lora-alpha A] trains peft LoRA adapters instead (target_modules all-linear,
          dropout 0, base frozen; AdamW and clipping over the trainable parameters only)
  logits  --model DIR --data FILE --count K --out FILE   fp32 logits of the first K samples (one at a time), written
          back to back as raw little-endian float32 ([tokens, vocab] each)
  case    --out DIR --settings FILE [make options]   make, then DIR/logits.bin (logits of the first --count samples)
          and DIR/reference.json (train with the settings), in one process
"""
import argparse
import json
import math
import os
import resource
import time

import torch
import torch.nn.functional as F


def make(a):
    import transformers as tf

    torch.manual_seed(a.seed)
    name = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[a.arch]
    config_cls, model_cls = getattr(tf, name + "Config"), getattr(tf, name + "ForCausalLM")
    rope = {"rope_scaling": json.loads(a.rope)} if a.rope else {}
    cfg = config_cls(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=a.hidden * 3,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        head_dim=a.head_dim or a.hidden // a.heads,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=bool(a.tie),
        use_cache=False,
        initializer_range=a.init_range,
        dtype="float32",
        **rope,
    )
    model = model_cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.02)
    os.makedirs(a.out, exist_ok=True)
    shards = {"max_shard_size": a.max_shard_size} if a.max_shard_size else {}
    model.save_pretrained(os.path.join(a.out, "model"), **shards)
    if a.legacy_rope:
        legacy_rope_config(os.path.join(a.out, "model", "config.json"))
    gen = torch.Generator().manual_seed(a.seed + 1)
    samples = []
    for _ in range(a.samples):
        n = int(torch.randint(a.min_len, a.max_len + 1, (1,), generator=gen))
        prompt = int(torch.randint(2, n - 2, (1,), generator=gen))
        ids = torch.randint(0, a.vocab, (n,), generator=gen).tolist()
        samples.append({"input_ids": ids, "loss_mask": [i >= prompt for i in range(n)]})
    with open(os.path.join(a.out, "data.json"), "w") as f:
        json.dump(samples, f)


def legacy_rope_config(path):
    """Rewrites transformers 5's `rope_parameters` as the older `rope_scaling` (with `type`) + top-level `rope_theta`."""
    c = json.load(open(path))
    params = c.pop("rope_parameters")
    c["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    c["rope_scaling"] = params
    json.dump(c, open(path, "w"), indent=2)


def case(a):
    make(a)
    a.model, a.data = os.path.join(a.out, "model"), os.path.join(a.out, "data.json")
    out = a.out
    a.out = os.path.join(out, "logits.bin")
    logits(a)
    a.out = os.path.join(out, "reference.json")
    train(a)


def lr_factor(s, step):
    warm = int(s["total_steps"] * s["warmup_ratio"])
    if step < warm:
        return step / max(1, warm)
    if s["scheduler"] == "constant":
        return 1.0
    mn = s["min_lr_ratio"]
    progress = (step - warm) / max(1, s["total_steps"] - warm)
    x = math.cos(math.pi * 0.5 * 2.0 * progress)
    return max(mn, x * (1 - mn) * 0.5 + (1 + mn) * 0.5)


def micro_batch_loss(model, chunk, global_targets):
    width = max(len(x["input_ids"]) for x in chunk)
    ids = torch.zeros(len(chunk), width, dtype=torch.long)
    attn = torch.zeros(len(chunk), width, dtype=torch.long)
    mask = torch.zeros(len(chunk), width, dtype=torch.bool)
    for i, x in enumerate(chunk):
        n = len(x["input_ids"])
        ids[i, :n] = torch.tensor(x["input_ids"])
        attn[i, :n] = 1
        mask[i, :n] = torch.tensor(x["loss_mask"])
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits.float()
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
    return (ce * mask[:, 1:].reshape(-1)).sum() / global_targets, int(attn.sum())


def train(a):
    import transformers
    from transformers import AutoModelForCausalLM

    s = json.load(open(a.settings))
    samples = json.load(open(a.data))
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    peer = f"transformers {transformers.__version__}, {model.config._attn_implementation} attention, fp32, eager"
    if s.get("gradient_checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if a.lora_rank:
        import peft

        lora = peft.LoraConfig(
            r=a.lora_rank, lora_alpha=a.lora_alpha, target_modules="all-linear", lora_dropout=0.0, bias="none"
        )
        model = peft.get_peft_model(model, lora)
        peer = f"{peer} + peft {peft.__version__} LoRA r={a.lora_rank} alpha={a.lora_alpha:g} all-linear"
    out = train_loop(model, s, samples)
    out["peak_rss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out["peer"] = f"{peer}, {torch.get_num_threads()} threads"
    json.dump(out, open(a.out, "w"))


def train_loop(model, s, samples):
    """`train`'s loop: trains the parameters of `model` that require grad (all, or e.g. peft's adapters) for
    `s["total_steps"]` steps; returns per-step loss, grad_norm (over those parameters, before clipping), lr and
    throughput."""
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s["lr"], betas=tuple(s["betas"]), weight_decay=s["weight_decay"], eps=1e-8)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(s, step))
    bs, mbs = s["train_batch_size"], s["micro_batch_size"]
    out = {"loss": [], "grad_norm": [], "lr": [], "tokens_per_s": [], "tokens": [], "step_s": []}
    times = []
    for step in range(s["total_steps"]):
        start = (step * bs) % len(samples)
        batch = [samples[(start + i) % len(samples)] for i in range(bs)]
        targets = sum(sum(x["loss_mask"][1:]) for x in batch)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss, tokens = 0.0, 0
        for i in range(0, bs, mbs):
            l, n = micro_batch_loss(model, batch[i : i + mbs], targets)
            l.backward()
            loss += l.item()
            tokens += n
        norm = torch.nn.utils.clip_grad_norm_(params, s["clip_grad"])
        lr = sched.get_last_lr()[0]
        if torch.isfinite(norm):
            opt.step()
        sched.step()
        dt = time.perf_counter() - t0
        times.append(dt)
        out["loss"].append(loss)
        out["grad_norm"].append(float(norm))
        out["lr"].append(lr)
        out["tokens_per_s"].append(tokens / dt)
        out["tokens"].append(tokens)
        out["step_s"].append(dt)
    return out


def logits(a):
    from transformers import AutoModelForCausalLM

    samples = json.load(open(a.data))[: a.count]
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    write_logits(model, samples, a.out)


def write_logits(model, samples, out):
    """Writes `model`'s fp32 logits of `samples` to the file `out` as `logits` describes."""
    model.eval()
    with torch.no_grad(), open(out, "wb") as f:
        for x in samples:
            ids = torch.tensor([x["input_ids"]])
            f.write(model(input_ids=ids, use_cache=False).logits[0].float().contiguous().numpy().tobytes())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("cmd", choices=["make", "train", "logits", "case"])
    p.add_argument("--out")
    p.add_argument("--model")
    p.add_argument("--data")
    p.add_argument("--settings")
    p.add_argument("--count", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--tie", type=int, default=1)
    p.add_argument("--arch", choices=["qwen2", "qwen3", "llama"], default="qwen2")
    p.add_argument("--head-dim", type=int, default=0)
    p.add_argument("--init-range", type=float, default=0.02)
    p.add_argument("--rope", default="")
    p.add_argument("--legacy-rope", type=int, default=0)
    p.add_argument("--max-shard-size", default="")
    p.add_argument("--min-len", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--max-len", type=int, default=40)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lora-rank", type=int, default=0)
    p.add_argument("--lora-alpha", type=float, default=16.0)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.use_deterministic_algorithms(True)
    {"make": make, "train": train, "logits": logits, "case": case}[a.cmd](a)


if __name__ == "__main__":
    main()
