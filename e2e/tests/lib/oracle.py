#!/usr/bin/env python3
"""The exactly-once oracle on a file sink's committed output.

usage: oracle.py OUT_DIR EVENTS

Committed files are those whose names do not start with "." (in-progress
files are hidden until their checkpoint completes). Every event seq must
appear exactly once, and each key's counts must be exactly 1..n: a record
lost or committed twice, or state restored wrong, breaks one of the two.
"""
import json
import os
import sys

out, events = sys.argv[1], int(sys.argv[2])
seqs, counts, dup = set(), {}, []
files = [n for n in os.listdir(out) if not n.startswith(".")]
for name in files:
    with open(os.path.join(out, name)) as f:
        for line in f:
            r = json.loads(line)
            if r["seq"] in seqs:
                dup.append(r["seq"])
            seqs.add(r["seq"])
            counts.setdefault(r["key"], []).append(r["count"])
errors = []
if dup:
    errors.append(f"{len(dup)} events committed twice, e.g. seq {dup[:5]}")
if len(seqs) != events:
    missing = [s for s in range(events) if s not in seqs][:5]
    errors.append(f"{len(seqs)} distinct events committed, expected {events}; missing e.g. {missing}")
bad = [k for k, c in counts.items() if sorted(c) != list(range(1, len(c) + 1))]
if bad:
    errors.append(f"{len(bad)} keys whose counts are not 1..n, e.g. key {bad[0]}: {sorted(counts[bad[0]])[:10]}")
if errors:
    print("exactly-once violated: " + "; ".join(errors), file=sys.stderr)
    sys.exit(1)
print(f"exactly once: {len(seqs)} events over {len(counts)} keys in {len(files)} committed files")
