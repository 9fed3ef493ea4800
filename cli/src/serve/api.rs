//! The OpenAI request bodies and their validation: JSON in, a checked [`Params`] out, or an
//! [`ApiError`] naming the field.
//!
//! Each body is parsed twice from one JSON value: once into [`Common`] (sampling, limits,
//! streaming: the fields both endpoints share) and once into the endpoint's own part
//! ([`CompletionBody`], [`ChatBody`]). Unknown fields are ignored, as OpenAI does; fields this
//! server cannot honour (n > 1, penalties, logit_bias, echo, suffix, tools) are refused with a
//! 400 rather than silently dropped.

use engine::sampling::SamplerConfig;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;

use super::error::ApiError;

/// Most stop sequences a request may give (OpenAI's limit).
pub const MAX_STOP: usize = 4;
/// Most `logprobs` alternatives on `/v1/completions` (OpenAI's limit).
pub const MAX_COMPLETION_LOGPROBS: usize = 5;
/// Most `top_logprobs` on `/v1/chat/completions` (OpenAI's limit).
pub const MAX_CHAT_TOP_LOGPROBS: usize = 20;
/// `max_tokens` when a completion request gives none (OpenAI's default for completions).
pub const DEFAULT_COMPLETION_MAX_TOKENS: usize = 16;

/// Invalid JSON is a 400 naming the line and column; a well-formed value of the wrong shape is a
/// 400 naming the field (`messages[1].content`).
pub fn parse_json(bytes: &[u8]) -> Result<Value, ApiError> {
    serde_json::from_slice(bytes).map_err(|e| {
        let what = if e.is_eof() {
            "the body ends before the JSON value does (truncated?)"
        } else {
            "the body is not valid JSON"
        };
        ApiError::invalid(None, format!("{what}: {e}")).with_code("invalid_json")
    })
}

/// `T` from `value`, naming the offending field on a type error.
pub fn from_value<T: DeserializeOwned>(value: &Value) -> Result<T, ApiError> {
    if !value.is_object() {
        return Err(ApiError::invalid(
            None,
            format!(
                "expected a JSON object as the request body, found {}",
                kind_of(value)
            ),
        ));
    }
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let param = (path != ".").then_some(path);
        ApiError::invalid(
            param.as_deref(),
            match &param {
                Some(p) => format!("field `{p}`: {}", e.inner()),
                None => e.inner().to_string(),
            },
        )
        .with_code("invalid_type")
    })
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A string or a list of strings (`stop`).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// The fields both endpoints share.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Common {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    /// The chat endpoint's newer name for `max_tokens`.
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub n: Option<i64>,
    pub stop: Option<OneOrMany>,
    pub seed: Option<i64>,
    #[serde(default)]
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// An integer on `/v1/completions`, a boolean on `/v1/chat/completions`.
    pub logprobs: Option<Value>,
    pub top_logprobs: Option<i64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub best_of: Option<i64>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    pub logit_bias: Option<serde_json::Map<String, Value>>,
    pub tools: Option<Vec<Value>>,
    /// vLLM's and llama.cpp's extension: keep generating past end-of-generation tokens (for
    /// benchmarks that need a fixed output length).
    pub ignore_eos: Option<bool>,
    /// vLLM's extension: log-probability entries name tokens as `token_id:{id}` (exact ids for
    /// tools that compare token sequences, such as the verify serve case).
    pub return_tokens_as_token_ids: Option<bool>,
}

/// `prompt` of `/v1/completions`: text, one text in a list, or token ids. A value of another
/// shape is refused naming what a prompt may be and what was found (not serde's "did not match
/// any variant of untagged enum").
#[derive(Debug, Clone, Deserialize)]
#[serde(try_from = "serde_json::Value")]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdLists(Vec<Vec<u32>>),
}

impl TryFrom<serde_json::Value> for Prompt {
    type Error = String;

    fn try_from(v: serde_json::Value) -> Result<Prompt, String> {
        use serde_json::Value;
        let kind = kind_of;
        let expected = "expected a string, a list of strings, a list of token ids \
                        (integers 0 ..= 4294967295) or a list of such lists";
        let found = |what: String| format!("{expected}, found {what}");
        match v {
            Value::String(t) => Ok(Prompt::Text(t)),
            Value::Array(items) if items.is_empty() => Ok(Prompt::Texts(Vec::new())),
            Value::Array(items) => match &items[0] {
                Value::String(_) => items
                    .iter()
                    .map(|x| x.as_str().map(str::to_owned).ok_or(x))
                    .collect::<Result<_, _>>()
                    .map(Prompt::Texts)
                    .map_err(|x| found(format!("a list of strings holding {}", kind(x)))),
                Value::Number(_) => ids(&items)
                    .map(Prompt::Ids)
                    .map_err(|x| found(format!("a list of token ids holding {x}"))),
                Value::Array(_) => items
                    .iter()
                    .map(|x| match x {
                        Value::Array(inner) => {
                            ids(inner).map_err(|e| format!("a list holding {e}"))
                        }
                        other => Err(format!("a list of lists holding {}", kind(other))),
                    })
                    .collect::<Result<_, _>>()
                    .map(Prompt::IdLists)
                    .map_err(|what| found(format!("a list of token-id lists: {what}"))),
                other => Err(found(format!("a list of {}", kind(other)))),
            },
            other => Err(found(kind(&other).to_owned())),
        }
    }
}

/// Token ids, or what the first value that is not one is.
fn ids(items: &[serde_json::Value]) -> Result<Vec<u32>, String> {
    items
        .iter()
        .map(|x| {
            x.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| format!("{x} (not a token id)"))
        })
        .collect()
}

#[derive(Debug, Clone, Deserialize)]
pub struct CompletionBody {
    pub prompt: Prompt,
}

/// One chat message; `content` is text or a list of parts of which only text is supported.
#[derive(Debug, Clone, Deserialize)]
pub struct Message {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatBody {
    pub messages: Vec<Message>,
}

/// Which endpoint a request came to (the two differ in `logprobs` and defaults).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

impl Endpoint {
    pub fn name(self) -> &'static str {
        match self {
            Endpoint::Completions => "completions",
            Endpoint::Chat => "chat_completions",
        }
    }
}

/// A request's checked generation parameters (the prompt is tokenized separately).
#[derive(Debug, Clone)]
pub struct Params {
    /// `None`: as many as the context allows (chat without a limit).
    pub max_tokens: Option<usize>,
    pub sampler: SamplerConfig,
    pub stop: Vec<String>,
    /// Alternatives to report per token; `Some(0)` reports only the chosen token's log-prob.
    pub top_logprobs: Option<usize>,
    pub stream: bool,
    pub include_usage: bool,
    pub ignore_eos: bool,
    pub tokens_as_ids: bool,
}

impl Common {
    /// Check every shared field against what OpenAI allows and what this server implements.
    pub fn params(&self, endpoint: Endpoint, seed_if_none: u64) -> Result<Params, ApiError> {
        if let Some(n) = self.n {
            if n != 1 {
                return Err(ApiError::invalid(
                    Some("n"),
                    format!("n must be 1 (this server returns one choice per request), found {n}"),
                ));
            }
        }
        if let Some(b) = self.best_of {
            if b != 1 {
                return Err(ApiError::invalid(
                    Some("best_of"),
                    format!("best_of must be 1, found {b}"),
                ));
            }
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if let Some(v) = v {
                if v != 0.0 {
                    return Err(ApiError::invalid(
                        Some(name),
                        format!("{name} is not supported by this server; expected 0 or absent, found {v}"),
                    ));
                }
            }
        }
        if self.echo == Some(true) {
            return Err(ApiError::invalid(
                Some("echo"),
                "echo is not supported by this server",
            ));
        }
        if self.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::invalid(
                Some("suffix"),
                "suffix is not supported by this server",
            ));
        }
        if self.logit_bias.as_ref().is_some_and(|m| !m.is_empty()) {
            return Err(ApiError::invalid(
                Some("logit_bias"),
                "logit_bias is not supported by this server",
            ));
        }
        if self.tools.as_ref().is_some_and(|t| !t.is_empty()) {
            return Err(ApiError::invalid(
                Some("tools"),
                "tools are not supported by this server",
            ));
        }

        let (max_name, max) = match (endpoint, self.max_completion_tokens, self.max_tokens) {
            (Endpoint::Chat, Some(m), _) => ("max_completion_tokens", Some(m)),
            (_, _, m) => ("max_tokens", m),
        };
        let max_tokens = match max {
            Some(m) if m < 1 => {
                return Err(ApiError::invalid(
                    Some(max_name),
                    format!("{max_name} must be at least 1, found {m}"),
                ))
            }
            Some(m) => Some(usize::try_from(m).unwrap_or(usize::MAX)),
            None if endpoint == Endpoint::Completions => Some(DEFAULT_COMPLETION_MAX_TOKENS),
            None => None,
        };

        // OpenAI's defaults: temperature 1, top_p 1; no top-k, min-p or repetition penalty.
        let temperature = self.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::invalid(
                Some("temperature"),
                format!("temperature must be between 0 and 2, found {temperature}"),
            ));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::invalid(
                Some("top_p"),
                format!("top_p must be in (0, 1], found {top_p}"),
            ));
        }
        let seed = match self.seed {
            Some(s) => s as u64,
            None => seed_if_none,
        };
        let sampler = SamplerConfig {
            temperature,
            top_k: 0,
            top_p,
            min_p: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 0,
            seed,
        };

        let stop = match &self.stop {
            None => Vec::new(),
            Some(OneOrMany::One(s)) => vec![s.clone()],
            Some(OneOrMany::Many(v)) => v.clone(),
        };
        if stop.len() > MAX_STOP {
            return Err(ApiError::invalid(
                Some("stop"),
                format!(
                    "at most {MAX_STOP} stop sequences are allowed, found {}",
                    stop.len()
                ),
            ));
        }
        if stop.iter().any(String::is_empty) {
            return Err(ApiError::invalid(
                Some("stop"),
                "a stop sequence must not be empty",
            ));
        }

        let top_logprobs = match endpoint {
            Endpoint::Completions => match &self.logprobs {
                None | Some(Value::Null) => None,
                Some(v) => match v.as_i64() {
                    Some(k) if (0..=MAX_COMPLETION_LOGPROBS as i64).contains(&k) => {
                        Some(k as usize)
                    }
                    _ => {
                        return Err(ApiError::invalid(
                            Some("logprobs"),
                            format!("logprobs must be an integer from 0 to {MAX_COMPLETION_LOGPROBS} on /v1/completions, found {v}"),
                        ))
                    }
                },
            },
            Endpoint::Chat => {
                let on = match &self.logprobs {
                    None | Some(Value::Null) => false,
                    Some(Value::Bool(b)) => *b,
                    Some(v) => {
                        return Err(ApiError::invalid(
                            Some("logprobs"),
                            format!(
                                "logprobs must be a boolean on /v1/chat/completions, found {v}"
                            ),
                        ))
                    }
                };
                match self.top_logprobs {
                    Some(k) if !(0..=MAX_CHAT_TOP_LOGPROBS as i64).contains(&k) => {
                        return Err(ApiError::invalid(
                            Some("top_logprobs"),
                            format!("top_logprobs must be from 0 to {MAX_CHAT_TOP_LOGPROBS}, found {k}"),
                        ))
                    }
                    Some(_) if !on => {
                        return Err(ApiError::invalid(
                            Some("top_logprobs"),
                            "top_logprobs needs logprobs: true",
                        ))
                    }
                    Some(k) => Some(k as usize),
                    None => on.then_some(0),
                }
            }
        };

        let stream = self.stream.unwrap_or(false);
        let include_usage = self
            .stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage);
        Ok(Params {
            max_tokens,
            sampler,
            stop,
            top_logprobs,
            stream,
            include_usage,
            ignore_eos: self.ignore_eos.unwrap_or(false),
            tokens_as_ids: self.return_tokens_as_token_ids.unwrap_or(false),
        })
    }
}

impl Message {
    /// The message's text (parts joined); a non-text part is refused.
    pub fn text(&self, index: usize) -> Result<String, ApiError> {
        match &self.content {
            None => Ok(String::new()),
            Some(Content::Text(t)) => Ok(t.clone()),
            Some(Content::Parts(parts)) => {
                let mut out = String::new();
                for (j, p) in parts.iter().enumerate() {
                    match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => out.push_str(t),
                        ("text", None) => {
                            return Err(ApiError::invalid(
                                Some(&format!("messages[{index}].content[{j}].text")),
                                "a text part needs `text`",
                            ))
                        }
                        (other, _) => {
                            return Err(ApiError::invalid(
                                Some(&format!("messages[{index}].content[{j}].type")),
                                format!(
                                "only text content is supported, found a part of type `{other}`"
                            ),
                            ))
                        }
                    }
                }
                Ok(out)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn check_err(body: Value, endpoint: Endpoint, param: Option<&str>, needle: &str) {
        let common: Result<Common, _> = from_value(&body);
        let err = match common.and_then(|c| c.params(endpoint, 0)) {
            Ok(p) => panic!("{body} was accepted: {p:?}"),
            Err(e) => e,
        };
        assert_eq!(err.status.as_u16(), 400, "{body}: {err:?}");
        assert_eq!(err.param.as_deref(), param, "{body}: {err:?}");
        assert!(err.message.contains(needle), "{body}: {}", err.message);
    }

    #[test]
    fn a_prompt_of_the_wrong_shape_says_what_a_prompt_may_be() {
        let check = |v: Value, expect: Result<&str, &str>| {
            let got = serde_json::from_value::<Prompt>(v.clone()).map(|p| format!("{p:?}"));
            match expect {
                Ok(debug) => assert_eq!(got.as_deref().ok(), Some(debug), "{v}"),
                Err(found) => {
                    let e = got.err().map(|e| e.to_string()).unwrap_or_default();
                    assert!(
                        e.starts_with("expected a string, a list of strings"),
                        "{v}: {e}"
                    );
                    assert!(e.ends_with(&format!("found {found}")), "{v}: {e}");
                }
            }
        };
        check(json!("hi"), Ok("Text(\"hi\")"));
        check(json!(["a", "b"]), Ok("Texts([\"a\", \"b\"])"));
        check(json!([1, 2]), Ok("Ids([1, 2])"));
        check(json!([[1], [2, 3]]), Ok("IdLists([[1], [2, 3]])"));
        check(json!(5), Err("a number"));
        check(json!(null), Err("null"));
        check(json!({"text": "x"}), Err("an object"));
        check(json!(["a", 1]), Err("a list of strings holding a number"));
        check(
            json!([1, -2]),
            Err("a list of token ids holding -2 (not a token id)"),
        );
        check(
            json!([1, 4294967296u64]),
            Err("a list of token ids holding 4294967296 (not a token id)"),
        );
        check(
            json!([[1], "x"]),
            Err("a list of token-id lists: a list of lists holding a string"),
        );
        check(json!([true]), Err("a list of a boolean"));
        // Through the request parser: the field is named once, with what a prompt may be.
        let e = from_value::<CompletionBody>(&json!({"prompt": 5}))
            .err()
            .map(|e| e.message)
            .unwrap_or_default();
        assert!(
            e.starts_with("field `prompt`: expected a string, a list of strings")
                && e.ends_with("found a number"),
            "{e}"
        );
    }

    #[test]
    fn refuses_each_bad_field_by_name() {
        use Endpoint::*;
        check_err(json!({"n": 2}), Completions, Some("n"), "n must be 1");
        check_err(
            json!({"max_tokens": 0}),
            Completions,
            Some("max_tokens"),
            "at least 1",
        );
        check_err(
            json!({"max_completion_tokens": -3}),
            Chat,
            Some("max_completion_tokens"),
            "at least 1",
        );
        check_err(
            json!({"temperature": 2.5}),
            Chat,
            Some("temperature"),
            "between 0 and 2",
        );
        check_err(json!({"top_p": 0}), Chat, Some("top_p"), "(0, 1]");
        check_err(
            json!({"stop": ["a", "b", "c", "d", "e"]}),
            Chat,
            Some("stop"),
            "at most 4",
        );
        check_err(json!({"stop": ""}), Chat, Some("stop"), "must not be empty");
        check_err(
            json!({"logprobs": 6}),
            Completions,
            Some("logprobs"),
            "0 to 5",
        );
        check_err(json!({"logprobs": 3}), Chat, Some("logprobs"), "boolean");
        check_err(
            json!({"top_logprobs": 2}),
            Chat,
            Some("top_logprobs"),
            "needs logprobs",
        );
        check_err(
            json!({"presence_penalty": 0.5}),
            Chat,
            Some("presence_penalty"),
            "not supported",
        );
        check_err(
            json!({"echo": true}),
            Completions,
            Some("echo"),
            "not supported",
        );
        check_err(
            json!({"temperature": "hot"}),
            Chat,
            Some("temperature"),
            "invalid type",
        );
        check_err(json!({"stream": 1}), Chat, Some("stream"), "invalid type");
    }

    #[test]
    fn openai_defaults() {
        let c: Common = from_value(&json!({})).unwrap_or_else(|e| panic!("{e:?}"));
        let p = c
            .params(Endpoint::Completions, 7)
            .unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(p.max_tokens, Some(DEFAULT_COMPLETION_MAX_TOKENS));
        assert_eq!(p.sampler.temperature, 1.0);
        assert_eq!(p.sampler.top_p, 1.0);
        assert_eq!(p.sampler.seed, 7);
        assert_eq!(p.top_logprobs, None);
        let p = c
            .params(Endpoint::Chat, 7)
            .unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(p.max_tokens, None);
    }

    #[test]
    fn bodies_that_are_not_objects_or_not_json() {
        assert!(parse_json(b"{\"prompt\": \"a\"").is_err_and(|e| e.message.contains("truncated")));
        assert!(parse_json(b"nope").is_err_and(|e| e.message.contains("not valid JSON")));
        let r: Result<Common, _> = from_value(&json!([1, 2]));
        assert!(r.is_err_and(|e| e.message.contains("found an array")));
        let r: Result<ChatBody, _> =
            from_value(&json!({"messages": [{"role": "user", "content": 5}]}));
        assert!(r.is_err_and(|e| e.param.as_deref() == Some("messages[0].content")));
    }
}
