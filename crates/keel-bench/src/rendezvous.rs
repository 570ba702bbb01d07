//! Handing NCCL's 128-byte unique id from rank 0 to every other rank over
//! TCP, with no MPI.
//!
//! Rank 0 listens (on all interfaces, at the rendezvous port) and waits for
//! the other `world - 1` ranks; each connects (retrying until rank 0 is
//! up), says who it is (`KEELRDV1`, world size, rank, as big-endian u32s),
//! and once all have arrived rank 0 answers each with `KEELRDV1` and the
//! id. Everything happens under one deadline: a rank that never comes is a
//! [`RendezvousError::Timeout`] naming it, on rank 0 and on the others.
//! A connection that does not start with the magic (a port scanner) is
//! dropped and does not count; a keel rank with another world size or a
//! rank already taken is an error (two jobs on one port).

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::Monotonic;

pub const ID_LEN: usize = 128;
const MAGIC: &[u8; 8] = b"KEELRDV1";
const HELLO_LEN: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum RendezvousError {
    #[error("cannot listen on {addr} for the other ranks")]
    Bind {
        addr: String,
        #[source]
        source: io::Error,
    },
    #[error("cannot resolve the rendezvous address {addr}")]
    Resolve {
        addr: String,
        #[source]
        source: io::Error,
    },
    #[error("rendezvous at {addr} timed out after {seconds} s: {what}")]
    Timeout {
        addr: String,
        seconds: f64,
        what: String,
    },
    #[error("rendezvous at {addr}: {reason}")]
    Protocol { addr: String, reason: String },
    #[error("rendezvous at {addr} failed")]
    Io {
        addr: String,
        #[source]
        source: io::Error,
    },
}

/// The address rank 0 listens on for a rendezvous at `endpoint`
/// (`HOST:PORT`): every interface, that port.
pub fn listen_addr(endpoint: &str) -> Result<SocketAddr, RendezvousError> {
    let port = endpoint
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse::<u16>().ok())
        .ok_or_else(|| RendezvousError::Protocol {
            addr: endpoint.into(),
            reason: "the rendezvous address must be HOST:PORT".into(),
        })?;
    Ok(SocketAddr::from(([0, 0, 0, 0], port)))
}

/// Binds rank 0's listener.
pub fn bind(endpoint: &str) -> Result<TcpListener, RendezvousError> {
    let addr = listen_addr(endpoint)?;
    TcpListener::bind(addr).map_err(|source| RendezvousError::Bind {
        addr: addr.to_string(),
        source,
    })
}

fn remaining(clock: &dyn Monotonic, deadline: Instant) -> Option<Duration> {
    deadline
        .checked_duration_since(clock.now())
        .filter(|d| !d.is_zero())
}

/// Rank 0: waits on `listener` for ranks `1..world`, then sends each `id`.
pub fn serve(
    listener: &TcpListener,
    world: usize,
    id: &[u8; ID_LEN],
    timeout: Duration,
    clock: &dyn Monotonic,
) -> Result<(), RendezvousError> {
    let addr = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "?".into());
    let io_err = |source| RendezvousError::Io {
        addr: addr.clone(),
        source,
    };
    let deadline = clock.now() + timeout;
    listener.set_nonblocking(true).map_err(io_err)?;
    let mut peers: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    let mut joined = 1;
    while joined < world {
        let Some(left) = remaining(clock, deadline) else {
            let missing: Vec<String> = (1..world)
                .filter(|r| peers[*r].is_none())
                .map(|r| r.to_string())
                .collect();
            return Err(RendezvousError::Timeout {
                addr,
                seconds: timeout.as_secs_f64(),
                what: format!(
                    "rank(s) {} of {world} did not join (are they running, with the same rendezvous address?)",
                    missing.join(", ")
                ),
            });
        };
        let mut stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5).min(left));
                continue;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(io_err(e)),
        };
        stream.set_nonblocking(false).map_err(io_err)?;
        stream
            .set_read_timeout(Some(left.min(Duration::from_secs(5))))
            .map_err(io_err)?;
        let mut hello = [0u8; HELLO_LEN];
        if stream.read_exact(&mut hello).is_err() || &hello[..8] != MAGIC {
            // Not a keel rank (or one that gave up): ignore it.
            continue;
        }
        let their_world = u32::from_be_bytes([hello[8], hello[9], hello[10], hello[11]]) as usize;
        let rank = u32::from_be_bytes([hello[12], hello[13], hello[14], hello[15]]) as usize;
        if their_world != world {
            return Err(RendezvousError::Protocol {
                addr,
                reason: format!(
                    "rank {rank} says the job has {their_world} ranks, rank 0 has {world} (two jobs on one port?)"
                ),
            });
        }
        if rank == 0 || rank >= world || peers[rank].is_some() {
            return Err(RendezvousError::Protocol {
                addr,
                reason: format!("rank {rank} joined twice or is out of range 1..{world}"),
            });
        }
        peers[rank] = Some(stream);
        joined += 1;
    }
    let mut reply = Vec::with_capacity(8 + ID_LEN);
    reply.extend_from_slice(MAGIC);
    reply.extend_from_slice(id);
    for mut s in peers.into_iter().flatten() {
        s.write_all(&reply).map_err(io_err)?;
    }
    Ok(())
}

/// Ranks 1..world: connects to rank 0 at `endpoint` (retrying until it
/// listens) and returns the id it sends.
pub fn join(
    endpoint: &str,
    rank: usize,
    world: usize,
    timeout: Duration,
    clock: &dyn Monotonic,
) -> Result<[u8; ID_LEN], RendezvousError> {
    let deadline = clock.now() + timeout;
    let timed_out = |what: &str| RendezvousError::Timeout {
        addr: endpoint.into(),
        seconds: timeout.as_secs_f64(),
        what: what.into(),
    };
    let mut last_error = String::from("no attempt");
    let mut stream = loop {
        let Some(left) = remaining(clock, deadline) else {
            return Err(timed_out(&format!(
                "rank 0 did not answer (last error: {last_error}); is it running and is the port reachable?"
            )));
        };
        let addrs: Vec<SocketAddr> = match endpoint.to_socket_addrs() {
            Ok(a) => a.collect(),
            Err(source) => {
                return Err(RendezvousError::Resolve {
                    addr: endpoint.into(),
                    source,
                })
            }
        };
        let mut connected = None;
        for a in &addrs {
            match TcpStream::connect_timeout(a, left.min(Duration::from_secs(2))) {
                Ok(s) => {
                    connected = Some(s);
                    break;
                }
                Err(e) => last_error = e.to_string(),
            }
        }
        match connected {
            Some(s) => break s,
            None => std::thread::sleep(Duration::from_millis(100).min(left)),
        }
    };
    let io_err = |source| RendezvousError::Io {
        addr: endpoint.into(),
        source,
    };
    let mut hello = [0u8; HELLO_LEN];
    hello[..8].copy_from_slice(MAGIC);
    hello[8..12].copy_from_slice(&(world as u32).to_be_bytes());
    hello[12..].copy_from_slice(&(rank as u32).to_be_bytes());
    stream.write_all(&hello).map_err(io_err)?;
    let left = remaining(clock, deadline).ok_or_else(|| timed_out("no id from rank 0"))?;
    stream.set_read_timeout(Some(left)).map_err(io_err)?;
    let mut reply = [0u8; 8 + ID_LEN];
    match stream.read_exact(&mut reply) {
        Ok(()) => {}
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            return Err(timed_out(
                "rank 0 accepted but sent no id: some other rank did not join",
            ))
        }
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
            return Err(RendezvousError::Protocol {
                addr: endpoint.into(),
                reason:
                    "rank 0 closed the connection without sending the id (it failed or timed out)"
                        .into(),
            })
        }
        Err(e) => return Err(io_err(e)),
    }
    if &reply[..8] != MAGIC {
        return Err(RendezvousError::Protocol {
            addr: endpoint.into(),
            reason: "the answer is not from a keel rank 0".into(),
        });
    }
    let mut id = [0u8; ID_LEN];
    id.copy_from_slice(&reply[8..]);
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SystemClock;

    fn id() -> [u8; ID_LEN] {
        let mut id = [0u8; ID_LEN];
        for (i, b) in id.iter_mut().enumerate() {
            *b = (i * 7 + 3) as u8;
        }
        id
    }

    #[test]
    fn every_rank_gets_the_id_even_when_rank_0_starts_last() {
        let probe = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = probe.local_addr().expect("addr").port();
        drop(probe);
        let endpoint = format!("127.0.0.1:{port}");
        let world = 4;
        let joiners: Vec<_> = (1..world)
            .map(|r| {
                let e = endpoint.clone();
                std::thread::spawn(move || {
                    join(&e, r, world, Duration::from_secs(20), &SystemClock)
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(300));
        let listener = bind(&endpoint).expect("rank 0 binds");
        serve(
            &listener,
            world,
            &id(),
            Duration::from_secs(20),
            &SystemClock,
        )
        .expect("serve");
        for j in joiners {
            assert_eq!(j.join().expect("thread").expect("id"), id());
        }
    }

    #[test]
    fn rank_0_times_out_naming_the_missing_ranks() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let endpoint = listener.local_addr().expect("addr").to_string();
        let e2 = endpoint.clone();
        let one = std::thread::spawn(move || join(&e2, 1, 4, Duration::from_secs(3), &SystemClock));
        let err = serve(
            &listener,
            4,
            &id(),
            Duration::from_millis(800),
            &SystemClock,
        )
        .expect_err("ranks 2 and 3 never come");
        let msg = err.to_string();
        assert!(matches!(err, RendezvousError::Timeout { .. }), "{msg}");
        assert!(msg.contains("rank(s) 2, 3 of 4 did not join"), "{msg}");
        // Rank 1 sees rank 0 give up.
        drop(listener);
        let r1 = one.join().expect("thread").expect_err("no id");
        assert!(
            matches!(
                r1,
                RendezvousError::Protocol { .. } | RendezvousError::Timeout { .. }
            ),
            "{r1}"
        );
    }

    #[test]
    fn a_rank_without_rank_0_times_out() {
        let probe = TcpListener::bind("127.0.0.1:0").expect("bind");
        let endpoint = probe.local_addr().expect("addr").to_string();
        drop(probe);
        let started = Instant::now();
        let err = join(&endpoint, 1, 2, Duration::from_millis(500), &SystemClock)
            .expect_err("nobody listens");
        assert!(started.elapsed() < Duration::from_secs(5));
        let msg = err.to_string();
        assert!(msg.contains("rank 0 did not answer"), "{msg}");
        assert!(msg.contains(&endpoint), "{msg}");
    }

    #[test]
    fn strangers_are_ignored_and_mismatched_jobs_rejected() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let endpoint = listener.local_addr().expect("addr").to_string();
        let e2 = endpoint.clone();
        let others = std::thread::spawn(move || {
            // A port scanner: connects, says nothing useful, leaves.
            let mut s = TcpStream::connect(&e2).expect("connect");
            s.write_all(b"GET / HTTP/1.0\r\n\r\n").expect("write");
            drop(s);
            join(&e2, 1, 2, Duration::from_secs(10), &SystemClock)
        });
        serve(&listener, 2, &id(), Duration::from_secs(10), &SystemClock).expect("serve");
        assert_eq!(others.join().expect("thread").expect("id"), id());

        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let endpoint = listener.local_addr().expect("addr").to_string();
        let other_job =
            std::thread::spawn(move || join(&endpoint, 1, 8, Duration::from_secs(5), &SystemClock));
        let err = serve(&listener, 2, &id(), Duration::from_secs(5), &SystemClock)
            .expect_err("world sizes differ");
        assert!(
            err.to_string()
                .contains("says the job has 8 ranks, rank 0 has 2"),
            "{err}"
        );
        drop(listener);
        let _ = other_job.join();
    }

    #[test]
    fn listen_address_needs_a_port() {
        assert_eq!(
            listen_addr("node01:29500").expect("addr"),
            SocketAddr::from(([0, 0, 0, 0], 29500))
        );
        assert!(listen_addr("node01").is_err());
        assert!(listen_addr("node01:http").is_err());
    }
}
