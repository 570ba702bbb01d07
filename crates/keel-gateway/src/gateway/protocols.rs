//! The two inference protocols' request handlers: OpenAI-compatible
//! routes and Open Inference Protocol v2.

use super::*;

impl Gateway {
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn openai(
        &self,
        gen: &Arc<Generation>,
        req: Request<Incoming>,
        route: Route,
        op: &'static str,
        ident: Identity,
        ctx: &mut Ctx,
        started: Instant,
    ) -> Result<(Response<GwBody>, bool), Fail> {
        let (parts, body) = req.into_parts();
        let s = &gen.cfg.server;
        // What can be decided without the body is decided before it is
        // read: the operation (the model is in the body) and the request
        // limit of a large body.
        if !gen.rbac.allows(&ident.roles, op, None) {
            ctx.denied = Some("forbidden");
            let e = ApiError::forbidden(format!("your roles do not allow {op}"));
            return Err(self.refuse(gen, &ident, ctx, e).await);
        }
        self.requests_left(gen, &ident, &body, ctx).await?;
        let (bytes, _held) = read_body(
            body,
            &parts.headers,
            s.max_body_bytes,
            Duration::from_millis(s.body_timeout_ms),
            self.body_room(gen),
        )
        .await?;
        let (body, parsed) = match request::parse_openai(&bytes, request::prompt_field(&route)) {
            Ok(p) => p,
            Err(e) => {
                let e = ApiError::bad_request(e.to_string());
                return Err(self.refuse(gen, &ident, ctx, e).await);
            }
        };
        // Looked up before the roles are checked, answered after them (a
        // caller without the role learns nothing about what exists).
        let model = self.model_route(gen, &parsed.model, Protocol::Openai);
        ctx.model_configured = model.is_some();
        ctx.model = Some(parsed.model.clone());
        ctx.stream = parsed.stream;
        ctx.prompt_estimate = parsed.prompt_tokens(
            gen.cfg.limits.prompt_bytes_per_token,
            gen.cfg.limits.prompt_tokens_per_message,
        );
        if gen.cfg.audit.include_content {
            ctx.request_body = Some(bytes.clone());
        }
        if !gen.rbac.allows(&ident.roles, op, Some(&parsed.model)) {
            ctx.denied = Some("forbidden");
            let e = ApiError::forbidden(format!(
                "your roles do not allow {op} on {:?}",
                reflect(&parsed.model)
            ));
            return Err(self.refuse(gen, &ident, ctx, e).await);
        }
        let Some(model) = model else {
            let e = no_such_model(&parsed.model);
            return Err(self.refuse(gen, &ident, ctx, e).await);
        };
        // The reservation is an upper bound on what the backend may
        // generate: a choice may use the largest length limit the body
        // gives (`default_max_tokens` when it gives none), the body is sent
        // with `max_tokens` and any negative `n_predict` set to that, and
        // each of the `n` (or `best_of`) completions may use all of it.
        // Saturating: these are the client's numbers.
        let (tokens, bound) = match route {
            Route::Embeddings => (ctx.prompt_estimate, None),
            _ => {
                let per_choice = parsed
                    .max_tokens
                    .unwrap_or(gen.cfg.limits.default_max_tokens);
                if let Some(min) = parsed.min_tokens.filter(|m| *m > per_choice) {
                    let e = ApiError::bad_request(format!(
                        "min_tokens ({min}) is more than the completion's limit ({per_choice}): \
                         give max_tokens of at least min_tokens"
                    ));
                    return Err(self.refuse(gen, &ident, ctx, e).await);
                }
                (
                    ctx.prompt_estimate
                        .saturating_add(per_choice.saturating_mul(parsed.choices)),
                    Some(per_choice),
                )
            }
        };
        let reservation = self.admit(gen, &ident, tokens, ctx).await?;
        let strip = parsed.stream && !parsed.include_usage;
        let path = route.template();
        let payload = Payload::OpenAi {
            path,
            body,
            force_usage: strip,
            max_tokens: bound,
        };
        let pin = parts
            .headers
            .get(s.pin_header.as_str())
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let served = match self
            .forward(gen, &model, pin.as_deref(), &payload, (&ident, op), ctx)
            .await
        {
            Ok(s) => s,
            Err(f) => {
                self.settle(reservation.as_ref(), 0).await;
                return Err(f);
            }
        };
        let is_sse = served
            .resp
            .headers()
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        if parsed.stream && served.resp.status().is_success() && is_sse {
            return Ok((
                self.stream(gen, served, strip, reservation, ctx.clone(), started),
                true,
            ));
        }
        self.deliver(gen, served, reservation.as_ref(), ctx, Summary::Answer)
            .await
            .map(|r| (r, false))
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) async fn oip(
        &self,
        gen: &Arc<Generation>,
        req: Request<Incoming>,
        m: OipModel,
        op: &'static str,
        action: &'static str,
        ident: Identity,
        ctx: &mut Ctx,
    ) -> Result<Response<GwBody>, Fail> {
        let model = self.model_route(gen, &m.name, Protocol::Oip);
        ctx.model_configured = model.is_some();
        ctx.model = Some(m.name.clone());
        if !gen.rbac.allows(&ident.roles, op, Some(&m.name)) {
            ctx.denied = Some("forbidden");
            let e = ApiError::forbidden(format!(
                "your roles do not allow {op} on {:?}",
                reflect(&m.name)
            ));
            return Err(self.refuse(gen, &ident, ctx, e).await);
        }
        let Some(model) = model else {
            let e = no_such_model(&m.name);
            return Err(self.refuse(gen, &ident, ctx, e).await);
        };
        let (parts, body) = req.into_parts();
        let s = &gen.cfg.server;
        let (bytes, _held) = if action == "/infer" {
            self.requests_left(gen, &ident, &body, ctx).await?;
            let (b, held) = read_body(
                body,
                &parts.headers,
                s.max_body_bytes,
                Duration::from_millis(s.body_timeout_ms),
                self.body_room(gen),
            )
            .await?;
            (b, Some(held))
        } else {
            (Bytes::new(), None)
        };
        if action == "/infer" {
            match serde_json::from_slice::<Value>(&bytes) {
                Ok(v) if v.is_object() => {
                    if self.inner.drift.watches(&m.name) {
                        ctx.oip_inputs = Some(Box::new(crate::drift::oip_inputs(&v)));
                    }
                }
                _ => {
                    let e = ApiError::bad_request("the inference request must be a JSON object");
                    return Err(self.refuse(gen, &ident, ctx, e).await);
                }
            }
        }
        if gen.cfg.audit.include_content && !bytes.is_empty() {
            ctx.request_body = Some(bytes.clone());
        }
        // Metadata and readiness calls reach the backend too: they count
        // against the request limits like inference (no tokens).
        let reservation = self.admit(gen, &ident, 0, ctx).await?;
        let payload = Payload::Oip {
            method: parts.method.clone(),
            version: m.version.clone(),
            action,
            body: bytes,
            content_type: parts.headers.get(http::header::CONTENT_TYPE).cloned(),
        };
        let pin = parts
            .headers
            .get(s.pin_header.as_str())
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let served = self
            .forward(gen, &model, pin.as_deref(), &payload, (&ident, op), ctx)
            .await?;
        let summary = if action == "/infer" {
            Summary::OipOutput
        } else {
            Summary::Nothing
        };
        self.deliver(gen, served, reservation.as_ref(), ctx, summary)
            .await
    }
}
