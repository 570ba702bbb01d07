"""scripts/bench-streams' driver: starts the streaming backend, each
target in turn (pinned to its core) and the load generator, samples the
target's CPU time and resident memory from /proc while the streams are
open, and writes one JSON line per (target, N) run. The report is
rendered by bench_streams_report.py from those lines.

Processes: the backends (keel-streams backend, one thread each), the
registry keel's rollout reads and the load generator (keel-streams load,
one thread) share core 0; the target alone has core 1 (`taskset`), one
worker thread or process.
"""

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

HOST = "127.0.0.1"
GEN_CORE = "0"
TARGET_CORE = "1"
TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def log(msg):
    print(f"==> bench-streams: {msg}", file=sys.stderr, flush=True)


def free_port():
    s = socket.socket()
    s.bind((HOST, 0))
    p = s.getsockname()[1]
    s.close()
    return p


def wait_http(url, proc, what, timeout=90):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it answered at {url}")
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except urllib.error.HTTPError:
            return  # it answers
        except Exception:
            time.sleep(0.2)
    raise RuntimeError(f"{what} does not answer at {url} after {timeout} s")


def descendants(pid):
    """pid and every process below it."""
    children = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                s = f.read()
        except OSError:
            continue
        ppid = int(s[s.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def usage(pid):
    """(CPU seconds, RSS bytes, peak RSS bytes) of pid's process tree."""
    cpu = rss = hwm = 0
    for p in descendants(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                s = f.read()
            fields = s[s.rindex(")") + 2 :].split()
            cpu += int(fields[11]) + int(fields[12])
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        rss += int(line.split()[1]) * 1024
                    elif line.startswith("VmHWM:"):
                        hwm += int(line.split()[1]) * 1024
        except (OSError, IndexError, ValueError):
            continue
    return cpu / TICK, rss, hwm


class Sampler:
    """Samples a process tree every `every` seconds in a thread."""

    def __init__(self, pid, every=0.5):
        self.pid, self.every, self.samples = pid, every, []
        self.stop = threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self):
        while not self.stop.is_set():
            cpu, rss, hwm = usage(self.pid)
            self.samples.append((time.time(), cpu, rss, hwm))
            self.stop.wait(self.every)

    def done(self):
        self.stop.set()
        self.t.join()
        return self.samples


def start(cmd, cwd, log_path, core, env=None):
    with open(log_path, "ab") as out:
        return subprocess.Popen(
            ["taskset", "-c", core, *cmd],
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def stop(proc):
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def keel_json(keel, *args, cwd=None, env=None):
    r = subprocess.run([keel, "--json", *args], cwd=cwd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"keel {' '.join(args)}: exit {r.returncode}: {r.stderr.strip()[:400]}")
    return json.loads(r.stdout)


def start_backend(a, work, name):
    port = free_port()
    p = start(
        [a.streams_bin, "backend", "--listen", f"{HOST}:{port}", "--ttft-ms", str(a.ttft_ms),
         "--interval-ms", a.interval_ms, "--tokens", a.tokens, "--seed", str(port)],
        work, os.path.join(work, f"{name}.log"), GEN_CORE,
    )
    wait_http(f"http://{HOST}:{port}/health", p, f"backend {name}")
    return p, port


class Registry:
    """keel's registry with `chat` v1 (production) and v2 (canary) on the
    two backends, and the keys the gateway reads and writes it with."""

    def __init__(self, a, work, b1, b2):
        self.dir = os.path.join(work, "registry")
        os.makedirs(self.dir)
        db = os.path.join(self.dir, "registry.db")
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("KEEL_")}
        m = lambda *args: keel_json(a.keel, "model", "--db", db, *args, env=self.env)
        for v, port in ((1, b1), (2, b2)):
            files = os.path.join(self.dir, f"chat-v{v}")
            os.makedirs(files)
            with open(os.path.join(files, "weights.bin"), "w") as f:
                f.write(f"version {v}")
            m("register", "chat", "--path", files, "--tag", f"keel.backend=http://{HOST}:{port}")
        m("alias", "set", "chat", "production", "1", "--reason", "bench-streams stable")
        m("alias", "set", "chat", "canary", "2", "--reason", "bench-streams canary")
        self.read_key = m("keys", "create", "gateway", "--role", "read")["secret"]
        self.write_key = m("keys", "create", "rollouts", "--role", "write")["secret"]
        self.port = free_port()
        self.proc = start(
            [a.keel, "model", "--db", db, "serve", "--listen", f"{HOST}:{self.port}"],
            self.dir, os.path.join(self.dir, "registry.log"), GEN_CORE, env=self.env,
        )
        wait_http(f"http://{HOST}:{self.port}/health", self.proc, "keel model serve")
        self.url = f"http://{HOST}:{self.port}"


ADMIN_TOKEN = "bench-streams-admin-token"


def keel_target(a, work, reg):
    """keel serve with every feature on: API keys, limits with token
    reservations, metrics, the access log, the audit log, and a rollout in
    progress (the canary at 50%, every request sampled for its analysis)."""
    import hashlib

    sha = hashlib.sha256(ADMIN_TOKEN.encode()).hexdigest()
    port, admin, metrics = free_port(), free_port(), free_port()
    with open(os.path.join(work, "registry.key"), "w") as f:
        f.write(reg.read_key)
    with open(os.path.join(work, "rollouts.key"), "w") as f:
        f.write(reg.write_key)
    with open(os.path.join(work, "admin.token"), "w") as f:
        f.write(ADMIN_TOKEN)
    cfg = f"""[server]
listen = "{HOST}:{port}"
access_log = true
workers = 1
[admin]
listen = "{HOST}:{admin}"
token_sha256 = "{sha}"
[metrics]
listen = "{HOST}:{metrics}"
token_sha256 = "{sha}"
[auth]
keys_file = "keys.json"
[audit]
path = "audit.jsonl"
[roles.user]
models = ["chat"]
operations = ["chat"]
[limits.default]
requests_per_minute = 100000000
tokens_per_minute = 100000000000
tokens_per_day = 100000000000
[registry]
url = "{reg.url}"
key_file = "registry.key"
write_key_file = "rollouts.key"
[[models]]
name = "chat"
registry = {{ model = "chat", stable = "production", canary = "canary" }}
[models.rollout]
steps = [50, 100]
interval_s = 86400
min_canary_samples = 100
"""
    with open(os.path.join(work, "keel.toml"), "w") as f:
        f.write(cfg)
    key = keel_json(a.keel, "serve", "keys", "create", "--config", "keel.toml", "--name", "bench", "--role", "user", cwd=work)["secret"]

    def after_start():
        r = subprocess.run(
            [a.keel, "--json", "serve", "rollout", "start", "chat", "--admin", f"http://{HOST}:{admin}", "--token-file", "admin.token"],
            cwd=work, capture_output=True, text=True,
        )
        if r.returncode != 0:
            raise RuntimeError(f"keel serve rollout start: exit {r.returncode}: {r.stderr.strip()[:400]}")

    def before_start():
        # Each run starts its own rollout: the state a previous run left
        # (its rollout still in progress) is not carried over.
        try:
            os.remove(os.path.join(work, "rollouts.json"))
        except FileNotFoundError:
            pass

    # The access log goes to stderr: to a file, as a service's would.
    return dict(
        before_start=before_start,
        cmd=[a.keel, "serve", "--config", "keel.toml"],
        health=f"http://{HOST}:{port}/healthz",
        url=f"http://{HOST}:{port}/v1/chat/completions",
        headers=[f"authorization: Bearer {key}"],
        model="chat",
        after_start=after_start,
        features="API key, limits with token reservations, metrics, access log, audit log, a rollout in progress (canary at 50%, requests sampled for its analysis)",
    )


def keel_min_target(a, work, bport):
    """keel serve with the API key and metrics only: no access or audit
    log, no limits, a fixed deployment (what the features cost)."""
    import hashlib

    sha = hashlib.sha256(ADMIN_TOKEN.encode()).hexdigest()
    d = os.path.join(work, "keel-min")
    os.makedirs(d, exist_ok=True)
    port = free_port()
    with open(os.path.join(d, "keel.toml"), "w") as f:
        f.write(f"""[server]
listen = "{HOST}:{port}"
access_log = false
workers = 1
[metrics]
listen = "{HOST}:{free_port()}"
token_sha256 = "{sha}"
[auth]
keys_file = "keys.json"
[roles.user]
models = ["chat"]
operations = ["chat"]
[[models]]
name = "chat"
[[models.deployments]]
name = "blue"
url = "http://{HOST}:{bport}"
model = "test"
""")
    key = keel_json(a.keel, "serve", "keys", "create", "--config", "keel.toml", "--name", "bench", "--role", "user", cwd=d)["secret"]
    return dict(
        cmd=[a.keel, "serve", "--config", "keel.toml"],
        cwd=d,
        health=f"http://{HOST}:{port}/healthz",
        url=f"http://{HOST}:{port}/v1/chat/completions",
        headers=[f"authorization: Bearer {key}"],
        model="chat",
        features="API key and metrics only: no access or audit log, no limits, no rollout",
    )


def hyper_target(a, work, bport):
    """keel-gateway's bare-proxy example: hyper's HTTP/1 server and
    client, a stream passed straight through; the HTTP stack's floor."""
    port = free_port()
    return dict(
        cmd=[a.bare, f"{HOST}:{port}", f"http://{HOST}:{bport}", "1"],
        health=f"http://{HOST}:{port}/health",
        url=f"http://{HOST}:{port}/v1/chat/completions",
        headers=[],
        model="chat",
        features="hyper's HTTP/1 server and pooled client, one thread, the stream passed through as it comes: no key, limits, routing, metrics or logs (keel-gateway's bare-proxy example)",
    )


def nginx_target(a, work, bport):
    port = free_port()
    d = os.path.join(work, "nginx")
    os.makedirs(d, exist_ok=True)
    conf = f"""daemon off;
master_process off;
worker_processes 1;
worker_rlimit_nofile {a.files};
pid {d}/nginx.pid;
error_log {d}/error.log;
events {{ worker_connections {a.files}; }}
http {{
    access_log off;
    client_body_temp_path {d}; proxy_temp_path {d};
    fastcgi_temp_path {d}; uwsgi_temp_path {d}; scgi_temp_path {d};
    upstream backend {{ server {HOST}:{bport}; keepalive 256; }}
    server {{
        listen {HOST}:{port} backlog=4096;
        location / {{
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""
    with open(os.path.join(d, "nginx.conf"), "w") as f:
        f.write(conf)
    return dict(
        cmd=[a.nginx, "-c", os.path.join(d, "nginx.conf"), "-p", d],
        health=f"http://{HOST}:{port}/health",
        url=f"http://{HOST}:{port}/v1/chat/completions",
        headers=[],
        model="chat",
        features="proxy_pass, proxy_buffering off, access log off, one worker process",
    )


def portkey_target(a, work, bport):
    port = free_port()
    return dict(
        cmd=["node", a.portkey, f"--port={port}", "--headless"],
        env={**os.environ, "NODE_ENV": "production"},
        health=f"http://{HOST}:{port}/",
        url=f"http://{HOST}:{port}/v1/chat/completions",
        headers=["x-portkey-provider: openai", f"x-portkey-custom-host: http://{HOST}:{bport}/v1", "authorization: Bearer none"],
        model="tiny",
        features="@portkey-ai/gateway, NODE_ENV=production, --headless, no keys",
    )


def litellm_target(a, work, bport):
    port = free_port()
    with open(os.path.join(work, "litellm.yaml"), "w") as f:
        f.write(f"""model_list:
  - model_name: chat
    litellm_params:
      model: openai/tiny
      api_base: http://{HOST}:{bport}/v1
      api_key: none
general_settings:
  master_key: sk-bench-litellm
litellm_settings:
  telemetry: false
  drop_params: false
""")
    return dict(
        cmd=[a.litellm, "--config", "litellm.yaml", "--host", HOST, "--port", str(port), "--num_workers", "1"],
        health=f"http://{HOST}:{port}/health/liveliness",
        url=f"http://{HOST}:{port}/v1/chat/completions",
        headers=["authorization: Bearer sk-bench-litellm"],
        model="chat",
        features="LiteLLM proxy, master key, one worker",
    )


def tensorzero_target(a, work, bport):
    """TensorZero's gateway (Rust), built by scripts/lib/build-tensorzero,
    with its observability off (then it needs no database, and has no
    client keys, rate limits or inference log), one tokio worker."""
    port = free_port()
    with open(os.path.join(work, "tensorzero.toml"), "w") as f:
        f.write(f"""[gateway]
bind_address = "{HOST}:{port}"
observability.enabled = false
disable_pseudonymous_usage_analytics = true

[models.chat]
routing = ["backend"]

[models.chat.providers.backend]
type = "openai"
model_name = "tiny"
api_base = "http://{HOST}:{bport}/v1"
api_key_location = "none"
""")
    return dict(
        cmd=[a.tensorzero, "--config-file", "tensorzero.toml"],
        env={**os.environ, "TOKIO_WORKER_THREADS": "1", "RUST_LOG": "warn"},
        health=f"http://{HOST}:{port}/health",
        url=f"http://{HOST}:{port}/openai/v1/chat/completions",
        headers=[],
        model="tensorzero::model_name::chat",
        features="TensorZero gateway (cargo release profile), observability off (no database: no keys, limits or inference log), one tokio worker",
    )


def direct_target(a, work, bport):
    return dict(cmd=None, url=f"http://{HOST}:{bport}/v1/chat/completions", headers=[], model="chat", features="the backend itself")


def probe(t):
    """One short streamed request, which must answer 200 with an event
    stream: a target that cannot stream is reported with its answer."""
    body = json.dumps({"model": t["model"], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}).encode()
    req = urllib.request.Request(t["url"], data=body, method="POST")
    req.add_header("content-type", "application/json")
    for h in t["headers"]:
        k, v = h.split(":", 1)
        req.add_header(k.strip(), v.strip())
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            text = r.read(1 << 16)
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"a streamed chat completion failed: HTTP {e.code}: {e.read(300)!r}")
    if b"data:" not in text:
        raise RuntimeError(f"a streamed chat completion answered no event stream: {text[:300]!r}")


def run_one(a, work, name, t, n, bpid):
    """One target at N streams; returns the record."""
    rec = dict(target=name, streams=n, features=t["features"])
    proc = None
    try:
        return measure(a, work, name, t, n, bpid, rec)
    finally:
        stop(rec.pop("_proc", None))


def measure(a, work, name, t, n, bpid, rec):
    proc = None
    if t["cmd"]:
        if t.get("before_start"):
            t["before_start"]()
        proc = rec["_proc"] = start(t["cmd"], t.get("cwd", work), os.path.join(work, f"{name}-{n}.log"), TARGET_CORE, env=t.get("env"))
        wait_http(t["health"], proc, name)
        if t.get("after_start"):
            t["after_start"]()
        probe(t)
        time.sleep(1)
        pid = proc.pid
    else:
        pid = bpid
    cpu0, rss0, _ = usage(pid)
    rec["idle_rss"] = rss0
    sampler = Sampler(pid)
    cmd = [a.streams_bin, "load", "--url", t["url"], "--streams", str(n), "--open-rate", str(a.open_rate),
           "--window-s", str(a.window_s), "--sources", str(a.sources), "--model", t["model"], "--idle-s", "60"]
    for h in t["headers"]:
        cmd += ["-H", h]
    t0 = time.time()
    r = subprocess.run(["taskset", "-c", GEN_CORE, *cmd], capture_output=True, text=True)
    samples = sampler.done()
    rec["elapsed_s"] = time.time() - t0
    alive = proc is None or proc.poll() is None
    rec["target_alive"] = alive
    if r.returncode != 0:
        rec["load_error"] = r.stderr.strip()[-400:]
        return rec
    m = json.loads(r.stdout)
    rec["load"] = m
    ws, we = m["window_start_us"] / 1e6, m["window_end_us"] / 1e6
    inside = [s for s in samples if ws <= s[0] <= we]
    if len(inside) >= 2:
        dt = inside[-1][0] - inside[0][0]
        dcpu = inside[-1][1] - inside[0][1]
        tokens = m["window_tokens"] * dt / max(m["window_s"], 1e-9)
        rec["window_cpu_s"] = dcpu
        rec["window_sampled_s"] = dt
        rec["cpu_per_1000_tokens_s"] = dcpu / tokens * 1000 if tokens else None
        rss = sorted(s[2] for s in inside)
        rec["window_rss_median"] = rss[len(rss) // 2]
        rec["window_rss_max"] = rss[-1]
        rec["cpu_share"] = dcpu / dt if dt else None
    rec["peak_rss"] = max((s[3] for s in samples), default=None)
    return rec


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--keel", required=True)
    p.add_argument("--streams-bin", required=True)
    p.add_argument("--bare", default="")
    p.add_argument("--nginx", default=shutil.which("nginx") or "/usr/sbin/nginx")
    p.add_argument("--portkey", default="/tmp/keel-portkey/node_modules/@portkey-ai/gateway/build/start-server.js")
    p.add_argument("--litellm", default="/tmp/keel-litellm/bin/litellm")
    p.add_argument("--tensorzero", default="")
    p.add_argument("--tensorzero-why", default="")
    p.add_argument("--targets", default="keel nginx portkey litellm")
    p.add_argument("--streams", default="1000 5000 9000")
    p.add_argument("--window-s", type=int, default=30)
    p.add_argument("--open-rate", type=int, default=1000)
    p.add_argument("--sources", type=int, default=64)
    p.add_argument("--ttft-ms", type=int, default=200)
    p.add_argument("--interval-ms", default="250-500")
    p.add_argument("--tokens", default="50-500")
    p.add_argument("--files", type=int, required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    work = a.work
    # This driver and its sampler share core 0 with the generator: the
    # target's core is its own.
    os.sched_setaffinity(0, {int(GEN_CORE)})
    procs = []
    try:
        b1, bport = start_backend(a, work, "backend")
        procs.append(b1)
        targets = {"direct": direct_target(a, work, bport)}
        left_out = {}
        for name in a.targets.split():
            try:
                if name == "keel":
                    b2, bport2 = start_backend(a, work, "backend-canary")
                    procs.append(b2)
                    reg = Registry(a, work, bport, bport2)
                    procs.append(reg.proc)
                    targets[name] = keel_target(a, work, reg)
                elif name == "keel-min":
                    targets[name] = keel_min_target(a, work, bport)
                elif name == "hyper":
                    if not a.bare or not os.access(a.bare, os.X_OK):
                        raise RuntimeError("no bare-proxy binary (--bare)")
                    targets[name] = hyper_target(a, work, bport)
                elif name == "nginx":
                    if not os.access(a.nginx, os.X_OK):
                        raise RuntimeError("not installed")
                    targets[name] = nginx_target(a, work, bport)
                elif name == "portkey":
                    if not os.path.exists(a.portkey):
                        raise RuntimeError(f"not installed ({a.portkey})")
                    targets[name] = portkey_target(a, work, bport)
                elif name == "tensorzero":
                    if not a.tensorzero or not os.access(a.tensorzero, os.X_OK):
                        raise RuntimeError(a.tensorzero_why or "not built (--tensorzero)")
                    targets[name] = tensorzero_target(a, work, bport)
                elif name == "litellm":
                    if not os.access(a.litellm, os.X_OK):
                        raise RuntimeError(f"not installed ({a.litellm})")
                    targets[name] = litellm_target(a, work, bport)
                else:
                    raise RuntimeError("unknown target")
            except Exception as e:
                left_out[name] = str(e)
                log(f"{name} left out: {e}")
        failed_at = {}
        with open(a.out, "w") as out:
            out.write(json.dumps({"meta": True, "left_out": left_out, "args": vars(a)}) + "\n")
            for n in [int(x) for x in a.streams.split()]:
                for name, t in targets.items():
                    if name in failed_at:
                        out.write(json.dumps({"target": name, "streams": n, "skipped": f"failed its budget at {failed_at[name]} streams"}) + "\n")
                        continue
                    log(f"{name}: {n} streams")
                    try:
                        rec = run_one(a, work, name, t, n, b1.pid)
                    except Exception as e:
                        rec = {"target": name, "streams": n, "features": t.get("features", ""), "error": str(e)[:400]}
                    out.write(json.dumps(rec) + "\n")
                    out.flush()
                    lm = rec.get("load") or {}
                    ok = (lm.get("refused_or_failed") == 0 and lm.get("cut") == 0 and not lm.get("errors")
                          and lm.get("peak_open", 0) >= n and rec.get("target_alive", False))
                    if name != "direct" and not ok:
                        failed_at[name] = n
                    log(f"{name} {n}: peak open {lm.get('peak_open')}, completed {lm.get('completed')}, cut {lm.get('cut')}, refused/failed {lm.get('refused_or_failed')}, errors {lm.get('errors')}, rss {rec.get('window_rss_median')}")
    finally:
        for pr in procs:
            stop(pr)


if __name__ == "__main__":
    main()
