//! What kind of failure an error is, as a contract between keel's
//! libraries and whoever reports their errors: the binary maps a kind to
//! an exit code (README.md, "Exit codes") without knowing each crate's
//! error types.
//!
//! Each library crate implements [`HasKind`] for its error types and
//! exports one [`Classifier`] (`error_kind`) that recognises them (and
//! the errors of the crates it passes errors on from); the binary walks an
//! error's chain with [`kind_of`] over the classifiers of the crates it
//! calls.

use std::error::Error;

/// What kind of failure an error is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The request cannot be carried out as asked: a bad flag, name,
    /// configuration, or a state that refuses the operation.
    Usage,
    /// Input data is malformed: a file, sysfs or procfs, a report, a
    /// manifest.
    Input,
    /// Something needed is unavailable, so the answer is unknown: no GPU,
    /// a library or driver missing, a service that does not answer.
    Unavailable,
    /// Reading or writing (a file, object storage, a database) failed.
    Io,
    /// A service refused the credentials.
    Permission,
    /// What was checked is wrong: a digest or signature that does not
    /// match, a GPU call that failed during a run, a step that failed.
    Failed,
}

/// An error that knows its kind.
pub trait HasKind {
    fn kind(&self) -> ErrorKind;
}

/// Recognises the errors of one crate (and of those it passes errors on
/// from): their kind, or `None` for an error it does not know.
pub type Classifier = fn(&(dyn Error + 'static)) -> Option<ErrorKind>;

/// The kind of `e` when it is a `T`.
pub fn downcast<T: HasKind + Error + 'static>(e: &(dyn Error + 'static)) -> Option<ErrorKind> {
    e.downcast_ref::<T>().map(HasKind::kind)
}

/// A crate's [`Classifier`] over its error types, and then over the
/// classifiers of crates whose errors it passes on:
/// `classify!(e; TopoError, PlanError; keel_store::error_kind)`.
#[macro_export]
macro_rules! classify {
    ($e:expr; $($t:ty),* $(,)? $(; $($other:path),* $(,)?)?) => {{
        let e: &(dyn ::std::error::Error + 'static) = $e;
        None$(.or_else(|| $crate::downcast::<$t>(e)))*
            $($(.or_else(|| $other(e)))*)?
    }};
}

/// The kind of the first error in `err`'s chain (itself, then its
/// sources) that one of `classifiers` recognises.
pub fn kind_of(err: &(dyn Error + 'static), classifiers: &[Classifier]) -> Option<ErrorKind> {
    let mut e = Some(err);
    while let Some(cur) = e {
        if let Some(k) = classifiers.iter().find_map(|c| c(cur)) {
            return Some(k);
        }
        e = cur.source();
    }
    None
}

/// An error and its sources on one line, `: `-separated (for a log line
/// or a stored status message).
pub fn one_line(e: &(dyn Error + '_)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fmt;

    #[derive(Debug)]
    struct Inner;
    impl fmt::Display for Inner {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("inner")
        }
    }
    impl Error for Inner {}
    impl HasKind for Inner {
        fn kind(&self) -> ErrorKind {
            ErrorKind::Input
        }
    }

    #[derive(Debug)]
    struct Outer(Inner);
    impl fmt::Display for Outer {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("outer")
        }
    }
    impl Error for Outer {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            Some(&self.0)
        }
    }

    #[derive(Debug)]
    struct Unknown;
    impl fmt::Display for Unknown {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("unknown")
        }
    }
    impl Error for Unknown {}

    fn inner_only(e: &(dyn Error + 'static)) -> Option<ErrorKind> {
        classify!(e; Inner)
    }

    #[test]
    fn the_first_error_in_the_chain_a_classifier_knows_gives_the_kind() {
        assert_eq!(
            kind_of(&Outer(Inner), &[inner_only]),
            Some(ErrorKind::Input)
        );
        assert_eq!(kind_of(&Unknown, &[inner_only]), None);
        assert_eq!(kind_of(&Inner, &[]), None);
    }

    #[test]
    fn one_line_joins_the_chain() {
        assert_eq!(one_line(&Outer(Inner)), "outer: inner");
        assert_eq!(one_line(&Inner), "inner");
    }

    #[test]
    fn a_classifier_passes_on_to_the_crates_it_names() {
        fn outer(e: &(dyn Error + 'static)) -> Option<ErrorKind> {
            classify!(e; ; inner_only)
        }
        assert_eq!(outer(&Inner), Some(ErrorKind::Input));
        assert_eq!(outer(&Unknown), None);
    }
}
