//! The JSON-schema preparation and schema-to-grammar step on arbitrary JSON: an error or a
//! rule, within its step budget; never a panic, a stack overflow or a hang (libFuzzer's
//! -timeout catches one).
#![no_main]

use libfuzzer_sys::fuzz_target;
use pdmesh_chat::schema;

fuzz_target!(|data: &[u8]| {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    // A small budget, so that exponential `$ref`/`allOf` nests show up as errors fast.
    let _ = schema::strict_within(&v, 5_000);
    if let Ok(rule) = schema::json_rule(&v) {
        assert!(rule.starts_with("%json"), "{rule}");
    }
});
