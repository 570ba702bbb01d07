"""Renders scripts/bench-streams' Markdown report from its JSON lines
(bench_streams.py writes them; this re-renders them at any time):

    python3 scripts/lib/bench_streams_report.py RUNS.jsonl COMMAND COMMIT LOAD_BEFORE LOAD_AFTER
"""

import datetime
import json
import sys

BUDGET_MS = 1.0


def q(d, key, which):
    v = (d or {}).get(key, {}).get(which)
    return None if v is None else v / 1000.0


def fmt(v, digits=2):
    return "-" if v is None else f"{v:.{digits}f}"


def lost(m, n):
    """Why a run lost or refused streams (empty: none)."""
    if not m:
        return ["no result"]
    why = []
    if m.get("peak_open", 0) < n:
        why.append(f"held {m.get('peak_open', 0)} of {n} at once")
    for k in ("refused_or_failed", "cut", "out_of_order"):
        if m.get(k):
            why.append(f"{k.replace('_', ' ')} {m[k]}")
    if m.get("errors"):
        why.append("errors " + ", ".join(f"{k} x{v}" for k, v in m["errors"].items()))
    return why


def main():
    path, command, commit, load0, load1 = sys.argv[1:6]
    recs = [json.loads(l) for l in open(path) if l.strip()]
    meta = next((r for r in recs if r.get("meta")), {})
    runs = [r for r in recs if not r.get("meta")]
    args = meta.get("args", {})
    ns = sorted({r["streams"] for r in runs})
    names = []
    for r in runs:
        if r["target"] not in names:
            names.append(r["target"])
    by = {(r["target"], r["streams"]): r for r in runs}
    L = []
    L.append("# Concurrent LLM streams through keel serve, nginx and the AI gateways")
    L.append("")
    L.append(f"Date: {datetime.date.today()}. Command: `{command}` (commit {commit}), on the development machine: 2 cores, 24 GiB, everything on loopback (load average {load0} before, {load1} after).")
    L.append("")
    L.append(
        f"Each stream is a streamed chat completion from `keel-streams backend` (crates/keel-testbackend): {args.get('ttft_ms')} ms to the first token, then one token every {args.get('interval_ms')} ms, {args.get('tokens')} tokens a stream. "
        f"`keel-streams load` holds N streams open at once (each on its own connection, from {args.get('sources')} loopback source addresses, opening at most {args.get('open_rate')} a second, a new stream whenever one ends), and measures for {args.get('window_s')} s once all are open. "
        "Each token carries its number and the backend's send time, so that the client subtracts the backend's own time: TTFT is the client's wait for the first token less the backend's wait before sending it, of the streams opened while the N were held (replacing streams that ended); \"while opening\" is of every stream, the first N opened at the open rate among them; a token's delay is its arrival less its send time, of the tokens inside the window. "
        "\"Added\" is the target's figure less the direct run's (the generator talking to the backend itself) at the same N and quantile."
    )
    L.append("")
    L.append("Processes: the target alone on core 1 (`taskset`, one worker thread or process); the backends, keel's registry and the load generator (one thread each) on core 0. Each target starts fresh for each N. RSS and CPU time are the target's process tree's, from /proc, sampled every 0.5 s: RSS per stream is (the median RSS while the N streams are open less the RSS before the load) / N; CPU per 1,000 tokens is the CPU time over the window's samples over the tokens the generator received in that time.")
    L.append("")
    L.append(f"Open files: the hard limit here is {args.get('files')} and cannot be raised (setrlimit: EPERM; no CAP_SYS_RESOURCE in this container). A proxy holds two descriptors per stream (the client's and the backend's), so no proxy process here can hold 10,000 streams: {args.get('files')} descriptors allow at most {(args.get('files') or 0) // 2 - 8} less its listeners and files.")
    L.append("")
    L.append("Targets:")
    for n in names:
        r = next(r for r in runs if r["target"] == n)
        L.append(f"- {n}: {r.get('features', '')}")
    for n, why in meta.get("left_out", {}).items():
        L.append(f"- {n}: left out ({why})")
    L.append("")
    L.append(f"Budget: added TTFT p99 and added token delay p99 under {BUDGET_MS:g} ms, no stream lost or refused.")
    L.append("")
    for n in ns:
        L.append(f"## {n:,} concurrent streams")
        L.append("")
        L.append("| target | held at once | completed | lost or refused | TTFT p50 / p99 / p99.9 ms (streams) | added TTFT p50 / p99 / p99.9 ms | added TTFT p99 while opening ms | token delay p50 / p99 ms | added token delay p99 ms | gap excess p99 ms | RSS idle MiB | RSS open MiB | RSS per stream KiB | CPU s per 1,000 tokens | CPU of its core | within budget |")
        L.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        d = by.get(("direct", n), {}).get("load")
        for name in names:
            r = by.get((name, n))
            if r is None:
                continue
            if r.get("skipped") or r.get("error") or r.get("load_error"):
                why = r.get("skipped") or r.get("error") or r.get("load_error")
                L.append(f"| {name} | {why} |" + " |" * 15)
                continue
            m = r["load"]
            tt = [q(m, "ttft_window_us", k) for k in ("p50", "p99", "p999")]
            all99 = q(m, "ttft_path_us", "p99")
            dl = [q(m, "token_delay_us", k) for k in ("p50", "p99")]
            if name == "direct" or not d:
                att = ["-", "-", "-"]
                adl = None
            else:
                att = [fmt(a - b) if a is not None and b is not None else "-" for a, b in zip(tt, [q(d, "ttft_window_us", k) for k in ("p50", "p99", "p999")])]
                b = q(d, "token_delay_us", "p99")
                adl = dl[1] - b if dl[1] is not None and b is not None else None
            d99 = q(d, "ttft_path_us", "p99") if d else None
            add_all99 = all99 - d99 if name != "direct" and all99 is not None and d99 is not None else None
            gap = q(m, "gap_excess_us", "p99")
            idle = r.get("idle_rss")
            rss = r.get("window_rss_median")
            per = (rss - idle) / n / 1024 if rss is not None and idle is not None else None
            why = lost(m, n)
            if name == "direct":
                ok = "-"
            else:
                add_tt99 = tt[1] - q(d, "ttft_window_us", "p99") if d and tt[1] is not None and q(d, "ttft_window_us", "p99") is not None else None
                fails = []
                if why:
                    fails.append("lost")
                if add_tt99 is None or add_tt99 >= BUDGET_MS:
                    fails.append("TTFT")
                if adl is None or adl >= BUDGET_MS:
                    fails.append("token delay")
                ok = "yes" if not fails else "no (" + ", ".join(fails) + ")"
                r["within_budget"] = not fails
            L.append(
                f"| {name} | {m.get('peak_open')} | {m.get('completed')} | {'; '.join(why) or 0} | {' / '.join(fmt(x) for x in tt)} ({(m.get('ttft_window_us') or {}).get('n', 0)}) | {' / '.join(att)} | {fmt(add_all99)} | {' / '.join(fmt(x) for x in dl)} | {fmt(adl)} | {fmt(gap)} | "
                f"{fmt(idle / 2**20 if idle else None, 0)} | {fmt(rss / 2**20 if rss else None, 0)} | {fmt(per, 1)} | {fmt(r.get('cpu_per_1000_tokens_s'), 3)} | {fmt(100 * r['cpu_share'] if r.get('cpu_share') is not None else None, 0)}% | {ok} |"
            )
        L.append("")
    L.append("## Per target")
    L.append("")
    L.append("| target | highest N within budget | first N over budget |")
    L.append("|---|---|---|")
    for name in names:
        if name == "direct":
            continue
        within = [n for n in ns if by.get((name, n), {}).get("within_budget")]
        over = [n for n in ns if (name, n) in by and not by[(name, n)].get("within_budget")]
        L.append(f"| {name} | {max(within) if within else 'none'} | {min(over) if over else 'none up to ' + str(max(ns))} |")
    L.append("")
    if "keel" in names and "nginx" in names:
        L.append("## keel against nginx")
        L.append("")
        L.append("| N | RSS per stream keel / nginx KiB | ratio | CPU per 1,000 tokens keel / nginx s | ratio |")
        L.append("|---|---|---|---|---|")
        for n in ns:
            k, g = by.get(("keel", n)), by.get(("nginx", n))
            if not k or not g or "load" not in k or "load" not in g:
                continue
            per = lambda r: (r["window_rss_median"] - r["idle_rss"]) / n / 1024 if r.get("window_rss_median") is not None else None
            pk, pg = per(k), per(g)
            ck, cg = k.get("cpu_per_1000_tokens_s"), g.get("cpu_per_1000_tokens_s")
            L.append(f"| {n:,} | {fmt(pk, 1)} / {fmt(pg, 1)} | {fmt(pk / pg if pk and pg else None)} | {fmt(ck, 3)} / {fmt(cg, 3)} | {fmt(ck / cg if ck and cg else None)} |")
        L.append("")
    print("\n".join(L))


if __name__ == "__main__":
    main()
