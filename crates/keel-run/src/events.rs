//! Azure Scheduled Events: the document IMDS serves, the events in it for
//! this VM, and a blocking client that polls an IMDS address (configurable,
//! so tests can point it at a fake) and acknowledges events.
//!
//! `GET {base}/metadata/scheduledevents?api-version=2020-07-01` with the
//! header `Metadata: true` returns `{DocumentIncarnation, Events: [...]}`;
//! the incarnation grows whenever the events change. Events are delivered
//! to every VM of an availability set or scale-set placement group, so
//! only those whose `Resources` name one of the job's VMs count (the batch
//! host sees its peers' events too). Acknowledging is a
//! `POST` of `{"StartRequests":[{"EventId":...}]}` to the same address; it
//! lets Azure start the event for every VM it lists, so only a leader
//! should do it, only after the job's checkpoint is committed and only
//! for an event that names no VM outside the job ([`ack`]).
//!
//! Nothing here ever decides to stop training on a failure to reach IMDS
//! or to read what it says: errors are returned to the caller, who keeps
//! polling.

use std::collections::BTreeSet;
use std::time::{Duration, SystemTime};

use serde::Deserialize;

/// IMDS's address on Azure.
pub const DEFAULT_IMDS: &str = "http://169.254.169.254";
/// The Scheduled Events path and version.
pub const EVENTS_PATH: &str = "/metadata/scheduledevents?api-version=2020-07-01";
/// The VM's name.
pub const NAME_PATH: &str = "/metadata/instance/compute/name?api-version=2021-02-01&format=text";
/// The most of a response read.
const MAX_BODY: usize = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum EventsError {
    #[error("invalid IMDS address {0:?} (expected http://HOST[:PORT])")]
    Address(String),
    #[error("IMDS at {addr} is unreachable")]
    Connect {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("reading from IMDS at {addr} failed")]
    Io {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("IMDS at {addr} answered {status} to {what}")]
    Status {
        addr: String,
        status: u16,
        what: &'static str,
    },
    #[error("IMDS sent a response that is not HTTP: {0}")]
    Http(String),
    #[error("IMDS sent a Scheduled Events document that does not parse")]
    Document(#[source] serde_json::Error),
}

/// The kind of event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventType {
    Freeze,
    Reboot,
    Redeploy,
    Preempt,
    Terminate,
    Other(String),
}

impl EventType {
    fn parse(s: &str) -> Self {
        match s {
            "Freeze" => Self::Freeze,
            "Reboot" => Self::Reboot,
            "Redeploy" => Self::Redeploy,
            "Preempt" => Self::Preempt,
            "Terminate" => Self::Terminate,
            other => Self::Other(other.chars().take(64).collect()),
        }
    }

    pub fn as_str(&self) -> &str {
        match self {
            Self::Freeze => "Freeze",
            Self::Reboot => "Reboot",
            Self::Redeploy => "Redeploy",
            Self::Preempt => "Preempt",
            Self::Terminate => "Terminate",
            Self::Other(s) => s,
        }
    }

    /// Whether the event ends the training on this VM (its memory or local
    /// disks are lost): everything but a Freeze (a pause of seconds) and
    /// types this version does not know.
    pub fn ends_training(&self) -> bool {
        matches!(
            self,
            Self::Reboot | Self::Redeploy | Self::Preempt | Self::Terminate
        )
    }
}

/// One scheduled event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub id: String,
    pub kind: EventType,
    /// The VMs it affects.
    pub resources: Vec<String>,
    /// `Scheduled` or `Started`.
    pub status: String,
    /// Not before this time; `None` once started (or unreadable).
    pub not_before: Option<SystemTime>,
    /// Expected interruption; `None` for unknown (-1 or absent).
    pub duration: Option<Duration>,
    pub source: String,
}

impl Event {
    /// Whether the event names `vm` among its resources (case-insensitive).
    pub fn affects(&self, vm: &str) -> bool {
        self.resources.iter().any(|r| r.eq_ignore_ascii_case(vm))
    }

    /// The time left before the event may start, from `now`; zero when
    /// it started or its time passed.
    pub fn notice(&self, now: SystemTime) -> Duration {
        self.not_before
            .and_then(|t| t.duration_since(now).ok())
            .unwrap_or(Duration::ZERO)
    }
}

/// A Scheduled Events document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Document {
    pub incarnation: u64,
    pub events: Vec<Event>,
}

#[derive(Deserialize)]
struct RawDocument {
    #[serde(rename = "DocumentIncarnation")]
    incarnation: u64,
    #[serde(rename = "Events", default)]
    events: Vec<RawEvent>,
}

#[derive(Deserialize)]
struct RawEvent {
    #[serde(rename = "EventId")]
    id: String,
    #[serde(rename = "EventType")]
    kind: String,
    #[serde(rename = "Resources", default)]
    resources: Vec<String>,
    #[serde(rename = "EventStatus", default)]
    status: String,
    #[serde(rename = "NotBefore", default)]
    not_before: String,
    #[serde(rename = "DurationInSeconds", default)]
    duration: Option<i64>,
    #[serde(rename = "EventSource", default)]
    source: String,
}

/// Parses a document. Unknown fields are ignored (newer API versions add
/// some); `NotBefore` is RFC 1123 (`Mon, 19 Sep 2016 18:29:47 GMT`), and
/// one that does not parse is `None`.
pub fn parse_document(bytes: &[u8]) -> Result<Document, EventsError> {
    let raw: RawDocument = serde_json::from_slice(bytes).map_err(EventsError::Document)?;
    Ok(Document {
        incarnation: raw.incarnation,
        events: raw
            .events
            .into_iter()
            .map(|e| Event {
                id: e.id,
                kind: EventType::parse(&e.kind),
                resources: e.resources,
                status: e.status,
                not_before: httpdate::parse_http_date(e.not_before.trim()).ok(),
                duration: e
                    .duration
                    .and_then(|d| u64::try_from(d).ok())
                    .map(Duration::from_secs),
                source: e.source,
            })
            .collect(),
    })
}

/// An AWS Spot interruption notice: `{"action": "terminate"|"stop"|
/// "hibernate", "time": "2017-09-18T08:22:00Z"}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AwsNotice {
    pub action: String,
    /// When the instance is interrupted; `None` when unreadable.
    pub time: Option<SystemTime>,
}

#[derive(Deserialize)]
struct RawAws {
    action: String,
    #[serde(default)]
    time: String,
}

/// Parses AWS's `spot/instance-action` document.
pub fn parse_aws_instance_action(bytes: &[u8]) -> Result<AwsNotice, EventsError> {
    let raw: RawAws = serde_json::from_slice(bytes).map_err(EventsError::Document)?;
    Ok(AwsNotice {
        action: raw.action.chars().take(32).collect(),
        time: parse_rfc3339_utc(&raw.time),
    })
}

/// `YYYY-MM-DDTHH:MM:SSZ` (UTC, whole seconds, as AWS writes it).
fn parse_rfc3339_utc(s: &str) -> Option<SystemTime> {
    keel_time::parse_rfc3339_secs(s)
        .and_then(|secs| u64::try_from(secs).ok())
        .map(|s| SystemTime::UNIX_EPOCH + Duration::from_secs(s))
}

/// Follows successive documents for the VMs of one job and reports each
/// event that affects any of them once. The batch host of a multi-node
/// job receives the events of its whole placement group, so an event
/// naming another of the job's VMs (a spot eviction of node 2) ends the
/// job's training as surely as one naming this VM.
#[derive(Debug, Clone)]
pub struct Tracker {
    vms: Vec<String>,
    incarnation: Option<u64>,
    seen: BTreeSet<String>,
}

impl Tracker {
    /// Tracks the events naming any of `vms` (compared without case).
    pub fn new(vms: &[String]) -> Self {
        Self {
            vms: vms.to_vec(),
            incarnation: None,
            seen: BTreeSet::new(),
        }
    }

    /// The events of `doc` for the job's VMs not reported before. A
    /// document with the incarnation already seen is not read again.
    pub fn observe(&mut self, doc: &Document) -> Vec<Event> {
        if self.incarnation == Some(doc.incarnation) {
            return Vec::new();
        }
        self.incarnation = Some(doc.incarnation);
        doc.events
            .iter()
            .filter(|e| self.vms.iter().any(|v| e.affects(v)) && self.seen.insert(e.id.clone()))
            .cloned()
            .collect()
    }
}

/// Whether to acknowledge an event (`StartRequests`), which lets Azure
/// start it at once for every VM it lists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ack {
    /// The job's checkpoint is committed and the event names only the
    /// job's VMs.
    Yes,
    /// No checkpoint was committed: the event keeps its notice.
    NotCommitted,
    /// The event names VMs outside the job, whose work an early start
    /// would cut short.
    Foreign(Vec<String>),
}

/// Decides whether the supervisor of the job running on `job_vms` may
/// acknowledge `event` (see [`Ack`]).
pub fn ack(event: &Event, job_vms: &[String], committed: bool) -> Ack {
    let foreign: Vec<String> = event
        .resources
        .iter()
        .filter(|r| !job_vms.iter().any(|v| v.eq_ignore_ascii_case(r)))
        .cloned()
        .collect();
    if !foreign.is_empty() {
        Ack::Foreign(foreign)
    } else if !committed {
        Ack::NotCommitted
    } else {
        Ack::Yes
    }
}

/// A blocking IMDS client.
#[derive(Debug, Clone)]
pub struct Imds {
    host: String,
    port: u16,
    timeout: Duration,
}

impl Imds {
    /// A client for `base` (`http://HOST[:PORT]`), each request limited
    /// to `timeout`.
    pub fn new(base: &str, timeout: Duration) -> Result<Self, EventsError> {
        let bad = || EventsError::Address(base.chars().take(200).collect());
        let rest = base.strip_prefix("http://").ok_or_else(bad)?;
        let rest = rest.trim_end_matches('/');
        if rest.is_empty() || rest.contains('/') || rest.contains('@') {
            return Err(bad());
        }
        let (host, port) = match rest.rsplit_once(':') {
            Some((h, p)) => (h.to_owned(), p.parse::<u16>().map_err(|_| bad())?),
            None => (rest.to_owned(), 80),
        };
        if host.is_empty() {
            return Err(bad());
        }
        Ok(Self {
            host,
            port,
            timeout,
        })
    }

    fn addr(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }

    /// The current Scheduled Events document.
    pub fn events(&self) -> Result<Document, EventsError> {
        let body = self.request("GET", EVENTS_PATH, None, "the Scheduled Events request")?;
        parse_document(&body)
    }

    /// This VM's name, as IMDS's compute metadata gives it.
    pub fn vm_name(&self) -> Result<String, EventsError> {
        let body = self.request("GET", NAME_PATH, None, "the VM name request")?;
        let name = String::from_utf8_lossy(&body).trim().to_owned();
        if name.is_empty() || name.len() > 128 || name.chars().any(char::is_control) {
            return Err(EventsError::Http("an invalid VM name".to_owned()));
        }
        Ok(name)
    }

    /// Acknowledges events: lets Azure start them now.
    pub fn acknowledge(&self, ids: &[&str]) -> Result<(), EventsError> {
        let body = serde_json::json!({
            "StartRequests": ids.iter().map(|id| serde_json::json!({"EventId": id})).collect::<Vec<_>>()
        });
        self.request(
            "POST",
            EVENTS_PATH,
            Some(body.to_string().as_bytes()),
            "the acknowledgement",
        )
        .map(|_| ())
    }

    /// AWS EC2: the Spot interruption notice, if one is pending
    /// (`spot/instance-action` through an IMDSv2 token; 404 means none).
    pub fn aws_instance_action(&self) -> Result<Option<AwsNotice>, EventsError> {
        let (status, token) = self.exchange(
            "PUT",
            "/latest/api/token",
            &[("X-aws-ec2-metadata-token-ttl-seconds", "300")],
            &[],
        )?;
        if status != 200 {
            return Err(EventsError::Status {
                addr: self.addr(),
                status,
                what: "the IMDSv2 token request",
            });
        }
        let token = String::from_utf8_lossy(&token).trim().to_owned();
        if token.is_empty() || token.len() > 512 || token.chars().any(char::is_control) {
            return Err(EventsError::Http("an invalid IMDSv2 token".to_owned()));
        }
        let (status, body) = self.exchange(
            "GET",
            "/latest/meta-data/spot/instance-action",
            &[("X-aws-ec2-metadata-token", &token)],
            &[],
        )?;
        match status {
            404 => Ok(None),
            200 => parse_aws_instance_action(&body).map(Some),
            status => Err(EventsError::Status {
                addr: self.addr(),
                status,
                what: "the Spot instance-action request",
            }),
        }
    }

    /// GCP: whether the instance is being preempted
    /// (`computeMetadata/v1/instance/preempted` says `TRUE`).
    pub fn gcp_preempted(&self) -> Result<bool, EventsError> {
        let (status, body) = self.exchange(
            "GET",
            "/computeMetadata/v1/instance/preempted",
            &[("Metadata-Flavor", "Google")],
            &[],
        )?;
        if status != 200 {
            return Err(EventsError::Status {
                addr: self.addr(),
                status,
                what: "the preempted request",
            });
        }
        match String::from_utf8_lossy(&body).trim() {
            "TRUE" => Ok(true),
            "FALSE" => Ok(false),
            _ => Err(EventsError::Http(
                "preempted is neither TRUE nor FALSE".to_owned(),
            )),
        }
    }

    fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
        what: &'static str,
    ) -> Result<Vec<u8>, EventsError> {
        let (status, body) = self.exchange(
            method,
            path,
            &[("Metadata", "true")],
            body.unwrap_or_default(),
        )?;
        if !(200..300).contains(&status) {
            return Err(EventsError::Status {
                addr: self.addr(),
                status,
                what,
            });
        }
        Ok(body)
    }

    fn exchange(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<(u16, Vec<u8>), EventsError> {
        let url = format!("http://{}{path}", self.addr());
        let agent: ureq::Agent = ureq::Agent::config_builder()
            // A metadata service is link-local: never through a proxy.
            .proxy(None)
            .max_redirects(0)
            .http_status_as_error(false)
            .timeout_connect(Some(self.timeout))
            .timeout_global(Some(self.timeout))
            .build()
            .into();
        let mut req = http_request(method, &url)?;
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        if !body.is_empty() {
            req = req.header("Content-Type", "application/json");
        }
        let mut resp = agent
            .run(
                req.body(body.to_vec())
                    .map_err(|e| EventsError::Http(e.to_string()))?,
            )
            .map_err(|e| self.error(e))?;
        let status = resp.status().as_u16();
        let body = resp
            .body_mut()
            .with_config()
            .limit(MAX_BODY as u64)
            .read_to_vec()
            .map_err(|e| self.error(e))?;
        Ok((status, body))
    }

    /// What a failed exchange says: unreachable before a connection was
    /// made, an I/O failure on it, or an answer that is not HTTP.
    fn error(&self, e: ureq::Error) -> EventsError {
        use std::io::ErrorKind as K;
        let addr = self.addr();
        match e {
            ureq::Error::HostNotFound
            | ureq::Error::ConnectionFailed
            | ureq::Error::Timeout(ureq::Timeout::Resolve | ureq::Timeout::Connect) => {
                EventsError::Connect {
                    addr,
                    source: e.into_io(),
                }
            }
            ureq::Error::Io(source)
                if matches!(
                    source.kind(),
                    K::ConnectionRefused
                        | K::AddrNotAvailable
                        | K::NetworkUnreachable
                        | K::HostUnreachable
                ) =>
            {
                EventsError::Connect { addr, source }
            }
            ureq::Error::Io(source) => EventsError::Io { addr, source },
            ureq::Error::Timeout(_) => EventsError::Io {
                addr,
                source: e.into_io(),
            },
            ureq::Error::BodyExceedsLimit(_) => {
                EventsError::Http("the response is too large".to_owned())
            }
            other => EventsError::Http(other.to_string()),
        }
    }
}

/// A request of `method` for `url`, without its body.
fn http_request(method: &str, url: &str) -> Result<ureq::http::request::Builder, EventsError> {
    let method = ureq::http::Method::from_bytes(method.as_bytes())
        .map_err(|e| EventsError::Http(e.to_string()))?;
    Ok(ureq::http::Request::builder().method(method).uri(url))
}

/// Polls IMDS and reports each new event for one VM once. An error (IMDS
/// down, a garbage answer) is returned and changes nothing: the next poll
/// starts over.
#[derive(Debug, Clone)]
pub struct Poller {
    imds: Imds,
    tracker: Tracker,
}

impl Poller {
    /// Polls for the events naming any of `vms` (the job's VMs).
    pub fn new(imds: Imds, vms: &[String]) -> Self {
        Self {
            imds,
            tracker: Tracker::new(vms),
        }
    }

    /// One poll: the new events for the job's VMs.
    pub fn poll(&mut self) -> Result<Vec<Event>, EventsError> {
        let doc = self.imds.events()?;
        Ok(self.tracker.observe(&doc))
    }

    pub fn imds(&self) -> &Imds {
        &self.imds
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const DOC: &str = r#"{"DocumentIncarnation": 3, "Events": [
        {"EventId": "A", "EventType": "Preempt", "ResourceType": "VirtualMachine",
         "Resources": ["vm-1", "vm-2"], "EventStatus": "Scheduled",
         "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT", "Description": "",
         "EventSource": "Platform", "DurationInSeconds": -1},
        {"EventId": "B", "EventType": "Freeze", "Resources": ["VM-1"],
         "EventStatus": "Started", "NotBefore": "", "DurationInSeconds": 5},
        {"EventId": "C", "EventType": "Reboot", "Resources": ["vm-9"],
         "EventStatus": "Scheduled", "NotBefore": "Mon, 19 Sep 2016 18:45:00 GMT",
         "NewField": 1}
    ]}"#;

    #[test]
    fn parses_a_document_and_keeps_this_vms_events_once() {
        let doc = parse_document(DOC.as_bytes()).expect("parse");
        assert_eq!(doc.incarnation, 3);
        let a = &doc.events[0];
        assert_eq!(a.kind, EventType::Preempt);
        assert_eq!(
            a.not_before,
            Some(SystemTime::UNIX_EPOCH + Duration::from_secs(1_474_309_787))
        );
        assert_eq!(a.duration, None);
        assert_eq!(doc.events[1].not_before, None);
        assert_eq!(doc.events[1].duration, Some(Duration::from_secs(5)));
        let mut t = Tracker::new(&["vm-1".to_owned()]);
        let ids: Vec<_> = t.observe(&doc).into_iter().map(|e| e.id).collect();
        assert_eq!(ids, ["A", "B"]);
        assert!(t.observe(&doc).is_empty(), "same incarnation");
        let next = Document {
            incarnation: 4,
            ..doc.clone()
        };
        assert!(t.observe(&next).is_empty(), "events already reported");
        assert!(EventType::Preempt.ends_training() && !EventType::Freeze.ends_training());
    }

    #[test]
    fn events_naming_any_of_the_jobs_vms_are_kept() {
        let doc = parse_document(DOC.as_bytes()).expect("parse");
        // The batch host vm-3 of a job on vm-3 and vm-9: C names vm-9.
        let job = ["vm-3".to_owned(), "vm-9".to_owned()];
        let mut t = Tracker::new(&job);
        let ids: Vec<_> = t.observe(&doc).into_iter().map(|e| e.id).collect();
        assert_eq!(ids, ["C"]);
        let mut t = Tracker::new(&["vm-2".to_owned()]);
        let ids: Vec<_> = t.observe(&doc).into_iter().map(|e| e.id).collect();
        assert_eq!(ids, ["A"]);
    }

    #[test]
    fn only_a_committed_event_of_the_jobs_own_vms_is_acknowledged() {
        let doc = parse_document(DOC.as_bytes()).expect("parse");
        let a = &doc.events[0]; // vm-1 and vm-2
        let both = ["VM-1".to_owned(), "vm-2".to_owned()];
        assert_eq!(ack(a, &both, true), Ack::Yes);
        assert_eq!(ack(a, &both, false), Ack::NotCommitted);
        assert_eq!(
            ack(a, &["vm-1".to_owned()], true),
            Ack::Foreign(vec!["vm-2".to_owned()])
        );
    }

    #[test]
    fn garbage_is_an_error() {
        for bad in [
            &b"<html>"[..],
            b"{}",
            b"{\"DocumentIncarnation\":\"x\"}",
            b"",
        ] {
            assert!(matches!(parse_document(bad), Err(EventsError::Document(_))));
        }
    }

    #[test]
    fn aws_notices() {
        let n =
            parse_aws_instance_action(br#"{"action":"terminate","time":"2017-09-18T08:22:00Z"}"#)
                .expect("parse");
        assert_eq!(n.action, "terminate");
        assert_eq!(
            n.time,
            Some(SystemTime::UNIX_EPOCH + Duration::from_secs(1_505_722_920))
        );
        let n = parse_aws_instance_action(br#"{"action":"stop","time":"soon"}"#).expect("parse");
        assert_eq!(n.time, None);
        assert!(parse_aws_instance_action(b"<html>").is_err());
        assert_eq!(
            parse_rfc3339_utc("2024-02-29T00:00:00Z"),
            Some(SystemTime::UNIX_EPOCH + Duration::from_secs(1_709_164_800))
        );
    }

    #[test]
    fn addresses() {
        let i = Imds::new("http://127.0.0.1:8080", Duration::from_secs(1)).expect("addr");
        assert_eq!(i.addr(), "127.0.0.1:8080");
        let i = Imds::new(DEFAULT_IMDS, Duration::from_secs(1)).expect("addr");
        assert_eq!(i.addr(), "169.254.169.254:80");
        for bad in [
            "169.254.169.254",
            "https://x",
            "http://",
            "http://h:x",
            "http://a/b",
        ] {
            assert!(Imds::new(bad, Duration::from_secs(1)).is_err(), "{bad}");
        }
    }

    proptest! {
        #[test]
        fn any_bytes_parse_or_fail_cleanly(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = parse_document(&bytes);
        }
    }
}
