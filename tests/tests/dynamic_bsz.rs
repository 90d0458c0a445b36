//! Token-budget micro-batches (`data.use_dynamic_bsz`, `data.max_token_len_per_gpu`): balanced variable
//! micro-batches train the same model as fixed ones, because the loss is the token-mean over the whole global batch.

use ferl_actors::data_loader::load_datasets;
use ferl_actors::sft::RunSummary;
use ferl_config::SftConfig;
use ferl_data::{Batching, DataPlan, RankMicroBatches};
use ferl_tests::*;
use ferl_trainer::run::StepRecord;

const DRIVER: &str = env!("CARGO_BIN_EXE_ferl-sft-driver");
const REL: f64 = 1e-5;
const STEPS: usize = 6;
/// Long enough that GSM8K rows differ in length (the fixture's 96 truncates most of them to the same length).
const MAX_LENGTH: &str = "data.max_length=320";
const BUDGET: usize = 480;

fn run(fx: &Fixture, path: LaunchPath, overrides: &[String], tag: &str) -> RunSummary {
    run_path(DRIVER, fx.dir.path(), path, overrides, tag)
        .unwrap_or_else(|e| panic!("{tag} ({path:?}) failed: {e}"))
}

/// The largest relative difference of loss and grad norm between two curves of the same steps.
fn max_rel_diff(got: &[StepRecord], want: &[StepRecord]) -> f64 {
    assert_eq!(got.len(), want.len(), "number of steps");
    got.iter()
        .zip(want)
        .flat_map(|(g, w)| [(g.loss, w.loss), (g.grad_norm, w.grad_norm)])
        .map(|(a, b)| (a - b).abs() / b.abs().max(1e-12))
        .fold(0.0, f64::max)
}

/// The first global batch's micro-batches at world 2, token-budget and fixed: they must differ, or the parity
/// below would prove nothing.
fn first_batch_plans(overrides: &[String]) -> (Vec<RankMicroBatches>, Vec<RankMicroBatches>) {
    let cfg = SftConfig::load(None, overrides).unwrap();
    let (train, _) = load_datasets(&cfg).unwrap();
    let d = &cfg.data;
    let mut plan =
        DataPlan::new(train.len(), d.train_batch_size, cfg.trainer.seed, d.shuffle).unwrap();
    let rows = plan.next_batch();
    let lengths: Vec<usize> = rows.iter().map(|&i| train.get(i).len()).collect();
    let dynamic = Batching::from_config(&cfg)
        .plan(&rows, &lengths, 2)
        .unwrap();
    let fixed = Batching::Fixed {
        micro_batch_size: d.micro_batch_size_per_gpu,
    };
    (dynamic, fixed.plan(&rows, &lengths, 2).unwrap())
}

#[test]
fn token_budget_batches_match_fixed_micro_batches_and_the_one_rank_run() {
    let fx = Fixture::new().unwrap();
    let budget = format!("data.max_token_len_per_gpu={BUDGET}");
    for packed in ["use_remove_padding=true", "use_remove_padding=false"] {
        let common = [
            MAX_LENGTH,
            packed,
            "model.fsdp_config.model_dtype=fp32",
            "trainer.resume_mode=disable",
        ];
        let fixed_o = fx.overrides(STEPS, "fixed", &common);
        let mut dyn_common = common.to_vec();
        dyn_common.extend(["data.use_dynamic_bsz=true", budget.as_str()]);
        let dyn_o = fx.overrides(STEPS, "dynamic", &dyn_common);

        let (dynamic_plan, fixed_plan) = first_batch_plans(&dyn_o);
        assert_ne!(
            dynamic_plan, fixed_plan,
            "{packed}: the token budget changed nothing"
        );
        let sizes: Vec<usize> = dynamic_plan.iter().flatten().map(Vec::len).collect();
        assert!(
            sizes.iter().any(|&n| n != sizes[0]),
            "{packed}: micro-batches of one size {sizes:?}: the test should train variable ones"
        );
        println!("{packed}: first batch, token-budget micro-batches {dynamic_plan:?}, fixed {fixed_plan:?}");

        let reference = reference_run(&fixed_o).unwrap();
        let fixed = run(&fx, LaunchPath::Actors(2), &fixed_o, "fixed");
        let dynamic = run(&fx, LaunchPath::Actors(2), &dyn_o, "dynamic");
        assert_eq!(dynamic.world_size, 2);
        let vs_fixed = max_rel_diff(&dynamic.steps, &fixed.steps);
        let vs_one_rank = max_rel_diff(&dynamic.steps, &reference);
        println!(
            "{packed}: {STEPS} steps fp32 at world 2, token-budget vs fixed micro-batches: max relative difference \
             {vs_fixed:e}; vs the 1-rank run: {vs_one_rank:e} (tolerance {REL:e})"
        );
        assert_curves_match(
            &format!("{packed}: dynamic vs fixed, world 2"),
            &dynamic.steps,
            &fixed.steps,
            REL,
        );
        assert_curves_match(
            &format!("{packed}: dynamic world 2 vs 1 rank"),
            &dynamic.steps,
            &reference,
            REL,
        );
        assert!(
            reference[STEPS - 1].loss < reference[0].loss,
            "the loss should fall: {reference:?}"
        );
    }
}

/// The SPMD executor's paths: one process (world 1: micro-batches only) and launcher ranks (world 2).
#[test]
fn token_budget_batches_train_the_same_in_one_process_and_under_a_launcher() {
    let fx = Fixture::new().unwrap();
    let budget = format!("data.max_token_len_per_gpu={BUDGET}");
    let o = fx.overrides(
        3,
        "spmd",
        &[
            MAX_LENGTH,
            "data.use_dynamic_bsz=true",
            &budget,
            "trainer.resume_mode=disable",
        ],
    );
    let reference = reference_run(&o).unwrap();
    for (i, path) in [LaunchPath::OneProcess, LaunchPath::Launcher(2)]
        .into_iter()
        .enumerate()
    {
        let got = run(&fx, path, &o, &format!("spmd{i}"));
        let diff = max_rel_diff(&got.steps, &reference);
        println!(
            "{path:?}, token-budget batches vs the 1-rank run: max relative difference {diff:e}"
        );
        assert_curves_match(
            &format!("{path:?}, token-budget batches"),
            &got.steps,
            &reference,
            REL,
        );
    }
}

#[test]
fn a_budget_below_max_length_is_refused_the_same_on_every_path() {
    let fx = Fixture::new().unwrap();
    let o = fx.overrides(
        2,
        "refused",
        &["data.use_dynamic_bsz=true", "data.max_token_len_per_gpu=64"],
    );
    let errors: Vec<String> = [
        LaunchPath::OneProcess,
        LaunchPath::Actors(2),
        LaunchPath::Launcher(2),
    ]
    .into_iter()
    .enumerate()
    .map(
        |(i, p)| match run_path(DRIVER, fx.dir.path(), p, &o, &format!("refused{i}")) {
            Ok(_) => panic!("a budget of 64 tokens under data.max_length=96 trained on {p:?}"),
            Err(e) => e,
        },
    )
    .collect();
    assert!(
        errors[0].contains("data.max_token_len_per_gpu=64")
            && errors[0].contains("data.max_length=96"),
        "{}",
        errors[0]
    );
    assert!(
        errors.iter().all(|e| e == &errors[0]),
        "different messages: {errors:#?}"
    );
}
