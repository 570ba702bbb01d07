//! Evaluating a rule: its check, by name, over the inputs of its target
//! kind. Each check returns where the setting is (or line 1 of the file
//! when it is missing) and a message naming what was found.

use keel_units::Bandwidth;

use crate::catalogue::{Params, Rule};
use crate::inputs::{EnvVar, GatewayInput, Input, Kind, NodeFacts, PromConfig, Sbatch, TomlDoc};
use crate::slurm::{GresConf, RecordKind, SlurmConf};
use crate::{cut, Location};

/// What a review knows beyond its inputs.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    /// The storage account's ingress limit, for the checkpoint cap rule.
    pub storage_ingress: Option<Bandwidth>,
}

/// One place a rule failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub location: Location,
    pub message: String,
}

/// A rule's result over all inputs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// No input of the rule's kind was given.
    NotApplicable,
    Pass,
    Fail(Vec<Failure>),
}

const CHECKS: &[&str] = &[
    "slurm.set",
    "slurm.min",
    "slurm.one_of",
    "slurm.none_of",
    "slurm.set_when",
    "slurm.prolog_epilog_timeout",
    "slurm.return_to_service",
    "slurm.finite",
    "slurm.list_has",
    "slurm.power_save_programs",
    "slurm.preempt_requeue",
    "slurm.gres_types",
    "slurm.job_comment",
    "gres.autodetect",
    "gateway.valid",
    "gateway.auth",
    "gateway.tls",
    "gateway.backend_tls",
    "gateway.jwks_https",
    "gateway.set",
    "gateway.unset",
    "gateway.set_when",
    "gateway.not_true",
    "gateway.not_false",
    "gateway.min",
    "gateway.limits",
    "gateway.quota",
    "gateway.fallback",
    "gateway.redundant",
    "gateway.registry_signatures",
    "keel.set",
    "keel.durable_registry_db",
    "prometheus.scrapes_keel",
    "prometheus.keel_alerts",
    "sbatch.option",
    "sbatch.requeue",
    "sbatch.runs",
    "sbatch.ckpt_cap",
    "sbatch.keel_run_signal",
    "env.hcoll_off",
    "env.one_of",
    "env.set",
    "env.nccl_ib_hca_node_wide",
    "node.check",
    "node.scratch",
];

/// Whether `check` names a check this crate implements.
pub fn known_check(check: &str) -> bool {
    CHECKS.contains(&check)
}

/// Evaluates `rule` over `inputs`.
pub fn evaluate(rule: &Rule, inputs: &[Input], opts: &Options) -> Outcome {
    let mut applied = false;
    let mut failures = Vec::new();
    let p = &rule.params;
    match rule.target {
        Kind::Env => {
            // NCCL's configuration files count below the job's environment
            // (NCCL sets their values only where the environment has none),
            // and do not make a job environment by themselves.
            let env_files: Vec<&EnvVar> = inputs
                .iter()
                .filter_map(|i| match i {
                    Input::Nccl(v, _) => Some(v.iter()),
                    _ => None,
                })
                .chain(inputs.iter().filter_map(|i| match i {
                    Input::Env(v, _) => Some(v.iter()),
                    _ => None,
                }))
                .flatten()
                .collect();
            let first_env = inputs.iter().find_map(|i| match i {
                Input::Env(_, f) => Some(f.as_str()),
                _ => None,
            });
            let scripts: Vec<&Sbatch> = inputs
                .iter()
                .filter_map(|i| match i {
                    Input::Sbatch(s) => Some(s),
                    _ => None,
                })
                .collect();
            if scripts.is_empty() {
                if let Some(file) = first_env {
                    applied = true;
                    failures.extend(env_check(&rule.check, p, &env_files, None, file));
                }
            } else {
                for s in scripts {
                    applied = true;
                    let mut env = env_files.clone();
                    env.extend(s.exports.iter());
                    failures.extend(env_check(&rule.check, p, &env, Some(s), &s.file));
                }
            }
        }
        _ => {
            for input in inputs
                .iter()
                .filter(|i| i.kind() == rule.target && applies(&rule.check, i))
            {
                applied = true;
                let f = match input {
                    Input::Slurm(c) => slurm_check(&rule.check, p, c),
                    Input::Gres(g) => gres_check(&rule.check, g),
                    Input::Gateway(g) => gateway_check(&rule.check, p, g),
                    Input::Keel(d) => keel_check(&rule.check, p, d),
                    Input::Sbatch(s) if rule.check == "sbatch.requeue" => sbatch_requeue(s, inputs),
                    Input::Sbatch(s) => sbatch_check(&rule.check, p, s, opts),
                    Input::Node(n) => node_check(&rule.check, n),
                    Input::Prometheus(c) => prometheus_check(&rule.check, c),
                    Input::Env(..) | Input::Nccl(..) => Vec::new(),
                };
                failures.extend(f);
            }
        }
    }
    if !applied {
        Outcome::NotApplicable
    } else if failures.is_empty() {
        Outcome::Pass
    } else {
        Outcome::Fail(failures)
    }
}

/// Whether a check has anything to look at in `input`: a rule on the
/// models that follow the registry does not apply to a gateway without
/// one, nor a registry rule to a keel config without `[model]`.
fn applies(check: &str, input: &Input) -> bool {
    match (check, input) {
        ("gateway.registry_signatures", Input::Gateway(g)) => {
            models(&g.doc).iter().any(|m| m.get("registry").is_some())
        }
        ("keel.durable_registry_db", Input::Keel(d)) => d.get("model").is_some(),
        _ => true,
    }
}

fn fail(location: Location, message: String) -> Vec<Failure> {
    vec![Failure { location, message }]
}

fn file_start(file: &str) -> Location {
    Location {
        file: file.to_owned(),
        line: 1,
    }
}

fn key_of(p: &Params) -> &str {
    p.key.as_deref().unwrap_or("")
}

fn is_infinite(v: &str) -> bool {
    ["INFINITE", "UNLIMITED", "-1", "NONE"]
        .iter()
        .any(|x| v.eq_ignore_ascii_case(x))
}

/// Every node is an autoscaled cloud node: `State=CLOUD` on every
/// NodeName line, with power saving on (a finite SuspendTime and a
/// ResumeProgram), as Azure CycleCloud writes slurm.conf.
fn autoscaled_cloud(c: &SlurmConf) -> bool {
    let mut nodes = c
        .records(RecordKind::Node)
        .filter(|n| !n.name.eq_ignore_ascii_case("DEFAULT"))
        .peekable();
    if nodes.peek().is_none() {
        return false;
    }
    let cloud = nodes.all(|n| {
        n.get("State").is_some_and(|s| {
            s.value
                .split('+')
                .any(|w| w.trim().eq_ignore_ascii_case("CLOUD"))
        })
    });
    let power_save = c
        .get("SuspendTime")
        .is_some_and(|t| !is_infinite(t.value.trim()) && !t.value.trim().is_empty())
        && c.get("ResumeProgram")
            .is_some_and(|r| !r.value.trim().is_empty());
    cloud && power_save
}

fn slurm_check(check: &str, p: &Params, c: &SlurmConf) -> Vec<Failure> {
    let main = c.files.first().map_or("", String::as_str);
    let key = key_of(p);
    let entry = c.get(key);
    let shown = |e: Option<&crate::slurm::Entry>| match e {
        Some(e) => format!("{}={}", e.key, cut(&e.value)),
        None => format!(
            "{key} is not set{}",
            p.default
                .as_ref()
                .map(|d| format!(" (default {d})"))
                .unwrap_or_default()
        ),
    };
    let loc = |e: Option<&crate::slurm::Entry>| {
        e.map_or_else(|| file_start(main), |e| e.location.clone())
    };
    let value = entry.map(|e| e.value.as_str()).or(p.default.as_deref());
    match check {
        "slurm.set" => match entry {
            Some(e) if !e.value.trim().is_empty() => Vec::new(),
            _ => fail(loc(entry), format!("{key} is not set")),
        },
        "slurm.min" => {
            let min = p.min.unwrap_or(1);
            match value.map(str::trim) {
                Some(v) if v.parse::<i64>().is_ok_and(|n| n >= min) => Vec::new(),
                _ => fail(
                    loc(entry),
                    format!("{}: must be at least {min}", shown(entry)),
                ),
            }
        }
        "slurm.one_of" => match value {
            Some(v) if p.values.iter().any(|x| x.eq_ignore_ascii_case(v.trim())) => Vec::new(),
            _ => fail(
                loc(entry),
                format!("{}: expected {}", shown(entry), p.values.join(" or ")),
            ),
        },
        "slurm.none_of" => {
            let bad = value.is_some_and(|v| {
                v.split(',')
                    .all(|item| p.values.iter().any(|x| x.eq_ignore_ascii_case(item.trim())))
            });
            if bad {
                fail(loc(entry), shown(entry))
            } else {
                Vec::new()
            }
        }
        "slurm.set_when" => {
            let Some(trigger) = p.when.iter().find_map(|w| c.get(w)) else {
                return Vec::new();
            };
            match entry {
                Some(e) if !e.value.trim().is_empty() => Vec::new(),
                _ => fail(
                    trigger.location.clone(),
                    format!("{} is set but {key} is not", trigger.key),
                ),
            }
        }
        "slurm.prolog_epilog_timeout" => {
            // PrologEpilogTimeout bounds both; since Slurm 25.05
            // PrologTimeout and EpilogTimeout bound each on its own
            // (SchedMD/slurm 60be338).
            let set = |k: &str| c.get(k).is_some_and(|e| !e.value.trim().is_empty());
            let mut out = Vec::new();
            for (script, own) in [("Prolog", "PrologTimeout"), ("Epilog", "EpilogTimeout")] {
                let Some(trigger) = c.get(script) else {
                    continue;
                };
                if !set("PrologEpilogTimeout") && !set(own) {
                    out.push(Failure {
                        location: trigger.location.clone(),
                        message: format!(
                            "{script} is set but neither PrologEpilogTimeout nor {own} is"
                        ),
                    });
                }
            }
            out
        }
        "slurm.return_to_service" => {
            let v = value.map(str::trim).unwrap_or("0");
            if v == "1" {
                return Vec::new();
            }
            if v == "2" && autoscaled_cloud(c) {
                return Vec::new();
            }
            let why = if v == "2" {
                ": nodes that are not autoscaled CLOUD nodes come back from DOWN whatever put them there"
            } else {
                ""
            };
            fail(loc(entry), format!("{}: expected 1{why}", shown(entry)))
        }
        "slurm.finite" => match entry {
            Some(e) if !is_infinite(e.value.trim()) && !e.value.trim().is_empty() => Vec::new(),
            _ => fail(loc(entry), format!("{}: power saving is off", shown(entry))),
        },
        "slurm.list_has" => {
            let has = entry.is_some_and(|e| {
                e.value
                    .split(',')
                    .any(|item| p.values.iter().any(|x| item.trim().eq_ignore_ascii_case(x)))
            });
            if has {
                Vec::new()
            } else {
                fail(
                    loc(entry),
                    format!("{}: lacks {}", shown(entry), p.values.join(" or ")),
                )
            }
        }
        "slurm.power_save_programs" => {
            let Some(t) = c.get("SuspendTime") else {
                return Vec::new();
            };
            if is_infinite(t.value.trim()) {
                return Vec::new();
            }
            let missing: Vec<&str> = ["SuspendProgram", "ResumeProgram"]
                .into_iter()
                .filter(|k| c.get(k).is_none_or(|e| e.value.trim().is_empty()))
                .collect();
            if missing.is_empty() {
                Vec::new()
            } else {
                fail(
                    t.location.clone(),
                    format!(
                        "SuspendTime={} but {} not set",
                        cut(&t.value),
                        missing.join(" and ")
                    ),
                )
            }
        }
        "slurm.preempt_requeue" => {
            let Some(t) = c.get("PreemptType") else {
                return Vec::new();
            };
            if t.value.trim().eq_ignore_ascii_case("preempt/none") {
                return Vec::new();
            }
            let mode = c.get("PreemptMode");
            let requeue = mode.is_some_and(|m| {
                m.value
                    .split(',')
                    .any(|x| x.trim().eq_ignore_ascii_case("REQUEUE"))
            });
            if requeue {
                Vec::new()
            } else {
                fail(
                    mode.map_or_else(|| t.location.clone(), |m| m.location.clone()),
                    format!(
                        "PreemptType={} with PreemptMode={}",
                        cut(&t.value),
                        mode.map_or("OFF (default)".to_owned(), |m| cut(&m.value))
                    ),
                )
            }
        }
        "slurm.job_comment" => {
            // Without accounting there is nothing to store it in:
            // KEEL-COST-003 says so.
            let storage = c.get("AccountingStorageType");
            let accounted = storage.is_some_and(|e| {
                let v = e.value.trim();
                !v.is_empty() && !v.eq_ignore_ascii_case("accounting_storage/none")
            });
            let Some(storage) = storage.filter(|_| accounted) else {
                return Vec::new();
            };
            // AccountingStoreJobComment was removed in Slurm 21.08, where
            // slurmctld stops on it; before, it defaulted to YES.
            if let Some(old) = c.get("AccountingStoreJobComment") {
                return fail(
                    old.location.clone(),
                    format!(
                        "AccountingStoreJobComment={} was removed in Slurm 21.08 (slurmctld exits on it): use AccountingStoreFlags=job_comment",
                        cut(&old.value)
                    ),
                );
            }
            let flags = c.get("AccountingStoreFlags");
            let stored = flags.is_some_and(|e| {
                e.value
                    .split(',')
                    .any(|x| x.trim().eq_ignore_ascii_case("job_comment"))
            });
            if stored {
                Vec::new()
            } else {
                fail(
                    flags.map_or_else(|| storage.location.clone(), |f| f.location.clone()),
                    format!(
                        "AccountingStorageType={} with {}: Slurm 21.08 and later store no job comments",
                        cut(&storage.value),
                        flags.map_or("no AccountingStoreFlags".to_owned(), |f| format!(
                            "AccountingStoreFlags={}",
                            cut(&f.value)
                        ))
                    ),
                )
            }
        }
        "slurm.gres_types" => {
            let gpu_node = c.records(RecordKind::Node).find(|n| {
                n.get("Gres")
                    .is_some_and(|g| g.value.split(',').any(|x| x.trim().starts_with("gpu")))
            });
            let Some(node) = gpu_node else {
                return Vec::new();
            };
            let has = c.get("GresTypes").is_some_and(|e| {
                e.value
                    .split(',')
                    .any(|x| x.trim().eq_ignore_ascii_case("gpu"))
            });
            if has {
                Vec::new()
            } else {
                fail(
                    node.location.clone(),
                    format!(
                        "NodeName={} declares GPUs but GresTypes lacks gpu",
                        cut(&node.name)
                    ),
                )
            }
        }
        _ => Vec::new(),
    }
}

fn gres_check(check: &str, g: &GresConf) -> Vec<Failure> {
    match check {
        "gres.autodetect" => {
            let nvml = g.lines.iter().any(|l| {
                l.get("AutoDetect")
                    .is_some_and(|e| e.value.trim().eq_ignore_ascii_case("nvml"))
            });
            if nvml {
                Vec::new()
            } else {
                let at = g
                    .lines
                    .iter()
                    .find_map(|l| l.get("AutoDetect"))
                    .map_or_else(|| file_start(&g.file), |e| e.location.clone());
                fail(at, "no AutoDetect=nvml".to_owned())
            }
        }
        _ => Vec::new(),
    }
}

/// The table and key of a dotted path: `traffic.health.enabled` is key
/// `enabled` in `[traffic.health]`.
fn split_path(path: &str) -> (&str, &str) {
    path.rsplit_once('.').unwrap_or(("", path))
}

fn toml_loc(d: &TomlDoc, path: &str) -> Location {
    let (table, key) = split_path(path);
    d.location(table, 0, key)
}

fn loopback(hostport: &str) -> bool {
    let host = match hostport.rsplit_once(':') {
        Some((h, _)) => h,
        None => hostport,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host == "localhost" || host == "::1" || host.starts_with("127.")
}

fn url_host(url: &str) -> Option<&str> {
    let rest = url.split_once("://")?.1;
    let authority = rest.split('/').next()?;
    Some(authority.rsplit_once('@').map_or(authority, |(_, h)| h))
}

fn models(d: &TomlDoc) -> Vec<&toml::Table> {
    d.get("models")
        .and_then(|m| m.as_array())
        .map(|a| a.iter().filter_map(|v| v.as_table()).collect())
        .unwrap_or_default()
}

fn model_name(m: &toml::Table) -> String {
    cut(m.get("name").and_then(|n| n.as_str()).unwrap_or("?"))
}

fn gateway_check(check: &str, p: &Params, g: &GatewayInput) -> Vec<Failure> {
    let d = &g.doc;
    let key = key_of(p);
    match check {
        "gateway.valid" => match &g.invalid {
            None => Vec::new(),
            Some(msg) => {
                let line = msg
                    .find("line ")
                    .and_then(|i| {
                        msg[i + 5..]
                            .chars()
                            .take_while(char::is_ascii_digit)
                            .collect::<String>()
                            .parse()
                            .ok()
                    })
                    .unwrap_or(1);
                fail(
                    Location {
                        file: d.file.clone(),
                        line,
                    },
                    format!("keel serve refuses it: {msg}"),
                )
            }
        },
        "gateway.auth" => {
            if d.get("auth.keys_file").is_some() || d.get("auth.jwt").is_some() {
                Vec::new()
            } else {
                fail(
                    d.location("auth", 0, "keys_file"),
                    "neither auth.keys_file nor [auth.jwt] is set".to_owned(),
                )
            }
        }
        "gateway.tls" => {
            let default = if key == "server" {
                Some("127.0.0.1:8080")
            } else {
                None
            };
            let Some(listen) = d.str(&format!("{key}.listen")).or(default) else {
                return Vec::new();
            };
            if loopback(listen) {
                return Vec::new();
            }
            let has = d.get(&format!("{key}.tls_cert")).is_some()
                && d.get(&format!("{key}.tls_key")).is_some();
            if has {
                Vec::new()
            } else {
                fail(
                    d.location(key, 0, "listen"),
                    format!(
                        "{key}.listen = {} without tls_cert and tls_key",
                        cut(listen)
                    ),
                )
            }
        }
        "gateway.backend_tls" => {
            let mut out = Vec::new();
            let mut dep_index = 0usize;
            for m in models(d) {
                let deps = m
                    .get("deployments")
                    .and_then(|v| v.as_array())
                    .cloned()
                    .unwrap_or_default();
                for dep in deps {
                    let url = dep.get("url").and_then(|u| u.as_str()).unwrap_or("");
                    if url.starts_with("http://") && !url_host(url).is_some_and(loopback) {
                        out.push(Failure {
                            location: d.location("models.deployments", dep_index, "url"),
                            message: format!(
                                "model {} deployment {} is plain http to {}",
                                model_name(m),
                                cut(dep.get("name").and_then(|n| n.as_str()).unwrap_or("?")),
                                cut(url_host(url).unwrap_or(url))
                            ),
                        });
                    }
                    dep_index += 1;
                }
            }
            out
        }
        "gateway.jwks_https" => match d.str("auth.jwt.jwks_url") {
            Some(u) if !u.starts_with("https://") => fail(
                toml_loc(d, "auth.jwt.jwks_url"),
                format!("jwks_url {} is not https", cut(u)),
            ),
            _ => Vec::new(),
        },
        "gateway.set" => {
            if d.get(key).is_some() {
                Vec::new()
            } else {
                fail(toml_loc(d, key), format!("{key} is not set"))
            }
        }
        "gateway.unset" => match d.get(key) {
            Some(v) => fail(toml_loc(d, key), format!("{key} = {}", cut(&v.to_string()))),
            None => Vec::new(),
        },
        "gateway.set_when" => {
            if !p.when.iter().any(|w| d.get(w).is_some()) || d.get(key).is_some() {
                Vec::new()
            } else {
                fail(
                    toml_loc(d, &p.when[0]),
                    format!("{} is set but {key} is not", p.when.join(" or ")),
                )
            }
        }
        "gateway.not_true" => match d.get(key).and_then(|v| v.as_bool()) {
            Some(true) => fail(toml_loc(d, key), format!("{key} = true")),
            _ => Vec::new(),
        },
        "gateway.not_false" => match d.get(key).and_then(|v| v.as_bool()) {
            Some(false) => fail(toml_loc(d, key), format!("{key} = false")),
            _ => Vec::new(),
        },
        "gateway.min" => {
            let min = p.min.unwrap_or(1);
            let v = d
                .get(key)
                .and_then(|v| v.as_integer())
                .or_else(|| p.default.as_deref().and_then(|x| x.parse().ok()));
            match v {
                Some(n) if n >= min => Vec::new(),
                other => fail(
                    toml_loc(d, key),
                    format!(
                        "{key} = {}: must be at least {min}",
                        other.map_or("?".to_owned(), |n| n.to_string())
                    ),
                ),
            }
        }
        "gateway.limits" | "gateway.quota" => {
            let fields: &[&str] = if check == "gateway.limits" {
                &["requests_per_minute", "tokens_per_minute"]
            } else {
                &["tokens_per_day", "tokens_per_month"]
            };
            let has = fields
                .iter()
                .any(|f| d.get(&format!("limits.default.{f}")).is_some());
            if has {
                Vec::new()
            } else {
                fail(
                    d.location("limits.default", 0, fields[0]),
                    format!("limits.default sets neither {}", fields.join(" nor ")),
                )
            }
        }
        "gateway.fallback" => {
            let mut out = Vec::new();
            for (i, m) in models(d).into_iter().enumerate() {
                let empty = m
                    .get("fallback")
                    .and_then(|f| f.as_array())
                    .is_none_or(|a| a.is_empty());
                if empty {
                    out.push(Failure {
                        location: d.location("models", i, "fallback"),
                        message: format!("model {} has no fallback", model_name(m)),
                    });
                }
            }
            out
        }
        "gateway.redundant" => {
            let mut out = Vec::new();
            for (i, m) in models(d).into_iter().enumerate() {
                let live = m
                    .get("deployments")
                    .and_then(|v| v.as_array())
                    .map(|a| {
                        a.iter()
                            .filter(|dep| {
                                dep.get("weight").and_then(|w| w.as_integer()).unwrap_or(1) > 0
                            })
                            .count()
                    })
                    .unwrap_or(0);
                if live < 2 {
                    out.push(Failure {
                        location: d.location("models", i, "name"),
                        message: format!(
                            "model {} has {live} deployment{} with traffic",
                            model_name(m),
                            if live == 1 { "" } else { "s" }
                        ),
                    });
                }
            }
            out
        }
        "gateway.registry_signatures" => {
            let mut out = Vec::new();
            for (i, m) in models(d).into_iter().enumerate() {
                let Some(r) = m.get("registry") else {
                    continue;
                };
                let stable = r
                    .get("stable")
                    .and_then(|v| v.as_str())
                    .unwrap_or("production");
                let signed = r.get("require_signature").and_then(|v| v.as_bool()) == Some(true);
                let allowed = r
                    .get("allowed_backends")
                    .and_then(|v| v.as_array())
                    .is_some_and(|a| !a.is_empty());
                let missing = match (signed, allowed) {
                    (false, _) => "registry.require_signature = true",
                    (true, false) => "registry.allowed_backends (where its versions may be served)",
                    (true, true) => continue,
                };
                out.push(Failure {
                    location: d.location("models", i, "registry"),
                    message: format!(
                        "model {} serves registry model {}@{} without {missing}",
                        model_name(m),
                        cut(r.get("model").and_then(|v| v.as_str()).unwrap_or("?")),
                        cut(stable)
                    ),
                });
            }
            out
        }
        _ => Vec::new(),
    }
}

/// Path prefixes of storage a reboot or a VM's deallocation wipes: tmpfs
/// and the node-local disks of Azure's GPU VMs (the resource disk, local
/// NVMe) and of scratch set-ups (`keel scratch`).
const EPHEMERAL_PREFIXES: &[&str] = &[
    "/tmp/",
    "/var/tmp/",
    "/dev/shm/",
    "/run/",
    "/mnt/resource",
    "/mnt/nvme",
    "/mnt/scratch",
    "/mnt/local",
    "/scratch/",
    "/local/",
    "/nvme",
];

fn prometheus_check(check: &str, c: &PromConfig) -> Vec<Failure> {
    let at = |line: u32| Location {
        file: c.file.clone(),
        line,
    };
    match check {
        "prometheus.scrapes_keel" => {
            let keel = c.jobs.iter().find(|j| {
                j.name.to_ascii_lowercase().contains("keel")
                    && (!j.targets.is_empty() || j.discovery)
            });
            if keel.is_some() {
                return Vec::new();
            }
            let names: Vec<String> = c.jobs.iter().map(|j| cut(&j.name)).collect();
            let found = if names.is_empty() {
                "no scrape job".to_owned()
            } else {
                format!("scrape jobs: {}", names.join(", "))
            };
            fail(
                at(c.jobs_line),
                format!(
                    "no scrape job for keel's exporter (a job_name with keel and targets); {found}"
                ),
            )
        }
        "prometheus.keel_alerts" => {
            if c.rule_files.iter().any(|r| r.keel_alerts) {
                return Vec::new();
            }
            let globs = c
                .rule_files
                .iter()
                .any(|r| r.path.contains(['*', '?', '[']));
            let mut message = if c.rule_files.is_empty() {
                "rule_files loads no rule file".to_owned()
            } else {
                let files: Vec<String> = c.rule_files.iter().map(|r| cut(&r.path)).collect();
                format!("rule_files loads no keel-alerts.yml: {}", files.join(", "))
            };
            if globs {
                message.push_str(" (globs are not expanded: name keel-alerts.yml)");
            }
            fail(at(c.rule_files_line), message)
        }
        _ => Vec::new(),
    }
}

fn keel_check(check: &str, p: &Params, d: &TomlDoc) -> Vec<Failure> {
    let key = key_of(p);
    match check {
        "keel.set" => {
            if d.get(key).is_some() {
                Vec::new()
            } else {
                fail(toml_loc(d, key), format!("{key} is not set"))
            }
        }
        "keel.durable_registry_db" => match d.str("model.db") {
            None => fail(
                toml_loc(d, "model.db"),
                "model.db is not set: the registry is in the home directory of whoever runs keel model"
                    .to_owned(),
            ),
            Some(db) => match EPHEMERAL_PREFIXES.iter().find(|p| db.starts_with(*p)) {
                Some(prefix) => fail(
                    toml_loc(d, "model.db"),
                    format!(
                        "model.db {} is under {prefix}, which a reboot or a deallocation wipes",
                        cut(db)
                    ),
                ),
                None => Vec::new(),
            },
        },
        _ => Vec::new(),
    }
}

/// The `keel ckpt push|watch` lines of a script.
fn ckpt_lines(s: &Sbatch) -> Vec<&(u32, String)> {
    s.commands
        .iter()
        .filter(|(_, l)| l.contains("keel ckpt push") || l.contains("keel ckpt watch"))
        .collect()
}

fn flag_value<'a>(line: &'a str, flag: &str) -> Option<&'a str> {
    let mut toks = line.split_whitespace();
    while let Some(t) = toks.next() {
        if t == flag {
            return toks.next();
        }
        if let Some(v) = t.strip_prefix(flag).and_then(|r| r.strip_prefix('=')) {
            return Some(v);
        }
    }
    None
}

fn directive_int(s: &Sbatch, option: &str) -> Option<u64> {
    s.directive(option)
        .and_then(|d| d.value.as_deref())
        .and_then(|v| v.split('-').next())
        .and_then(|v| v.trim().parse().ok())
}

/// Whether Slurm requeues the job after a node failure or preemption:
/// `#SBATCH --requeue`, or no `--no-requeue` while slurm.conf's
/// `JobRequeue` is 1 (its default: slurm.conf(5), "JobRequeue ... The
/// default value is 1"). Without a slurm.conf the default is assumed.
fn sbatch_requeue(s: &Sbatch, inputs: &[Input]) -> Vec<Failure> {
    let requeue = s
        .directives
        .iter()
        .rev()
        .find(|d| d.option == "requeue" || d.option == "no-requeue");
    match requeue {
        Some(d) if d.option == "requeue" => Vec::new(),
        Some(d) => fail(
            Location {
                file: s.file.clone(),
                line: d.line,
            },
            "#SBATCH --no-requeue: Slurm will not restart the job after a node failure".to_owned(),
        ),
        None => {
            let off = inputs.iter().find_map(|i| match i {
                Input::Slurm(c) => c.get("JobRequeue").filter(|e| e.value.trim() == "0"),
                _ => None,
            });
            match off {
                Some(e) => fail(
                    file_start(&s.file),
                    format!(
                        "no #SBATCH --requeue, and {}:{} sets JobRequeue=0",
                        e.location.file, e.location.line
                    ),
                ),
                None => Vec::new(),
            }
        }
    }
}

fn sbatch_check(check: &str, p: &Params, s: &Sbatch, opts: &Options) -> Vec<Failure> {
    match check {
        "sbatch.option" => {
            let opt = p.option.as_deref().unwrap_or("");
            if s.directive(opt).is_some() {
                Vec::new()
            } else {
                fail(file_start(&s.file), format!("no #SBATCH --{opt}"))
            }
        }
        "sbatch.runs" => {
            let found = s
                .commands
                .iter()
                .any(|(_, l)| p.values.iter().any(|v| l.contains(v.as_str())));
            if found {
                Vec::new()
            } else {
                fail(
                    file_start(&s.file),
                    format!("runs none of: {}", p.values.join(", ")),
                )
            }
        }
        "sbatch.ckpt_cap" => {
            let env_cap = s
                .exports
                .iter()
                .rev()
                .find(|v| v.name == "KEEL_CKPT_CAP")
                .map(|v| v.value.as_str());
            let writers = directive_int(s, "nodes").unwrap_or(1)
                * directive_int(s, "ntasks-per-node").unwrap_or(1);
            let mut out = Vec::new();
            for (line, text) in ckpt_lines(s) {
                let at = Location {
                    file: s.file.clone(),
                    line: *line,
                };
                let Some(cap) = flag_value(text, "--cap").or(env_cap) else {
                    out.push(Failure {
                        location: at,
                        message: "keel ckpt runs without --cap or KEEL_CKPT_CAP".to_owned(),
                    });
                    continue;
                };
                let parsed = match Bandwidth::parse(cap) {
                    Ok(b) => b,
                    Err(e) => {
                        out.push(Failure {
                            location: at,
                            message: format!("cap {}: {e}", cut(cap)),
                        });
                        continue;
                    }
                };
                if let Some(ingress) = opts.storage_ingress {
                    #[allow(clippy::cast_precision_loss)]
                    let total = parsed.bits_per_sec() * writers as f64;
                    if total >= ingress.bits_per_sec() {
                        out.push(Failure {
                            location: at,
                            message: format!(
                                "cap {} × {writers} writers = {:.0} Mbit/s, not below the ingress {:.0} Mbit/s",
                                cut(cap),
                                total / 1e6,
                                ingress.bits_per_sec() / 1e6
                            ),
                        });
                    }
                }
            }
            out
        }
        "sbatch.keel_run_signal" => keel_run_signal(s, p),
        _ => Vec::new(),
    }
}

/// A `keel run` line's waits against the script's `--signal`: the warning
/// must go to the batch shell (`B:`, keel run), be a signal keel run
/// answers, and come early enough for the checkpoint deadline, the grace
/// and the stop reserve before Slurm's SIGKILL, which follows the end by
/// KillWait (`params.min`, Slurm's default 30 s: the rule reads only the
/// script). As `keel_run::budget::least_signal_secs`.
fn keel_run_signal(s: &Sbatch, p: &Params) -> Vec<Failure> {
    let Some((line, text)) = s.commands.iter().find(|(_, l)| {
        l.split_whitespace()
            .collect::<Vec<_>>()
            .windows(2)
            .any(|w| w[0].ends_with("keel") && w[1] == "run")
    }) else {
        return Vec::new();
    };
    let at = |line: u32| Location {
        file: s.file.clone(),
        line,
    };
    let secs = |flag: &str, default: f64| {
        flag_value(text, flag)
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|v| v.is_finite() && *v >= 0.0)
            .unwrap_or(default)
    };
    let deadline = secs("--checkpoint-deadline", 120.0);
    let grace = secs("--grace", 30.0);
    let reserve = secs("--stop-reserve", 3.0);
    #[allow(clippy::cast_precision_loss)]
    let kill_wait = p.min.unwrap_or(30) as f64;
    let need = (deadline + grace + reserve - kill_wait).max(0.0);
    let Some(d) = s.directive("signal") else {
        return fail(
            at(*line),
            format!("keel run gets no warning before the time limit: no #SBATCH --signal (it needs B:USR1@{need:.0} or more)"),
        );
    };
    let value = d.value.as_deref().unwrap_or("");
    let (target, rest) = match value.split_once(':') {
        Some((t, r)) => (Some(t), r),
        None => (None, value),
    };
    let (sig, when) = match rest.split_once('@') {
        Some((sig, w)) => (sig, w.trim().parse::<f64>().ok()),
        None => (rest, Some(60.0)),
    };
    let sig = sig.trim().to_ascii_uppercase();
    let sig = sig.strip_prefix("SIG").unwrap_or(&sig);
    let mut out = Vec::new();
    if !target.is_some_and(|t| t.contains('B')) {
        out.push(Failure {
            location: at(d.line),
            message: format!(
                "--signal={} goes to the job's steps, not to the batch shell where keel run runs: use B:",
                cut(value)
            ),
        });
    }
    if !matches!(sig, "USR1" | "USR2" | "TERM" | "10" | "12" | "15") {
        out.push(Failure {
            location: at(d.line),
            message: format!(
                "--signal={}: keel run checkpoints on USR1, USR2 or TERM only",
                cut(value)
            ),
        });
    }
    match when {
        Some(w) if w >= need => {}
        Some(w) => out.push(Failure {
            location: at(d.line),
            message: format!(
                "--signal={} warns {w:.0} s before the end, but keel run's waits (--checkpoint-deadline {deadline:.0} + --grace {grace:.0} + --stop-reserve {reserve:.0} s, less KillWait {kill_wait:.0} s) need {need:.0} s: keel shortens them and the checkpoint may not commit",
                cut(value)
            ),
        }),
        None => out.push(Failure {
            location: at(d.line),
            message: format!("--signal={}: the time is not a number", cut(value)),
        }),
    }
    out
}

fn env_check(
    check: &str,
    p: &Params,
    env: &[&EnvVar],
    script: Option<&Sbatch>,
    file: &str,
) -> Vec<Failure> {
    let key = key_of(p);
    let find = |name: &str| env.iter().rev().find(|v| v.name == name).copied();
    match check {
        "env.hcoll_off" => {
            // Only where MPI launches the job: a script that starts its
            // ranks without MPI (torchrun, srun without --mpi) loads no
            // HCOLL. An environment file alone is taken as an MPI job's.
            let uses_mpi = script.is_none_or(|s| {
                s.commands.iter().any(|(_, l)| {
                    l.split_whitespace().any(|t| {
                        t == "mpirun"
                            || t == "mpiexec"
                            || t.ends_with("/mpirun")
                            || t.starts_with("--mpi=")
                    })
                })
            });
            if !uses_mpi {
                return Vec::new();
            }
            let var =
                find("OMPI_MCA_coll_hcoll_enable").or_else(|| find("OMPI_MCA_COLL_HCOLL_ENABLE"));
            if var.is_some_and(|v| v.value.trim() == "0") {
                return Vec::new();
            }
            let on_mpirun = script.is_some_and(|s| {
                s.commands.iter().any(|(_, l)| {
                    let toks: Vec<&str> = l.split_whitespace().collect();
                    toks.windows(3).any(|w| {
                        (w[0] == "-mca" || w[0] == "--mca")
                            && w[1] == "coll_hcoll_enable"
                            && w[2] == "0"
                    })
                })
            });
            if on_mpirun {
                return Vec::new();
            }
            match var {
                Some(v) => fail(v.location.clone(), format!("{}={}", v.name, cut(&v.value))),
                None => fail(
                    file_start(file),
                    "OMPI_MCA_coll_hcoll_enable is not 0".to_owned(),
                ),
            }
        }
        "env.one_of" => match find(key) {
            Some(v) if p.values.iter().any(|x| x == v.value.trim()) => Vec::new(),
            Some(v) => fail(
                v.location.clone(),
                format!(
                    "{key}={}: expected {}",
                    cut(&v.value),
                    p.values.join(" or ")
                ),
            ),
            None => fail(file_start(file), format!("{key} is not set")),
        },
        "env.set" => match find(key) {
            Some(v) if !v.value.trim().is_empty() => Vec::new(),
            _ => fail(file_start(file), format!("{key} is not set")),
        },
        "env.nccl_ib_hca_node_wide" => match script {
            Some(s) => per_rank_ib_hca_lines(s),
            None => {
                let rank_var = RANK_VARS.iter().find_map(|r| find(r));
                match (find("NCCL_IB_HCA"), rank_var) {
                    (Some(v), Some(r)) if names_one_hca(&v.value) => fail(
                        v.location.clone(),
                        format!(
                            "NCCL_IB_HCA={} names one HCA in a rank's environment ({}={}): each rank has its own",
                            cut(&v.value),
                            r.name,
                            cut(&r.value)
                        ),
                    ),
                    _ => Vec::new(),
                }
            }
        },
        _ => Vec::new(),
    }
}

/// Variables that differ from rank to rank.
const RANK_VARS: &[&str] = &[
    "SLURM_LOCALID",
    "SLURM_PROCID",
    "LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_RANK",
    "PMIX_RANK",
    "MPI_LOCALRANKID",
    "RANK",
];

/// Whether shell text refers to a rank variable (`$LOCAL_RANK`,
/// `${SLURM_LOCALID:-0}`).
fn mentions_rank_var(text: &str) -> bool {
    RANK_VARS.iter().any(|v| {
        [format!("${v}"), format!("${{{v}")].iter().any(|r| {
            text.match_indices(r.as_str()).any(|(at, m)| {
                // `$RANK` is not `$RANKS`, nor the tail of `$LOCAL_RANK`.
                let next = text[at + m.len()..].chars().next();
                m.starts_with("${") || !next.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
            })
        })
    })
}

/// An `NCCL_IB_HCA` value that names exactly one HCA (`mlx5_ib3:1`,
/// `=mlx5_ib3`), not a prefix that matches several (`mlx5`) or an
/// exclusion (`^mlx5_an0`).
fn names_one_hca(value: &str) -> bool {
    let v = value.trim();
    if v.is_empty() || v.starts_with('^') {
        return false;
    }
    let exact = v.starts_with('=');
    let items: Vec<&str> = v.trim_start_matches('=').split(',').collect();
    items.len() == 1 && (exact || items[0].contains(':'))
}

/// Lines of a script that give `NCCL_IB_HCA` a value per rank: inside a
/// `case` on a rank variable, or built from one.
fn per_rank_ib_hca_lines(s: &Sbatch) -> Vec<Failure> {
    let mut out = Vec::new();
    let mut in_rank_case = false;
    for (line, text) in &s.commands {
        let words: Vec<&str> = text.split_whitespace().collect();
        if words.first() == Some(&"case") && mentions_rank_var(text) {
            in_rank_case = true;
        }
        for (at, _) in text.match_indices("NCCL_IB_HCA=") {
            let value = text[at + "NCCL_IB_HCA=".len()..]
                .split(|c: char| c.is_whitespace() || c == ';')
                .next()
                .unwrap_or("");
            let why = if mentions_rank_var(value) {
                Some("built from a rank variable")
            } else if in_rank_case {
                Some("set in a case on the rank")
            } else {
                None
            };
            if let Some(why) = why {
                out.push(Failure {
                    location: Location {
                        file: s.file.clone(),
                        line: *line,
                    },
                    message: format!(
                        "NCCL_IB_HCA={} {why}: a different value per rank",
                        cut(value)
                    ),
                });
                break;
            }
        }
        if words.contains(&"esac") || words.last().is_some_and(|w| w.ends_with("esac")) {
            in_rank_case = false;
        }
    }
    out
}

fn node_check(check: &str, n: &NodeFacts) -> Vec<Failure> {
    let at = file_start(&n.file());
    match check {
        "node.check" => {
            if n.check_status == "fail" {
                let what = if n.failed_checks.is_empty() {
                    String::new()
                } else {
                    format!(": {}", cut(&n.failed_checks.join("; ")))
                };
                fail(at, format!("keel check fails{what}"))
            } else {
                Vec::new()
            }
        }
        "node.scratch" => {
            if n.scratch.is_empty() {
                fail(
                    at,
                    "no file system on a local NVMe drive or RAID array is mounted".to_owned(),
                )
            } else {
                Vec::new()
            }
        }
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inputs::{parse, Source};
    use crate::slurm::FsLoader;

    fn hcoll(script: &str) -> Outcome {
        let mut diags = Vec::new();
        let input = parse(
            Source {
                path: std::path::Path::new("job.sbatch"),
                text: script,
                kind: Kind::Sbatch,
            },
            &FsLoader,
            &mut diags,
        )
        .expect("input");
        let rule = crate::rules()
            .into_iter()
            .find(|r| r.id == "KEEL-PERF-001")
            .expect("rule");
        evaluate(&rule, &[input], &Options::default())
    }

    fn job_comment(conf: &str) -> Outcome {
        let mut diags = Vec::new();
        let input = parse(
            Source {
                path: std::path::Path::new("slurm.conf"),
                text: conf,
                kind: Kind::Slurm,
            },
            &FsLoader,
            &mut diags,
        )
        .expect("input");
        let rule = crate::rules()
            .into_iter()
            .find(|r| r.id == "KEEL-COST-009")
            .expect("rule");
        evaluate(&rule, &[input], &Options::default())
    }

    #[test]
    fn job_comments_matter_only_where_jobs_are_accounted() {
        const DBD: &str = "AccountingStorageType=accounting_storage/slurmdbd\n";
        assert_eq!(job_comment("ClusterName=c\n"), Outcome::Pass);
        assert_eq!(
            job_comment("AccountingStorageType=accounting_storage/none\n"),
            Outcome::Pass
        );
        assert_eq!(
            job_comment(&format!(
                "{DBD}AccountingStoreFlags=job_script,JOB_COMMENT\n"
            )),
            Outcome::Pass
        );
        // The spelling before Slurm 21.08, which later slurmctlds refuse:
        // reported, with or without the flag beside it.
        for conf in [
            format!("{DBD}AccountingStoreJobComment=YES\n"),
            format!("{DBD}AccountingStoreFlags=job_comment\nAccountingStoreJobComment=YES\n"),
        ] {
            match job_comment(&conf) {
                Outcome::Fail(f) => {
                    assert!(f[0].location.line >= 2);
                    assert_eq!(f[0].message, "AccountingStoreJobComment=YES was removed in Slurm 21.08 (slurmctld exits on it): use AccountingStoreFlags=job_comment");
                }
                other => panic!("expected a failure, got {other:?}"),
            }
        }
        match job_comment(&format!("{DBD}AccountingStoreFlags=job_script\n")) {
            Outcome::Fail(f) => {
                assert_eq!(f[0].location.line, 2);
                assert_eq!(f[0].message, "AccountingStorageType=accounting_storage/slurmdbd with AccountingStoreFlags=job_script: Slurm 21.08 and later store no job comments");
            }
            other => panic!("expected a failure, got {other:?}"),
        }
    }

    #[test]
    fn hcoll_matters_only_where_mpi_launches() {
        assert_eq!(
            hcoll("#!/bin/bash\n#SBATCH -N2\nsrun torchrun train.py\n"),
            Outcome::Pass
        );
        assert!(matches!(
            hcoll("#!/bin/bash\n#SBATCH -N2\nmpirun -np 16 python train.py\n"),
            Outcome::Fail(_)
        ));
        assert_eq!(
            hcoll("#!/bin/bash\nmpirun -mca coll_hcoll_enable 0 -np 16 python train.py\n"),
            Outcome::Pass
        );
        assert!(matches!(
            hcoll(
                "#!/bin/bash\nexport OMPI_MCA_coll_hcoll_enable=1\nsrun --mpi=pmix python t.py\n"
            ),
            Outcome::Fail(_)
        ));
    }
}
