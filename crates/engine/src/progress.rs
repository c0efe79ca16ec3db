//! Progress bars (indicatif) for load, convert, perplexity and bench: hidden when not wanted
//! (the caller passes whether stderr is a terminal).

use indicatif::{ProgressBar, ProgressStyle};

/// A bar counting bytes.
pub fn bar(enabled: bool, total: u64, what: &str) -> ProgressBar {
    styled(enabled, total, what, "{msg} [{bar:30}] {bytes}/{total_bytes} ({eta})")
}

/// A bar counting `total` steps (tokens, runs) rather than bytes.
pub fn count_bar(enabled: bool, total: u64, what: &str) -> ProgressBar {
    styled(enabled, total, what, "{msg} [{bar:30}] {pos}/{len} ({eta})")
}

fn styled(enabled: bool, total: u64, what: &str, template: &str) -> ProgressBar {
    if !enabled {
        return ProgressBar::hidden();
    }
    let b = ProgressBar::new(total);
    b.set_style(
        ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar()).progress_chars("=> "),
    );
    b.set_message(what.to_string());
    b
}
