//! Admission: reading a request body within its limit and the body
//! budget, the limit scopes a caller is held to, reserving and settling
//! its requests and tokens, and the rate-limit headers.

use super::*;

pub(super) enum BodyError {
    TooLarge,
    Timeout,
    Broken,
    /// The gateway's body budget has no room.
    Budget,
}

/// Where a request body's bytes are counted: the gateway's budget and its
/// limit (`server.max_body_bytes_in_flight`).
pub(super) struct BodyRoom<'a> {
    budget: &'a BodyBudget,
    limit: usize,
}

/// Reads a request body of at most `limit` bytes within `timeout`,
/// counting it in the body budget: a declared length is taken from the
/// budget before a byte is read, a body without one as it arrives.
pub(super) async fn read_body(
    body: Incoming,
    headers: &HeaderMap,
    limit: usize,
    timeout: Duration,
    room: BodyRoom<'_>,
) -> Result<(Bytes, BodyPermit), ApiError> {
    let declared = headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large(limit));
    }
    let declared = declared.map_or(0, |n| n as usize);
    let Some(mut permit) = room.budget.take(declared, room.limit) else {
        return Err(no_room());
    };
    let read = tokio::time::timeout(
        timeout,
        collect_limited(body, limit, Some((&mut permit, room.limit))),
    )
    .await
    .unwrap_or(Err(BodyError::Timeout));
    match read {
        Ok(b) => Ok((b, permit)),
        Err(BodyError::TooLarge) => Err(too_large(limit)),
        Err(BodyError::Budget) => Err(no_room()),
        Err(BodyError::Timeout) => Err(ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            "the request body did not arrive in time",
        )),
        Err(BodyError::Broken) => Err(ApiError::bad_request("the request body could not be read")),
    }
}

/// 503: the bodies in flight fill `server.max_body_bytes_in_flight`.
pub(super) fn no_room() -> ApiError {
    ApiError::unavailable(
        "the gateway holds as many request and response bytes as it may; retry later",
        Some(1),
    )
}

pub(super) fn too_large(limit: usize) -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "invalid_request_error",
        format!("the request body is larger than {limit} bytes"),
    )
}

/// A whole body of at most `limit` bytes; one that came in one piece (the
/// usual case) is passed on as it is, without a copy. With a permit, bytes
/// beyond what it holds are taken from the budget as they arrive.
pub(super) async fn collect_limited<B>(
    body: B,
    limit: usize,
    mut permit: Option<(&mut BodyPermit, usize)>,
) -> Result<Bytes, BodyError>
where
    B: http_body::Body<Data = Bytes>,
{
    if body.size_hint().lower() > limit as u64 {
        return Err(BodyError::TooLarge);
    }
    // A declared length (at most `limit`, checked above) sizes the buffer
    // once, so a body in pieces is not copied again as it grows.
    let exact = body.size_hint().exact().map(|n| n as usize);
    let mut body = std::pin::pin!(body);
    let mut first: Option<Bytes> = None;
    let mut more: Option<bytes::BytesMut> = None;
    let mut total = 0usize;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.map_err(|_| BodyError::Broken)?.into_data() else {
            continue; // trailers
        };
        total += data.len();
        if total > limit {
            return Err(BodyError::TooLarge);
        }
        if let Some((p, room)) = &mut permit {
            if total > p.held() && !p.grow(total - p.held(), *room) {
                return Err(BodyError::Budget);
            }
        }
        if let Some(m) = &mut more {
            m.extend_from_slice(&data);
        } else if let Some(f) = first.take() {
            let mut m = bytes::BytesMut::with_capacity(
                exact.map_or(total.max(f.len() * 2), |n| n.max(total)),
            );
            m.extend_from_slice(&f);
            m.extend_from_slice(&data);
            more = Some(m);
        } else {
            first = Some(data);
        }
    }
    Ok(match more {
        Some(m) => m.freeze(),
        None => first.unwrap_or_default(),
    })
}

/// The counters a caller is held to: its key's (or the default) limits,
/// and its team's when the team has limits.
pub fn scopes_for(l: &LimitsConfig, id: &Identity) -> Vec<Scope> {
    let own = l.keys.get(&*id.id).copied().unwrap_or(l.default);
    let team = id
        .team
        .as_ref()
        .zip(id.team_scope.as_ref())
        .and_then(|(t, name)| {
            l.teams
                .get(&**t)
                .filter(|tl| !tl.is_empty())
                .map(|tl| Scope {
                    name: name.clone(),
                    limits: *tl,
                })
        });
    let mut v = Vec::with_capacity(usize::from(!own.is_empty()) + usize::from(team.is_some()));
    if !own.is_empty() {
        v.push(Scope {
            name: id.key_scope.clone(),
            limits: own,
        });
    }
    v.extend(team);
    v
}

pub(super) fn rate_headers(h: &mut HeaderMap, info: &RateInfo) {
    use http::header::HeaderName;
    const LIMIT_REQUESTS: HeaderName = HeaderName::from_static("x-ratelimit-limit-requests");
    const REMAINING_REQUESTS: HeaderName =
        HeaderName::from_static("x-ratelimit-remaining-requests");
    const RESET_REQUESTS: HeaderName = HeaderName::from_static("x-ratelimit-reset-requests");
    const LIMIT_TOKENS: HeaderName = HeaderName::from_static("x-ratelimit-limit-tokens");
    const REMAINING_TOKENS: HeaderName = HeaderName::from_static("x-ratelimit-remaining-tokens");
    const RESET_TOKENS: HeaderName = HeaderName::from_static("x-ratelimit-reset-tokens");
    let reset = reset_header_value;
    if let Some(l) = info.limit_requests {
        h.insert(LIMIT_REQUESTS, HeaderValue::from(l));
        h.insert(
            REMAINING_REQUESTS,
            HeaderValue::from(info.remaining_requests),
        );
        if let Some(v) = reset(info.reset_requests_ms) {
            h.insert(RESET_REQUESTS, v);
        }
    }
    if let Some(l) = info.limit_tokens {
        h.insert(LIMIT_TOKENS, HeaderValue::from(l));
        h.insert(REMAINING_TOKENS, HeaderValue::from(info.remaining_tokens));
        if let Some(v) = reset(info.reset_tokens_ms) {
            h.insert(RESET_TOKENS, v);
        }
    }
}

impl Gateway {
    pub(super) async fn admit(
        &self,
        gen: &Generation,
        ident: &Identity,
        tokens: u64,
        ctx: &mut Ctx,
    ) -> Result<Option<Reservation>, ApiError> {
        let scopes = scopes_for(&gen.cfg.limits, ident);
        if scopes.is_empty() {
            return Ok(None);
        }
        match self.inner.limiter.reserve(&scopes, tokens).await {
            Err(e) => {
                tracing::error!(error = %e, "limit store unavailable; refusing");
                ctx.error = Some(e.to_string());
                ctx.denied = Some("limits_unavailable");
                Err(ApiError::unavailable(
                    "limits cannot be checked right now",
                    Some(1),
                ))
            }
            Ok(Admission::Admitted { reservation, info }) => {
                ctx.rate = Some(info);
                Ok(Some(reservation))
            }
            Ok(Admission::Refused {
                refusal,
                retry_after_ms,
                info,
            }) => {
                ctx.rate = Some(info);
                let retry = Some(retry_after_s(retry_after_ms));
                Err(match refusal {
                    Refusal::Rate => {
                        ctx.denied = Some("rate_limited");
                        ApiError {
                            retry_after_s: retry,
                            ..ApiError::new(
                                StatusCode::TOO_MANY_REQUESTS,
                                "rate_limit_exceeded",
                                "rate limit reached for requests or tokens per minute",
                            )
                        }
                    }
                    Refusal::Quota => {
                        ctx.denied = Some("quota_exhausted");
                        ApiError {
                            retry_after_s: retry,
                            ..ApiError::new(
                                StatusCode::FORBIDDEN,
                                "insufficient_quota",
                                "token quota for this period is used up",
                            )
                        }
                    }
                })
            }
        }
    }

    /// Answers an authenticated request refused before admission (a
    /// denial, an unknown model or route, a body that does not parse):
    /// the refusal counts one request, no tokens, against the caller's
    /// limits, so refusals are not free; once those are used up the
    /// caller gets the limit's own refusal (429) instead.
    pub(super) async fn refuse(
        &self,
        gen: &Generation,
        ident: &Identity,
        ctx: &mut Ctx,
        e: ApiError,
    ) -> Fail {
        match self.admit(gen, ident, 0, ctx).await {
            Ok(_) => e.into(),
            Err(limit) => limit.into(),
        }
    }

    pub(super) fn body_room<'a>(&'a self, gen: &Generation) -> BodyRoom<'a> {
        BodyRoom {
            budget: &self.inner.bodies,
            limit: gen.cfg.server.max_body_bytes_in_flight,
        }
    }

    /// Refuses (429) a request whose body is large or of unknown length
    /// when a scope of the caller has no requests left in its window, so
    /// that the body is not read only to be refused. Admission after the
    /// body still decides; this check takes nothing and reserves nothing,
    /// and is skipped for small bodies, which cost little to read (one
    /// look-up fewer for them, a Redis round trip with `redis_url`). When
    /// the store cannot answer, admission decides.
    pub(super) async fn requests_left(
        &self,
        gen: &Generation,
        ident: &Identity,
        body: &Incoming,
        ctx: &mut Ctx,
    ) -> Result<(), ApiError> {
        use http_body::Body as _;
        if body
            .size_hint()
            .exact()
            .is_some_and(|n| n <= PRECHECK_BODY_BYTES)
        {
            return Ok(());
        }
        for scope in scopes_for(&gen.cfg.limits, ident) {
            let Some(rpm) = scope.limits.requests_per_minute else {
                continue;
            };
            let Ok(used) = self.inner.limiter.usage(&scope.name).await else {
                return Ok(());
            };
            if used.requests < rpm {
                continue;
            }
            let reset_ms =
                (used.window_start_ms + WINDOW_MS).saturating_sub(self.inner.clock.now_ms());
            ctx.denied = Some("rate_limited");
            ctx.rate = Some(RateInfo {
                limit_requests: Some(rpm),
                remaining_requests: 0,
                reset_requests_ms: reset_ms,
                ..RateInfo::default()
            });
            return Err(ApiError {
                retry_after_s: Some(retry_after_s(reset_ms)),
                ..ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "rate_limit_exceeded",
                    "rate limit reached for requests per minute",
                )
            });
        }
        Ok(())
    }

    pub(super) async fn settle(&self, res: Option<&Reservation>, actual: u64) {
        if let Some(r) = res {
            if let Err(e) = self.inner.limiter.settle(r, actual).await {
                tracing::error!(error = %e, "could not settle a reservation; it stays charged");
            }
        }
    }
}
