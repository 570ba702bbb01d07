"""Renders scripts/bench-registry's Markdown report from the targets' JSON
files (written by scripts/lib/bench_registry.py), so that a report can be
rendered again from the same results.

    python bench_registry_report.py OUT BASE TARGETS LOAD_BEFORE LOAD_AFTER \
        VERSIONS WRITES RESOLVES ARGS BUILD

reads BASE.<target>.json for each target and writes OUT.
"""
import json, os, subprocess, sys
out, base, targets, lb, la, versions, writes, resolves, args, build = sys.argv[1:]
targets = targets.split()
r = {t: json.load(open(f"{base}.{t}.json")) for t in targets if os.path.exists(f"{base}.{t}.json")}
mlflow_version = subprocess.run([os.path.dirname(sys.executable) + "/mlflow", "--version"], capture_output=True, text=True).stdout.strip()
def cell(t, p):
    x = r.get(t, {}).get(p)
    if not x:
        return "-"
    s = f"{x['per_s']}/s, p50 {x['p50_ms']} ms, p99 {x['p99_ms']} ms"
    if x["errors"]:
        s += f", {x['errors']} errors"
    return s
def ratio(a, b, p):
    x, y = r.get(a, {}).get(p), r.get(b, {}).get(p)
    if not x or not y or not y["per_s"]:
        return "-"
    return f"{x['per_s'] / y['per_s']:.1f}x"
phases = ["register-1", "register-16", "alias-16", "search-1", "search-16", "resolve-16"]
lines = [
    "# Model registry: keel vs MLflow, SQLite and PostgreSQL",
    "",
    "Command: `" + ("scripts/bench-registry " + args).strip() + f"` (versions {versions}, writes {writes}, resolutions {resolves}).",
    f"Client: the MLflow client ({mlflow_version}), unchanged; servers: `keel model serve` ({build}) and `mlflow server` (same version, default workers) with the registry in SQLite or PostgreSQL (Debian 12's PostgreSQL 15, scripts/services/postgres, default settings, fsync on; TLS from both).",
    f"Machine: {os.cpu_count()} cores, shared with other engineers' builds and tests; load average (1, 5, 15 min) {lb} before, {la} after. Client, servers and PostgreSQL on the same cores.",
    "",
    "Each cell: throughput, p50 and p99 latency of one client call (a resolution is two requests).",
    "",
    "| phase | keel SQLite | MLflow SQLite | keel/MLflow | keel PostgreSQL | MLflow PostgreSQL | keel/MLflow | keel PostgreSQL, 2 replicas |",
    "|---|---|---|---|---|---|---|---|",
]
for p in [p for p in phases if any(p in x for x in r.values())]:
    lines.append(f"| {p} | {cell('keel-sqlite', p)} | {cell('mlflow-sqlite', p)} | {ratio('keel-sqlite', 'mlflow-sqlite', p)} | {cell('keel-pg', p)} | {cell('mlflow-pg', p)} | {ratio('keel-pg', 'mlflow-pg', p)} | {cell('keel-pg-2', p)} |")
lines += [
    "",
    "CPU per call (ms of user + system time, /proc/PID/stat) by the client's process (all 16 threads), the server's processes and PostgreSQL's:",
    "",
    "| phase | " + " | ".join(f"{t}: client / server / PostgreSQL" for t in targets if t in r) + " |",
    "|---|" + "---|" * len([t for t in targets if t in r]),
]
def cpu(t, p):
    x = r[t].get(p, {}).get("cpu_ms_per_call")
    if not x:
        return "-"
    # A process that ends during a phase takes its CPU time with it: a
    # sum that went down is not a reading.
    shown = lambda v: f"{v}" if v >= 0 else "n/a (a process ended)"
    pg = shown(x["postgres"]) if "pg" in t else "-"
    return f"{shown(x['client'])} / {shown(x['server'])} / {pg}"
for p in phases:
    if any(p in r[t] for t in r):
        lines.append(f"| {p} | " + " | ".join(cpu(t, p) for t in targets if t in r) + " |")
lines.append("")
for t in targets:
    if t not in r:
        continue
    pop = r[t].get("populate")
    if pop:
        lines.append(f"- {t}: populating {versions} versions (16 writers) took {pop['seconds']} s ({pop['errors']} errors); the search filter matched {r[t].get('search_matches')} versions; models:/search@champion resolved to {r[t].get('resolved')}.")
    for p in phases:
        x = r[t].get(p)
        if x and x.get("first_error"):
            lines.append(f"- {t} {p}: first error: `{x['first_error']}`")
open(out, "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
