//! `ferl sft` with its output in a pipe, as under `nohup`, SLURM or CI: no progress bar can draw there, so long
//! phases print plain progress lines, at least every 10 s, without escape codes.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ferl_tests::*;

/// Optimizer steps of the run at scale 1 (8 rows each, with 40 training rows: several epochs).
const STEPS: usize = 24;
/// Rows of the validation set at scale 1, validated once after the last step.
const VAL_ROWS: usize = 700;
/// A run must last this long to show a silent phase: without progress lines it prints nothing after its start.
const LONG_ENOUGH: Duration = Duration::from_secs(12);

/// Reads `from` line by line on a thread, sending each line with the time it arrived.
fn stamp(
    from: impl Read + Send + 'static,
    to: mpsc::Sender<(Instant, String)>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(from).lines() {
            let Ok(line) = line else { break };
            if to.send((Instant::now(), line)).is_err() {
                break;
            }
        }
    })
}

/// What a run printed: when it started and ended, and each line of stdout and stderr with when it arrived.
struct Log {
    started: Instant,
    ended: Instant,
    lines: Vec<(Instant, String)>,
}

impl Log {
    /// The lines, each after its time since the start.
    fn text(&self) -> String {
        self.lines
            .iter()
            .map(|(t, l)| format!("{:6.1}s {l}\n", (*t - self.started).as_secs_f64()))
            .collect()
    }

    /// The longest stretch without a line (start and end included), and when it began.
    fn longest_silence(&self) -> (Duration, Duration) {
        let mut times = vec![self.started];
        times.extend(self.lines.iter().map(|(t, _)| *t));
        times.push(self.ended);
        times
            .windows(2)
            .map(|w| (w[1] - w[0], w[0] - self.started))
            .max()
            .unwrap()
    }

    fn has(&self, prefix: &str, part: &str) -> bool {
        self.lines
            .iter()
            .any(|(_, l)| l.starts_with(prefix) && l.contains(part))
    }
}

/// Runs `ferl sft` for `steps` steps validating on `val_rows` rows, its output in pipes; fails unless it succeeds.
fn run(ferl: &Path, fx: &Fixture, steps: usize, val_rows: usize) -> Log {
    let val = fx.dir.path().join(format!("val-{val_rows}.jsonl"));
    write_gsm8k_slice(&val, val_rows).unwrap();
    let val_files = format!("data.val_files={}", val.display());
    // No console logger: no line per step, so every line of the run's long phases is a progress line.
    let keys = fx.overrides(
        steps,
        &format!("run-{steps}"),
        &[&val_files, "trainer.logger=[jsonl]", "trainer.test_freq=-1"],
    );
    let started = Instant::now();
    let mut child = Command::new(ferl)
        .env("OMP_NUM_THREADS", "1")
        .env_remove("FERL_PROGRESS_INTERVAL_S")
        .arg("sft")
        .args(&keys)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = mpsc::channel();
    let readers = [
        stamp(child.stdout.take().unwrap(), tx.clone()),
        stamp(child.stderr.take().unwrap(), tx),
    ];
    let status = child.wait().unwrap();
    let ended = Instant::now();
    for r in readers {
        r.join().unwrap();
    }
    let mut lines: Vec<(Instant, String)> = rx.iter().collect();
    lines.sort_by_key(|(t, _)| *t);
    let log = Log {
        started,
        ended,
        lines,
    };
    assert!(status.success(), "ferl sft failed:\n{}", log.text());
    log
}

#[test]
fn plain_progress_lines_appear_in_a_non_tty_log_at_least_every_10_s() {
    let ferl = ferl_binary();
    let fx = Fixture::new().unwrap();
    // A faster machine runs a larger job, so that the run always outlasts the 10 s it must never stay silent for.
    let (mut steps, mut val_rows) = (STEPS, VAL_ROWS);
    let mut log = run(&ferl, &fx, steps, val_rows);
    while log.ended - log.started < LONG_ENOUGH && steps < 8 * STEPS {
        (steps, val_rows) = (2 * steps, (2 * val_rows).min(7000));
        log = run(&ferl, &fx, steps, val_rows);
    }
    let text = log.text();
    let took = log.ended - log.started;
    assert!(
        took >= LONG_ENOUGH,
        "even {steps} steps took only {took:?}:\n{text}"
    );

    let (gap, from) = log.longest_silence();
    assert!(
        gap < Duration::from_secs(10),
        "{gap:?} without a line from {from:?} on:\n{text}"
    );
    assert!(
        !text.contains('\x1b') && !text.contains('\r'),
        "escape codes or carriage returns in a log:\n{text}"
    );
    assert!(
        log.has("training: ", &format!("/{steps} steps [")),
        "{text}"
    );
    assert!(
        log.has("validation: ", &format!("/{val_rows} rows [")),
        "{text}"
    );
    assert!(
        log.has(
            "validation: ",
            &format!("{val_rows}/{val_rows} rows done in")
        ),
        "{text}"
    );
    assert!(
        log.has("trained steps ", &format!("1..{steps} on 1 rank(s)")),
        "{text}"
    );
}
