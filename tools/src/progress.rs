//! Progress of long work (`bench`, `report`, `soak`) on stderr.
//!
//! On a terminal an indicatif bar, with the work done, the item at hand and
//! an ETA; log lines written meanwhile go through [`LogWriter`], which
//! hides the bar while a line is written, so neither tears the other.
//! When stderr is not a terminal (a log file, a pipe, CI) there is no bar:
//! a plain progress line (tracing target `progress`) every
//! [`LINE_EVERY`], with the same figures. `--quiet` turns the `progress`
//! target off, and with it both.
//!
//! The ETA is linear: the time per unit so far times the units left
//! ([`eta`]), in both paths.

use std::fmt::Write as _;
use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressState, ProgressStyle};

/// How often the plain path logs a line (the first after one period).
pub const LINE_EVERY: Duration = Duration::from_secs(5);

/// The bar being drawn, if any, with its number: log lines hide it while
/// they are written.
static ACTIVE: Mutex<Option<(u64, ProgressBar)>> = Mutex::new(None);
/// Numbers of bars, so a bar that ends clears only itself from [`ACTIVE`].
static NEXT_BAR: AtomicU64 = AtomicU64::new(0);

fn active() -> Option<ProgressBar> {
    ACTIVE
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .as_ref()
        .map(|(_, b)| b.clone())
}

/// Run `f` (which writes to stderr) with the bar, if one is drawn, hidden.
pub fn suspend<R>(f: impl FnOnce() -> R) -> R {
    match active() {
        Some(bar) => bar.suspend(f),
        None => f(),
    }
}

/// The tracing writer of every command: stderr, one event at a time, with
/// the bar hidden while an event is written.
#[derive(Debug, Clone, Copy, Default)]
pub struct LogWriter;

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogWriter {
    type Writer = LogLine;
    fn make_writer(&'a self) -> LogLine {
        LogLine(Vec::new())
    }
}

/// One event's bytes, written to stderr when the event is complete.
#[derive(Debug)]
pub struct LogLine(Vec<u8>);

impl Write for LogLine {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for LogLine {
    fn drop(&mut self) {
        if self.0.is_empty() {
            return;
        }
        // A log line that cannot be written has nowhere else to go.
        suspend(|| {
            let _ = std::io::stderr().lock().write_all(&self.0);
        });
    }
}

/// The time left at a linear pace: `elapsed` per `done` units, for
/// `total - done` more; none before the first unit.
pub fn eta(elapsed: Duration, done: u64, total: u64) -> Option<Duration> {
    if done == 0 {
        return None;
    }
    let left = total.saturating_sub(done);
    Some(elapsed.mul_f64(left as f64 / done as f64))
}

/// `1h02m`, `3m07s`, `42s`.
fn human(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 3600 {
        format!("{}h{:02}m", s / 3600, s % 3600 / 60)
    } else if s >= 60 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        format!("{s}s")
    }
}

/// What a unit of the work is, as the lines and the bar name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// Runs, cases: counted.
    Items,
    /// Seconds of a timed phase.
    Seconds,
}

/// The plain path's line: `LABEL DONE/TOTAL[ s]: MSG (elapsed E, eta T)`.
pub fn line(
    label: &str,
    unit: Unit,
    done: u64,
    total: u64,
    msg: &str,
    elapsed: Duration,
) -> String {
    let mut s = format!("{label} {done}/{total}");
    if unit == Unit::Seconds {
        s.push_str(" s");
    }
    if !msg.is_empty() {
        let _ = write!(s, ": {msg}");
    }
    let _ = write!(s, " (elapsed {}", human(elapsed));
    if let Some(t) = eta(elapsed, done, total) {
        let _ = write!(s, ", eta {}", human(t));
    }
    s.push(')');
    s
}

#[derive(Debug)]
enum Show {
    /// `--quiet`.
    Hidden,
    /// A terminal: the bar and its number.
    Bar(ProgressBar, u64),
    /// A log: a line when `next` has passed.
    Lines { next: Instant },
}

/// The progress of one piece of work of `total` units.
#[derive(Debug)]
pub struct Progress {
    show: Show,
    label: &'static str,
    unit: Unit,
    total: u64,
    done: u64,
    msg: String,
    start: Instant,
}

impl Progress {
    /// Progress of `total` units labelled `label` (`starwire bench`), as a
    /// bar on a terminal, lines otherwise, nothing with `--quiet`.
    pub fn new(label: &'static str, unit: Unit, total: u64) -> Self {
        let now = Instant::now();
        let show = if !tracing::enabled!(target: "progress", tracing::Level::INFO) {
            Show::Hidden
        } else if std::io::stderr().is_terminal() {
            Show::Bar(
                bar(label, unit, total),
                NEXT_BAR.fetch_add(1, Ordering::Relaxed),
            )
        } else {
            Show::Lines {
                next: now + LINE_EVERY,
            }
        };
        Self::with(show, label, unit, total, now)
    }

    fn with(show: Show, label: &'static str, unit: Unit, total: u64, now: Instant) -> Self {
        if let Show::Bar(b, id) = &show {
            *ACTIVE.lock().unwrap_or_else(PoisonError::into_inner) = Some((*id, b.clone()));
        }
        Self {
            show,
            label,
            unit,
            total,
            done: 0,
            msg: String::new(),
            start: now,
        }
    }

    /// `done` units of the total are done; `msg` names the one at hand.
    pub fn set(&mut self, done: u64, msg: &str) {
        if let Some(l) = self.update(done, msg, Instant::now()) {
            tracing::info!(target: "progress", "{l}");
        }
    }

    /// The next item, named `msg`, begins.
    pub fn begin(&mut self, msg: &str) {
        self.set(self.done, msg);
    }

    /// The item at hand is done.
    pub fn end(&mut self) {
        let msg = std::mem::take(&mut self.msg);
        self.set(self.done + 1, &msg);
    }

    /// [`set`](Self::set) at `now`: the line the plain path logs, if one
    /// is due.
    fn update(&mut self, done: u64, msg: &str, now: Instant) -> Option<String> {
        self.done = done.min(self.total);
        if msg != self.msg {
            self.msg.clear();
            self.msg.push_str(msg);
        }
        match &mut self.show {
            Show::Hidden => None,
            Show::Bar(b, _) => {
                b.set_position(self.done);
                if b.message() != self.msg {
                    b.set_message(self.msg.clone());
                }
                None
            }
            Show::Lines { next } => {
                if now < *next {
                    return None;
                }
                while *next <= now {
                    *next += LINE_EVERY;
                }
                Some(line(
                    self.label,
                    self.unit,
                    self.done,
                    self.total,
                    &self.msg,
                    now.saturating_duration_since(self.start),
                ))
            }
        }
    }

    /// The work is over: the bar is cleared (the command's own output says
    /// what was done); nothing more is shown.
    pub fn finish(&mut self) {
        if let Show::Bar(b, id) = std::mem::replace(&mut self.show, Show::Hidden) {
            let mut active = ACTIVE.lock().unwrap_or_else(PoisonError::into_inner);
            if active.as_ref().is_some_and(|(a, _)| *a == id) {
                *active = None;
            }
            drop(active);
            b.finish_and_clear();
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.finish();
    }
}

/// A bar on stderr: `LABEL [bar] DONE/TOTAL (elapsed, eta) MSG`, the
/// message last.
fn bar(label: &'static str, unit: Unit, total: u64) -> ProgressBar {
    let unit = if unit == Unit::Seconds { " s" } else { "" };
    let template = format!(
        "{{prefix}} [{{bar:20}}] {{pos}}/{{len}}{unit} (elapsed {{elapsed_h}}, eta {{eta_linear}}) {{msg}}"
    );
    let style = ProgressStyle::with_template(&template)
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ")
        .with_key(
            "elapsed_h",
            |s: &ProgressState, w: &mut dyn std::fmt::Write| {
                let _ = w.write_str(&human(s.elapsed()));
            },
        )
        .with_key(
            "eta_linear",
            |s: &ProgressState, w: &mut dyn std::fmt::Write| {
                let t = eta(s.elapsed(), s.pos(), s.len().unwrap_or(0));
                let _ = w.write_str(&t.map_or_else(|| "?".to_owned(), human));
            },
        );
    let b = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    b.set_style(style);
    b.set_prefix(label);
    b.enable_steady_tick(Duration::from_millis(500));
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    fn active_id() -> Option<u64> {
        ACTIVE
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map(|(id, _)| *id)
    }

    #[test]
    fn eta_is_the_pace_so_far_times_what_is_left() {
        let s = Duration::from_secs;
        assert_eq!(eta(s(10), 0, 4), None);
        assert_eq!(eta(s(10), 1, 4), Some(s(30)));
        assert_eq!(eta(s(10), 2, 4), Some(s(10)));
        assert_eq!(eta(s(10), 4, 4), Some(s(0)));
        // Past the total (a drain that ran long) is no time left.
        assert_eq!(eta(s(10), 5, 4), Some(s(0)));
    }

    #[test]
    fn lines_name_the_work_the_item_and_the_eta() {
        let s = Duration::from_secs;
        assert_eq!(
            line(
                "starwire bench",
                Unit::Items,
                3,
                12,
                "tcp lat 64 B rep 1",
                s(9)
            ),
            "starwire bench 3/12: tcp lat 64 B rep 1 (elapsed 9s, eta 27s)"
        );
        assert_eq!(
            line("soak: sending", Unit::Seconds, 0, 600, "", s(0)),
            "soak: sending 0/600 s (elapsed 0s)"
        );
        assert_eq!(
            line("soak: sending", Unit::Seconds, 120, 3600, "", s(120)),
            "soak: sending 120/3600 s (elapsed 2m00s, eta 58m00s)"
        );
        assert_eq!(human(s(3725)), "1h02m");
    }

    #[test]
    fn the_plain_path_logs_a_line_every_period_only() {
        let t0 = Instant::now();
        let show = Show::Lines {
            next: t0 + LINE_EVERY,
        };
        let mut p = Progress::with(show, "report", Unit::Items, 10, t0);
        let at = |ms| t0 + Duration::from_millis(ms);
        assert_eq!(p.update(1, "lat", at(1000)), None);
        let l = p.update(2, "rate", at(5000)).expect("a line at 5 s");
        assert_eq!(l, "report 2/10: rate (elapsed 5s, eta 20s)");
        assert_eq!(p.update(3, "rate", at(9000)), None);
        // A long item: one line when it ends, not one per missed period.
        assert!(p.update(4, "bw", at(21_000)).is_some());
        assert_eq!(p.update(5, "bw", at(24_000)), None);
        assert!(p.update(20, "fuse", at(25_000)).unwrap().contains("10/10"));
    }

    #[test]
    fn hidden_progress_logs_nothing() {
        let t0 = Instant::now();
        let mut p = Progress::with(Show::Hidden, "x", Unit::Items, 2, t0);
        assert_eq!(p.update(1, "", t0 + Duration::from_secs(60)), None);
    }

    #[test]
    fn a_bar_is_active_while_it_lives() {
        let id = NEXT_BAR.fetch_add(1, Ordering::Relaxed);
        let show = Show::Bar(ProgressBar::hidden(), id);
        let mut p = Progress::with(show, "x", Unit::Items, 2, Instant::now());
        assert_eq!(active_id(), Some(id));
        assert!(active().is_some());
        p.finish();
        assert_ne!(active_id(), Some(id));
        // Without a bar, suspend just runs its closure.
        assert_eq!(suspend(|| 7), 7);
    }
}
