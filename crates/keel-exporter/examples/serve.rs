//! The exporter's server without keel's command line, for
//! `scripts/bench-exporter`: the same collection, rendering and HTTP path
//! as `keel exporter`, built alone so a release build is quick.
//!
//! ```text
//! serve --root DIR --gpu-snapshot FILE [--listen ADDR] [--min-interval-ms N] [--dcgm-names]
//! ```
//!
//! No authentication (a benchmark on loopback); prints `listening ADDR`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use keel_exporter::replay::ReplayProbe;
use keel_exporter::server::{serve, Auth, ServeOptions};
use keel_exporter::{Exporter, ExporterOptions, IdlePolicy, Naming, SystemClock};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut root = PathBuf::from("/");
    let mut snapshots = Vec::new();
    let mut listen = "127.0.0.1:0".to_owned();
    let mut min_interval = Duration::from_millis(500);
    let mut naming = Naming::Keel;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--root" => root = value()?.into(),
            "--gpu-snapshot" => snapshots.push(PathBuf::from(value()?)),
            "--listen" => listen = value()?,
            "--min-interval-ms" => min_interval = Duration::from_millis(value()?.parse()?),
            "--dcgm-names" => naming = Naming::Dcgm,
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    let clock = Arc::new(SystemClock);
    let probe = ReplayProbe::load(&snapshots, Duration::from_secs(15), clock.clone())?;
    let mut opts = ExporterOptions::new(root);
    opts.min_interval = min_interval;
    opts.naming = naming;
    opts.idle = Some(IdlePolicy {
        threshold_percent: 5.0,
        idle_minutes: 30.0,
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let l = tokio::net::TcpListener::bind(&listen).await?;
        println!("listening {}", l.local_addr()?);
        let exporter = Exporter::new(opts, Box::new(probe), clock)?;
        let o = ServeOptions {
            auth: Auth::None,
            ..ServeOptions::default()
        };
        serve(l, exporter, o, std::future::pending()).await
    })?;
    Ok(())
}
