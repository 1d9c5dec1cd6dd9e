//! Lark grammars run over a byte vocabulary (256 one-byte tokens and an end token, 256):
//! what a grammar lets a model write, byte by byte, without a model's tokenizer.

use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};

/// The end token of the byte vocabulary.
pub const END: u32 = 256;

/// A matcher for the Lark `grammar` over the byte vocabulary; a grammar llguidance
/// refuses is a panic naming it.
pub fn byte_matcher(grammar: &str) -> llguidance::Matcher {
    let words: Vec<Vec<u8>> = (0..=255u8)
        .map(|b| vec![b])
        .chain([vec![0xff, b'E']])
        .collect();
    let trie = TokTrie::from(&TokRxInfo::new(words.len() as u32, END), &words);
    let env: TokEnv = std::sync::Arc::new(ApproximateTokEnv::new(trie));
    let factory = llguidance::ParserFactory::new_simple(&env).unwrap();
    let parser = factory
        .create_parser(llguidance::api::TopLevelGrammar::from_lark(grammar.into()))
        .unwrap_or_else(|e| panic!("{e}\n{grammar}"));
    llguidance::Matcher::new(Ok(parser))
}

/// How far the Lark `grammar` follows `text`: `Ok` when it accepts exactly `text`, else
/// the byte offset where it refused (or `text.len()`: it wanted more).
pub fn lark_follows(grammar: &str, text: &str) -> Result<(), usize> {
    let mut m = byte_matcher(grammar);
    for (i, b) in text.bytes().enumerate() {
        // Stopped: the grammar is complete and allows nothing more.
        if m.is_stopped() || !m.compute_mask().unwrap().is_allowed(u32::from(b)) {
            return Err(i);
        }
        m.consume_token(u32::from(b)).unwrap();
    }
    if m.is_stopped() || m.is_accepting().unwrap() {
        Ok(())
    } else {
        Err(text.len())
    }
}

/// Whether the Lark `grammar` accepts exactly `text`.
pub fn lark_accepts(grammar: &str, text: &str) -> bool {
    lark_follows(grammar, text).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grammar_accepts_its_text_and_says_where_another_goes_wrong() {
        let g = r#"start: "ab" "c"?"#;
        assert!(lark_accepts(g, "ab") && lark_accepts(g, "abc"));
        assert_eq!(lark_follows(g, "ax"), Err(1), "refused at the x");
        assert_eq!(lark_follows(g, "a"), Err(1), "wanted more");
        assert_eq!(lark_follows(g, "abcd"), Err(3), "nothing after the end");
    }
}
