//! Shared by the `keel check` test binaries: writable copies of the machine
//! fixtures with faults injected at the lowest boundary, and running keel.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("workspace root")
}

/// A writable copy of a fixture machine.
pub struct Node {
    _tmp: tempfile::TempDir,
    pub root: PathBuf,
    pub profile: String,
    pub sku: &'static str,
}

impl Node {
    pub fn new(fixture: &str, sku: &'static str) -> Node {
        let tmp = tempfile::tempdir().expect("tempdir");
        let root = tmp.path().join("root");
        let src = workspace().join("tests/fixtures").join(fixture);
        // Everything but sys/ is copied; sys/ (a thousand small files) is
        // linked, and copied only by cases that change it.
        std::fs::create_dir(&root).expect("mkdir");
        for entry in std::fs::read_dir(&src).expect("fixture") {
            let entry = entry.expect("entry");
            let name = entry.file_name();
            if name == "sys" {
                std::os::unix::fs::symlink(entry.path(), root.join("sys")).expect("link sys");
            } else {
                copy(&entry.path(), &root.join(&name));
            }
        }
        // The test machine's disks are not the fixture's: leave them out
        // unless a case asks for them.
        Node {
            _tmp: tmp,
            root,
            profile: "[host]\ndisks = []\n".into(),
            sku,
        }
    }

    pub fn ndv4() -> Node {
        Node::new("nd96asr_v4", "nd96asr_v4")
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.root.join(rel)
    }

    /// Replaces the linked sys/ with a private copy before it is changed.
    pub fn own(&self, rel: &str) {
        let sys = self.path("sys");
        if rel.starts_with("sys/")
            && std::fs::symlink_metadata(&sys).is_ok_and(|m| m.file_type().is_symlink())
        {
            let target = std::fs::read_link(&sys).expect("link");
            std::fs::remove_file(&sys).expect("unlink");
            copy(&target, &sys);
        }
    }

    pub fn write(&self, rel: &str, content: &str) {
        self.own(rel);
        std::fs::write(self.path(rel), content).expect("write");
    }

    /// Takes a kernel module out of `proc/modules`; returns the file as
    /// it was.
    pub fn unload(&self, module: &str) -> String {
        let m = std::fs::read_to_string(self.path("proc/modules")).expect("modules");
        let prefix = format!("{module} ");
        let kept: String = m
            .lines()
            .filter(|l| !l.starts_with(&prefix))
            .map(|l| format!("{l}\n"))
            .collect();
        self.write("proc/modules", &kept);
        m
    }

    pub fn remove(&self, rel: &str) {
        self.own(rel);
        let path = self.path(rel);
        if std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir()) {
            std::fs::remove_dir_all(path).expect("remove");
        } else {
            std::fs::remove_file(path).expect("remove");
        }
    }

    pub fn gpu(&self, f: impl FnOnce(&mut Value)) {
        let p = self.path("gpu.json");
        let mut v: Value =
            serde_json::from_str(&std::fs::read_to_string(&p).expect("read")).expect("json");
        f(&mut v);
        std::fs::write(&p, serde_json::to_string_pretty(&v).expect("json")).expect("write");
    }

    /// A GPU gone from the bus: its PCI device (`0000:00:00.0` form,
    /// lower case) removed from sysfs and from the NVML snapshot.
    pub fn lose_gpu(&self, pci: &str) {
        self.remove(&format!("sys/bus/pci/devices/{pci}"));
        self.gpu(|v| {
            v["gpus"].as_array_mut().expect("gpus").retain(|g| {
                !g["pci_bus_id"]
                    .as_str()
                    .is_some_and(|id| id.eq_ignore_ascii_case(pci))
            });
        });
    }

    pub fn uptime(&self) -> f64 {
        let s = std::fs::read_to_string(self.path("proc/uptime")).expect("uptime");
        s.split_whitespace()
            .next()
            .and_then(|v| v.parse().ok())
            .expect("seconds")
    }

    /// Appends a kernel-log record `ago` seconds before now.
    pub fn log(&self, ago: f64, msg: &str) {
        let usec = ((self.uptime() - ago) * 1e6) as u64;
        let p = self.path("dev/kmsg");
        let mut s = std::fs::read_to_string(&p).expect("kmsg");
        s.push_str(&format!("3,9999,{usec},-;{msg}\n"));
        std::fs::write(&p, s).expect("write");
    }

    pub fn profile(&mut self, toml: &str) {
        self.profile = toml.to_owned();
    }

    /// `keel --root ROOT [--json] check [--gpu-snapshot ...] EXTRA...`: no
    /// SKU, profile or IMDS chosen (for tests of how keel chooses them).
    pub fn bare_check_args(&self, json: bool, extra: &[&str]) -> Vec<String> {
        let mut args: Vec<String> = vec!["--root".into(), self.root.display().to_string()];
        if json {
            args.push("--json".into());
        }
        args.push("check".into());
        if self.path("gpu.json").exists() {
            args.push("--gpu-snapshot".into());
            args.push(self.path("gpu.json").display().to_string());
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    }

    /// `keel --root ROOT [--json] check --sku ... --profile-file ...
    /// [--gpu-snapshot ...] --imds-endpoint 127.0.0.1:1 EXTRA...`: the node's
    /// profile overrides written, no real IMDS asked.
    pub fn check_args(&self, json: bool, extra: &[&str]) -> Vec<String> {
        let pf = self.root.with_file_name("profile.toml");
        std::fs::write(&pf, &self.profile).expect("profile");
        let pf = pf.display().to_string();
        let mut own = vec!["--sku", self.sku, "--profile-file", &pf];
        own.extend(["--imds-endpoint", "127.0.0.1:1"]);
        own.extend(extra);
        self.bare_check_args(json, &own)
    }

    pub fn run(&self, extra: &[&str]) -> (i32, Value, String) {
        let args = self.check_args(true, extra);
        let out = keel(&args, &[]);
        let v: Value =
            serde_json::from_str(&out.1).unwrap_or_else(|e| panic!("{e}: {}\n{}", out.1, out.2));
        (out.0, v, out.2)
    }
}

pub fn copy(from: &Path, to: &Path) {
    let st = Command::new("cp")
        .arg("-a")
        .arg(from)
        .arg(to)
        .status()
        .expect("cp");
    assert!(st.success(), "cp -a {} {}", from.display(), to.display());
}

pub fn keel(args: &[String], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_keel"));
    c.args(args).current_dir(workspace());
    for var in [
        "KEEL_ROOT",
        "KEEL_CONFIG",
        "KEEL_SKU",
        "KEEL_PROFILE_FILE",
        "KEEL_GPU_SNAPSHOT",
        "KEEL_STATE_DIR",
        "KEEL_IMDS_ENDPOINT",
        "KEEL_TUNE_STATE",
        "SLURM_LOCALID",
        "UCX_TLS",
        "NO_COLOR",
    ] {
        c.env_remove(var);
    }
    c.env("HOME", "/nonexistent");
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().expect("run keel");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

pub fn results<'a>(report: &'a Value, id: &str) -> Vec<&'a Value> {
    report["results"]
        .as_array()
        .expect("results")
        .iter()
        .filter(|r| r["id"] == id)
        .collect()
}
