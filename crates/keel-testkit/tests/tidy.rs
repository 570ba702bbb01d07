//! Checks that keep the map true to the territory: ARCHITECTURE.md's crate
//! graph against `cargo metadata`, library crates free of the binary's
//! dependencies, no source file in `crates/` past the size the map
//! allows without a written reason, and the gateway crates' modules
//! importing downwards only.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn architecture() -> String {
    std::fs::read_to_string(repo().join("ARCHITECTURE.md")).expect("read ARCHITECTURE.md")
}

/// A crate's workspace dependencies: (normal, dev).
type Graph = BTreeMap<String, (BTreeSet<String>, BTreeSet<String>)>;

fn metadata() -> Value {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(repo())
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .output()
        .expect("run cargo metadata");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("cargo metadata's JSON")
}

/// The graph the manifests declare, between workspace crates.
fn manifest_graph(meta: &Value) -> Graph {
    let packages = meta["packages"].as_array().expect("packages");
    let names: BTreeSet<String> = packages
        .iter()
        .filter_map(|p| p["name"].as_str().map(str::to_owned))
        .collect();
    let mut graph = Graph::new();
    for p in packages {
        let name = p["name"].as_str().expect("name").to_owned();
        let entry = graph.entry(name).or_default();
        for d in p["dependencies"].as_array().expect("dependencies") {
            let dep = d["name"].as_str().expect("dependency name");
            if !names.contains(dep) {
                continue;
            }
            match d["kind"].as_str() {
                None | Some("build") => entry.0.insert(dep.to_owned()),
                Some("dev") => entry.1.insert(dep.to_owned()),
                Some(other) => panic!("unexpected dependency kind {other}"),
            };
        }
        // A crate listed as both a normal and a dev dependency is a normal
        // one for what ships; the doc lists it where the manifest does.
    }
    graph
}

/// Names between backquotes in `text`.
fn quoted(text: &str) -> Vec<String> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

/// The graph ARCHITECTURE.md draws between its crate-graph markers: lines
/// of "- `crate` -> `a`, `b`; dev: `c`" (or "-> none").
fn documented_graph(doc: &str) -> Result<Graph, String> {
    let start = doc
        .find("<!-- crate-graph:start -->")
        .ok_or("ARCHITECTURE.md has no <!-- crate-graph:start --> marker")?;
    let end = doc
        .find("<!-- crate-graph:end -->")
        .ok_or("ARCHITECTURE.md has no <!-- crate-graph:end --> marker")?;
    let mut graph = Graph::new();
    for line in doc[start..end].lines().skip(1) {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let rest = line
            .strip_prefix("- ")
            .ok_or_else(|| format!("not a crate line: {line}"))?;
        let (head, deps) = rest
            .split_once(" -> ")
            .ok_or_else(|| format!("no ` -> ` in: {line}"))?;
        let name = match quoted(head).as_slice() {
            [n] => n.clone(),
            _ => return Err(format!("one crate name in backquotes before ->: {line}")),
        };
        let (normal, dev) = match deps.split_once("; dev:") {
            Some((n, d)) => (n, d),
            None => (deps, ""),
        };
        let normal: BTreeSet<String> = quoted(normal).into_iter().collect();
        if normal.is_empty() && normal_is_not_none(deps) {
            return Err(format!(
                "write `none` for a crate with no dependencies: {line}"
            ));
        }
        let dev: BTreeSet<String> = quoted(dev).into_iter().collect();
        if graph.insert(name.clone(), (normal, dev)).is_some() {
            return Err(format!("{name} is listed twice"));
        }
    }
    Ok(graph)
}

fn normal_is_not_none(deps: &str) -> bool {
    let normal = deps.split(';').next().unwrap_or("");
    normal.trim() != "none"
}

fn render(name: &str, (normal, dev): &(BTreeSet<String>, BTreeSet<String>)) -> String {
    let list = |s: &BTreeSet<String>| {
        s.iter()
            .map(|d| format!("`{d}`"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut line = format!(
        "- `{name}` -> {}",
        if normal.is_empty() {
            "none".to_owned()
        } else {
            list(normal)
        }
    );
    if !dev.is_empty() {
        line.push_str(&format!("; dev: {}", list(dev)));
    }
    line
}

#[test]
fn architecture_md_draws_the_crate_graph_the_manifests_declare() {
    let manifests = manifest_graph(&metadata());
    let documented = documented_graph(&architecture()).unwrap_or_else(|e| panic!("{e}"));
    if manifests != documented {
        let want: Vec<String> = manifests.iter().map(|(n, d)| render(n, d)).collect();
        panic!(
            "ARCHITECTURE.md's crate graph differs from the manifests; the lines between its \
             crate-graph markers should read:\n{}\n(and say why each new arrow is there)",
            want.join("\n")
        );
    }
}

#[test]
fn the_documented_graph_is_read_as_written() {
    let doc = "x\n<!-- crate-graph:start -->\n- `a` -> `b`, `c`; dev: `d`\n- `b` -> none\n- `c` -> none; dev: `b`\n<!-- crate-graph:end -->\n";
    let g = documented_graph(doc).expect("parses");
    let set = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
    assert_eq!(g["a"], (set(&["b", "c"]), set(&["d"])));
    assert_eq!(g["b"], (set(&[]), set(&[])));
    assert_eq!(g["c"], (set(&[]), set(&["b"])));
    for (n, d) in &g {
        let line = render(n, d);
        assert!(doc.contains(&line), "{line}");
    }
    assert!(documented_graph("- `a` -> `b`\n").is_err());
    assert!(
        documented_graph("<!-- crate-graph:start -->\n- `a` -> \n<!-- crate-graph:end -->")
            .is_err()
    );
    assert!(documented_graph(
        "<!-- crate-graph:start -->\n- `a` -> none\n- `a` -> none\n<!-- crate-graph:end -->"
    )
    .is_err());
}

#[test]
fn library_crates_do_not_use_the_binarys_dependencies() {
    let meta = metadata();
    let mut offenders = Vec::new();
    for p in meta["packages"].as_array().expect("packages") {
        let name = p["name"].as_str().expect("name");
        let is_binary_only = p["targets"].as_array().expect("targets").iter().all(|t| {
            t["kind"].as_array().is_some_and(|k| {
                k.iter()
                    .all(|k| k == "bin" || k == "test" || k == "bench" || k == "example")
            })
        });
        if name == "keel" || is_binary_only {
            continue;
        }
        for d in p["dependencies"].as_array().expect("dependencies") {
            let dep = d["name"].as_str().expect("dependency name");
            if d["kind"].is_null() && matches!(dep, "clap" | "anyhow" | "keel") {
                offenders.push(format!("{name} -> {dep}"));
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "library crates using the binary's dependencies: {offenders:?}"
    );
}

/// Lines of a source file before its unit tests (`#[cfg(test)]` at the
/// start of a line): the part a reader must hold in mind.
fn code_lines(text: &str) -> usize {
    let mut n = 0;
    for line in text.lines() {
        if line.starts_with("#[cfg(test)]") {
            break;
        }
        n += 1;
    }
    n
}

const MAX_LINES: usize = 1_500;

fn rust_sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        let name = e.file_name();
        if path.is_dir() {
            // Integration tests, benches and examples are test files.
            if !matches!(
                name.to_str(),
                Some("tests" | "benches" | "examples" | "target" | "fixtures")
            ) {
                rust_sources(&path, out);
            }
        } else if path.extension().is_some_and(|x| x == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn no_source_file_is_longer_than_the_map_allows() {
    let root = repo();
    let mut files = Vec::new();
    rust_sources(&root.join("crates"), &mut files);
    assert!(files.len() > 50, "found only {} sources", files.len());
    let doc = architecture();
    let mut long = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).expect("read source");
        let n = code_lines(&text);
        if n > MAX_LINES {
            let rel = f.strip_prefix(&root).unwrap_or(&f).display().to_string();
            let reason = doc.lines().any(|l| {
                l.starts_with("- ")
                    && l.contains(&format!("`{rel}`"))
                    && l.contains("over 1,500 lines")
            });
            if !reason {
                long.push(format!("{rel}: {n} lines before its tests"));
            }
        }
    }
    assert!(
        long.is_empty(),
        "source files over {MAX_LINES} lines (before their unit tests): split them, or give each \
         a one-line reason in ARCHITECTURE.md (\"- `PATH` is over 1,500 lines: REASON\"):\n{}",
        long.join("\n")
    );
}

#[test]
fn code_lines_stop_at_the_unit_tests() {
    assert_eq!(code_lines("a\nb\n#[cfg(test)]\nmod tests {}\n"), 2);
    assert_eq!(code_lines("a\n    #[cfg(test)]\nb\n"), 3);
}

/// What a top-level module of the crate at `src` refers to: `crate::NAME`
/// and the names in `use crate::{...}`, in its code before the unit tests
/// (comments left out), with the names `lib.rs` re-exports
/// (`pub use MODULE::{Name, ...}`) taken as their modules. A module's
/// children (`src/MODULE/*.rs`) count as the module.
fn module_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut mods = BTreeSet::new();
    for e in std::fs::read_dir(src).expect("read src").flatten() {
        let p = e.path();
        if p.extension().is_some_and(|x| x == "rs") {
            let stem = p.file_stem().and_then(|s| s.to_str()).unwrap_or("");
            if stem != "lib" {
                mods.insert(stem.to_owned());
            }
        }
    }
    let lib = std::fs::read_to_string(src.join("lib.rs")).expect("read lib.rs");
    let mut reexported = BTreeMap::new();
    for line in lib.lines() {
        let Some(rest) = line.strip_prefix("pub use ") else {
            continue;
        };
        let Some((module, names)) = rest.split_once("::") else {
            continue;
        };
        if mods.contains(module) {
            for n in names.split(|c: char| !(c.is_alphanumeric() || c == '_')) {
                if !n.is_empty() {
                    reexported.insert(n.to_owned(), module.to_owned());
                }
            }
        }
    }
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    let mut graph = BTreeMap::new();
    for m in &mods {
        let mut files = vec![src.join(format!("{m}.rs"))];
        rust_sources(&src.join(m), &mut files);
        let mut refs = BTreeSet::new();
        for f in files {
            let text = std::fs::read_to_string(&f).expect("read source");
            let code: String = text
                .lines()
                .take(code_lines(&text))
                .filter(|l| !l.trim_start().starts_with("//"))
                .collect::<Vec<_>>()
                .join("\n");
            let mut rest = code.as_str();
            while let Some(i) = rest.find("crate::") {
                rest = &rest[i + "crate::".len()..];
                let names: Vec<String> = if let Some(group) = rest.strip_prefix('{') {
                    let end = group.find('}').unwrap_or(group.len());
                    group[..end]
                        .split(',')
                        .map(|item| ident(item.trim()))
                        .collect()
                } else {
                    vec![ident(rest)]
                };
                for n in names {
                    let target = reexported.get(&n).cloned().unwrap_or(n);
                    if mods.contains(&target) && &target != m {
                        refs.insert(target);
                    }
                }
            }
        }
        graph.insert(m.clone(), refs);
    }
    graph
}

/// A cycle in `graph`, if it has one.
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        n: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        done: &mut BTreeSet<String>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| p == n) {
            let mut c = path[i..].to_vec();
            c.push(n.to_owned());
            return Some(c);
        }
        if done.contains(n) {
            return None;
        }
        path.push(n.to_owned());
        for next in graph.get(n).into_iter().flatten() {
            if let Some(c) = visit(next, graph, done, path) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(n.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|n| visit(n, graph, &mut done, &mut Vec::new()))
}

#[test]
fn the_gateway_crates_modules_import_downwards_only() {
    for krate in ["keel-gateway", "keel-control", "keel-gateway-config"] {
        let graph = module_graph(&repo().join("crates").join(krate).join("src"));
        assert!(graph.len() > 3, "{krate}: only {graph:?}");
        if let Some(c) = find_cycle(&graph) {
            panic!(
                "{krate}: modules import each other in a circle: {} (move what both need \
                 into a module below them)",
                c.join(" -> ")
            );
        }
    }
}

#[test]
fn a_circle_of_modules_is_found() {
    let g = |edges: &[(&str, &str)]| {
        let mut m: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (a, b) in edges {
            m.entry((*a).to_owned())
                .or_default()
                .insert((*b).to_owned());
            m.entry((*b).to_owned()).or_default();
        }
        m
    };
    assert_eq!(find_cycle(&g(&[("a", "b"), ("b", "c"), ("a", "c")])), None);
    assert_eq!(
        find_cycle(&g(&[("a", "b"), ("b", "c"), ("c", "a")])),
        Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
    );
    let dir = tempfile::tempdir().expect("tmp");
    std::fs::write(
        dir.path().join("lib.rs"),
        "mod a;\nmod b;\nmod c;\nmod d;\npub use b::{Bee, Buzz};\n",
    )
    .expect("w");
    std::fs::write(
        dir.path().join("a.rs"),
        "use crate::{c::X, Bee};\n// crate::d is a comment\n",
    )
    .expect("w");
    std::fs::write(
        dir.path().join("b.rs"),
        "fn f() { crate::c::y() }\n#[cfg(test)]\nmod tests { use crate::a; }\n",
    )
    .expect("w");
    std::fs::write(dir.path().join("c.rs"), "").expect("w");
    std::fs::write(dir.path().join("d.rs"), "use crate::a::Z;\n").expect("w");
    let graph = module_graph(dir.path());
    assert_eq!(graph["a"], BTreeSet::from(["b".to_owned(), "c".to_owned()]));
    assert_eq!(graph["b"], BTreeSet::from(["c".to_owned()]));
    assert_eq!(graph["d"], BTreeSet::from(["a".to_owned()]));
    assert_eq!(find_cycle(&graph), None);
}
