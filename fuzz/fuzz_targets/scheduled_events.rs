//! Azure Scheduled Events documents as IMDS (or anything answering at its
//! address) might send them: parsing and tracking never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(doc) = keel_run::events::parse_document(data) {
        let mut t = keel_run::events::Tracker::new(&["vm-1".to_owned()]);
        let first = t.observe(&doc);
        assert!(first.iter().all(|e| e.affects("vm-1")));
        assert!(t.observe(&doc).is_empty());
        for e in &doc.events {
            let _ = e.notice(std::time::SystemTime::now());
        }
    }
});
