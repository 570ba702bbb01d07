//! Forwarding to a deployment (retries, fallbacks, circuits, the
//! connection pool) and mirroring a share of the traffic.

use super::*;

impl Gateway {
    /// Tries the candidates in order within the retry limit and budget.
    /// `caller` is who asks and for which operation: a fallback model its
    /// roles do not allow is skipped, and pinning a deployment outside the
    /// traffic split needs the `pin` operation.
    pub(super) async fn forward(
        &self,
        gen: &Generation,
        model: &Arc<ModelRoute>,
        pin: Option<&str>,
        payload: &Payload,
        caller: (&Identity, &'static str),
        ctx: &mut Ctx,
    ) -> Result<Served, Fail> {
        let (ident, op) = caller;
        if let Some(p) = pin {
            let serving = model
                .deployments
                .iter()
                .any(|d| *d.name == *p && d.weight > 0);
            if !serving && !gen.rbac.allows(&ident.roles, "pin", Some(&model.name)) {
                // The same answer whether or not such a deployment exists.
                ctx.denied = Some("forbidden");
                return Err(ApiError::forbidden(format!(
                    "pinning {:?}: a deployment outside {:?}'s traffic split (weight 0, \
                     the mirror, or no such name) can be pinned only with a role that \
                     allows the `pin` operation",
                    reflect(p),
                    model.name
                ))
                .into());
            }
        }
        let mut cands = gen
            .traffic
            .candidates(model, pin, &self.inner.rng)
            .map_err(ApiError::bad_request)?;
        // A fallback model is served only to callers allowed to use it.
        cands.retain(|c| !c.fallback || gen.rbac.allows(&ident.roles, op, Some(&c.model)));
        let start = Instant::now();
        self.inner.budget.record_request(start);
        if pin.is_none() {
            if let Some((shadow, pct)) = &model.mirror {
                if self.inner.rng.unit() * 100.0 < *pct {
                    self.mirror(gen, model, shadow.clone(), payload, ctx.id);
                }
            }
        }
        let retries = gen.cfg.traffic.retries;
        let timeout = gen.cfg.traffic.timeout();
        let mut sent = 0u32;
        let mut soonest: Option<Instant> = None;
        let mut last_fail: Option<Fail> = None;
        for c in cands {
            let now = Instant::now();
            if sent > 0 && (sent > retries || !self.inner.budget.has_retry(now)) {
                break;
            }
            let backend = c.deployment.backend.clone();
            let Some(permit) = backend.try_acquire(now) else {
                if let Some(u) = backend.open_until(now) {
                    soonest = Some(soonest.map_or(u, |s| s.min(u)));
                }
                continue;
            };
            let lease = Lease {
                backend: &backend,
                permit,
                who: &ident.id,
                done: false,
            };
            if sent > 0 {
                self.inner.budget.take_retry(now);
                self.inner.metrics.retry(&model.name);
                ctx.retries += 1;
            }
            sent += 1;
            let (method, path, body, ct) = payload.render(&c.deployment.backend_model);
            let uri = match backend.url.request_uri(&path) {
                Ok(u) => u,
                Err(e) => {
                    // A model or version name that makes no URI: the
                    // request's fault, not the backend's.
                    drop(lease);
                    return Err(
                        ApiError::bad_request(format!("cannot address the backend: {e}")).into(),
                    );
                }
            };
            let headers = upstream_headers(backend.url.host.as_ref(), ct.as_ref(), ctx.id);
            let sent_at = Instant::now();
            match self
                .inner
                .upstream
                .send(method, uri, headers, body, timeout)
                .await
            {
                Ok(resp)
                    if resp.status().is_server_error()
                        || resp.status() == StatusCode::TOO_MANY_REQUESTS =>
                {
                    // Retried either way; only the configured statuses
                    // (502, 503, 504 by default) count against the
                    // circuit: a 500 or 429 that the input provoked says
                    // the backend is up.
                    let ra = retry_after(resp.headers());
                    let failed = backend.is_failure(resp.status().as_u16());
                    lease.done(!failed, ra.filter(|_| failed));
                    let status = resp.status();
                    let ct = resp.headers().get(http::header::CONTENT_TYPE).cloned();
                    let body = read_limited(resp.into_body(), 64 << 10, timeout)
                        .await
                        .unwrap_or_default();
                    ctx.error = Some(format!(
                        "{}: {} answered {status}",
                        c.model, c.deployment.name
                    ));
                    if status.is_server_error() {
                        self.failed_sample(&c.model, &c.deployment.name, sent_at);
                    }
                    last_fail = Some(Fail::Upstream(status, ct, body, ra));
                }
                Ok(resp) => {
                    lease.done(true, None);
                    if c.fallback {
                        self.inner.metrics.fallback(&model.name, &c.model);
                        ctx.fallback = true;
                    }
                    ctx.served_model = Some(c.model.clone());
                    ctx.deployment = Some(c.deployment.name.clone());
                    ctx.served_headers =
                        c.model_header.clone().zip(c.deployment.name_header.clone());
                    return Ok(Served { resp, sent_at });
                }
                Err(e) => {
                    lease.done(false, None);
                    tracing::warn!(model = %c.model, deployment = %c.deployment.name, error = %e, "backend failed");
                    ctx.error = Some(format!("{}: {}: {e}", c.model, c.deployment.name));
                    self.failed_sample(&c.model, &c.deployment.name, sent_at);
                    last_fail = None;
                }
            }
        }
        ctx.backend_time = Some(start.elapsed());
        if let Some(f) = last_fail {
            return Err(f);
        }
        let retry = soonest.map(|u| {
            u.saturating_duration_since(Instant::now())
                .as_secs_f64()
                .ceil()
                .max(1.0) as u64
        });
        Err(ApiError::unavailable(
            format!(
                "no deployment of {:?} can serve the request now",
                model.name
            ),
            retry.or(Some(1)),
        )
        .into())
    }

    /// Sends a copy to the shadow deployment and throws the answer away;
    /// never charged to the caller's limits.
    pub(super) fn mirror(
        &self,
        gen: &Generation,
        model: &ModelRoute,
        shadow: crate::traffic::Deployment,
        payload: &Payload,
        id: RequestId,
    ) {
        let (method, path, body, ct) = payload.render(&shadow.backend_model);
        let headers = upstream_headers(shadow.backend.url.host.as_ref(), ct.as_ref(), id);
        let upstream = self.inner.upstream.clone();
        let timeout = gen.cfg.traffic.timeout();
        let gw = self.clone();
        let model = model.name.clone();
        let guard = TaskGuard::new(&self.inner);
        tokio::spawn(async move {
            let _guard = guard;
            let backend = shadow.backend.clone();
            let sent = async {
                let uri = backend.url.request_uri(&path)?;
                upstream.send(method, uri, headers, body, timeout).await
            };
            let outcome = match sent.await {
                Ok(r) => {
                    let ok = r.status().is_success();
                    let _ = read_limited(r.into_body(), 64 << 20, timeout).await;
                    if ok {
                        "ok"
                    } else {
                        "error"
                    }
                }
                Err(_) => "error",
            };
            gw.inner.metrics.mirrored(&model, &shadow.name, outcome);
        });
    }
}
