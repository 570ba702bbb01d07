"""The model-registry benchmark's client (scripts/bench-registry): the
unchanged MLflow client (`MlflowClient`, and `models:/` resolution through
`ModelsArtifactRepository.get_underlying_uri`) against one registry server,
keel's or MLflow's, at one or more URLs (replicas, taken in turn by the
client threads).

    python bench_registry.py --urls URL[,URL...] --versions N --writes N
                             --resolves N [--phases write,search] --out FILE

Phases, in order, each timed per call (perf_counter around the client
call) and as a whole (wall time for the throughput):
  register-1    `writes` create_model_version calls from one thread
  register-16   `writes` calls from 16 threads (16 writers), on another model
  alias-16      `writes` set_registered_model_alias calls from 16 threads,
                moving one alias between two versions
  (populate)    `versions` versions of model "search" (run_id run-0..run-99,
                so a run filter matches 1 in 100), 16 threads, not timed
  search-1      20 search_model_versions("name='search' AND run_id='run-7'")
                calls from one thread (100 of the 10,000 versions match)
  search-16     80 such calls from 16 threads
  resolve-16    `resolves` resolutions of models:/search@champion from 16
                threads (the client asks for the alias's version, then its
                download URI: two requests)
A call that raises counts as an error (the client's own retries, on 429
and 5xx, happen inside the call, as for any user).

Where the cores go, per phase: CPU seconds (user + system, from
/proc/PID/stat) used by the client (this process, all its threads), by the
servers (every process in the process groups --server-pgids names) and by
PostgreSQL (every process named postgres), each divided by the calls
answered: `cpu_ms_per_call`. A process that ends during a phase takes its
CPU time with it (the servers and their pooled database connections live
through every phase).

Writes one JSON object:
{phase: {ops, errors, seconds, per_s, p50_ms, p99_ms, cpu_ms_per_call}, ...}.
"""

import argparse
import json
import os
import sys
import threading
import time

from mlflow import MlflowClient


def percentile(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    i = min(len(xs) - 1, max(0, int(round(q * (len(xs) - 1)))))
    return xs[i]


CLK_TCK = os.sysconf("SC_CLK_TCK")
SERVER_PGIDS = set()


def cpu_seconds():
    """CPU seconds so far: {client, server, postgres}."""
    server = postgres = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        # After the name: state ppid pgrp ... utime (14th field) stime (15th).
        pgrp, ticks = int(fields[2]), int(fields[11]) + int(fields[12])
        if pgrp in SERVER_PGIDS:
            server += ticks
        elif comm == "postgres":
            postgres += ticks
    return {"client": time.process_time(), "server": server / CLK_TCK, "postgres": postgres / CLK_TCK}


def run(n_threads, total, urls, op):
    """`total` calls of op(client, i), spread over n_threads threads, each
    with a client of its own on urls[thread % len(urls)]."""
    lat = []
    errors = []
    lock = threading.Lock()
    counter = iter(range(total))

    def worker(t):
        url = urls[t % len(urls)]
        c = MlflowClient(tracking_uri=url, registry_uri=url)
        mine = []
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                break
            t0 = time.perf_counter()
            try:
                op(c, i)
            except Exception as e:  # noqa: BLE001 - counted, reported
                with lock:
                    errors.append(repr(e)[:300])
                continue
            mine.append(time.perf_counter() - t0)
        with lock:
            lat.extend(mine)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    cpu0 = cpu_seconds()
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    seconds = time.perf_counter() - t0
    cpu1 = cpu_seconds()
    calls = max(1, len(lat))
    return {
        "cpu_ms_per_call": {k: round((cpu1[k] - cpu0[k]) * 1000 / calls, 2) for k in cpu0},
        "ops": len(lat),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "seconds": round(seconds, 3),
        "per_s": round(len(lat) / seconds, 1) if seconds > 0 else None,
        "p50_ms": round(percentile(lat, 0.50) * 1000, 2) if lat else None,
        "p99_ms": round(percentile(lat, 0.99) * 1000, 2) if lat else None,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--urls", required=True)
    ap.add_argument("--versions", type=int, default=10000)
    ap.add_argument("--writes", type=int, default=400)
    ap.add_argument("--resolves", type=int, default=2000)
    ap.add_argument("--phases", default="write,search")
    ap.add_argument("--out", required=True)
    ap.add_argument("--server-pgids", default="", help="the servers' process groups, comma-separated")
    a = ap.parse_args()
    SERVER_PGIDS.update(int(p) for p in a.server_pgids.split(",") if p)
    urls = a.urls.split(",")
    phases = a.phases.split(",")
    c = MlflowClient(tracking_uri=urls[0], registry_uri=urls[0])
    out = {}

    def log(msg):
        print(f"==> bench-registry client: {msg}", file=sys.stderr, flush=True)

    src = "s3://bench/models/m"
    if "write" in phases:
        for m in ("w1", "w16"):
            c.create_registered_model(m)
        log("register-1")
        out["register-1"] = run(1, a.writes, urls, lambda c, i: c.create_model_version("w1", src))
        log("register-16")
        out["register-16"] = run(16, a.writes, urls, lambda c, i: c.create_model_version("w16", src))
        log("alias-16")
        out["alias-16"] = run(
            16,
            a.writes,
            urls,
            lambda c, i: c.set_registered_model_alias("w16", "prod", str(i % 2 + 1)),
        )
    if "search" in phases:
        c.create_registered_model("search")
        log(f"populating {a.versions} versions")
        t0 = time.perf_counter()
        pop = run(
            16,
            a.versions,
            urls,
            lambda c, i: c.create_model_version("search", src, run_id=f"run-{i % 100}"),
        )
        out["populate"] = {**pop, "seconds": round(time.perf_counter() - t0, 1)}
        if pop["errors"]:
            # Numbers must be whole for the filter's count: fill the gaps.
            run(1, pop["errors"], urls, lambda c, i: c.create_model_version("search", src, run_id=f"run-{(i * 37) % 100}"))
        flt = "name='search' AND run_id='run-7'"
        found = c.search_model_versions(flt)
        out["search_matches"] = len(found)
        log("search-1")
        out["search-1"] = run(1, 20, urls, lambda c, i: c.search_model_versions(flt))
        log("search-16")
        out["search-16"] = run(16, 80, urls, lambda c, i: c.search_model_versions(flt))
        c.set_registered_model_alias("search", "champion", "5000" if a.versions >= 5000 else "1")
        os.environ["MLFLOW_REGISTRY_URI"] = urls[0]
        os.environ["MLFLOW_TRACKING_URI"] = urls[0]
        from mlflow.store.artifact.models_artifact_repo import ModelsArtifactRepository

        want = ModelsArtifactRepository.get_underlying_uri("models:/search@champion")
        out["resolved"] = want
        log("resolve-16")
        out["resolve-16"] = run(
            16,
            a.resolves,
            urls,
            lambda c, i: ModelsArtifactRepository.get_underlying_uri("models:/search@champion"),
        )
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
