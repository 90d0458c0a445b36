//! # ferl-fuzz: fuzz tests that run on stable Rust, under `cargo nextest`, in a bounded time
//!
//! A [`Target`] is a function from bytes to an [`Answer`] (accepted, or refused with an error message), written in
//! the crate that owns the code it exercises (`tests/fuzz.rs` there). [`Target::run`] feeds it, until its time
//! budget is spent:
//! 1. every file of its seed corpus, `fuzz/corpus/<target>/` (checked into the repository), first;
//! 2. then, at random, mutations of corpus files and earlier inputs (bit flips, truncation, splicing, deleted and
//!    repeated ranges, length fields set to edge values, dictionary tokens, numbers made huge) and structured
//!    inputs from the target's proptest strategies ([`Target::generate`]).
//!
//! # Invariants (every input)
//! 1. No panic.
//! 2. No hang: an input running longer than the per-input limit fails the test.
//! 3. Every refusal is an error with a message.
//! 4. Inputs known to be malformed are refused: corpus files whose name starts with `err-`, and the inputs of
//!    strategies added with [`Expect::Refused`].
//!
//! A failing input is written to `$TMPDIR/ferl-fuzz/<target>/` and named in the failure; fix the code and copy it
//! into the corpus (as `err-<what>` when it must be refused), so every later run replays it first. An input that
//! kills the process (stack overflow, abort) is left in `$TMPDIR/ferl-fuzz/<target>/last-input`.
//!
//! # Environment
//! - `FERL_FUZZ_SECONDS`: time budget per target (default [`DEFAULT_SECONDS`], at most [`MAX_SECONDS`]).
//! - `FERL_FUZZ_INPUT_SECONDS`: per-input limit before an input counts as a hang (default 2).
//! - `FERL_FUZZ_SEED`: the seed of the random choices (printed by every run), to replay a run.
//! - `FERL_FUZZ_WRITE_SEEDS=1`: also write four inputs of each strategy into the corpus folder, named `seed-*`
//!   (`err-seed-*` for [`Expect::Refused`] strategies): how a new target gets its first seeds.

mod mutate;
mod worker;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use proptest::strategy::{BoxedStrategy, Strategy, ValueTree};
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::worker::{Outcome, Worker};

/// Default time budget per target, in seconds.
pub const DEFAULT_SECONDS: u64 = 20;
/// Largest time budget per target, in seconds (CI runs every target).
pub const MAX_SECONDS: u64 = 60;
/// Default per-input limit, in seconds.
pub const DEFAULT_INPUT_SECONDS: u64 = 2;
/// Inputs kept for mutation and splicing, besides the corpus.
const POOL: usize = 256;

/// How a target answered one input: `Ok` when it accepted it, `Err` with the message it refused it with.
pub type Answer = Result<(), String>;

/// What a strategy's inputs must get.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// Accepted or refused: both are fine (well-formed inputs may still be refused by later checks).
    Any,
    /// Malformed by construction: the target must refuse every one.
    Refused,
}

type Check = Arc<dyn Fn(&[u8]) -> Answer + Send + Sync>;

/// One fuzz target: its name (and corpus folder), its function, its strategies and dictionary.
pub struct Target {
    name: &'static str,
    check: Check,
    strategies: Vec<(&'static str, BoxedStrategy<Vec<u8>>, Expect)>,
    dictionary: Vec<Vec<u8>>,
    max_len: usize,
    seconds: u64,
}

/// Where an input came from, for reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    Corpus,
    Mutation,
    Strategy(usize),
}

/// Counts of one run, printed at its end.
#[derive(Default, Debug)]
struct Stats {
    inputs: u64,
    accepted: u64,
    refused: u64,
}

impl Target {
    /// A target named `name` (its corpus is `fuzz/corpus/<name>/`) answering inputs with `check`.
    pub fn new(
        name: &'static str,
        check: impl Fn(&[u8]) -> Answer + Send + Sync + 'static,
    ) -> Self {
        Self {
            name,
            check: Arc::new(check),
            strategies: Vec::new(),
            dictionary: Vec::new(),
            max_len: 256 << 10,
            seconds: DEFAULT_SECONDS,
        }
    }

    /// Adds a proptest strategy of structured inputs; `expect` says whether each must be refused.
    pub fn generate(
        mut self,
        name: &'static str,
        strategy: impl Strategy<Value = Vec<u8>> + 'static,
        expect: Expect,
    ) -> Self {
        self.strategies.push((name, strategy.boxed(), expect));
        self
    }

    /// Adds tokens that mutations insert (keywords, delimiters, magic numbers of the format).
    pub fn dictionary(mut self, tokens: &[&[u8]]) -> Self {
        self.dictionary.extend(tokens.iter().map(|t| t.to_vec()));
        self
    }

    /// Caps the length of mutated inputs (default 256 KiB).
    pub fn max_len(mut self, max_len: usize) -> Self {
        self.max_len = max_len;
        self
    }

    /// Sets this target's time budget in seconds when `FERL_FUZZ_SECONDS` does not (default [`DEFAULT_SECONDS`]).
    pub fn seconds(mut self, seconds: u64) -> Self {
        self.seconds = seconds;
        self
    }

    /// The corpus folder of this target.
    pub fn corpus_dir(&self) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("corpus")
            .join(self.name)
    }

    /// Runs the target for its time budget; panics naming the input on the first failure (see the module docs).
    pub fn run(self) {
        let budget =
            Duration::from_secs(env_u64("FERL_FUZZ_SECONDS", self.seconds).min(MAX_SECONDS));
        let limit =
            Duration::from_secs(env_u64("FERL_FUZZ_INPUT_SECONDS", DEFAULT_INPUT_SECONDS).max(1));
        let seed = env_u64("FERL_FUZZ_SEED", rand::random());
        eprintln!(
            "fuzz target {}: {}s budget, {}s per input, FERL_FUZZ_SEED={seed}",
            self.name,
            budget.as_secs(),
            limit.as_secs()
        );
        let mut run = Run::new(&self, seed, limit);
        let corpus = corpus_files(&self.corpus_dir());
        if std::env::var("FERL_FUZZ_WRITE_SEEDS").is_ok_and(|v| v == "1") {
            run.write_seeds(&self.corpus_dir());
        }
        for (path, bytes) in &corpus {
            let refused = file_name(path).starts_with("err-");
            run.one(bytes, Source::Corpus, refused.then_some(Expect::Refused));
            run.pool.push(bytes.clone());
        }
        let start = Instant::now();
        while start.elapsed() < budget {
            run.step();
        }
        eprintln!(
            "fuzz target {}: {} corpus files, {:?} in {:.1}s",
            self.name,
            corpus.len(),
            run.stats,
            start.elapsed().as_secs_f64()
        );
    }
}

/// The state of one target's run.
struct Run<'t> {
    target: &'t Target,
    worker: Worker,
    rng: StdRng,
    runner: TestRunner,
    pool: Vec<Vec<u8>>,
    stats: Stats,
    seed: u64,
}

impl<'t> Run<'t> {
    fn new(target: &'t Target, seed: u64, limit: Duration) -> Self {
        let last = std::env::temp_dir()
            .join("ferl-fuzz")
            .join(target.name)
            .join("last-input");
        let mut key = [0u8; 32];
        key[..8].copy_from_slice(&seed.to_le_bytes());
        Self {
            target,
            worker: Worker::spawn(target.name, target.check.clone(), limit, &last),
            rng: StdRng::seed_from_u64(seed),
            runner: TestRunner::new_with_rng(
                Config::default(),
                TestRng::from_seed(RngAlgorithm::ChaCha, &key),
            ),
            pool: Vec::new(),
            stats: Stats::default(),
            seed,
        }
    }

    /// One random input: a mutation of a pool entry, or a strategy's value.
    fn step(&mut self) {
        let strategies = self.target.strategies.len();
        if self.pool.is_empty() || (strategies > 0 && self.rng.random_bool(0.4)) {
            if strategies == 0 {
                return self.one_input(Vec::new(), Source::Mutation, None);
            }
            let i = self.rng.random_range(0..strategies);
            let input = self.generated(i);
            let expect = self.target.strategies[i].2;
            return self.one_input(input, Source::Strategy(i), Some(expect));
        }
        let base = &self.pool[self.rng.random_range(0..self.pool.len())];
        let input = mutate::mutate(
            &mut self.rng,
            base,
            &self.pool,
            &self.target.dictionary,
            self.target.max_len,
        );
        self.one_input(input, Source::Mutation, None)
    }

    fn generated(&mut self, i: usize) -> Vec<u8> {
        let strategy = &self.target.strategies[i].1;
        match strategy.new_tree(&mut self.runner) {
            Ok(tree) => tree.current(),
            Err(e) => panic!(
                "fuzz target {}: strategy {} failed: {e}",
                self.target.name, self.target.strategies[i].0
            ),
        }
    }

    fn one_input(&mut self, input: Vec<u8>, source: Source, expect: Option<Expect>) {
        let accepted = self.one(&input, source, expect);
        if accepted || self.pool.len() < POOL {
            if self.pool.len() >= POOL {
                let at = self.rng.random_range(0..POOL);
                self.pool[at] = input;
            } else {
                self.pool.push(input);
            }
        }
    }

    /// Runs one input and checks the invariants; returns whether it was accepted.
    fn one(&mut self, input: &[u8], source: Source, expect: Option<Expect>) -> bool {
        self.stats.inputs += 1;
        let why = match self.worker.answer(input) {
            Outcome::Answered(Ok(())) if expect == Some(Expect::Refused) => {
                "a malformed input was accepted".to_string()
            }
            Outcome::Answered(Ok(())) => {
                self.stats.accepted += 1;
                return true;
            }
            Outcome::Answered(Err(e)) if e.trim().is_empty() => {
                "refused with an empty error message".into()
            }
            Outcome::Answered(Err(_)) => {
                self.stats.refused += 1;
                return false;
            }
            Outcome::Panicked(msg) => format!("panicked: {msg}"),
            Outcome::Hung(limit) => format!("no answer after {limit:?} (hang)"),
        };
        self.fail(input, source, &why)
    }

    fn fail(&self, input: &[u8], source: Source, why: &str) -> ! {
        let source = match source {
            Source::Strategy(i) => format!("strategy `{}`", self.target.strategies[i].0),
            other => format!("{other:?}").to_lowercase(),
        };
        let saved = save_finding(self.target.name, input);
        panic!(
            "fuzz target {}: input from {source} {why}\n  input ({} bytes, saved to {saved}): {}\n  replay: \
             FERL_FUZZ_SEED={}; keep it: copy it into {}",
            self.target.name,
            input.len(),
            preview(input),
            self.seed,
            self.target.corpus_dir().display()
        )
    }

    /// Writes a few values of each `Expect::Any` strategy into `dir` (named by content).
    fn write_seeds(&mut self, dir: &Path) {
        std::fs::create_dir_all(dir).expect("corpus folder");
        for i in 0..self.target.strategies.len() {
            let prefix = match self.target.strategies[i].2 {
                Expect::Any => "seed",
                Expect::Refused => "err-seed",
            };
            for _ in 0..4 {
                let input = self.generated(i);
                let path = dir.join(format!("{prefix}-{:016x}", fingerprint(&input)));
                std::fs::write(&path, &input).expect("write seed");
            }
        }
    }
}

fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a whole number")),
        Err(_) => default,
    }
}

fn file_name(path: &Path) -> &str {
    path.file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default()
}

/// The corpus files of `dir` in name order (a missing folder is an empty corpus; `README*` files are skipped).
fn corpus_files(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut paths: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && !file_name(p).starts_with("README"))
        .collect();
    paths.sort();
    paths
        .into_iter()
        .map(|p| {
            let bytes = std::fs::read(&p)
                .unwrap_or_else(|e| panic!("reading corpus file {}: {e}", p.display()));
            (p, bytes)
        })
        .collect()
}

/// A stable 64-bit FNV-1a hash of `bytes`, for file names.
fn fingerprint(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

fn save_finding(target: &str, input: &[u8]) -> String {
    let dir = std::env::temp_dir().join("ferl-fuzz").join(target);
    let path = dir.join(format!("finding-{:016x}", fingerprint(input)));
    match std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&path, input)) {
        Ok(()) => path.display().to_string(),
        Err(e) => format!("(not saved: {e})"),
    }
}

/// The input as text when it is text, else hex; at most 512 bytes of it.
fn preview(input: &[u8]) -> String {
    let head = &input[..input.len().min(512)];
    let more = if input.len() > head.len() { "..." } else { "" };
    match std::str::from_utf8(head) {
        Ok(text) => format!("{text:?}{more}"),
        Err(_) => format!(
            "{}{more}",
            head.iter().map(|b| format!("{b:02x}")).collect::<String>()
        ),
    }
}
