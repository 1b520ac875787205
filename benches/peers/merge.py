#!/usr/bin/env python3
"""merge.py -- turn benches/compare.sh's raw results into the benchmark report
(docs/benchmarks.md, its charts in docs/benchmarks/).

Input (a results directory written by compare.sh):
  meta.tsv   key<TAB>value lines (date, uname, CPU, copy bandwidth, command...)
  runs.tsv   one row per launch: tool, world, transport, repeat, status, csv,
             seconds, command; status is "ok" or why there is no data.
             transport is "shm" / "tcp" (local part), "lat-shm" (latency
             part), "netns-<Gbit/s>" (network-namespace part) or
             "bound-tcp" / "bound-netns-<Gbit/s>" (bound part: ring
             streams without reduction, tool "tcpring")
  csv/*.csv  gradwire-format CSVs:
             size_bytes,count,type,redop,time_us,algbw_gbs,busbw_gbs,wrong
  logs/*.log the runs' output (the mpirun line of the netns runs is read
             from there)

Output: markdown with
  * "Summary" (one screen): each target's ratio and verdict, and gradwire's
    busbw over the best peer's per table;
  * "Targets in detail": every performance target of the issue "Make the CPU paths
    beat Open MPI and Gloo", judged from this run's medians (met / not met);
  * one table per (W, transport) of the local part: per size the median
    busbw of each tool across repeats (with the +-spread when repeats > 1),
    the gradwire / best-peer busbw ratio, for shm the memory-bandwidth bound
    and gradwire's fraction of it, the median time_us and the #wrong elements
    of each tool (max over repeats).  Gloo only has TCP; its numbers are
    shown beside both the shm and the tcp table;
  * the small-message latency table (latency part);
  * one table per link rate of the netns part, with gradwire's fraction of
    the link rate;
  * beside each of those tables an SVG chart of busbw against size (median,
    min-max bars), written next to the output in benchmarks/;
  * "Transport ceilings" (bound part): per (W, TCP loopback / netns rate)
    and size, the median payload rate of tcpring's ring streams (a ring
    allreduce's per-link traffic with no reduction: the rate the sockets
    sustain, the ceiling of any ring allreduce over TCP)
    and the allreduce busbw of gradwire and of the best peer as fractions
    of it; the same figures per size in the "TCP ceiling" column of targets
    3a, 3b and 4 (context: met / not met does not depend on them);
  * the exact commands.

Usage: merge.py --results DIR [--out docs/benchmarks.md]
"""
import argparse
import csv
import math
import os
import re
import statistics
import sys
from collections import defaultdict

TOOLS = [("gradwire", "gradwire"), ("mpi", "Open MPI"), ("gloo", "Gloo")]
NAMES = dict(TOOLS)
PEERS = ("mpi", "gloo")
MiB = 1 << 20

# ---- the targets (issue "Make the CPU paths beat Open MPI and Gloo") ---------------
T1_RATIO = 2.5          # shm busbw >= 2.5x Open MPI (vader), W=2 and 4, 16..256 MiB
T1_BOUND_FRAC = 0.70    # ... and >= 70% of the memory-bandwidth bound
T1_SIZES = (16 * MiB, 256 * MiB)
T2_SIZE = 4096          # 4 KiB latency vs Open MPI (shm)
T2_MAX_RATIO = {2: 2.0, 4: 1.0}
T3_FAST = (10.0, 1.5, 16 * MiB)   # 10 Gbit/s: busbw >= 1.5x best peer, sizes >= 16 MiB
T3_SLOW = (1.0, 0.95, 1 * MiB)    # 1 Gbit/s: busbw >= 95% of the link rate, sizes >= 1 MiB
T4_RATIO, T4_MIN = 1.2, 16 * MiB  # loopback TCP, W=2 and 4: >= 1.2x best peer



KEEP = "<!-- Sections below are written by other scripts (benches/rxe_compare.sh --record); merge.py keeps them. -->"

def bound_k(w: int) -> float:
    """Bytes moved per rank per byte of message by a zero-copy shared-memory
    allreduce: 2.5 at W=2 and 2.75 at W=4 (the issue's figures); 3 - 1/W gives
    both and is used for any other W."""
    return 3.0 - 1.0 / w


def bound_busbw(copy_bw: float, w: int) -> float:
    """busbw of an allreduce that takes k*S/copy_bw: copy_bw/k * 2(W-1)/W."""
    return copy_bw / bound_k(w) * 2.0 * (w - 1) / w


def cores_bound_busbw(copy_all: float, w: int) -> float:
    """busbw bound when W ranks share fewer cores: all W*k*S bytes pass through the cores
    copying at once (copy_all GB/s in total), so time >= W*k*S/copy_all."""
    return copy_all / (w * bound_k(w)) * 2.0 * (w - 1) / w


def memory_ceiling_cells(gw, mp, sizes, w, copy_bw, cores, zero_copy=None):
    """Context cells of targets 1a and 1b: which memory bound applies at W ranks and what
    each target asks of it. cores = (online CPUs, memcpy GB/s of all of them at once).
    zero_copy (private-buffer rows): gradwire's busbw on gradwire_alloc buffers per size:
    the same reduction with no copies (it reads the peers' buffers and writes each
    finished part straight into them), to which a private-buffer allreduce adds a copy of
    every part it fetches and every part it writes back (the kernel's, through cross-memory
    attach; two, through staging). Context, not a strict ceiling (the host's cross-core hand-off
    speed moves both)."""
    if not copy_bw:
        return {}
    ncores, copy_all = cores
    if ncores and copy_all and w > ncores:
        b = cores_bound_busbw(copy_all, w)
        what = (f"{w} ranks on {ncores} cores: their {w}·{bound_k(w):g}·S bytes pass through "
                f"{ncores} cores copying at once ({copy_all:g} GB/s, measured): bound "
                f"{num(b)} GB/s")
    else:
        b = bound_busbw(copy_bw, w)
        what = f"memory bound {num(b)} GB/s (a core per rank)"
    # A bound that a measured allreduce beats (data that stays in cache never pays the
    # memory rate) bounds nothing at that size: say so instead of "out of reach".
    def verdict_at(sz, need):
        beaten = [t for t, v in (("gradwire", gw.get(sz)), ("Open MPI", mp.get(sz)))
                  if v is not None and v > ABOVE_CEILING * b]
        if beaten:
            return f" ({' and '.join(beaten)} above it: **no bound at this size**)"
        return " (**out of reach**)" if need > b else ""

    c1a, c1b = [what], [what]
    for sz in sizes:
        g, m = gw.get(sz), mp.get(sz)
        need = T1_RATIO * m if m else None
        if need:
            c1a.append(f"{human(sz)}: target needs {num(need)} GB/s = {need / b:.0%} of it"
                       + (f"; gradwire at {g / b:.0%}" if g is not None else "")
                       + (f", Open MPI at {m / b:.0%}" if m is not None else "")
                       + verdict_at(sz, need))
            z = (zero_copy or {}).get(sz)
            if z:
                c1a.append(f"{human(sz)}, against the zero-copy form (gradwire_alloc buffers, "
                           f"{num(z)} GB/s): the target needs {need / z:.0%} of it"
                           + (" (**beyond the zero-copy form**, which does less work)"
                              if need >= z else ""))
    need_b = T1_BOUND_FRAC * bound_busbw(copy_bw, w)
    if b < bound_busbw(copy_bw, w):
        c1b.append(f"the target ({T1_BOUND_FRAC:.0%} of the per-rank bound) needs {num(need_b)} GB/s "
                   f"= {need_b / b:.0%} of it")
        for sz in sizes:
            if gw.get(sz) is not None:
                c1b.append(f"{human(sz)}: gradwire at {gw[sz] / b:.0%} of it" + verdict_at(sz, need_b))
    else:
        c1b = ["—"]
    return {"1a": "<br>".join(c1a), "1b": "<br>".join(c1b)}


def human(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def num(x: float) -> str:
    return f"{x:.3f}" if x < 10 else f"{x:.2f}"


def fmt_bw(vals):
    if not vals:
        return "—"
    med = statistics.median(vals)
    s = num(med)
    if len(vals) > 1 and med > 0:
        spread = (max(vals) - min(vals)) / 2 / med * 100
        s += f" ±{spread:.0f}%"
    return s


def fmt_us(vals):
    if not vals:
        return "—"
    med = statistics.median(vals)
    return us(med)


def us(x: float) -> str:
    return f"{x:.1f}" if x < 1000 else f"{x:,.0f}"


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


def rate_of(kind: str):
    """'netns-10' or 'bound-netns-10' -> 10.0; anything else -> None."""
    if kind.startswith("bound-"):
        kind = kind[len("bound-"):]
    if kind.startswith("netns-"):
        try:
            return float(kind[len("netns-"):])
        except ValueError:
            return None
    return None


def rate_label(rate: float) -> str:
    return f"{rate:g} Gbit/s"


def load(results):
    """-> data[(tool, W, kind)][size] = list of row dicts (one per repeat),
          status[(tool, W, kind)] = list of non-ok statuses,
          commands[(tool, W, kind)] = one example command,
          inner[(tool, W, kind)] = the mpirun line mpi_netns.sh ran (netns)."""
    data = defaultdict(lambda: defaultdict(list))
    status = defaultdict(list)
    commands, inner = {}, {}
    for run in read_tsv(os.path.join(results, "runs.tsv")):
        key = (run["tool"], int(run["world"]), run["transport"])
        if run.get("command"):
            commands[key] = run["command"]
        if run["status"] != "ok":
            status[key].append(f"repeat {run['repeat']}: {run['status']}")
            continue
        if run["tool"] == "mpi" and run["transport"].startswith("netns-"):
            logf = os.path.join(results, "logs",
                                os.path.basename(run["csv"])[:-len(".csv")] + ".log")
            try:
                with open(logf) as f:
                    for line in f:
                        if re.match(r"mpi_netns\.sh: \S*mpirun\S* ", line):
                            inner[key] = line[len("mpi_netns.sh: "):].strip()
            except OSError:
                pass
        # The CSV of this results directory (it may have been moved or copied), else
        # the path as recorded.
        csv_path = os.path.join(results, "csv", os.path.basename(run["csv"]))
        if not os.path.exists(csv_path):
            csv_path = run["csv"]
        try:
            with open(csv_path, newline="") as f:
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
    return data, status, commands, inner


class Results:
    def __init__(self, data, status):
        self.data, self.status = data, status

    def rows(self, key, size):
        return self.data[key].get(size, []) if key in self.data else []

    def med(self, key, size, field="busbw"):
        vals = [r[field] for r in self.rows(key, size)]
        return statistics.median(vals) if vals else None

    def sizes(self, *keys):
        out = set()
        for k in keys:
            if k in self.data:
                out |= set(self.data[k].keys())
        return sorted(out)

    def why_absent(self, key):
        """None if the key has data, else the reason (for a cell)."""
        if key in self.data and self.data[key]:
            return None
        why = [x.split(": ", 1)[-1] for x in self.status.get(key, [])]
        reason = why[0] if why else "no data"
        return reason if reason.startswith(("n/a", "not run")) else f"n/a ({reason})"

    def wrong_cell(self, keys, size):
        out = []
        for k in keys:
            rows = self.rows(k, size)
            ws = [r["wrong"] for r in rows if r["wrong"] is not None]
            out.append(str(max(ws)) if ws else ("unchecked" if rows else
                                                ("n/a" if self.why_absent(k) else "—")))
        return " / ".join(out)


SHARED = "shm-shared"  # gradwire on buffers from its allocator; the peers' shm runs beside
REGISTERED = "shm-registered"  # gradwire on private buffers registered in place; likewise
GW_SHM_KINDS = (SHARED, REGISTERED)
GW_SHM_HEADINGS = {
    SHARED: "gradwire's buffers from gradwire_alloc (`--buffers shared`)",
    REGISTERED: "gradwire's private buffers registered in place (`--buffers registered`)",
}


def local_key(tool, w, transport):
    if tool == "gloo":
        return (tool, w, "tcp")
    return (tool, w, "shm" if transport in GW_SHM_KINDS and tool != "gradwire" else transport)


def busbw_cells(res, keys, absent, size, ratios):
    """The cells every per-size row starts with: size, each tool's busbw, and gradwire's
    ratio to the best peer (also appended to `ratios`). Returns (cells, gradwire busbw)."""
    cells = [human(size)]
    for t, _ in TOOLS:
        cells.append(absent[t] or fmt_bw([r["busbw"] for r in res.rows(keys[t], size)]))
    gw = res.med(keys["gradwire"], size)
    pv, pt = best_peer(res, keys, size)
    if gw is not None and pv:
        ratios.append((size, gw / pv))
        cells.append(f"{gw / pv:.2f}× (vs {NAMES[pt]})")
    else:
        cells.append("n/a")
    return cells, gw


def best_peer(res, keys_by_tool, size):
    """-> (value, tool) of the peer with the highest median busbw, or (None, None)."""
    best = (None, None)
    for p in PEERS:
        v = res.med(keys_by_tool[p], size)
        if v is not None and (best[0] is None or v > best[0]):
            best = (v, p)
    return best


def table_local(res, w, transport, copy_bw):
    keys = {t: local_key(t, w, transport) for t, _ in TOOLS}
    absent = {t: res.why_absent(keys[t]) for t, _ in TOOLS}
    sizes = res.sizes(*keys.values())
    bound = bound_busbw(copy_bw, w) if (transport in ("shm",) + GW_SHM_KINDS and copy_bw) else None

    def label(t, n):
        return f"{n} (tcp)" if t == "gloo" and transport != "tcp" else n
    head = ["size"] + [f"{label(t, n)} busbw GB/s" for t, n in TOOLS] + \
           ["gradwire / best peer"]
    if bound is not None:
        head += ["mem. bound busbw GB/s", "gradwire / bound"]
    head += [f"{label(t, n)} µs" for t, n in TOOLS] + ["#wrong gw / MPI / Gloo"]
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join(["---:"] * len(head)) + "|"]
    ratios = []
    for size in sizes:
        cells, gw = busbw_cells(res, keys, absent, size, ratios)
        if bound is not None:
            cells.append(num(bound))
            cells.append(f"{gw / bound * 100:.0f}%" if gw is not None else "n/a")
        for t, _ in TOOLS:
            cells.append("n/a" if absent[t] else
                         fmt_us([r["time_us"] for r in res.rows(keys[t], size)]))
        cells.append(res.wrong_cell([keys[t] for t, _ in TOOLS], size))
        lines.append("| " + " | ".join(cells) + " |")
    return lines, ratios


def table_netns(res, w, kind):
    rate = rate_of(kind)
    link = rate / 8.0  # GB/s
    keys = {t: (t, w, kind) for t, _ in TOOLS}
    absent = {t: res.why_absent(keys[t]) for t, _ in TOOLS}
    sizes = res.sizes(*keys.values())
    head = ["size"] + [f"{n} busbw GB/s" for _, n in TOOLS] + \
           ["gradwire / best peer", "gradwire / link rate"] + \
           [f"{n} µs" for _, n in TOOLS] + ["#wrong gw / MPI / Gloo"]
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join(["---:"] * len(head)) + "|"]
    ratios = []
    for size in sizes:
        cells, gw = busbw_cells(res, keys, absent, size, ratios)
        cells.append(f"{gw / link * 100:.0f}%" if gw is not None else "n/a")
        for t, _ in TOOLS:
            cells.append("n/a" if absent[t] else
                         fmt_us([r["time_us"] for r in res.rows(keys[t], size)]))
        cells.append(res.wrong_cell([keys[t] for t, _ in TOOLS], size))
        lines.append("| " + " | ".join(cells) + " |")
    return lines, ratios


def table_latency(res, ranks):
    head = ["W", "size", "gradwire µs", "Open MPI µs", "gradwire / Open MPI (time)",
            "gradwire busbw GB/s", "Open MPI busbw GB/s", "#wrong gw / MPI"]
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join(["---:"] * len(head)) + "|"]
    for w in ranks:
        kg, km = ("gradwire", w, "lat-shm"), ("mpi", w, "lat-shm")
        ag, am = res.why_absent(kg), res.why_absent(km)
        for size in res.sizes(kg, km) or [None]:
            if size is None:
                lines.append(f"| {w} | — | {ag or '—'} | {am or '—'} | n/a | | | |")
                continue
            tg = res.med(kg, size, "time_us")
            tm = res.med(km, size, "time_us")
            ratio = f"{tg / tm:.2f}×" if tg is not None and tm else "n/a"
            lines.append("| " + " | ".join([
                str(w), human(size),
                ag or fmt_us([r["time_us"] for r in res.rows(kg, size)]) + spread(res, kg, size),
                am or fmt_us([r["time_us"] for r in res.rows(km, size)]) + spread(res, km, size),
                ratio,
                ag or fmt_bw([r["busbw"] for r in res.rows(kg, size)]),
                am or fmt_bw([r["busbw"] for r in res.rows(km, size)]),
                res.wrong_cell([kg, km], size)]) + " |")
    return lines


def spread(res, key, size):
    vals = [r["time_us"] for r in res.rows(key, size)]
    if len(vals) > 1:
        med = statistics.median(vals)
        if med > 0:
            return f" ±{(max(vals) - min(vals)) / 2 / med * 100:.0f}%"
    return ""


# ---- transport ceilings (bound part) -------------------------------------------------
#
# benches/peers/tcpring.c: W processes in a ring, each streaming to the next and reading
# from the previous at once, per "call" of S exactly a ring allreduce's per-link traffic
# (2(W-1) chunks of S/W) with no reduction, no framing, no step synchronisation and a
# receive buffer that stays in cache; the faster of one stream across calls and call by
# call. Its payload rate per link is comparable with an
# allreduce's busbw (algbw·2(W−1)/W): the ceiling of any ring allreduce over the same
# TCP path.

# An allreduce more than 5% above the ceiling is flagged in the Targets table: there it
# bounds nothing at that size (noise, or a tbf link whose bucket refills between an
# allreduce's calls while the stream never pauses).
ABOVE_CEILING = 1.05


def bound_key(res, w, rate=None):
    """The bound part's key for TCP loopback (rate None) or the netns rate, or None."""
    if rate is None:
        return ("tcpring", w, "bound-tcp")
    for k in sorted(set(res.data) | set(res.status)):
        if k[0] == "tcpring" and k[1] == w and k[2].startswith("bound-netns-") and \
                rate_of(k[2]) == rate:
            return k
    return None


def allreduce_keys(bkind, w):
    """The allreduce keys (per tool) the bound kind is the ceiling of."""
    if bkind == "bound-tcp":
        return {t: local_key(t, w, "tcp") for t, _ in TOOLS}
    return {t: (t, w, bkind[len("bound-"):]) for t, _ in TOOLS}


def pct(x):
    return f"{x * 100:.0f}%" if x is not None else "—"


def ceiling_figures(res, bkey, keys, size):
    """-> (ceiling, gradwire allreduce, (best peer value, tool)) medians at size."""
    c = res.med(bkey, size) if bkey else None
    return c, res.med(keys["gradwire"], size), best_peer(res, keys, size)


def ceiling_cell(res, parts, bkey, keys, lo, need, link=None):
    """The Targets table's "TCP ceiling" cell of a TCP target row: per size >= lo,
    the ceiling (tcpring's payload rate), gradwire's allreduce and the best peer's as
    fractions of it and, when need(size, best peer value) gives the busbw the
    target asks for, that as a fraction of it too."""
    if "bound" not in parts:
        return "n/a (bound part not run)"
    if bkey is None:
        return "n/a (no bound run for this W / rate)"
    why = res.why_absent(bkey)
    if why:
        return why
    sizes = [s for s in res.sizes(bkey, *keys.values()) if s >= lo]
    if not sizes:
        return "n/a (no sizes in range in this run)"
    out = []
    for s in sizes:
        c, gw, (pv, pt) = ceiling_figures(res, bkey, keys, s)
        if not c:
            out.append(f"{human(s)}: no ceiling at this size")
            continue
        cell = f"{human(s)}: ceiling {num(c)} GB/s (socket stream"
        cell += f", {pct(c / link)} of link rate)" if link else ")"
        cell += f"; gradwire allreduce at {pct(gw / c if gw is not None else None)} of it"
        cell += (f"; best peer at {pct(pv / c)} of it ({NAMES[pt]})" if pv else
                 "; best peer at — of it")
        nd = need(s, pv)
        if nd is not None:
            cell += f"; target needs {pct(nd / c)}"
        if max(gw or 0, pv or 0) > ABOVE_CEILING * c:
            cell += " (**an allreduce is above it: no bound at this size**)"
        out.append(cell)
    return "<br>".join(out)


def table_bound(res, bkey, link=None):
    """Per size: ceiling (tcpring's payload rate), allreduce busbw of gradwire and the
    best peer and their fractions of the ceiling; for netns also the ceiling's fraction
    of the link rate."""
    keys = allreduce_keys(bkey[2], bkey[1])
    sizes = res.sizes(bkey, *keys.values())
    head = ["size", "ceiling: tcpring GB/s", "tcpring µs per call",
            "gradwire allreduce busbw GB/s", "gradwire / ceiling",
            "best peer allreduce busbw GB/s", "best peer / ceiling"]
    if link:
        head.append("ceiling / link rate")
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join(["---:"] * len(head)) + "|"]
    absent = res.why_absent(bkey)
    for size in sizes:
        c, gw, (pv, pt) = ceiling_figures(res, bkey, keys, size)
        cells = [human(size),
                 absent or fmt_bw([r["busbw"] for r in res.rows(bkey, size)]),
                 "n/a" if absent else fmt_us([r["time_us"] for r in res.rows(bkey, size)]),
                 num(gw) if gw is not None else "—",
                 pct(gw / c) if gw is not None and c else "—",
                 f"{num(pv)} ({NAMES[pt]})" if pv else "—",
                 pct(pv / c) if pv and c else "—"]
        if link:
            cells.append(pct(c / link) if c is not None else "—")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


# ---- targets ------------------------------------------------------------------------

def verdict(per_size, le=False, thr=None):
    """per_size: list of (size, ratio or None).  -> result cell."""
    if not per_size:
        return "n/a (no sizes in range in this run)"
    missing = [s for s, r in per_size if r is None]
    bad = [s for s, r in per_size if r is not None and ((r > thr) if le else (r < thr))]
    if bad:
        return "**not met**" + (f" ({', '.join(human(s) for s in bad)})"
                                if len(per_size) > 1 else "")
    if missing:
        return f"n/a (no data at {', '.join(human(s) for s in missing)})"
    return "**met**"


def join(xs):
    return " · ".join(xs) if xs else "—"


def targets(res, meta, copy_bw, ranks_local, transports, cores=(0, None)):
    """-> (lines, tally) of the Targets table."""
    rows = []  # (target, W, sizes, gradwire, reference, ratio, threshold, result)
    ceil = {}  # (target id, W) -> the "TCP ceiling" cell (targets 3a, 3b, 4)
    parts = meta.get("parts", "local").split()
    lat_size_ok = False

    def in_range(keys, lo, hi=None):
        return [s for s in res.sizes(*keys) if s >= lo and (hi is None or s <= hi)]

    # 1. one host, shm, W=2 and 4, 16..256 MiB: vs Open MPI and vs the memory bound;
    # gradwire on private buffers, and (where run) on the same registered in place and on
    # buffers from its allocator
    kinds = [("shm", ", private buffers")]
    for kind, which in ((REGISTERED, ", private buffers registered in place"), (SHARED, ", gradwire_alloc buffers")):
        if res.sizes(("gradwire", 2, kind)) or res.sizes(("gradwire", 4, kind)):
            kinds.append((kind, which))
    for (kind, which), w in ((k, w) for k in kinds for w in (2, 4)):
        kg, km = ("gradwire", w, kind), ("mpi", w, "shm")
        sizes = in_range([kg, km], *T1_SIZES)
        where = f"W={w}"
        name_1a = "1a shm busbw ≥ 2.5× Open MPI (vader)" + which
        name_1b = "1b shm busbw ≥ 70% of memory bound" + which
        if "local" not in parts or w not in ranks_local or "shm" not in transports:
            na = "n/a (local shm part with W=%d not run)" % w
            rows.append((name_1a, where, "16–256 MiB",
                         "—", "—", "—", f"≥ {T1_RATIO:.2f}×", na))
            rows.append((name_1b, where, "16–256 MiB",
                         "—", "—", "—", f"≥ {T1_BOUND_FRAC:.0%}", na))
            continue
        gw = {s: res.med(kg, s) for s in sizes}
        mp = {s: res.med(km, s) for s in sizes}
        rat = [(s, gw[s] / mp[s] if gw[s] is not None and mp[s] else None) for s in sizes]
        zero_copy = {s: res.med(("gradwire", w, SHARED), s) for s in sizes} if kind == "shm" else None
        for tid, cell in memory_ceiling_cells(gw, mp, sizes, w, copy_bw, cores, zero_copy).items():
            ceil[({"1a": name_1a, "1b": name_1b}[tid], where)] = cell
        rows.append((name_1a, where,
                     join([human(s) for s in sizes]),
                     join([num(gw[s]) if gw[s] is not None else "—" for s in sizes]),
                     join([num(mp[s]) if mp[s] is not None else "—" for s in sizes]) +
                     " (Open MPI)",
                     join([f"{r:.2f}×" if r is not None else "—" for _, r in rat]),
                     f"≥ {T1_RATIO:.2f}×", verdict(rat, thr=T1_RATIO)))
        if copy_bw:
            b = bound_busbw(copy_bw, w)
            frac = [(s, gw[s] / b if gw[s] is not None else None) for s in sizes]
            rows.append((name_1b, where,
                         join([human(s) for s in sizes]),
                         join([num(gw[s]) if gw[s] is not None else "—" for s in sizes]),
                         f"{num(b)} (bound: memcpy {copy_bw:g} / {bound_k(w):g} · "
                         f"{2 * (w - 1) / w:g})",
                         join([f"{f * 100:.1f}%" if f is not None else "—" for _, f in frac]),
                         f"≥ {T1_BOUND_FRAC:.0%}", verdict(frac, thr=T1_BOUND_FRAC)))
        else:
            rows.append((name_1b, where, "16–256 MiB",
                         "—", "—", "—", f"≥ {T1_BOUND_FRAC:.0%}",
                         "n/a (no copy bandwidth measured)"))

    # 2. 4 KiB latency, shm: <= 2x Open MPI at W=2, <= Open MPI at W=4
    for w in (2, 4):
        thr = T2_MAX_RATIO[w]
        src = None
        for kind, label in (("lat-shm", f"latency part, -n {meta.get('lat_iters', '?')}"),
                            ("shm", "local sweep")):
            kg, km = ("gradwire", w, kind), ("mpi", w, kind)
            if res.med(kg, T2_SIZE, "time_us") is not None or \
               res.med(km, T2_SIZE, "time_us") is not None:
                src = (kg, km, label)
                break
        if src is None:
            rows.append((f"2 4 KiB latency ≤ {thr:g}× Open MPI (shm)", f"W={w}", "4 KiB",
                         "—", "—", "—", f"≤ {thr:.2f}×",
                         "n/a (no 4 KiB shm run with W=%d)" % w))
            continue
        kg, km, label = src
        tg, tm = res.med(kg, T2_SIZE, "time_us"), res.med(km, T2_SIZE, "time_us")
        r = tg / tm if tg is not None and tm else None
        rows.append((f"2 4 KiB latency ≤ {thr:g}× Open MPI (shm)", f"W={w}",
                     f"4 KiB ({label})",
                     f"{us(tg)} µs" if tg is not None else "—",
                     f"{us(tm)} µs (Open MPI)" if tm is not None else "—",
                     f"{r:.2f}×" if r is not None else "—",
                     f"≤ {thr:.2f}×", verdict([(T2_SIZE, r)], le=True, thr=thr)))

    # 3. network namespaces
    netns_kinds = sorted({k[2] for k in list(res.data) + list(res.status)
                          if k[2].startswith("netns-")})
    nw = int(meta.get("netns_ranks", "4") or 4)

    def find_kind(rate):
        for kd in netns_kinds:
            if rate_of(kd) == rate:
                return kd
        return None

    def netns_ceiling(tid, rate, lo, need):
        kd = find_kind(rate) or f"netns-{rate:g}"
        keys = {t: (t, nw, kd) for t, _ in TOOLS}
        ceil[(tid, f"W={nw}")] = ceiling_cell(res, parts, bound_key(res, nw, rate), keys,
                                              lo, need, link=rate / 8.0)

    rate, factor, lo = T3_FAST
    netns_ceiling("3a", rate, lo, lambda s, pv, f=factor: f * pv if pv else None)
    kd = find_kind(rate)
    name = f"3a {rate_label(rate)} busbw ≥ {factor:g}× best of Open MPI, Gloo"
    if kd is None:
        rows.append((name, f"W={nw}", f"≥ {human(lo)}", "—", "—", "—", f"≥ {factor:.2f}×",
                     f"n/a (no {rate_label(rate)} netns run)"))
    else:
        keys = {t: (t, nw, kd) for t, _ in TOOLS}
        sizes = in_range(keys.values(), lo)
        gw = {s: res.med(keys["gradwire"], s) for s in sizes}
        peer = {s: best_peer(res, keys, s) for s in sizes}
        rat = [(s, gw[s] / peer[s][0] if gw[s] is not None and peer[s][0] else None)
               for s in sizes]
        rows.append((name, f"W={nw}", join([human(s) for s in sizes]),
                     join([num(gw[s]) if gw[s] is not None else "—" for s in sizes]),
                     join([f"{num(peer[s][0])} ({NAMES[peer[s][1]]})" if peer[s][0] else "—"
                           for s in sizes]),
                     join([f"{r:.2f}×" if r is not None else "—" for _, r in rat]),
                     f"≥ {factor:.2f}×", verdict(rat, thr=factor)))

    rate, frac_thr, lo = T3_SLOW
    netns_ceiling("3b", rate, lo, lambda s, pv, x=frac_thr * rate / 8.0: x)
    kd = find_kind(rate)
    link = rate / 8.0
    name = f"3b {rate_label(rate)} busbw ≥ {frac_thr:.0%} of link rate"
    if kd is None:
        rows.append((name, f"W={nw}", f"≥ {human(lo)}", "—", "—", "—", f"≥ {frac_thr:.0%}",
                     f"n/a (no {rate_label(rate)} netns run)"))
    else:
        k = ("gradwire", nw, kd)
        sizes = in_range([k], lo)
        gw = {s: res.med(k, s) for s in sizes}
        frac = [(s, gw[s] / link if gw[s] is not None else None) for s in sizes]
        rows.append((name, f"W={nw}", join([human(s) for s in sizes]),
                     join([num(gw[s]) if gw[s] is not None else "—" for s in sizes]),
                     f"{link:g} (link rate, GB/s)",
                     join([f"{f * 100:.1f}%" if f is not None else "—" for _, f in frac]),
                     f"≥ {frac_thr:.0%}", verdict(frac, thr=frac_thr)))

    # 4. loopback TCP, W=2 and 4, >= 16 MiB: >= 1.2x the best peer
    for w in (2, 4):
        name = f"4 loopback TCP busbw ≥ {T4_RATIO:g}× best of Open MPI, Gloo"
        ceil[("4", f"W={w}")] = ceiling_cell(
            res, parts, bound_key(res, w) if w in ranks_local else None,
            {t: local_key(t, w, "tcp") for t, _ in TOOLS}, T4_MIN,
            lambda s, pv: T4_RATIO * pv if pv else None)
        if "local" not in parts or w not in ranks_local or "tcp" not in transports:
            rows.append((name, f"W={w}", f"≥ {human(T4_MIN)}", "—", "—", "—",
                         f"≥ {T4_RATIO:.2f}×", f"n/a (local tcp part with W={w} not run)"))
            continue
        keys = {t: local_key(t, w, "tcp") for t, _ in TOOLS}
        sizes = in_range(keys.values(), T4_MIN)
        gw = {s: res.med(keys["gradwire"], s) for s in sizes}
        peer = {s: best_peer(res, keys, s) for s in sizes}
        rat = [(s, gw[s] / peer[s][0] if gw[s] is not None and peer[s][0] else None)
               for s in sizes]
        rows.append((name, f"W={w}", join([human(s) for s in sizes]),
                     join([num(gw[s]) if gw[s] is not None else "—" for s in sizes]),
                     join([f"{num(peer[s][0])} ({NAMES[peer[s][1]]})" if peer[s][0] else "—"
                           for s in sizes]),
                     join([f"{r:.2f}×" if r is not None else "—" for _, r in rat]),
                     f"≥ {T4_RATIO:.2f}×", verdict(rat, thr=T4_RATIO)))

    head = ["#", "target", "W", "sizes", "gradwire", "reference", "gradwire / reference",
            "threshold", "result", "ceiling: memory (1) or TCP (3, 4; bound part); context, not judged"]
    lines = ["| " + " | ".join(head) + " |",
             "|---|---|---:|---|---:|---:|---:|---:|---|---|"]
    tally = defaultdict(int)
    short = ["| # | target | W | sizes | gradwire / reference | threshold | result |",
             "|---|---|---:|---|---:|---:|---|"]
    # by target id, then W (stable: the order rows were made in within one id)
    rows.sort(key=lambda r: r[0].split(" ", 1)[0])
    for r in rows:
        tid, _, name = r[0].partition(" ")
        lines.append("| " + " | ".join((tid, name) + tuple(r[1:]) +
                                       (ceil.get((r[0], r[1]), ceil.get((tid, r[1]), "—")),)) + " |")
        short.append("| " + " | ".join((tid, name, r[1], r[2], r[5], r[6], r[7])) + " |")
        res_cell = r[-1]
        tally["met" if res_cell == "**met**" else
              "not met" if res_cell.startswith("**not met") else "n/a"] += 1
    return lines, tally, short


# ---- plots (SVG written by hand: no plotting package needed) ------------------------
COLOURS = {"gradwire": "#1f77b4", "mpi": "#d62728", "gloo": "#2ca02c"}


def svg_plot(title, series, path):
    """A busbw-against-size line chart: `series` is [(name, colour, [(size, median, lo, hi)])],
    the size axis in powers of two; min-max of the repeats as a bar at each point."""
    pts = [p for _, _, ps in series for p in ps]
    if not pts:
        return False
    width, height, left, right, top, bottom = 640, 320, 60, 150, 30, 40
    xs = sorted({p[0] for p in pts})
    lx = [math.log2(x) for x in xs]
    x0, x1 = min(lx), max(lx) if max(lx) > min(lx) else min(lx) + 1
    ymax = max(p[3] for p in pts) * 1.08 or 1.0

    def X(size):
        return left + (math.log2(size) - x0) / (x1 - x0) * (width - left - right)

    def Y(v):
        return top + (1 - v / ymax) * (height - top - bottom)

    el = [f'<text x="{left}" y="18" font-weight="bold">{title}</text>',
          f'<line x1="{left}" y1="{Y(0):.1f}" x2="{width - right}" y2="{Y(0):.1f}" stroke="black"/>',
          f'<line x1="{left}" y1="{top}" x2="{left}" y2="{Y(0):.1f}" stroke="black"/>',
          f'<text x="12" y="{top + (height - top - bottom) / 2:.0f}" transform="rotate(-90 12 '
          f'{top + (height - top - bottom) / 2:.0f})" text-anchor="middle">busbw GB/s</text>']
    step = 10 ** math.floor(math.log10(ymax / 4))
    step *= next(f for f in (1, 2, 5, 10) if ymax / (step * f) <= 6)
    v = 0.0
    while v <= ymax:
        el.append(f'<line x1="{left}" y1="{Y(v):.1f}" x2="{width - right}" y2="{Y(v):.1f}" stroke="#ddd"/>')
        el.append(f'<text x="{left - 4}" y="{Y(v) + 4:.1f}" text-anchor="end">{v:g}</text>')
        v += step
    for size in xs:
        el.append(f'<text x="{X(size):.1f}" y="{height - bottom + 16}" text-anchor="middle">{human(size)}</text>')
    for i, (name, colour, ps) in enumerate(series):
        ps = sorted(ps)
        if len(ps) > 1:
            el.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="'
                      + " ".join(f"{X(a):.1f},{Y(m):.1f}" for a, m, _, _ in ps) + '"/>')
        for a, m, lo, hi in ps:
            el.append(f'<line x1="{X(a):.1f}" y1="{Y(lo):.1f}" x2="{X(a):.1f}" y2="{Y(hi):.1f}" stroke="{colour}"/>')
            el.append(f'<circle cx="{X(a):.1f}" cy="{Y(m):.1f}" r="2.5" fill="{colour}"/>')
        ly = top + 16 * i
        el.append(f'<line x1="{width - right + 10}" y1="{ly}" x2="{width - right + 28}" y2="{ly}" stroke="{colour}" stroke-width="2"/>')
        el.append(f'<text x="{width - right + 32}" y="{ly + 4}">{name}</text>')
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
                f'font-family="sans-serif" font-size="12">' + "".join(el) + "</svg>\n")
    return True


def plot_series(res, keys, labels):
    """[(label, colour, [(size, median, min, max)])] of each tool's busbw that has data."""
    out = []
    for t, key in keys.items():
        ps = []
        for size in res.sizes(key):
            vals = [r["busbw"] for r in res.rows(key, size)]
            if vals:
                ps.append((size, statistics.median(vals), min(vals), max(vals)))
        if ps:
            out.append((labels[t], COLOURS[t], ps))
    return out


def geomean(xs):
    xs = [x for x in xs if x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def parse_csvish(value, keys_hint):
    """'a,b;1,2;' -> {'a': '1', 'b': '2'} or None."""
    parts = [p for p in value.split(";") if p]
    if len(parts) == 2 and "," in parts[0]:
        return dict(zip(parts[0].split(","), parts[1].split(",")))
    return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", required=True)
    ap.add_argument("--out", default="docs/benchmarks.md")
    args = ap.parse_args()

    meta = read_meta(os.path.join(args.results, "meta.tsv"))
    data, status, commands, inner = load(args.results)
    res = Results(data, status)
    ranks = [int(x) for x in meta.get("ranks", "2 4").split()]
    transports = meta.get("transports", "shm tcp").split()
    parts = meta.get("parts", "local").split()
    nproc = int(meta.get("nproc", "0") or 0)
    repeats = int(meta.get("repeats", "1") or 1)

    copybw = meta.get("copybw", "n/a")
    copy_bw = None
    cores = (0, None)
    cb = parse_csvish(copybw, None)
    if cb:
        try:
            copy_bw = float(cb.get("memcpy_gbs", ""))
        except ValueError:
            copy_bw = None
        try:
            cores = (int(cb.get("cores", "")), float(cb.get("memcpy_all_cores_gbs", "")))
        except ValueError:
            cores = (0, None)
        copybw = (f"memcpy {cb.get('memcpy_gbs')} GB/s, reduce-add (`d[i] += s[i]`) "
                  f"{cb.get('add_gbs')} GB/s, triad {cb.get('triad_gbs')} GB/s "
                  f"(single thread, {cb.get('buffer_mib')} MiB buffers, best of 7; "
                  f"bytes of destination per second)"
                  + (f"; memcpy on all {cores[0]} cores at once {cores[1]:g} GB/s in total"
                     if cores[1] else ""))

    pingpong = meta.get("pingpong", "n/a")
    pp = parse_csvish(pingpong, None)
    if pp:
        pingpong = (f"{pp.get('rtt_us_mean')} µs mean, {pp.get('rtt_us_min')} µs min "
                    "(8-byte messages, blocking reads: the latency floor for a transport "
                    "that sleeps in the kernel while it waits)")

    out = []
    w = out.append
    def plot(name, title, keys, labels):
        """Writes the chart beside the report (in benchmarks/) and puts its image into it."""
        if svg_plot(title, plot_series(res, keys, labels), os.path.join(os.path.dirname(os.path.abspath(args.out)), "benchmarks", name)):
            w(f"![{title}](benchmarks/{name})")
            w("")

    w("# Benchmarks: gradwire against Open MPI and Gloo")
    w("")
    w(f"Generated by `benches/peers/merge.py` from the run kept in `{os.path.relpath(args.results)}` "
      "(`benches/compare.sh --record` runs and keeps one; `benches/compare.sh --report` "
      "regenerates this page from the kept run). Do not edit by hand.")
    w("")
    if meta.get("load_warning"):
        w(f"> **Warning:** {meta['load_warning']}.")
        w("")
    w("@@SUMMARY@@")

    # ---- targets
    tlines, tally, tshort = targets(res, meta, copy_bw, ranks, transports, cores)
    w("## Targets in detail")
    w("")
    w("The performance targets of the issue \"Make the CPU paths beat Open MPI and Gloo\" "
      "(float32 SUM allreduce), judged by `benches/peers/merge.py` from **this run's "
      "medians** (every figure below is the median over repeats of the cell it comes "
      "from; ratios are ratios of medians). busbw in GB/s (1e9 B/s). A row is met only "
      "if every size in its range meets the threshold; the sizes that do not are named.")
    w("")
    out.extend(tlines)
    w("")
    w(f"**{tally['met']} met, {tally['not met']} not met, {tally['n/a']} n/a** "
      f"(of {sum(tally.values())} rows).")
    w("")
    w("- 1b: memory-bandwidth bound of a zero-copy allreduce, which moves about k·S bytes "
      "per rank (k = 2.5 at W=2, 2.75 at W=4): bound time = k·S / copy_bw, bound busbw = "
      "copy_bw / k · 2(W−1)/W, with **copy_bw = the memcpy figure of `copybw` measured in "
      "this run**" + (f" ({copy_bw:g} GB/s)" if copy_bw else "") + ".")
    w("- 2: time per call at 4 KiB (slowest rank's mean), from the latency part (many "
      "iterations of the one size) when it ran, else from the 4 KiB row of the local "
      "shm sweep.")
    w(f"- 3: {meta.get('netns_ranks', '4')} network namespaces (1 rank each) on a bridge, "
      "each node's egress shaped with tc tbf to the rate; link rate in GB/s = Gbit/s / 8. "
      "3a compares with the better of Open MPI and Gloo at each size. 3b: tbf counts "
      "whole frames, so with MTU 1500 and TCP timestamps a link carries at most "
      "1448/1514 = 95.6% of its rate as TCP payload in steady state (a short transfer can "
      "do slightly better while the tbf bucket's initial burst lasts).")
    w("- 4: loopback TCP (`--transport tcp`, Open MPI `btl self,tcp` on `lo`, Gloo on `lo`).")
    if copy_bw:
        w("- Memory ceiling (rows 1a, 1b): the bound that applies at W ranks. With a core per "
          "rank it is the per-rank bound of 1b. When ranks outnumber cores, a rank copies "
          "only while it holds a core, so all W·k·S bytes pass through the cores copying at "
          "once: bound busbw = (memcpy of all cores at once, measured by copybw in this run) "
          "/ (W·k) · 2(W−1)/W. Then what each target asks as a percentage of that bound "
          "(above 100%: out of reach on this machine, whatever the implementation). "
          "Where data stays in cache an allreduce can beat that bound; so the private-buffer "
          "rows also set the target against gradwire's zero-copy form in the same run "
          "(gradwire_alloc buffers): the same reduction with no copies (each rank reads the "
          "peers' buffers and writes its finished part straight into them), while a "
          "private-buffer allreduce must also copy every part out of one process and the "
          "result into the other (once, through the kernel's cross-memory attach, as "
          "gradwire and Open MPI's vader do here; twice, through shared staging). Not a strict ceiling: the host's cross-core hand-off speed, which varies "
          "from minute to minute here, moves both. Context only: the result column does not "
          "depend on it.")
    if "bound" in parts:
        w("- TCP ceiling (rows 3a, 3b, 4; from the bound part, see \"Transport ceilings\"): "
          "per size, the median payload rate of **tcpring** over the same TCP path "
          "(same W, same sizes): ring streams that carry a ring allreduce's per-link "
          "traffic with no reduction, so no ring allreduce over TCP (gradwire's, Open "
          "MPI's, Gloo's) should exceed it; where one does by "
          f"more than {ABOVE_CEILING - 1:.0%} the cell says so, and that size has no bound. "
          "Then gradwire's and the best peer's allreduce busbw as percentages of it and, "
          "where the target's threshold is a busbw, the percentage the target asks for "
          "(above 100%: out of reach of a ring allreduce over this transport here). "
          "Context only: the result column does not depend on it.")
    w("")

    w("## Setup")
    w("")
    w(f"- **Command:** `{meta.get('command', '?')}`")
    w(f"- **Date:** {meta.get('date', '?')}")
    w(f"- **Kernel:** `{meta.get('uname_r', '?')}`; **nproc:** {meta.get('nproc', '?')}; "
      f"**CPU:** {meta.get('cpu_model', '?')}; **memory:** {meta.get('mem_total', '?')}")
    w(f"- **Measured copy bandwidth** (`benches/peers/copybw.c`): {copybw}")
    w(f"- **Loopback TCP round trip** (`benches/peers/pingpong.c`): {pingpong}")
    handoff = [parse_csvish(meta.get(k, ""), None) for k in ("handoff_start", "handoff_end")]
    if any(handoff):
        at = [h.get("handoff_gbs", "?") if h else "n/a" for h in handoff]
        w(f"- **Cross-core hand-off** (`benches/peers/handoff.c`: two threads pinned to CPUs 0 "
          f"and 1 copy 512 KiB into shared memory and then each other's copy out, a barrier "
          f"between): {at[0]} GB/s per thread before the runs, {at[1]} after. On this virtual "
          f"machine it has changed several-fold from one minute to the next with nothing else "
          f"running in the guest; shared-memory cells whose repeats spread widely ran through "
          f"such a change.")
    w(f"- **Load average** at start: {meta.get('loadavg_start', '?')}, "
      f"at end: {meta.get('loadavg_end', '?')}")
    w(f"- **Parameters:** {meta.get('params', '?')}")
    if "local" in parts and meta.get("local_params"):
        w(f"  - local: {meta['local_params']}")
    if "latency" in parts:
        w(f"  - latency: {meta.get('lat_params', '?')}")
    if "netns" in parts:
        w(f"  - netns: {meta.get('netns_params', '?')}; status: {meta.get('netns_status', '?')}")
    if "bound" in parts:
        w(f"  - bound: {meta.get('bound_params', '?')}; status: "
          f"{meta.get('bound_status', '?')}, netns: {meta.get('netns_status', '?')}")
    w(f"- **gradwire:** {meta.get('gradwire_rev', '?')}, {meta.get('rustc', '?')}; "
      f"status: {meta.get('gradwire_status', '?')}")
    w(f"- **Open MPI:** {meta.get('mpi_version', '?')}; status: {meta.get('mpi_status', '?')}")
    w(f"- **Gloo:** torch {meta.get('torch_version', '?')} ({meta.get('python_version', '?')}), "
      f"launched by {meta.get('gloo_launcher', '?')}; status: {meta.get('gloo_status', '?')}")
    w("")
    w("## Method")
    w("")
    w("- Every tool sweeps the same sizes with the same `-n` timed and `-w` warmup "
      "iterations of a float32 SUM allreduce (per part: see Parameters). Per size: warmup, "
      "barrier, timed loop; "
      "**time = the slowest rank's mean time per call** (max over ranks of the mean); "
      "algbw = bytes / time (GB = 1e9 bytes); **busbw = algbw · 2(W−1)/W** "
      "(nccl-tests convention, comparable to the copy bandwidth above).")
    w("- gradwire: `gradwire bench allreduce --check` (in place) under `gradwire launch`. "
      f"Open MPI: `benches/peers/mpi_collectives.c -c allreduce`, `MPI_Allreduce` **{meta.get('mpi_place', '?')}**, "
      "`--mca pml ob1` plus `btl self,vader` (shm) or `btl self,tcp` on `lo` (tcp), "
      "otherwise Open MPI's defaults (binding, yield-when-oversubscribed). "
      "Gloo: `benches/peers/gloo_collectives.py -c allreduce`, `torch.distributed.all_reduce` "
      "(in-place — Gloo has no out-of-place allreduce; the timed buffer starts at 0) "
      "on CPU tensors over TCP loopback (`GLOO_SOCKET_IFNAME=lo`), 1 torch thread per rank. "
      "Gloo has no shared-memory transport, so its TCP numbers appear in both the shm "
      "and tcp tables.")
    w("- gradwire's buffers: private memory (an anonymous mapping, like the peers' `malloc`; "
      "from 256 KiB the one-host allreduce reaches the peers' through cross-memory attach, "
      "`process_vm_readv`/`process_vm_writev`, like Open MPI's vader single-copy path) "
      "unless the table or target says **gradwire_alloc buffers**: then the same run with "
      "`--buffers shared`, buffers from gradwire's allocator (`gradwire_alloc`, a memfd the "
      "ranks of a host map), which the one-host allreduce reads and writes in place, with "
      "no copy at all (the peers' columns there repeat their shm runs; Open "
      "MPI's `MPI_Alloc_mem` would not change its vader path); or **registered in place**: "
      "then `--buffers registered`, private buffers starting 64 bytes into a page (where "
      "`malloc` puts large ones) that the bench registers once before its sizes with "
      "`gradwire_register` (as a framework registers its gradient buckets, the way "
      "`ncclCommRegister` works): their whole pages become shared in place and take the "
      "zero-copy path, every rank reduces the partial first and last pages itself from copies all ranks stage. Targets 1a "
      "and 1b are judged for all three.")
    if "netns" in parts:
        w("- Network namespaces: all three tools run under the same "
          "`gradwire launch -n W --netns --link-gbit R` (one namespace per rank on a private "
          "bridge, 10.77.0.0/24, each node's `eth0` egress shaped by `tc tbf`; the launcher "
          "removes them at exit). gradwire: `--transport tcp`. Gloo: "
          "`GLOO_SOCKET_IFNAME=eth0`. Open MPI: `benches/peers/mpi_netns.sh` — rank 0's "
          "namespace runs `mpirun`, which starts the orteds of the other namespaces through "
          "an rsh agent that runs `ip netns exec`; `btl self,tcp` and oob on `eth0`, "
          "`--bind-to none` and, when W > cores, `mpi_yield_when_idle 1` (what Open MPI does "
          "itself when it knows a node is oversubscribed; every orted believes it has a "
          "node to itself). The mpirun line is listed under Exact commands.")
    w("- **#wrong**: after timing, each tool checks an allreduce of per-rank "
      "pseudo-random integers (exact in float32) against an independently computed "
      "sum and counts differing elements (max over repeats; should be 0).")
    if repeats > 1:
        w(f"- Each cell is the **median of {repeats} repeats** (whole sweeps, interleaved "
          "across tools); `±x%` is half the min–max range relative to the median.")
    w("- ratio = gradwire busbw / the best peer's busbw at that size (>1: gradwire faster).")
    if copy_bw:
        w("- shm tables: **mem. bound** = copy_bw / k · 2(W−1)/W with copy_bw = the memcpy "
          f"figure above ({copy_bw:g} GB/s) and k = 2.5 (W=2), 2.75 (W=4), 3 − 1/W in "
          "general (bytes a zero-copy allreduce moves per rank per message byte); "
          "gradwire / bound is gradwire's busbw as a fraction of it.")
    if nproc:
        allw = set(ranks) | ({int(meta.get("netns_ranks", "0") or 0)}
                             if "netns" in parts or "bound" in parts else set())
        over = sorted(r for r in allw if r > nproc)
        if over:
            w(f"- W = {', '.join(map(str, over))} is **more ranks than cores** ({nproc}): "
              "ranks time-share cores, so those rows measure scheduling as much as "
              "the transport.")
    w("")

    def missing_notes(keys_names):
        notes = []
        for k, name in keys_names:
            if status.get(k):
                notes.append(f"- {name}: " + "; ".join(sorted(set(status[k]))))
        if notes:
            w("")
            w("Missing data:")
            w("")
            out.extend(notes)

    summary = []
    if "local" in parts:
        for wsz in ranks:
            extra = [k for k in GW_SHM_KINDS if "shm" in transports and res.sizes(("gradwire", wsz, k))]
            for tr in transports + extra:
                lines, ratios = table_local(res, wsz, tr, copy_bw)
                w(f"## W = {wsz}, transport = {tr}" if tr not in GW_SHM_KINDS else
                  f"## W = {wsz}, transport = shm, {GW_SHM_HEADINGS[tr]}")
                w("")
                gw_label = {"shm-shared": "gradwire (alloc)", "shm-registered": "gradwire (registered)"}.get(tr, "gradwire")
                plot(f"allreduce-w{wsz}-{tr}.svg", f"allreduce, W = {wsz}, {tr}",
                     {t: local_key(t, wsz, tr) for t, _ in TOOLS},
                     {"gradwire": gw_label, "mpi": "Open MPI", "gloo": "Gloo (tcp)" if tr != "tcp" else "Gloo"})
                if len(lines) <= 2:
                    w("_No data._")
                else:
                    out.extend(lines)
                missing_notes([(local_key(t, wsz, tr), n) for t, n in TOOLS])
                if ratios:
                    big = [r for s, r in ratios if s >= MiB]
                    summary.append((wsz, tr, geomean([r for _, r in ratios]),
                                    geomean(big) if big else float("nan")))
                w("")

    if "latency" in parts:
        w(f"## Small-message latency, shm ({meta.get('lat_params', '?')})")
        w("")
        out.extend(table_latency(res, ranks))
        missing_notes([((t, wsz, "lat-shm"), f"{n} W={wsz}") for wsz in ranks
                       for t, n in TOOLS[:2]])
        w("")

    if "netns" in parts:
        nw = int(meta.get("netns_ranks", "4") or 4)
        for r in meta.get("netns_rates", "").split():
            kind = f"netns-{r}"
            rate = rate_of(kind)
            w(f"## W = {nw} network namespaces, links shaped to {rate_label(rate)} "
              f"(link rate {rate / 8:g} GB/s)")
            w("")
            plot(f"allreduce-netns-{r}g.svg", f"allreduce, {nw} namespaces, {rate_label(rate)} links",
                 {t: (t, nw, kind) for t, _ in TOOLS}, {"gradwire": "gradwire", "mpi": "Open MPI", "gloo": "Gloo"})
            lines, ratios = table_netns(res, nw, kind)
            if len(lines) <= 2:
                w("_No data._")
            else:
                out.extend(lines)
            missing_notes([((t, nw, kind), n) for t, n in TOOLS])
            if ratios:
                big = [x for s, x in ratios if s >= MiB]
                summary.append((nw, f"netns {rate_label(rate)}", geomean([x for _, x in ratios]),
                                geomean(big) if big else float("nan")))
            w("")

    if "bound" in parts:
        w("## Transport ceilings (socket streams without reduction, same run)")
        w("")
        w("`benches/peers/tcpring.c` under `gradwire launch`, with the same W, sizes and "
          "iterations as the allreduce runs it is set against: W processes in a ring, each "
          "streaming to the next and reading from the previous at once from one thread, "
          "per call of size S exactly a ring allreduce's per-link traffic (2(W−1) chunks of "
          "S/W), with no reduction, no framing, no step synchronisation and a receive "
          "buffer that stays in cache, timed both as one stream across calls and call by "
          "call (less in flight, so more of it still in cache when read), the faster kept. Its payload rate per link (time = the slowest "
          "rank's time per call) is comparable with an allreduce's busbw "
          "(algbw · 2(W−1)/W): the rate the sockets sustain on this machine, the ceiling "
          "of any ring allreduce over the same TCP path, which moves the same bytes and "
          "must also reduce them. Medians across repeats; the allreduce columns repeat "
          "the medians of the tables above. A fraction above 100% is noise (W = 4 on 2 "
          "cores swings ±20%) or, on a tbf link, an allreduce call that starts on a bucket "
          "refilled while it paused between calls, which the stream does not "
          "get. Small sizes carry no per-call latency in the stream: there it is a loose "
          "ceiling.")
        w("")
        nw = int(meta.get("netns_ranks", "4") or 4)
        blocks = [(wsz, None) for wsz in ranks] + \
                 [(nw, float(r)) for r in meta.get("netns_rates", "").split()]
        for wsz, rate in blocks:
            bkey = bound_key(res, wsz, rate) or ("tcpring", wsz, f"bound-netns-{rate:g}")
            link = rate / 8.0 if rate else None
            if rate is None:
                w(f"### W = {wsz}, TCP loopback")
            else:
                w(f"### W = {wsz} network namespaces, links shaped to {rate_label(rate)} "
                  f"(link rate {link:g} GB/s)")
            w("")
            lines = table_bound(res, bkey, link)
            if len(lines) <= 2:
                w("_No data._")
            else:
                out.extend(lines)
            missing_notes([(bkey, "tcpring")])
            w("")

    top = ["## Summary", "",
           f"float32 SUM allreduce, {meta.get('nproc', '?')} cores ({meta.get('cpu_model', '?')}), "
           f"{meta.get('date', '?')[:10]}, gradwire {meta.get('gradwire_rev', '?').split(' ')[0]}; "
           f"medians of {repeats} repeat(s). The performance targets, judged from this run "
           "(figures and ceilings in \"Targets in detail\"):", ""]
    top += tshort + ["", f"**{tally['met']} met, {tally['not met']} not met, {tally['n/a']} n/a** "
                     f"(of {sum(tally.values())} rows).", ""]
    if summary:
        top += ["gradwire's busbw over the best peer's (geometric mean over the sizes of each table):", "",
                "| W | transport | all sizes | sizes ≥ 1 MiB |", "|---:|---|---:|---:|"]
        for wsz, tr, g_all, g_big in summary:
            big = "n/a" if math.isnan(g_big) else f"{g_big:.2f}×"
            top.append(f"| {wsz} | {tr} | {g_all:.2f}× | {big} |")
        top.append("")
    at = out.index("@@SUMMARY@@")
    out[at:at + 1] = top

    w("## Exact commands")
    w("")
    w("One per (tool, W, part/transport), as run for the last repeat (paths relative to "
      "the repo root). `gradwire launch` sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT "
      "(torchrun-style) for every rank it starts.")
    w("")
    w("```")

    def order(k):
        kind = k[2]
        part = 0 if kind in ("shm", "tcp") else 1 if kind.startswith("lat-") else \
            3 if kind.startswith("bound-") else 2
        sub = (-(rate_of(kind) or math.inf), "") if part >= 2 else (0, kind)
        return (part, sub, k[1], [t for t, _ in TOOLS].index(k[0]) if k[0] in NAMES else 9)
    for key in sorted(commands, key=order):
        w(commands[key])
        if key in inner:
            w(f"#   rank 0 of the above runs: {inner[key]}")
    w("```")
    w("")

    # Sections written by other scripts (benches/record_section.py) follow KEEP; keep them.
    kept = KEEP + "\n"
    if os.path.exists(args.out):
        old = open(args.out).read()
        if KEEP in old:
            kept = old[old.index(KEEP):]
    with open(args.out, "w") as f:
        f.write("\n".join(out).rstrip("\n") + "\n\n" + kept)
    print(f"merge.py: wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
