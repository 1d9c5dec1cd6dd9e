//! JSON schemas as constrained-decoding grammars, strict and compact.
//!
//! Strict: an object schema that names its properties and says nothing of others takes
//! only those, as OpenAI's strict mode and vLLM's and SGLang's default grammars do.
//! Without this a small model given a schema may invent keys
//! (`"population_thousands_per_year…"`) until the length limit. The rewrite adds
//! `additionalProperties: false` where a schema is silent; a schema that says
//! `additionalProperties` or `unevaluatedProperties` itself keeps what it says, and an
//! object with no named properties (`{"type": "object"}`) stays free-form.
//!
//! Compact: `,` and `:` with no whitespace between tokens (a small model given free
//! whitespace may write spaces forever).
//!
//! The gateway builds its `json_schema` and forced-call grammars with [`json_rule`], and
//! a worker the grammar of an SGLang `json_schema` constraint.

use std::collections::{HashMap, HashSet};

use serde_json::{Map, Value};

/// The most schema nodes the rewrite visits for one schema, `$ref`s followed and every
/// name it merges counted. A schema a person writes visits a few hundred; one built to
/// grow exponentially through nested `allOf`s of `$ref`s is refused here instead of
/// holding a CPU for minutes.
pub const MAX_SCHEMA_WORK: usize = 200_000;

/// A schema the rewrite refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SchemaError {
    #[error(
        "schema too complex: preparing it takes more than {limit} steps (nested `$ref`s, `allOf`s and properties count)"
    )]
    TooComplex { limit: usize },
}

/// `schema` with every object schema that names properties closed to others, through
/// properties, items, `$defs`, `anyOf`/`oneOf`/`allOf` and `$ref`s.
///
/// Parts that are combined in place (the branches of an `allOf`, or a `$ref`, `anyOf` or
/// `oneOf` next to the schema's own properties) each see only part of the object, so they
/// stay open and the combining schema is closed instead, to the union of their names.
///
/// Every `$ref` target is looked at once (memoized by JSON pointer), and the whole walk
/// has a budget of [`MAX_SCHEMA_WORK`] steps.
pub fn strict(schema: &Value) -> Result<Value, SchemaError> {
    strict_within(schema, MAX_SCHEMA_WORK)
}

/// [`strict`] with a budget of `limit` steps.
pub fn strict_within(schema: &Value, limit: usize) -> Result<Value, SchemaError> {
    let mut walk = Walk {
        root: schema,
        parts: HashSet::new(),
        names: HashMap::new(),
        left: limit,
        limit,
    };
    // Local `$ref` targets used as parts, as JSON pointers. Everything inside a part is a
    // part too, so each new part's subtree is walked again as one.
    let mut found = Vec::new();
    walk.find_parts(schema, String::new(), false, &mut found)?;
    while let Some(r) = found.pop() {
        if let Some(target) = schema.pointer(&r) {
            walk.find_parts(target, r, true, &mut found)?;
        }
    }
    let mut out = schema.clone();
    walk.close(&mut out, String::new(), false)?;
    Ok(out)
}

/// The llguidance Lark rule `%json{…}` for `schema`: [`strict`], with compact, fixed
/// whitespace unless the schema sets its own `x-guidance` options.
pub fn json_rule(schema: &Value) -> Result<String, SchemaError> {
    let mut s = strict(schema)?;
    if let Value::Object(m) = &mut s
        && !m.contains_key("x-guidance")
    {
        m.insert(
            "x-guidance".into(),
            Value::Object(Map::from_iter([(
                "whitespace_flexible".to_owned(),
                Value::Bool(false),
            )])),
        );
    }
    Ok(format!("%json{s}"))
}

/// A JSON-pointer path segment.
fn escape(key: &str) -> String {
    key.replace('~', "~0").replace('/', "~1")
}

/// The local JSON pointer a `$ref` names (`#/$defs/x` → `/$defs/x`), if it is local.
fn local_ref(m: &Map<String, Value>) -> Option<&str> {
    m.get("$ref")?.as_str()?.strip_prefix('#')
}

/// Whether the in-place parts of `m` (`allOf` branches, `anyOf`/`oneOf` branches, `$ref`)
/// are combined with one another or with `m`'s own properties, rather than each being the
/// whole schema of the object. Everything inside a part is a part too.
fn combined(m: &Map<String, Value>, is_part: bool) -> bool {
    let own = usize::from(m.contains_key("properties") || m.contains_key("patternProperties"));
    let all_of = m.get("allOf").and_then(Value::as_array).map_or(0, Vec::len);
    let others = ["anyOf", "oneOf", "$ref"]
        .iter()
        .filter(|k| m.contains_key(**k))
        .count();
    is_part || own + all_of + others >= 2
}

/// The subschemas of `m`, as JSON pointers relative to it, each with whether it is a part
/// of a combination.
fn subschemas(m: &Map<String, Value>, is_part: bool) -> Vec<(String, bool)> {
    let parts = combined(m, is_part);
    let mut out = Vec::new();
    for (k, v) in m {
        let key = escape(k);
        match (k.as_str(), v) {
            ("properties" | "patternProperties" | "$defs" | "definitions", Value::Object(o)) => {
                out.extend(o.keys().map(|n| (format!("/{key}/{}", escape(n)), false)));
            }
            ("additionalProperties" | "additionalItems" | "items", Value::Object(_)) => {
                out.push((format!("/{key}"), false));
            }
            ("items" | "prefixItems", Value::Array(a)) => {
                out.extend((0..a.len()).map(|i| (format!("/{key}/{i}"), false)));
            }
            ("allOf" | "anyOf" | "oneOf", Value::Array(a)) => {
                out.extend((0..a.len()).map(|i| (format!("/{key}/{i}"), parts)));
            }
            _ => {}
        }
    }
    out
}

/// One rewrite: the schema, what is known of it so far, and the steps left.
struct Walk<'a> {
    root: &'a Value,
    /// Pointers of `$ref` targets used as parts of a combination.
    parts: HashSet<String>,
    /// The property names a `$ref` target declares as a part ([`Walk::part_names`]), by
    /// pointer; `None` inside: being computed (a cycle) or open.
    names: HashMap<String, Option<Vec<String>>>,
    left: usize,
    limit: usize,
}

impl Walk<'_> {
    fn spend(&mut self, n: usize) -> Result<(), SchemaError> {
        self.left = self
            .left
            .checked_sub(n)
            .ok_or(SchemaError::TooComplex { limit: self.limit })?;
        Ok(())
    }

    /// Collects the `$ref` targets used as parts under `node`; new ones go to `found`.
    fn find_parts(
        &mut self,
        node: &Value,
        path: String,
        is_part: bool,
        found: &mut Vec<String>,
    ) -> Result<(), SchemaError> {
        self.spend(1)?;
        let Some(m) = node.as_object() else {
            return Ok(());
        };
        let is_part = is_part || self.parts.contains(&path);
        if combined(m, is_part)
            && let Some(r) = local_ref(m)
            && self.parts.insert(r.to_owned())
        {
            found.push(r.to_owned());
        }
        for (sub, sub_is_part) in subschemas(m, is_part) {
            if let Some(child) = node.pointer(&sub) {
                self.find_parts(child, format!("{path}{sub}"), sub_is_part, found)?;
            }
        }
        Ok(())
    }

    fn close(&mut self, node: &mut Value, path: String, is_part: bool) -> Result<(), SchemaError> {
        self.spend(1)?;
        let is_part = match node.as_object() {
            Some(_) => is_part || self.parts.contains(&path),
            None => return Ok(()),
        };
        let subs = node.as_object().map(|m| subschemas(m, is_part));
        for (sub, sub_is_part) in subs.into_iter().flatten() {
            if let Some(child) = node.pointer_mut(&sub) {
                self.close(child, format!("{path}{sub}"), sub_is_part)?;
            }
        }
        let Some(m) = node.as_object_mut() else {
            return Ok(());
        };
        if is_part
            || m.contains_key("additionalProperties")
            || m.contains_key("unevaluatedProperties")
        {
            return Ok(());
        }
        if !combined(m, false) {
            if m.get("properties").is_some_and(Value::is_object)
                || m.get("patternProperties").is_some_and(Value::is_object)
            {
                m.insert("additionalProperties".into(), Value::Bool(false));
            }
            return Ok(());
        }
        // A combination: every name its parts declare is allowed here (`true`: the parts
        // constrain the value), and nothing else.
        let Some(names) = self.part_names(m)? else {
            return Ok(());
        };
        if names.is_empty() && !m.contains_key("patternProperties") {
            return Ok(());
        }
        self.spend(names.len())?;
        let props = m
            .entry("properties")
            .or_insert_with(|| Value::Object(Map::new()));
        let Value::Object(props) = props else {
            return Ok(());
        };
        for n in names {
            props.entry(n).or_insert(Value::Bool(true));
        }
        m.insert("additionalProperties".into(), Value::Bool(false));
        Ok(())
    }

    /// The property names `m` and its in-place parts declare, in order; `None` when a part
    /// allows other properties in a way a closed combination would change (its own
    /// `additionalProperties`, `patternProperties`, a `$ref` that is not local or that
    /// comes back to itself).
    fn part_names(&mut self, m: &Map<String, Value>) -> Result<Option<Vec<String>>, SchemaError> {
        self.spend(1)?;
        let mut names: Vec<String> = m
            .get("properties")
            .and_then(Value::as_object)
            .map(|p| p.keys().cloned().collect())
            .unwrap_or_default();
        let mut seen: HashSet<String> = names.iter().cloned().collect();
        let mut parts: Vec<&Value> = Vec::new();
        for key in ["allOf", "anyOf", "oneOf"] {
            parts.extend(m.get(key).and_then(Value::as_array).into_iter().flatten());
        }
        for branch in parts {
            let Some(more) = self.part(branch)? else {
                return Ok(None);
            };
            self.spend(more.len())?;
            names.extend(more.into_iter().filter(|n| seen.insert(n.clone())));
        }
        if m.contains_key("$ref") {
            let Some(r) = local_ref(m) else {
                return Ok(None);
            };
            let more = match self.names.get(r) {
                Some(known) => known.clone(),
                None => {
                    // Marked open while it is computed: a `$ref` cycle leaves it open.
                    self.names.insert(r.to_owned(), None);
                    let root = self.root;
                    let more = match root.pointer(r) {
                        Some(target) => self.part(target)?,
                        None => None,
                    };
                    self.names.insert(r.to_owned(), more.clone());
                    more
                }
            };
            let Some(more) = more else {
                return Ok(None);
            };
            self.spend(more.len())?;
            names.extend(more.into_iter().filter(|n| seen.insert(n.clone())));
        }
        Ok(Some(names))
    }

    /// The names one part declares ([`Walk::part_names`]).
    fn part(&mut self, v: &Value) -> Result<Option<Vec<String>>, SchemaError> {
        match v {
            Value::Object(p) => {
                let opens = |k: &str| p.get(k).is_some_and(|v| v != &Value::Bool(false));
                if opens("additionalProperties")
                    || opens("unevaluatedProperties")
                    || p.contains_key("patternProperties")
                {
                    return Ok(None);
                }
                self.part_names(p)
            }
            _ => Ok(Some(Vec::new())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Whether the Lark `grammar` accepts exactly `text`, over a byte vocabulary (256
    /// one-byte tokens and an end token).
    fn lark_accepts(grammar: &str, text: &str) -> bool {
        use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
        let words: Vec<Vec<u8>> = (0..=255u8)
            .map(|b| vec![b])
            .chain([vec![0xff, b'E']])
            .collect();
        let trie = TokTrie::from(&TokRxInfo::new(words.len() as u32, 256), &words);
        let env: TokEnv = std::sync::Arc::new(ApproximateTokEnv::new(trie));
        let factory = llguidance::ParserFactory::new_simple(&env).unwrap();
        let parser = factory
            .create_parser(llguidance::api::TopLevelGrammar::from_lark(grammar.into()))
            .unwrap_or_else(|e| panic!("{e}\n{grammar}"));
        let mut m = llguidance::Matcher::new(Ok(parser));
        for b in text.bytes() {
            // Stopped: the grammar is complete and allows nothing more.
            if m.is_stopped() || !m.compute_mask().unwrap().is_allowed(u32::from(b)) {
                return false;
            }
            m.consume_token(u32::from(b)).unwrap();
        }
        m.is_stopped() || m.is_accepting().unwrap()
    }

    /// Whether `schema`, exactly as given (compact whitespace), accepts `text`.
    fn accepts(schema: &Value, text: &str) -> bool {
        let mut s = schema.clone();
        s["x-guidance"] = json!({"whitespace_flexible": false});
        lark_accepts(&format!("start: %json{s}"), text)
    }

    fn closed(schema: &Value) -> Value {
        strict(schema).unwrap()
    }

    fn city() -> Value {
        json!({
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "country": {"type": "string"},
                "population_millions": {"type": "number"},
            },
            "required": ["name", "country", "population_millions"],
        })
    }

    #[test]
    fn a_silent_object_takes_only_its_properties() {
        let s = closed(&city());
        assert_eq!(s["additionalProperties"], json!(false));
        let answer = r#"{"name":"Cairo","country":"Egypt","population_millions":22.1"#;
        assert!(accepts(&s, &format!("{answer}}}")));
        assert!(!accepts(
            &s,
            &format!(r#"{answer},"population_thousands":1}}"#)
        ));
        assert!(
            accepts(&city(), &format!(r#"{answer},"population_thousands":1}}"#)),
            "the schema as written allows other keys"
        );
    }

    #[test]
    fn the_rule_is_strict_and_compact() {
        let rule = |schema: &Value| format!("start: {}", json_rule(schema).unwrap());
        let answer = r#"{"name":"Cairo","country":"Egypt","population_millions":22.1"#;
        let g = rule(&city());
        assert!(lark_accepts(&g, &format!("{answer}}}")), "{g}");
        assert!(!lark_accepts(
            &g,
            &format!(r#"{answer},"population_thousands":1}}"#)
        ));
        assert!(!lark_accepts(&g, &format!("{answer} }}")), "compact: {g}");
        assert!(!lark_accepts(
            &g,
            r#"{"name": "Cairo","country":"Egypt","population_millions":22.1}"#
        ));

        // Options the schema gives llguidance itself are its own.
        let mut own = city();
        own["x-guidance"] = json!({"whitespace_flexible": true});
        assert!(lark_accepts(&rule(&own), &format!("{answer} }}")));
    }

    #[test]
    fn nested_objects_arrays_and_definitions_are_closed() {
        let person = json!({"type": "object", "properties": {"name": {"type": "string"}}});
        let s = closed(&json!({
            "type": "object",
            "properties": {
                "passenger": {"$ref": "#/$defs/person"},
                "address": {"type": "object", "properties": {"city": {"type": "string"}}},
                "legs": {"type": "array", "items": {"type": "object", "properties": {"to": {"type": "string"}}}},
                "pair": {"type": "array", "prefixItems": [person.clone(), person.clone()]},
                "either": {"anyOf": [person.clone(), {"type": "null"}]},
                "tags": {"type": "object"},
            },
            "$defs": {"person": person.clone()},
            "definitions": {"old": person},
        }));
        for p in [
            "",
            "/properties/address",
            "/properties/legs/items",
            "/properties/pair/prefixItems/0",
            "/properties/pair/prefixItems/1",
            "/properties/either/anyOf/0",
            "/$defs/person",
            "/definitions/old",
        ] {
            assert_eq!(
                s.pointer(&format!("{p}/additionalProperties")),
                Some(&json!(false)),
                "{p}: {s}"
            );
        }
        assert_eq!(
            s["properties"]["tags"],
            json!({"type": "object"}),
            "a free-form object stays free"
        );
        assert_eq!(
            s["properties"]["passenger"],
            json!({"$ref": "#/$defs/person"})
        );
        assert!(!accepts(&s, r#"{"passenger":{"name":"Ann","age":3}}"#));
        assert!(!accepts(&s, r#"{"legs":[{"to":"Rome","from":"Paris"}]}"#));
        assert!(accepts(
            &s,
            r#"{"passenger":{"name":"Ann"},"legs":[{"to":"Rome"}],"tags":{"any":1}}"#
        ));
    }

    #[test]
    fn what_a_schema_says_about_other_properties_is_kept() {
        let open = json!({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": true});
        assert_eq!(closed(&open), open);
        assert!(accepts(&closed(&open), r#"{"a":1,"b":"x"}"#));

        let typed = json!({
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "additionalProperties": {"type": "integer"},
        });
        assert_eq!(closed(&typed), typed);
        assert!(accepts(&closed(&typed), r#"{"a":1,"b":2}"#));
        assert!(!accepts(&closed(&typed), r#"{"a":1,"b":"x"}"#));

        // Inside a schema the user gave for other properties, objects are closed as usual.
        let s = closed(&json!({
            "type": "object",
            "additionalProperties": {"type": "object", "properties": {"n": {"type": "integer"}}},
        }));
        assert_eq!(
            s["additionalProperties"]["additionalProperties"],
            json!(false)
        );
        assert!(accepts(&s, r#"{"x":{"n":1}}"#));
        assert!(!accepts(&s, r#"{"x":{"n":1,"m":2}}"#));

        let unevaluated = json!({"properties": {"a": {}}, "unevaluatedProperties": true});
        assert_eq!(closed(&unevaluated), unevaluated);
    }

    #[test]
    fn a_combination_is_closed_to_the_union_of_its_parts() {
        // Closing each branch of an allOf would make them forbid one another's keys.
        let s = closed(&json!({
            "allOf": [
                {"$ref": "#/$defs/base"},
                {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]},
            ],
            "$defs": {"base": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}},
        }));
        assert_eq!(s["additionalProperties"], json!(false), "{s}");
        assert!(s["$defs"]["base"].get("additionalProperties").is_none());
        assert!(s["allOf"][1].get("additionalProperties").is_none());
        assert!(accepts(&s, r#"{"a":1,"b":2}"#), "{s}");
        assert!(!accepts(&s, r#"{"a":1,"b":2,"c":3}"#), "{s}");

        // Own properties next to alternatives: each alternative adds its own names.
        let s = closed(&json!({
            "type": "object",
            "properties": {"kind": {"type": "string"}},
            "anyOf": [
                {"properties": {"x": {"type": "integer"}}, "required": ["x"]},
                {"properties": {"y": {"type": "integer"}}, "required": ["y"]},
            ],
        }));
        assert!(accepts(&s, r#"{"kind":"p","x":1}"#), "{s}");
        assert!(!accepts(&s, r#"{"kind":"p","x":1,"z":2}"#), "{s}");

        // A part that allows more keeps the combination open.
        let open = json!({
            "allOf": [
                {"properties": {"a": {}}, "additionalProperties": {"type": "string"}},
                {"properties": {"b": {}}},
            ],
        });
        assert_eq!(closed(&open), open);
    }

    #[test]
    fn recursive_and_odd_schemas_are_left_valid() {
        let tree = json!({
            "type": "object",
            "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
        });
        let s = closed(&tree);
        assert_eq!(s["additionalProperties"], json!(false));
        assert!(accepts(&s, r#"{"v":1,"kids":[{"v":2}]}"#));
        assert!(!accepts(&s, r#"{"v":1,"kids":[{"w":2}]}"#));

        let cycle = json!({"allOf": [{"$ref": "#"}], "properties": {"a": {}}});
        assert_eq!(
            closed(&cycle),
            cycle,
            "a combination whose part comes back to itself stays open"
        );
        for v in [
            json!(true),
            json!({}),
            json!({"type": "string"}),
            json!({"enum": [1, 2]}),
        ] {
            assert_eq!(closed(&v), v);
        }
    }

    /// `levels` nested `allOf`s of two `$ref`s to the next level: 2^levels paths to the
    /// leaf when each `$ref` is followed anew.
    fn doubling(levels: usize) -> Value {
        let mut defs = Map::new();
        for i in 0..levels {
            let next = format!("#/$defs/l{}", i + 1);
            defs.insert(
                format!("l{i}"),
                json!({"allOf": [{"$ref": next}, {"$ref": next}]}),
            );
        }
        defs.insert(
            format!("l{levels}"),
            json!({"type": "object", "properties": {"x": {"type": "integer"}}}),
        );
        json!({"$ref": "#/$defs/l0", "properties": {"y": {}}, "$defs": defs})
    }

    #[test]
    fn a_doubling_schema_costs_steps_in_proportion_to_its_size() {
        for levels in [23, 40] {
            let s = strict_within(&doubling(levels), 2_000).unwrap();
            assert_eq!(s["additionalProperties"], json!(false), "{s}");
            assert_eq!(s["properties"]["x"], json!(true), "{s}");
            // llguidance writes the `$ref`'s properties first.
            assert!(accepts(&s, r#"{"x":2,"y":1}"#));
            assert!(!accepts(&s, r#"{"x":2,"z":2}"#), "closed");
        }
    }

    #[test]
    fn a_schema_past_the_budget_is_too_complex() {
        let wide = json!({
            "type": "object",
            "properties": (0..500).map(|i| (format!("p{i}"), json!({"type": "object", "properties": {"a": {}}})))
                .collect::<Map<String, Value>>(),
        });
        assert_eq!(
            strict_within(&wide, 100),
            Err(SchemaError::TooComplex { limit: 100 })
        );
        assert!(strict_within(&wide, 5_000).is_ok());
        let msg = SchemaError::TooComplex { limit: 100 }.to_string();
        assert!(
            msg.starts_with("schema too complex") && msg.contains("100"),
            "{msg}"
        );
    }
}
