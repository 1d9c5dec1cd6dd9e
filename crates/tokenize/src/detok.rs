//! Streaming detokenization: turns generated ids into text chunks as they arrive, holding
//! back bytes of a character that later tokens complete, so no chunk ever carries half a
//! character or a U+FFFD for one.
//!
//! The prefix/read-offset technique (TGI, vLLM): decode a small window of ids twice, once
//! up to what was already emitted and once with the new ids, and emit the difference
//! once it no longer ends in U+FFFD. Work per token is bounded by the window, not by the
//! length of the whole output.

use crate::{TextTokenizer, TokenizerError};

/// Created by [`TextTokenizer::detokenizer`].
#[derive(Debug)]
pub struct IncrementalDetokenizer {
    tok: TextTokenizer,
    skip_special: bool,
    /// The window: `ids[..prefix]` is context already emitted, `ids[prefix..read]` the last
    /// emitted chunk, `ids[read..]` not emitted yet.
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl IncrementalDetokenizer {
    pub(crate) fn new(tok: TextTokenizer, skip_special: bool) -> Self {
        Self {
            tok,
            skip_special,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
        }
    }

    /// Feeds generated ids; returns the text they complete (possibly empty). An id outside
    /// the vocabulary is an error and leaves the state unchanged.
    pub fn push(&mut self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.tok.check_ids(ids)?;
        let mut out = String::new();
        for &id in ids {
            self.ids.push(id);
            out.push_str(&self.step()?);
        }
        Ok(out)
    }

    /// Everything still held back (an incomplete character decodes as U+FFFD here, as the
    /// bytes really are broken). The detokenizer is empty afterwards.
    pub fn finish(&mut self) -> String {
        let rest = self.diff().map(|(_, new)| new).unwrap_or_default();
        self.ids.clear();
        self.prefix = 0;
        self.read = 0;
        rest
    }

    fn step(&mut self) -> Result<String, TokenizerError> {
        let (complete, new) = self.diff()?;
        if new.is_empty() || !complete {
            return Ok(String::new());
        }
        self.prefix = self.read;
        self.read = self.ids.len();
        // Drop context that no later window needs.
        self.ids.drain(..self.prefix);
        self.read -= self.prefix;
        self.prefix = 0;
        Ok(new)
    }

    /// Text the unread ids add to the window, and whether it ends on a whole character.
    fn diff(&self) -> Result<(bool, String), TokenizerError> {
        let decode = |ids: &[u32]| {
            self.tok
                .inner()
                .decode(ids, self.skip_special)
                .map_err(TokenizerError::tokenizer)
        };
        let before = decode(&self.ids[self.prefix..self.read])?;
        let after = decode(&self.ids[self.prefix..])?;
        let complete = !after.ends_with(char::REPLACEMENT_CHARACTER);
        // Decoding more ids never rewrites earlier text for byte-level vocabularies; for
        // safety take the new text from the first byte where the two differ.
        let common = before
            .bytes()
            .zip(after.bytes())
            .take_while(|(a, b)| a == b)
            .count();
        let mut start = common.min(before.len());
        while !after.is_char_boundary(start) {
            start -= 1;
        }
        Ok((complete, after[start..].to_string()))
    }
}

#[cfg(test)]
mod tests {
    use crate::test_support::tiny;

    /// Pushes ids one at a time; returns the chunks, then what `finish` flushed.
    fn stream(ids: &[u32], skip_special: bool) -> (Vec<String>, String) {
        let mut d = tiny().detokenizer(skip_special);
        let chunks = ids.iter().map(|&id| d.push(&[id]).unwrap()).collect();
        (chunks, d.finish())
    }

    #[test]
    fn split_characters_are_held_until_complete() {
        // The tiny vocabulary has one token per byte: é is 2 tokens, 😀 is 4.
        let ids: Vec<u32> = "aé😀b".bytes().map(u32::from).collect();
        let (chunks, rest) = stream(&ids, false);
        assert_eq!(chunks, ["a", "", "é", "", "", "", "😀", "b"]);
        assert_eq!(rest, "");
    }

    #[test]
    fn pushing_many_ids_at_once_emits_every_complete_character() {
        let tok = tiny();
        let mut d = tok.detokenizer(false);
        let bytes = "中文".as_bytes();
        // All of 中 and the first byte of 文.
        let first: Vec<u32> = bytes[..4].iter().map(|&b| u32::from(b)).collect();
        assert_eq!(d.push(&first).unwrap(), "中");
        let second: Vec<u32> = bytes[4..].iter().map(|&b| u32::from(b)).collect();
        assert_eq!(d.push(&second).unwrap(), "文");
    }

    #[test]
    fn finish_flushes_a_truly_broken_character_as_replacement() {
        let (chunks, rest) = stream(&[u32::from(b'x'), 0xf0, 0x9f], false);
        assert_eq!(chunks, ["x", "", ""]);
        assert_eq!(rest, "\u{FFFD}");
    }

    #[test]
    fn special_tokens_follow_skip_special() {
        let (chunks, _) = stream(&[256, 259, 257], false);
        assert_eq!(chunks, ["<|im_start|>", "hi", "<|im_end|>"]);
        let (chunks, _) = stream(&[256, 259, 257], true);
        assert_eq!(chunks, ["", "hi", ""]);
    }

    #[test]
    fn unknown_ids_are_an_error_and_change_nothing() {
        let mut d = tiny().detokenizer(false);
        assert!(d.push(&[0xc3, 9999]).is_err());
        assert_eq!(d.push(&[u32::from(b'a')]).unwrap(), "a");
    }
}
