"""peft reference for ferl's LoRA parity tests (trainer/core/tests/lora_peft.rs).

A tiny fp32 Qwen2 and its SFT samples are made by parity_reference.py's `make` (hidden 64, 2 layers, GQA 4/2, vocab
256, --samples samples of 8..--max-len tokens), then wrapped with
`peft.get_peft_model(LoraConfig(r, lora_alpha, target_modules="all-linear", lora_dropout=0.0, bias="none"))`.

Subcommands:
  train  --out DIR --settings FILE [--count K]
         every `lora_B` is set to seeded normal * 0.02 (so the adapter matters) and the adapter saved to
         DIR/adapter_start; parity_reference's loop trains it (settings, batches and loss as there) and writes
         DIR/reference.json (per-step loss, grad_norm over the adapters before clipping, lr), DIR/adapter_trained
         (`save_pretrained`) and DIR/merged.safetensors (`merge_and_unload()`'s state dict). Then prints `ready` and
         serves: each line of stdin names an adapter folder; the base model with `PeftModel.from_pretrained(base,
         folder)` writes folder/logits.bin (fp32 logits of the first K samples, as parity_reference's `logits`) and
         `done` is printed. Ends with stdin.
  fresh  --out DIR --settings FILE
         peft's default init (Kaiming-uniform A, zero B) saved to DIR/adapter_fresh, then trained as by `train`
         (DIR/reference.json; its first loss is the base model's).
  serve  --out DIR --settings FILE [--count K]
         makes the tiny model and samples, then serves adapter folders as `train` does (for adapters ferl wrote
         from scratch, never made by peft).
Common: --rank R --alpha A --seed S --tie 0|1 --samples N --max-len L --threads T
"""
import argparse
import json
import os
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import parity_reference as ref  # noqa: E402


def make(a):
    """The tiny model and samples (parity_reference's `make`) in a.out."""
    m = argparse.Namespace(
        out=a.out,
        vocab=256,
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        head_dim=0,
        tie=a.tie,
        arch="qwen2",
        init_range=0.02,
        rope="",
        legacy_rope=0,
        max_shard_size="",
        min_len=8,
        max_len=a.max_len,
        seed=a.seed,
        samples=a.samples,
    )
    ref.make(m)
    return os.path.join(a.out, "model"), json.load(open(os.path.join(a.out, "data.json")))


def base_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def lora_model(a, model_dir):
    """The base model with a fresh peft LoRA (seeded: A from peft's init, B zero)."""
    import peft

    torch.manual_seed(a.seed + 2)
    cfg = peft.LoraConfig(r=a.rank, lora_alpha=a.alpha, target_modules="all-linear", lora_dropout=0.0, bias="none")
    return peft.get_peft_model(base_model(model_dir), cfg)


def train(a):
    model_dir, samples = make(a)
    s = json.load(open(a.settings))
    model = lora_model(a, model_dir)
    gen = torch.Generator().manual_seed(a.seed + 3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    model.save_pretrained(os.path.join(a.out, "adapter_start"))
    out = ref.train_loop(model, s, samples)
    json.dump(out, open(os.path.join(a.out, "reference.json"), "w"))
    model.save_pretrained(os.path.join(a.out, "adapter_trained"))
    merged = model.merge_and_unload()
    state = {k: v.detach().clone().contiguous() for k, v in merged.state_dict().items()}
    save_file(state, os.path.join(a.out, "merged.safetensors"))
    serve_adapters(a, model_dir, samples)


def serve_adapters(a, model_dir, samples):
    """Prints `ready`, then for each adapter folder named on stdin writes folder/logits.bin of the base model with
    `PeftModel.from_pretrained(base, folder)` and prints `done`."""
    print("ready", flush=True)
    from peft import PeftModel

    for line in sys.stdin:
        folder = line.strip()
        model = PeftModel.from_pretrained(base_model(model_dir), folder)
        ref.write_logits(model, samples[: a.count], os.path.join(folder, "logits.bin"))
        print("done", flush=True)


def serve(a):
    model_dir, samples = make(a)
    serve_adapters(a, model_dir, samples)


def fresh(a):
    model_dir, samples = make(a)
    s = json.load(open(a.settings))
    model = lora_model(a, model_dir)
    model.save_pretrained(os.path.join(a.out, "adapter_fresh"))
    out = ref.train_loop(model, s, samples)
    json.dump(out, open(os.path.join(a.out, "reference.json"), "w"))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("cmd", choices=["train", "fresh", "serve"])
    p.add_argument("--out", required=True)
    p.add_argument("--settings", required=True)
    p.add_argument("--count", type=int, default=2)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tie", type=int, default=1)
    p.add_argument("--samples", type=int, default=48)
    p.add_argument("--max-len", type=int, default=24)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.use_deterministic_algorithms(True)
    {"train": train, "fresh": fresh, "serve": serve}[a.cmd](a)


if __name__ == "__main__":
    main()
