//! Delivering a backend's answer: a whole body read and summarised, or a
//! stream handed to the client event by event and settled at its end.

use super::*;

impl Gateway {
    /// Reads a whole backend response, settles, and answers.
    pub(super) async fn deliver(
        &self,
        gen: &Generation,
        served: Served,
        reservation: Option<&Reservation>,
        ctx: &mut Ctx,
        summary: Summary,
    ) -> Result<Response<GwBody>, Fail> {
        let (parts, body) = served.resp.into_parts();
        // Counted in the body budget as it arrives, so that responses being
        // read are bounded too, not only those read.
        let room = gen.cfg.server.max_body_bytes_in_flight;
        let mut held = self.inner.bodies.permit();
        let read = tokio::time::timeout(
            gen.cfg.traffic.timeout(),
            collect_limited(body, 64 << 20, Some((&mut held, room))),
        )
        .await
        .unwrap_or(Err(BodyError::Timeout));
        ctx.backend_time = Some(served.sent_at.elapsed());
        let bytes = match read {
            Ok(b) => b,
            Err(BodyError::Budget) => {
                // The backend did the work: the reservation stays charged
                // whole, as for a client that goes away.
                ctx.error = Some("the backend's response does not fit in the body budget".into());
                return Err(no_room().into());
            }
            Err(_) => {
                self.settle(reservation, 0).await;
                ctx.error = Some("backend response body failed or timed out".into());
                return Err(ApiError::new(
                    StatusCode::BAD_GATEWAY,
                    "upstream_error",
                    "the backend's response broke off",
                )
                .into());
            }
        };
        let ok = parts.status.is_success();
        match summary {
            Summary::Answer if ok => {
                if let Some(a) = summary_of_body(&bytes) {
                    ctx.usage = a.usage;
                    ctx.finish_reason = a.finish_reason;
                    ctx.answer_chars = a.answer_chars;
                }
            }
            // Read only while a rollout watches the model.
            Summary::OipOutput
                if ok
                    && self.inner.samples.watching(
                        ctx.served_model
                            .as_deref()
                            .or(ctx.model.as_deref())
                            .unwrap_or(""),
                    ) =>
            {
                ctx.output_mean = oip_output_mean(&bytes);
            }
            _ => {}
        }
        match (ok, ctx.usage) {
            (false, _) => self.settle(reservation, 0).await,
            (true, Some(u)) => self.settle(reservation, u.total()).await,
            (true, None) => {}
        }
        if gen.cfg.audit.include_content {
            ctx.response_body = Some(bytes.clone());
        }
        let mut r = Response::new(GwBody::held(bytes, held));
        *r.status_mut() = parts.status;
        // Room for the headers the gateway adds (id, model, deployment,
        // six rate-limit headers) without growing.
        *r.headers_mut() = HeaderMap::with_capacity(16);
        if let Some(ct) = parts.headers.get(http::header::CONTENT_TYPE) {
            r.headers_mut()
                .insert(http::header::CONTENT_TYPE, ct.clone());
        }
        Ok(r)
    }

    /// Passes an SSE stream on event by event as the client's connection
    /// takes it (crate::stream); settles, counts and audits when it ends.
    pub(super) fn stream(
        &self,
        gen: &Generation,
        served: Served,
        strip: bool,
        reservation: Option<Reservation>,
        mut ctx: Ctx,
        started: Instant,
    ) -> Response<GwBody> {
        let (parts, body) = served.resp.into_parts();
        let idle = Duration::from_millis(gen.cfg.traffic.stream_idle_timeout_ms);
        let capture = gen.cfg.audit.include_content.then_some(CONTENT_CAP);
        let gw = self.clone();
        let sent_at = served.sent_at;
        ctx.status = parts.status.as_u16();
        // Counted until the request is settled, so that shutdown waits
        // for it.
        let guard = TaskGuard::new(&self.inner);
        let ending: crate::stream::Ending = Box::new(move |end| {
            Box::pin(async move {
                let _guard = guard;
                gw.end_stream(end, ctx, reservation, sent_at, started).await;
            })
        });
        let s = crate::stream::SseStream::new(body, SseFilter::new(strip), idle, capture, ending);
        let mut resp = Response::new(GwBody::Stream(Box::new(s)));
        *resp.status_mut() = parts.status;
        for h in [http::header::CONTENT_TYPE, http::header::CACHE_CONTROL] {
            if let Some(v) = parts.headers.get(&h) {
                resp.headers_mut().insert(h, v.clone());
            }
        }
        resp
    }

    /// Settles, counts and audits a stream that ended.
    pub(super) async fn end_stream(
        &self,
        end: crate::stream::StreamEnd,
        mut ctx: Ctx,
        reservation: Option<Reservation>,
        sent_at: Instant,
        started: Instant,
    ) {
        let crate::stream::StreamEnd {
            filter: f,
            ok,
            error,
            captured,
        } = end;
        if let Some(e) = error {
            ctx.error = Some(e);
        }
        ctx.backend_time = Some(sent_at.elapsed());
        ctx.usage = f.usage;
        ctx.finish_reason = f.finish_reason;
        ctx.answer_chars = Some(f.answer_chars);
        ctx.stream_aborted = !ok || !f.done;
        match f.usage {
            Some(u) => self.settle(reservation.as_ref(), u.total()).await,
            None if f.events == 0 => self.settle(reservation.as_ref(), 0).await,
            None => {
                // No usage chunk (a server that ignores `stream_options`,
                // or a stream cut short): charge the prompt estimate and
                // the text that was sent, by the same quarter-of-the-bytes
                // rule.
                let u = TokenUsage {
                    prompt: ctx.prompt_estimate,
                    completion: f.content_bytes.div_ceil(4),
                };
                ctx.usage = Some(u);
                ctx.usage_estimated = true;
                self.settle(reservation.as_ref(), u.total()).await;
            }
        }
        if let Some(c) = captured {
            ctx.response_body = Some(Bytes::from(c));
        }
        if !ok && ctx.status < 400 {
            ctx.error.get_or_insert_with(|| "stream ended early".into());
        }
        // The body ends only after the request is settled and, with
        // `audit.sync`, its line is on disk.
        if let Some(synced) = self.finish(ctx, started.elapsed()) {
            if !synced.await.unwrap_or(false) {
                tracing::error!("the audit log could not be written for a finished stream");
            }
        }
    }
}
