//! Parsing what clients send: the route a method and path name, and the
//! parts of an OpenAI-style body the gateway needs (model, streaming, token
//! estimate). Everything here takes untrusted bytes and must never panic;
//! a proptest and the `request` fuzz target hold it to that.

use std::borrow::Cow;
use std::ops::Range;

use bytes::Bytes;
use http::Method;
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};

/// A public route. Templates (`route_template`) label metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// `GET /healthz`, `GET /v2/health/live`: the process is up.
    Live,
    /// `GET /readyz`, `GET /v2/health/ready`: some model can be served.
    Ready,
    ChatCompletions,
    Completions,
    Embeddings,
    /// `GET /v1/models`: answered by the gateway, filtered by role.
    Models,
    /// `GET /v2/models/{name}[/versions/{v}]`.
    OipMetadata(OipModel),
    /// `GET /v2/models/{name}[/versions/{v}]/ready`.
    OipReady(OipModel),
    /// `POST /v2/models/{name}[/versions/{v}]/infer`.
    OipInfer(OipModel),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OipModel {
    pub name: String,
    pub version: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouteError {
    NotFound,
    MethodNotAllowed,
}

/// Every public route as (method, example path, public without a key),
/// for documentation and for the test that knocks on each.
pub const ROUTES: &[(&str, &str, bool)] = &[
    ("GET", "/healthz", true),
    ("GET", "/readyz", true),
    ("GET", "/v2/health/live", true),
    ("GET", "/v2/health/ready", true),
    ("POST", "/v1/chat/completions", false),
    ("POST", "/v1/completions", false),
    ("POST", "/v1/embeddings", false),
    ("GET", "/v1/models", false),
    ("GET", "/v2/models/{name}", false),
    ("GET", "/v2/models/{name}/versions/{version}", false),
    ("GET", "/v2/models/{name}/ready", false),
    ("GET", "/v2/models/{name}/versions/{version}/ready", false),
    ("POST", "/v2/models/{name}/infer", false),
    ("POST", "/v2/models/{name}/versions/{version}/infer", false),
];

impl Route {
    /// The route template, for metric labels and logs.
    pub fn template(&self) -> &'static str {
        match self {
            Route::Live => "/healthz",
            Route::Ready => "/readyz",
            Route::ChatCompletions => "/v1/chat/completions",
            Route::Completions => "/v1/completions",
            Route::Embeddings => "/v1/embeddings",
            Route::Models => "/v1/models",
            Route::OipMetadata(m) if m.version.is_some() => "/v2/models/{name}/versions/{version}",
            Route::OipMetadata(_) => "/v2/models/{name}",
            Route::OipReady(m) if m.version.is_some() => {
                "/v2/models/{name}/versions/{version}/ready"
            }
            Route::OipReady(_) => "/v2/models/{name}/ready",
            Route::OipInfer(m) if m.version.is_some() => {
                "/v2/models/{name}/versions/{version}/infer"
            }
            Route::OipInfer(_) => "/v2/models/{name}/infer",
        }
    }

    /// The RBAC operation this route is; `None` for the open probes.
    pub fn operation(&self) -> Option<&'static str> {
        Some(match self {
            Route::Live | Route::Ready => return None,
            Route::ChatCompletions => "chat",
            Route::Completions => "completions",
            Route::Embeddings => "embeddings",
            Route::Models => "models",
            Route::OipMetadata(_) | Route::OipReady(_) => "metadata",
            Route::OipInfer(_) => "infer",
        })
    }

    pub fn is_public(&self) -> bool {
        matches!(self, Route::Live | Route::Ready)
    }
}

/// Names a route from a method and a path (no query string).
pub fn route(method: &Method, path: &str) -> Result<Route, RouteError> {
    let want = |m: Method, r: Route| {
        if *method == m {
            Ok(r)
        } else {
            Err(RouteError::MethodNotAllowed)
        }
    };
    match path {
        "/healthz" | "/v2/health/live" => return want(Method::GET, Route::Live),
        "/readyz" | "/v2/health/ready" => return want(Method::GET, Route::Ready),
        "/v1/chat/completions" => return want(Method::POST, Route::ChatCompletions),
        "/v1/completions" => return want(Method::POST, Route::Completions),
        "/v1/embeddings" => return want(Method::POST, Route::Embeddings),
        "/v1/models" => return want(Method::GET, Route::Models),
        _ => {}
    }
    let rest = path
        .strip_prefix("/v2/models/")
        .ok_or(RouteError::NotFound)?;
    let parts: Vec<&str> = rest.split('/').collect();
    let (name, version, action) = match parts.as_slice() {
        [n] => (*n, None, None),
        [n, a] => (*n, None, Some(*a)),
        [n, "versions", v] => (*n, Some(*v), None),
        [n, "versions", v, a] => (*n, Some(*v), Some(*a)),
        _ => return Err(RouteError::NotFound),
    };
    let ok_seg = |s: &str| {
        !s.is_empty()
            && s.len() <= 256
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'))
            && s != "."
            && s != ".."
    };
    if !ok_seg(name) || !version.is_none_or(ok_seg) {
        return Err(RouteError::NotFound);
    }
    let m = OipModel {
        name: name.to_owned(),
        version: version.map(str::to_owned),
    };
    match action {
        None => want(Method::GET, Route::OipMetadata(m)),
        Some("ready") => want(Method::GET, Route::OipReady(m)),
        Some("infer") => want(Method::POST, Route::OipInfer(m)),
        Some(_) => Err(RouteError::NotFound),
    }
}

/// What the gateway reads from an OpenAI-style request body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenAiRequest {
    pub model: String,
    pub stream: bool,
    /// The client asked for the usage chunk (`stream_options.include_usage`).
    pub include_usage: bool,
    /// The largest of the length limits the body gives: `max_tokens`,
    /// `max_completion_tokens`, `max_new_tokens` and a non-negative
    /// `n_predict` (servers differ in which one wins when several are
    /// given).
    pub max_tokens: Option<u64>,
    /// vLLM's `min_tokens`: the completion's least length.
    pub min_tokens: Option<u64>,
    /// Completions generated per request: the larger of `n` and `best_of`,
    /// at least 1.
    pub choices: u64,
    /// The prompt's size: text bytes, token ids (one token each), the
    /// bytes of the fields a chat template renders besides the messages
    /// ([`TEMPLATE_FIELDS`]) and the number of chat messages.
    /// [`OpenAiRequest::prompt_tokens`] turns it into tokens.
    pub prompt: PromptSize,
}

/// A prompt's size as parsed, before any bytes-per-token rule.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PromptSize {
    pub text_bytes: u64,
    /// Token ids, and the other scalars (numbers, booleans) a template
    /// renders: one token each.
    pub ids: u64,
    /// Bytes of [`TEMPLATE_FIELDS`] as sent.
    pub tools_bytes: u64,
    /// Elements of a chat request's `messages` array (0 for other routes).
    pub messages: u64,
}

impl OpenAiRequest {
    /// Prompt tokens estimated at `bytes_per_token` bytes a token (text,
    /// and the [`TEMPLATE_FIELDS`], each rounded up), plus one per token
    /// id, number or boolean, plus `tokens_per_message` for each chat message and once more
    /// for the header of the reply the template opens (none when there
    /// are no messages). With 4 bytes a token, a typical English
    /// tokenizer's average; with 1, an upper bound for byte-level BPE
    /// tokenizers, where every token is at least one byte, once
    /// `tokens_per_message` covers the chat template's own tokens.
    pub fn prompt_tokens(&self, bytes_per_token: u64, tokens_per_message: u64) -> u64 {
        let b = bytes_per_token.max(1);
        let p = &self.prompt;
        let template = if p.messages == 0 {
            0
        } else {
            tokens_per_message.saturating_mul(p.messages.saturating_add(1))
        };
        p.text_bytes
            .div_ceil(b)
            .saturating_add(p.ids)
            .saturating_add(p.tools_bytes.div_ceil(b))
            .saturating_add(template)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error("the body is not valid JSON: {0}")]
    Json(String),
    #[error("the body must be a JSON object")]
    NotObject,
    #[error("`model` must be a non-empty string")]
    Model,
    #[error("`model` {0:?} is longer than a model name may be ({MAX_MODEL_BYTES} bytes)")]
    ModelTooLong(String),
    #[error("`{0}` has the wrong type")]
    Field(&'static str),
    #[error("`{0}` must be a whole number, at least 0")]
    Count(&'static str),
    #[error("`{0}` appears more than once")]
    Duplicate(&'static str),
}

/// Which field holds the prompt for each route.
pub fn prompt_field(r: &Route) -> &'static str {
    match r {
        Route::ChatCompletions => "messages",
        Route::Completions => "prompt",
        _ => "input",
    }
}

/// The longest `model` name a request may give.
pub const MAX_MODEL_BYTES: usize = 256;

/// Top-level fields besides the prompt that chat templates render into
/// the prompt (tool and function definitions, vLLM's and llama.cpp's RAG
/// `documents`, a request's own `chat_template` and its arguments): their
/// bytes as sent count toward the prompt estimate.
pub const TEMPLATE_FIELDS: [&str; 5] = [
    "tools",
    "functions",
    "documents",
    "chat_template",
    "chat_template_kwargs",
];

/// Object keys of OpenAI's message format. They are the format's own
/// words, covered by `prompt_tokens_per_message`; any other key in the
/// prompt counts as text (a template that renders an object, such as
/// tool-call arguments given as JSON, renders its keys).
pub const FORMAT_KEYS: [&str; 24] = [
    "role",
    "content",
    "name",
    "type",
    "text",
    "tool_calls",
    "tool_call_id",
    "function_call",
    "id",
    "function",
    "arguments",
    "image_url",
    "url",
    "detail",
    "input_audio",
    "data",
    "format",
    "refusal",
    "audio",
    "file",
    "file_id",
    "filename",
    "file_data",
    "reasoning_content",
];

/// `role` values of OpenAI's message format (covered by
/// `prompt_tokens_per_message`); any other role counts as text.
pub const FORMAT_ROLES: [&str; 6] = [
    "system",
    "developer",
    "user",
    "assistant",
    "tool",
    "function",
];

/// `type` values of OpenAI's message format; any other counts as text.
pub const FORMAT_TYPES: [&str; 6] = [
    "text",
    "image_url",
    "input_audio",
    "file",
    "function",
    "refusal",
];

/// An OpenAI-style body as the client sent it, with the byte spans of the
/// top-level fields the gateway rewrites. Forwarding splices the backend's
/// model name (and, for streams, `stream_options`, and the length limits)
/// into the original bytes: every other field reaches the backend exactly
/// as the client wrote it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenAiBody {
    bytes: Bytes,
    /// Where the opening `{` is.
    open: usize,
    model: Range<usize>,
    stream_options: Option<Range<usize>>,
    /// Whether and how the body gives `max_tokens`.
    max_tokens: Slot,
    /// A negative `n_predict` (llama.cpp: no limit) at this span.
    unbounded_n_predict: Option<Range<usize>>,
}

/// Whether a body gives `max_tokens`, and where a `null` one sits (it is
/// replaced, not shadowed by a second key).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Slot {
    /// A number.
    Given,
    Absent,
    /// `null` at this span.
    Null(Range<usize>),
}

impl OpenAiBody {
    /// The original bytes.
    pub fn bytes(&self) -> &Bytes {
        &self.bytes
    }

    /// The body to send: `model` set to `backend_model`; with
    /// `force_usage`, `stream_options.include_usage` set to true (added
    /// when absent); with `limit` (the completion tokens reserved a
    /// choice, at least every length limit the body gives), `max_tokens`
    /// set to it when the body gives no number there and a negative
    /// `n_predict` replaced by it, so that no backend, whichever field it
    /// reads first, can generate more than was reserved.
    pub fn render(&self, backend_model: &str, force_usage: bool, limit: Option<u64>) -> Bytes {
        let b = &self.bytes[..];
        let model = serde_json::to_string(backend_model).expect("a string serialises");
        let mut edits: Vec<(Range<usize>, Vec<u8>)> =
            vec![(self.model.clone(), model.into_bytes())];
        if let Some(n) = limit {
            match &self.max_tokens {
                Slot::Given => {}
                Slot::Null(r) => edits.push((r.clone(), n.to_string().into_bytes())),
                Slot::Absent => edits.push((
                    self.open + 1..self.open + 1,
                    format!(r#""max_tokens":{n},"#).into_bytes(),
                )),
            }
            if let Some(r) = &self.unbounded_n_predict {
                edits.push((r.clone(), n.to_string().into_bytes()));
            }
        }
        if force_usage {
            match &self.stream_options {
                Some(r) => {
                    let mut o = match serde_json::from_slice::<Value>(&b[r.clone()]) {
                        Ok(Value::Object(o)) => o,
                        _ => Map::new(),
                    };
                    o.insert("include_usage".into(), Value::Bool(true));
                    edits.push((r.clone(), Value::Object(o).to_string().into_bytes()));
                }
                None => edits.push((
                    self.open + 1..self.open + 1,
                    br#""stream_options":{"include_usage":true},"#.to_vec(),
                )),
            }
        }
        edits.sort_by_key(|(r, _)| r.start);
        let mut out =
            Vec::with_capacity(b.len() + edits.iter().map(|(_, v)| v.len()).sum::<usize>());
        let mut at = 0;
        for (r, v) in edits {
            out.extend_from_slice(&b[at..r.start]);
            out.extend_from_slice(&v);
            at = r.end;
        }
        out.extend_from_slice(&b[at..]);
        Bytes::from(out)
    }
}

/// A top-level key, borrowed from the body unless it has escapes.
struct Key<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(v.to_owned())))
            }
        }
        d.deserialize_str(V)
    }
}

/// What a value is the value of, for the words of the message format.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Under {
    Role,
    Type,
    Other,
}

/// Counts a prompt's size as it is parsed, without building the value:
/// every string a chat template may render counts its bytes, every number
/// and boolean one token (token-id prompts, values in tool-call
/// arguments). That is every string value at any depth, a `name`,
/// tool-call ids, names and arguments included, and every object key,
/// except the words of OpenAI's message format: [`FORMAT_KEYS`], and a
/// `role` or `type` value from [`FORMAT_ROLES`] or [`FORMAT_TYPES`] (those
/// are the template's own tokens, `prompt_tokens_per_message`). A value
/// nested deeper than 64 levels counts its bytes as sent. The test backend
/// reports prompt tokens by the same rule, so tests can assert exact
/// accounting. `elements` counts the elements of the prompt itself when
/// it is an array (a chat request's messages).
struct Estimate<'a> {
    bytes: &'a mut u64,
    ids: &'a mut u64,
    elements: &'a mut u64,
    depth: u32,
    under: Under,
}

impl<'de> DeserializeSeed<'de> for Estimate<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        if self.depth > 64 {
            let raw = <&'de RawValue>::deserialize(d)?;
            *self.bytes = self.bytes.saturating_add(raw.get().len() as u64);
            return Ok(());
        }
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Estimate<'_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        let format_word = match self.under {
            Under::Role => FORMAT_ROLES.contains(&v),
            Under::Type => FORMAT_TYPES.contains(&v),
            Under::Other => false,
        };
        if !format_word {
            *self.bytes += v.len() as u64;
        }
        Ok(())
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        *self.ids += 1;
        Ok(())
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<(), E> {
        self.visit_u64(v.unsigned_abs())
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        self.visit_u64(0)
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        self.visit_u64(0)
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<(), A::Error> {
        while a
            .next_element_seed(Estimate {
                bytes: &mut *self.bytes,
                ids: &mut *self.ids,
                elements: &mut *self.elements,
                depth: self.depth + 1,
                under: Under::Other,
            })?
            .is_some()
        {
            if self.depth == 0 {
                *self.elements += 1;
            }
        }
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<(), A::Error> {
        while let Some(Key(k)) = a.next_key::<Key<'de>>()? {
            if !FORMAT_KEYS.contains(&&*k) {
                *self.bytes += k.len() as u64;
            }
            a.next_value_seed(Estimate {
                bytes: &mut *self.bytes,
                ids: &mut *self.ids,
                elements: &mut *self.elements,
                depth: self.depth + 1,
                under: match &*k {
                    "role" => Under::Role,
                    "type" => Under::Type,
                    _ => Under::Other,
                },
            })?;
        }
        Ok(())
    }
}

/// The top-level object: spans of the rewritten fields and what the
/// gateway reads.
struct Top {
    base: usize,
    prompt_field: &'static str,
}

#[derive(Default)]
struct Seen {
    model: Option<(String, Range<usize>)>,
    stream: Option<bool>,
    stream_options: Option<(bool, Range<usize>)>,
    max_tokens: Option<(Option<u64>, Range<usize>)>,
    max_completion_tokens: Option<Option<u64>>,
    max_new_tokens: Option<Option<u64>>,
    min_tokens: Option<Option<u64>>,
    /// `Err(span)`: negative (no limit, to be replaced).
    n_predict: Option<Option<Result<u64, Range<usize>>>>,
    n: Option<Option<u64>>,
    best_of: Option<Option<u64>>,
    /// Text bytes, token ids and chat messages.
    prompt: Option<(u64, u64, u64)>,
    /// Bytes of the [`TEMPLATE_FIELDS`].
    tools: u64,
}

impl<'de> Visitor<'de> for Top {
    type Value = Result<Seen, ParseError>;
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<Self::Value, A::Error> {
        let mut seen = Seen::default();
        let mut failed = None;
        while let Some(Key(k)) = a.next_key::<Key<'de>>()? {
            if k == self.prompt_field {
                let (mut bytes, mut ids, mut elements) = (0, 0, 0);
                a.next_value_seed(Estimate {
                    bytes: &mut bytes,
                    ids: &mut ids,
                    elements: &mut elements,
                    depth: 0,
                    under: Under::Other,
                })?;
                let messages = if self.prompt_field == "messages" {
                    elements
                } else {
                    0
                };
                if seen.prompt.replace((bytes, ids, messages)).is_some() {
                    failed.get_or_insert(ParseError::Duplicate(self.prompt_field));
                }
                continue;
            }
            if TEMPLATE_FIELDS.contains(&&*k) {
                let raw: &'de RawValue = a.next_value()?;
                seen.tools = seen.tools.saturating_add(raw.get().len() as u64);
                continue;
            }
            let Some(name) = READ_FIELDS.iter().copied().find(|f| *f == k) else {
                a.next_value::<IgnoredAny>()?;
                continue;
            };
            let raw: &'de RawValue = a.next_value()?;
            let span = {
                let start = raw.get().as_ptr() as usize - self.base;
                start..start + raw.get().len()
            };
            let v: Value = serde_json::from_str(raw.get()).map_err(de::Error::custom)?;
            let dup = match name {
                "model" => match v {
                    Value::String(s) if s.len() > MAX_MODEL_BYTES => {
                        failed.get_or_insert_with(|| {
                            ParseError::ModelTooLong(crate::error::reflect(&s).into_owned())
                        });
                        false
                    }
                    Value::String(s) if !s.is_empty() => seen.model.replace((s, span)).is_some(),
                    _ => {
                        failed.get_or_insert(ParseError::Model);
                        false
                    }
                },
                "stream" => match v {
                    Value::Null => seen.stream.replace(false).is_some(),
                    Value::Bool(b) => seen.stream.replace(b).is_some(),
                    _ => {
                        failed.get_or_insert(ParseError::Field("stream"));
                        false
                    }
                },
                "stream_options" => {
                    let include = match &v {
                        Value::Null => Some(false),
                        Value::Object(o) => match o.get("include_usage") {
                            None | Some(Value::Null) => Some(false),
                            Some(Value::Bool(b)) => Some(*b),
                            Some(_) => {
                                failed.get_or_insert(ParseError::Field(
                                    "stream_options.include_usage",
                                ));
                                None
                            }
                        },
                        _ => {
                            failed.get_or_insert(ParseError::Field("stream_options"));
                            None
                        }
                    };
                    include.is_some_and(|i| seen.stream_options.replace((i, span)).is_some())
                }
                // llama.cpp reads `n_predict` before `max_tokens`; a
                // negative one (-1: no limit) is replaced when forwarding.
                "n_predict" => {
                    let n = match &v {
                        Value::Null => Some(None),
                        Value::Number(n) => match (n.as_u64(), n.as_i64()) {
                            (Some(u), _) => Some(Some(Ok(u))),
                            (None, Some(_)) => Some(Some(Err(span))),
                            _ => None,
                        },
                        _ => None,
                    };
                    match n {
                        Some(n) => seen.n_predict.replace(n).is_some(),
                        None => {
                            failed.get_or_insert(ParseError::Field("n_predict"));
                            false
                        }
                    }
                }
                f => {
                    let n = match &v {
                        Value::Null => Some(None),
                        Value::Number(n) => n.as_u64().map(Some),
                        _ => None,
                    };
                    match (n, f) {
                        (None, _) => {
                            failed.get_or_insert(if matches!(v, Value::Number(_)) {
                                ParseError::Count(f)
                            } else {
                                ParseError::Field(f)
                            });
                            false
                        }
                        (Some(n), "max_new_tokens") => seen.max_new_tokens.replace(n).is_some(),
                        (Some(n), "min_tokens") => seen.min_tokens.replace(n).is_some(),
                        (Some(n), "max_tokens") => seen.max_tokens.replace((n, span)).is_some(),
                        (Some(n), "n") => seen.n.replace(n).is_some(),
                        (Some(n), "best_of") => seen.best_of.replace(n).is_some(),
                        (Some(n), _) => seen.max_completion_tokens.replace(n).is_some(),
                    }
                }
            };
            if dup {
                failed.get_or_insert(ParseError::Duplicate(name));
            }
        }
        Ok(match failed {
            Some(e) => Err(e),
            None => Ok(seen),
        })
    }
}

/// The top-level fields the gateway reads (besides the prompt): the
/// length limits of OpenAI (`max_tokens`, `max_completion_tokens`),
/// llama.cpp (`n_predict`), TGI-style servers (`max_new_tokens`) and
/// vLLM (`min_tokens`) among them.
const READ_FIELDS: [&str; 10] = [
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "max_new_tokens",
    "min_tokens",
    "n_predict",
    "n",
    "best_of",
];

/// Parses an OpenAI-style body: the fields the gateway needs, and the body
/// kept for forwarding. The document is scanned once; only the small
/// fields the gateway reads are built as values. A field the gateway reads
/// that appears twice is refused, so the gateway and the backend cannot
/// disagree about which model was asked for.
pub fn parse_openai(
    body: &Bytes,
    prompt_field: &'static str,
) -> Result<(OpenAiBody, OpenAiRequest), ParseError> {
    let open = body.iter().position(|b| !b.is_ascii_whitespace());
    if open.is_none_or(|i| body[i] != b'{') {
        return Err(match serde_json::from_slice::<IgnoredAny>(body) {
            Ok(_) => ParseError::NotObject,
            Err(e) => ParseError::Json(e.to_string()),
        });
    }
    let top = Top {
        base: body.as_ptr() as usize,
        prompt_field,
    };
    let mut de = serde_json::Deserializer::from_slice(body);
    let seen = de
        .deserialize_map(top)
        .and_then(|r| de.end().map(|()| r))
        .map_err(|e| ParseError::Json(e.to_string()))??;
    let Some((model, model_span)) = seen.model else {
        return Err(ParseError::Model);
    };
    let stream = seen.stream.unwrap_or(false);
    let (include_usage, stream_options) = match seen.stream_options {
        Some((i, r)) => (i, Some(r)),
        None => (false, None),
    };
    let max_tokens = seen.max_tokens.as_ref().and_then(|(n, _)| *n);
    let slot = match &seen.max_tokens {
        Some((Some(_), _)) => Slot::Given,
        Some((None, r)) => Slot::Null(r.clone()),
        None => Slot::Absent,
    };
    let (n_predict, unbounded_n_predict) = match seen.n_predict.flatten() {
        Some(Ok(n)) => (Some(n), None),
        Some(Err(r)) => (None, Some(r)),
        None => (None, None),
    };
    let longest = [
        max_tokens,
        seen.max_completion_tokens.flatten(),
        seen.max_new_tokens.flatten(),
        n_predict,
    ]
    .into_iter()
    .flatten()
    .max();
    Ok((
        OpenAiBody {
            bytes: body.clone(),
            open: open.unwrap_or(0),
            model: model_span,
            stream_options,
            max_tokens: slot,
            unbounded_n_predict,
        },
        OpenAiRequest {
            model,
            stream,
            include_usage,
            max_tokens: longest,
            min_tokens: seen.min_tokens.flatten(),
            choices: seen
                .n
                .flatten()
                .max(seen.best_of.flatten())
                .unwrap_or(1)
                .max(1),
            prompt: {
                let (text_bytes, ids, messages) = seen.prompt.unwrap_or((0, 0, 0));
                PromptSize {
                    text_bytes,
                    ids,
                    tools_bytes: seen.tools,
                    messages,
                }
            },
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The estimate rule over a built JSON value: the reference the
    /// streaming count is checked against.
    fn estimate_tokens(v: &Value) -> u64 {
        fn walk(v: &Value, key: &str, bytes: &mut u64, ids: &mut u64, depth: u32) {
            if depth > 64 {
                *bytes += serde_json::to_string(v).expect("json").len() as u64;
                return;
            }
            match v {
                Value::String(s) if key == "role" && FORMAT_ROLES.contains(&s.as_str()) => {}
                Value::String(s) if key == "type" && FORMAT_TYPES.contains(&s.as_str()) => {}
                Value::String(s) => *bytes += s.len() as u64,
                Value::Number(_) | Value::Bool(_) => *ids += 1,
                Value::Array(a) => a.iter().for_each(|x| walk(x, "", bytes, ids, depth + 1)),
                Value::Object(o) => {
                    for (k, x) in o {
                        if !FORMAT_KEYS.contains(&k.as_str()) {
                            *bytes += k.len() as u64;
                        }
                        walk(x, k, bytes, ids, depth + 1);
                    }
                }
                Value::Null => {}
            }
        }
        let (mut bytes, mut ids) = (0, 0);
        walk(v, "", &mut bytes, &mut ids, 0);
        bytes.div_ceil(4) + ids
    }

    #[test]
    fn routes() {
        let get = Method::GET;
        let post = Method::POST;
        assert_eq!(
            route(&post, "/v1/chat/completions"),
            Ok(Route::ChatCompletions)
        );
        assert_eq!(
            route(&get, "/v1/chat/completions"),
            Err(RouteError::MethodNotAllowed)
        );
        assert_eq!(
            route(&post, "/v2/models/resnet/versions/2/infer"),
            Ok(Route::OipInfer(OipModel {
                name: "resnet".into(),
                version: Some("2".into())
            }))
        );
        assert_eq!(
            route(&get, "/v2/models/resnet").map(|r| r.template()),
            Ok("/v2/models/{name}")
        );
        assert_eq!(
            route(&get, "/v2/models/../ready"),
            Err(RouteError::NotFound)
        );
        assert_eq!(route(&get, "/v2/models//ready"), Err(RouteError::NotFound));
        assert_eq!(
            route(&get, "/v2/models/a/b/c/d/e"),
            Err(RouteError::NotFound)
        );
        assert_eq!(route(&get, "/nope"), Err(RouteError::NotFound));
        for (m, p, public) in ROUTES {
            let p = p.replace("{name}", "m").replace("{version}", "1");
            let r = route(&m.parse().expect("method"), &p).expect(&p);
            assert_eq!(r.is_public(), *public, "{p}");
        }
    }

    #[test]
    fn bodies() {
        let (_, r) = parse_openai(&Bytes::from_static(br#"{"model":"m","messages":[{"role":"user","content":"12345678"}],"stream":true,"max_tokens":10}"#),
            "messages",
        )
        .expect("ok");
        assert_eq!(
            r,
            OpenAiRequest {
                model: "m".into(),
                stream: true,
                include_usage: false,
                max_tokens: Some(10),
                min_tokens: None,
                choices: 1,
                prompt: PromptSize {
                    text_bytes: 8,
                    ids: 0,
                    tools_bytes: 0,
                    messages: 1
                }
            }
        );
        let (_, r) = parse_openai(
            &Bytes::from_static(
                br#"{"model":"m","prompt":[1,2,3],"stream_options":{"include_usage":true}}"#,
            ),
            "prompt",
        )
        .expect("ok");
        assert_eq!((r.prompt_tokens(4, 0), r.include_usage), (3, true));
        assert_eq!(
            r.prompt_tokens(1, 0),
            3,
            "token ids are one token whatever the rule"
        );
        assert!(matches!(
            parse_openai(&Bytes::from_static(b"{"), "messages"),
            Err(ParseError::Json(_))
        ));
        assert_eq!(
            parse_openai(&Bytes::from_static(b"[]"), "messages"),
            Err(ParseError::NotObject)
        );
        assert_eq!(
            parse_openai(&Bytes::from_static(br#"{"model":1}"#), "messages"),
            Err(ParseError::Model)
        );
        assert_eq!(
            parse_openai(
                &Bytes::from_static(br#"{"model":"m","stream":"yes"}"#),
                "messages"
            ),
            Err(ParseError::Field("stream"))
        );
        assert_eq!(
            parse_openai(
                &Bytes::from_static(br#"{"model":"m","max_tokens":-1}"#),
                "messages"
            ),
            Err(ParseError::Count("max_tokens"))
        );
        // A model name is at most 256 bytes; the error does not repeat it.
        let long = format!(r#"{{"model":"{}"}}"#, "m".repeat(MAX_MODEL_BYTES + 1));
        let e = parse_openai(&body(&long), "messages").expect_err("too long");
        assert!(
            matches!(&e, ParseError::ModelTooLong(s) if s.ends_with("… (257 bytes)")),
            "{e}"
        );
        let long = format!(r#"{{"model":"{}"}}"#, "m".repeat(1 << 20));
        let e = parse_openai(&body(&long), "messages").expect_err("too long");
        assert!(e.to_string().len() < 2 * MAX_MODEL_BYTES, "{e}");
        let ok = format!(r#"{{"model":"{}"}}"#, "m".repeat(MAX_MODEL_BYTES));
        assert!(parse_openai(&body(&ok), "messages").is_ok());
    }

    fn body(s: &str) -> Bytes {
        Bytes::copy_from_slice(s.as_bytes())
    }

    #[test]
    fn reservations_bound_what_the_backend_may_generate() {
        let parse = |s: &str, f| parse_openai(&body(s), f).expect(s);
        // The larger of the two limits, whichever order they come in.
        for src in [
            r#"{"model":"m","max_tokens":5,"max_completion_tokens":9}"#,
            r#"{"model":"m","max_completion_tokens":9,"max_tokens":5}"#,
        ] {
            let (_, r) = parse(src, "messages");
            assert_eq!((r.max_tokens, r.choices), (Some(9), 1));
        }
        // n and best_of multiply; 0 and null count as one.
        for (src, want) in [
            (r#"{"model":"m","n":3}"#, 3),
            (r#"{"model":"m","n":2,"best_of":5}"#, 5),
            (r#"{"model":"m","n":0}"#, 1),
            (r#"{"model":"m","n":null}"#, 1),
        ] {
            assert_eq!(parse(src, "prompt").1.choices, want, "{src}");
        }
        assert_eq!(
            parse_openai(&body(r#"{"model":"m","n":"3"}"#), "messages"),
            Err(ParseError::Field("n"))
        );
        assert_eq!(
            parse_openai(&body(r#"{"model":"m","n":1,"n":9}"#), "messages"),
            Err(ParseError::Duplicate("n"))
        );
        // The fields a template renders count by a quarter of their bytes
        // as sent.
        let tools = r#"[{"type":"function","function":{"name":"get_weather"}}]"#;
        let src = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"1234"}}],"tools":{tools},"functions":[]}}"#
        );
        let (_, r) = parse(&src, "messages");
        assert_eq!(
            r.prompt_tokens(4, 0),
            1 + (tools.len() as u64 + 2).div_ceil(4)
        );
        assert_eq!(r.prompt_tokens(1, 0), 4 + tools.len() as u64 + 2);

        // The chat template's tokens: per message, and once more for the
        // reply's header; only for chat messages, and none without any.
        let (_, r) = parse(
            r#"{"model":"m","messages":[{"role":"system","content":"12"},{"role":"user","content":[{"type":"text","text":"34"}]}]}"#,
            "messages",
        );
        assert_eq!(r.prompt.messages, 2);
        assert_eq!(r.prompt_tokens(1, 0), 4);
        assert_eq!(r.prompt_tokens(1, 5), 4 + 5 * 3);
        let (_, r) = parse(r#"{"model":"m","messages":[]}"#, "messages");
        assert_eq!(r.prompt_tokens(1, 5), 0, "no messages, no template");
        let (_, r) = parse(r#"{"model":"m","prompt":["ab","cd"]}"#, "prompt");
        assert_eq!((r.prompt.messages, r.prompt_tokens(1, 5)), (0, 4));
        let (_, r) = parse(r#"{"model":"m","input":["ab","cd"]}"#, "input");
        assert_eq!((r.prompt.messages, r.prompt_tokens(1, 5)), (0, 4));
        let (_, r) = parse(r#"{"model":"m","messages":"hi"}"#, "messages");
        assert_eq!(r.prompt.messages, 0, "a string is not a list of messages");
        let many = format!(r#"{{"model":"m","messages":[{}{{}}]}}"#, "{},".repeat(99));
        let (_, r) = parse(&many, "messages");
        assert_eq!(r.prompt_tokens(1, u64::MAX), u64::MAX, "saturates");

        // Every string a template renders counts: a message's name,
        // tool-call ids, names and arguments, a role of its own, keys
        // outside the format's words; the format's words do not.
        let big = "x".repeat(1000);
        for (message, counted) in [
            (
                serde_json::json!({"role": "user", "content": "ab", "name": big}),
                1002,
            ),
            (
                serde_json::json!({"role": "assistant", "content": null, "tool_calls": [
                    {"id": big, "type": "function", "function": {"name": "f", "arguments": big}}
                ]}),
                2001,
            ),
            (
                serde_json::json!({"role": "tool", "tool_call_id": big, "content": "ab"}),
                1002,
            ),
            (serde_json::json!({"role": big, "content": "ab"}), 1002),
            (serde_json::json!({"role": "user", "type": big}), 1000),
            // Arguments as an object: its keys, strings and numbers.
            (
                serde_json::json!({"role": "assistant", "tool_calls": [{"function": {"arguments": {big.clone(): 1, "b": true}}}]}),
                1001 + 2,
            ),
            (
                serde_json::json!({"role": "user", "content": "ab", big.clone(): "cd"}),
                1004,
            ),
        ] {
            let src = serde_json::json!({"model": "m", "messages": [message]}).to_string();
            let (_, r) = parse(&src, "messages");
            let ids = r.prompt.ids;
            assert_eq!(r.prompt.text_bytes + ids, counted, "{src}");
            assert_eq!(r.prompt_tokens(1, 0), counted, "{src}");
        }
        // Nesting deeper than 64 levels counts the bytes as sent.
        let deep = format!("{}\"{big}\"{}", "[".repeat(70), "]".repeat(70));
        let src = format!(r#"{{"model":"m","messages":{deep}}}"#);
        let (_, r) = parse(&src, "messages");
        assert!(r.prompt.text_bytes >= 1000, "{:?}", r.prompt);
        // The other fields a template renders count as sent.
        let src = format!(
            r#"{{"model":"m","documents":[{{"text":"{big}"}}],"chat_template":"{big}","chat_template_kwargs":{{"k":"{big}"}}}}"#
        );
        let (_, r) = parse(&src, "messages");
        assert!(r.prompt.tools_bytes > 3000, "{:?}", r.prompt);

        // Rendering with the limit reserved a choice sets max_tokens when
        // it is not a number: inserted when absent, replacing a null (a
        // server that reads only max_tokens, as llama.cpp does besides
        // n_predict, is bound too), left alone when given.
        let (b, r) = parse(r#"{"model":"m","messages":[]}"#, "messages");
        assert_eq!(r.max_tokens, None);
        let v: Value = serde_json::from_slice(&b.render("b", false, Some(7))).expect("json");
        assert_eq!(
            v,
            serde_json::json!({"max_tokens": 7, "model": "b", "messages": []})
        );
        let (b, _) = parse(
            r#"{"model":"m","max_tokens":null,"max_completion_tokens":null}"#,
            "messages",
        );
        let out = b.render("b", true, Some(7));
        assert_eq!(
            std::str::from_utf8(&out).expect("utf8"),
            r#"{"stream_options":{"include_usage":true},"model":"b","max_tokens":7,"max_completion_tokens":null}"#
        );
        for (src, limit, want) in [
            (
                r#"{"model":"m","max_tokens":3}"#,
                3,
                r#"{"model":"b","max_tokens":3}"#,
            ),
            (
                r#"{"model":"m","max_tokens":null,"max_completion_tokens":3}"#,
                3,
                r#"{"model":"b","max_tokens":3,"max_completion_tokens":3}"#,
            ),
            (
                r#"{"model":"m","max_completion_tokens":3}"#,
                3,
                r#"{"max_tokens":3,"model":"b","max_completion_tokens":3}"#,
            ),
            // llama.cpp's n_predict: -1 (no limit) becomes the limit; a
            // number counts like max_tokens.
            (
                r#"{"model":"m","n_predict":-1}"#,
                7,
                r#"{"max_tokens":7,"model":"b","n_predict":7}"#,
            ),
            (
                r#"{"model":"m","n_predict":-2,"max_tokens":4}"#,
                4,
                r#"{"model":"b","n_predict":4,"max_tokens":4}"#,
            ),
            (
                r#"{"model":"m","n_predict":40,"max_tokens":4}"#,
                40,
                r#"{"model":"b","n_predict":40,"max_tokens":4}"#,
            ),
            (
                r#"{"model":"m","max_new_tokens":40}"#,
                40,
                r#"{"max_tokens":40,"model":"b","max_new_tokens":40}"#,
            ),
        ] {
            let (b, r) = parse(src, "messages");
            assert_eq!(r.max_tokens.unwrap_or(limit), limit, "{src}");
            let out = b.render("b", false, Some(limit));
            assert_eq!(std::str::from_utf8(&out).expect("utf8"), want, "{src}");
        }
        // The largest length limit is the one reserved, whichever a
        // server reads; min_tokens is read for the gateway to check.
        let (_, r) = parse(
            r#"{"model":"m","max_tokens":5,"n_predict":11,"max_new_tokens":9,"min_tokens":2}"#,
            "messages",
        );
        assert_eq!((r.max_tokens, r.min_tokens), (Some(11), Some(2)));
        for (src, e) in [
            (
                r#"{"model":"m","max_new_tokens":-1}"#,
                ParseError::Count("max_new_tokens"),
            ),
            (
                r#"{"model":"m","min_tokens":1.5}"#,
                ParseError::Count("min_tokens"),
            ),
            (
                r#"{"model":"m","n_predict":"all"}"#,
                ParseError::Field("n_predict"),
            ),
            (
                r#"{"model":"m","n_predict":1.5}"#,
                ParseError::Field("n_predict"),
            ),
            (
                r#"{"model":"m","n_predict":1,"n_predict":-1}"#,
                ParseError::Duplicate("n_predict"),
            ),
            (
                r#"{"model":"m","max_new_tokens":1,"max_new_tokens":9}"#,
                ParseError::Duplicate("max_new_tokens"),
            ),
        ] {
            assert_eq!(parse_openai(&body(src), "messages"), Err(e), "{src}");
        }
        assert_eq!(
            parse_openai(
                &body(r#"{"model":"m","max_tokens":1,"max_tokens":null}"#),
                "messages"
            ),
            Err(ParseError::Duplicate("max_tokens"))
        );
    }

    #[test]
    fn rendering_splices_only_what_changes() {
        let src = r#" { "temperature" : 0.5, "model": "public\u002dname", "messages":[{"role":"user","content":"hi"}], "x": {"model": "inner"} } "#;
        let (b, r) = parse_openai(&body(src), "messages").expect("ok");
        assert_eq!(r.model, "public-name");
        let out = b.render("backend/\"quoted\"", false, None);
        assert_eq!(
            std::str::from_utf8(&out).expect("utf8"),
            r#" { "temperature" : 0.5, "model": "backend/\"quoted\"", "messages":[{"role":"user","content":"hi"}], "x": {"model": "inner"} } "#
        );
        let v: Value = serde_json::from_slice(&b.render("b", true, None)).expect("json");
        assert_eq!(
            v["stream_options"],
            serde_json::json!({"include_usage": true})
        );
        assert_eq!(v["model"], "b");
        assert_eq!(v["x"]["model"], "inner");

        for (so, want) in [
            (r#"null"#, serde_json::json!({"include_usage": true})),
            (
                r#"{"include_usage": false, "other": 1}"#,
                serde_json::json!({"include_usage": true, "other": 1}),
            ),
        ] {
            let src = format!(r#"{{"stream":true,"stream_options":{so},"model":"m"}}"#);
            let (b, _) = parse_openai(&body(&src), "messages").expect("ok");
            let v: Value = serde_json::from_slice(&b.render("b", true, None)).expect("json");
            assert_eq!(v["stream_options"], want, "{src}");
            assert_eq!(v["model"], "b");
            let v: Value = serde_json::from_slice(&b.render("b", false, None)).expect("json");
            assert_eq!(v, {
                let mut o: Value = serde_json::from_str(&src).expect("json");
                o["model"] = "b".into();
                o
            });
        }
    }

    #[test]
    fn fields_the_gateway_reads_may_not_repeat() {
        for (src, field) in [
            (r#"{"model":"a","model":"b"}"#, "model"),
            (r#"{"model":"a","mod\u0065l":"b"}"#, "model"),
            (r#"{"model":"a","stream":true,"stream":false}"#, "stream"),
            (
                r#"{"model":"a","max_tokens":1,"max_tokens":2}"#,
                "max_tokens",
            ),
            (r#"{"model":"a","messages":[],"messages":[]}"#, "messages"),
        ] {
            assert_eq!(
                parse_openai(&body(src), "messages"),
                Err(ParseError::Duplicate(field)),
                "{src}"
            );
        }
        // Fields passed through untouched may repeat: the backend decides.
        assert!(parse_openai(&body(r#"{"model":"a","user":"x","user":"y"}"#), "messages").is_ok());
        assert!(matches!(
            parse_openai(&body(r#"{"model":"a"} x"#), "messages"),
            Err(ParseError::Json(_))
        ));
        assert_eq!(
            parse_openai(&body(" 1 "), "messages"),
            Err(ParseError::NotObject)
        );
        assert_eq!(
            parse_openai(&body("{}"), "messages"),
            Err(ParseError::Model)
        );
    }

    fn json_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(Value::from),
            "\\PC{0,12}".prop_map(Value::from),
            prop_oneof![Just("user"), Just("tool"), Just("text"), Just("function")]
                .prop_map(Value::from),
        ];
        leaf.prop_recursive(6, 48, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                proptest::collection::vec(
                    (
                        prop_oneof![
                            Just("content".to_owned()),
                            Just("text".to_owned()),
                            Just("role".to_owned()),
                            Just("type".to_owned()),
                            Just("name".to_owned()),
                            Just("arguments".to_owned()),
                            "[a-z]{1,6}"
                        ],
                        inner
                    ),
                    0..6
                )
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #[test]
        fn parsing_never_panics(body in proptest::collection::vec(any::<u8>(), 0..512), path in "[/a-z0-9{}._-]{0,40}") {
            let _ = parse_openai(&Bytes::from(body), "messages");
            let _ = route(&Method::POST, &path);
            let _ = route(&Method::GET, &format!("/v2/models/{path}"));
        }

        #[test]
        fn streaming_estimate_matches_the_value_rule(prompt in json_value(), field in prop_oneof![Just("messages"), Just("prompt"), Just("input")]) {
            let body = serde_json::json!({"model": "m", field: prompt.clone()});
            let bytes = Bytes::from(serde_json::to_vec(&body).expect("json"));
            let (b, r) = parse_openai(&bytes, field).expect("parses");
            prop_assert_eq!(r.prompt_tokens(4, 0), estimate_tokens(&prompt));
            prop_assert_eq!(b.render("m", false, None), bytes, "the same model name gives the same bytes");
        }

        #[test]
        fn json_bodies_never_panic(model in "\\PC{0,20}", content in "\\PC{0,64}", mt in any::<i64>(), stream in any::<bool>()) {
            let body = serde_json::json!({"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": mt, "stream": stream});
            let bytes = serde_json::to_vec(&body).expect("json");
            if let Ok((_, r)) = parse_openai(&Bytes::from(bytes), "messages") {
                prop_assert_eq!(r.prompt_tokens(4, 0), (content.len() as u64).div_ceil(4));
                prop_assert_eq!(r.max_tokens, u64::try_from(mt).ok());
            }
        }
    }
}
