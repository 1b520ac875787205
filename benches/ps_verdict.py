#!/usr/bin/env python3
"""Judges a "Parameter-server shards and token ring" section (benches/ps_bench.sh) against
the target: push and pull at least 85 % of the raw one-sided write/read bandwidth from
1 MiB. Reads the section's tables, prints the verdict paragraph."""
import re
import sys

TARGET, FROM = 85, 1 << 20
text = open(sys.argv[1]).read()
verdicts = []
for title, body in re.findall(r"^### (.+?)\n\n(\|.*?)(?:\n\n|\Z)", text, re.S | re.M):
    rows = [[c.strip() for c in l.strip("|").split("|")] for l in body.splitlines() if re.match(r"\| \d", l)]
    rows = [r for r in rows if len(r) == 7 and int(r[0]) >= FROM]
    if not rows:
        continue
    pct = lambda c: int(c.rstrip(" %"))
    push, pull = [pct(r[3]) for r in rows], [pct(r[6]) for r in rows]
    short = [f"{int(r[0]) >> 20} MiB {k}" for r in rows for k, v in (("push", pct(r[3])), ("pull", pct(r[6]))) if v < TARGET]
    verdicts.append(f"- {title}: push {min(push)}-{max(push)} %, pull {min(pull)}-{max(pull)} %: "
                    + ("**met**" if not short else "**not met** (" + ", ".join(short) + ")"))
print(f"Verdict against the target (push and pull at least {TARGET} % of the raw one-sided bandwidth")
print("from 1 MiB), from the tables above:")
print()
print("\n".join(verdicts))
