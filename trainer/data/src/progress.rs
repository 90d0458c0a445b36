//! Progress of long phases (training steps, validation, tokenizing, waiting for actors), visible in a terminal and in a
//! log file alike: one mechanism for every launch path.
//!
//! - In a terminal (stderr is a TTY) a [`Progress`] draws an `indicatif` bar; a [`Phase`] inside it (validation
//!   during training) shows its count in the bar's message.
//! - Anywhere else (`nohup`, SLURM output files, CI logs), where a bar would draw nothing, it prints plain lines to
//!   stderr, without escape codes: `validation: 512/1319 rows [0:12, eta 0:19]`. A status line is printed whenever
//!   `FERL_PROGRESS_INTERVAL_S` seconds (default 5; `0` turns the lines off) pass without a line from any progress of
//!   the process, so while a phase runs its log never stays silent longer than that, however long its single steps
//!   take, and a phase that follows a silent one speaks up in time. Lines printed through [`Progress::println`] (the
//!   `console` logger's) count, so a run whose steps are logged anyway adds no progress lines between them. A phase
//!   that printed a status line ends with one (`... done in 0:23`) when finished; short phases print nothing.

use std::io::{IsTerminal, Write};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

/// Environment variable: seconds between plain progress lines when stderr is not a terminal (`0`: none).
pub const INTERVAL_ENV: &str = "FERL_PROGRESS_INTERVAL_S";
/// The default of [`INTERVAL_ENV`].
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(5);

/// The progress of one long phase (with at most one [`Phase`] inside it at a time). Clones share it; its lines stop
/// at [`Progress::finish`] or when the last clone is dropped.
#[derive(Clone, Default)]
pub struct Progress {
    owner: Option<Arc<Owner>>,
}

/// A phase inside a [`Progress`] (validation within training): its count is shown instead of the outer one's until
/// it is finished or dropped. Made by [`Progress::phase`].
#[derive(Default)]
pub struct Phase {
    shared: Option<Arc<Shared>>,
}

/// Ends the progress when the last clone goes (stops the line printer).
struct Owner {
    shared: Arc<Shared>,
    printer: Mutex<Option<std::thread::JoinHandle<()>>>,
}

struct Shared {
    style: Style,
    sink: Sink,
    state: Mutex<State>,
    wake: Condvar,
}

enum Style {
    Bar(ProgressBar),
    Lines,
}

/// Where lines go (progress lines to stderr, [`Progress::println`]'s to stdout; in tests, into memory), and when the
/// last one went: one clock for every progress of the process, so that a phase following a silent one speaks up in
/// time.
#[derive(Clone)]
struct Sink {
    last_line: Arc<Mutex<Instant>>,
    #[cfg(test)]
    memory: Option<Arc<Mutex<Vec<String>>>>,
}

impl Sink {
    /// Stderr and stdout, with the process's clock (started by its first progress).
    fn std() -> Self {
        static LAST_LINE: OnceLock<Arc<Mutex<Instant>>> = OnceLock::new();
        Self {
            last_line: LAST_LINE
                .get_or_init(|| Arc::new(Mutex::new(Instant::now())))
                .clone(),
            #[cfg(test)]
            memory: None,
        }
    }

    /// When the last line went.
    fn last(&self) -> Instant {
        *self.last_line.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes the turn of a status line at `now`: false when a line went since `seen` (the last one looked at).
    fn claim(&self, seen: Instant, now: Instant) -> bool {
        let mut last = self.last_line.lock().unwrap_or_else(|e| e.into_inner());
        let free = *last == seen;
        if free {
            *last = now;
        }
        free
    }

    fn progress(&self, line: &str) {
        self.write(line, true);
    }

    fn out(&self, line: &str) {
        self.write(line, false);
    }

    fn write(&self, line: &str, progress: bool) {
        *self.last_line.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        #[cfg(test)]
        if let Some(m) = &self.memory {
            m.lock().expect("memory sink").push(line.to_string());
            return;
        }
        if progress {
            let _ = writeln!(std::io::stderr().lock(), "{line}");
        } else {
            println!("{line}");
        }
    }
}

struct State {
    top: Count,
    sub: Option<Count>,
    done: bool,
}

/// What a line reports of one phase.
struct Count {
    what: String,
    unit: String,
    pos: u64,
    len: u64,
    msg: String,
    started: Instant,
    /// Position and time the rate (for the eta) is measured from: the first position set, reset when it goes back.
    base: Option<(u64, Instant)>,
    /// A line of this phase was printed (so its end is printed too).
    printed: bool,
}

impl Count {
    fn new(what: &str, unit: &str, len: u64) -> Self {
        Self {
            what: what.to_string(),
            unit: unit.to_string(),
            pos: 0,
            len,
            msg: String::new(),
            started: Instant::now(),
            base: None,
            printed: false,
        }
    }

    fn set_position(&mut self, pos: u64) {
        if self.base.is_none() || pos < self.pos {
            self.base = Some((pos, Instant::now()));
        }
        self.pos = pos;
    }

    fn inc(&mut self, n: u64) {
        if self.base.is_none() {
            self.base = Some((self.pos, Instant::now()));
        }
        self.pos += n;
    }

    /// `what: pos/len unit` (or `what: pos unit` without a length, or `what` alone at 0).
    fn counted(&self) -> String {
        match (self.len, self.pos) {
            (0, 0) => self.what.clone(),
            (0, pos) => format!("{}: {pos} {}", self.what, self.unit),
            (len, pos) => format!("{}: {pos}/{len} {}", self.what, self.unit),
        }
    }

    /// The phase's status line at `now`: count, elapsed time, eta where known, message.
    fn line(&self, now: Instant) -> String {
        let mut time = clock(now - self.started);
        if let Some((base, at)) = self.base {
            if self.len > self.pos && self.pos > base {
                let per = (now - at).as_secs_f64() / (self.pos - base) as f64;
                let eta = Duration::from_secs_f64(per * (self.len - self.pos) as f64);
                time.push_str(&format!(", eta {}", clock(eta)));
            }
        }
        let mut line = format!("{} [{time}]", self.counted());
        if !self.msg.is_empty() {
            line.push(' ');
            line.push_str(&self.msg);
        }
        line
    }

    fn done_line(&self, now: Instant) -> String {
        format!("{} done in {}", self.counted(), clock(now - self.started))
    }
}

/// `m:ss`, or `h:mm:ss` from an hour on.
fn clock(d: Duration) -> String {
    let s = d.as_secs();
    match s / 3600 {
        0 => format!("{}:{:02}", s / 60, s % 60),
        h => format!("{h}:{:02}:{:02}", s / 60 % 60, s % 60),
    }
}

/// A terminal's bar for `what` over `len` units.
fn bar(what: &str, len: u64) -> ProgressBar {
    let style = ProgressStyle::with_template(
        "{prefix} {bar:30} {pos}/{len} [{elapsed_precise}<{eta_precise}] {msg}",
    )
    .expect("a valid template");
    ProgressBar::new(len)
        .with_prefix(what.to_string())
        .with_style(style)
}

/// A terminal's spinner for waiting on `what`.
fn spinner(what: &str) -> ProgressBar {
    let style = ProgressStyle::with_template("{spinner} {prefix} [{elapsed_precise}] {msg}")
        .expect("a valid template");
    ProgressBar::new_spinner()
        .with_prefix(what.to_string())
        .with_style(style)
}

/// The interval of plain lines from [`INTERVAL_ENV`]; none when it is `0`.
fn interval_from_env() -> Option<Duration> {
    match std::env::var(INTERVAL_ENV) {
        Ok(v) => match v.trim().parse::<f64>() {
            Ok(s) if s > 0.0 && s.is_finite() => Some(Duration::from_secs_f64(s)),
            Ok(_) => None,
            Err(_) => Some(DEFAULT_INTERVAL),
        },
        Err(_) => Some(DEFAULT_INTERVAL),
    }
}

impl Progress {
    /// The progress of `what` over `len` `unit`s (`len` 0: unknown): a bar when stderr is a terminal, else plain
    /// lines (see the module docs).
    pub fn new(what: &str, unit: &str, len: u64) -> Self {
        if std::io::stderr().is_terminal() {
            return Self::with(
                Style::Bar(bar(what, len)),
                Sink::std(),
                what,
                unit,
                len,
                None,
            );
        }
        match interval_from_env() {
            Some(every) => Self::with(Style::Lines, Sink::std(), what, unit, len, Some(every)),
            None => Self::hidden(),
        }
    }

    /// The progress of waiting for `what`, whose length is unknown (a spinner in a terminal, plain lines with the
    /// time waited elsewhere).
    pub fn waiting(what: &str) -> Self {
        if std::io::stderr().is_terminal() {
            let bar = spinner(what);
            bar.enable_steady_tick(Duration::from_millis(120));
            return Self::with(Style::Bar(bar), Sink::std(), what, "", 0, None);
        }
        match interval_from_env() {
            Some(every) => Self::with(Style::Lines, Sink::std(), what, "", 0, Some(every)),
            None => Self::hidden(),
        }
    }

    /// A progress that shows nothing (ranks that do not report); [`Progress::println`] still prints.
    pub fn hidden() -> Self {
        Self::default()
    }

    fn with(
        style: Style,
        sink: Sink,
        what: &str,
        unit: &str,
        len: u64,
        every: Option<Duration>,
    ) -> Self {
        let shared = Arc::new(Shared {
            style,
            sink,
            state: Mutex::new(State {
                top: Count::new(what, unit, len),
                sub: None,
                done: false,
            }),
            wake: Condvar::new(),
        });
        let printer = every.map(|every| {
            let s = shared.clone();
            std::thread::Builder::new()
                .name("ferl-progress".into())
                .spawn(move || s.print_lines(every))
                .expect("starting the progress printer")
        });
        Self {
            owner: Some(Arc::new(Owner {
                shared,
                printer: Mutex::new(printer),
            })),
        }
    }

    fn shared(&self) -> Option<&Arc<Shared>> {
        self.owner.as_ref().map(|o| &o.shared)
    }

    /// Whether it shows nothing.
    pub fn is_hidden(&self) -> bool {
        self.owner.is_none()
    }

    /// Sets the number of units (0: unknown).
    pub fn set_length(&self, len: u64) {
        if let Some(s) = self.shared() {
            s.state().top.len = len;
            if let Style::Bar(b) = &s.style {
                b.set_length(len);
            }
        }
    }

    /// Sets the units done.
    pub fn set_position(&self, pos: u64) {
        if let Some(s) = self.shared() {
            s.state().top.set_position(pos);
            if let Style::Bar(b) = &s.style {
                b.set_position(pos);
            }
        }
    }

    /// Adds `n` units done.
    pub fn inc(&self, n: u64) {
        if let Some(s) = self.shared() {
            s.state().top.inc(n);
            if let Style::Bar(b) = &s.style {
                b.inc(n);
            }
        }
    }

    /// Sets the text shown after the count (`loss 2.31 lr 1e-5`).
    pub fn set_message(&self, msg: impl Into<String>) {
        if let Some(s) = self.shared() {
            let msg = msg.into();
            let mut st = s.state();
            if let (Style::Bar(b), None) = (&s.style, &st.sub) {
                b.set_message(msg.clone());
            }
            st.top.msg = msg;
        }
    }

    /// Prints `line` to stdout (above the bar in a terminal); it counts as a line of this progress.
    pub fn println(&self, line: impl AsRef<str>) {
        let line = line.as_ref();
        match self.shared() {
            None => println!("{line}"),
            Some(s) => match &s.style {
                Style::Bar(b) => b.println(line),
                Style::Lines => {
                    s.sink.out(line);
                    s.wake.notify_all();
                }
            },
        }
    }

    /// Starts a phase of `len` `unit`s inside this progress (`validation`, rows), until [`Phase::finish`] or its drop.
    pub fn phase(&self, what: &str, unit: &str, len: u64) -> Phase {
        let Some(s) = self.shared() else {
            return Phase::default();
        };
        let mut st = s.state();
        st.sub = Some(Count::new(what, unit, len));
        if let (Style::Bar(b), Some(sub)) = (&s.style, &st.sub) {
            b.set_message(sub.counted());
        }
        Phase {
            shared: Some(s.clone()),
        }
    }

    /// Finishes it: the bar stays drawn at its last state; in lines, a last line (`... done in 0:23`) when any was
    /// printed. Dropping the last clone unfinished (a failed phase) only stops the lines.
    pub fn finish(&self) {
        if let Some(o) = &self.owner {
            o.stop(true);
        }
    }
}

impl Owner {
    /// Stops the line printer; `done` also says so (a bar is drawn finished; in lines, a last line if any was
    /// printed).
    fn stop(&self, done: bool) {
        let s = &self.shared;
        let mut st = s.state();
        if st.done {
            return;
        }
        st.done = true;
        match &s.style {
            Style::Bar(b) if done => b.finish(),
            Style::Lines if done && st.top.printed => {
                s.sink.progress(&st.top.done_line(Instant::now()))
            }
            _ => {}
        }
        drop(st);
        s.wake.notify_all();
        if let Some(h) = self.printer.lock().expect("progress printer").take() {
            let _ = h.join();
        }
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        self.stop(false);
    }
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The line printer: the current phase's status whenever `every` passes without a line of the process's
    /// progress.
    fn print_lines(&self, every: Duration) {
        let mut st = self.state();
        loop {
            if st.done {
                return;
            }
            let now = Instant::now();
            let last = self.sink.last();
            let due = last + every;
            if now < due {
                st = self
                    .wake
                    .wait_timeout(st, due - now)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
                continue;
            }
            if !self.sink.claim(last, now) {
                continue;
            }
            let count = match st.sub.as_mut() {
                Some(sub) => sub,
                None => &mut st.top,
            };
            count.printed = true;
            let line = count.line(now);
            self.sink.progress(&line);
        }
    }
}

impl Phase {
    /// A phase that shows nothing.
    pub fn hidden() -> Self {
        Self::default()
    }

    /// Sets the number of units (0: unknown).
    pub fn set_length(&self, len: u64) {
        self.update(|c| c.len = len);
    }

    /// Sets the units done.
    pub fn set_position(&self, pos: u64) {
        self.update(|c| c.set_position(pos));
    }

    /// Adds `n` units done.
    pub fn inc(&self, n: u64) {
        self.update(|c| c.inc(n));
    }

    fn update(&self, f: impl FnOnce(&mut Count)) {
        let Some(s) = &self.shared else { return };
        let mut st = s.state();
        if let Some(sub) = st.sub.as_mut() {
            f(sub);
            if let Style::Bar(b) = &s.style {
                b.set_message(sub.counted());
            }
        }
    }
}

impl Phase {
    /// Ends the phase: in lines, a last line (`validation: 1319/1319 rows done in 0:23`) when any was printed.
    /// Dropping it unfinished (a failed phase) ends it silently.
    pub fn finish(mut self) {
        self.end(true);
    }

    fn end(&mut self, done: bool) {
        let Some(s) = self.shared.take() else { return };
        let mut st = s.state();
        let Some(sub) = st.sub.take() else { return };
        match &s.style {
            Style::Bar(b) => b.set_message(st.top.msg.clone()),
            Style::Lines if done && sub.printed && !st.done => {
                s.sink.progress(&sub.done_line(Instant::now()));
            }
            Style::Lines => {}
        }
    }
}

impl Drop for Phase {
    fn drop(&mut self) {
        self.end(false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines_every(every: Duration, what: &str, len: u64) -> (Progress, Arc<Mutex<Vec<String>>>) {
        let memory = Arc::new(Mutex::new(Vec::new()));
        let sink = Sink {
            last_line: Arc::new(Mutex::new(Instant::now())),
            memory: Some(memory.clone()),
        };
        let p = Progress::with(Style::Lines, sink, what, "rows", len, Some(every));
        (p, memory)
    }

    fn taken(m: &Arc<Mutex<Vec<String>>>) -> Vec<String> {
        std::mem::take(&mut *m.lock().unwrap())
    }

    #[test]
    fn a_silent_phase_prints_plain_status_lines_at_the_interval() {
        let (p, memory) = lines_every(Duration::from_millis(100), "tokenizing", 40);
        let t0 = Instant::now();
        p.set_position(0);
        for _ in 0..10 {
            std::thread::sleep(Duration::from_millis(35));
            p.inc(2);
        }
        let most = t0.elapsed().as_millis() / 100;
        let got = taken(&memory);
        assert!(!got.is_empty(), "a line after 100 ms of silence");
        assert!(
            got.len() as u128 <= most,
            "at most one line per 100 ms: {got:?}"
        );
        assert!(got[0].starts_with("tokenizing: "), "{got:?}");
        assert!(got.iter().all(|l| l.contains("/40 rows [0:0")), "{got:?}");
        assert!(
            got.iter().any(|l| l.contains(", eta ")),
            "the eta is shown once the rate is known: {got:?}"
        );
        assert!(
            got.iter().all(|l| l.is_ascii() && !l.contains('\x1b')),
            "{got:?}"
        );
        p.finish();
        let end = taken(&memory);
        assert_eq!(
            end.last().map(String::as_str),
            Some("tokenizing: 20/40 rows done in 0:00")
        );
    }

    #[test]
    fn a_short_phase_prints_nothing_and_printed_lines_reset_the_clock() {
        let (p, memory) = lines_every(Duration::from_millis(1000), "training", 3);
        p.set_position(1);
        let t0 = Instant::now();
        for step in 0..15 {
            std::thread::sleep(Duration::from_millis(50));
            p.println(format!("step {step}"));
        }
        let got = taken(&memory);
        let waited = t0.elapsed();
        if waited < Duration::from_millis(900) {
            assert_eq!(
                got.len(),
                15,
                "only the printed lines over {waited:?}: {got:?}"
            );
            assert!(got.iter().all(|l| l.starts_with("step ")), "{got:?}");
        }
        drop(p);
        assert!(
            taken(&memory).is_empty(),
            "a phase that printed no status ends silently"
        );
    }

    #[test]
    fn a_phase_inside_reports_its_own_count_then_the_outer_one_resumes() {
        let (p, memory) = lines_every(Duration::from_millis(80), "training", 10);
        p.set_position(2);
        p.set_message("loss 2.0000");
        let val = p.phase("validation", "rows", 1319);
        val.set_position(512);
        std::thread::sleep(Duration::from_millis(130));
        let got = taken(&memory);
        assert!(!got.is_empty(), "a line while validating");
        assert!(
            got.iter()
                .all(|l| l.starts_with("validation: 512/1319 rows [")),
            "{got:?}"
        );
        val.finish();
        let got = taken(&memory);
        assert_eq!(
            got.last().map(String::as_str),
            Some("validation: 512/1319 rows done in 0:00")
        );
        std::thread::sleep(Duration::from_millis(130));
        let got = taken(&memory);
        assert!(!got.is_empty(), "the outer progress goes on");
        assert!(
            got.iter()
                .all(|l| l.starts_with("training: 2/10 rows [") && l.ends_with("] loss 2.0000")),
            "{got:?}"
        );
        // Failed phases end without a `done` line.
        let val = p.phase("validation", "rows", 1319);
        std::thread::sleep(Duration::from_millis(130));
        drop(val);
        drop(p);
        let got = taken(&memory);
        assert!(
            !got.is_empty() && got.iter().all(|l| !l.contains("done")),
            "{got:?}"
        );
    }

    #[test]
    fn a_phase_after_a_silent_one_speaks_up_on_the_process_clock() {
        let every = Duration::from_millis(400);
        let (a, memory) = lines_every(every, "tokenizing", 10);
        let sink = a.owner.as_ref().unwrap().shared.sink.clone();
        std::thread::sleep(Duration::from_millis(300));
        a.finish();
        assert!(taken(&memory).is_empty(), "300 ms: no line yet");
        let b = Progress::with(Style::Lines, sink, "training", "steps", 5, Some(every));
        std::thread::sleep(Duration::from_millis(300));
        let got = taken(&memory);
        assert_eq!(
            got.len(),
            1,
            "400 ms after the last line, not 400 ms after `training` began: {got:?}"
        );
        assert!(got[0].starts_with("training: 0/5 steps [0:00]"), "{got:?}");
        drop(b);
    }

    #[test]
    fn in_a_terminal_a_phase_shows_its_count_in_the_bars_message() {
        let memory = Arc::new(Mutex::new(Vec::new()));
        let sink = Sink {
            last_line: Arc::new(Mutex::new(Instant::now())),
            memory: Some(memory.clone()),
        };
        let b = bar("training", 0);
        b.set_draw_target(indicatif::ProgressDrawTarget::hidden());
        let p = Progress::with(Style::Bar(b.clone()), sink, "training", "steps", 0, None);
        p.set_length(10);
        p.set_position(3);
        p.set_message("loss 2.0000");
        assert_eq!((b.length(), b.position()), (Some(10), 3));
        let val = p.phase("validation", "rows", 100);
        val.set_position(40);
        assert_eq!(b.message(), "validation: 40/100 rows");
        val.finish();
        assert_eq!(b.message(), "loss 2.0000", "the outer message is back");
        p.finish();
        assert!(b.is_finished());
        assert!(
            taken(&memory).is_empty(),
            "a bar prints no lines of its own"
        );
        let s = spinner("data loader");
        s.set_draw_target(indicatif::ProgressDrawTarget::hidden());
        assert_eq!(s.prefix(), "data loader");
    }

    #[test]
    fn a_hidden_progress_and_its_phases_do_nothing() {
        let p = Progress::hidden();
        assert!(p.is_hidden());
        p.set_length(3);
        p.inc(1);
        let phase = p.phase("validation", "rows", 3);
        phase.inc(1);
        assert!(phase.shared.is_none());
        p.finish();
    }

    #[test]
    fn clock_reads_minutes_and_hours() {
        assert_eq!(clock(Duration::from_secs(5)), "0:05");
        assert_eq!(clock(Duration::from_secs(754)), "12:34");
        assert_eq!(clock(Duration::from_secs(3 * 3600 + 62)), "3:01:02");
    }
}
