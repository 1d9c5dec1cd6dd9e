//! SGLang's constraints as the Lark grammars pdmesh's engine takes: a JSON schema the way
//! pdmesh's gateway turns one into a grammar, a regex as a regex literal; the forms pdmesh
//! has no grammar for are INVALID_ARGUMENT naming the field.

use pdmesh_proto::sglang::grpc::scheduler as s;

use super::{Invalid, invalid};

/// A Lark grammar for a JSON schema, as pdmesh's gateway builds one: strict (an object
/// schema silent on `additionalProperties` takes only the properties it names, SGLang's
/// default too) and compact.
fn json_schema_grammar(schema: &str) -> Result<String, Invalid> {
    let v: serde_json::Value = serde_json::from_str(schema)
        .map_err(|e| invalid("sampling_params.json_schema", format!("not JSON: {e}")))?;
    // The rewrite has a step budget, so this stays short on the async runtime.
    let rule = pdmesh_chat::schema::json_rule(&v)
        .map_err(|e| invalid("sampling_params.json_schema", e))?;
    Ok(format!("start: {rule}\n"))
}

/// The grammar for an SGLang constraint (empty: none).
pub(super) fn constraint_grammar(
    constraint: Option<s::sampling_params::Constraint>,
) -> Result<String, Invalid> {
    Ok(match constraint {
        None => String::new(),
        Some(s::sampling_params::Constraint::JsonSchema(js)) => json_schema_grammar(&js)?,
        Some(s::sampling_params::Constraint::Regex(rx)) => {
            // A Lark regex literal: `/` inside it is escaped.
            format!("start: /{}/\n", rx.replace('/', "\\/"))
        }
        Some(s::sampling_params::Constraint::EbnfGrammar(_)) => {
            return Err(invalid(
                "sampling_params.ebnf_grammar",
                "is not supported; use json_schema or regex",
            ));
        }
        Some(s::sampling_params::Constraint::StructuralTag(_)) => {
            return Err(invalid(
                "sampling_params.structural_tag",
                "is not supported; use json_schema or regex",
            ));
        }
    })
}
