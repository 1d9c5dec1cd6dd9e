//! Stop strings with OpenAI semantics: the returned text ends just before the first
//! occurrence of any stop string, and while streaming, text that could be the start of a
//! stop string is held back until it is known not to be one, so no part of it leaks.
//! Text of the tokens before `min_tokens` is protected: a match must end after it (the
//! engine's rule, vLLM's too).

/// Filters a stream of text deltas against a set of stop strings.
#[derive(Debug, Default)]
pub(crate) struct StopFilter {
    stops: Vec<String>,
    held: String,
    stopped: bool,
    /// Bytes emitted so far (where `held` starts in the whole text).
    emitted: usize,
    /// A match must end past this byte of the whole text.
    floor: usize,
    /// The stop string that matched.
    matched: Option<String>,
}

impl StopFilter {
    /// Empty stop strings are ignored (the handlers reject them anyway).
    pub fn new(stops: &[String]) -> Self {
        Self {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            ..Self::default()
        }
    }

    /// Whether a stop string has been seen; everything after it is dropped.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// The stop string seen (the first in the text; of two at one place, the earlier
    /// listed).
    pub fn matched(&self) -> Option<&str> {
        self.matched.as_deref()
    }

    /// Feeds a delta; returns the text that is now safe to emit. With `protect`, no match
    /// may end inside this delta (it is the text of a token before `min_tokens`).
    pub fn push(&mut self, delta: &str, protect: bool) -> String {
        if self.stopped {
            return String::new();
        }
        self.held.push_str(delta);
        let floor = self.floor.saturating_sub(self.emitted);
        if protect {
            self.floor = self.emitted + self.held.len();
        }
        // The match that starts first wins; a held-back tail always starts at or before
        // any match, because every partial match is kept in `held`.
        if let Some((pos, k)) = self
            .stops
            .iter()
            .enumerate()
            .filter_map(|(k, s)| {
                self.held
                    .match_indices(s.as_str())
                    .map(|(i, _)| (i, k))
                    .find(|&(i, _)| i + s.len() > floor && !protect)
            })
            .min()
        {
            self.stopped = true;
            self.matched = Some(self.stops[k].clone());
            self.held.truncate(pos);
            return std::mem::take(&mut self.held);
        }
        let keep = self.partial_suffix_len();
        let emit = self.held.len() - keep;
        self.emitted += emit;
        self.held.drain(..emit).collect()
    }

    /// The stream ended without a stop string: releases what was held back.
    pub fn finish(&mut self) -> String {
        if self.stopped {
            String::new()
        } else {
            std::mem::take(&mut self.held)
        }
    }

    /// Length of the longest tail of `held` that is a proper prefix of some stop string.
    fn partial_suffix_len(&self) -> usize {
        let held = self.held.as_bytes();
        let mut best = 0;
        for stop in &self.stops {
            let max = (stop.len() - 1).min(held.len());
            for k in (best + 1..=max).rev() {
                let start = held.len() - k;
                if self.held.is_char_boundary(start) && stop.as_bytes().starts_with(&held[start..])
                {
                    best = k;
                    break;
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `deltas` and returns (the emitted pieces, the final text).
    fn run(stops: &[&str], deltas: &[&str]) -> (Vec<String>, String) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut f = StopFilter::new(&stops);
        let mut pieces: Vec<String> = deltas.iter().map(|d| f.push(d, false)).collect();
        pieces.push(f.finish());
        let text = pieces.concat();
        (pieces, text)
    }

    #[test]
    fn protected_text_never_matches_but_a_match_ending_after_it_does() {
        let stops = vec!["ab".to_string()];
        let mut f = StopFilter::new(&stops);
        // Two protected tokens with the stop string in them, then one that completes a
        // match begun in protected text.
        let mut out = f.push("xab", true);
        out.push_str(&f.push("ab", true));
        assert!(!f.stopped());
        out.push_str(&f.push("a", true));
        out.push_str(&f.push("b tail", false));
        assert!(f.stopped());
        assert_eq!(out, "xabab");
        // Unprotected from the start: the first match stops.
        let mut g = StopFilter::new(&stops);
        assert_eq!(g.push("xab", false), "x");
    }

    #[test]
    fn text_is_cut_before_the_stop_string() {
        let (_, text) = run(&["\n\n"], &["Hello", " world", "\n\nmore"]);
        assert_eq!(text, "Hello world");
        let stops = ["or".to_string(), "wor".to_string()];
        let mut f = StopFilter::new(&stops);
        f.push("Hello world", false);
        assert_eq!(f.matched(), Some("wor"), "the match that starts first");
    }

    #[test]
    fn a_stop_string_split_across_deltas_never_leaks() {
        let (pieces, text) = run(&["STOP"], &["abc S", "T", "O", "Pxyz"]);
        assert_eq!(text, "abc ");
        assert!(pieces.iter().all(|p| !p.contains('S')), "{pieces:?}");
    }

    #[test]
    fn a_false_start_is_released_once_it_diverges() {
        let (pieces, text) = run(&["STOP"], &["ST", "AR", "T"]);
        assert_eq!(text, "START");
        assert_eq!(pieces[0], "", "the possible start must be held back");
        assert_eq!(pieces[1], "STAR");
    }

    #[test]
    fn held_text_is_released_at_the_end_when_no_stop_matched() {
        let (_, text) = run(&["</end>"], &["the </e"]);
        assert_eq!(text, "the </e");
    }

    #[test]
    fn the_earliest_of_several_stop_strings_wins() {
        let (_, text) = run(&["world", "lo"], &["hello world"]);
        assert_eq!(text, "hel");
    }

    #[test]
    fn nothing_after_the_stop_is_emitted() {
        let mut f = StopFilter::new(&["x".to_string()]);
        assert_eq!(f.push("axb", false), "a");
        assert!(f.stopped());
        assert_eq!(f.push("ccc", false), "");
        assert_eq!(f.finish(), "");
    }

    #[test]
    fn multibyte_text_is_cut_on_char_boundaries() {
        let (_, text) = run(&["é!"], &["caf", "é", "é!"]);
        assert_eq!(text, "café");
        let (_, text) = run(&["日本"], &["今日は日", "曜日"]);
        assert_eq!(text, "今日は日曜日");
    }

    #[test]
    fn without_stop_strings_everything_passes_through_at_once() {
        let (pieces, _) = run(&[], &["a", "b"]);
        assert_eq!(pieces, ["a", "b", ""]);
    }
}
