//! Prints an NVML snapshot of this machine's GPUs as snapshot JSON, for
//! recording fixtures without installing keel (see `keel_gpu::recorded`):
//!
//! ```text
//! cargo run -p keel-gpu --example record -- "DESCRIPTION" > gpu.json
//! ```
//!
//! Exits 3 (unknown) when NVML is unavailable or does not answer.

use std::io::Write;
use std::process::ExitCode;

use keel_gpu::{record, recorded, NvmlProbe};

fn main() -> ExitCode {
    let description = std::env::args().nth(1);
    match record(&NvmlProbe::new(), description) {
        Ok(snap) => match std::io::stdout().write_all(recorded::to_json(&snap).as_bytes()) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("record: cannot write the snapshot: {e}");
                ExitCode::from(74)
            }
        },
        Err(e) => {
            eprintln!("record: {e}");
            ExitCode::from(3)
        }
    }
}
