//! The TCP rendezvous between separate processes, as `srun` starts them:
//! this test binary re-runs itself as the other ranks.

use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::Duration;

use keel_bench::rendezvous::{self, ID_LEN};
use keel_bench::SystemClock;

const CHILD: &str = "KEEL_TEST_RENDEZVOUS_CHILD";

/// Runs as a rank when this binary is started by the tests below.
#[test]
fn child_rank() {
    let Ok(spec) = std::env::var(CHILD) else {
        return;
    };
    let parts: Vec<&str> = spec.split(',').collect();
    let (endpoint, rank, world, timeout_ms) = (
        parts[0],
        parts[1].parse().expect("rank"),
        parts[2].parse().expect("world"),
        parts[3].parse().expect("timeout"),
    );
    match rendezvous::join(
        endpoint,
        rank,
        world,
        Duration::from_millis(timeout_ms),
        &SystemClock,
    ) {
        Ok(id) => println!(
            "ID {}",
            id.iter().map(|b| format!("{b:02x}")).collect::<String>()
        ),
        Err(e) => println!("ERROR {e}"),
    }
}

fn spawn(endpoint: &str, rank: usize, world: usize, timeout_ms: u64) -> std::process::Child {
    Command::new(std::env::current_exe().expect("exe"))
        .args(["--exact", "child_rank", "--nocapture", "--test-threads=1"])
        .env(CHILD, format!("{endpoint},{rank},{world},{timeout_ms}"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn rank")
}

fn answer(child: std::process::Child) -> String {
    let out = child.wait_with_output().expect("rank output");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        // libtest may print "test child_rank ... " before it on the line.
        .find_map(|l| {
            l.find("ID ")
                .or_else(|| l.find("ERROR "))
                .map(|i| l[i..].to_owned())
        })
        .unwrap_or_else(|| "(no answer)".to_owned())
}

#[test]
fn processes_exchange_the_id() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let endpoint = listener.local_addr().expect("addr").to_string();
    let world = 4;
    let children: Vec<_> = (1..world)
        .map(|r| spawn(&endpoint, r, world, 30_000))
        .collect();
    let mut id = [0u8; ID_LEN];
    for (i, b) in id.iter_mut().enumerate() {
        *b = (255 - i) as u8;
    }
    rendezvous::serve(&listener, world, &id, Duration::from_secs(30), &SystemClock)
        .expect("every rank joins");
    let want = format!(
        "ID {}",
        id.iter().map(|b| format!("{b:02x}")).collect::<String>()
    );
    for c in children {
        assert_eq!(answer(c), want);
    }
}

#[test]
fn a_process_without_rank_0_times_out_with_a_clear_error() {
    let probe = TcpListener::bind("127.0.0.1:0").expect("bind");
    let endpoint = probe.local_addr().expect("addr").to_string();
    drop(probe);
    let got = answer(spawn(&endpoint, 1, 2, 700));
    assert!(
        got.starts_with(&format!(
            "ERROR rendezvous at {endpoint} timed out after 0.7 s: rank 0 did not answer"
        )),
        "{got}"
    );
}

#[test]
fn rank_0_times_out_when_a_process_is_missing() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let endpoint = listener.local_addr().expect("addr").to_string();
    let one = spawn(&endpoint, 1, 3, 5_000);
    let err = rendezvous::serve(
        &listener,
        3,
        &[7; ID_LEN],
        Duration::from_millis(1500),
        &SystemClock,
    )
    .expect_err("rank 2 never starts");
    assert!(
        err.to_string().contains("rank(s) 2 of 3 did not join"),
        "{err}"
    );
    drop(listener);
    let got = answer(one);
    assert!(got.starts_with("ERROR rendezvous at"), "{got}");
}
