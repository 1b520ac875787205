"""The table of one claim of benches/reproduce.sh (for one model) from its runs' CSVs
(`gradwire train --csv` rows, or benches/torch_reproduce.py's): per run label, the time to
a common accuracy target and the final accuracy, as the median over the repeats (one CSV
per label and repeat) with the spread (min-max).

    python3 benches/reproduce_table.py CLAIM TITLE BASELINE PLOT CSV...

The target is the baseline's converged accuracy, the mean test accuracy of its last 3
epochs (median over its repeats), less 1 point (TOLERANCE); a run's time to it is the wall
clock (evaluation excluded) of its first epoch at or above it. A run that reaches the target
and ends below it (its converged accuracy under the target: it diverged or fell back) is
marked: its time to target is not a result to pick. Runs shorter than 60 s of training are
flagged, and the seeds of the repeats are listed.
"""

import csv
import statistics
import sys
from collections import OrderedDict

TOLERANCE = 0.01  # accuracy (a fraction) below the baseline's converged accuracy
LAST = 3  # epochs whose mean is a run's converged accuracy
MIN_RUN_S = 60.0

claim, title, baseline, plot, files = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]
runs = OrderedDict()  # label -> [rows of each repeat]
for f in files:
    rows = list(csv.DictReader(open(f)))
    if rows:
        runs.setdefault(rows[0]["label"], []).append(rows)
if baseline not in runs:
    sys.exit(f"reproduce_table: no runs of the baseline {baseline!r} among {list(runs)}")


def converged(rows):
    return statistics.mean(float(r["test_acc"]) for r in rows[-LAST:])


base_acc = statistics.median(converged(rows) for rows in runs[baseline])
target = base_acc - TOLERANCE


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
seeds = sorted({rows[0].get("seed", "0") for reps in runs.values() for rows in reps}, key=lambda v: (len(v), v))
short = []
for label, reps in runs.items():
    walls = [float(rows[-1]["wall_s"]) for rows in reps if float(rows[-1]["wall_s"]) < MIN_RUN_S]
    if walls:
        short.append(f"{label} ({len(walls)} of {len(reps)} runs, {min(walls):.0f}–{max(walls):.0f} s)")
print(f"## {claim}\n\n{title}.\n")
print(
    f"Target: {100 * target:.1f} % test accuracy: {baseline}'s converged accuracy ({100 * base_acc:.1f} %, the mean of its last {LAST} epochs, "
    f"median over its repeats) less {100 * TOLERANCE:g} point. "
    + (f"Medians of {repeats} runs each (seeds {', '.join(seeds)}), spread min–max." if repeats > 1 else f"One run each (seed {seeds[0]}).")
    + (f" Shorter than {MIN_RUN_S:.0f} s of training: {', '.join(short)}." if short else f" Every run trained at least {MIN_RUN_S:.0f} s.")
    + "\n"
)
unheld = []  # labels whose runs reached the target and ended below it
print(f"| run | time to target (s) | spread (s) | epochs to target | vs {baseline} | final test acc | spread | total wall (s) | MB sent per rank |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for label, reps in runs.items():
    reached = [reach(rows) for rows in reps]
    finals = [100 * float(rows[-1]["test_acc"]) for rows in reps]
    walls = [float(rows[-1]["wall_s"]) for rows in reps]
    sent = statistics.median(float(rows[-1]["mb_sent_per_rank_mean"]) for rows in reps)
    sent_text = f"{sent:.1f}" if sent == sent else "n/a"  # NaN: DDP counts no bytes
    acc = f"{statistics.median(finals):.1f} %"
    acc_spread = spread(finals, lambda v: f"{v:.1f}")
    if any(t is None for t, _ in reached):
        missed = sum(t is None for t, _ in reached)
        print(f"| {label} | not reached in {missed} of {len(reps)} | - | - | - | {acc} | {acc_spread} | {statistics.median(walls):.2f} | {sent_text} |")
        continue
    t = statistics.median(t for t, _ in reached)
    e = statistics.median(e for _, e in reached)
    vs = f"{100 * (t / base_t - 1):+.0f} %" if base_t else "n/a"
    fell = sum(converged(rows) < target for rows in reps)
    mark = ""
    if fell:
        mark = " †"
        unheld.append(f"{label} ({fell} of {len(reps)})")
    print(f"| {label} | {t:.2f}{mark} | {spread([t for t, _ in reached], lambda v: f'{v:.1f}')} | {e:g} | {vs} | {acc} | {acc_spread} | {statistics.median(walls):.2f} | {sent_text} |")
if unheld:
    print(f"\n† Reached the target and ended below it (converged accuracy, the mean of the last {LAST} epochs, under the target): {', '.join(unheld)}.")
print(f"\n![{claim}]({plot})\n")
