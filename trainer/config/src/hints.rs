//! Nearest-key hints for unknown config keys, ranked by meaning before spelling: first a table of known synonyms
//! ([`SYNONYMS`]: names other trainers use for verl's keys), then edit distance, which prefers keys in the same
//! section as the unknown key.

/// Names users bring from other trainers, with the verl key they mean: `(synonym, canonical key)`. A synonym
/// without a dot matches an unknown key's last segment (`trainer.epochs`, `epochs`); one with a dot matches the
/// whole key. Matching ignores ASCII case and treats `-` as `_`.
pub const SYNONYMS: &[(&str, &str)] = &[
    ("lr_warmup", "optim.lr_warmup_steps"),
    ("warmup_steps", "optim.lr_warmup_steps"),
    ("num_warmup_steps", "optim.lr_warmup_steps"),
    ("warmup", "optim.lr_warmup_steps"),
    ("warmup_ratio", "optim.lr_warmup_steps_ratio"),
    ("learning_rate", "optim.lr"),
    ("min_lr", "optim.min_lr_ratio"),
    ("scheduler", "optim.lr_scheduler"),
    ("lr_schedule", "optim.lr_scheduler"),
    ("grad_clip", "optim.clip_grad"),
    ("max_grad_norm", "optim.clip_grad"),
    ("clip_grad_norm", "optim.clip_grad"),
    ("gradient_clipping", "optim.clip_grad"),
    ("wd", "optim.weight_decay"),
    ("optim.name", "optim.optimizer"),
    ("optim.type", "optim.optimizer"),
    ("batch_size", "data.train_batch_size"),
    ("global_batch_size", "data.train_batch_size"),
    (
        "micro_batch_size_per_device",
        "data.micro_batch_size_per_gpu",
    ),
    (
        "per_device_train_batch_size",
        "data.micro_batch_size_per_gpu",
    ),
    ("max_token_len", "data.max_token_len_per_gpu"),
    ("ppo_max_token_len_per_gpu", "data.max_token_len_per_gpu"),
    ("dynamic_bsz", "data.use_dynamic_bsz"),
    ("seq_len", "data.max_length"),
    ("seq_length", "data.max_length"),
    ("max_seq_len", "data.max_length"),
    ("max_seq_length", "data.max_length"),
    ("cutoff_len", "data.max_length"),
    ("train_data", "data.train_files"),
    ("dataset", "data.train_files"),
    ("eval_files", "data.val_files"),
    ("test_files", "data.val_files"),
    ("dataloader_num_workers", "data.num_workers"),
    ("chat_template_kwargs", "data.apply_chat_template_kwargs"),
    ("epochs", "trainer.total_epochs"),
    ("num_epochs", "trainer.total_epochs"),
    ("num_train_epochs", "trainer.total_epochs"),
    ("max_epochs", "trainer.total_epochs"),
    ("max_steps", "trainer.total_training_steps"),
    ("total_steps", "trainer.total_training_steps"),
    ("train_steps", "trainer.total_training_steps"),
    ("output_dir", "trainer.default_local_dir"),
    ("save_dir", "trainer.default_local_dir"),
    ("checkpoint_dir", "trainer.default_local_dir"),
    ("save_steps", "trainer.save_freq"),
    ("eval_steps", "trainer.test_freq"),
    ("eval_freq", "trainer.test_freq"),
    ("val_freq", "trainer.test_freq"),
    ("report_to", "trainer.logger"),
    ("loggers", "trainer.logger"),
    ("random_seed", "trainer.seed"),
    ("resume_from_checkpoint", "trainer.resume_from_path"),
    ("num_nodes", "trainer.nnodes"),
    ("nproc_per_node", "trainer.n_gpus_per_node"),
    (
        "gradient_checkpointing",
        "model.enable_gradient_checkpointing",
    ),
    (
        "activation_checkpointing",
        "model.enable_gradient_checkpointing",
    ),
    ("model_name_or_path", "model.partial_pretrain"),
    ("model_path", "model.partial_pretrain"),
    ("pretrained_model", "model.partial_pretrain"),
    ("model.path", "model.partial_pretrain"),
    ("model.name", "model.partial_pretrain"),
    ("lora_r", "model.lora_rank"),
    ("use_liger_kernel", "model.use_liger"),
    ("sharding", "model.fsdp_config.sharding_strategy"),
    (
        "fsdp_sharding_strategy",
        "model.fsdp_config.sharding_strategy",
    ),
    ("dtype", "model.fsdp_config.model_dtype"),
    ("torch_dtype", "model.fsdp_config.model_dtype"),
    ("precision", "model.fsdp_config.model_dtype"),
    ("offload", "model.fsdp_config.cpu_offload"),
    ("sequence_parallel_size", "ulysses_sequence_parallel_size"),
    ("sp_size", "ulysses_sequence_parallel_size"),
    ("remove_padding", "use_remove_padding"),
    ("packing", "use_remove_padding"),
];

/// [`SYNONYMS`] for [`PpoConfig`](crate::PpoConfig): names users bring from other RL trainers (TRL, OpenRLHF) and
/// from verl's SFT config, with the PPO key they mean. Whole-key entries come first where a section has its own key
/// (`critic.lr`).
pub const PPO_SYNONYMS: &[(&str, &str)] = &[
    ("critic.lr", "critic.optim.lr"),
    ("critic.learning_rate", "critic.optim.lr"),
    ("critic.weight_decay", "critic.optim.weight_decay"),
    (
        "critic.ppo_micro_batch_size",
        "critic.ppo_micro_batch_size_per_gpu",
    ),
    (
        "reward_model.micro_batch_size",
        "reward_model.micro_batch_size_per_gpu",
    ),
    ("algorithm.kl_coef", "algorithm.kl_ctrl.kl_coef"),
    (
        "actor_rollout_ref.ref.param_offload",
        "actor_rollout_ref.ref.fsdp_config.param_offload",
    ),
    ("model.path", "actor_rollout_ref.model.path"),
    ("model.partial_pretrain", "actor_rollout_ref.model.path"),
    ("lr", "actor_rollout_ref.actor.optim.lr"),
    ("learning_rate", "actor_rollout_ref.actor.optim.lr"),
    ("actor_lr", "actor_rollout_ref.actor.optim.lr"),
    ("weight_decay", "actor_rollout_ref.actor.optim.weight_decay"),
    ("wd", "actor_rollout_ref.actor.optim.weight_decay"),
    (
        "warmup_steps",
        "actor_rollout_ref.actor.optim.lr_warmup_steps",
    ),
    (
        "lr_warmup_steps",
        "actor_rollout_ref.actor.optim.lr_warmup_steps",
    ),
    (
        "warmup_ratio",
        "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio",
    ),
    (
        "lr_warmup_steps_ratio",
        "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio",
    ),
    (
        "lr_scheduler",
        "actor_rollout_ref.actor.optim.lr_scheduler_type",
    ),
    (
        "scheduler",
        "actor_rollout_ref.actor.optim.lr_scheduler_type",
    ),
    ("batch_size", "data.train_batch_size"),
    ("global_batch_size", "data.train_batch_size"),
    ("rollout_batch_size", "data.train_batch_size"),
    ("prompts_per_step", "data.train_batch_size"),
    (
        "mini_batch_size",
        "actor_rollout_ref.actor.ppo_mini_batch_size",
    ),
    (
        "micro_batch_size_per_gpu",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    ),
    (
        "micro_batch_size",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    ),
    ("num_samples", "actor_rollout_ref.rollout.n"),
    ("n_samples", "actor_rollout_ref.rollout.n"),
    ("num_generations", "actor_rollout_ref.rollout.n"),
    ("num_return_sequences", "actor_rollout_ref.rollout.n"),
    ("group_size", "actor_rollout_ref.rollout.n"),
    ("rollout_n", "actor_rollout_ref.rollout.n"),
    ("temperature", "actor_rollout_ref.rollout.temperature"),
    ("max_new_tokens", "data.max_response_length"),
    ("max_tokens", "data.max_response_length"),
    ("max_completion_length", "data.max_response_length"),
    ("max_response_len", "data.max_response_length"),
    ("max_prompt_len", "data.max_prompt_length"),
    ("max_length", "data.max_prompt_length"),
    ("train_data", "data.train_files"),
    ("dataset", "data.train_files"),
    ("eval_files", "data.val_files"),
    ("test_files", "data.val_files"),
    ("epochs", "trainer.total_epochs"),
    ("num_epochs", "trainer.total_epochs"),
    ("num_train_epochs", "trainer.total_epochs"),
    ("max_steps", "trainer.total_training_steps"),
    ("total_steps", "trainer.total_training_steps"),
    ("beta", "actor_rollout_ref.actor.kl_loss_coef"),
    ("kl_coef", "actor_rollout_ref.actor.kl_loss_coef"),
    ("init_kl_coef", "actor_rollout_ref.actor.kl_loss_coef"),
    ("kl_estimator", "actor_rollout_ref.actor.kl_loss_type"),
    ("epsilon", "actor_rollout_ref.actor.clip_ratio"),
    ("cliprange", "actor_rollout_ref.actor.clip_ratio"),
    ("clip_range", "actor_rollout_ref.actor.clip_ratio"),
    ("eps_clip", "actor_rollout_ref.actor.clip_ratio"),
    ("epsilon_high", "actor_rollout_ref.actor.clip_ratio_high"),
    ("max_grad_norm", "actor_rollout_ref.actor.grad_clip"),
    ("clip_grad", "actor_rollout_ref.actor.grad_clip"),
    ("advantage_estimator", "algorithm.adv_estimator"),
    ("estimator", "algorithm.adv_estimator"),
    ("scale_rewards", "algorithm.norm_adv_by_std_in_grpo"),
    ("model_path", "actor_rollout_ref.model.path"),
    ("model_name_or_path", "actor_rollout_ref.model.path"),
    ("pretrained_model", "actor_rollout_ref.model.path"),
    ("partial_pretrain", "actor_rollout_ref.model.path"),
    (
        "gradient_checkpointing",
        "actor_rollout_ref.model.enable_gradient_checkpointing",
    ),
    (
        "remove_padding",
        "actor_rollout_ref.model.use_remove_padding",
    ),
    ("lora_r", "actor_rollout_ref.model.lora_rank"),
    (
        "param_offload",
        "actor_rollout_ref.actor.fsdp_config.param_offload",
    ),
    (
        "optimizer_offload",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload",
    ),
    (
        "tp_size",
        "actor_rollout_ref.rollout.tensor_model_parallel_size",
    ),
    (
        "tensor_parallel_size",
        "actor_rollout_ref.rollout.tensor_model_parallel_size",
    ),
    (
        "sp_size",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
    ),
    (
        "sequence_parallel_size",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
    ),
    ("reward_fn", "custom_reward_function.path"),
    ("reward_function", "custom_reward_function.path"),
    ("reward_funcs", "custom_reward_function.path"),
    ("output_dir", "trainer.default_local_dir"),
    ("save_dir", "trainer.default_local_dir"),
    ("checkpoint_dir", "trainer.default_local_dir"),
    ("save_steps", "trainer.save_freq"),
    ("save_interval", "trainer.save_freq"),
    ("eval_steps", "trainer.test_freq"),
    ("eval_freq", "trainer.test_freq"),
    ("val_freq", "trainer.test_freq"),
    ("report_to", "trainer.logger"),
    ("loggers", "trainer.logger"),
    ("random_seed", "trainer.seed"),
    ("resume_from_checkpoint", "trainer.resume_from_path"),
    ("max_ckpt_to_keep", "trainer.max_actor_ckpt_to_keep"),
    ("num_nodes", "trainer.nnodes"),
    ("nproc_per_node", "trainer.n_gpus_per_node"),
];

/// The key among `known` that unknown `key` most likely means: a [`SYNONYMS`] entry whose key is known, else the
/// closest by edit distance (see [`distance`]); ties go to the earlier key in `known`. Empty when `known` is.
pub fn nearest<'a>(known: &'a [String], key: &str) -> &'a str {
    nearest_with(SYNONYMS, known, key)
}

/// [`nearest`] with another config type's synonym table (e.g. [`PPO_SYNONYMS`]).
pub fn nearest_with<'a>(
    synonyms: &[(&str, &'static str)],
    known: &'a [String],
    key: &str,
) -> &'a str {
    if let Some(k) = synonym_in(synonyms, key).and_then(|s| known.iter().find(|k| k.as_str() == s))
    {
        return k;
    }
    known
        .iter()
        .min_by_key(|cand| distance(key, cand))
        .map_or("", String::as_str)
}

/// The canonical key [`SYNONYMS`] gives for `key`: a whole-key entry first, then one for its last segment.
pub fn synonym(key: &str) -> Option<&'static str> {
    synonym_in(SYNONYMS, key)
}

/// [`synonym`] in another synonym table.
pub fn synonym_in(synonyms: &[(&str, &'static str)], key: &str) -> Option<&'static str> {
    let norm = key.to_ascii_lowercase().replace('-', "_");
    let (_, last) = split_last(&norm);
    let whole = synonyms.iter().find(|(s, _)| *s == norm);
    let tail = || {
        synonyms
            .iter()
            .find(|(s, _)| !s.contains('.') && *s == last)
    };
    whole.or_else(tail).map(|(_, canonical)| *canonical)
}

/// How far candidate `cand` is from unknown `key`: the edit distance of their last segments, plus 2 when they lie
/// in different sections (so a close key in the same section wins), or the edit distance of the whole keys when
/// that is smaller (a misspelt section).
pub fn distance(key: &str, cand: &str) -> usize {
    let (key_parent, key_last) = split_last(key);
    let (cand_parent, cand_last) = split_last(cand);
    let penalty = if key_parent == cand_parent { 0 } else { 2 };
    let segment = strsim::levenshtein(key_last, cand_last) + penalty;
    segment.min(strsim::levenshtein(key, cand))
}

/// `(parent section, last segment)` of a dotted key; the parent of a top-level key is empty.
fn split_last(key: &str) -> (&str, &str) {
    key.rsplit_once('.').unwrap_or(("", key))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn synonyms_match_whole_keys_then_last_segments() {
        assert_eq!(synonym("trainer.epochs"), Some("trainer.total_epochs"));
        assert_eq!(synonym("Num-Epochs"), Some("trainer.total_epochs"));
        assert_eq!(synonym("model.path"), Some("model.partial_pretrain"));
        assert_eq!(synonym("data.path"), None);
        assert_eq!(synonym("optim.lr"), None);
    }

    #[test]
    fn nearest_prefers_meaning_then_the_same_section() {
        let known = keys(&[
            "data.max_length",
            "data.val_files",
            "optim.lr",
            "trainer.seed",
            "trainer.val_file",
        ]);
        assert_eq!(nearest(&known, "data.max_seq_length"), "data.max_length");
        // One edit in the same section beats an exact segment in another one.
        assert_eq!(nearest(&known, "data.val_file"), "data.val_files");
        assert_eq!(nearest(&known, "data.seed"), "trainer.seed");
        assert_eq!(nearest(&known, "trainer.sed"), "trainer.seed");
        assert_eq!(nearest(&known, "lr"), "optim.lr");
        assert_eq!(nearest(&known, "learning_rate"), "optim.lr");
        // A synonym whose key is not known falls back to spelling.
        assert_eq!(nearest(&known, "trainer.epochs"), "trainer.seed");
        assert_eq!(nearest(&[], "x"), "");
    }
}
