#!/usr/bin/env python3
"""merge.py -- turn benches/compare.sh's raw results into BENCHMARKS.md.

Input (a results directory written by compare.sh):
  meta.tsv   key<TAB>value lines (date, uname, CPU, copy bandwidth, command...)
  runs.tsv   one row per launch: tool, world, transport, repeat, status, csv,
             seconds, command; status is "ok" or why there is no data
  csv/*.csv  gradwire-format CSVs:
             size_bytes,count,type,redop,time_us,algbw_gbs,busbw_gbs,wrong

Output: markdown with one table per (W, transport): per size the median
busbw of each tool across repeats (with the +-spread when repeats > 1), the
gradwire / best-peer busbw ratio, the median time_us of each tool and the
#wrong elements of each tool (max over repeats).  Gloo only has TCP; its
numbers are shown beside both the shm and the tcp table.

Usage: merge.py --results DIR [--out BENCHMARKS.md]
"""
import argparse
import csv
import math
import os
import statistics
import sys
from collections import defaultdict

TOOLS = [("gradwire", "gradwire"), ("mpi", "Open MPI"), ("gloo", "Gloo")]
PEERS = ("mpi", "gloo")


def human(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def fmt_bw(vals):
    if not vals:
        return "—"
    med = statistics.median(vals)
    s = f"{med:.3f}" if med < 10 else f"{med:.2f}"
    if len(vals) > 1 and med > 0:
        spread = (max(vals) - min(vals)) / 2 / med * 100
        s += f" ±{spread:.0f}%"
    return s


def fmt_us(vals):
    if not vals:
        return "—"
    med = statistics.median(vals)
    return f"{med:.1f}" if med < 1000 else f"{med:,.0f}"


def read_tsv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))


def read_meta(path):
    meta = {}
    with open(path) as f:
        for line in f:
            k, _, v = line.rstrip("\n").partition("\t")
            meta[k] = v
    return meta


def load(results):
    """-> data[(tool, W, transport)][size] = list of row dicts (one per repeat),
          status[(tool, W, transport)] = list of non-ok statuses,
          commands[(tool, W, transport)] = one example command."""
    data = defaultdict(lambda: defaultdict(list))
    status = defaultdict(list)
    commands = {}
    for run in read_tsv(os.path.join(results, "runs.tsv")):
        key = (run["tool"], int(run["world"]), run["transport"])
        if run.get("command"):
            commands[key] = run["command"]
        if run["status"] != "ok":
            status[key].append(f"repeat {run['repeat']}: {run['status']}")
            continue
        try:
            with open(run["csv"], newline="") as f:
                rows = list(csv.DictReader(f))
        except OSError as e:
            status[key].append(f"repeat {run['repeat']}: unreadable CSV ({e})")
            continue
        if not rows:
            status[key].append(f"repeat {run['repeat']}: empty CSV")
        for row in rows:
            try:
                size = int(row["size_bytes"])
                data[key][size].append({
                    "busbw": float(row["busbw_gbs"]),
                    "time_us": float(row["time_us"]),
                    # gradwire leaves it empty when run without --check
                    "wrong": int(float(row["wrong"])) if (row.get("wrong") or "").strip()
                    else None,
                })
            except (KeyError, ValueError) as e:
                status[key].append(f"repeat {run['repeat']}: bad row {dict(row)} ({e})")
    return data, status, commands


def tool_key(tool, w, transport):
    return (tool, w, "tcp" if tool == "gloo" else transport)


def table(data, status, w, transport):
    keys = {t: tool_key(t, w, transport) for t, _ in TOOLS}
    # A tool with no data at all in this table: say why in its cells.
    absent = {}
    for t, _ in TOOLS:
        if not data[keys[t]]:
            why = [x.split(": ", 1)[-1] for x in status.get(keys[t], [])]
            reason = why[0] if why else "no data"
            absent[t] = reason if reason.startswith(("n/a", "not run")) else f"n/a ({reason})"
    sizes = sorted(set().union(*(data[keys[t]].keys() for t, _ in TOOLS)))
    def label(t, n):
        return f"{n} (tcp)" if t == "gloo" and transport != "tcp" else n
    head = ["size"] + [f"{label(t, n)} busbw GB/s" for t, n in TOOLS] + \
           ["gradwire / best peer"] + [f"{label(t, n)} µs" for t, n in TOOLS] + \
           ["#wrong gw / MPI / Gloo"]
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join(["---:"] * len(head)) + "|"]
    ratios = []
    for size in sizes:
        cells = [human(size)]
        med = {}
        for t, _ in TOOLS:
            vals = [r["busbw"] for r in data[keys[t]].get(size, [])]
            cells.append(absent[t] if t in absent else fmt_bw(vals))
            if vals:
                med[t] = statistics.median(vals)
        peers = [med[p] for p in PEERS if p in med]
        if "gradwire" in med and peers and max(peers) > 0:
            ratio = med["gradwire"] / max(peers)
            best = max((p for p in PEERS if p in med), key=lambda p: med[p])
            ratios.append((size, ratio))
            cells.append(f"{ratio:.2f}× (vs {dict(TOOLS)[best]})")
        else:
            cells.append("n/a")
        for t, _ in TOOLS:
            cells.append("n/a" if t in absent else
                         fmt_us([r["time_us"] for r in data[keys[t]].get(size, [])]))
        wrong = []
        for t, _ in TOOLS:
            rows = data[keys[t]].get(size, [])
            ws = [r["wrong"] for r in rows if r["wrong"] is not None]
            wrong.append(str(max(ws)) if ws else ("unchecked" if rows else
                                                  ("n/a" if t in absent else "—")))
        cells.append(" / ".join(wrong))
        lines.append("| " + " | ".join(cells) + " |")
    return lines, ratios


def geomean(xs):
    xs = [x for x in xs if x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", required=True)
    ap.add_argument("--out", default="BENCHMARKS.md")
    args = ap.parse_args()

    meta = read_meta(os.path.join(args.results, "meta.tsv"))
    data, status, commands = load(args.results)
    ranks = [int(x) for x in meta.get("ranks", "2 4").split()]
    transports = meta.get("transports", "shm tcp").split()
    nproc = int(meta.get("nproc", "0") or 0)
    repeats = int(meta.get("repeats", "1") or 1)

    copybw = meta.get("copybw", "n/a")
    parts = [p for p in copybw.split(";") if p]
    if len(parts) == 2 and "," in parts[0]:
        cb = dict(zip(parts[0].split(","), parts[1].split(",")))
        copybw = (f"memcpy {cb.get('memcpy_gbs')} GB/s, reduce-add (`d[i] += s[i]`) "
                  f"{cb.get('add_gbs')} GB/s, triad {cb.get('triad_gbs')} GB/s "
                  f"(single thread, {cb.get('buffer_mib')} MiB buffers, best of 7; "
                  f"bytes of destination per second)")

    pingpong = meta.get("pingpong", "n/a")
    parts = [p for p in pingpong.split(";") if p]
    if len(parts) == 2 and "," in parts[0]:
        pp = dict(zip(parts[0].split(","), parts[1].split(",")))
        pingpong = (f"{pp.get('rtt_us_mean')} µs mean, {pp.get('rtt_us_min')} µs min "
                    "(8-byte messages, blocking reads: the latency floor for a transport "
                    "that sleeps in the kernel while it waits)")

    out = []
    w = out.append
    w("# Allreduce benchmarks: gradwire vs Open MPI vs Gloo")
    w("")
    w("Generated by `benches/compare.sh`; do not edit by hand, re-run it instead.")
    w("")
    if meta.get("load_warning"):
        w(f"> **Warning:** {meta['load_warning']}.")
        w("")
    w("## Setup")
    w("")
    w(f"- **Command:** `{meta.get('command', '?')}`")
    w(f"- **Date:** {meta.get('date', '?')}")
    w(f"- **Kernel:** `{meta.get('uname_r', '?')}`; **nproc:** {meta.get('nproc', '?')}; "
      f"**CPU:** {meta.get('cpu_model', '?')}; **memory:** {meta.get('mem_total', '?')}")
    w(f"- **Measured copy bandwidth** (`benches/peers/copybw.c`): {copybw}")
    w(f"- **Loopback TCP round trip** (`benches/peers/pingpong.c`): {pingpong}")
    w(f"- **Load average** at start: {meta.get('loadavg_start', '?')}, "
      f"at end: {meta.get('loadavg_end', '?')}")
    w(f"- **Parameters:** {meta.get('params', '?')}")
    w(f"- **gradwire:** {meta.get('gradwire_rev', '?')}, {meta.get('rustc', '?')}; "
      f"status: {meta.get('gradwire_status', '?')}")
    w(f"- **Open MPI:** {meta.get('mpi_version', '?')}; status: {meta.get('mpi_status', '?')}")
    w(f"- **Gloo:** torch {meta.get('torch_version', '?')} ({meta.get('python_version', '?')}), "
      f"launched by {meta.get('gloo_launcher', '?')}; status: {meta.get('gloo_status', '?')}")
    w("")
    w("## Method")
    w("")
    w("- Every tool sweeps the same sizes with the same `-n` timed and `-w` warmup "
      "iterations of a float32 SUM allreduce. Per size: warmup, barrier, timed loop; "
      "**time = the slowest rank's mean time per call** (max over ranks of the mean); "
      "algbw = bytes / time (GB = 1e9 bytes); **busbw = algbw · 2(W−1)/W** "
      "(nccl-tests convention, comparable to the copy bandwidth above).")
    w("- gradwire: `gradwire bench allreduce --check` (in place) under `gradwire launch`. "
      f"Open MPI: `benches/peers/mpi_allreduce.c`, `MPI_Allreduce` **{meta.get('mpi_place', '?')}**, "
      "`--mca pml ob1` plus `btl self,vader` (shm) or `btl self,tcp` on `lo` (tcp), "
      "otherwise Open MPI's defaults (binding, yield-when-oversubscribed). "
      "Gloo: `benches/peers/gloo_allreduce.py`, `torch.distributed.all_reduce` "
      "(in-place — Gloo has no out-of-place allreduce; the timed buffer starts at 0) "
      "on CPU tensors over TCP loopback (`GLOO_SOCKET_IFNAME=lo`), 1 torch thread per rank. "
      "Gloo has no shared-memory transport, so its TCP numbers appear in both the shm "
      "and tcp tables.")
    w("- **#wrong**: after timing, each tool checks an allreduce of per-rank "
      "pseudo-random integers (exact in float32) against an independently computed "
      "sum and counts differing elements (max over repeats; should be 0).")
    if repeats > 1:
        w(f"- Each cell is the **median of {repeats} repeats** (whole sweeps, interleaved "
          "across tools); `±x%` is half the min–max range relative to the median.")
    w("- ratio = gradwire busbw / the best peer's busbw at that size (>1: gradwire faster).")
    if nproc:
        over = [r for r in ranks if r > nproc]
        if over:
            w(f"- W = {', '.join(map(str, over))} is **more ranks than cores** ({nproc}): "
              "ranks time-share cores, so those rows measure scheduling as much as "
              "the transport.")
    w("")

    summary = []
    for wsz in ranks:
        for tr in transports:
            lines, ratios = table(data, status, wsz, tr)
            w(f"## W = {wsz}, transport = {tr}")
            w("")
            if len(lines) <= 2:
                w("_No data._")
            else:
                out.extend(lines)
            notes = []
            for t, name in TOOLS:
                k = tool_key(t, wsz, tr)
                if status.get(k):
                    notes.append(f"- {name}: " + "; ".join(sorted(set(status[k]))))
            if notes:
                w("")
                w("Missing data:")
                w("")
                out.extend(notes)
            if ratios:
                big = [r for s, r in ratios if s >= (1 << 20)]
                summary.append((wsz, tr, geomean([r for _, r in ratios]),
                                geomean(big) if big else float("nan")))
            w("")

    if summary:
        w("## Summary: gradwire / best-peer busbw (geometric mean over sizes)")
        w("")
        w("| W | transport | all sizes | sizes ≥ 1 MiB |")
        w("|---:|---|---:|---:|")
        for wsz, tr, g_all, g_big in summary:
            big = "n/a" if math.isnan(g_big) else f"{g_big:.2f}×"
            w(f"| {wsz} | {tr} | {g_all:.2f}× | {big} |")
        w("")

    w("## Exact commands")
    w("")
    w("One per (tool, W, transport), as run for the last repeat (paths relative to the repo root).")
    w("")
    w("```")
    for key in sorted(commands):
        w(commands[key])
    w("```")
    w("")

    with open(args.out, "w") as f:
        f.write("\n".join(out))
    print(f"merge.py: wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
