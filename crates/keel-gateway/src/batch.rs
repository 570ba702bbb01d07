//! Off-the-request-path writing: callers push items under a short lock and
//! never wake anyone; one thread takes what has queued every few
//! milliseconds (20 ms while busy, backing off to 50 ms when idle) and
//! hands it to a sink (the audit log, the access log). Per-item wake-ups
//! cost the gateway more CPU than the writing itself, and each wake-up of
//! these threads takes a core from the requests for a moment.
//!
//! The threads also run at the lowest priority (nice 19): a batch is a
//! burst of a few hundred microseconds of serialising and hashing, and at
//! normal priority that burst can take the core the serving thread was
//! about to run on. At nice 19 the scheduler lets a waking serving thread
//! preempt the writer and does not let the writer preempt it; on a busy
//! machine the writer still gets a share of a core, and whatever a core
//! leaves idle.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often a busy queue is drained.
const BUSY: Duration = Duration::from_millis(20);

#[derive(Debug)]
struct Shared<T> {
    queue: Mutex<Vec<T>>,
    closed: AtomicBool,
    busy: AtomicBool,
}

/// A queue drained in batches by a thread of its own.
#[derive(Debug)]
pub struct Batcher<T> {
    shared: Arc<Shared<T>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl<T: Send + 'static> Batcher<T> {
    /// Starts the thread; `sink(batch, last)` gets every non-empty batch in
    /// order, and is called once more with `last` true when closing.
    pub fn spawn(
        name: &str,
        sink: impl FnMut(Vec<T>, bool) + Send + 'static,
    ) -> std::io::Result<Self> {
        Self::spawn_with(name, true, sink)
    }

    /// `spawn`, choosing whether the thread runs at the lowest priority: a
    /// writer whose batches callers wait for (a synced audit log) keeps
    /// the normal one.
    pub fn spawn_with(
        name: &str,
        lowest_priority: bool,
        mut sink: impl FnMut(Vec<T>, bool) + Send + 'static,
    ) -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Vec::new()),
            closed: AtomicBool::new(false),
            busy: AtomicBool::new(false),
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                if lowest_priority {
                    lower_priority();
                }
                let mut wait = BUSY;
                loop {
                    std::thread::park_timeout(wait);
                    let closed = s.closed.load(Ordering::SeqCst);
                    s.busy.store(true, Ordering::SeqCst);
                    let batch =
                        std::mem::take(&mut *s.queue.lock().unwrap_or_else(|p| p.into_inner()));
                    if batch.is_empty() {
                        wait = (wait * 2).min(Duration::from_millis(50));
                    } else {
                        wait = BUSY;
                        sink(batch, false);
                    }
                    s.busy.store(false, Ordering::SeqCst);
                    if closed {
                        let rest =
                            std::mem::take(&mut *s.queue.lock().unwrap_or_else(|p| p.into_inner()));
                        sink(rest, true);
                        break;
                    }
                }
            })?;
        Ok(Self {
            shared,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Queues an item, or once the batcher is closing gives it back.
    /// Checked under the queue's lock, so an item either reaches the last
    /// batch or is given back here, never lost in between.
    pub fn push(&self, item: T) -> Result<(), T> {
        let mut q = self.shared.queue.lock().unwrap_or_else(|p| p.into_inner());
        if self.shared.closed.load(Ordering::SeqCst) {
            return Err(item);
        }
        q.push(item);
        Ok(())
    }

    /// `push`, and wakes the thread now: for an item whose caller waits
    /// for its batch. Items queued meanwhile join the same batch.
    pub fn push_now(&self, item: T) -> Result<(), T> {
        self.push(item)?;
        if let Some(t) = self
            .thread
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            t.thread().unpark();
        }
        Ok(())
    }

    /// Hands over what is queued, calls the sink a last time and stops.
    pub fn close(&self) {
        self.shared.closed.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }

    /// Waits (up to `limit`) until everything pushed so far was handed to
    /// the sink, without stopping the thread.
    pub fn drain(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        if let Some(t) = self
            .thread
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            t.thread().unpark();
        }
        while Instant::now() < deadline {
            let empty = self
                .shared
                .queue
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_empty();
            if empty && !self.shared.busy.load(Ordering::SeqCst) {
                return;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

impl<T> Drop for Batcher<T> {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

/// Puts the calling thread at nice 19. Raising a thread's nice value is
/// always allowed; if it fails all the same, the thread runs on at the
/// priority it has, which only costs latency.
fn lower_priority() {
    // `PRIO_PROCESS` with no id is the calling thread on Linux.
    #[cfg(target_os = "linux")]
    if let Err(e) = rustix::process::setpriority_process(None, 19) {
        tracing::debug!(error = %e, "could not lower a writer thread's priority");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn everything_pushed_reaches_the_sink_in_order() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        let b = Batcher::spawn("test", move |batch: Vec<u32>, _| {
            s.lock().expect("lock").extend(batch)
        })
        .expect("spawn");
        for i in 0..1000 {
            b.push(i).expect("open");
        }
        b.drain(Duration::from_secs(2));
        assert_eq!(seen.lock().expect("lock").len(), 1000);
        for i in 1000..1100 {
            b.push(i).expect("open");
        }
        b.close();
        let v = seen.lock().expect("lock").clone();
        assert_eq!(v, (0..1100).collect::<Vec<_>>());
        assert_eq!(b.push(5), Err(5), "given back after close");
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn the_writer_thread_runs_at_the_lowest_priority() {
        let before = rustix::process::getpriority_process(None).expect("getpriority");
        let seen = Arc::new(Mutex::new(None));
        let s = seen.clone();
        let b = Batcher::spawn("test-nice", move |_: Vec<u32>, _| {
            *s.lock().expect("lock") = Some(rustix::process::getpriority_process(None));
        })
        .expect("spawn");
        b.push(1).expect("open");
        b.drain(Duration::from_secs(2));
        let nice = seen.lock().expect("lock").take().expect("the sink ran");
        assert_eq!(nice.expect("getpriority"), 19);
        // The thread that pushed keeps its own priority.
        assert_eq!(
            rustix::process::getpriority_process(None).expect("getpriority"),
            before
        );
    }
}
