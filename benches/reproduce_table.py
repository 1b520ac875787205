"""The table of one claim of benches/reproduce.sh from its runs' CSVs (`gradwire train
--csv` rows, or benches/torch_reproduce.py's): time to a common accuracy target per run
label, as the median over repeats (one CSV per label and repeat) with the spread.

    python3 benches/reproduce_table.py CLAIM TITLE BASELINE PLOT CSV...

The target is 99 % of the lowest best test accuracy among all runs, so every run can
reach it; a run's time to it is the wall clock (evaluation excluded) of its first epoch at
or above it.
"""

import csv
import statistics
import sys
from collections import OrderedDict

claim, title, baseline, plot, files = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]
runs = OrderedDict()  # label -> [rows of each repeat]
for f in files:
    rows = list(csv.DictReader(open(f)))
    if rows:
        runs.setdefault(rows[0]["label"], []).append(rows)
target = 0.99 * min(max(float(r["test_acc"]) for r in rows) for reps in runs.values() for rows in reps)


def reach(rows):
    for r in rows:
        if float(r["test_acc"]) >= target:
            return float(r["wall_s"]), int(r["epoch"])
    return None, None


def spread(values, fmt):
    return f"{fmt(min(values))}–{fmt(max(values))}" if len(values) > 1 else "-"


def median_time(label):
    times = [reach(rows)[0] for rows in runs.get(label, [])]
    return statistics.median(times) if times and None not in times else None


base_t = median_time(baseline)
repeats = max(len(r) for r in runs.values())
print(f"## {claim}\n\n{title}.\n")
print(f"Target: {100 * target:.1f} % test accuracy (99 % of the lowest best accuracy among the runs). "
      f"{'Medians of ' + str(repeats) + ' runs each, spread min–max.' if repeats > 1 else 'One run each.'}\n")
print(f"| run | time to target (s) | spread (s) | epochs to target | vs {baseline} | final test acc | total wall (s) | MB sent per rank |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for label, reps in runs.items():
    reached = [reach(rows) for rows in reps]
    finals = [float(rows[-1]["test_acc"]) for rows in reps]
    walls = [float(rows[-1]["wall_s"]) for rows in reps]
    sent = statistics.median(float(rows[-1]["mb_sent_per_rank_mean"]) for rows in reps)
    sent_text = f"{sent:.1f}" if sent == sent else "n/a"  # NaN: DDP counts no bytes
    acc = f"{100 * statistics.median(finals):.1f} %"
    if any(t is None for t, _ in reached):
        print(f"| {label} | not reached in {sum(t is None for t, _ in reached)} of {len(reps)} | - | - | - | {acc} | {statistics.median(walls):.2f} | {sent_text} |")
        continue
    t = statistics.median(t for t, _ in reached)
    e = statistics.median(e for _, e in reached)
    vs = f"{100 * (t / base_t - 1):+.0f} %" if base_t else "n/a"
    print(f"| {label} | {t:.2f} | {spread([t for t, _ in reached], lambda v: f'{v:.1f}')} | {e:g} | {vs} | {acc} | {statistics.median(walls):.2f} | {sent_text} |")
print(f"\n![{claim}]({plot})\n")
