//! Scheduled Events against the fake IMDS server over real HTTP.

use std::time::{Duration, SystemTime};

use keel_run::events::{EventType, EventsError, Imds, Poller};
use keel_testkit::imds::{scheduled_event, FakeImds, ImdsMode};

fn client(fake: &FakeImds) -> Imds {
    Imds::new(&fake.base_url(), Duration::from_secs(2)).expect("address")
}

#[test]
fn a_preempt_for_this_vm_is_reported_once_with_its_notice_and_others_are_ignored() {
    let fake = FakeImds::start("vm-1").expect("fake imds");
    let imds = client(&fake);
    let vm = imds.vm_name().expect("vm name");
    assert_eq!(vm, "vm-1");
    let mut poller = Poller::new(imds.clone(), std::slice::from_ref(&vm));
    assert!(poller.poll().expect("poll").is_empty());
    let now = SystemTime::now();
    fake.set_events(vec![
        scheduled_event("other", "Reboot", &["vm-7"], now + Duration::from_secs(900)),
        scheduled_event(
            "evict",
            "Preempt",
            &["vm-1", "vm-2"],
            now + Duration::from_secs(30),
        ),
    ]);
    let events = poller.poll().expect("poll");
    assert_eq!(events.len(), 1, "{events:?}");
    let e = &events[0];
    assert_eq!((e.id.as_str(), &e.kind), ("evict", &EventType::Preempt));
    let notice = e.notice(SystemTime::now());
    assert!(
        notice > Duration::from_secs(25) && notice <= Duration::from_secs(30),
        "{notice:?}"
    );
    assert!(poller.poll().expect("poll").is_empty(), "reported once");
    // A later document adding an event for another VM only is ignored too.
    fake.set_events(vec![
        scheduled_event(
            "evict",
            "Preempt",
            &["vm-1", "vm-2"],
            now + Duration::from_secs(30),
        ),
        scheduled_event("more", "Terminate", &["vm-3"], now),
    ]);
    assert!(poller.poll().expect("poll").is_empty());
    imds.acknowledge(&["evict"]).expect("ack");
    assert_eq!(fake.acks(), ["evict"]);
}

#[test]
fn imds_down_or_garbage_is_an_error_and_polling_recovers() {
    let fake = FakeImds::start("vm-1").expect("fake imds");
    let mut poller = Poller::new(client(&fake), &["vm-1".to_owned()]);
    fake.set_mode(ImdsMode::Garbage);
    assert!(matches!(poller.poll(), Err(EventsError::Document(_))));
    fake.set_mode(ImdsMode::Down);
    let err = poller.poll().expect_err("down");
    assert!(
        matches!(err, EventsError::Http(_) | EventsError::Io { .. }),
        "{err:?}"
    );
    fake.set_mode(ImdsMode::Normal);
    fake.set_events(vec![scheduled_event(
        "e1",
        "Redeploy",
        &["vm-1"],
        SystemTime::now() + Duration::from_secs(600),
    )]);
    let events = poller.poll().expect("poll after recovery");
    assert_eq!(events.len(), 1);
    assert!(events[0].kind.ends_training());
}

#[test]
fn an_unreachable_imds_is_a_connect_error() {
    // A port nothing listens on.
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    drop(l);
    let imds = Imds::new(&format!("http://{addr}"), Duration::from_millis(500)).expect("addr");
    assert!(matches!(imds.events(), Err(EventsError::Connect { .. })));
}

#[test]
fn an_aws_spot_notice_is_read_through_an_imdsv2_token() {
    let fake = FakeImds::start("vm-1").expect("fake imds");
    let imds = client(&fake);
    assert_eq!(imds.aws_instance_action().expect("none yet"), None);
    fake.set_aws_action(Some(
        serde_json::json!({"action": "terminate", "time": "2030-01-01T00:00:00Z"}),
    ));
    let n = imds.aws_instance_action().expect("notice").expect("some");
    assert_eq!(n.action, "terminate");
    assert!(n.time.is_some());
}

#[test]
fn a_gcp_preemption_is_read_with_the_google_flavor() {
    let fake = FakeImds::start("vm-1").expect("fake imds");
    let imds = client(&fake);
    assert!(!imds.gcp_preempted().expect("not yet"));
    fake.set_gcp_preempted(true);
    assert!(imds.gcp_preempted().expect("preempted"));
}

/// A server that answers every connection with `head` and then sends
/// `body` a chunk at a time, `pause` apart.
fn raw_server(head: &'static str, body: Vec<u8>, chunk: usize, pause: Duration) -> String {
    use std::io::{Read, Write};
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr").to_string();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            let body = body.clone();
            std::thread::spawn(move || {
                let mut req = [0u8; 4096];
                let _ = s.read(&mut req);
                if s.write_all(head.as_bytes()).is_err() {
                    return;
                }
                for c in body.chunks(chunk.max(1)) {
                    if s.write_all(c).is_err() {
                        return;
                    }
                    std::thread::sleep(pause);
                }
            });
        }
    });
    addr
}

#[test]
fn a_slow_imds_answer_ends_at_the_timeout() {
    // Headers at once, then one byte of a 1000-byte body every 100 ms: a
    // read timeout alone would wait 100 s.
    let addr = raw_server(
        "HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n",
        vec![b' '; 1000],
        1,
        Duration::from_millis(100),
    );
    let imds = Imds::new(&format!("http://{addr}"), Duration::from_millis(500)).expect("addr");
    let start = std::time::Instant::now();
    let err = imds.events().expect_err("slow");
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    assert!(matches!(err, EventsError::Io { .. }), "{err:?}");
}

#[test]
fn an_oversized_imds_answer_is_refused() {
    let addr = raw_server(
        "HTTP/1.1 200 OK\r\nContent-Length: 2097152\r\n\r\n",
        vec![b' '; 2 << 20],
        64 << 10,
        Duration::ZERO,
    );
    let imds = Imds::new(&format!("http://{addr}"), Duration::from_secs(5)).expect("addr");
    let err = imds.events().expect_err("too large");
    assert!(
        matches!(&err, EventsError::Http(m) if m.contains("too large")),
        "{err:?}"
    );
}
