//! The bytes of request and response bodies the gateway holds at once,
//! across every connection: one atomic counter, taken from before a body
//! is read (or as its chunks arrive when it has no length) and given back
//! when the body is dropped or handed on. What does not fit is refused
//! (503) instead of being buffered.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// The counter of body bytes held.
#[derive(Debug, Clone, Default)]
pub struct BodyBudget(Arc<AtomicUsize>);

impl BodyBudget {
    /// Bytes held now.
    pub fn held(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }

    /// A permit holding nothing yet, to [`BodyPermit::grow`].
    pub fn permit(&self) -> BodyPermit {
        BodyPermit {
            budget: self.clone(),
            held: 0,
        }
    }

    /// A permit for `n` bytes, if they fit under `limit`.
    pub fn take(&self, n: usize, limit: usize) -> Option<BodyPermit> {
        let mut p = self.permit();
        p.grow(n, limit).then_some(p)
    }
}

/// Bytes taken from the budget, given back when dropped.
#[derive(Debug)]
pub struct BodyPermit {
    budget: BodyBudget,
    held: usize,
}

impl BodyPermit {
    /// Takes `n` more bytes if they fit under `limit`.
    pub fn grow(&mut self, n: usize, limit: usize) -> bool {
        if n == 0 {
            return true;
        }
        let before = self.budget.0.fetch_add(n, Ordering::AcqRel);
        if before.saturating_add(n) > limit {
            self.budget.0.fetch_sub(n, Ordering::AcqRel);
            return false;
        }
        self.held += n;
        true
    }

    /// Gives back `n` of the bytes held (at most all of them).
    pub fn release(&mut self, n: usize) {
        let n = n.min(self.held);
        if n > 0 {
            self.held -= n;
            self.budget.0.fetch_sub(n, Ordering::AcqRel);
        }
    }

    pub fn held(&self) -> usize {
        self.held
    }
}

impl Drop for BodyPermit {
    fn drop(&mut self) {
        if self.held > 0 {
            self.budget.0.fetch_sub(self.held, Ordering::AcqRel);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permits_fit_under_the_limit_and_give_back_what_they_hold() {
        let b = BodyBudget::default();
        let mut a = b.take(60, 100).expect("fits");
        assert!(b.take(41, 100).is_none(), "60 + 41 > 100");
        assert_eq!(b.held(), 60, "a refused take leaves nothing behind");
        let c = b.take(40, 100).expect("fits exactly");
        assert!(!a.grow(1, 100));
        drop(c);
        assert!(a.grow(30, 100));
        assert_eq!(b.held(), 90);
        a.release(50);
        assert_eq!((a.held(), b.held()), (40, 40));
        a.release(1000);
        assert_eq!((a.held(), b.held()), (0, 0));
        let d = b.take(0, 0).expect("nothing always fits");
        drop(d);
        let e = b.take(70, 100).expect("fits");
        drop(e);
        assert_eq!(b.held(), 0);
    }
}
