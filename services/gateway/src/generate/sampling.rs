//! The sampling fields every generating endpoint reads from its body (OpenAI's and vLLM's),
//! checked into the worker's parameters, with the limits their schemas state.

use serde::Deserialize;
use utoipa::ToSchema;
use utoipa::openapi::schema::{
    ArrayBuilder, Object, ObjectBuilder, OneOfBuilder, Schema, SchemaType, Type,
};

use super::schema::{nullable, short_string};
use crate::clients::GenParams;
use crate::error::ApiError;
use crate::json::whole;

/// Most stop strings per request (OpenAI's limit).
pub(crate) const MAX_STOP: usize = 4;

/// Longest stop string, in bytes (the worker's engine refuses longer ones too: each is
/// matched after every generated token).
pub(crate) const MAX_STOP_BYTES: usize = 256;

/// Longest `cache_salt`, in bytes (the worker's engine refuses longer ones too).
pub(crate) const MAX_CACHE_SALT_BYTES: usize = 256;

/// Most alternatives per token: chat's `top_logprobs` and completions' `logprobs`
/// (OpenAI's limits).
pub(crate) const MAX_TOP_LOGPROBS: i64 = 20;
/// Most choices (`n`) one request may ask for: each holds a batch slot and its own pages
/// after the shared prompt.
pub(crate) const MAX_CHOICES: u32 = 16;
pub(crate) const MAX_COMPLETION_LOGPROBS: i64 = 5;

/// `stop`: a string or a list of strings (its schema, with the limits on both, is
/// written out in `openapi`).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum Stop {
    One(String),
    Many(Vec<String>),
}

/// The sampling fields both endpoints share (parsed from the same body as the request).
/// The limits in the `schema` attributes are the ones [`SamplingFields::to_params`]
/// checks (a test in `openapi` holds them together).
#[derive(Debug, Default, Deserialize, ToSchema)]
pub(crate) struct SamplingFields {
    /// Sampling temperature; 0 picks the most likely token.
    #[schema(minimum = 0, maximum = 2)]
    pub temperature: Option<f64>,
    /// Nucleus sampling: the smallest set of tokens whose probabilities reach this.
    #[schema(exclusive_minimum = 0, maximum = 1)]
    pub top_p: Option<f64>,
    /// Sample from this many most likely tokens; -1 or 0 turns it off.
    #[schema(minimum = -1, maximum = 2147483647)]
    #[serde(default, deserialize_with = "whole::opt")]
    pub top_k: Option<i64>,
    /// Drop tokens less likely than this fraction of the most likely one's probability.
    #[schema(minimum = 0, maximum = 1)]
    pub min_p: Option<f64>,
    #[schema(minimum = -2, maximum = 2)]
    pub frequency_penalty: Option<f64>,
    #[schema(minimum = -2, maximum = 2)]
    pub presence_penalty: Option<f64>,
    #[schema(exclusive_minimum = 0, maximum = 10)]
    pub repetition_penalty: Option<f64>,
    /// Seed for sampling: the same request with the same seed gives the same answer.
    #[serde(default, deserialize_with = "whole::opt")]
    pub seed: Option<i64>,
    /// Most tokens to generate. The prompt and these must fit in the model's context
    /// (a 400 naming the field otherwise). Unset: up to the context's end.
    #[schema(minimum = 1)]
    #[serde(default, deserialize_with = "whole::opt")]
    pub max_tokens: Option<i64>,
    /// OpenAI's newer name for `max_tokens`; wins over it when both are given.
    #[schema(minimum = 1)]
    #[serde(default, deserialize_with = "whole::opt")]
    pub max_completion_tokens: Option<i64>,
    #[schema(schema_with = crate::generate::sampling::stop)]
    pub stop: Option<Stop>,
    /// How many choices to generate for the one prompt.
    #[schema(minimum = 1, maximum = 16)]
    #[serde(default, deserialize_with = "whole::opt")]
    pub n: Option<i64>,
    /// Token ids that end the generation, as the end-of-sequence token does.
    #[serde(default, deserialize_with = "whole::opt_list")]
    pub stop_token_ids: Option<Vec<u32>>,
    /// Generate past the end-of-sequence token (up to `max_tokens`).
    pub ignore_eos: Option<bool>,
    /// Token id (as a string, JSON's object keys) → bias in [-100, 100].
    #[schema(schema_with = crate::generate::sampling::logit_bias)]
    pub logit_bias: Option<std::collections::BTreeMap<String, f64>>,
    /// Generate at least this many tokens before the end-of-sequence token may end the
    /// answer; at most `max_tokens`.
    #[schema(minimum = 0)]
    #[serde(default, deserialize_with = "whole::opt")]
    pub min_tokens: Option<i64>,
    /// vLLM's prefix-cache salt: requests with different salts never share cached KV.
    #[schema(schema_with = crate::generate::sampling::cache_salt)]
    pub cache_salt: Option<String>,
}

fn in_range(
    param: &str,
    v: Option<f64>,
    ok: impl Fn(f64) -> bool,
    range: &str,
) -> Result<Option<f32>, ApiError> {
    match v {
        None => Ok(None),
        // A positive value too small for an f32 (`top_p: 1e-50`) stays positive: as 0 it
        // would leave an open range such as top_p's (0, 1], and the worker refuse it.
        Some(x) if x.is_finite() && ok(x) && x > 0.0 => Ok(Some((x as f32).max(f32::MIN_POSITIVE))),
        Some(x) if x.is_finite() && ok(x) => Ok(Some(x as f32)),
        Some(x) => Err(ApiError::invalid_param(
            param,
            format!("{param} must be {range}, got {x}"),
        )),
    }
}

impl SamplingFields {
    /// The field the length limit was given in: `max_completion_tokens` wins over
    /// `max_tokens`.
    pub fn max_param(&self) -> &'static str {
        if self.max_completion_tokens.is_some() {
            "max_completion_tokens"
        } else {
            "max_tokens"
        }
    }

    /// Range-checks every field (OpenAI's ranges) and builds the worker's parameters.
    pub fn to_params(&self) -> Result<GenParams, ApiError> {
        let n = match self.n {
            None => 1,
            Some(n) if (1..=MAX_CHOICES as i64).contains(&n) => n as u32,
            Some(n) => {
                return Err(ApiError::invalid_param(
                    "n",
                    format!("n must be between 1 and {MAX_CHOICES}, got {n}"),
                ));
            }
        };
        let temperature = in_range(
            "temperature",
            self.temperature,
            |x| (0.0..=2.0).contains(&x),
            "between 0 and 2",
        )?;
        let top_p = in_range("top_p", self.top_p, |x| x > 0.0 && x <= 1.0, "in (0, 1]")?;
        let min_p = in_range(
            "min_p",
            self.min_p,
            |x| (0.0..=1.0).contains(&x),
            "between 0 and 1",
        )?;
        let frequency_penalty = in_range(
            "frequency_penalty",
            self.frequency_penalty,
            |x| (-2.0..=2.0).contains(&x),
            "between -2 and 2",
        )?;
        let presence_penalty = in_range(
            "presence_penalty",
            self.presence_penalty,
            |x| (-2.0..=2.0).contains(&x),
            "between -2 and 2",
        )?;
        let repetition_penalty = in_range(
            "repetition_penalty",
            self.repetition_penalty,
            |x| x > 0.0 && x <= 10.0,
            "in (0, 10]",
        )?;
        let top_k = match self.top_k {
            None => None,
            Some(k) if (-1..=i64::from(i32::MAX)).contains(&k) => Some(k as i32),
            Some(k) => {
                return Err(ApiError::invalid_param(
                    "top_k",
                    format!("top_k must be -1 (disabled) or >= 0, got {k}"),
                ));
            }
        };
        let max_param = self.max_param();
        let max = self.max_completion_tokens.or(self.max_tokens);
        let max_tokens = match max {
            None => None,
            Some(m) if m >= 1 => Some(u32::try_from(m).unwrap_or(u32::MAX)),
            Some(m) => {
                return Err(ApiError::invalid_param(
                    max_param,
                    format!("{max_param} must be at least 1, got {m}"),
                ));
            }
        };
        let stop = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stop.len() > MAX_STOP {
            return Err(ApiError::invalid_param(
                "stop",
                format!(
                    "at most {MAX_STOP} stop strings are allowed, got {}",
                    stop.len()
                ),
            ));
        }
        if stop.iter().any(String::is_empty) {
            return Err(ApiError::invalid_param(
                "stop",
                "stop strings must not be empty",
            ));
        }
        if let Some(long) = stop.iter().find(|s| s.len() > MAX_STOP_BYTES) {
            return Err(ApiError::invalid_param(
                "stop",
                format!(
                    "a stop string is at most {MAX_STOP_BYTES} bytes, got one of {}",
                    long.len()
                ),
            ));
        }
        let mut logit_bias = Vec::new();
        for (k, &v) in self.logit_bias.iter().flatten() {
            let Ok(t) = k.parse::<u32>() else {
                return Err(ApiError::invalid_param(
                    "logit_bias",
                    format!("logit_bias keys must be token ids, got {k:?}"),
                ));
            };
            if !(-100.0..=100.0).contains(&v) {
                return Err(ApiError::invalid_param(
                    "logit_bias",
                    format!(
                        "logit_bias values must be between -100 and 100, got {v} for token {t}"
                    ),
                ));
            }
            logit_bias.push((t, v as f32));
        }
        let min_tokens = match self.min_tokens {
            None => 0,
            Some(m) if m < 0 => {
                return Err(ApiError::invalid_param(
                    "min_tokens",
                    format!("min_tokens must be at least 0, got {m}"),
                ));
            }
            Some(m) => match max_tokens {
                Some(max) if m > i64::from(max) => {
                    return Err(ApiError::invalid_param(
                        "min_tokens",
                        format!("min_tokens ({m}) must not exceed {max_param} ({max})"),
                    ));
                }
                _ => u32::try_from(m).unwrap_or(u32::MAX),
            },
        };
        match self.cache_salt.as_deref() {
            Some("") => {
                return Err(ApiError::invalid_param(
                    "cache_salt",
                    "cache_salt must be a non-empty string when given",
                ));
            }
            Some(salt) if salt.len() > MAX_CACHE_SALT_BYTES => {
                return Err(ApiError::invalid_param(
                    "cache_salt",
                    format!(
                        "cache_salt is at most {MAX_CACHE_SALT_BYTES} bytes, got {}",
                        salt.len()
                    ),
                ));
            }
            _ => {}
        }
        Ok(GenParams {
            temperature: temperature.unwrap_or(1.0),
            top_p,
            top_k,
            min_p,
            frequency_penalty: frequency_penalty.unwrap_or(0.0),
            presence_penalty: presence_penalty.unwrap_or(0.0),
            repetition_penalty,
            seed: self.seed.map(|s| s as u64),
            max_tokens,
            stop,
            stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            grammar: None,
            logprobs: None,
            logit_bias,
            min_tokens,
            n,
            request: None,
            prompt_group: None,
            prompt_logprobs: None,
            cache_salt: self.cache_salt.clone(),
        })
    }
}

pub(crate) fn stop_string() -> Object {
    short_string(MAX_STOP_BYTES, "A stop string:")
}

/// `SamplingFields.stop`: a string or a list of them.
pub(crate) fn stop() -> Schema {
    let list = ArrayBuilder::new()
        .items(stop_string())
        .max_items(Some(MAX_STOP));
    let schema = OneOfBuilder::new()
        .item(stop_string())
        .item(list)
        .description(Some(format!(
            "Strings that end the answer where the model writes one: one, or a list of at most {}.",
            MAX_STOP
        )));
    nullable(schema)
}

/// `SamplingFields.logit_bias`.
pub(crate) fn logit_bias() -> Object {
    ObjectBuilder::new()
        .schema_type(SchemaType::from_iter([Type::Object, Type::Null]))
        .property_names(Some(
            ObjectBuilder::new()
                .schema_type(Type::String)
                .pattern(Some("^(0|[1-9][0-9]{0,8})$")),
        ))
        .additional_properties(Some(
            ObjectBuilder::new()
                .schema_type(Type::Number)
                .minimum(Some(-100))
                .maximum(Some(100)),
        ))
        .description(Some(
            "Token id (a string, as JSON's keys are) → a bias in [-100, 100] added to its \
             logit. The ids must be in the model's vocabulary.",
        ))
        .build()
}

/// `SamplingFields.cache_salt`.
pub(crate) fn cache_salt() -> Schema {
    nullable(short_string(
        MAX_CACHE_SALT_BYTES,
        "vLLM's prefix-cache salt: requests with different salts never share cached KV.",
    ))
}
