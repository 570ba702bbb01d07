//! Slurm's hostlist syntax, expanded without asking Slurm:
//! `n[1-3,5],gpu01` is `n1 n2 n3 n5 gpu01`. Zero padding is kept
//! (`gpu[01-10]`); several bracket groups multiply (`r[1-2]n[1-2]` is
//! `r1n1 r1n2 r2n1 r2n2`), the way `scontrol show hostnames` does. Text
//! after the last bracket (`n[1-2]-ib`) is kept as a suffix, which Slurm
//! 22.05 rejects as an invalid hostlist.

/// The most names one hostlist may expand to; more is an error rather than
/// an allocation the size of the input's numbers.
pub const MAX_HOSTS: usize = 1 << 16;

/// Why a hostlist could not be expanded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostlistError {
    #[error("unbalanced brackets in hostlist {list:?}")]
    Brackets { list: String },
    #[error("bad range {range:?} in hostlist {list:?}")]
    Range { list: String, range: String },
    #[error("hostlist {list:?} expands to more than {MAX_HOSTS} names")]
    TooLarge { list: String },
}

/// Expands a hostlist into node names, in order, duplicates kept.
/// Whitespace around names and empty entries (`a,,b`) are ignored.
pub fn expand_hostlist(list: &str) -> Result<Vec<String>, HostlistError> {
    let mut names = Vec::new();
    for item in split_top_level(list)? {
        let item = item.trim();
        if item.is_empty() {
            continue;
        }
        expand_item(list, item, &mut names)?;
    }
    Ok(names)
}

/// Splits at commas outside brackets.
fn split_top_level(list: &str) -> Result<Vec<&str>, HostlistError> {
    let brackets = || HostlistError::Brackets {
        list: list.to_owned(),
    };
    let mut items = Vec::new();
    let mut depth = 0u32;
    let mut start = 0;
    for (at, c) in list.char_indices() {
        match c {
            '[' if depth == 0 => depth = 1,
            '[' => return Err(brackets()),
            ']' if depth == 1 => depth = 0,
            ']' => return Err(brackets()),
            ',' if depth == 0 => {
                items.push(&list[start..at]);
                start = at + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(brackets());
    }
    items.push(&list[start..]);
    Ok(items)
}

/// Expands one `prefix[ranges]suffix[ranges]...` item onto `names`.
fn expand_item(list: &str, item: &str, names: &mut Vec<String>) -> Result<(), HostlistError> {
    let mut partial = vec![String::new()];
    let mut rest = item;
    while let Some(open) = rest.find('[') {
        let close =
            rest[open..]
                .find(']')
                .map(|c| open + c)
                .ok_or_else(|| HostlistError::Brackets {
                    list: list.to_owned(),
                })?;
        let text = &rest[..open];
        let numbers = ranges(list, &rest[open + 1..close])?;
        if partial.len().saturating_mul(numbers.len()) + names.len() > MAX_HOSTS {
            return Err(HostlistError::TooLarge {
                list: list.to_owned(),
            });
        }
        partial = partial
            .iter()
            .flat_map(|head| numbers.iter().map(move |n| format!("{head}{text}{n}")))
            .collect();
        rest = &rest[close + 1..];
    }
    names.extend(partial.into_iter().map(|head| head + rest));
    Ok(())
}

/// Expands `1-3,05,7-8` into the numbers as text, padded to the width of
/// each range's lower bound when it has a leading zero.
fn ranges(list: &str, inside: &str) -> Result<Vec<String>, HostlistError> {
    let mut out = Vec::new();
    for range in inside.split(',') {
        let bad = || HostlistError::Range {
            list: list.to_owned(),
            range: range.to_owned(),
        };
        let range_trimmed = range.trim();
        let (lo, hi) = range_trimmed
            .split_once('-')
            .unwrap_or((range_trimmed, range_trimmed));
        let digits =
            |s: &str| !s.is_empty() && s.len() <= 18 && s.bytes().all(|b| b.is_ascii_digit());
        if !digits(lo) || !digits(hi) {
            return Err(bad());
        }
        let (Ok(start), Ok(end)) = (lo.parse::<u64>(), hi.parse::<u64>()) else {
            return Err(bad());
        };
        if end < start {
            return Err(bad());
        }
        if (end - start) as usize >= MAX_HOSTS.saturating_sub(out.len()) {
            return Err(HostlistError::TooLarge {
                list: list.to_owned(),
            });
        }
        let width = if lo.len() > 1 && lo.starts_with('0') {
            lo.len()
        } else {
            0
        };
        out.extend((start..=end).map(|n| format!("{n:0width$}")));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn check(list: &str, want: &[&str]) {
        assert_eq!(
            expand_hostlist(list),
            Ok(want.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>()),
            "{list:?}"
        );
    }

    #[test]
    fn expands_like_scontrol_show_hostnames() {
        check("", &[]);
        check("n1", &["n1"]);
        check("n[1-3,5],gpu01", &["n1", "n2", "n3", "n5", "gpu01"]);
        check("gpu[08-11]", &["gpu08", "gpu09", "gpu10", "gpu11"]);
        check("gpu[098-101]", &["gpu098", "gpu099", "gpu100", "gpu101"]);
        check("n[9-10]", &["n9", "n10"]);
        check("n[0]", &["n0"]);
        check("r[1-2]n[1-2]", &["r1n1", "r1n2", "r2n1", "r2n2"]);
        check("n[1-2]-ib", &["n1-ib", "n2-ib"]);
        check(" a , ,b ", &["a", "b"]);
        check("[1-2]", &["1", "2"]);
        check("n[3,1]", &["n3", "n1"]);
    }

    #[test]
    fn rejects_what_slurm_rejects() {
        for list in [
            "n[1-3", "n1-3]", "n[[1]]", "n[]", "n[a-b]", "n[3-1]", "n[1-]", "n[-1]", "n[1--2]",
        ] {
            assert!(expand_hostlist(list).is_err(), "{list:?}");
        }
        assert_eq!(
            expand_hostlist("n[0-99999999]"),
            Err(HostlistError::TooLarge {
                list: "n[0-99999999]".into()
            })
        );
        assert!(matches!(
            expand_hostlist("a[0-999]b[0-999]"),
            Err(HostlistError::TooLarge { .. })
        ));
    }

    proptest! {
        #[test]
        fn never_panics(list in "\\PC{0,40}") {
            let _ = expand_hostlist(&list);
        }

        #[test]
        fn never_panics_on_hostlist_like_input(list in "([a-z]|[0-9]{1,3}|\\[|\\]|,|-){0,30}") {
            if let Ok(names) = expand_hostlist(&list) {
                prop_assert!(names.len() <= MAX_HOSTS);
            }
        }

        #[test]
        fn ranges_expand_to_every_number(
            prefix in "[a-z]{1,5}",
            start in 0u32..2000,
            len in 0u32..50,
            width in 1usize..6,
        ) {
            let end = start + len;
            let list = format!("{prefix}[{start:0width$}-{end:0width$}]");
            let names = expand_hostlist(&list).expect("valid");
            let padded = width > 1 && format!("{start:0width$}").starts_with('0');
            let want: Vec<String> = (start..=end)
                .map(|n| if padded { format!("{prefix}{n:0width$}") } else { format!("{prefix}{n}") })
                .collect();
            prop_assert_eq!(names, want);
        }

        #[test]
        fn plain_names_come_back(names in proptest::collection::vec("[a-z][a-z0-9-]{0,8}", 0..10)) {
            prop_assert_eq!(expand_hostlist(&names.join(",")).expect("valid"), names);
        }
    }
}
