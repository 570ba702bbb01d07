//! Places for connections: how many a listener serves at once, in all and
//! per client, and which connection gives up its place when none is free.
//!
//! A new connection has not authenticated yet (nothing of it has been
//! read). Such connections hold at most `max_connections - reserved`
//! places; a connection becomes authenticated when a response to one of
//! its requests carries [`crate::Authenticated`], and from then on it is
//! never made to give way. When a new connection finds no place (every
//! place taken, or every place unauthenticated connections may hold), the
//! oldest unauthenticated connection that is waiting for a request head
//! (none of its requests in flight) is closed and the new one takes its
//! place; with none such, the new connection is refused. A client over
//! its own cap is refused at once, without taking anyone's place.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use crate::client::client_of;
use crate::conn::{ConnState, InFlight, PlaceRef};

/// Why a connection got no place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Every place is held by authenticated connections or requests in
    /// flight.
    Full,
    /// The client holds its share already.
    PerClient,
}

impl Refused {
    /// What the client is told.
    pub fn message(self) -> &'static str {
        match self {
            Refused::Full => "too many connections",
            Refused::PerClient => "too many connections from this address",
        }
    }
}

/// The places of one listener.
#[derive(Debug, Clone)]
pub struct Places {
    state: Arc<Mutex<State>>,
    max: usize,
    per_client: usize,
    anonymous_max: usize,
}

#[derive(Debug, Default)]
pub(crate) struct State {
    total: usize,
    anonymous: usize,
    by_client: HashMap<IpAddr, usize>,
    /// Unauthenticated connections, oldest first.
    waiting: BTreeMap<u64, (IpAddr, Weak<ConnState>)>,
    next: u64,
    evicted: u64,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl State {
    fn release(&mut self, client: IpAddr, anonymous: bool) {
        self.total = self.total.saturating_sub(1);
        if anonymous {
            self.anonymous = self.anonymous.saturating_sub(1);
        }
        if let Some(n) = self.by_client.get_mut(&client) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.by_client.remove(&client);
            }
        }
    }

    /// Closes the oldest unauthenticated connection that waits for a
    /// request head, giving its place back; false if there is none.
    fn evict_one(&mut self) -> bool {
        let mut stale = Vec::new();
        let mut victim = None;
        for (id, (client, conn)) in &self.waiting {
            match conn.upgrade() {
                None => stale.push(*id),
                Some(c) if c.in_flight() => {}
                Some(c) => {
                    victim = Some((*id, *client, c));
                    break;
                }
            }
        }
        for id in stale {
            self.waiting.remove(&id);
        }
        let Some((id, client, conn)) = victim else {
            return false;
        };
        self.waiting.remove(&id);
        conn.released.store(true, Ordering::Relaxed);
        self.release(client, true);
        self.evicted += 1;
        conn.evict.notify_one();
        true
    }

    /// A connection's first authenticated response.
    pub(crate) fn authenticated(&mut self, id: u64, conn: &ConnState) {
        if conn.released.load(Ordering::Relaxed) || conn.authenticated.load(Ordering::Relaxed) {
            return;
        }
        conn.authenticated.store(true, Ordering::Relaxed);
        self.anonymous = self.anonymous.saturating_sub(1);
        self.waiting.remove(&id);
    }
}

impl Places {
    /// `max` places in all, `per_client` for one client, and `reserved`
    /// of them only for connections that have authenticated (each at
    /// least 1 place; unauthenticated connections always get at least one).
    pub fn new(max: usize, per_client: usize, reserved: usize) -> Self {
        let max = max.max(1);
        Self {
            state: Arc::new(Mutex::new(State::default())),
            max,
            per_client: per_client.max(1),
            anonymous_max: max.saturating_sub(reserved).max(1),
        }
    }

    /// A place for a connection from `peer`, or why there is none.
    pub fn admit(&self, peer: IpAddr) -> Result<Place, Refused> {
        let client = client_of(peer);
        let mut s = lock(&self.state);
        if s.by_client.get(&client).copied().unwrap_or(0) >= self.per_client {
            return Err(Refused::PerClient);
        }
        if (s.total >= self.max || s.anonymous >= self.anonymous_max) && !s.evict_one() {
            return Err(Refused::Full);
        }
        // After an eviction both counts are below their caps again.
        let id = s.next;
        s.next += 1;
        s.total += 1;
        s.anonymous += 1;
        *s.by_client.entry(client).or_insert(0) += 1;
        let conn = Arc::new(ConnState::placed(PlaceRef {
            state: Arc::downgrade(&self.state),
            id,
        }));
        s.waiting.insert(id, (client, Arc::downgrade(&conn)));
        Ok(Place {
            state: self.state.clone(),
            client,
            conn: InFlight::from_state(conn),
        })
    }

    /// Connections open now: in all, and of them not authenticated.
    pub fn open(&self) -> (usize, usize) {
        let s = lock(&self.state);
        (s.total, s.anonymous)
    }

    /// Connections closed so far to make room for newer ones.
    pub fn evicted(&self) -> u64 {
        lock(&self.state).evicted
    }
}

/// A connection's place, given back when dropped (unless the connection
/// was closed to make room, which gave it back then).
#[derive(Debug)]
pub struct Place {
    state: Arc<Mutex<State>>,
    client: IpAddr,
    conn: InFlight,
}

impl Place {
    /// The connection's state, for its socket's deadlines and its service.
    pub fn in_flight(&self) -> &InFlight {
        &self.conn
    }

    /// Completes when the connection has been chosen to give up its place:
    /// the connection is then to be closed at once.
    pub async fn evicted(&self) {
        self.conn.state().evict.notified().await
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        let c = self.conn.state();
        let mut s = lock(&self.state);
        if c.released.swap(true, Ordering::Relaxed) {
            return;
        }
        let anonymous = !c.authenticated.load(Ordering::Relaxed);
        if anonymous {
            if let Some(p) = &c.place {
                s.waiting.remove(&p.id);
            }
        }
        s.release(self.client, anonymous);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("address")
    }

    #[test]
    fn a_client_over_its_share_is_refused_and_a_closed_place_comes_back() {
        let p = Places::new(10, 2, 0);
        let a = p.admit(ip("10.0.0.1")).expect("first");
        let _b = p.admit(ip("10.0.0.1")).expect("second");
        assert_eq!(
            p.admit(ip("::ffff:10.0.0.1")).expect_err("third"),
            Refused::PerClient
        );
        let _c = p.admit(ip("10.0.0.2")).expect("another client");
        drop(a);
        let _d = p.admit(ip("10.0.0.1")).expect("after one closed");
        assert_eq!(p.open(), (3, 3));
        assert_eq!(p.evicted(), 0, "a client over its cap takes no one's place");
    }

    #[test]
    fn a_new_connection_takes_the_place_of_the_oldest_waiting_unauthenticated_one() {
        let p = Places::new(3, 10, 0);
        let first = p.admit(ip("10.0.0.1")).expect("1");
        let second = p.admit(ip("10.0.0.2")).expect("2");
        let third = p.admit(ip("10.0.0.3")).expect("3");
        // The first has a request in flight, the second has authenticated:
        // neither gives way; the third does.
        let busy = first.in_flight().enter();
        second.in_flight().authenticate();
        let fourth = p.admit(ip("10.0.0.4")).expect("takes the third's place");
        assert!(third.conn.state().released.load(Ordering::Relaxed));
        assert_eq!(p.evicted(), 1);
        assert_eq!(p.open(), (3, 2));
        // The evicted connection's end gives nothing back twice.
        drop(third);
        assert_eq!(p.open(), (3, 2));
        // The fourth is now the only one that can give way.
        let fifth = p.admit(ip("10.0.0.5")).expect("takes the fourth's place");
        assert!(fourth.conn.state().released.load(Ordering::Relaxed));
        // With the fifth's request in flight too, no one can give way.
        let _busy5 = fifth.in_flight().enter();
        assert_eq!(p.admit(ip("10.0.0.6")).expect_err("6"), Refused::Full);
        // The first's request done, it is the oldest waiting: it gives way.
        drop(busy);
        let _sixth = p.admit(ip("10.0.0.6")).expect("takes the first's place");
        assert!(first.conn.state().released.load(Ordering::Relaxed));
        assert!(!second.conn.state().released.load(Ordering::Relaxed));
    }

    #[test]
    fn unauthenticated_connections_leave_the_reserve_to_authenticated_ones() {
        // 4 places, 2 reserved: two unauthenticated connections at most.
        let p = Places::new(4, 10, 2);
        let a = p.admit(ip("10.0.0.1")).expect("a");
        let b = p.admit(ip("10.0.0.2")).expect("b");
        let _ab = a.in_flight().enter();
        let _bb = b.in_flight().enter();
        // Both unauthenticated places are busy and nothing can give way.
        assert_eq!(p.admit(ip("10.0.0.3")).expect_err("c"), Refused::Full);
        // Authenticated, they leave room for two more.
        a.in_flight().authenticate();
        b.in_flight().authenticate();
        let c = p.admit(ip("10.0.0.3")).expect("c");
        c.in_flight().authenticate();
        let d = p.admit(ip("10.0.0.4")).expect("d");
        d.in_flight().authenticate();
        assert_eq!(p.open(), (4, 0));
        // Every place authenticated: no one gives way.
        assert_eq!(p.admit(ip("10.0.0.5")).expect_err("e"), Refused::Full);
        drop(d);
        let _e = p.admit(ip("10.0.0.5")).expect("e");
        assert_eq!(p.open(), (4, 1));
    }
}
