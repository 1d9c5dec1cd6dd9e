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

use std::collections::HashSet;

use serde_json::{Map, Value};

/// `schema` with every object schema that names properties closed to others, through
/// properties, items, `$defs`, `anyOf`/`oneOf`/`allOf` and `$ref`s.
///
/// Parts that are combined in place (the branches of an `allOf`, or a `$ref`, `anyOf` or
/// `oneOf` next to the schema's own properties) each see only part of the object, so they
/// stay open and the combining schema is closed instead, to the union of their names.
pub fn strict(schema: &Value) -> Value {
    // Local `$ref` targets used as parts, as JSON pointers. A part's own `$ref`s are parts
    // too, so the set grows until it is stable.
    let mut parts = HashSet::new();
    loop {
        let before = parts.len();
        find_parts(schema, String::new(), false, &mut parts);
        if parts.len() == before {
            break;
        }
    }
    let mut out = schema.clone();
    close(&mut out, schema, String::new(), false, &parts);
    out
}

/// The llguidance Lark rule `%json{…}` for `schema`: [`strict`], with compact, fixed
/// whitespace unless the schema sets its own `x-guidance` options.
pub fn json_rule(schema: &Value) -> String {
    let mut s = strict(schema);
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
    format!("%json{s}")
}

/// The most `$ref`s followed while collecting a combination's property names (cycles).
const MAX_REF_DEPTH: usize = 32;

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

fn find_parts(node: &Value, path: String, is_part: bool, parts: &mut HashSet<String>) {
    let Some(m) = node.as_object() else { return };
    let is_part = is_part || parts.contains(&path);
    if combined(m, is_part)
        && let Some(r) = local_ref(m)
    {
        parts.insert(r.to_owned());
    }
    for (sub, sub_is_part) in subschemas(m, is_part) {
        if let Some(child) = node.pointer(&sub) {
            find_parts(child, format!("{path}{sub}"), sub_is_part, parts);
        }
    }
}

fn close(node: &mut Value, root: &Value, path: String, is_part: bool, parts: &HashSet<String>) {
    let is_part = match node.as_object() {
        Some(_) => is_part || parts.contains(&path),
        None => return,
    };
    let subs = node.as_object().map(|m| subschemas(m, is_part));
    for (sub, sub_is_part) in subs.into_iter().flatten() {
        if let Some(child) = node.pointer_mut(&sub) {
            close(child, root, format!("{path}{sub}"), sub_is_part, parts);
        }
    }
    let Some(m) = node.as_object_mut() else {
        return;
    };
    if is_part || m.contains_key("additionalProperties") || m.contains_key("unevaluatedProperties")
    {
        return;
    }
    if !combined(m, false) {
        if m.get("properties").is_some_and(Value::is_object)
            || m.get("patternProperties").is_some_and(Value::is_object)
        {
            m.insert("additionalProperties".into(), Value::Bool(false));
        }
        return;
    }
    // A combination: every name its parts declare is allowed here (`true`: the parts
    // constrain the value), and nothing else.
    let Some(names) = part_names(root, m, 0) else {
        return;
    };
    if names.is_empty() && !m.contains_key("patternProperties") {
        return;
    }
    let props = m
        .entry("properties")
        .or_insert_with(|| Value::Object(Map::new()));
    let Value::Object(props) = props else { return };
    for n in names {
        props.entry(n).or_insert(Value::Bool(true));
    }
    m.insert("additionalProperties".into(), Value::Bool(false));
}

/// The property names `m` and its in-place parts declare, in order; `None` when a part
/// allows other properties in a way a closed combination would change (its own
/// `additionalProperties`, `patternProperties`, a `$ref` that is not local).
fn part_names(root: &Value, m: &Map<String, Value>, depth: usize) -> Option<Vec<String>> {
    let mut names: Vec<String> = m
        .get("properties")
        .and_then(Value::as_object)
        .map(|p| p.keys().cloned().collect())
        .unwrap_or_default();
    let mut add = |more: Vec<String>| {
        for n in more {
            if !names.contains(&n) {
                names.push(n);
            }
        }
    };
    let part = |v: &Value, depth: usize| -> Option<Vec<String>> {
        match v {
            Value::Object(p) => {
                let opens = |k: &str| p.get(k).is_some_and(|v| v != &Value::Bool(false));
                if opens("additionalProperties")
                    || opens("unevaluatedProperties")
                    || p.contains_key("patternProperties")
                {
                    return None;
                }
                part_names(root, p, depth)
            }
            _ => Some(Vec::new()),
        }
    };
    for key in ["allOf", "anyOf", "oneOf"] {
        for branch in m.get(key).and_then(Value::as_array).into_iter().flatten() {
            add(part(branch, depth)?);
        }
    }
    if m.contains_key("$ref") {
        if depth >= MAX_REF_DEPTH {
            return None;
        }
        let target = root.pointer(local_ref(m)?)?;
        add(part(target, depth + 1)?);
    }
    Some(names)
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
        let s = strict(&city());
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
        let rule = |schema: &Value| format!("start: {}", json_rule(schema));
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
        let s = strict(&json!({
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
        assert_eq!(strict(&open), open);
        assert!(accepts(&strict(&open), r#"{"a":1,"b":"x"}"#));

        let typed = json!({
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "additionalProperties": {"type": "integer"},
        });
        assert_eq!(strict(&typed), typed);
        assert!(accepts(&strict(&typed), r#"{"a":1,"b":2}"#));
        assert!(!accepts(&strict(&typed), r#"{"a":1,"b":"x"}"#));

        // Inside a schema the user gave for other properties, objects are closed as usual.
        let s = strict(&json!({
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
        assert_eq!(strict(&unevaluated), unevaluated);
    }

    #[test]
    fn a_combination_is_closed_to_the_union_of_its_parts() {
        // Closing each branch of an allOf would make them forbid one another's keys.
        let s = strict(&json!({
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
        let s = strict(&json!({
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
        assert_eq!(strict(&open), open);
    }

    #[test]
    fn recursive_and_odd_schemas_are_left_valid() {
        let tree = json!({
            "type": "object",
            "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
        });
        let s = strict(&tree);
        assert_eq!(s["additionalProperties"], json!(false));
        assert!(accepts(&s, r#"{"v":1,"kids":[{"v":2}]}"#));
        assert!(!accepts(&s, r#"{"v":1,"kids":[{"w":2}]}"#));

        let cycle = json!({"allOf": [{"$ref": "#"}], "properties": {"a": {}}});
        let _ = strict(&cycle);
        for v in [
            json!(true),
            json!({}),
            json!({"type": "string"}),
            json!({"enum": [1, 2]}),
        ] {
            assert_eq!(strict(&v), v);
        }
    }
}
