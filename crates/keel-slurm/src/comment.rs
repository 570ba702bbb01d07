//! A job's `Comment` as words a marker can be added to and found in.
//!
//! `keel run --slurm` appends [`RUN_MARKER`] to the Comment of the job it
//! supervises; with `AccountingStoreFlags=job_comment` the comment reaches
//! slurmdbd and `sacct --json` returns it (`comment.job`), which is how
//! `keel cost` tells the jobs that ran under `keel run` (checkpointed and
//! requeued on failure) from the others.
//!
//! The Comment is the one field of a job its owner can set that sacct can
//! return: `AdminComment` and `SystemComment` are always accounted but only
//! an administrator (or a plugin) may set them.

/// The word `keel run --slurm` adds to its job's Comment.
pub const RUN_MARKER: &str = "keel-run";

/// Whether `comment` holds `marker` as one of its words (separated by
/// whitespace, `,` or `;`).
pub fn has_marker(comment: &str, marker: &str) -> bool {
    !marker.is_empty()
        && comment
            .split(|c: char| c.is_whitespace() || c == ',' || c == ';')
            .any(|w| w == marker)
}

/// `comment` with `marker` appended after a space (or alone, for a blank
/// comment), keeping every character of the comment; `None` when the
/// comment already has it.
pub fn with_marker(comment: &str, marker: &str) -> Option<String> {
    if has_marker(comment, marker) {
        return None;
    }
    if comment.trim().is_empty() {
        return Some(marker.to_owned());
    }
    let sep = if comment.ends_with(char::is_whitespace) {
        ""
    } else {
        " "
    };
    Some(format!("{comment}{sep}{marker}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_marker_is_a_word_of_the_comment() {
        assert!(has_marker("keel-run", RUN_MARKER));
        assert!(has_marker("team=ml keel-run", RUN_MARKER));
        assert!(has_marker("keel-run;team=ml", RUN_MARKER));
        assert!(has_marker("a,keel-run,b", RUN_MARKER));
        assert!(!has_marker("", RUN_MARKER));
        assert!(!has_marker("keel-runner", RUN_MARKER));
        assert!(!has_marker("not-keel-run", RUN_MARKER));
        assert!(!has_marker("keel-run", ""));
    }

    #[test]
    fn the_marker_is_appended_once_and_the_comment_kept() {
        assert_eq!(with_marker("", RUN_MARKER).as_deref(), Some("keel-run"));
        assert_eq!(with_marker("  ", RUN_MARKER).as_deref(), Some("keel-run"));
        assert_eq!(
            with_marker("team=ml a|b", RUN_MARKER).as_deref(),
            Some("team=ml a|b keel-run")
        );
        assert_eq!(
            with_marker("ends in a space ", RUN_MARKER).as_deref(),
            Some("ends in a space keel-run")
        );
        assert_eq!(with_marker("team=ml keel-run", RUN_MARKER), None);
        let once = with_marker("x", RUN_MARKER).expect("added");
        assert_eq!(with_marker(&once, RUN_MARKER), None);
    }

    proptest::proptest! {
        #[test]
        fn marking_keeps_the_comment_and_is_idempotent(comment in "[ -~]{0,60}") {
            match with_marker(&comment, RUN_MARKER) {
                Some(marked) => {
                    proptest::prop_assert!(marked.starts_with(comment.trim_end()));
                    proptest::prop_assert!(has_marker(&marked, RUN_MARKER));
                    proptest::prop_assert_eq!(with_marker(&marked, RUN_MARKER), None);
                }
                None => proptest::prop_assert!(has_marker(&comment, RUN_MARKER)),
            }
        }
    }
}
