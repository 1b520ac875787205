#!/usr/bin/env python3
"""merge_collectives.py -- turn benches/collectives.sh's raw results into markdown.

Input (a results directory written by collectives.sh, default target/peers/results-coll):
  meta.tsv   key<TAB>value lines (date, kernel, CPU, mpirun --version, command, ...)
  runs.tsv   one row per launch: tool, coll, world, part, repeat, status, csv, seconds,
             command.  tool: gradwire, mpi, gloo, torch (torch.distributed on gradwire's
             backend), tcpring (coll "ceiling": the socket ceiling of the netns part) or
             threads (the one-copy ceiling of the local part: benches/peers/thread_copies.c);
             part: "local", "netns-<Gbit/s>" or "torch"; status "ok" or why there is
             no data ("n/a (...)", "failed (exit N)", "timeout ...").
  csv/*.csv  size_bytes,count,type,redop,time_us,algbw_gbs,busbw_gbs,wrong

Output: markdown with
  * "Goals": met / not met, from this run's medians (the thresholds below);
  * per collective, one table of the local and netns rows -- W, part, size, the median
    busbw of gradwire, Open MPI and Gloo across repeats (range in brackets when there
    are several), gradwire / Open MPI, for netns the socket ceiling (tcpring's payload
    rate at the same size) and gradwire's fraction of it, the #wrong elements (max over
    repeats); locally, for allgather, alltoall, broadcast and reduce_scatter, the one-copy
    ceiling (thread_copies) and gradwire's fraction of it -- and, where the torch part ran it,
    torch.distributed on the gradwire
    backend against `gradwire bench` of the same collective and size;
  * the machine, the parameters and the exact commands.

Usage: merge_collectives.py --results DIR [--out FILE]
"""
import argparse
import csv
import os
import statistics
import sys
from collections import defaultdict

# The TSV readers of compare.sh's merge (this directory is on sys.path when run as a script).
from merge import read_meta, read_tsv

COLLS = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "alltoall")
NAMES = {"gradwire": "gradwire", "mpi": "Open MPI", "gloo": "Gloo", "torch": "torch (gradwire backend)",
         "tcpring": "tcpring", "threads": "one-copy ceiling (thread_copies)"}
BUSBW = {"allreduce": "2(W-1)/W", "reduce_scatter": "(W-1)/W", "allgather": "(W-1)/W",
         "alltoall": "(W-1)/W", "broadcast": "1", "reduce": "1"}
MiB = 1 << 20

# ---- the goals ----------------------------------------------------------------
LOCAL_WORLDS = (2, 4)
LOCAL_MIN = 1 * MiB
RS_AG_VS_MPI = 2.5      # reduce_scatter, allgather busbw >= 2.5x Open MPI's (one host)
BCAST_VS_MPI = 2.5      # broadcast >= 2.5x Open MPI's
A2A_VS_MPI = 1.5        # alltoall >= 1.5x Open MPI's
NETNS_MIN = 16 * MiB
NETNS_FRAC = 0.90       # netns: every collective >= 90 % of the socket ceiling
TORCH_MIN = 1 * MiB
TORCH_FRAC = 0.90       # torch RS/AG >= 90 % of gradwire bench's busbw


def human(n: int) -> str:
    for unit, div in (("G", 1 << 30), ("M", MiB), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def num(x: float) -> str:
    return f"{x:.2f}" if x < 100 else f"{x:.0f}"


class Results:
    def __init__(self, results):
        self.runs = read_tsv(os.path.join(results, "runs.tsv"))
        # key = (tool, coll, world, part) -> size -> [(busbw, time_us, wrong)]
        self.data = defaultdict(lambda: defaultdict(list))
        self.status = defaultdict(list)
        for r in self.runs:
            key = (r["tool"], r["coll"], int(r["world"]), r["part"])
            self.status[key].append(r["status"])
            if r["status"] != "ok" or not r["csv"] or not os.path.exists(r["csv"]):
                continue
            with open(r["csv"], newline="") as f:
                for row in csv.DictReader(f):
                    try:
                        wrong = int(row["wrong"]) if row.get("wrong", "") != "" else None
                        self.data[key][int(row["size_bytes"])].append(
                            (float(row["busbw_gbs"]), float(row["time_us"]), wrong))
                    except (KeyError, ValueError):
                        continue

    def med(self, key, size):
        vals = [v[0] for v in self.data.get(key, {}).get(size, [])]
        return statistics.median(vals) if vals else None

    def cell(self, key, size):
        """Median busbw (range) or why there is none."""
        vals = [v[0] for v in self.data.get(key, {}).get(size, [])]
        if vals:
            m = statistics.median(vals)
            return num(m) + (f" ({num(min(vals))}–{num(max(vals))})" if len(vals) > 1 else "")
        return self.why(key)

    def why(self, key):
        st = [s for s in self.status.get(key, []) if s != "ok"]
        if not st:
            return "—" if key not in self.status else "no row"
        # the most frequent reason
        return max(set(st), key=st.count)

    def wrong(self, key, size):
        ws = [v[2] for v in self.data.get(key, {}).get(size, []) if v[2] is not None]
        return str(max(ws)) if ws else "–"

    def sizes(self, keys):
        out = set()
        for k in keys:
            out |= set(self.data.get(k, {}))
        return sorted(out)

    def worlds(self, coll, part_pred):
        return sorted({k[2] for k in self.status if k[1] == coll and part_pred(k[3])})

    def parts(self, coll):
        return sorted({k[3] for k in self.status if k[1] == coll and k[3] != "torch"},
                      key=lambda p: (p != "local", p))


def ratio(a, b):
    return f"{a / b:.2f}x" if a is not None and b not in (None, 0) else "—"


def part_label(part):
    if part == "local":
        return "one host (gradwire shm, MPI vader, Gloo TCP lo)"
    if part.startswith("netns-"):
        return f"netns, {part[len('netns-'):]} Gbit/s links (TCP)"
    return part


def ceiling_key(coll, w, part):
    """The ceiling a collective's busbw is set beside: the socket ceiling across namespaces,
    the one-copy ceiling on one host (allgather, alltoall, broadcast and reduce_scatter)."""
    if part.startswith("netns-"):
        return ("tcpring", "ceiling", w, part)
    return ("threads", coll, w, part)


def coll_table(res, coll, lines):
    head = ("| W | part | size | gradwire busbw | Open MPI busbw | Gloo busbw | gradwire / MPI "
            "| ceiling | gradwire / ceiling | #wrong gw / MPI / Gloo |")
    rows = []
    for part in res.parts(coll):
        for w in res.worlds(coll, lambda p, part=part: p == part):
            keys = {t: (t, coll, w, part) for t in ("gradwire", "mpi", "gloo")}
            ckey = ceiling_key(coll, w, part)
            sizes = res.sizes(keys.values()) or [None]
            for s in sizes:
                if s is None:
                    rows.append(f"| {w} | {part_label(part)} | — | {res.why(keys['gradwire'])} | "
                                f"{res.why(keys['mpi'])} | {res.why(keys['gloo'])} | — | — | — | — |")
                    continue
                gw, mp = res.med(keys["gradwire"], s), res.med(keys["mpi"], s)
                if ckey in res.status:
                    c = res.med(ckey, s)
                    ceil = num(c) if c is not None else res.why(ckey)
                    frac = f"{gw / c * 100:.0f} %" if gw is not None and c else "—"
                else:
                    ceil, frac = "—", "—"
                rows.append(
                    f"| {w} | {part_label(part)} | {human(s)} | {res.cell(keys['gradwire'], s)} | "
                    f"{res.cell(keys['mpi'], s)} | {res.cell(keys['gloo'], s)} | {ratio(gw, mp)} | "
                    f"{ceil} | {frac} | {res.wrong(keys['gradwire'], s)} / {res.wrong(keys['mpi'], s)} / "
                    f"{res.wrong(keys['gloo'], s)} |")
    if rows:
        lines += [head, "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|", *rows, ""]
    # torch part
    trows = []
    for w in res.worlds(coll, lambda p: p == "torch"):
        tk, bk = ("torch", coll, w, "torch"), ("gradwire", coll, w, "torch")
        sizes = res.sizes([tk, bk]) or [None]
        for s in sizes:
            if s is None:
                trows.append(f"| {w} | — | {res.why(tk)} | {res.why(bk)} | — | — |")
                continue
            t, b = res.med(tk, s), res.med(bk, s)
            pct = f"{t / b * 100:.0f} %" if t is not None and b else "—"
            trows.append(f"| {w} | {human(s)} | {res.cell(tk, s)} | {res.cell(bk, s)} | {pct} | "
                         f"{res.wrong(tk, s)} / {res.wrong(bk, s)} |")
    if trows:
        lines += [f"torch.distributed (`{TORCH_API.get(coll, coll)}`) on the gradwire backend against "
                  "`gradwire bench` of the same collective, one host, same run:", "",
                  "| W | size | torch (gradwire backend) busbw | gradwire bench busbw | torch / bench "
                  "| #wrong torch / bench |", "|---:|---:|---:|---:|---:|---|", *trows, ""]


TORCH_API = {"allreduce": "all_reduce", "reduce_scatter": "reduce_scatter_tensor",
             "allgather": "all_gather_into_tensor", "broadcast": "broadcast", "reduce": "reduce",
             "alltoall": "all_to_all_single"}


def judge(pairs, need_all=True):
    """pairs: [(size, ok: bool|None, text)] -> (verdict, detail)."""
    have = [p for p in pairs if p[1] is not None]
    detail = "; ".join(f"{human(s)}: {t}" for s, _, t in pairs)
    if not have:
        return None, detail
    if all(p[1] for p in have) and (not need_all or len(have) == len(pairs)):
        return "met", detail
    if all(p[1] for p in have):
        return "met (sizes with data)", detail
    return "not met", detail


def goals(res, meta, lines):
    parts = meta.get("parts", "").split()
    colls = meta.get("colls", "").split()
    ranks = [int(x) for x in meta.get("ranks", "").split() if x.isdigit()]
    rows = []

    def row(goal, where, verdict, detail, why="not run"):
        v = f"**{verdict}**" if verdict else (why if why.startswith("n/a") else f"n/a ({why})")
        rows.append(f"| {goal} | {where} | {v} | {detail or '—'} |")

    def vs(coll, w, part, other, thr, min_size, label, ceiling=None):
        """gradwire busbw >= thr x other's (other: key) at sizes >= min_size; with `ceiling`
        (a key), each size also says where that ceiling stands against the goal."""
        gk = ("gradwire", coll, w, part)
        sizes = [s for s in res.sizes([gk, other]) if s >= min_size]
        pairs = []
        for s in sizes:
            g, o = res.med(gk, s), res.med(other, s)
            if g is None or o is None:
                pairs.append((s, None, f"{num(g) if g is not None else '—'} vs "
                                       f"{num(o) if o is not None else '—'}"))
            else:
                text = f"{num(g)} vs {num(o)} ({g / o:.2f}x)"
                c = res.med(ceiling, s) if ceiling else None
                if c is not None and o:
                    # Where the ceiling is below the goal, no implementation reaches it here.
                    text += f", ceiling {num(c)} ({c / o:.2f}x{', below the goal' if c < thr * o else ''})"
                pairs.append((s, g >= thr * o, text))
        verdict, detail = judge(pairs)
        why = res.why(gk) if not res.data.get(gk) else f"no {label} data"
        if not res.data.get(other):
            why = f"{label}: {res.why(other)}"
        return verdict, detail, why

    # one host
    for w in LOCAL_WORLDS:
        where = f"one host, W={w}, ≥ {human(LOCAL_MIN)}"
        if "local" not in parts or w not in ranks:
            for g in ("reduce_scatter", "allgather"):
                row(f"{g} busbw ≥ allreduce's (same run)", where, None, "", "not run")
                row(f"{g} busbw ≥ {RS_AG_VS_MPI}x Open MPI's", where, None, "", "not run")
            row(f"broadcast busbw ≥ {BCAST_VS_MPI}x Open MPI's", where, None, "", "not run")
            row(f"alltoall busbw ≥ {A2A_VS_MPI}x Open MPI's", where, None, "", "not run")
            continue
        for g in ("reduce_scatter", "allgather"):
            if g not in colls:
                row(f"{g} busbw ≥ allreduce's (same run)", where, None, "", "not in --colls")
                row(f"{g} busbw ≥ {RS_AG_VS_MPI}x Open MPI's", where, None, "", "not in --colls")
                continue
            if "allreduce" in colls:
                v, d, why = vs(g, w, "local", ("gradwire", "allreduce", w, "local"), 1.0, LOCAL_MIN,
                               "gradwire allreduce", ceiling_key(g, w, "local"))
            else:
                v, d, why = None, "", "allreduce not in --colls"
            row(f"{g} busbw ≥ allreduce's (same run)", where, v, d, why)
            v, d, why = vs(g, w, "local", ("mpi", g, w, "local"), RS_AG_VS_MPI, LOCAL_MIN, "Open MPI",
                           ceiling_key(g, w, "local"))
            row(f"{g} busbw ≥ {RS_AG_VS_MPI}x Open MPI's", where, v, d, why)
        for g, thr in (("broadcast", BCAST_VS_MPI), ("alltoall", A2A_VS_MPI)):
            if g not in colls:
                row(f"{g} busbw ≥ {thr}x Open MPI's", where, None, "", "not in --colls")
                continue
            v, d, why = vs(g, w, "local", ("mpi", g, w, "local"), thr, LOCAL_MIN, "Open MPI",
                           ceiling_key(g, w, "local"))
            row(f"{g} busbw ≥ {thr}x Open MPI's", where, v, d, why)

    # netns
    nparts = sorted({k[3] for k in res.status if k[3].startswith("netns-")})
    if "netns" not in parts or not nparts:
        row(f"every collective ≥ {NETNS_FRAC * 100:.0f} % of the socket ceiling", "netns TCP",
            None, "", "not run")
    for part in nparts:
        for w in sorted({k[2] for k in res.status if k[3] == part}):
            ckey = ("tcpring", "ceiling", w, part)
            for g in [c for c in COLLS if c in colls]:
                where = f"netns {part[len('netns-'):]} Gbit/s, W={w}, ≥ {human(NETNS_MIN)}"
                v, d, why = vs(g, w, part, ckey, NETNS_FRAC, NETNS_MIN, "socket ceiling")
                row(f"{g} busbw ≥ {NETNS_FRAC * 100:.0f} % of the socket ceiling", where, v, d, why)

    # torch
    tcolls = meta.get("torch_colls", "").split()
    if "torch" not in parts:
        row(f"torch reduce_scatter_tensor / all_gather_into_tensor ≥ {TORCH_FRAC * 100:.0f} % of "
            "gradwire bench", "torch", None, "", "not run")
    else:
        for g in ("reduce_scatter", "allgather"):
            for w in res.worlds(g, lambda p: p == "torch") or [None]:
                goal = f"torch `{TORCH_API[g]}` busbw ≥ {TORCH_FRAC * 100:.0f} % of gradwire bench's"
                if w is None or g not in tcolls:
                    row(goal, "torch", None, "", "not in --torch-colls")
                    continue
                tk, bk = ("torch", g, w, "torch"), ("gradwire", g, w, "torch")
                sizes = [s for s in res.sizes([tk, bk]) if s >= TORCH_MIN]
                pairs = []
                for s in sizes:
                    t, b = res.med(tk, s), res.med(bk, s)
                    if t is None or b is None:
                        pairs.append((s, None, "—"))
                    else:
                        pairs.append((s, t >= TORCH_FRAC * b, f"{num(t)} vs {num(b)} ({t / b * 100:.0f} %)"))
                v, d = judge(pairs)
                why = f"torch: {res.why(tk)}" if not res.data.get(tk) else f"bench: {res.why(bk)}"
                row(goal, f"one host, W={w}, ≥ {human(TORCH_MIN)}", v, d, why)

    lines += ["## Goals", "",
              "Judged from this run's medians (busbw, GB/s; per size: gradwire vs the reference). "
              "\"met\" needs every size in the range to pass.", "",
              "| goal | where | result | per size |", "|---|---|---|---|", *rows, ""]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", required=True)
    ap.add_argument("--out", default="-")
    args = ap.parse_args()
    meta = read_meta(os.path.join(args.results, "meta.tsv"))
    res = Results(args.results)

    lines = ["# Collectives: gradwire vs Open MPI and Gloo", ""]
    lines.append(f"Written by `{meta.get('command', 'benches/collectives.sh')}` on "
                 f"{meta.get('date', '?')}.  float32, sum; busbw in GB/s (nccl-tests: algbw × "
                 "2(W-1)/W for allreduce, (W-1)/W for reduce_scatter, allgather and alltoall, 1 for "
                 "broadcast and reduce), the slowest rank's mean time, median over "
                 f"{meta.get('repeats', '?')} repeat(s) (range in brackets).  Sizes are the whole "
                 "buffer: reduce_scatter's total input, allgather's total output, alltoall's total "
                 "input of one rank.")
    lines.append("")
    if meta.get("load_warning"):
        lines += [f"**Warning:** {meta['load_warning']}.", ""]
    goals(res, meta, lines)

    present = [c for c in COLLS if any(k[1] == c for k in res.status)]
    for coll in present:
        lines += [f"## {coll}", "", f"busbw = algbw × {BUSBW[coll]}.", ""]
        coll_table(res, coll, lines)

    lines += ["## Machine and parameters", "",
              "| | |", "|---|---|"]
    for k, label in (("date", "date"), ("nproc", "nproc"), ("cpu_model", "CPU"),
                     ("mem_total", "memory"), ("uname_r", "kernel (uname -r)"),
                     ("mpi_version", "mpirun --version"), ("torch_version", "torch"),
                     ("python_version", "python"), ("gradwire_rev", "gradwire revision"),
                     ("gradwire_bin", "gradwire binary"), ("gradwire_lib", "libgradwire.so (torch part)"),
                     ("loadavg_start", "load average at start"), ("loadavg_end", "load average at end"),
                     ("params", "run"), ("local_params", "local part"), ("netns_params", "netns part"),
                     ("torch_params", "torch part"), ("gradwire_status", "gradwire"),
                     ("mpi_status", "Open MPI"), ("gloo_status", "Gloo"), ("torch_status", "torch backend"),
                     ("netns_status", "netns"), ("bound_status", "socket ceiling (tcpring)"),
                     ("copy_status", "one-copy ceiling (thread_copies)")):
        part = {"local_params": "local", "netns_params": "netns", "torch_params": "torch"}.get(k)
        if k in meta and (part is None or part in meta.get("parts", "").split()):
            lines.append(f"| {label} | {meta[k].replace('|', '/')} |")
    lines.append("")
    lines += ["The socket ceiling is benches/peers/tcpring.c (compare.sh's bound part) across the "
              "same namespaces: ring streams with no reduction, per call of size S a ring "
              "allreduce's per-link traffic; its payload rate is what each rank's shaped link "
              "sustains, the ceiling of every collective's busbw over the same path.", "",
              "The one-copy ceiling is benches/peers/thread_copies.c on the same host, sizes and "
              "iterations: W threads of one process, one per rank, copying every output byte once "
              "straight from the input that holds it (broadcast's copies shared by all W threads; "
              "reduce-scatter's output written once as the float32 sum of the inputs' parts), "
              "a barrier ending each call. No library moving bytes between processes' private "
              "buffers copies less or has less in the way, so a goal set as a multiple of Open MPI "
              "or of gradwire's allreduce is out of reach on this machine where that multiple is "
              "above the ceiling (\"below the goal\" in the Goals table).", ""]

    bad = [r for r in res.runs if r["status"] != "ok"]
    if bad:
        lines += ["### Runs without data", "", "| tool | collective | W | part | repeat | status |",
                  "|---|---|---:|---|---:|---|"]
        lines += [f"| {NAMES.get(r['tool'], r['tool'])} | {r['coll']} | {r['world']} | {r['part']} | "
                  f"{r['repeat']} | {r['status']} |" for r in bad]
        lines.append("")
    cmds = [r for r in res.runs if r["command"] and r["repeat"] == "1"]
    reps = meta.get("repeats", "1")
    lines += ["### Commands", "",
              "Every launch of repeat 1 in order (" + (f"repeats 2..{reps} ran the same, CSV names "
              "aside; " if reps not in ("", "1") else "") + "the seconds include start-up):", "", "```"]
    lines += [f"# {r['seconds']} s, {r['status']}\n{r['command']}" for r in cmds]
    lines += ["```", ""]

    text = "\n".join(lines)
    if args.out == "-":
        sys.stdout.write(text)
    else:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
