//! slurm.conf, gres.conf, sacct text and Prometheus configs: parsing never
//! panics, and every diagnostic points at a line of the input.
#![no_main]

use std::path::Path;

use keel_review::slurm::{parse_gres_conf, parse_slurm_conf, Loader};
use libfuzzer_sys::fuzz_target;

struct NoIncludes;

impl Loader for NoIncludes {
    fn load(&self, _: &Path) -> std::io::Result<String> {
        Err(std::io::ErrorKind::NotFound.into())
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let lines = u32::try_from(text.lines().count().max(1)).unwrap_or(u32::MAX);
    let c = parse_slurm_conf(Path::new("slurm.conf"), text, &NoIncludes);
    for d in &c.diagnostics {
        assert!(d.location.line >= 1 && d.location.line <= lines);
    }
    let _ = parse_gres_conf(Path::new("gres.conf"), text);
    let _ = keel_review::cost::parse_sacct("sacct", text);
    let mut diags = Vec::new();
    let source = keel_review::Source {
        path: Path::new("prometheus.yml"),
        text,
        kind: keel_review::Kind::Prometheus,
    };
    let _ = keel_review::inputs::parse(source, &NoIncludes, &mut diags);
    for d in &diags {
        assert!(d.location.line >= 1 && d.location.line <= lines);
    }
});
