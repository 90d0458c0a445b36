"""TRL's GRPOTrainer on ferl's digit task (the peer of `ferl-bench rl --learn`): the same model folder (tokenizer and
chat template in it), prompts, exact-match reward, batch, group size, mini- and micro-batches, PPO epochs, learning
rate, KL coefficient, clip ratios and threads as the `ferl grpo` runs beside it. Prints one JSON object: the mean
reward of each generation batch with the seconds since training began, and the seconds to the first batch whose mean
reward reaches the goal."""

import argparse
import json
import time

import torch


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--mini", type=int, default=5)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--beta", type=float, default=0.001)
    p.add_argument("--generations", type=int, default=20)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--goal", type=float, default=0.8)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    started = time.time()
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cfg = json.load(open(f"{a.model}/tokenizer_config.json"))
    tok = PreTrainedTokenizerFast(
        tokenizer_file=f"{a.model}/tokenizer.json",
        bos_token=cfg["bos_token"], eos_token=cfg["eos_token"], pad_token=cfg["pad_token"],
    )
    tok.chat_template = cfg["chat_template"]
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    rows = [json.loads(line) for line in open(a.data)]
    data = Dataset.from_list(
        [{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]} for r in rows]
    )

    def exact_match(completions, ground_truth, **_):
        return [float(c[0]["content"].strip() == g.strip()) for c, g in zip(completions, ground_truth)]

    rows_per_mini = a.mini * a.n
    steps_per_generation = a.prompts // a.mini
    config = GRPOConfig(
        output_dir=f"{a.out}.trainer",
        per_device_train_batch_size=rows_per_mini,
        steps_per_generation=steps_per_generation,
        num_generations=a.n,
        max_completion_length=1,
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=a.beta,
        num_iterations=a.epochs,
        epsilon=0.2,
        epsilon_high=0.28,
        scale_rewards="group",
        temperature=1.0,
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=a.seed,
        max_steps=a.generations * steps_per_generation * a.epochs,
        disable_dropout=True,
        dataloader_num_workers=0,
    )
    curve = []

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            self.t0 = time.time()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                curve.append([state.global_step, time.time() - self.t0, logs["reward"]])

    clock = Clock()
    trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=config, train_dataset=data,
                          processing_class=tok, callbacks=[clock])
    setup_s = time.time() - started
    trainer.train()
    # TRL logs a generation batch's mean reward once, on the first optimizer step it serves.
    batches = curve
    reached = next((s for _, s, r in batches if r >= a.goal), None)
    json.dump({"setup_s": setup_s, "curve": batches, "reached_s": reached}, open(a.out, "w"))


if __name__ == "__main__":
    main()
