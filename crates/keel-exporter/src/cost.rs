//! Idle GPU-hours per Slurm job, for `keel cost idle`: read from one
//! exporter's `/metrics` ([`from_exposition`]) or from a Prometheus server
//! that scrapes the exporters ([`prometheus_queries`], [`from_prometheus`]),
//! and a minimal HTTP/1.1 GET ([`http_get`]; plain `http://` only).

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use serde::Serialize;

/// Why a report could not be made.
#[derive(Debug, thiserror::Error)]
pub enum CostError {
    #[error("{url} is not an http:// URL (https is not supported here)")]
    Url { url: String },
    #[error("cannot reach {url}: {message}")]
    Connect { url: String, message: String },
    #[error("{url} did not answer within {seconds} s")]
    Timeout { url: String, seconds: f64 },
    #[error("{url} answered HTTP {status}")]
    Status { url: String, status: u16 },
    #[error("{url} answered something that is not {what}: {message}")]
    Format {
        url: String,
        what: &'static str,
        message: String,
    },
}

/// One job's idle GPU time.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct IdleRow {
    pub job: String,
    pub user: String,
    pub partition: String,
    pub idle_gpu_hours: f64,
    pub observed_gpu_hours: f64,
    /// The policy marks the job idle now.
    pub idle_now: bool,
}

fn labels(s: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut rest = s;
    while let Some((name, after)) = rest.split_once("=\"") {
        let mut value = String::new();
        let mut chars = after.char_indices();
        let mut end = after.len();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c)) => value.push(c),
                    None => {}
                },
                '"' => {
                    end = i + 1;
                    break;
                }
                c => value.push(c),
            }
        }
        out.insert(name.trim_start_matches(',').trim().to_owned(), value);
        rest = &after[end..];
    }
    out
}

fn row_of<'a>(
    rows: &'a mut BTreeMap<String, IdleRow>,
    l: &BTreeMap<String, String>,
) -> Option<&'a mut IdleRow> {
    let job = l.get("slurm_job")?.clone();
    Some(rows.entry(job.clone()).or_insert_with(|| IdleRow {
        job,
        user: l.get("user").cloned().unwrap_or_default(),
        partition: l.get("partition").cloned().unwrap_or_default(),
        idle_gpu_hours: 0.0,
        observed_gpu_hours: 0.0,
        idle_now: false,
    }))
}

/// The idle rows in an exporter's `/metrics` text (keel's names).
pub fn from_exposition(text: &str) -> Vec<IdleRow> {
    let mut rows = BTreeMap::new();
    for line in text.lines() {
        let Some((name, rest)) = line.split_once('{') else {
            continue;
        };
        let Some((l, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let Ok(v) = value.trim().parse::<f64>() else {
            continue;
        };
        if !matches!(
            name,
            "keel_job_gpu_idle_seconds_total"
                | "keel_job_gpu_observed_seconds_total"
                | "keel_job_gpu_idle"
        ) {
            continue;
        }
        let l = labels(l);
        let Some(row) = row_of(&mut rows, &l) else {
            continue;
        };
        match name {
            "keel_job_gpu_idle_seconds_total" => row.idle_gpu_hours += v / 3600.0,
            "keel_job_gpu_observed_seconds_total" => row.observed_gpu_hours += v / 3600.0,
            "keel_job_gpu_idle" => row.idle_now |= v >= 1.0,
            _ => {}
        }
    }
    sorted(rows)
}

fn sorted(rows: BTreeMap<String, IdleRow>) -> Vec<IdleRow> {
    let mut v: Vec<IdleRow> = rows.into_values().collect();
    v.sort_by(|a, b| {
        b.idle_gpu_hours
            .total_cmp(&a.idle_gpu_hours)
            .then(a.job.cmp(&b.job))
    });
    v
}

/// PromQL for idle GPU-seconds, observed GPU-seconds and the idle verdict
/// over `range` (a Prometheus duration: `24h`), summed over nodes.
pub fn prometheus_queries(range: &str) -> [String; 3] {
    [
        format!("sum by (slurm_job, user, partition) (increase(keel_job_gpu_idle_seconds_total[{range}]))"),
        format!("sum by (slurm_job, user, partition) (increase(keel_job_gpu_observed_seconds_total[{range}]))"),
        "max by (slurm_job, user, partition) (keel_job_gpu_idle)".to_owned(),
    ]
}

/// A query result's samples: labels and value.
type Samples = Vec<(BTreeMap<String, String>, f64)>;

fn vector(url: &str, body: &str) -> Result<Samples, CostError> {
    let bad = |message: String| CostError::Format {
        url: url.to_owned(),
        what: "a Prometheus query result",
        message,
    };
    let v: serde_json::Value = serde_json::from_str(body).map_err(|e| bad(e.to_string()))?;
    if v["status"] != "success" {
        return Err(bad(format!("status {}", v["status"])));
    }
    let result = v["data"]["result"]
        .as_array()
        .ok_or_else(|| bad("no data.result array".into()))?;
    Ok(result
        .iter()
        .filter_map(|s| {
            let labels = s["metric"]
                .as_object()?
                .iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap_or("").to_owned()))
                .collect();
            let value = s["value"][1].as_str()?.parse().ok()?;
            Some((labels, value))
        })
        .collect())
}

/// Rows from the three query results of [`prometheus_queries`] (the
/// bodies of `/api/v1/query`).
pub fn from_prometheus(
    url: &str,
    idle: &str,
    observed: &str,
    now: &str,
) -> Result<Vec<IdleRow>, CostError> {
    let mut rows = BTreeMap::new();
    for (l, v) in vector(url, idle)? {
        if let Some(r) = row_of(&mut rows, &l) {
            r.idle_gpu_hours += v / 3600.0;
        }
    }
    for (l, v) in vector(url, observed)? {
        if let Some(r) = row_of(&mut rows, &l) {
            r.observed_gpu_hours += v / 3600.0;
        }
    }
    for (l, v) in vector(url, now)? {
        if let Some(r) = row_of(&mut rows, &l) {
            r.idle_now |= v >= 1.0;
        }
    }
    Ok(sorted(rows))
}

/// `%`-encodes a query parameter.
pub fn encode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// GETs `url` (`http://host:port/path?query`), with a bearer token when
/// given; at most 64 MiB of body, the whole exchange within `timeout`.
pub async fn http_get(
    url: &str,
    token: Option<&str>,
    timeout: Duration,
) -> Result<String, CostError> {
    let fail = |message: String| CostError::Connect {
        url: url.to_owned(),
        message,
    };
    let rest = url.strip_prefix("http://").ok_or_else(|| CostError::Url {
        url: url.to_owned(),
    })?;
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    if authority.is_empty() {
        return Err(CostError::Url {
            url: url.to_owned(),
        });
    }
    let work = async {
        let stream = tokio::net::TcpStream::connect(authority)
            .await
            .map_err(|e| fail(e.to_string()))?;
        let (mut send, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .map_err(|e| fail(e.to_string()))?;
        tokio::spawn(conn);
        let mut req = http::Request::get(path)
            .header(http::header::HOST, authority)
            .body(Empty::<Bytes>::new())
            .map_err(|e| fail(e.to_string()))?;
        if let Some(t) = token {
            let v = http::HeaderValue::from_str(&format!("Bearer {t}"))
                .map_err(|_| fail("the token is not a valid header value".into()))?;
            req.headers_mut().insert(http::header::AUTHORIZATION, v);
        }
        let resp = send
            .send_request(req)
            .await
            .map_err(|e| fail(e.to_string()))?;
        let status = resp.status().as_u16();
        let body = Limited::new(resp.into_body(), 64 << 20)
            .collect()
            .await
            .map_err(|e| fail(e.to_string()))?
            .to_bytes();
        if status != 200 {
            return Err(CostError::Status {
                url: url.to_owned(),
                status,
            });
        }
        Ok(String::from_utf8_lossy(&body).into_owned())
    };
    tokio::time::timeout(timeout, work)
        .await
        .map_err(|_| CostError::Timeout {
            url: url.to_owned(),
            seconds: timeout.as_secs_f64(),
        })?
}

impl keel_error::HasKind for CostError {
    fn kind(&self) -> keel_error::ErrorKind {
        use keel_error::ErrorKind as K;
        match self {
            Self::Url { .. } => K::Usage,
            Self::Format { .. } => K::Input,
            Self::Connect { .. } | Self::Timeout { .. } | Self::Status { .. } => K::Unavailable,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_from_an_exposition() {
        let text = "# HELP keel_job_gpu_idle_seconds_total x\n\
            keel_job_gpu_idle_seconds_total{slurm_job=\"7\",user=\"alice\",partition=\"gpu\"} 7200\n\
            keel_job_gpu_observed_seconds_total{slurm_job=\"7\",user=\"alice\",partition=\"gpu\"} 14400\n\
            keel_job_gpu_idle{slurm_job=\"7\",user=\"alice\",partition=\"gpu\"} 1\n\
            keel_job_gpu_idle_seconds_total{slurm_job=\"8\",user=\"b\\\"o\",partition=\"\"} 36000\n\
            keel_job_gpu_idle{slurm_job=\"8\",user=\"b\\\"o\",partition=\"\"} 0\n\
            keel_gpu_job_info{gpu=\"0\",job=\"9\"} 1\n";
        let rows = from_exposition(text);
        assert_eq!(rows.len(), 2);
        assert_eq!(
            (
                rows[0].job.as_str(),
                rows[0].user.as_str(),
                rows[0].idle_gpu_hours,
                rows[0].idle_now
            ),
            ("8", "b\"o", 10.0, false)
        );
        assert_eq!(
            (
                rows[1].idle_gpu_hours,
                rows[1].observed_gpu_hours,
                rows[1].idle_now
            ),
            (2.0, 4.0, true)
        );
        assert_eq!(rows[1].partition, "gpu");
    }

    #[test]
    fn rows_from_prometheus_results() {
        let idle = r#"{"status":"success","data":{"resultType":"vector","result":[{"metric":{"slurm_job":"7","user":"alice","partition":"gpu"},"value":[1,"3600"]}]}}"#;
        let none = r#"{"status":"success","data":{"resultType":"vector","result":[]}}"#;
        let rows = from_prometheus("http://p", idle, none, none).expect("rows");
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].idle_gpu_hours, 1.0);
        assert!(matches!(
            from_prometheus("http://p", "<html>", none, none),
            Err(CostError::Format { .. })
        ));
        assert!(matches!(
            from_prometheus("http://p", r#"{"status":"error"}"#, none, none),
            Err(CostError::Format { .. })
        ));
        assert_eq!(
            encode("sum by (job) (x[1h])"),
            "sum%20by%20%28job%29%20%28x%5B1h%5D%29"
        );
    }
}
