#!/usr/bin/env python3
"""The DDP overhead report (a docs/benchmarks.md section and an SVG bar chart) from the CSV that
benches/ddp_overhead.py writes; nothing in it is typed by hand.

    python3 benches/ddp_overhead_report.py benches/results/ddp_overhead.csv [--record]

--record writes the section into docs/benchmarks.md (benches/record_section.py) and the chart to
docs/benchmarks/ddp_overhead.svg; without it the section is printed.
"""
import argparse
import csv
import statistics

from record_section import record  # benches/, this script's folder

SVG = "docs/benchmarks/ddp_overhead.svg"
LABELS = {
    "local": "step, no communication",
    "ddp_nocomm": "DDP, hook that sends nothing",
    "ddp_gloo": "DDP on gloo",
    "ddp_gradwire": "DDP on gradwire",
    "ar_gradwire": "allreduce of the gradients, gradwire C call",
    "ar_gloo": "allreduce of the gradients, gloo",
    "ddp_nocomm_view": "DDP, hook that sends nothing, bucket views",
    "ddp_gloo_view": "DDP on gloo, bucket views",
    "ddp_gradwire_view": "DDP on gradwire, bucket views",
}


def spread(values, fmt="{:.1f}"):
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}–{fmt.format(max(values))}]"


def svg(medians, ranges):
    """A horizontal bar per variant (median), with a line over its min-max range."""
    width, left, bar, gap = 640, 300, 18, 8
    top = max(hi for _, hi in ranges.values())
    scale = (width - left - 20) / top
    rows = []
    for i, (k, m) in enumerate(medians.items()):
        y = 10 + i * (bar + gap)
        lo, hi = ranges[k]
        rows.append(f'<text x="{left - 6}" y="{y + 13}" text-anchor="end">{LABELS[k]}</text>')
        rows.append(f'<rect x="{left}" y="{y}" width="{m * scale:.1f}" height="{bar}" fill="#4878a8"/>')
        rows.append(f'<line x1="{left + lo * scale:.1f}" x2="{left + hi * scale:.1f}" y1="{y + bar / 2}" y2="{y + bar / 2}" stroke="black"/>')
        rows.append(f'<text x="{left + hi * scale + 4:.1f}" y="{y + 13}">{m:.1f} ms</text>')
    height = 20 + len(medians) * (bar + gap)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width + 60}" height="{height}" font-family="sans-serif" font-size="12">'
            + "".join(rows) + "</svg>\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    with open(args.csv) as f:
        rows = list(csv.DictReader(f))
    meta = rows[0]
    rounds = sorted({int(r["round"]) for r in rows})
    ms = {}
    for r in rows:
        ms.setdefault(r["variant"], {})[int(r["round"])] = float(r["ms"])
    variants = [k for k in LABELS if k in ms]
    # Per round, paired: the variants of one round ran back to back.
    def over(k, base="local"):
        """k's step less base's, round by round."""
        return [ms[k][i] - ms[base][i] for i in rounds]

    def per_allreduce(values):
        """Round by round, as multiples of that round's bare allreduce."""
        return [v / ms["ar_gradwire"][i] for v, i in zip(values, rounds)]

    def overhead(suffix):
        """DDP's figures in one form (default buckets, or gradient_as_bucket_view=True)."""
        nocomm, on_gloo, on_gradwire = (f"ddp_{b}{suffix}" for b in ("nocomm", "gloo", "gradwire"))
        added = over(on_gradwire, nocomm)
        return [
            f"- DDP's own cost (hook that sends nothing) over the plain step: {spread(over(nocomm))} ms, "
            f"{spread(per_allreduce(over(nocomm)), '{:.2f}')}x the bare allreduce by itself.",
            f"- DDP on gradwire over the plain step: {spread(over(on_gradwire))} ms, "
            f"**{spread(per_allreduce(over(on_gradwire)), '{:.2f}')}x** the bare allreduce of the same bytes "
            f"(goal, issue 53: at most 2x); on gloo: {spread(over(on_gloo))} ms.",
            f"- What gradwire adds to DDP's own cost: {spread(added)} ms per step, "
            f"**{spread(per_allreduce(added), '{:.2f}')}x** the bare allreduce; gloo adds {spread(over(on_gloo, nocomm))} ms.",
        ]

    lines = [
        "## DDP on gradwire: overhead over the step with no communication",
        "",
        f"Command: `benches/ddp_overhead.py` under `gradwire launch -n {meta['world']}` (CSV: `{args.csv}`, report: "
        f"`benches/ddp_overhead_report.py`). {meta['world']} ranks on {meta['cores']} cores, one thread each, torch {meta['torch']}, "
        f"an MLP of {int(meta['params']) / 1e6:.1f} M parameters, batch {meta['batch']}, CPU tensors. {len(rounds)} rounds after one that warms up; each round runs every variant for {meta['steps']} steps, "
        "one after another in the same processes, in an order rotated from round to round; each figure is the slowest rank's mean step, "
        "median over the rounds [min-max]; overheads are paired within a round. The DDP replicas on gloo and gradwire end with the same parameters, "
        "in each form.",
        "",
        "| variant | ms per step |",
        "|---|---|",
    ]
    lines += [f"| {LABELS[k]} | {spread(list(ms[k].values()))} |" for k in variants]
    lines += ["", "DDP as constructed by default (each bucket a copy of its gradients):", ""]
    lines += overhead("")
    if "ddp_gradwire_view" in ms:
        lines += ["", "DDP with `gradient_as_bucket_view=True` (the gradients are views into the buckets):", ""]
        lines += overhead("_view")
    own = {sfx: statistics.median(over(f"ddp_nocomm{sfx}")) for sfx in ("", "_view") if f"ddp_nocomm{sfx}" in ms}
    views = f" ({own['_view']:.1f} ms with bucket views, {own['']:.1f} ms without)" if "_view" in own else ""
    lines += [
        "",
        f"DDP's own cost (the hook that sends nothing){views} is the same on every backend. Where it is as large as the allreduce, "
        "no backend meets the 2x goal over the plain step; what gradwire adds to it is the part the backend controls.",
        "",
        f"- DDP on gradwire over the plain step, round by round (ms): {', '.join('%.1f' % o for o in over('ddp_gradwire'))}.",
        "",
        f"![DDP overhead]({SVG})",
    ]
    section = "\n".join(lines) + "\n"
    if not args.record:
        print(section)
        return
    medians = {k: statistics.median(ms[k].values()) for k in variants}
    record(section, (SVG, svg(medians, {k: (min(ms[k].values()), max(ms[k].values())) for k in variants})))


if __name__ == "__main__":
    main()
