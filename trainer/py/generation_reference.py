"""transformers reference for ferl's generation and scoring tests (trainer/core/tests/generation.rs).

  session --out DIR [make options of parity_reference.py] --prompts N --new-tokens M
      1. makes a tiny random model with parity_reference.make (DIR/model) and N random prompts of 3 to 24 tokens
         (DIR/prompts.json);
      2. generates greedily for every prompt alone (batch 1, no padding) with eos disabled, then picks as EOS the
         token found in the responses of the number of prompts closest to N/2, writes it to
         DIR/model/generation_config.json (eos_token_id, pad_token_id) and generates greedily again with
         `model.generate(do_sample=False, max_new_tokens=M)`, which stops a prompt at that token (kept);
      3. writes DIR/greedy.json: {"eos": [...], "responses": [[...], ...], "margins": [min top1-top2 logit gap]};
      4. prints `ready`, then for each stdin line `score IN OUT T` writes to OUT, for each {"prompt", "response"} of
         IN, the response tokens' log_softmax(logits / T) and the entropy of softmax(logits / T) (fp32, each
         sequence alone, one forward pass), and prints `done`.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from parity_reference import make  # noqa: E402


def make_prompts(a):
    gen = torch.Generator().manual_seed(a.seed + 2)
    prompts = []
    for _ in range(a.prompts):
        n = int(torch.randint(3, 25, (1,), generator=gen))
        prompts.append(torch.randint(0, a.vocab, (n,), generator=gen).tolist())
    return prompts


def greedy(model, prompts, new_tokens):
    """Greedy responses of each prompt alone and the smallest top-1/top-2 logit gap of each."""
    responses, margins = [], []
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
        )
        responses.append(out.sequences[0, len(p):].tolist())
        top2 = torch.cat([l.float() for l in out.logits]).topk(2, dim=-1).values
        margins.append(float((top2[:, 0] - top2[:, 1]).min()))
    return responses, margins


def pick_eos(responses):
    """The token in the responses of the number of prompts closest to half of them (smallest id on ties)."""
    seen = {}
    for r in responses:
        for t in set(r):
            seen[t] = seen.get(t, 0) + 1
    half = len(responses) / 2
    return min(seen, key=lambda t: (abs(seen[t] - half), t))


def session(a):
    make(a)
    model_dir = os.path.join(a.out, "model")
    prompts = make_prompts(a)
    json.dump(prompts, open(os.path.join(a.out, "prompts.json"), "w"))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gc = model.generation_config
    gc.eos_token_id, gc.pad_token_id, gc.bos_token_id = None, 0, None
    gc.do_sample, gc.temperature, gc.top_k, gc.top_p = False, 1.0, None, None
    free, _ = greedy(model, prompts, a.new_tokens)
    eos = [pick_eos(free)]
    gc.eos_token_id = eos
    gc.save_pretrained(model_dir)
    responses, margins = greedy(model, prompts, a.new_tokens)
    out = {"eos": eos, "responses": responses, "margins": margins}
    json.dump(out, open(os.path.join(a.out, "greedy.json"), "w"))
    print("ready", flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd, src, dst, temperature = line.split()
        assert cmd == "score", line
        json.dump(score(model, json.load(open(src)), float(temperature)), open(dst, "w"))
        print("done", flush=True)


def score(model, seqs, temperature):
    result = []
    with torch.no_grad():
        for s in seqs:
            prompt, response = s["prompt"], s["response"]
            ids = torch.tensor([prompt + response])
            logits = model(input_ids=ids, use_cache=False).logits[0].float()
            rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(response)] / temperature
            ls = torch.log_softmax(rows, dim=-1)
            lp = ls.gather(1, torch.tensor(response).unsqueeze(1)).squeeze(1)
            entropy = -(ls.exp() * ls).sum(-1)
            result.append({"log_probs": lp.tolist(), "entropy": entropy.tolist()})
    return result


def main():
    p = argparse.ArgumentParser()
    p.add_argument("cmd", choices=["session"])
    p.add_argument("--out", required=True)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--tie", type=int, default=1)
    p.add_argument("--arch", choices=["qwen2", "qwen3", "llama"], default="qwen2")
    p.add_argument("--head-dim", type=int, default=0)
    p.add_argument("--init-range", type=float, default=0.2)
    p.add_argument("--rope", default="")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    # What parity_reference.make reads besides the model's shape: one dummy SFT sample, no sharding, modern RoPE.
    a.samples, a.min_len, a.max_len, a.max_shard_size, a.legacy_rope = 1, 8, 8, "", 0
    torch.set_num_threads(a.threads)
    torch.use_deterministic_algorithms(True)
    session(a)


if __name__ == "__main__":
    main()
