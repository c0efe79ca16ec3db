//! Stop strings over streamed text. A stop string may span tokens, so text that could still
//! be the start of one is held back until it cannot (then released) or until the stop
//! string completes (then the output ends before it). Each token's log-probabilities
//! travel with its text, so a chunk carries the entries of the tokens whose text it
//! completes: nothing is sent twice or lost.

use std::collections::VecDeque;

/// A generated token as a client sees it in `logprobs`.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenInfo {
    pub text: String,
    pub logprob: f32,
    /// The most probable tokens' text and log-probability, best first.
    pub top: Vec<(String, f32)>,
    /// Characters of the completion before this token's text.
    pub offset: usize,
}

/// What may be sent after a push.
#[derive(Debug, Default, PartialEq)]
pub struct Released {
    pub text: String,
    pub tokens: Vec<TokenInfo>,
    /// A stop string was reached: `text` ends before it and nothing more comes.
    pub stopped: bool,
}

pub struct Holdback {
    stops: Vec<String>,
    /// Text not yet released; starts at byte `released` of the whole output.
    held: String,
    /// Tokens not yet released, with the byte range of their text in the whole output.
    tokens: VecDeque<(usize, usize, TokenInfo)>,
    released: usize,
    pushed: usize,
    pushed_chars: usize,
}

impl Holdback {
    pub fn new(stops: Vec<String>) -> Self {
        let stops = stops.into_iter().filter(|s| !s.is_empty()).collect();
        Holdback { stops, held: String::new(), tokens: VecDeque::new(), released: 0, pushed: 0, pushed_chars: 0 }
    }

    /// Add a token's text (`piece`, possibly empty while a character is unfinished) and
    /// its log-probabilities; returns what can be sent now.
    pub fn push(&mut self, piece: &str, token: Option<TokenInfo>) -> Released {
        let start = self.pushed;
        self.held.push_str(piece);
        self.pushed += piece.len();
        if let Some(t) = token {
            self.tokens.push_back((start, self.pushed, TokenInfo { offset: self.pushed_chars, ..t }));
        }
        self.pushed_chars += piece.chars().count();
        if let Some(at) = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min() {
            let cut = self.released + at;
            // Tokens whose text starts before the stop string are part of the output.
            let tokens = self.tokens.drain(..).filter(|(s, _, _)| *s < cut).map(|(_, _, t)| t).collect();
            self.held.truncate(at);
            return Released { text: std::mem::take(&mut self.held), tokens, stopped: true };
        }
        let keep = self.stops.iter().map(|s| held_prefix(&self.held, s)).max().unwrap_or(0);
        let text: String = self.held.drain(..self.held.len() - keep).collect();
        self.released += text.len();
        let released = self.released;
        Released { text, tokens: self.take_tokens(|end| end <= released), stopped: false }
    }

    /// Everything held, when the generation ended without a stop string.
    pub fn finish(&mut self) -> Released {
        let text = std::mem::take(&mut self.held);
        self.released += text.len();
        Released { text, tokens: self.take_tokens(|_| true), stopped: false }
    }

    /// The leading tokens whose text ends where `done` says.
    fn take_tokens(&mut self, done: impl Fn(usize) -> bool) -> Vec<TokenInfo> {
        let n = self.tokens.iter().take_while(|(_, end, _)| done(*end)).count();
        self.tokens.drain(..n).map(|(_, _, t)| t).collect()
    }
}

/// Bytes at the end of `held` that begin `stop` (its longest proper prefix `held` ends with).
fn held_prefix(held: &str, stop: &str) -> usize {
    let (h, s) = (held.as_bytes(), stop.as_bytes());
    // A prefix that ends inside a character can never match: `held` ends on a boundary.
    (1..s.len().min(h.len() + 1)).rev().find(|&k| h.ends_with(&s[..k])).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok(text: &str) -> Option<TokenInfo> {
        Some(TokenInfo { text: text.into(), logprob: -1.0, top: vec![], offset: 0 })
    }

    fn texts(r: &Released) -> Vec<(&str, usize)> {
        r.tokens.iter().map(|t| (t.text.as_str(), t.offset)).collect()
    }

    /// A stop string split over three tokens: the text before it is sent once, the tokens
    /// inside it are not, and text that only might start it is released when it cannot.
    #[test]
    fn stops_across_tokens() {
        let mut h = Holdback::new(vec!["</answer>".into(), "\n\n".into()]);
        let r = h.push("The", tok("The"));
        assert_eq!((r.text.as_str(), texts(&r), r.stopped), ("The", vec![("The", 0)], false));
        let r = h.push(" answer </", tok(" answer </"));
        assert_eq!((r.text.as_str(), texts(&r)), (" answer ", vec![]));
        let r = h.push("ans", tok("ans"));
        assert_eq!(r, Released::default());
        let r = h.push("wer> more", tok("wer> more"));
        assert_eq!((r.text.as_str(), texts(&r), r.stopped), ("", vec![(" answer </", 3)], true));
    }

    #[test]
    fn held_text_is_released_when_it_cannot_stop() {
        let mut h = Holdback::new(vec!["\n\n".into()]);
        let r = h.push("a\n", tok("a\n"));
        assert_eq!((r.text.as_str(), texts(&r)), ("a", vec![]));
        let r = h.push("b", tok("b"));
        assert_eq!((r.text.as_str(), texts(&r)), ("\nb", vec![("a\n", 0), ("b", 2)]));
        let r = h.push("\n", tok("\n"));
        assert_eq!(r.text, "");
        let r = h.finish();
        assert_eq!((r.text.as_str(), texts(&r), r.stopped), ("\n", vec![("\n", 3)], false));
    }

    /// A character split over two tokens: the first token's text is empty; both entries
    /// point at where the character starts.
    #[test]
    fn unfinished_characters_and_no_stops() {
        let mut h = Holdback::new(vec![]);
        let r = h.push("", tok("\u{fffd}"));
        assert_eq!((r.text.as_str(), texts(&r)), ("", vec![("\u{fffd}", 0)]));
        let r = h.push("é!", tok("\u{fffd}!"));
        assert_eq!((r.text.as_str(), texts(&r)), ("é!", vec![("\u{fffd}!", 0)]));
        let r = h.push("x", None);
        assert_eq!((r.text.as_str(), r.tokens.len()), ("x", 0));
    }

    #[test]
    fn the_earliest_stop_wins_and_multibyte_prefixes_hold() {
        let mut h = Holdback::new(vec!["cd".into(), "bc".into(), "€€".into()]);
        assert_eq!(h.push("ab", None).text, "a");
        // "bc" starts before "cd": the output ends after "a".
        let r = h.push("cd", None);
        assert_eq!((r.text.as_str(), r.stopped), ("", true));
        let mut h = Holdback::new(vec!["€€".into()]);
        assert_eq!(h.push("x€", None).text, "x");
        assert_eq!(h.push("y", None).text, "€y");
        assert_eq!(held_prefix("a€", "€€"), 3);
    }
}
