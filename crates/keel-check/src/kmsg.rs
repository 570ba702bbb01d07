//! The kernel log as `/dev/kmsg` gives it: `pri,seq,usec,flags;message`,
//! with `usec` the time since boot. Parsers for the lines checks look for:
//! NVIDIA XIDs and InfiniBand/Ethernet carrier losses.

use serde::Serialize;

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Record {
    pub seq: u64,
    /// Microseconds since boot.
    pub usec: u64,
    pub message: String,
}

/// Parses `/dev/kmsg` records. Continuation lines (starting with a space:
/// `SUBSYSTEM=...`) and malformed lines are skipped.
pub fn parse(text: &str) -> Vec<Record> {
    text.lines().filter_map(parse_record).collect()
}

fn parse_record(line: &str) -> Option<Record> {
    if line.starts_with(' ') {
        return None;
    }
    let (prefix, message) = line.split_once(';')?;
    let mut fields = prefix.split(',');
    let _pri: u32 = fields.next()?.trim().parse().ok()?;
    let seq: u64 = fields.next()?.trim().parse().ok()?;
    let usec: u64 = fields.next()?.trim().parse().ok()?;
    Some(Record {
        seq,
        usec,
        message: message.to_owned(),
    })
}

/// An XID reported by the NVIDIA driver.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Xid {
    /// `DDDD:BB:DD` as the driver prints it (no function), lowercase.
    pub pci: String,
    pub code: u32,
}

/// `NVRM: Xid (PCI:0000:07:00): 79, pid=..., GPU has fallen off the bus.`
/// (also the older `NVRM: Xid (0000:07:00): 13, ...`).
pub fn parse_xid(message: &str) -> Option<Xid> {
    let at = message.find("Xid (")?;
    let rest = &message[at + 5..];
    let rest = rest.strip_prefix("PCI:").unwrap_or(rest);
    let (pci, rest) = rest.split_once(')')?;
    let rest = rest.strip_prefix(':')?.trim_start();
    let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
    let code = digits.parse().ok()?;
    let pci = pci.trim().to_ascii_lowercase();
    if pci.is_empty()
        || !pci
            .chars()
            .all(|c| c.is_ascii_hexdigit() || c == ':' || c == '.')
    {
        return None;
    }
    Some(Xid { pci, code })
}

/// The interface of a `<ifname>: lost carrier` line (`mlx5_core
/// 0101:00:00.0 ib0: lost carrier`, `IPv6: ADDRCONF(...)` excluded).
pub fn parse_lost_carrier(message: &str) -> Option<String> {
    let head = message.trim_end().strip_suffix(": lost carrier")?;
    let name = head.rsplit(' ').next()?;
    if name.is_empty() || name.contains(':') {
        return None;
    }
    Some(name.to_owned())
}

/// The records of `text` that checks read (XIDs, carrier losses), as
/// they were, one line each: what a snapshot of the node keeps of its
/// kernel log (the rest can be large and personal).
pub fn relevant(text: &str) -> String {
    let mut out = String::new();
    for line in text.lines() {
        let Some(rec) = parse_record(line) else {
            continue;
        };
        if parse_xid(&rec.message).is_some() || parse_lost_carrier(&rec.message).is_some() {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn records_parse_and_continuations_are_skipped() {
        let text = "6,1201,5234567,-;NVRM: Xid (PCI:0000:07:00): 79, pid=4242, name=python, GPU has fallen off the bus.\n SUBSYSTEM=pci\n garbage\n4,1202,6000000,-;mlx5_core 0101:00:00.0 ib0: lost carrier\n";
        let r = parse(text);
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].usec, 5_234_567);
        assert_eq!(
            parse_xid(&r[0].message),
            Some(Xid {
                pci: "0000:07:00".into(),
                code: 79
            })
        );
        assert_eq!(parse_lost_carrier(&r[1].message), Some("ib0".into()));
    }

    #[test]
    fn xid_forms() {
        assert_eq!(
            parse_xid("NVRM: Xid (0000:3B:00): 13, Graphics Exception"),
            Some(Xid {
                pci: "0000:3b:00".into(),
                code: 13
            })
        );
        assert_eq!(parse_xid("NVRM: Xid (PCI:0001:00:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error"), Some(Xid { pci: "0001:00:00".into(), code: 48 }));
        assert_eq!(
            parse_xid("NVRM: loading NVIDIA UNIX x86_64 Kernel Module"),
            None
        );
        assert_eq!(parse_xid("NVRM: Xid (PCI:0000:07:00): x"), None);
        assert_eq!(
            parse_lost_carrier("IPv6: ADDRCONF(NETDEV_CHANGE): ib0: link becomes ready"),
            None
        );
        assert_eq!(parse_lost_carrier("ib3: lost carrier"), Some("ib3".into()));
    }

    proptest! {
        #[test]
        fn parsers_never_panic(s in "\\PC{0,120}") {
            let _ = parse(&s);
            let _ = parse_xid(&s);
            let _ = parse_lost_carrier(&s);
        }

        #[test]
        fn xid_round_trip(d in 0u32..0xffff, b in 0u8..=255, dev in 0u8..32, code in 1u32..200) {
            let pci = format!("{d:04x}:{b:02x}:{dev:02x}");
            let line = format!("NVRM: Xid (PCI:{pci}): {code}, pid=1, name=x, text");
            prop_assert_eq!(parse_xid(&line), Some(Xid { pci, code }));
        }
    }

    #[test]
    fn a_snapshot_keeps_only_the_records_checks_read() {
        let log = "6,1,100,-;Linux version 6.8\n SUBSYSTEM=pci\n\
                   4,2,200,-;NVRM: Xid (PCI:0000:07:00): 79, pid=1, GPU has fallen off the bus.\n\
                   6,3,300,-;user: WANDB_API_KEY=secret\n\
                   6,4,400,-;mlx5_core 0101:00:00.0 ib0: lost carrier\n\
                   garbage\n";
        let kept = relevant(log);
        assert_eq!(
            kept,
            "4,2,200,-;NVRM: Xid (PCI:0000:07:00): 79, pid=1, GPU has fallen off the bus.\n\
             6,4,400,-;mlx5_core 0101:00:00.0 ib0: lost carrier\n"
        );
        // What the checks see is unchanged.
        let xids = |t: &str| -> Vec<(u64, Xid)> {
            parse(t)
                .into_iter()
                .filter_map(|r| parse_xid(&r.message).map(|x| (r.usec, x)))
                .collect()
        };
        assert_eq!(xids(log), xids(&kept));
        assert_eq!(relevant(""), "");
    }
}
