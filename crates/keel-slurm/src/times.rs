//! Slurm's time fields, read without a clock: `KillWait = 30 sec` from
//! `scontrol show config`, `GraceTime=0` from `scontrol show partition`,
//! and a job's time left from `squeue -o %L` (`MM:SS`, `H:MM:SS`,
//! `D-HH:MM:SS`; `UNLIMITED`, `NOT_SET` and `INVALID` for none).

use std::time::Duration;

/// A duration as squeue prints it (`%L`, `%l`): `SS`, `MM:SS`, `H:MM:SS`
/// or `D-H:MM:SS`. `None` for `UNLIMITED`, `NOT_SET`, `INVALID` or
/// anything else.
pub fn parse_squeue_time(s: &str) -> Option<Duration> {
    let s = s.trim();
    let (days, rest) = match s.split_once('-') {
        Some((d, r)) => (d.parse::<u64>().ok()?, r),
        None => (0, s),
    };
    let parts: Vec<&str> = rest.split(':').collect();
    if parts.is_empty()
        || parts.len() > 3
        || parts
            .iter()
            .any(|p| p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) || p.len() > 9)
    {
        return None;
    }
    let n: Vec<u64> = parts.iter().map(|p| p.parse().unwrap_or(0)).collect();
    let secs = match n.as_slice() {
        [s] => *s,
        [m, s] => m * 60 + s,
        [h, m, s] => h * 3600 + m * 60 + s,
        _ => return None,
    };
    Some(Duration::from_secs(days * 86_400 + secs))
}

/// `KillWait` from `scontrol show config` (`KillWait                = 30 sec`).
pub fn parse_kill_wait(config: &str) -> Option<Duration> {
    config.lines().find_map(|l| {
        let (k, v) = l.split_once('=')?;
        if k.trim() != "KillWait" {
            return None;
        }
        let n = v.split_whitespace().next()?.parse::<u64>().ok()?;
        Some(Duration::from_secs(n))
    })
}

/// `GraceTime` from `scontrol show partition NAME` (seconds).
pub fn parse_grace_time(partition: &str) -> Option<Duration> {
    partition.split_whitespace().find_map(|kv| {
        let v = kv.strip_prefix("GraceTime=")?;
        Some(Duration::from_secs(v.parse::<u64>().ok()?))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn squeue_times() {
        let s = Duration::from_secs;
        assert_eq!(parse_squeue_time("0:45"), Some(s(45)));
        assert_eq!(parse_squeue_time("12:05"), Some(s(725)));
        assert_eq!(parse_squeue_time("1:00:00"), Some(s(3600)));
        assert_eq!(
            parse_squeue_time("2-03:04:05"),
            Some(s(2 * 86_400 + 3 * 3600 + 245))
        );
        assert_eq!(parse_squeue_time("59"), Some(s(59)));
        for none in [
            "UNLIMITED",
            "NOT_SET",
            "INVALID",
            "",
            "1:2:3:4",
            "a:00",
            "-1:00",
            "1-",
        ] {
            assert_eq!(parse_squeue_time(none), None, "{none:?}");
        }
    }

    #[test]
    fn config_and_partition_fields() {
        let conf = "JobRequeue              = 1\nKillOnBadExit           = 0\nKillWait                = 30 sec\n";
        assert_eq!(parse_kill_wait(conf), Some(Duration::from_secs(30)));
        assert_eq!(parse_kill_wait("KillWaitX = 3 sec\n"), None);
        let part = "PartitionName=debug\n   AllowGroups=ALL AllowAccounts=ALL\n   PreemptMode=OFF GraceTime=45 Hidden=NO\n";
        assert_eq!(parse_grace_time(part), Some(Duration::from_secs(45)));
        assert_eq!(parse_grace_time("PartitionName=x"), None);
    }
}
