#!/usr/bin/env python3
"""docs/cost_model.md from the runs benches/cost_model.sh keeps: per kind of link the fitted
parameters, every run's measured (the median of its repeats) and predicted time, the median
error (on the runs the fit saw and on those it did not), how often the model picks the
faster of ring and recursive doubling where the repeats tell the two apart, against the
fixed size threshold it replaces, and a chart per link and node count.

    python3 benches/cost_model_report.py benches/results/cost_model docs/cost_model.md
"""

import csv
import glob
import os
import statistics
import subprocess
import sys
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"))
from merge import human, svg_plot  # noqa: E402 (the benchmark report's chart writer)

# The threshold the automatic choice used before the model (GRADWIRE_SMALL_BYTES' default).
OLD_SMALL_BYTES = 256 << 10
COLOURS = {"ring": "#1f77b4", "rd": "#d62728", "hd": "#2ca02c"}
MODEL_COLOURS = {"ring": "#9ecae1", "rd": "#fc9f9f", "hd": "#a1d99b"}
NAMES = {"ring": "ring", "rd": "recursive doubling", "hd": "halving-doubling"}
PUBLISHED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "published", "nccl_allreduce.csv")


def read_model(path):
    """(the fit's comment line, rows as dicts) of one `gradwire model --fit` output."""
    with open(path) as f:
        first = f.readline().strip().lstrip("# ")
        return first, list(csv.DictReader(f))


def link_name(rate):
    """A link's name in the kept files: "1g", or "native" for the unshaped veth pairs."""
    return rate if rate == "native" else f"{rate}g"


def link_title(rate):
    return "Unshaped links (the veth pairs as they are)" if rate == "native" else f"Links shaped to {rate} Gbit/s"


def repeat_times(kept, csv_name):
    """size -> the times of every repeat of one kept run (its .rN.csv files)."""
    times = defaultdict(list)
    for path in sorted(glob.glob(os.path.join(kept, csv_name[: -len(".csv")] + ".r*.csv"))):
        for row in csv.DictReader(open(path)):
            times[int(row["size_bytes"])].append(float(row["time_us"]))
    return times


def pct(x):
    return f"{100 * x:.0f} %"


def share(picks):
    """'K of N (P %)' of a list of whether each pick was the faster."""
    return f"{sum(picks)} of {len(picks)} ({pct(sum(picks) / len(picks))})" if picks else "none"


# The extrapolation's assumptions (not measured here): a node of 8 ranks joined inside by
# 1200 Gbit/s at 3 us per step (NVLink class); networks as below; a batch computing 100 ms.
NETWORKS = [("100 Gbit/s RDMA", 100, 5), ("25 Gbit/s Ethernet", 25, 25)]
MODELS = [("100 M parameters", 400_000_000), ("1 B parameters", 4_000_000_000)]
PER_NODE, NODE_GBIT, NODE_ALPHA_US, GAMMA_NS, COMPUTE_MS = 8, 1200, 3, 0.05, 100
NODES = [1 << i for i in range(11)]


def model(gw, nodes, per_node, gbit, alpha_us, gamma_ns, node_gbit, node_alpha_us, min_bytes, max_bytes, factor=4, compute_ms=None):
    """The rows of `gradwire model` for this job, as dicts of strings, by size."""
    args = [gw, "model", "--nodes", str(nodes), "--ranks-per-node", str(per_node), "--gbit", str(gbit), "--alpha-us", str(alpha_us),
            "--gamma-ns", str(gamma_ns), "--node-gbit", str(node_gbit), "--node-alpha-us", str(node_alpha_us),
            "-b", str(min_bytes), "-e", str(max_bytes), "-f", str(factor)]
    if compute_ms is not None:
        args += ["--compute-ms", str(compute_ms)]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return {int(r["bytes"]): r for r in csv.DictReader(line for line in out.splitlines() if not line.startswith("#"))}


def predicted(gw, nodes, gbit, alpha_us, nbytes):
    """One row of `gradwire model` for the extrapolation's job at this size."""
    return model(gw, nodes, PER_NODE, gbit, alpha_us, GAMMA_NS, NODE_GBIT, NODE_ALPHA_US, nbytes, nbytes, compute_ms=COMPUTE_MS)[nbytes]


# Published NCCL allreduce runs on 8 x H100 nodes (benches/results/published/). Assumed for
# them, not fitted: NVLink4 inside the node (450 GB/s each way) at 3 us a step, the network
# at 5 us a step, reduction on the GPU (0.001 ns a byte).
H100_NODE_GBIT, H100_NODE_ALPHA_US, H100_NET_ALPHA_US, GPU_GAMMA_NS = 3600, 3, 5, 0.001
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def published(gw, path):
    """The section comparing the model with published runs of 64 GPUs and more."""
    rows = list(csv.DictReader(open(path)))
    gaps = {"ring": defaultdict(list), "sharded": defaultdict(list)}
    tables = []
    for (source, nodes), group in groupby_keys(rows, ("source", "nodes")).items():
        first = group[0]
        per_node, node_gbit = int(first["ranks_per_node"]), float(first["node_network_gbit"])
        sizes = [int(r["bytes"]) for r in group]

        def predict(gbit):
            return model(gw, int(nodes), per_node, gbit, H100_NET_ALPHA_US, GPU_GAMMA_NS, H100_NODE_GBIT, H100_NODE_ALPHA_US,
                         min(sizes), max(sizes), factor=2)

        # NCCL runs a ring per network card, so its rings together reach the node's whole
        # rate (busbw up to it); gradwire's sharded form gives each rank its share of it.
        as_nccl, as_gradwire = predict(node_gbit), predict(node_gbit / per_node)
        tables += [f"**{source}**, {nodes} nodes x {per_node} GPUs, {node_gbit:g} Gbit/s of network a node "
                   f"(rate from {first['node_network_gbit_from']}; time from {first['time_from'].split(' (')[0]}); {first['url']}", "",
                   "| bytes | measured µs | the model's ring µs | gap | gradwire's sharded form µs | gap |", "|---:|---:|---:|---:|---:|---:|"]
        for r in group:
            b, measured = int(r["bytes"]), float(r["time_us"])
            ring, sharded = float(as_nccl[b]["ring_us"]), float(as_gradwire[b]["sharded_us"])
            band = "from 64 MiB" if b >= 64 << 20 else "below 64 MiB"
            gaps["ring"][band].append(ring / measured - 1)
            gaps["sharded"][band].append(sharded / measured - 1)
            tables.append(f"| {human(b)} | {measured:.0f} | {ring:.0f} | {100 * (ring / measured - 1):+.0f} % | {sharded:.0f} | "
                          f"{100 * (sharded / measured - 1):+.0f} % |")
        tables.append("")
    summary = []
    for what, by_band in (("the model's ring against NCCL", gaps["ring"]), ("gradwire's sharded form against NCCL", gaps["sharded"])):
        for band in ("below 64 MiB", "from 64 MiB"):
            if by_band[band]:
                g = by_band[band]
                summary.append(f"{what} {band}: median gap {100 * statistics.median(g):+.0f} %, "
                               f"median |gap| {100 * statistics.median(abs(x) for x in g):.0f} % ({len(g)} runs)")
    return ["## Against published runs at 64-256 GPUs", "",
            f"Measured by others with NCCL (`{os.path.relpath(path, REPO)}`, every row with its source, checked against it), "
            "predicted here by `gradwire model` for the same nodes and ranks per node. Assumed, not fitted: inside a node "
            f"NVLink4, {H100_NODE_GBIT} Gbit/s at {H100_NODE_ALPHA_US} µs a step; the network {H100_NET_ALPHA_US} µs a step; "
            f"reduction on the GPU, γ = {GPU_GAMMA_NS} ns a byte. NCCL chooses its own algorithm; for large messages it runs "
            "rings, one per network card, which together reach the node's whole network rate: the model's ring is given that "
            "rate. gradwire's sharded hierarchical allreduce (reduce-scatter in the node, a cross-node allreduce of each "
            "rank's shard over its own share of the network, allgather in the node) is predicted with each rank's share. "
            "Gap: predicted over measured, less 1.", "",
            "Summary: " + "; ".join(summary) + ".", "", *tables]


def groupby_keys(rows, keys):
    """Rows grouped by the values of `keys`, in the order first seen."""
    groups = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    return groups


def extrapolation(gw, charts, measured_nodes):
    """The section predicting 1 to 1024 nodes, with a chart per network."""
    lines = ["## Extrapolation to 1024 nodes", "",
             f"Predicted by `gradwire model` (not measured beyond {measured_nodes} nodes: every row above that is an "
             f"extrapolation of the model's form, marked ~). Assumed, not fitted: {PER_NODE} ranks per node joined inside by "
             f"{NODE_GBIT} Gbit/s at {NODE_ALPHA_US} µs per step; γ = {GAMMA_NS} ns per byte; "
             + "; ".join(f"{name}: α = {a} µs per step" for name, _, a in NETWORKS)
             + f"; a batch computes {COMPUTE_MS} ms. float32 parameters and gradients. DDP's allreduce is the fastest of the "
             "flat and hierarchical forms; DASO's wait is per batch in its cycling phase (a global send every 4 batches, "
             "merged one batch later behind that batch's computation, node-local averages every batch).", ""]
    head = "| nodes | " + " | ".join(f"{m}, {n}: DDP allreduce ms / DASO wait per batch ms" for n, _, _ in NETWORKS for m, _ in MODELS) + " |"
    lines += [head, "|---:|" + "---|" * (len(NETWORKS) * len(MODELS))]
    series = {name: [] for name, _, _ in NETWORKS}
    for nodes in NODES:
        cells = []
        for name, gbit, alpha in NETWORKS:
            for mname, nbytes in MODELS:
                row = predicted(gw, nodes, gbit, alpha, nbytes)
                ddp = min(float(row[k]) for k in ("ring_us", "rd_us", "hd_us", "sharded_us", "leader_us"))
                cells.append(f"{ddp / 1e3:.1f} / {float(row['daso_wait_per_batch_us']) / 1e3:.1f}")
                if mname == MODELS[0][0]:
                    p = nodes * PER_NODE
                    series[name].append((nodes, 2 * (p - 1) / p * nbytes / (ddp * 1e-6) / 1e9, row["fastest"]))
        mark = "~" if nodes > measured_nodes else ""
        lines.append(f"| {mark}{nodes} | " + " | ".join(cells) + " |")
    lines.append("")
    plotted = [(f"{name}", colour, [(n, bw, bw, bw) for n, bw, _ in pts]) for (name, pts), colour in zip(series.items(), ("#1f77b4", "#d62728"))]
    if svg_plot(f"DDP allreduce of {MODELS[0][0]}, predicted busbw against nodes (x: nodes)", plotted, os.path.join(charts, "extrapolation.svg")):
        lines += ["![predicted busbw against nodes](cost_model/extrapolation.svg)", ""]
    return lines


def main():
    kept, out = sys.argv[1], sys.argv[2]
    gw = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "target", "release", "gradwire")
    meta = dict(line.rstrip("\n").split("\t", 1) for line in open(os.path.join(kept, "meta.tsv")))
    runs = list(csv.DictReader(open(os.path.join(kept, "runs.tsv")), delimiter="\t"))
    rates = sorted({r["rate_gbit"] for r in runs}, key=lambda r: float("inf") if r == "native" else float(r))
    charts = os.path.join(os.path.dirname(os.path.abspath(out)), "cost_model")
    summary, sections = [], []
    all_err, held_err, strict, picks, old_picks, auto_ratios = [], [], [], [], [], []
    for rate in rates:
        fitline, rows = read_model(os.path.join(kept, f"model_{link_name(rate)}.csv"))
        # (nodes, algo) -> size -> every repeat's time
        spread = {(int(run["nodes"]), run["algo"]): repeat_times(kept, run["csv"]) for run in runs if run["rate_gbit"] == rate and run["algo"] != "auto"}
        by = defaultdict(dict)  # (nodes, bytes) -> algo -> row
        for r in rows:
            r["err"] = float(r["predicted_us"]) / float(r["measured_us"]) - 1
            by[(int(r["ranks"]), int(float(r["bytes"])))][r["algo"]] = r
        # The automatic choice's own runs (told the fitted network), by nodes and size.
        auto = {}
        for run in runs:
            if run["rate_gbit"] == rate and run["algo"] == "auto":
                for row in csv.DictReader(open(os.path.join(kept, run["csv"]))):
                    auto[(int(run["nodes"]), int(row["size_bytes"]))] = float(row["time_us"])
        errs = [abs(r["err"]) for r in rows]
        held = [abs(r["err"]) for r in rows if r["in_fit"] == "0"]
        rate_strict, rate_picks, rate_old, decided = [], [], [], {}
        for (n, b), algos in sorted(by.items()):
            if "ring" in algos and "rd" in algos:
                t = {a: float(algos[a]["measured_us"]) for a in ("ring", "rd")}
                faster, slower = sorted(t, key=t.get)
                model, old = algos["ring"]["chosen"], "rd" if b < OLD_SMALL_BYTES else "ring"
                rate_strict.append(model == faster)
                # Decided: every repeat of the faster beat every repeat of the slower. Where
                # the repeats overlap the two take the same time within the noise, and the
                # faster median is a coin toss.
                times = {a: spread.get((n, a), {}).get(b, []) for a in (faster, slower)}
                decided[(n, b)] = len(times[faster]) > 1 and max(times[faster]) < min(times[slower])
                if decided[(n, b)]:
                    rate_picks.append(model == faster)
                    rate_old.append(old == faster)
        all_err += errs
        held_err += held
        strict += rate_strict
        picks += rate_picks
        old_picks += rate_old
        summary.append(
            f"| {link_title(rate)} | {fitline.split(': ', 1)[1]} | {pct(statistics.median(errs))} | "
            + (f"{pct(statistics.median(held))}" if held else "n/a")
            + f" | {pct(sum(e <= 0.25 for e in errs) / len(errs))} | {len(rate_picks)} of {len(rate_strict)} | {share(rate_picks)} | "
            f"{share(rate_old)} | {share(rate_strict)} |"
        )
        lines = [f"### {link_title(rate)}", "", f"Fit: {fitline}.", "",
                 "| nodes | bytes | " + " | ".join(f"{NAMES[a]} measured / predicted µs (error)" for a in ("ring", "rd", "hd"))
                 + " | faster (measured) | the repeats decide it | model's pick | `GRADWIRE_ALGO=auto` told the fitted network: µs (over the faster) |",
                 "|---:|---:|" + "---|" * 3 + "---|---|---|---|"]
        for (n, b), algos in sorted(by.items()):
            cells = []
            for a in ("ring", "rd", "hd"):
                r = algos.get(a)
                if r is None:
                    cells.append("")
                    continue
                mark = "" if r["in_fit"] == "1" else " *"
                cells.append(f"{float(r['measured_us']):.0f} / {float(r['predicted_us']):.0f} ({100 * r['err']:+.0f} %){mark}")
            faster = min(("ring", "rd"), key=lambda a: float(algos[a]["measured_us"])) if "ring" in algos and "rd" in algos else ""
            pick = algos.get("ring", {}).get("chosen", "")
            auto_cell = ""
            if (n, b) in auto and faster:
                ratio = auto[(n, b)] / float(algos[faster]["measured_us"])
                auto_ratios.append(ratio)
                auto_cell = f"{auto[(n, b)]:.0f} ({ratio:.2f}x)"
            verdict = {True: "yes", False: "no (a tie)"}.get(decided.get((n, b)), "")
            lines.append(f"| {n} | {human(b)} | " + " | ".join(cells) + f" | {faster} | {verdict} | {pick} | {auto_cell} |")
        lines += ["", "\\* not in the fit (predicted from the other node counts).", ""]
        for n in sorted({n for n, _ in by}):
            series = []
            for a in ("ring", "rd", "hd"):
                pts = [(b, algos[a]) for (m, b), algos in sorted(by.items()) if m == n and a in algos]
                if not pts:
                    continue
                # busbw as nccl-tests defines it: 2(n-1)/n x bytes / time, GB/s.
                def bw(b, us):
                    return 2 * (n - 1) / n * b / (float(us) * 1e-6) / 1e9

                series.append((f"{a} measured", COLOURS[a], [(b, bw(b, r["measured_us"]), bw(b, r["measured_us"]), bw(b, r["measured_us"])) for b, r in pts]))
                series.append((f"{a} model", MODEL_COLOURS[a], [(b, bw(b, r["predicted_us"]), bw(b, r["predicted_us"]), bw(b, r["predicted_us"])) for b, r in pts]))
            name = f"allreduce-{link_name(rate)}-n{n}.svg"
            link = "unshaped links" if rate == "native" else f"{rate} Gbit/s"
            if svg_plot(f"allreduce, {n} nodes, {link}: measured and predicted", series, os.path.join(charts, name)):
                lines.append(f"![{n} nodes, {link}](cost_model/{name})")
                lines.append("")
        sections.append("\n".join(lines))
    doc = [
        "# The cost model against measured runs",
        "",
        "Generated by `benches/cost_model.sh --record` (or `--report` from the kept CSVs in "
        "`benches/results/cost_model/`); do not edit. The model and its command: "
        "[operators.md](operators.md#the-cost-model).",
        "",
        f"Setup: {meta.get('cpus')} CPUs ({meta.get('cpu')}), kernel {meta.get('kernel')}, "
        f"commit {meta.get('commit')}, {meta.get('date')}. Each node is a network namespace with one rank, joined to the others "
        "by veth pairs, its egress shaped by tc tbf to a rate or left unshaped; `gradwire bench allreduce` over tcp, float32 sum, "
        "time = the slowest rank's mean (4-64 KiB: 400 timed calls after 40, so that tbf's 256 KiB burst weighs little; from "
        f"256 KiB: 5 after 1), {meta.get('repeats', '1')} repeats of every run, interleaved; a run's time is the median of its repeats.",
        "",
        "What these links show and what they do not. tbf's token bucket fills while the link idles, so on a shaped link the "
        "latency of a step (α) is spent earning the tokens its bytes then use: the time of a call is its bytes at the rate, α "
        "hides, and the fit finds α at or near zero. On these links 2 nodes' ring and recursive doubling move the same bytes "
        "(one step or two) and tie within the noise. The unshaped links have no bucket: there α is the veth's and the "
        "software's cost of a step, and it decides between the algorithms. This kernel has no netem, so no added delay is "
        "measured. Every node is a namespace of one "
        f"{meta.get('cpus')}-core machine, so from 4 nodes on ranks time-share cores: the fit (`gradwire model --fit ... --cores N`) "
        "finds σ, the time a step waits per rank beyond one on a core, which is zero where every rank has a core of its own "
        "(the extrapolation below, and the automatic choice in a real job).",
        "",
        "## Summary",
        "",
        "A case is decided where every repeat of the faster of ring and recursive doubling beat every repeat of the slower; "
        "elsewhere the two tie within the noise and either pick is as good.",
        "",
        "| link | fitted parameters | median error | median error, runs not in the fit | within 25 % | cases the repeats decide | "
        "the model picks the faster, decided cases | the fixed 256 KiB threshold does | the model picks the faster median, every case |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        *summary,
        "",
        f"Over every link: median error {pct(statistics.median(all_err))}"
        + (f" ({pct(statistics.median(held_err))} on the runs not in the fit)" if held_err else "")
        + f"; of {len(strict)} cases (nodes x size x link) the repeats decide {len(picks)}, and in those the model picks the faster of "
        f"ring and recursive doubling in {share(picks)}, the fixed threshold in {share(old_picks)}; counting every case by its "
        f"medians, ties included, the model picks the faster in {share(strict)}."
        + (f" The automatic choice itself (it has no σ), told the network fitted when it ran (`GRADWIRE_NET_*`, in runs.tsv), ran within 5 % of the faster in "
           f"{pct(sum(r <= 1.05 for r in auto_ratios) / len(auto_ratios))} of {len(auto_ratios)} cases "
           f"(median {statistics.median(auto_ratios):.2f}x, worst {max(auto_ratios):.2f}x)." if auto_ratios else ""),
        "",
        *extrapolation(gw, charts, max(int(r["nodes"]) for r in runs)),
        *published(gw, PUBLISHED),
        "## Each run",
        "",
        *sections,
    ]
    with open(out, "w") as f:
        f.write("\n".join(doc).rstrip() + "\n")


if __name__ == "__main__":
    main()
