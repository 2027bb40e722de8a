#!/usr/bin/env python3
"""Checks a --trace file against the Chrome trace-event format (the JSON object
form: {"traceEvents": [...]}, complete events "X" with ts/dur in microseconds,
metadata events "M" naming processes and threads), and tandem's promises:

  - every rank's track is named ("rank R (device)"), every process too;
  - the spans data, forward, backward, optimizer and "all_reduce bucket" (with
    args.bytes > 0) appear on every rank, once per traced step;
  - each bucket all-reduce starts inside its step's backward span (launched by
    backward's hook, so it overlaps backward), and spans of a track do not go
    back in time.

    python3 tests/apps/check_trace.py FILE RANKS PROCESSES STEPS
Prints "ok: ..." and exits 0, or prints the first violation and exits 1.
"""
import json
import sys


def fail(message):
    print(f"check_trace: {message}")
    sys.exit(1)


def main(path, ranks, processes, steps):
    with open(path) as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        fail("not a JSON object with a traceEvents array")
    spans = {}
    thread_names, process_names = {}, {}
    for e in doc["traceEvents"]:
        if not isinstance(e.get("name"), str) or e.get("ph") not in ("X", "M"):
            fail(f"event without a name or with an unexpected phase: {e}")
        if not isinstance(e.get("pid"), int):
            fail(f"event without an integer pid: {e}")
        if e["ph"] == "M":
            if e["name"] == "process_name":
                process_names[e["pid"]] = e["args"]["name"]
            elif e["name"] == "thread_name":
                thread_names[e["tid"]] = e["args"]["name"]
            continue
        if not isinstance(e.get("tid"), int):
            fail(f"complete event without an integer tid: {e}")
        for key in ("ts", "dur"):
            if not isinstance(e.get(key), (int, float)) or e[key] < 0:
                fail(f"complete event with a bad {key}: {e}")
        spans.setdefault(e["tid"], []).append(e)
    # Device tracks of CUDA ranks (tid 1000000 + rank) come on top of the rank tracks.
    thread_names = {t: n for t, n in thread_names.items() if t < 1000000}
    if sorted(thread_names) != list(range(ranks)):
        fail(f"named tracks {sorted(thread_names)}, expected ranks 0..{ranks - 1}")
    if len(process_names) != processes:
        fail(f"{len(process_names)} named processes, expected {processes}: {process_names}")
    for rank in range(ranks):
        events = sorted(spans.get(rank, []), key=lambda e: e["ts"])
        counts = {}
        for e in events:
            counts[e["name"]] = counts.get(e["name"], 0) + 1
        for name in ("data", "forward", "backward", "optimizer", "all_reduce bucket"):
            if counts.get(name, 0) < steps:
                fail(f"rank {rank}: {counts.get(name, 0)} '{name}' spans, expected >= {steps}")
        backwards = [e for e in events if e["name"] == "backward"]
        for e in events:
            if e["name"] != "all_reduce bucket":
                continue
            if not e.get("args", {}).get("bytes", 0) > 0:
                fail(f"rank {rank}: bucket span without bytes: {e}")
            inside = [b for b in backwards if b["ts"] <= e["ts"] <= b["ts"] + b["dur"]]
            if not inside:
                fail(f"rank {rank}: bucket all-reduce at {e['ts']} starts outside every backward span")
    print(f"ok: {ranks} rank tracks, {processes} process(es), "
          f"{sum(len(v) for v in spans.values())} spans")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
