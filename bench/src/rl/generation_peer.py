"""transformers peer of `ferl-bench rl` (bench/src/rl/generation.rs): greedy batched generation with the KV cache.

  python generation_peer.py --model DIR --prompts FILE --new-tokens M --threads T --repeats R --out FILE

Loads the Hugging Face folder DIR in fp32 (transformers' default attention), left-pads the prompts of FILE (a JSON list
of token-id lists) into one batch with an attention mask, runs one short warm-up generation (8 new tokens of the first
two prompts, not timed), then R times `model.generate(do_sample=False, max_new_tokens=M, min_new_tokens=M)` with no
EOS token (every sequence gets exactly M tokens), timing only the `generate` call. Writes to --out: {"gen_s": [...],
"tokens": [[...], ...]} (the last repeat's new tokens per prompt) and "peer" (versions and attention implementation).
"""
import argparse
import json
import time

import torch

WARMUP_TOKENS = 8


def batch(prompts, pad):
    """Left-padded input ids and attention mask of `prompts`."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    return ids, mask


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--new-tokens", type=int, required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    import transformers
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    gc = model.generation_config
    gc.eos_token_id, gc.bos_token_id, gc.pad_token_id = None, None, 0
    gc.do_sample, gc.temperature, gc.top_k, gc.top_p = False, 1.0, None, None
    gc.use_cache = True
    ids, mask = batch(json.load(open(a.prompts)), 0)

    def generate(n, rows):
        with torch.inference_mode():
            return model.generate(
                ids[:rows], attention_mask=mask[:rows], do_sample=False, max_new_tokens=n, min_new_tokens=n
            )

    generate(WARMUP_TOKENS, 2)
    times, out = [], None
    for _ in range(a.repeats):
        start = time.perf_counter()
        out = generate(a.new_tokens, len(ids))
        times.append(time.perf_counter() - start)
    tokens = out[:, ids.shape[1]:].tolist()
    peer = (
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"attention {model.config._attn_implementation}, {torch.get_num_threads()} threads"
    )
    json.dump({"gen_s": times, "tokens": tokens, "peer": peer}, open(a.out, "w"))


if __name__ == "__main__":
    main()
