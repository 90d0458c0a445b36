"""PyTorch reference of one actor update's loss and gradient for ferl's RL test (trainer/rl/tests/actor_step.rs).

A transformers model (from `parity_reference.py make`) scores the samples' target tokens (the response), and verl's
actor loss (rl_reference.py's formulas: the clipped policy loss, the entropy bonus, the KL loss, `agg_loss`) is
back-propagated once. Writes the loss, its terms, the per-token log-probabilities and the gradient's global L2 norm.

Usage: python actor_step_reference.py --model DIR --data FILE --inputs FILE --out FILE
INPUTS: {"old_log_prob", "advantages", "ref_log_prob": [n floats in target-row order], "cfg": {...}}
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rl_reference import agg_loss, entropy_from_logits, kl_penalty, policy_loss  # noqa: E402


def left_aligned(values, lengths):
    """[n] values (sample by sample) as a [batch, width] matrix and its mask."""
    width = max(max(lengths), 1)
    mat = torch.zeros(len(lengths), width)
    mask = torch.zeros(len(lengths), width)
    start = 0
    for i, n in enumerate(lengths):
        mat[i, :n] = values[start:start + n]
        mask[i, :n] = 1
        start += n
    return mat, mask


def main():
    p = argparse.ArgumentParser()
    for k in ("--model", "--data", "--inputs", "--out"):
        p.add_argument(k, required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    samples = json.load(open(a.data))
    inp = json.load(open(a.inputs))
    cfg = inp["cfg"]
    width = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    attn = torch.zeros(len(samples), width, dtype=torch.long)
    tmask = torch.zeros(len(samples), width, dtype=torch.bool)
    for i, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[i, :n] = torch.tensor(s["input_ids"])
        attn[i, :n] = 1
        tmask[i, :n] = torch.tensor(s["loss_mask"])
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits.float()[:, :-1]
    targets, rows = ids[:, 1:], tmask[:, 1:]
    lp_all = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    lengths = rows.sum(dim=1).tolist()
    log_prob, mask = left_aligned(lp_all[rows], lengths)
    entropy, _ = left_aligned(entropy_from_logits(logits)[rows], lengths)
    old, _ = left_aligned(torch.tensor(inp["old_log_prob"]), lengths)
    adv, _ = left_aligned(torch.tensor(inp["advantages"]), lengths)
    ref, _ = left_aligned(torch.tensor(inp["ref_log_prob"]), lengths)
    mode = cfg["loss_agg_mode"]
    pg, clipfrac, ppo_kl, _ = policy_loss(
        old, log_prob, adv, mask, mode, cfg["clip_ratio"], cfg["clip_ratio_low"], cfg["clip_ratio_high"],
        cfg["clip_ratio_c"], {})
    ent = agg_loss(entropy, mask, mode)
    kl = agg_loss(kl_penalty(log_prob, ref, cfg["kl_loss_type"]), mask, mode)
    loss = pg - ent * cfg["entropy_coeff"] + kl * cfg["kl_loss_coef"]
    loss.backward()
    norm = torch.sqrt(sum((q.grad.double() ** 2).sum() for q in model.parameters() if q.grad is not None))
    out = {"loss": loss.item(), "pg_loss": pg.item(), "pg_clipfrac": clipfrac.item(), "ppo_kl": ppo_kl.item(),
           "entropy": ent.item(), "kl_loss": kl.item(), "grad_norm": norm.item(),
           "log_prob": lp_all[rows].tolist()}
    json.dump(out, open(a.out, "w"))


if __name__ == "__main__":
    main()
