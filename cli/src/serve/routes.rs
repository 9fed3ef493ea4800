//! The HTTP routes: request → validated [`Job`] → the engine's events → an OpenAI response
//! (one JSON object, or server-sent events ending in `data: [DONE]`).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, MethodRouter};
use axum::{Json, Router};
use futures_util::StreamExt;
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use super::api::{self, ChatBody, Common, CompletionBody, Endpoint, Params, Prompt};
use super::batcher::{Event, Finish, Job, TokenLogprob};
use super::chat::TemplateMessage;
use super::error::ApiError;
use super::{AppState, ModelInfo};

type St = State<Arc<AppState>>;

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/completions", only(Method::POST, post(completions)))
        .route("/v1/chat/completions", only(Method::POST, post(chat)))
        .route("/v1/models", only(Method::GET, get(models)))
        .route("/health", only(Method::GET, get(health)))
        .route("/ready", only(Method::GET, get(ready)))
        .route("/metrics", only(Method::GET, get(metrics)))
        .fallback(no_route)
        .with_state(state)
}

/// A route that answers other methods with an OpenAI error object (405) instead of an empty body.
fn only(method: Method, r: MethodRouter<Arc<AppState>>) -> MethodRouter<Arc<AppState>> {
    r.fallback(move |m: Method, uri: Uri| async move {
        let mut e = ApiError::invalid(
            None,
            format!("{} does not take {m}; use {method}", uri.path()),
        );
        e.status = StatusCode::METHOD_NOT_ALLOWED;
        e
    })
}

async fn no_route(m: Method, uri: Uri) -> ApiError {
    ApiError::no_route(m.as_str(), uri.path())
}

async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

async fn ready(State(st): St) -> Response {
    match st.ready.reason() {
        None => (
            StatusCode::OK,
            Json(json!({
                "status": "ready",
                "model": st.cfg.model_id,
                "seconds_since_last_token": st.ready.idle_for().map(|d| d.as_secs_f64()),
            })),
        )
            .into_response(),
        Some(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "not ready", "reason": reason, "model": st.cfg.model_id})),
        )
            .into_response(),
    }
}

async fn metrics(State(st): St) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        st.metrics.render(st.ready.is_ready()),
    )
        .into_response()
}

async fn models(State(st): St) -> Json<Value> {
    let info = st.info.get();
    Json(json!({
        "object": "list",
        "data": [{
            "id": st.cfg.model_id,
            "object": "model",
            "created": unix_now(),
            "owned_by": "plumbline",
            "context_length": st.cfg.ctx,
            "architecture": info.map(|i| i.arch.clone()),
            "chat_template": info.map(|i| i.template.source().describe()),
        }]
    }))
}

async fn completions(State(st): St, body: Body) -> Response {
    respond(st, Endpoint::Completions, body).await
}

async fn chat(State(st): St, body: Body) -> Response {
    respond(st, Endpoint::Chat, body).await
}

async fn respond(st: Arc<AppState>, endpoint: Endpoint, body: Body) -> Response {
    let r = generate(&st, endpoint, body).await;
    let resp = match r {
        Ok(resp) => resp,
        Err(e) => {
            if e.status.is_server_error() {
                tracing::error!(endpoint = endpoint.name(), message = %e.message, "request failed");
            } else {
                tracing::debug!(endpoint = endpoint.name(), status = e.status.as_u16(), message = %e.message, "request refused");
            }
            e.into_response()
        }
    };
    st.metrics.request(endpoint.name(), resp.status().as_u16());
    resp
}

/// Bytes past the body limit read and dropped before the 413 is sent.
const DRAIN_AFTER_LIMIT: usize = 8 << 20;

/// The body, at most `limit` bytes, within the body timeout.
async fn read_body(st: &AppState, body: Body) -> Result<Bytes, ApiError> {
    let limit = st.cfg.max_body_bytes;
    let read = async {
        let mut out: Vec<u8> = Vec::new();
        let (mut over, mut drained) = (false, 0usize);
        let mut stream = body.into_data_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| {
                ApiError::invalid(None, format!("reading the request body: {e}"))
                    .with_code("incomplete_body")
            })?;
            if over || out.len() + chunk.len() > limit {
                // Read (and drop) a bounded amount more before answering, so that the client,
                // still sending, gets the 413 instead of a reset connection.
                over = true;
                drained += chunk.len();
                if drained > DRAIN_AFTER_LIMIT {
                    break;
                }
                continue;
            }
            out.extend_from_slice(&chunk);
        }
        if over {
            return Err(ApiError::too_large(limit));
        }
        Ok(Bytes::from(out))
    };
    match tokio::time::timeout(st.cfg.body_timeout, read).await {
        Ok(r) => r,
        Err(_) => Err(ApiError::body_timeout(st.cfg.body_timeout.as_secs())),
    }
}

/// A request checked and tokenized.
struct Prepared {
    job: Job,
    params: Params,
    rx: UnboundedReceiver<Event>,
}

async fn generate(
    st: &Arc<AppState>,
    endpoint: Endpoint,
    body: Body,
) -> Result<Response, ApiError> {
    let bytes = read_body(st, body).await?;
    let value = api::parse_json(&bytes)?;
    let common: Common = api::from_value(&value)?;
    if let Some(m) = &common.model {
        if m != &st.cfg.model_id {
            return Err(ApiError::unknown_model(m, &st.cfg.model_id));
        }
    }
    let params = common.params(endpoint, st.fresh_seed())?;
    let info = st.model()?;
    let prompt = match endpoint {
        Endpoint::Completions => {
            let b: CompletionBody = api::from_value(&value)?;
            completion_prompt(info, b.prompt)?
        }
        Endpoint::Chat => {
            let b: ChatBody = api::from_value(&value)?;
            chat_prompt(info, &b)?
        }
    };
    let max_tokens = check_context(prompt.len(), params.max_tokens, st.cfg.ctx)?;
    let (tx, rx) = unbounded_channel();
    let job = Job {
        prompt,
        max_tokens,
        sampler: params.sampler,
        stop: params.stop.clone(),
        top_logprobs: params.top_logprobs,
        ignore_eos: params.ignore_eos,
        events: tx,
        enqueued: Instant::now(),
        probe: false,
    };
    let p = Prepared { job, params, rx };
    let id = match endpoint {
        Endpoint::Completions => format!("cmpl-{}", st.next_id()),
        Endpoint::Chat => format!("chatcmpl-{}", st.next_id()),
    };
    let meta = Meta {
        id,
        created: unix_now(),
        model: st.cfg.model_id.clone(),
        endpoint,
    };
    if p.params.stream {
        stream(st, p, meta).await
    } else {
        collect(st, p, meta).await
    }
}

/// The prompt of `/v1/completions`, tokenized as `plumbline generate` does (BOS where the model
/// asks for it; special-token text stays text), or ids as given.
fn completion_prompt(info: &ModelInfo, prompt: Prompt) -> Result<Vec<u32>, ApiError> {
    let empty =
        || ApiError::invalid(Some("prompt"), "the prompt is empty").with_code("empty_prompt");
    let one = |n: usize| {
        ApiError::invalid(
            Some("prompt"),
            format!("one prompt per request (n = 1), found a list of {n}"),
        )
    };
    let ids = match prompt {
        Prompt::Text(t) => encode_text(info, &t)?,
        Prompt::Texts(v) if v.len() == 1 => encode_text(info, &v[0])?,
        Prompt::Texts(v) => return Err(if v.is_empty() { empty() } else { one(v.len()) }),
        Prompt::Ids(ids) => ids,
        Prompt::IdLists(mut v) if v.len() == 1 => v.remove(0),
        Prompt::IdLists(v) => return Err(if v.is_empty() { empty() } else { one(v.len()) }),
    };
    if ids.is_empty() {
        return Err(empty());
    }
    if let Some((i, &bad)) = ids
        .iter()
        .enumerate()
        .find(|(_, &t)| t as usize >= info.n_vocab)
    {
        return Err(ApiError::invalid(
            Some(&format!("prompt[{i}]")),
            format!(
                "token id {bad} is outside the vocabulary of {} tokens",
                info.n_vocab
            ),
        ));
    }
    Ok(ids)
}

fn encode_text(info: &ModelInfo, text: &str) -> Result<Vec<u32>, ApiError> {
    if text.is_empty() {
        return Err(
            ApiError::invalid(Some("prompt"), "the prompt is empty").with_code("empty_prompt")
        );
    }
    info.tokenizer
        .encode(text, true, false)
        .map_err(|e| ApiError::invalid(Some("prompt"), format!("tokenizing the prompt: {e}")))
}

/// The chat prompt: messages through the chat template, tokenized with special tokens parsed
/// (the template writes them as text); a BOS the template wrote is not doubled.
fn chat_prompt(info: &ModelInfo, body: &ChatBody) -> Result<Vec<u32>, ApiError> {
    if body.messages.is_empty() {
        return Err(
            ApiError::invalid(Some("messages"), "messages must not be empty")
                .with_code("empty_prompt"),
        );
    }
    let mut msgs = Vec::with_capacity(body.messages.len());
    for (i, m) in body.messages.iter().enumerate() {
        let role = match m.role.as_str() {
            "system" | "developer" => "system",
            "user" => "user",
            "assistant" => "assistant",
            other => {
                return Err(ApiError::invalid(
                    Some(&format!("messages[{i}].role")),
                    format!("role must be system, developer, user or assistant, found `{other}`"),
                ))
            }
        };
        msgs.push(TemplateMessage {
            role: role.to_string(),
            content: m.text(i)?,
        });
    }
    if msgs.iter().all(|m| m.content.trim().is_empty()) {
        return Err(
            ApiError::invalid(Some("messages"), "every message is empty").with_code("empty_prompt"),
        );
    }
    let text = info
        .template
        .render(&msgs)
        .map_err(|e| ApiError::invalid(Some("messages"), e))?;
    let mut ids = info.tokenizer.encode(&text, true, true).map_err(|e| {
        ApiError::invalid(Some("messages"), format!("tokenizing the chat prompt: {e}"))
    })?;
    if let Some(bos) = info.tokenizer.bos() {
        if ids.len() >= 2 && ids[0] == bos && ids[1] == bos {
            ids.remove(0);
        }
    }
    Ok(ids)
}

/// `max_tokens` checked against the context: prompt + max_tokens must fit.
fn check_context(
    n_prompt: usize,
    max_tokens: Option<usize>,
    ctx: usize,
) -> Result<usize, ApiError> {
    if n_prompt >= ctx {
        return Err(ApiError::invalid(
            Some("prompt"),
            format!("the prompt is {n_prompt} tokens; this server's context is {ctx} tokens, leaving no room to generate"),
        )
        .with_code("context_length_exceeded"));
    }
    match max_tokens {
        None => Ok(ctx - n_prompt),
        Some(m) if n_prompt.saturating_add(m) > ctx => Err(ApiError::invalid(
            Some("max_tokens"),
            format!(
                "prompt ({n_prompt} tokens) + max_tokens ({m}) is over this server's context of {ctx} tokens"
            ),
        )
        .with_code("context_length_exceeded")),
        Some(m) => Ok(m),
    }
}

struct Meta {
    id: String,
    created: u64,
    model: String,
    endpoint: Endpoint,
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    })
}

/// How log-probability entries name tokens: their text, or `token_id:{id}`.
#[derive(Clone, Copy)]
struct LpFormat {
    endpoint: Endpoint,
    top: usize,
    ids: bool,
}

impl LpFormat {
    fn name(&self, id: u32, text: &str) -> String {
        if self.ids {
            format!("token_id:{id}")
        } else {
            text.to_string()
        }
    }

    /// Log-probabilities of some tokens, each with the text length before it (completions'
    /// `text_offset`), in the endpoint's format.
    fn json(&self, lps: &[(TokenLogprob, usize)]) -> Value {
        match self.endpoint {
            Endpoint::Completions => json!({
                "tokens": lps.iter().map(|(l, _)| self.name(l.id, &l.token)).collect::<Vec<_>>(),
                "token_logprobs": lps.iter().map(|(l, _)| l.logprob).collect::<Vec<_>>(),
                "top_logprobs": if self.top == 0 { Value::Null } else {
                    Value::Array(lps.iter().map(|(l, _)| {
                        let mut m = serde_json::Map::new();
                        for (i, t, _, p) in &l.top {
                            m.entry(self.name(*i, t)).or_insert(json!(p));
                        }
                        Value::Object(m)
                    }).collect())
                },
                "text_offset": lps.iter().map(|(_, o)| *o).collect::<Vec<_>>(),
            }),
            Endpoint::Chat => json!({
                "content": lps.iter().map(|(l, _)| json!({
                    "token": self.name(l.id, &l.token),
                    "logprob": l.logprob,
                    "bytes": l.bytes,
                    "top_logprobs": l.top.iter().map(|(i, t, b, p)| json!({
                        "token": self.name(*i, t), "logprob": p, "bytes": b,
                    })).collect::<Vec<_>>(),
                })).collect::<Vec<_>>(),
            }),
        }
    }
}

async fn collect(st: &AppState, mut p: Prepared, meta: Meta) -> Result<Response, ApiError> {
    let format = p.params.top_logprobs.map(|top| LpFormat {
        endpoint: meta.endpoint,
        top,
        ids: p.params.tokens_as_ids,
    });
    st.submit(p.job)?;
    let mut text = String::new();
    let mut lps: Vec<(TokenLogprob, usize)> = Vec::new();
    while let Some(ev) = p.rx.recv().await {
        match ev {
            Event::Delta { text: t, logprob } => {
                if let Some(l) = logprob {
                    lps.push((l, text.len()));
                }
                text.push_str(&t);
            }
            Event::Done {
                finish,
                prompt_tokens,
                completion_tokens,
            } => {
                let logprobs = format.map(|f| f.json(&lps));
                let choice = match meta.endpoint {
                    Endpoint::Completions => json!({
                        "index": 0, "text": text, "logprobs": logprobs,
                        "finish_reason": finish.as_str(),
                    }),
                    Endpoint::Chat => json!({
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": logprobs,
                        "finish_reason": finish.as_str(),
                    }),
                };
                let object = match meta.endpoint {
                    Endpoint::Completions => "text_completion",
                    Endpoint::Chat => "chat.completion",
                };
                return Ok(Json(json!({
                    "id": meta.id,
                    "object": object,
                    "created": meta.created,
                    "model": meta.model,
                    "choices": [choice],
                    "usage": usage(prompt_tokens, completion_tokens),
                }))
                .into_response());
            }
            Event::Failed(reason) => {
                return Err(ApiError::internal(format!("generation failed: {reason}")))
            }
        }
    }
    Err(ApiError::internal("the engine dropped the request"))
}

/// One SSE frame.
fn sse(v: &Value) -> String {
    format!("data: {v}\n\n")
}

struct StreamState {
    rx: UnboundedReceiver<Event>,
    first: Option<Event>,
    meta: Meta,
    format: Option<LpFormat>,
    include_usage: bool,
    text_len: usize,
    done: bool,
}

impl StreamState {
    fn chunk(
        &self,
        delta_text: Option<&str>,
        logprobs: Option<Value>,
        finish: Option<Finish>,
    ) -> Value {
        let (object, choice) = match self.meta.endpoint {
            Endpoint::Completions => (
                "text_completion",
                json!({
                    "index": 0,
                    "text": delta_text.unwrap_or(""),
                    "logprobs": logprobs,
                    "finish_reason": finish.map(Finish::as_str),
                }),
            ),
            Endpoint::Chat => (
                "chat.completion.chunk",
                json!({
                    "index": 0,
                    "delta": match delta_text { Some(t) => json!({"content": t}), None => json!({}) },
                    "logprobs": logprobs,
                    "finish_reason": finish.map(Finish::as_str),
                }),
            ),
        };
        json!({
            "id": self.meta.id,
            "object": object,
            "created": self.meta.created,
            "model": self.meta.model,
            "choices": [choice],
        })
    }

    /// The frames for one event; `true` when the stream ends after them.
    fn frames(&mut self, ev: Event) -> (String, bool) {
        match ev {
            Event::Delta { text, logprob } => {
                if text.is_empty() && logprob.is_none() {
                    return (String::new(), false);
                }
                let lp = match (logprob, self.format) {
                    (Some(l), Some(f)) => Some(f.json(&[(l, self.text_len)])),
                    _ => None,
                };
                self.text_len += text.len();
                (sse(&self.chunk(Some(&text), lp, None)), false)
            }
            Event::Done {
                finish,
                prompt_tokens,
                completion_tokens,
            } => {
                let mut out = sse(&self.chunk(None, None, Some(finish)));
                if self.include_usage {
                    let mut u = self.chunk(None, None, None);
                    u["choices"] = json!([]);
                    u["usage"] = usage(prompt_tokens, completion_tokens);
                    out.push_str(&sse(&u));
                }
                out.push_str("data: [DONE]\n\n");
                (out, true)
            }
            Event::Failed(reason) => (
                sse(&ApiError::internal(format!("generation failed: {reason}")).body()),
                true,
            ),
        }
    }
}

async fn stream(st: &AppState, mut p: Prepared, meta: Meta) -> Result<Response, ApiError> {
    let endpoint = meta.endpoint;
    st.submit(p.job)?;
    // Wait for the first event so that a generation that fails at once is a plain 500.
    let first = match p.rx.recv().await {
        Some(Event::Failed(reason)) => {
            return Err(ApiError::internal(format!("generation failed: {reason}")))
        }
        Some(ev) => ev,
        None => return Err(ApiError::internal("the engine dropped the request")),
    };
    let state = StreamState {
        rx: p.rx,
        first: Some(first),
        meta,
        format: p.params.top_logprobs.map(|top| LpFormat {
            endpoint,
            top,
            ids: p.params.tokens_as_ids,
        }),
        include_usage: p.params.include_usage,
        text_len: 0,
        done: false,
    };
    // Chat streams open with the assistant role, as OpenAI's do.
    let opening = if state.meta.endpoint == Endpoint::Chat {
        let mut c = state.chunk(None, None, None);
        c["choices"][0]["delta"] = json!({"role": "assistant", "content": ""});
        sse(&c)
    } else {
        String::new()
    };
    let head =
        futures_util::stream::once(async move { Ok::<Bytes, Infallible>(Bytes::from(opening)) });
    let rest = futures_util::stream::unfold(state, |mut s| async move {
        if s.done {
            return None;
        }
        let ev = match s.first.take() {
            Some(ev) => ev,
            None => match s.rx.recv().await {
                Some(ev) => ev,
                None => Event::Failed("the engine dropped the request".into()),
            },
        };
        let (frames, end) = s.frames(ev);
        s.done = end;
        Some((Ok::<Bytes, Infallible>(Bytes::from(frames)), s))
    });
    let frames = head
        .chain(rest)
        .filter(|r| std::future::ready(!matches!(r, Ok(b) if b.is_empty())));
    let body = Body::from_stream(frames);
    Ok((
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn context_limits() {
        assert_eq!(check_context(10, Some(5), 16), Ok(5));
        assert_eq!(check_context(10, None, 16), Ok(6));
        let e = check_context(10, Some(7), 16).err();
        assert_eq!(e.and_then(|e| e.code), Some("context_length_exceeded"));
        let e = check_context(16, Some(1), 16).err();
        assert_eq!(e.and_then(|e| e.param), Some("prompt".to_string()));
    }
}
