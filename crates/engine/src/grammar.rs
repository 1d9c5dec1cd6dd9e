//! Constrained decoding with llguidance: a request's grammar (Lark, with `%json{…}` for
//! JSON schemas) becomes a token mask applied to its logits before sampling, so the model
//! can only write text the grammar accepts. The vocabulary comes from the engine's own
//! token-bytes table (the engine never tokenizes); the mask for a step is computed on
//! another thread while the forward pass runs.
//!
//! Compiling a grammar can take long (a large JSON schema): a request carries its grammar
//! compiled ([`Grammar`], made only by [`GrammarCompiler::compile`] on the caller's
//! thread), and the engine thread only copies the compiled parser. The engine never
//! compiles: there is no path from a grammar's text to its thread.

use std::sync::{Arc, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory, TokenParser};

use crate::EngineError;

/// Why a grammar could not be built or refused a token.
#[derive(Clone, Debug, thiserror::Error)]
pub enum GrammarError {
    #[error("the model names no end-of-generation token")]
    NoEndToken,
    #[error("the grammar engine refused the vocabulary: {0}")]
    Vocabulary(String),
    #[error("the grammar refused token {token}: {why}")]
    Refused { token: u32, why: String },
}

/// Builds matchers for one vocabulary. The token trie is built on first use (a grammar
/// request), not at load.
pub(crate) struct Grammars {
    token_bytes: Vec<Vec<u8>>,
    eog: Vec<u32>,
    factory: OnceLock<Result<Arc<ParserFactory>, GrammarError>>,
}

/// A grammar compiled for one engine's vocabulary, as a request carries it
/// ([`crate::SamplingParams::grammar`]). Cheap to clone; equal when the texts are.
#[derive(Clone)]
pub struct Grammar {
    lark: Arc<str>,
    parser: TokenParser,
    /// The vocabulary it was compiled for: an engine refuses another's.
    vocab: usize,
}

impl Grammar {
    /// The grammar's text (Lark).
    pub fn lark(&self) -> &str {
        &self.lark
    }
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Grammar").field(&self.lark).finish()
    }
}

impl PartialEq for Grammar {
    fn eq(&self, other: &Self) -> bool {
        self.lark == other.lark && self.vocab == other.vocab
    }
}

/// Compiles grammars for an engine off its thread. Cheap to clone.
#[derive(Clone)]
pub struct GrammarCompiler(pub(crate) Arc<Grammars>);

impl GrammarCompiler {
    /// Compiles `lark` for this engine's vocabulary (a caller's error if it does not
    /// compile). Blocking, and possibly long: call it off the engine's thread.
    pub fn compile(&self, lark: &str) -> Result<Grammar, EngineError> {
        Ok(Grammar {
            lark: lark.into(),
            parser: self.0.parser(lark)?,
            vocab: self.0.token_bytes.len(),
        })
    }
}

impl Grammars {
    /// `token_bytes[i]`: the bytes token `i` stands for (empty for control tokens);
    /// `eog`: the ids that end generation (the first stands for "end" in grammars).
    pub fn new(token_bytes: Vec<Vec<u8>>, eog: Vec<u32>) -> Self {
        Self {
            token_bytes,
            eog,
            factory: OnceLock::new(),
        }
    }

    fn factory(&self) -> Result<&Arc<ParserFactory>, EngineError> {
        let built = self.factory.get_or_init(|| {
            let eos = *self.eog.first().ok_or(GrammarError::NoEndToken)?;
            let words: Vec<Vec<u8>> = self
                .token_bytes
                .iter()
                .enumerate()
                .map(|(i, b)| {
                    if b.is_empty() {
                        // Control tokens never match text: mark them special, as the
                        // trie expects (0xFF prefix), with a unique name.
                        let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                        w.extend(format!("<special_{i}>").as_bytes());
                        w
                    } else {
                        b.clone()
                    }
                })
                .collect();
            let info = TokRxInfo::new(words.len() as u32, eos);
            let trie = TokTrie::from(&info, &words);
            let env: llguidance::toktrie::TokEnv = Arc::new(ApproximateTokEnv::new(trie));
            let mut factory = ParserFactory::new_simple(&env)
                .map_err(|e| GrammarError::Vocabulary(e.to_string()))?;
            factory.quiet();
            Ok(Arc::new(factory))
        });
        built
            .as_ref()
            .map_err(|e| EngineError::Unsupported(format!("grammar: {e}")))
    }

    /// Compiles `lark`; a grammar that does not compile is the caller's error.
    fn parser(&self, lark: &str) -> Result<TokenParser, EngineError> {
        self.factory()?
            .create_parser(TopLevelGrammar::from_lark(lark.to_owned()))
            .map_err(|e| EngineError::InvalidParam {
                field: "grammar",
                msg: e.to_string(),
            })
    }

    /// A fresh matcher for compiled grammar `g`: a copy of its parser, nothing compiled.
    /// A grammar compiled for another vocabulary is the caller's error.
    pub fn matcher(&self, g: &Grammar) -> Result<Constraint, EngineError> {
        if g.vocab != self.token_bytes.len() {
            return Err(EngineError::InvalidParam {
                field: "grammar",
                msg: format!(
                    "compiled for a vocabulary of {} tokens; this model has {}",
                    g.vocab,
                    self.token_bytes.len()
                ),
            });
        }
        Ok(Constraint {
            matcher: Matcher::new(Ok(g.parser.clone())),
            mask: None,
            eos: self.eog[0],
        })
    }
}

/// One request's grammar state: the matcher and the mask for its next token.
pub(crate) struct Constraint {
    matcher: Matcher,
    mask: Option<SimpleVob>,
    eos: u32,
}

impl Constraint {
    /// Computes the mask for the next token if it is not known yet (run off the engine's
    /// critical path, beside the forward pass).
    pub fn prepare(&mut self) {
        if self.mask.is_none() && !self.matcher.is_stopped() {
            match self.matcher.compute_mask() {
                Ok(m) => self.mask = Some(self.forced(m)),
                Err(e) => tracing::warn!(error = %e, "the grammar could not compute a mask"),
            }
        }
    }

    /// Where the grammar forces the next bytes (a tag, a key, a tool's name), only the
    /// longest token spelling a prefix of them: otherwise a model that never saw the text
    /// may spell it letter by letter, spending many tokens on what had no choice.
    fn forced(&mut self, mask: SimpleVob) -> SimpleVob {
        let ff = self.matcher.compute_ff_bytes();
        if ff.is_empty() {
            return mask;
        }
        let Ok(env) = self.matcher.tok_env() else {
            return mask;
        };
        let (tok, len) = env.tok_trie().prefix_token_id(&ff);
        if len == 0 || !mask.is_allowed(tok) {
            return mask;
        }
        let mut only = SimpleVob::alloc(mask.len());
        only.allow_token(tok);
        only
    }

    /// Sets every token the grammar forbids to -inf. The grammar's "end" allows every
    /// end-of-generation id. Returns false when nothing is allowed (the grammar is done
    /// or failed), so the caller ends the sequence.
    pub fn apply(&mut self, logits: &mut [f32], eog: &[u32]) -> bool {
        self.prepare();
        let Some(mask) = &self.mask else {
            // Stopped or failed: only an end token may follow.
            for (t, l) in logits.iter_mut().enumerate() {
                if !eog.contains(&(t as u32)) {
                    *l = f32::NEG_INFINITY;
                }
            }
            return false;
        };
        let end = mask.is_allowed(self.eos);
        let mut any = false;
        for (t, l) in logits.iter_mut().enumerate() {
            let t = t as u32;
            let ok = if eog.contains(&t) {
                end
            } else {
                (t as usize) < mask.len() && mask.is_allowed(t)
            };
            if ok {
                any |= *l > f32::NEG_INFINITY;
            } else {
                *l = f32::NEG_INFINITY;
            }
        }
        any
    }

    /// Advances past sampled token `tok` (an end-of-generation id counts as "end").
    /// Err: the grammar rejected it.
    pub fn commit(&mut self, tok: u32, eog: &[u32]) -> Result<(), GrammarError> {
        self.mask = None;
        let t = if eog.contains(&tok) { self.eos } else { tok };
        self.matcher
            .consume_token(t)
            .map_err(|e| GrammarError::Refused {
                token: tok,
                why: e.to_string(),
            })
    }

    /// Whether the grammar is complete and can take no more text.
    pub fn done(&self) -> bool {
        self.matcher.is_stopped()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A matcher for `lark`, compiled as a caller would.
    fn compiled(g: &Grammars, lark: &str) -> Result<Constraint, EngineError> {
        let grammar = Grammar {
            lark: lark.into(),
            parser: g.parser(lark)?,
            vocab: g.token_bytes.len(),
        };
        g.matcher(&grammar)
    }

    /// A byte-level toy vocabulary: 256 single bytes, a few merges, and two control ids.
    fn toy() -> Grammars {
        let mut words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        for w in [
            "{\"",
            "\":",
            "name",
            "get_weather",
            "\"}",
            "<tool_call>",
            "Paris",
        ] {
            words.push(w.as_bytes().to_vec());
        }
        words.push(Vec::new()); // eos
        words.push(Vec::new()); // another end token
        let n = words.len() as u32;
        Grammars::new(words, vec![n - 2, n - 1])
    }

    fn greedy(g: &Grammars, c: &mut Constraint, prefer: &[u8], max: usize) -> Vec<u8> {
        let vocab = g.token_bytes.len();
        let mut out = Vec::new();
        for _ in 0..max {
            // Prefer the longest token continuing `prefer`, else the lowest allowed id.
            let mut logits = vec![0.0f32; vocab];
            for (t, b) in g.token_bytes.iter().enumerate() {
                if !b.is_empty() && prefer[out.len().min(prefer.len())..].starts_with(b) {
                    logits[t] = 1.0 + b.len() as f32;
                }
            }
            let live = c.apply(&mut logits, &g.eog);
            let tok = crate::sampler::argmax(&logits);
            if !live || g.eog.contains(&tok) {
                c.commit(tok, &g.eog).unwrap();
                break;
            }
            out.extend(&g.token_bytes[tok as usize]);
            c.commit(tok, &g.eog).unwrap();
            if c.done() {
                break;
            }
        }
        out
    }

    #[test]
    fn the_mask_forces_the_grammar_whatever_the_model_prefers() {
        let g = toy();
        let lark = r#"start: "<tool_call>\n" %json{"type":"object","properties":{"name":{"const":"get_weather"}},"required":["name"],"additionalProperties":false,"x-guidance":{"whitespace_flexible":false}} "\n</tool_call>""#;
        let mut c = compiled(&g, lark).unwrap();
        // The "model" wants to write prose; the grammar wins.
        let out = greedy(&g, &mut c, b"Sure, the weather in Paris is", 200);
        let text = String::from_utf8(out).unwrap();
        let body = text
            .strip_prefix("<tool_call>\n")
            .and_then(|r| r.strip_suffix("\n</tool_call>"))
            .unwrap_or_else(|| panic!("not a tool call: {text:?}"));
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["name"], "get_weather");
        assert!(c.done(), "the grammar is complete after the closing tag");
    }

    #[test]
    fn one_compiled_grammar_serves_many_requests_and_a_bad_one_is_refused_at_compile() {
        let compiler = GrammarCompiler(Arc::new(toy()));
        let lark = r#"start: "<tool_call>" /[a-z]+/"#;
        let grammar = compiler.compile(lark).unwrap();
        assert_eq!(grammar.lark(), lark);
        let g = &compiler.0;
        for _ in 0..3 {
            let mut m = g.matcher(&grammar).unwrap();
            let mut logits = vec![0.0f32; g.token_bytes.len()];
            assert!(m.apply(&mut logits, &g.eog), "a working matcher");
            let allowed = logits.iter().filter(|l| **l > f32::NEG_INFINITY).count();
            assert_eq!(allowed, 1, "only the forced tag's longest token");
        }
        let e = compiler.compile("start: (").unwrap_err();
        assert!(
            matches!(
                e,
                EngineError::InvalidParam {
                    field: "grammar",
                    ..
                }
            ),
            "{e}"
        );
        // Compiled for another vocabulary: refused, never applied to this one's ids.
        let mut words = g.token_bytes.clone();
        words.push(b"zz".to_vec());
        let other = GrammarCompiler(Arc::new(Grammars::new(words, g.eog.clone())));
        let foreign = other.compile(lark).unwrap();
        assert!(matches!(
            g.matcher(&foreign),
            Err(EngineError::InvalidParam {
                field: "grammar",
                ..
            })
        ));
    }

    #[test]
    fn forced_text_is_spelled_with_the_longest_token() {
        let g = toy();
        let mut c = compiled(&g, r#"start: "<tool_call>" /[a-z]+/"#).unwrap();
        let vocab = g.token_bytes.len();
        let mut logits = vec![0.0f32; vocab];
        logits[usize::from(b'<')] = 5.0; // the model prefers the one-byte spelling
        assert!(c.apply(&mut logits, &g.eog));
        let allowed: Vec<usize> = (0..vocab)
            .filter(|&t| logits[t] > f32::NEG_INFINITY)
            .collect();
        assert_eq!(allowed.len(), 1);
        assert_eq!(g.token_bytes[allowed[0]], b"<tool_call>");
        c.commit(allowed[0] as u32, &g.eog).unwrap();
        // A free choice is left free.
        let mut logits = vec![0.0f32; vocab];
        assert!(c.apply(&mut logits, &g.eog));
        // a-z, and the merge "name".
        assert_eq!((0..vocab).filter(|&t| logits[t] == 0.0).count(), 27);
    }

    #[test]
    fn an_end_token_is_allowed_only_where_the_grammar_may_end() {
        let g = toy();
        let mut c = compiled(&g, r#"start: "ab" | "abc""#).unwrap();
        let (a, b) = (u32::from(b'a'), u32::from(b'b'));
        let vocab = g.token_bytes.len();
        let mut logits = vec![0.0f32; vocab];
        assert!(c.apply(&mut logits, &g.eog));
        assert!(logits[a as usize].is_finite());
        assert!(
            g.eog
                .iter()
                .all(|&e| logits[e as usize] == f32::NEG_INFINITY)
        );
        c.commit(a, &g.eog).unwrap();
        c.commit(b, &g.eog).unwrap();
        let mut logits = vec![0.0f32; vocab];
        assert!(c.apply(&mut logits, &g.eog));
        assert!(
            g.eog.iter().all(|&e| logits[e as usize] == 0.0),
            "ab is complete"
        );
        assert!(logits[usize::from(b'c')].is_finite());
        assert!(logits[usize::from(b'd')] == f32::NEG_INFINITY);
        c.commit(g.eog[1], &g.eog).unwrap();
        assert!(c.done());
    }

    #[test]
    fn a_bad_grammar_is_the_callers_error() {
        let g = toy();
        let Err(e) = compiled(&g, "start: undefined_rule") else {
            panic!("compiled a grammar with an undefined rule");
        };
        assert!(e.is_client_error(), "{e}");
        assert!(matches!(
            e,
            EngineError::InvalidParam {
                field: "grammar",
                ..
            }
        ));
    }

    /// The prefix the gateway puts before a constrained answer when the prompt opened
    /// `<think>`: free reasoning up to the first `</think>`, then the grammar.
    #[test]
    fn reasoning_runs_free_until_the_first_end_think() {
        let g = toy();
        let lark = "start: think_ answer_\nthink_[lazy]: /(?s:.*)<\\/think>/\nanswer_: \"X\"";
        let feed = |text: &str| {
            let mut c = compiled(&g, lark).unwrap();
            for b in text.bytes() {
                c.commit(u32::from(b), &g.eog)?;
            }
            Ok::<bool, GrammarError>(c.done())
        };
        assert!(feed("a <b> X</think>X").unwrap());
        assert!(feed("</think>X").unwrap());
        assert!(matches!(
            feed("ab</think>Y"),
            Err(GrammarError::Refused { token, .. }) if token == u32::from(b'Y')
        ));
        assert!(!feed("still thinking, X").unwrap());
    }

    #[test]
    fn a_token_outside_the_grammar_is_refused() {
        let g = toy();
        let mut c = compiled(&g, r#"start: "x""#).unwrap();
        assert!(matches!(
            c.commit(u32::from(b'y'), &g.eog),
            Err(GrammarError::Refused { token, .. }) if token == u32::from(b'y')
        ));
    }
}
