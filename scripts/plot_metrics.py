#!/usr/bin/env python3
"""Draws a training run's curves from its --metrics file into a PNG.

    python3 scripts/plot_metrics.py run.csv run.png [--title "train_mnist, 2 CPU ranks"]
    python3 scripts/plot_metrics.py a.csv b.jsonl both.png     # several runs, one line each

Reads the CSV (dataset,epoch,step,loss,accuracy,samples_per_s,wall_s[,lr]) or JSON
lines the programs write with --metrics (one row per epoch: the loss is the mean
over every rank, so there is one curve per run, not per rank) and draws three
panels against the global step: training loss, test accuracy, learning rate
(when the file has it). Rows of an appended --resume run continue the same
curve. Needs matplotlib (Debian: python3-matplotlib); exit status 2 with one line
on a bad file.
"""
import argparse
import csv
import json
import os
import sys


def read_rows(path):
    rows = []
    with open(path) as f:
        if path.endswith(".jsonl"):
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}:{n}: not JSON: {e}") from e
        else:
            for row in csv.DictReader(f):
                if row.get("dataset") == "dataset":  # the header again, after an append
                    continue
                rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no rows")
    out = []
    for n, row in enumerate(rows, 1):
        try:
            out.append({"step": int(row["step"]), "loss": float(row["loss"]),
                        "accuracy": float(row["accuracy"]),
                        "lr": float(row["lr"]) if row.get("lr") not in (None, "") else None})
        except (KeyError, ValueError) as e:
            raise ValueError(f"{path}: row {n}: {e!r} (is it a --metrics file?)") from e
    out.sort(key=lambda r: r["step"])
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("inputs", nargs="+", help="metrics files, then the PNG to write")
    parser.add_argument("--title", default="")
    args = parser.parse_args()
    if len(args.inputs) < 2 or not args.inputs[-1].endswith(".png"):
        print("plot_metrics: give one or more metrics files and then the .png to write",
              file=sys.stderr)
        return 2
    *paths, png = args.inputs
    try:
        runs = [(os.path.basename(p), read_rows(p)) for p in paths]
    except (OSError, ValueError) as e:
        print(f"plot_metrics: {e}", file=sys.stderr)
        return 2
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    has_lr = any(r["lr"] is not None for _, rows in runs for r in rows)
    panels = 3 if has_lr else 2
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.4))
    for name, rows in runs:
        steps = [r["step"] for r in rows]
        axes[0].plot(steps, [r["loss"] for r in rows], marker="o", label=name)
        axes[1].plot(steps, [100 * r["accuracy"] for r in rows], marker="o", label=name)
        if has_lr:
            axes[2].plot(steps, [r["lr"] for r in rows], marker="o", label=name)
    titles = ["training loss (mean over ranks)", "test accuracy (%)", "learning rate (epoch end)"]
    for ax, title in zip(axes, titles):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("global step")
        ax.grid(alpha=0.3)
    if len(runs) > 1:
        axes[0].legend(fontsize=8)
    if args.title:
        fig.suptitle(args.title, fontsize=11)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"plot_metrics: wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
