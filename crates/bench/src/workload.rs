//! The workloads: seeded, so two runs (or a run and its reference) send the same requests.
//!
//! - `random`: one-turn prompts of about `input_len` tokens, `output_len` tokens out
//!   (`ignore_eos`, so every answer has the set length).
//! - `sessions`: multi-turn agentic sessions sharing one long system prompt and two tools;
//!   every other turn names a tool the model must call, whose result is added to the
//!   history, so each request carries the whole growing conversation.
//! - `long`: one-turn prompts of `input_len` tokens meant to be long (thousands).

use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{Value, json};

/// Which workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Kind {
    Random,
    Sessions,
    Long,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Self::Random => "random",
            Self::Sessions => "sessions",
            Self::Long => "long",
        }
    }
}

/// One user turn: its text, and the tool it must call (None: the model decides).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Turn {
    pub text: String,
    pub tool: Option<&'static str>,
}

/// A conversation a virtual user drives turn by turn.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Session {
    pub system: Option<String>,
    pub turns: Vec<Turn>,
    /// Whether requests carry the tools.
    pub tools: bool,
    /// Whether every answer runs to `max_tokens` (the random and long workloads).
    pub ignore_eos: bool,
}

/// Everything that decides the requests.
#[derive(Clone, Copy, Debug)]
pub struct Spec {
    pub kind: Kind,
    /// Sessions (one-turn workloads: requests) per load level.
    pub sessions: usize,
    /// Turns per session (sessions workload).
    pub turns: usize,
    /// About this many prompt tokens (random, long; the shared system prompt of sessions).
    pub input_len: usize,
    pub output_len: u32,
    pub seed: u64,
}

impl Spec {
    /// A one-line description for reports.
    pub fn describe(&self) -> String {
        match self.kind {
            Kind::Sessions => format!(
                "sessions: {} sessions x {} turns, system prompt ~{} tokens, up to {} tokens out, seed {}",
                self.sessions, self.turns, self.input_len, self.output_len, self.seed
            ),
            k => format!(
                "{}: {} requests, ~{} tokens in, {} tokens out, seed {}",
                k.name(),
                self.sessions,
                self.input_len,
                self.output_len,
                self.seed
            ),
        }
    }

    /// The sessions of one load level; `salt` makes each level's prompts its own, so a
    /// level does not find the previous one's prompts in a prefix cache (the sessions'
    /// shared system prompt stays the same: sharing it is the point).
    pub fn sessions(&self, salt: u64) -> Vec<Session> {
        let mut rng =
            ChaCha8Rng::seed_from_u64(self.seed ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        match self.kind {
            Kind::Random | Kind::Long => (0..self.sessions)
                .map(|_| Session {
                    system: None,
                    turns: vec![Turn {
                        text: words(&mut rng, self.input_len),
                        tool: None,
                    }],
                    tools: false,
                    ignore_eos: true,
                })
                .collect(),
            Kind::Sessions => {
                let system = system_prompt(self.seed, self.input_len);
                (0..self.sessions)
                    .map(|_| Session {
                        system: Some(system.clone()),
                        turns: (0..self.turns).map(|t| agent_turn(&mut rng, t)).collect(),
                        tools: true,
                        ignore_eos: false,
                    })
                    .collect()
            }
        }
    }
}

const WORDS: &[&str] = &[
    "the", "river", "stone", "light", "market", "winter", "garden", "paper", "silver", "cloud",
    "engine", "harbor", "window", "forest", "letter", "bridge", "candle", "valley", "mirror",
    "thunder", "orange", "signal", "desert", "ladder", "castle", "pencil", "rocket", "island",
    "copper", "meadow", "planet", "basket", "anchor", "violin", "shadow", "lantern", "falcon",
    "marble", "tunnel", "compass", "blanket", "harvest", "crystal", "whistle", "journey", "quiet",
    "bright", "gentle", "rapid", "ancient", "hollow", "golden", "narrow", "distant", "and", "with",
    "under", "over", "near", "beyond", "across", "between", "behind", "along",
];

const CITIES: &[&str] = &[
    "Paris", "Tokyo", "Lagos", "Lima", "Oslo", "Cairo", "Denver", "Hanoi", "Perth", "Quito",
];

const TOPICS: &[&str] = &[
    "rate limits",
    "streaming",
    "tool calls",
    "prefix caching",
    "batch jobs",
    "timeouts",
    "authentication",
    "model cards",
];

const FOLLOW_UPS: &[&str] = &[
    "Summarize that in one sentence.",
    "What should I do next?",
    "Give me one more detail.",
    "Is there anything to watch out for?",
];

fn words(rng: &mut ChaCha8Rng, n: usize) -> String {
    let mut s = String::with_capacity(n * 7);
    for i in 0..n.max(1) {
        if i > 0 {
            s.push(' ');
        }
        s.push_str(WORDS.choose(rng).expect("non-empty"));
    }
    s
}

/// The system prompt every session shares (the same for a seed, whatever the level).
fn system_prompt(seed: u64, len: usize) -> String {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    format!(
        "You are an operations agent. Use get_weather for weather questions and search_docs \
         for documentation questions; answer briefly otherwise. Reference notes: {}",
        words(&mut rng, len)
    )
}

fn agent_turn(rng: &mut ChaCha8Rng, t: usize) -> Turn {
    if t % 2 == 1 {
        return Turn {
            text: FOLLOW_UPS.choose(rng).expect("non-empty").to_string(),
            tool: None,
        };
    }
    if rng.random_bool(0.5) {
        Turn {
            text: format!(
                "What is the weather in {} today?",
                CITIES.choose(rng).expect("non-empty")
            ),
            tool: Some("get_weather"),
        }
    } else {
        Turn {
            text: format!(
                "Find the documentation about {}.",
                TOPICS.choose(rng).expect("non-empty")
            ),
            tool: Some("search_docs"),
        }
    }
}

/// The tools every sessions request carries (OpenAI's `tools` array).
pub fn tools() -> Value {
    json!([
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather for a city.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string"},
                        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}
                    },
                    "required": ["city"]
                }
            }
        },
        {
            "type": "function",
            "function": {
                "name": "search_docs",
                "description": "Search the documentation.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "query": {"type": "string"},
                        "limit": {"type": "integer"}
                    },
                    "required": ["query"]
                }
            }
        }
    ])
}

/// The result a tool "returns" for `arguments` (fixed, so runs stay comparable).
pub fn tool_result(name: &str, arguments: &str) -> String {
    let args: Value = serde_json::from_str(arguments).unwrap_or(Value::Null);
    match name {
        "get_weather" => json!({
            "city": args["city"],
            "forecast": "light rain, 14 degrees, wind 10 km/h"
        })
        .to_string(),
        _ => json!({
            "query": args["query"],
            "results": ["Section 2.1 covers this.", "See also the FAQ."]
        })
        .to_string(),
    }
}

/// Whether a call is valid for its tool: a known name, arguments that are a JSON object
/// with every required key, no unknown key, and each value of its declared type.
pub fn valid_call(name: &str, arguments: &str) -> bool {
    let tools = tools();
    let Some(tool) = tools
        .as_array()
        .into_iter()
        .flatten()
        .find(|t| t["function"]["name"] == name)
    else {
        return false;
    };
    let params = &tool["function"]["parameters"];
    let Ok(Value::Object(args)) = serde_json::from_str::<Value>(arguments) else {
        return false;
    };
    let required = params["required"].as_array().into_iter().flatten();
    if required
        .filter_map(Value::as_str)
        .any(|k| !args.contains_key(k))
    {
        return false;
    }
    args.iter().all(|(k, v)| {
        let spec = &params["properties"][k];
        let typed = match spec["type"].as_str() {
            Some("string") => v.is_string(),
            Some("integer") => v.is_i64() || v.is_u64(),
            _ => false,
        };
        let allowed = spec["enum"].as_array().is_none_or(|e| e.contains(v));
        typed && allowed
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(kind: Kind) -> Spec {
        Spec {
            kind,
            sessions: 4,
            turns: 4,
            input_len: 50,
            output_len: 8,
            seed: 7,
        }
    }

    #[test]
    fn the_same_seed_and_salt_give_the_same_sessions_and_a_new_salt_new_prompts() {
        for kind in [Kind::Random, Kind::Sessions, Kind::Long] {
            let s = spec(kind);
            assert_eq!(s.sessions(1), s.sessions(1));
            assert_ne!(s.sessions(1), s.sessions(2));
            assert_eq!(s.sessions(1).len(), 4);
        }
        let a = spec(Kind::Sessions).sessions(1);
        let b = spec(Kind::Sessions).sessions(2);
        assert_eq!(a[0].system, b[0].system, "levels share the system prompt");
        assert!(a.iter().all(|s| s.turns.len() == 4 && s.tools));
        assert!(
            a.iter()
                .all(|s| s.turns[0].tool.is_some() && s.turns[1].tool.is_none())
        );
    }

    #[test]
    fn random_prompts_have_the_set_number_of_words() {
        let s = spec(Kind::Random).sessions(3);
        assert!(
            s.iter()
                .all(|x| x.turns[0].text.split(' ').count() == 50 && x.ignore_eos)
        );
    }

    #[test]
    fn calls_are_checked_against_the_tools_schema() {
        assert!(valid_call("get_weather", r#"{"city": "Oslo"}"#));
        assert!(valid_call(
            "get_weather",
            r#"{"city": "Oslo", "unit": "celsius"}"#
        ));
        assert!(!valid_call(
            "get_weather",
            r#"{"city": "Oslo", "unit": "kelvin"}"#
        ));
        assert!(!valid_call("get_weather", r#"{"town": "Oslo"}"#));
        assert!(!valid_call("get_weather", r#"{"city": 3}"#));
        assert!(!valid_call("get_weather", "not json"));
        assert!(valid_call("search_docs", r#"{"query": "x", "limit": 3}"#));
        assert!(!valid_call(
            "search_docs",
            r#"{"query": "x", "limit": 3.5}"#
        ));
        assert!(!valid_call("delete_all", "{}"));
    }
}
