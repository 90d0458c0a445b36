"""PyTorch reference of verl's core_algos formulas for ferl's RL tests (trainer/rl/tests/rl_core_algos.rs).

Written from verl's `verl/trainer/ppo/core_algos.py` and `verl/utils/torch_functional.py` (GRPO and RLOO outcome
advantages, `agg_loss`, the `vanilla` clipped policy loss with dual clip, `kl_penalty` with the `+` straight-through
variants, `entropy_from_logits`, the actor's loss composition) as plain PyTorch, without verl installed.

Usage: python rl_reference.py INPUTS.json OUTPUTS.json
INPUTS holds the fixed float32 inputs (see the test) and the cases to compute; OUTPUTS maps each case name to its
values flattened to a list (scalars as one-element lists).
"""
import json
import sys
from collections import defaultdict

import torch

EPS_MEAN = 1e-8


def masked_sum(values, mask, dim=None):
    kept = torch.where(mask.bool(), values, torch.zeros_like(values)) * mask
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(values, mask, dim=None):
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / (count + EPS_MEAN)


def agg_loss(mat, mask, mode, dp_size=1, batch_num_tokens=None, global_batch_size=None):
    if mode == "token-mean":
        tokens = mask.sum() if batch_num_tokens is None else batch_num_tokens
        return masked_sum(mat, mask) / tokens * dp_size
    per_seq_tokens = mask.sum(dim=-1)
    seq = (mat * mask).sum(dim=-1)
    if mode == "seq-mean-token-mean":
        seq = seq / (per_seq_tokens + EPS_MEAN)
    elif mode != "seq-mean-token-sum":
        raise ValueError(mode)
    seq_mask = (per_seq_tokens > 0).float()
    seqs = seq_mask.sum() if global_batch_size is None else global_batch_size
    return masked_sum(seq, seq_mask) / seqs * dp_size


def group_stats(scores, index):
    by_uid = defaultdict(list)
    for i, uid in enumerate(index):
        by_uid[uid].append(scores[i])
    return by_uid


def grpo(rewards, mask, index, epsilon, norm_by_std):
    scores = rewards.sum(dim=-1)
    by_uid = group_stats(scores, index)
    mean, std = {}, {}
    for uid, vals in by_uid.items():
        if len(vals) == 1:
            mean[uid], std[uid] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            stacked = torch.stack(vals)
            mean[uid], std[uid] = stacked.mean(), stacked.std()
    out = scores.clone()
    for i, uid in enumerate(index):
        centred = scores[i] - mean[uid]
        out[i] = centred / (std[uid] + epsilon) if norm_by_std else centred
    return out.unsqueeze(-1) * mask


def rloo(rewards, mask, index):
    scores = rewards.sum(dim=-1)
    by_uid = group_stats(scores, index)
    mean = {uid: (torch.stack(v).mean() if len(v) > 1 else torch.tensor(0.0)) for uid, v in by_uid.items()}
    out = scores.clone()
    for i, uid in enumerate(index):
        n = len(by_uid[uid])
        if n > 1:
            out[i] = scores[i] * n / (n - 1) - mean[uid] * n / (n - 1)
    return out.unsqueeze(-1) * mask


def policy_loss(old, new, adv, mask, mode, clip, low, high, c, glob):
    low = clip if low is None else low
    high = clip if high is None else high
    neg_kl = torch.clamp(new - old, min=-20.0, max=20.0)
    ratio = torch.exp(neg_kl)
    ppo_kl = masked_mean(-neg_kl, mask)
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1 - low, 1 + high)
    c1 = torch.maximum(l1, l2)
    clipfrac = masked_mean(torch.gt(l2, l1).float(), mask)
    l3 = -adv * c
    c2 = torch.min(l3, c1)
    clipfrac_lower = masked_mean(torch.gt(c1, l3) * (adv < 0).float(), mask)
    losses = torch.where(adv < 0, c2, c1)
    return agg_loss(losses, mask, mode, **glob), clipfrac, ppo_kl, clipfrac_lower


def kl_forward(logp, ref, kind):
    if kind in ("k1", "kl"):
        return logp - ref
    if kind == "abs":
        return (logp - ref).abs()
    if kind in ("k2", "mse"):
        return 0.5 * (logp - ref).square()
    if kind in ("k3", "low_var_kl"):
        d = torch.clamp(ref - logp, min=-20, max=20)
        return torch.clamp(torch.exp(d) - d - 1, min=-10, max=10)
    raise ValueError(kind)


def kl_penalty(logp, ref, kind):
    base = kind[:-1] if kind.endswith("+") else kind
    fwd = kl_forward(logp, ref, base)
    if not kind.endswith("+") or base in ("k2", "mse"):
        return fwd
    bwd = 0.5 * (logp - ref).square()
    return bwd - bwd.detach() + fwd.detach()


def entropy_from_logits(logits):
    p = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(dim=-1)


def flat(t):
    return [float(x) for x in t.detach().reshape(-1).tolist()]


def tensor(inp, name):
    return torch.tensor(inp[name]["data"], dtype=torch.float32).reshape(inp[name]["shape"])


def main():
    inp = json.load(open(sys.argv[1]))
    mask = tensor(inp, "response_mask")
    rewards = tensor(inp, "token_level_rewards")
    old, ref, adv = tensor(inp, "old_log_prob"), tensor(inp, "ref_log_prob"), tensor(inp, "advantages")
    logits = tensor(inp, "logits")
    index = inp["index"]
    out = {}
    for k, (eps, norm) in enumerate(inp["grpo"]):
        out[f"grpo/{k}"] = flat(grpo(rewards, mask, index, eps, norm))
    out["rloo"] = flat(rloo(rewards, mask, index))
    out["entropy"] = flat(entropy_from_logits(logits))
    for case in inp["agg"]:
        g = case["global"]
        out[case["name"]] = flat(agg_loss(adv, mask, case["mode"], **g))
    for case in inp["policy"]:
        new = tensor(inp, "log_prob").requires_grad_(True)
        loss, clipfrac, ppo_kl, lower = policy_loss(
            old, new, adv, mask, case["mode"], case["clip_ratio"], case["clip_ratio_low"],
            case["clip_ratio_high"], case["clip_ratio_c"], case["global"])
        loss.backward()
        name = case["name"]
        out[name + "/pg_loss"] = flat(loss)
        out[name + "/pg_clipfrac"] = flat(clipfrac)
        out[name + "/ppo_kl"] = flat(ppo_kl)
        out[name + "/pg_clipfrac_lower"] = flat(lower)
        out[name + "/grad"] = flat(new.grad)
    for kind in inp["kl"]:
        new = tensor(inp, "log_prob").requires_grad_(True)
        kl = kl_penalty(new, ref, kind)
        kl.sum().backward()
        out[f"kl/{kind}"] = flat(kl)
        out[f"kl/{kind}/grad"] = flat(new.grad)
    for case in inp["actor"]:
        new = tensor(inp, "log_prob").requires_grad_(True)
        lg = logits.clone().requires_grad_(True)
        mode = case["mode"]
        pg, _, _, _ = policy_loss(old, new, adv, mask, mode, 0.2, None, None, 3.0, {})
        ent = agg_loss(entropy_from_logits(lg), mask, mode)
        kl = agg_loss(kl_penalty(new, ref, case["kl_loss_type"]), mask, mode)
        loss = pg - ent * case["entropy_coeff"] + kl * case["kl_loss_coef"]
        loss.backward()
        name = case["name"]
        out[name + "/loss"] = flat(loss)
        out[name + "/entropy"] = flat(ent)
        out[name + "/kl_loss"] = flat(kl)
        out[name + "/grad"] = flat(new.grad)
        out[name + "/logits_grad"] = flat(lg.grad)
    json.dump(out, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
