//! One generation's text, as the tokenizer service and the gateway both produce it: ids in,
//! through the incremental detokenizer and (when asked) the output parser that splits
//! reasoning and tool calls from content, deltas out. One implementation, so a stream
//! gives the same deltas wherever it is detokenized.

use pdmesh_tokenize::{IncrementalDetokenizer, TextTokenizer, TokenizerError};

use crate::{Delta, OutputParser};

/// Created by [`TextStream::new`]; feed it with [`TextStream::push`], end it with
/// [`TextStream::finish`].
pub struct TextStream {
    detok: IncrementalDetokenizer,
    parser: Option<OutputParser>,
}

impl TextStream {
    /// Special tokens skipped or not; `parser` absent: plain text.
    pub fn new(tok: &TextTokenizer, skip_special: bool, parser: Option<OutputParser>) -> Self {
        Self {
            detok: tok.detokenizer(skip_special),
            parser,
        }
    }

    /// The deltas `ids` complete (possibly none). An id outside the vocabulary is an error
    /// and leaves the stream unchanged.
    pub fn push(&mut self, ids: &[u32]) -> Result<Vec<Delta>, TokenizerError> {
        let text = self.detok.push(ids)?;
        Ok(self.parse(text))
    }

    /// Everything still held back. `truncated`: the generation stopped at its length
    /// limit, so unfinished markup is dropped and the calls before it stand; otherwise an
    /// open block that never closed is a parse error.
    pub fn finish(mut self, truncated: bool) -> Vec<Delta> {
        let text = self.detok.finish();
        let mut deltas = self.parse(text);
        if let Some(p) = &mut self.parser {
            deltas.extend(if truncated {
                p.finish_truncated()
            } else {
                p.finish()
            });
        }
        deltas
    }

    fn parse(&mut self, text: String) -> Vec<Delta> {
        match &mut self.parser {
            None if text.is_empty() => Vec::new(),
            None => vec![Delta::Content(text)],
            Some(p) => p.push(text.as_bytes()),
        }
    }
}
