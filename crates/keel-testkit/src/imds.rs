//! A fake Azure Instance Metadata Service for Scheduled Events: it serves
//! the events document (its `DocumentIncarnation` grows with every change),
//! the VM's name, records acknowledgements (`POST StartRequests`), and can
//! be switched to answer garbage or to drop every connection (down).
//! Requests without `Metadata: true` get 400, as from IMDS. It also serves
//! AWS's IMDSv2 token and Spot `instance-action` (404 until one is set)
//! and GCP's `instance/preempted`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

const AWS_TOKEN: &str = "fake-imdsv2-token";

/// How the fake answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImdsMode {
    Normal,
    /// 200 with a body that is not a document.
    Garbage,
    /// Closes every connection without an answer.
    Down,
}

#[derive(Debug)]
struct State {
    vm: String,
    incarnation: u64,
    events: Vec<serde_json::Value>,
    mode: ImdsMode,
    acks: Vec<String>,
    requests: u64,
    aws_action: Option<serde_json::Value>,
    gcp_preempted: bool,
}

/// The running fake; stops when dropped.
#[derive(Debug)]
pub struct FakeImds {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    stop: Arc<AtomicBool>,
}

/// A Scheduled Event as IMDS writes it.
pub fn scheduled_event(
    id: &str,
    kind: &str,
    resources: &[&str],
    not_before: SystemTime,
) -> serde_json::Value {
    serde_json::json!({
        "EventId": id,
        "EventType": kind,
        "ResourceType": "VirtualMachine",
        "Resources": resources,
        "EventStatus": "Scheduled",
        "NotBefore": httpdate::fmt_http_date(not_before),
        "Description": "",
        "EventSource": "Platform",
        "DurationInSeconds": -1,
    })
}

impl FakeImds {
    /// Starts a fake for a VM named `vm` on 127.0.0.1.
    pub fn start(vm: &str) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(State {
            vm: vm.to_owned(),
            incarnation: 1,
            events: Vec::new(),
            mode: ImdsMode::Normal,
            acks: Vec::new(),
            requests: 0,
            aws_action: None,
            gcp_preempted: false,
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let (st, sp) = (state.clone(), stop.clone());
        std::thread::spawn(move || {
            while !sp.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((s, _)) => {
                        let st = st.clone();
                        std::thread::spawn(move || {
                            let _ = handle(s, &st);
                        });
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        });
        Ok(Self { addr, state, stop })
    }

    /// `http://127.0.0.1:PORT`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Replaces the events (the incarnation grows).
    pub fn set_events(&self, events: Vec<serde_json::Value>) {
        let mut s = self.lock();
        s.events = events;
        s.incarnation += 1;
    }

    pub fn set_mode(&self, mode: ImdsMode) {
        self.lock().mode = mode;
    }

    /// The AWS Spot `instance-action` document (`None`: 404, no notice).
    pub fn set_aws_action(&self, action: Option<serde_json::Value>) {
        self.lock().aws_action = action;
    }

    /// What GCP's `instance/preempted` says (`TRUE` once set).
    pub fn set_gcp_preempted(&self, preempted: bool) {
        self.lock().gcp_preempted = preempted;
    }

    /// The event ids acknowledged so far, in order.
    pub fn acks(&self) -> Vec<String> {
        self.lock().acks.clone()
    }

    /// The requests answered or dropped so far.
    pub fn requests(&self) -> u64 {
        self.lock().requests
    }
}

impl Drop for FakeImds {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn respond(s: &mut TcpStream, status: &str, body: &[u8]) -> std::io::Result<()> {
    write!(
        s,
        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )?;
    s.write_all(body)
}

fn handle(mut s: TcpStream, state: &Mutex<State>) -> std::io::Result<()> {
    s.set_nonblocking(false)?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut r = BufReader::new(s.try_clone()?);
    let mut line = String::new();
    r.read_line(&mut line)?;
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or("").to_owned();
    let path = parts.next().unwrap_or("").to_owned();
    let mut metadata = false;
    let mut aws_ttl = false;
    let mut aws_token = false;
    let mut google = false;
    let mut length = 0usize;
    loop {
        let mut h = String::new();
        if r.read_line(&mut h)? == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            if k.trim().eq_ignore_ascii_case("metadata") && v.trim() == "true" {
                metadata = true;
            }
            if k.trim().eq_ignore_ascii_case("metadata-flavor") && v.trim() == "Google" {
                google = true;
            }
            if k.trim()
                .eq_ignore_ascii_case("x-aws-ec2-metadata-token-ttl-seconds")
            {
                aws_ttl = true;
            }
            if k.trim().eq_ignore_ascii_case("x-aws-ec2-metadata-token") && v.trim() == AWS_TOKEN {
                aws_token = true;
            }
            if k.trim().eq_ignore_ascii_case("content-length") {
                length = v.trim().parse().unwrap_or(0);
            }
        }
    }
    let mut body = vec![0; length.min(1 << 20)];
    r.read_exact(&mut body)?;
    let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
    st.requests += 1;
    match st.mode {
        ImdsMode::Down => return Ok(()),
        ImdsMode::Garbage => {
            drop(st);
            return respond(&mut s, "200 OK", b"<html>maintenance</html>");
        }
        ImdsMode::Normal => {}
    }
    if path == "/computeMetadata/v1/instance/preempted" {
        let p = st.gcp_preempted;
        drop(st);
        return if google {
            respond(&mut s, "200 OK", if p { b"TRUE" } else { b"FALSE" })
        } else {
            respond(&mut s, "403 Forbidden", b"")
        };
    }
    // AWS: IMDSv2 token, then the Spot notice.
    if path == "/latest/api/token" {
        drop(st);
        return if method == "PUT" && aws_ttl {
            respond(&mut s, "200 OK", AWS_TOKEN.as_bytes())
        } else {
            respond(&mut s, "400 Bad Request", b"")
        };
    }
    if path == "/latest/meta-data/spot/instance-action" {
        let action = st.aws_action.clone();
        drop(st);
        return match (aws_token, action) {
            (false, _) => respond(&mut s, "401 Unauthorized", b""),
            (true, None) => respond(&mut s, "404 Not Found", b""),
            (true, Some(a)) => respond(&mut s, "200 OK", a.to_string().as_bytes()),
        };
    }
    if !metadata {
        drop(st);
        return respond(&mut s, "400 Bad Request", b"{\"error\":\"Bad request\"}");
    }
    if path.starts_with("/metadata/instance/compute/name") {
        let name = st.vm.clone();
        drop(st);
        return respond(&mut s, "200 OK", name.as_bytes());
    }
    if !path.starts_with("/metadata/scheduledevents") {
        drop(st);
        return respond(&mut s, "404 Not Found", b"{}");
    }
    if method == "POST" {
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        let Some(reqs) = v.get("StartRequests").and_then(|r| r.as_array()) else {
            drop(st);
            return respond(&mut s, "400 Bad Request", b"{}");
        };
        for r in reqs {
            if let Some(id) = r.get("EventId").and_then(|i| i.as_str()) {
                st.acks.push(id.to_owned());
            }
        }
        drop(st);
        return respond(&mut s, "200 OK", b"");
    }
    let doc = serde_json::json!({
        "DocumentIncarnation": st.incarnation,
        "Events": st.events,
    });
    drop(st);
    respond(&mut s, "200 OK", doc.to_string().as_bytes())
}
