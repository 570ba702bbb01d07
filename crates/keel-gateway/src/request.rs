//! Parsing what clients send: the route a method and path name, and the
//! parts of an OpenAI-style body the gateway needs (model, streaming, token
//! estimate). Everything here takes untrusted bytes and must never panic;
//! a proptest and the `request` fuzz target hold it to that.

use http::Method;
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
    /// `max_completion_tokens`, else `max_tokens`.
    pub max_tokens: Option<u64>,
    /// Prompt tokens estimated as a quarter of the prompt's bytes.
    pub prompt_estimate: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error("the body is not valid JSON: {0}")]
    Json(String),
    #[error("the body must be a JSON object")]
    NotObject,
    #[error("`model` must be a non-empty string")]
    Model,
    #[error("`{0}` has the wrong type")]
    Field(&'static str),
}

/// Which field holds the prompt for each route.
pub fn prompt_field(r: &Route) -> &'static str {
    match r {
        Route::ChatCompletions => "messages",
        Route::Completions => "prompt",
        _ => "input",
    }
}

/// Parses an OpenAI-style body into its JSON object and the fields the
/// gateway needs.
pub fn parse_openai(
    body: &[u8],
    prompt_field: &str,
) -> Result<(Map<String, Value>, OpenAiRequest), ParseError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| ParseError::Json(e.to_string()))?;
    let Value::Object(obj) = v else {
        return Err(ParseError::NotObject);
    };
    let model = match obj.get("model") {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        _ => return Err(ParseError::Model),
    };
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ParseError::Field("stream")),
    };
    let include_usage = match obj.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => match o.get("include_usage") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err(ParseError::Field("stream_options.include_usage")),
        },
        Some(_) => return Err(ParseError::Field("stream_options")),
    };
    let mut max_tokens = None;
    for f in ["max_tokens", "max_completion_tokens"] {
        match obj.get(f) {
            None | Some(Value::Null) => {}
            Some(Value::Number(n)) => match n.as_u64() {
                Some(n) => max_tokens = Some(n),
                None => {
                    return Err(ParseError::Field(if f == "max_tokens" {
                        "max_tokens"
                    } else {
                        "max_completion_tokens"
                    }))
                }
            },
            Some(_) => {
                return Err(ParseError::Field(if f == "max_tokens" {
                    "max_tokens"
                } else {
                    "max_completion_tokens"
                }))
            }
        }
    }
    let prompt_estimate = obj.get(prompt_field).map_or(0, estimate_tokens);
    Ok((
        obj,
        OpenAiRequest {
            model,
            stream,
            include_usage,
            max_tokens,
            prompt_estimate,
        },
    ))
}

/// Tokens in a prompt, estimated as a quarter of its text bytes rounded
/// up (token-id arrays count one token per id). The test backend reports
/// prompt tokens by the same rule, so tests can assert exact accounting.
pub fn estimate_tokens(v: &Value) -> u64 {
    fn walk(v: &Value, bytes: &mut u64, ids: &mut u64, depth: u32) {
        if depth > 64 {
            return;
        }
        match v {
            Value::String(s) => *bytes += s.len() as u64,
            Value::Number(_) => *ids += 1,
            Value::Array(a) => a.iter().for_each(|x| walk(x, bytes, ids, depth + 1)),
            Value::Object(o) => {
                for (k, x) in o {
                    if k == "content" || k == "text" || depth == 0 {
                        walk(x, bytes, ids, depth + 1);
                    } else if let Value::Array(_) | Value::Object(_) = x {
                        walk(x, bytes, ids, depth + 1);
                    }
                }
            }
            _ => {}
        }
    }
    let (mut bytes, mut ids) = (0, 0);
    walk(v, &mut bytes, &mut ids, 0);
    bytes.div_ceil(4) + ids
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

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
        let (_, r) = parse_openai(
            br#"{"model":"m","messages":[{"role":"user","content":"12345678"}],"stream":true,"max_tokens":10}"#,
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
                prompt_estimate: 2
            }
        );
        let (_, r) = parse_openai(
            br#"{"model":"m","prompt":[1,2,3],"stream_options":{"include_usage":true}}"#,
            "prompt",
        )
        .expect("ok");
        assert_eq!((r.prompt_estimate, r.include_usage), (3, true));
        assert!(matches!(
            parse_openai(b"{", "messages"),
            Err(ParseError::Json(_))
        ));
        assert_eq!(parse_openai(b"[]", "messages"), Err(ParseError::NotObject));
        assert_eq!(
            parse_openai(br#"{"model":1}"#, "messages"),
            Err(ParseError::Model)
        );
        assert_eq!(
            parse_openai(br#"{"model":"m","stream":"yes"}"#, "messages"),
            Err(ParseError::Field("stream"))
        );
        assert_eq!(
            parse_openai(br#"{"model":"m","max_tokens":-1}"#, "messages"),
            Err(ParseError::Field("max_tokens"))
        );
    }

    proptest! {
        #[test]
        fn parsing_never_panics(body in proptest::collection::vec(any::<u8>(), 0..512), path in "[/a-z0-9{}._-]{0,40}") {
            let _ = parse_openai(&body, "messages");
            let _ = route(&Method::POST, &path);
            let _ = route(&Method::GET, &format!("/v2/models/{path}"));
        }

        #[test]
        fn json_bodies_never_panic(model in "\\PC{0,20}", content in "\\PC{0,64}", mt in any::<i64>(), stream in any::<bool>()) {
            let body = serde_json::json!({"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": mt, "stream": stream});
            let bytes = serde_json::to_vec(&body).expect("json");
            if let Ok((_, r)) = parse_openai(&bytes, "messages") {
                prop_assert_eq!(r.prompt_estimate, (content.len() as u64).div_ceil(4));
                prop_assert_eq!(r.max_tokens, u64::try_from(mt).ok());
            }
        }
    }
}
