#!/usr/bin/env python3
"""Writes one section (a markdown text starting with its "## " heading) into the benchmark
report, docs/benchmarks.md.

    python3 benches/record_section.py SECTION.md

The section replaces the one with the same heading and leaves every other section as it is;
a new one goes at the end, after the marker below which compare.sh's merge.py keeps the
sections other scripts write (rxe_compare.sh, ps_bench.sh, tbf_wire.sh).
"""
import os
import sys

PATH = "docs/benchmarks.md"
KEEP = "<!-- Sections below are written by other scripts (benches/rxe_compare.sh --record); merge.py keeps them. -->"


def record(section, chart=None):
    """Writes `section` (markdown starting with its "## " heading) into the report, and
    `chart` (path, SVG text), if given, beside it."""
    section = section.strip("\n") + "\n"
    head = section.splitlines()[0]
    if not head.startswith("## "):
        sys.exit(f"record_section: the section does not start with a '## ' heading: {head!r}")
    if chart is not None:
        os.makedirs(os.path.dirname(chart[0]), exist_ok=True)
        with open(chart[0], "w") as f:
            f.write(chart[1])
    text = open(PATH).read()
    if KEEP not in text:
        text = text.rstrip("\n") + "\n\n" + KEEP + "\n"
    if head + "\n" in text:
        start = text.index(head + "\n")
        end = text.find("\n## ", start + len(head))
        rest = text[end + 1 :] if end >= 0 else ""
        text = text[:start].rstrip("\n") + "\n\n" + section + ("\n" + rest if rest else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    open(PATH, "w").write(text)
    print(f"recorded in {PATH}: {head[3:]}", file=sys.stderr)


if __name__ == "__main__":
    record(open(sys.argv[1]).read())
