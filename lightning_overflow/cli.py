"""lightning_overflow's command line: the demo, the dashboard of a run, and its journal for a person.

``python -m lightning_overflow demo`` (the main job), ``... report RUN_DIR`` (the dashboard) and ``... journal
RUN_DIR`` (what happened, in words).

Every bad argument ends the command before any work with one line on stderr,
``lightning-overflow <command>: error: <what is wrong>``, and exit status 2.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

__all__ = ["ACCELERATORS", "OUT_SUFFIXES", "RUN_MARKERS", "build_parser", "main"]

ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps")
OUT_SUFFIXES = (".png", ".svg", ".pdf")
# What a Lightning fit writes into its run folder (a logger's version folder, or default_root_dir without a logger):
# a folder holding one of these is a run, journaled or not.
RUN_MARKERS = ("hparams.yaml", "metrics.csv", "events.out.tfevents.*", "checkpoints")
MAX_SEED = 2**32 - 1  # the range pl.seed_everything accepts; outside it, it picks a random seed instead


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are the one line ``prog: error: message`` (no usage block)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int >= 1 (got {text!r})") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1 (got {value})")
    return value


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int in [0, {MAX_SEED}] (got {text!r})") from None
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be an int in [0, {MAX_SEED}] (got {value})")
    return value


def _learning_rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0 (got {text!r})") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0 (got {value})")
    return value


def _accelerator(text: str) -> str:
    if text not in ACCELERATORS:
        allowed = ", ".join(repr(a) for a in ACCELERATORS)
        raise argparse.ArgumentTypeError(f"must be one of {allowed} (got {text!r})")
    import torch

    cuda = torch.cuda.is_available()
    mps = torch.backends.mps.is_available()
    # Checked here, before any model or Trainer exists, so the answer is this line and not a traceback.
    if text == "cuda" and not cuda:
        raise argparse.ArgumentTypeError("'cuda' needs a CUDA device and torch finds none; use --accelerator cpu")
    if text == "mps" and not mps:
        raise argparse.ArgumentTypeError("'mps' needs an Apple MPS device and torch finds none; use --accelerator cpu")
    if text == "gpu" and not (cuda or mps):
        raise argparse.ArgumentTypeError(
            "'gpu' needs a CUDA or Apple MPS device and torch finds none; use --accelerator cpu"
        )
    return text


def _out_file(text: str) -> Path:
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(
            f"'{path}' is a directory; name the picture to write (e.g. {path}/dashboard.png)"
        )
    if path.suffix.lower() not in OUT_SUFFIXES:
        raise argparse.ArgumentTypeError(f"must end in {', '.join(OUT_SUFFIXES)} (got '{path}')")
    parent = path.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"the folder '{parent}' does not exist (got '{path}'); create it first")
    return path


def _out_folder(text: str) -> Path:
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"'{path}' is a file; the demo writes its runs into a folder")
    return path


def _labels(text: str) -> list[str]:
    labels = [label.strip() for label in text.split(",")]
    if not all(labels):
        raise argparse.ArgumentTypeError(f"must be comma-separated non-empty names (got {text!r})")
    return labels


def _demo(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import torch

    from lightning_overflow.demo.run import run_demo

    torch.set_flush_denormal(True)  # denormals make CPU steps several times slower; a process-wide setting
    run_demo(steps=args.steps, seed=args.seed, out=args.out, accelerator=args.accelerator, lr=args.lr)
    return 0


def _run_dirs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[Path], list[str | None]]:
    """The run directories and their labels: from ``NAME=DIR`` or ``--labels``, else ``None``."""
    paths: list[Path] = []
    named: list[str | None] = []
    for text in args.run_dirs:
        name, sep, folder = text.partition("=")
        if sep and not Path(text).exists():  # a folder whose own name holds '=' stays a folder
            if not name or not folder:
                parser.error(f"argument RUN_DIR: NAME=DIR needs both a name and a folder (got {text!r})")
            paths.append(Path(folder))
            named.append(name)
        else:
            paths.append(Path(text))
            named.append(None)
    if args.labels is not None:
        if any(n is not None for n in named):
            parser.error("argument --labels: give each run's label once, either as NAME=DIR or in --labels")
        if len(args.labels) != len(paths):
            parser.error(f"argument --labels: {len(args.labels)} label(s) for {len(paths)} run directories")
        return paths, args.labels
    return paths, named


def _report(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from lightning_overflow.report import (
        ReportError,
        default_labels,
        load_run,
        render,
        run_outcome,
        sparse_logging_warning,
        summarise,
    )
    from lightning_overflow.report.runs import INSTALL_PLOT

    try:
        import matplotlib.figure  # noqa: F401  (render draws with it: checked before any run is read)
    except ImportError as err:
        parser.error(f"drawing the dashboard needs matplotlib, which cannot be imported ({err}): {INSTALL_PLOT}")
    paths, named = _run_dirs(parser, args)
    try:
        runs = [load_run(p, label, loss_key=args.loss_key, val_key=args.val_key) for p, label in zip(paths, named)]
    except ReportError as err:
        parser.error(str(err))
    # Named after the folder each run was read from, which may lie below the one given.
    for run, name, label in zip(runs, named, default_labels([run.folder for run in runs])):
        run.label = name or label
    labels = [run.label for run in runs]
    if len(set(labels)) != len(labels):
        parser.error(f"two runs share a label ({', '.join(labels)}): name them with --labels or NAME=DIR")
    last_of_all = max(run.last_step for run in runs)
    for run in runs:
        print(summarise(run, run_outcome(run, last_of_all)))
        warning = sparse_logging_warning(run, last_of_all)
        if warning:
            print(f"{parser.prog}: warning: {warning}", file=sys.stderr)
    out = args.out or paths[0] / "overflow_dashboard.png"
    print(f"dashboard: {render(runs, out, title=args.title)}")
    return 0


def _run_folders(path: Path) -> list[Path]:
    """The Lightning run folders at or under ``path`` (a folder holding one of ``RUN_MARKERS``), in path order; a
    folder inside another run (TensorBoard's per-writer folders) is that run's."""
    if not path.is_dir():
        return []
    found = {
        marker.parent
        for pattern in RUN_MARKERS
        for marker in path.rglob(pattern)
        if pattern != "checkpoints" or marker.is_dir()
    }
    return sorted(folder for folder in found if folder.parent not in found)


def _journal(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import json

    from lightning_overflow.events import find_journals, read_journal
    from lightning_overflow.journal_listing import NOTHING_TO_REPORT, journal_lines

    if not args.run_dir.exists():
        parser.error(f"argument RUN_DIR: '{args.run_dir}' does not exist")
    found = find_journals(args.run_dir)
    if not found:
        # A fit writes its journal with its first event: a run folder without one is a run where nothing happened.
        clean = _run_folders(args.run_dir)
        if not clean:
            parser.error(f"argument RUN_DIR: no journal (overflow_events.jsonl) at or under '{args.run_dir}'")
        for number, folder in enumerate(clean):
            if args.json:  # no events: no JSON line; the person reading the terminal is still told why
                print(f"{parser.prog}: {folder}: {NOTHING_TO_REPORT}", file=sys.stderr)
            else:
                print(("\n" if number else "") + f"{folder}:\n{NOTHING_TO_REPORT}")
        return 0
    for number, journal in enumerate(found):
        with warnings.catch_warnings(record=True) as skipped:
            warnings.simplefilter("always")
            events = list(read_journal(journal))
        for warning in skipped[:3]:  # one line each, not Python's warning with its source line
            print(f"{parser.prog}: {warning.message}", file=sys.stderr)
        if len(skipped) > 3:
            print(f"{parser.prog}: ... and {len(skipped) - 3} more line(s) skipped", file=sys.stderr)
        if skipped and not events:
            parser.error(f"argument RUN_DIR: '{journal}' holds no event that can be read ({len(skipped)} line(s) "
                         "skipped): it is not a journal, or it was cut off while its first event was written")
        if args.json:
            for event in events:
                print(json.dumps(event))
            if not events:
                print(f"{parser.prog}: {journal}: {NOTHING_TO_REPORT}", file=sys.stderr)
            continue
        print(("\n" if number else "") + f"{journal}:")
        print("\n".join(journal_lines(events)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``lightning-overflow`` parser with its ``demo``, ``report`` and ``journal`` commands."""
    parser = _Parser(prog="lightning-overflow", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a diverging model bare and with the suite; print the comparison")
    demo.add_argument("--steps", type=_positive_int, default=500, help="optimizer steps per run (default 500)")
    demo.add_argument("--seed", type=_seed, default=0, help="seed of both runs (default 0)")
    demo.add_argument("--out", type=_out_folder, default=Path("overflow_demo"),
                      help="output folder (default ./overflow_demo)")
    demo.add_argument("--accelerator", type=_accelerator, default="cpu",
                      help=f"Lightning accelerator: {', '.join(ACCELERATORS)} (default cpu)")
    demo.add_argument("--lr", type=_learning_rate, default=None, help="learning rate (default: one that diverges bare)")
    demo.set_defaults(run=_demo, parser=demo)
    report = commands.add_parser(
        "report", help="draw the dashboard of one or more run directories",
        description="Draw the dashboard of one or more runs, overlaid, and print what happened in each.",
    )
    report.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="a logger's folder for one run (metrics.csv or TensorBoard events, and the journal); "
                             "NAME=RUN_DIR labels it NAME")
    report.add_argument("--out", type=_out_file, default=None,
                        help="the picture to write, .png/.svg/.pdf, in an existing folder "
                             "(default RUN_DIR/overflow_dashboard.png of the first run)")
    report.add_argument("--title", default=None, help="the picture's title (default: the run labels)")
    report.add_argument("--labels", type=_labels, default=None,
                        help="comma-separated run labels, one per RUN_DIR (default: each run folder's name, with "
                             "its experiment's for a version_N folder: protected/version_0)")
    report.add_argument("--loss-key", default=None, metavar="KEY",
                        help="the training loss to draw (default: train_loss, train/loss, loss, train_loss_step... "
                             "whichever the run logged; never one of the suite's keys)")
    report.add_argument("--val-key", default=None, metavar="KEY",
                        help="the validation loss to draw (default: val_loss, val/loss... whichever was logged)")
    report.set_defaults(run=_report, parser=report)
    journal = commands.add_parser(
        "journal", help="what happened in a run, from its journal, for a person",
        description="Print a run's journal: its findings in plain words, then its events grouped (what to try first).",
    )
    journal.add_argument("run_dir", type=Path, metavar="RUN_DIR",
                         help="the journal, or a folder holding one or more (a logger's run folder, lightning_logs)")
    journal.add_argument("--json", action="store_true",
                         help="print the events as JSON lines, as written (none for a run where nothing happened)")
    journal.set_defaults(run=_journal, parser=journal)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (bad arguments raise ``SystemExit(2)``)."""
    args = build_parser().parse_args(argv)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LeafSpec.*")
        try:
            return int(args.run(args.parser, args))  # the command's own parser, so errors name the command
        except BrokenPipeError:  # the reader closed the pipe (journal ... | head): stop quietly
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error as Python flushes
            return 1
