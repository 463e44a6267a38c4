"""Command line: ``python -m lightning_overflow demo`` (the main job) and ``... report RUN_DIR`` (the dashboard)."""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    import torch

    from lightning_overflow.demo.run import run_demo

    torch.set_flush_denormal(True)  # denormals make CPU steps several times slower; a process-wide setting
    run_demo(steps=args.steps, seed=args.seed, out=Path(args.out), accelerator=args.accelerator, lr=args.lr)
    return 0


def _report(args: argparse.Namespace) -> int:
    from lightning_overflow.report import ReportError, load_run, render, summarise

    try:
        runs = [load_run(path) for path in args.run_dirs]
    except ReportError as err:
        print(f"report: {err}", file=sys.stderr)
        return 2
    for run in runs:
        print(summarise(run))
    out = Path(args.out) if args.out else Path(args.run_dirs[0]) / "overflow_dashboard.png"
    print(f"dashboard: {render(runs, out)}")
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int >= 1 (got {text!r})") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1 (got {value})")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-overflow", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a diverging model bare and with the suite; print the comparison")
    demo.add_argument("--steps", type=_positive_int, default=500, help="optimizer steps per run (default 500)")
    demo.add_argument("--seed", type=int, default=0, help="seed of both runs (default 0)")
    demo.add_argument("--out", default="overflow_demo", help="output folder (default ./overflow_demo)")
    demo.add_argument("--accelerator", default="cpu", help="Lightning accelerator (default cpu)")
    demo.add_argument("--lr", type=float, default=None, help="learning rate (default: one that diverges bare)")
    demo.set_defaults(run=_demo)
    report = commands.add_parser("report", help="render the dashboard PNG of one or more run directories")
    report.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a logger's run folder (metrics + journal)")
    report.add_argument("--out", default=None, help="the PNG to write (default RUN_DIR/overflow_dashboard.png)")
    report.set_defaults(run=_report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LeafSpec.*")
        return int(args.run(args))
