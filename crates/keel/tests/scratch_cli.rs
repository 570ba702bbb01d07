//! `keel scratch plan|verify` on the machine fixtures and a temporary
//! directory (apply on loop devices is tested in keel-tune).

mod common;

use common::keel;

fn args(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

fn fixture(name: &str) -> String {
    common::workspace()
        .join("tests/fixtures")
        .join(name)
        .display()
        .to_string()
}

#[test]
fn plan_on_the_fixtures() {
    let (c, out, err) = keel(
        &args(&["--root", &fixture("nd96asr_v4"), "scratch", "plan"]),
        &[],
    );
    assert_eq!(c, 0, "{err}");
    insta::assert_snapshot!("scratch-plan-nd96asr_v4", out);

    let (c, out, err) = keel(
        &args(&[
            "--root",
            &fixture("nd96isr_h100_v5"),
            "--json",
            "scratch",
            "apply",
            "--mount",
            "/scratch",
        ]),
        &[],
    );
    assert_eq!(c, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(v["applied"], false, "dry run without --apply");
    assert_eq!(v["used"].as_array().map(Vec::len), Some(8));
    assert_eq!(v["commands"][3], "mount -o noatime /dev/md128 /scratch");

    // Applying acts on this machine: never with a fixture's drives.
    let (c, _, err) = keel(
        &args(&[
            "--root",
            &fixture("nd96asr_v4"),
            "scratch",
            "apply",
            "--apply",
        ]),
        &[],
    );
    assert_eq!(c, 64, "{err}");
    assert!(err.contains("--root must be /"), "{err}");

    let (c, _, err) = keel(
        &args(&["--root", &fixture("cpu-only"), "scratch", "plan"]),
        &[],
    );
    assert_eq!(c, 3, "{err}");
    assert!(err.contains("no NVMe drive found"), "{err}");
}

#[test]
fn verify_judges_against_the_profile_figure() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let path = dir.path().join("fs");
    std::fs::create_dir(&path).expect("mkdir");
    let path = path.to_str().expect("utf-8");
    let run = |profile: Option<&str>| {
        let mut a = args(&[
            "--root",
            &fixture("nd96asr_v4"),
            "--json",
            "scratch",
            "verify",
            path,
            "--streams",
            "2",
            "--size-mib",
            "8",
        ]);
        if let Some(p) = profile {
            let f = dir.path().join("profile.toml");
            std::fs::write(&f, p).expect("profile");
            a.push("--profile-file".into());
            a.push(f.display().to_string());
        }
        let (c, out, err) = keel(&a, &[]);
        let v: serde_json::Value =
            serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}{err}"));
        assert!(
            err.contains("reading it back with O_DIRECT"),
            "progress on stderr: {err}"
        );
        (c, v)
    };
    // Figures no disk reaches, and figures every disk does.
    let (c, v) = run(Some("[scratch]\nwrite_gbps = 1e9\nread_gbps = 1e9\n"));
    assert_eq!((c, v["status"].as_str()), (2, Some("fail")), "{v}");
    assert_eq!(v["sku"], "nd96asr_v4");
    let (c, v) = run(Some("[scratch]\nwrite_gbps = 1e-9\nread_gbps = 1e-9\n"));
    assert_eq!((c, v["status"].as_str()), (0, Some("pass")), "{v}");
    assert_eq!(v["bytes"], 2 * (8 << 20));
    assert!(v["write_gbps"].as_f64().is_some_and(|x| x > 0.0));
    // Nothing left behind.
    assert_eq!(std::fs::read_dir(path).expect("dir").count(), 0);

    let (c, _, err) = keel(&args(&["scratch", "verify", "/nonexistent/keel"]), &[]);
    assert_eq!(c, 74, "{err}");
}
