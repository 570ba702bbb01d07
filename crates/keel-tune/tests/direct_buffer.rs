//! `keel scratch verify` measures with buffers in base pages under the
//! allocator the keel binary uses (jemalloc), whose large allocations
//! the kernel backs with transparent huge pages where it allows them:
//! a buffer in huge pages is one segment per request instead of 256, which
//! some devices turn into a higher figure than fio's (see
//! `keel_tune::scratch::DirectBuf`).

use keel_tune::scratch::DirectBuf;

#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// What `/proc/self/smaps` says of the mapping that holds `addr`.
#[derive(Debug)]
struct Mapping {
    /// `THPeligible` (absent where the kernel has no transparent huge pages).
    thp_eligible: Option<bool>,
    anon_huge_kb: u64,
}

fn mapping_of(addr: usize) -> Mapping {
    let smaps = std::fs::read_to_string("/proc/self/smaps").expect("read /proc/self/smaps");
    let mut inside = false;
    let mut found: Option<Mapping> = None;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or_default();
        if let Some((a, b)) = first.split_once('-') {
            if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) {
                if found.is_some() {
                    break;
                }
                inside = (a..b).contains(&addr);
                if inside {
                    found = Some(Mapping {
                        thp_eligible: None,
                        anon_huge_kb: 0,
                    });
                }
                continue;
            }
        }
        let (Some(m), true) = (found.as_mut(), inside) else {
            continue;
        };
        let value = |key: &str| {
            line.strip_prefix(key)
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse::<u64>().ok())
        };
        if let Some(v) = value("THPeligible:") {
            m.thp_eligible = Some(v == 1);
        } else if let Some(v) = value("AnonHugePages:") {
            m.anon_huge_kb = v;
        }
    }
    found.unwrap_or_else(|| panic!("no mapping holds {addr:#x} in /proc/self/smaps"))
}

fn thp_mode() -> String {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default()
}

#[test]
fn direct_buffers_are_never_in_huge_pages() {
    for len in [1 << 20, 4 << 20, 16 << 20] {
        let mut b = DirectBuf::new(len).expect("map a buffer");
        assert_eq!(b.addr() % 4096, 0, "page-aligned for O_DIRECT");
        assert_eq!(b.as_mut_slice().len(), len);
        b.as_mut_slice().fill(0x5a);
        let m = mapping_of(b.addr());
        assert_ne!(m.thp_eligible, Some(true), "{len} bytes: {m:?}");
        assert_eq!(m.anon_huge_kb, 0, "{len} bytes: {m:?}");
    }
}

/// The check above can fail: an anonymous mapping of the same size that
/// asks for huge pages (as an allocator may for its large allocations) is
/// eligible for them where the kernel's mode allows them (what `verify`
/// measured with before).
#[test]
fn the_smaps_check_sees_an_allocation_eligible_for_huge_pages() {
    let mode = thp_mode();
    if !mode.contains("[always]") && !mode.contains("[madvise]") {
        eprintln!(
            "skipped: transparent huge pages are off here ({})",
            mode.trim()
        );
        return;
    }
    let mut m = memmap2::MmapMut::map_anon(16 << 20).expect("anonymous mapping");
    m.advise(memmap2::Advice::HugePage)
        .expect("madvise(MADV_HUGEPAGE)");
    m.fill(0x5a);
    let found = mapping_of(m.as_ptr() as usize);
    assert_eq!(found.thp_eligible, Some(true), "{found:?}");
}
