//! The thread that runs a target's inputs, one at a time: it catches panics, and the caller stops waiting for an
//! input after the per-input limit (the hang is then reported and the thread left behind, as the test fails).

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::panic::AssertUnwindSafe;
use std::path::Path;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::time::Duration;

use crate::{Answer, Check};

/// What became of one input.
pub(crate) enum Outcome {
    /// The target answered.
    Answered(Answer),
    /// The target panicked with this message.
    Panicked(String),
    /// No answer within this limit.
    Hung(Duration),
}

/// A running worker thread and its channels.
pub(crate) struct Worker {
    inputs: SyncSender<Vec<u8>>,
    outcomes: Receiver<Outcome>,
    limit: Duration,
    last: Option<File>,
}

impl Worker {
    /// Starts the worker of `target`; `last` receives each input before it runs (for inputs that kill the process).
    pub(crate) fn spawn(target: &str, check: Check, limit: Duration, last: &Path) -> Self {
        let (inputs, input_rx) = mpsc::sync_channel::<Vec<u8>>(1);
        let (outcome_tx, outcomes) = mpsc::sync_channel(1);
        std::thread::Builder::new()
            .name(format!("fuzz-{target}"))
            .spawn(move || {
                for input in input_rx {
                    let outcome = match std::panic::catch_unwind(AssertUnwindSafe(|| check(&input)))
                    {
                        Ok(answer) => Outcome::Answered(answer),
                        Err(payload) => Outcome::Panicked(panic_message(payload.as_ref())),
                    };
                    if outcome_tx.send(outcome).is_err() {
                        return;
                    }
                }
            })
            .expect("spawning the fuzz worker thread");
        let last = last
            .parent()
            .and_then(|dir| std::fs::create_dir_all(dir).ok())
            .and_then(|()| File::create(last).ok());
        Self {
            inputs,
            outcomes,
            limit,
            last,
        }
    }

    /// Runs `input` and waits for its outcome, at most the per-input limit.
    pub(crate) fn answer(&mut self, input: &[u8]) -> Outcome {
        if let Some(file) = &mut self.last {
            let _ = file
                .set_len(0)
                .and_then(|()| file.write_all_at(input, 0))
                .and_then(|()| file.flush());
        }
        if self.inputs.send(input.to_vec()).is_err() {
            return Outcome::Panicked("the worker thread is gone".into());
        }
        match self.outcomes.recv_timeout(self.limit) {
            Ok(outcome) => outcome,
            Err(RecvTimeoutError::Timeout) => Outcome::Hung(self.limit),
            Err(RecvTimeoutError::Disconnected) => {
                Outcome::Panicked("the worker thread is gone".into())
            }
        }
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(a panic without a message)".into())
}
