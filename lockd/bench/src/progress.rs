//! The progress display on stderr: an indicatif bar on a terminal, otherwise a plain status line
//! every 10 s so that logs of long runs still show stalls as they happen.

use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Redraw period of the bar.
const TICK: Duration = Duration::from_millis(250);
/// Period of the plain status line when stderr is not a terminal.
const PLAIN_EVERY: Duration = Duration::from_secs(10);

/// A running display; `finish` removes it before the report is printed.
pub struct Progress {
    bar: ProgressBar,
    task: tokio::task::JoinHandle<()>,
}

impl Progress {
    /// Shows progress over `total` (warmup plus measured time); `status` renders the live
    /// counters.
    pub fn start(
        total: Duration,
        disabled: bool,
        status: impl Fn() -> String + Send + 'static,
    ) -> Progress {
        let target = if disabled {
            ProgressDrawTarget::hidden()
        } else {
            ProgressDrawTarget::stderr()
        };
        let bar = ProgressBar::with_draw_target(Some(total.as_millis() as u64), target);
        bar.set_style(
            ProgressStyle::with_template("{spinner} {elapsed:>4} [{bar:25}] {msg}")
                .expect("static template is valid")
                .progress_chars("=> "),
        );
        // Plain lines only when the bar cannot show and the user did not ask for silence.
        let plain = bar.is_hidden() && !disabled;
        let start = Instant::now();
        let shown = bar.clone();
        let task = tokio::spawn(async move {
            let mut last_plain = Instant::now();
            loop {
                tokio::time::sleep(TICK).await;
                let msg = status();
                shown.set_position(start.elapsed().as_millis() as u64);
                if plain && last_plain.elapsed() >= PLAIN_EVERY {
                    last_plain = Instant::now();
                    eprintln!("lockd-bench: {:>4}s {msg}", start.elapsed().as_secs());
                }
                shown.set_message(msg);
            }
        });
        Progress { bar, task }
    }

    /// A handle that prints whole lines while the display runs.
    pub fn lines(&self) -> Lines {
        Lines(self.bar.clone())
    }

    pub fn finish(self) {
        self.task.abort();
        self.bar.finish_and_clear();
    }
}

/// Prints lines on stderr beside a running display: a bar drawn on a terminal would otherwise
/// overwrite them or be torn by them.
#[derive(Clone)]
pub struct Lines(ProgressBar);

impl Lines {
    pub fn print(&self, line: &str) {
        self.0.suspend(|| eprintln!("{line}"));
    }
}
