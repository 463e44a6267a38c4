"""The real-client lane: real Lightning-based libraries, their own models and loops, bare vs ``default_callbacks()``.

    benchmarks/clients/install.sh                 # once: the separate venv .venv-clients (see docs/clients.md)
    .venv-clients/bin/python benchmarks/clients/run.py [--quick] [--only LIB] [--no-docs]

Per library: a healthy run bare (twice) and with the suite (weights compared bit for bit), a checkpoint + resume,
and faults a user of that library meets, each bare, with the user's gradient clipping, and with the suite. Prints
one markdown table per library and a summary, writes the same to docs/clients.md, and exits 1 only when a
must-hold check fails (see ``CHECKS`` below). Nothing is downloaded: data is shipped by the library or synthesised.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import tv_shim  # noqa: E402  (before anything imports torchvision: lightly, torchmetrics)

tv_shim.install()

from common import Row, max_abs_diff, quiet, run_row, seed  # noqa: E402

PREFACE = """\
Real Lightning-based libraries from PyPI (pinned in `benchmarks/clients/install.sh`), with their own models, data
and training loops; nothing is downloaded at run time. Each row is one fit: `bare`, `clip` (the user's
`gradient_clip_val`), `suite` (`callbacks=default_callbacks()`), `clip+suite` (both). "x bare" is the metric over
the bare row's of the same case; "wall x bare" likewise for wall time (noisy on a shared machine: rows of a few
seconds; the first row of a library pays its warm-up). The faults are written at an exact place in the data, or
are a setting a user gets wrong. The console of every row and the tracebacks go to a scratch `console.log`.

torchvision: lightly imports it at module level, but PyPI's Linux torchvision wheels are CUDA builds whose compiled
ops cannot load beside the CPU torch (`import torchvision` raises `RuntimeError: operator torchvision::nms does not
exist`; torchmetrics, hence Lightning, then fails to import too in that venv). `benchmarks/clients/tv_shim.py`
defines the two operator schemas torchvision's import registers fake kernels for (no kernels), before anything
imports torchvision; its pure-Python modules then work, and no compiled torchvision op is called by the lane. This
is why the lane has its own venv (`.venv-clients`), and why anything run there must `import tv_shim` first.
"""
LIBS = ("neuralforecast", "pytorch_forecasting", "lightly")
TOLERANCE = 1.5  # the suite may not end a run more than this times worse than bare (when bare ended finite)
CHECKS = """\
Must hold (exit 1 otherwise):
1. healthy: the suite's final weights equal bare's bit for bit, unless bare itself is not reproducible (two bare
   runs differ) or the suite's fit summary reports what it did (then the difference is shown, explained);
2. resume: a checkpoint is written and the run resumes (or loads) to the same result, with the suite;
3. no row with the suite ends worse than the same row without it (bare; for `clip+suite`, the user's clipped row)
   by more than 1.5x the metric, when that reference row finished with a finite metric;
4. the suite never crashes: no exception other than its deliberate `DivergenceError` out of a suite row unless the
   reference row raised the same exception type without the suite.
Should hold (reported, not fatal): the user's module sees each training step once (neuralforecast's
`train_trajectories` has the same length with and without the suite); a suite row ends no worse than its reference
at all."""


def _module(lib: str):
    import importlib

    return importlib.import_module(f"lib_{lib}")


def fmt(x: float | None, nd: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isnan(x):
        return "nan"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return f"{x:.{nd}g}"


def ref_of(mode: str) -> str:
    return "clip" if mode == "clip+suite" else "bare"


def judge(row: Row, ref: Row | None) -> list[str]:
    """Must-hold failures of a suite row against its reference row."""
    bad = []
    if row.exc_type and row.exc_type != "DivergenceError":
        same_as_ref = ref is not None and ref.exc_type == row.exc_type
        if row.exc_in_suite or not same_as_ref:
            bad.append(f"suite crash: {row.exc_type}: {row.exc_text}")
    if ref is not None and ref.ok:
        if not row.ok:
            bad.append(f"ended `{row.ended}` where {ref.mode} finished with metric {fmt(ref.metric)}")
        elif row.metric > TOLERANCE * ref.metric + 1e-12:
            bad.append(f"metric {fmt(row.metric)} > {TOLERANCE}x {ref.mode}'s {fmt(ref.metric)}")
    return bad


def run_lib(lib: str, quick: bool, workdir: str, log_path: str) -> dict:
    mod = _module(lib)
    steps = mod.STEPS["quick" if quick else "full"]
    rows: list[Row] = []
    fails: list[str] = []
    notes: list[str] = []

    def go(case: str, mode: str) -> Row:
        seed(0)
        r = run_row(lib, case, mode, lambda: mod.train(case, mode, steps, workdir), log_path)
        print(f"  [{lib}] {case:>14} / {mode:<10} {r.ended:<32} metric {fmt(r.metric):>9}  {r.wall:6.1f}s",
              flush=True)
        rows.append(r)
        return r

    # 1. healthy: bare twice (is the library itself reproducible?) and the suite
    healthy_cases = getattr(mod, "HEALTHY", ("healthy",))
    verdicts = []
    for hc in healthy_cases:
        b1, b2, s = go(hc, "bare"), go(hc, "bare"), go(hc, "suite")
        bare_repro = max_abs_diff(b1.weights, b2.weights)
        d = max_abs_diff(b1.weights, s.weights)
        if d == 0.0:
            v = "bit-identical"
        elif d is None:
            v = f"no weights to compare (bare: {b1.ended}; suite: {s.ended})"
            fails.append(f"{hc}: {v}")
        elif bare_repro not in (0.0, None):
            v = (f"differs by {fmt(d)}; explained: bare is not reproducible itself (two bare runs differ by "
                 f"{fmt(bare_repro)})")
        elif s.summary:
            v = f"differs by max |dw| {fmt(d)}; the suite reports acting (its summary)"
            notes.append(f"{hc}: the suite changed a healthy run (max |dw| {fmt(d)}), by its own account")
        else:
            v = f"differs by max |dw| {fmt(d)} and the suite reports nothing: unexplained"
            fails.append(f"{hc}: {v}")
        fails += [f"{hc}/suite: {m}" for m in judge(s, b1)]
        verdicts.append(v if len(healthy_cases) == 1 else f"{hc}: {v}")
    healthy = "; ".join(verdicts)

    # 2. checkpoint and resume, bare and with the suite
    resume = {}
    for mode in ("bare", "suite"):
        holder: dict = {}

        def fn(mode=mode, holder=holder):
            out, detail = mod.resume(mode, steps, workdir)
            holder["detail"] = detail
            return out

        seed(0)
        r = run_row(lib, "resume", mode, fn, log_path)
        ok = r.exc_type is None and bool(r.extra.get("resume_ok"))
        detail = holder.get("detail") or f"{r.ended}: {r.exc_text}"
        if mode == "suite" and "bare" in resume and r.exc_type is None:
            vs_bare = max_abs_diff(resume["bare"][2].weights, r.weights)
            detail += "; suite vs bare, both resumed: " + ("bit-identical" if vs_bare == 0.0 else
                                                            f"max |dw| {fmt(vs_bare)}")
            ok = ok or (vs_bare == 0.0 and math.isfinite(r.metric))  # whatever resuming does, the suite changed nothing
        resume[mode] = (ok, detail, r)
        print(f"  [{lib}] {'resume':>14} / {mode:<10} {'works' if ok else 'FAILS'}: {detail}", flush=True)
        if mode == "suite" and not ok:
            fails.append(f"resume with the suite: {detail}")

    # 3. faults: bare, the user's clipping, the suite; plus library-specific extra rows
    plan = [(c, m) for c in mod.CASES if c not in healthy_cases for m in ("bare", "clip", "suite")]
    plan += list(getattr(mod, "EXTRA_ROWS", []))
    for case, mode in plan:
        r = go(case, mode)
        if "suite" in mode:
            ref = next((x for x in rows if x.case == case and x.mode == ref_of(mode)), None)
            fails += [f"{case}/{mode}: {m}" for m in judge(r, ref)]
            if ref is not None and ref.ok and r.ok and r.metric > ref.metric * (1 + 1e-6):
                notes.append(f"should-hold FAILED ({case}/{mode}): ended worse than {ref.mode} "
                             f"({fmt(r.metric)} vs {fmt(ref.metric)}, x{r.metric / ref.metric:.3g}; within the "
                             f"{TOLERANCE}x must-hold tolerance)")
    for r in rows:  # should hold: the user's training_step runs once per step with the suite too
        ref = next((x for x in rows if x.case == r.case and x.mode == ref_of(r.mode)), None)
        if "suite" in r.mode and ref is not None and "train_trajectories" in r.extra and ref.ok and r.ok:
            tb, ts = ref.extra["train_trajectories"], r.extra["train_trajectories"]
            if tb != ts:
                notes.append(f"should-hold FAILED ({r.case}/{r.mode}): train_trajectories has {ts} entries with "
                             f"the suite vs {tb} in {ref.mode} (the user's training_step ran {ts - tb} extra times)")
    return {"lib": lib, "mod": mod, "rows": rows, "healthy": healthy, "resume": resume, "fails": fails,
            "notes": notes, "steps": steps}


def render(res: dict) -> str:
    lib, mod, rows = res["lib"], res["mod"], res["rows"]
    out = [f"### {lib}", "", mod.__doc__.strip(), "", f"Metric: {mod.METRIC}. Training length: {mod.LENGTH(res['steps'])}. "
           f"`clip` = `gradient_clip_val={mod.CLIP}`.", ""]
    out.append("| case | mode | how it ended | metric | x bare | wall s | wall x bare | extra | suite summary |")
    out.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    refs: list[str] = []
    for r in rows:
        bares = [x for x in rows if x.case == r.case and x.mode == "bare"]
        base = min(bares, key=lambda x: x.wall) if bares else None  # the fastest bare: the first pays the warm-up
        ratio = r.metric / base.metric if base and base.ok and r.ok and base.metric else None
        wall_ratio = r.wall / base.wall if base and base is not r and base.wall > 0 else None
        ended = r.ended if not r.exc_type else f"raised `{r.exc_type}: {r.exc_text[:110]}`"
        ended = ended.replace("|", "\\|")
        extra = ", ".join(f"{k}={v}" for k, v in r.extra.items() if k != "resume_ok")
        if r.summary:
            refs.append(r.summary)
            said = f"[{len(refs)}]"
        else:
            said = "-" if "suite" in r.mode else ""
        out.append(f"| {r.case} | {r.mode} | {ended} | {fmt(r.metric)} | {fmt(ratio, 3)} | {r.wall:.1f} | "
                   f"{fmt(wall_ratio, 3)} | {extra} | {said} |")
    out.append("")
    for i, lines in enumerate(refs, 1):
        out.append(f"[{i}]")
        out.append("```")
        out += [ln for block in lines for ln in block.splitlines()]
        out.append("```")
    out.append("")
    out.append(f"- healthy, bare vs suite: {res['healthy']}")
    for mode, (ok, detail, _) in res["resume"].items():
        out.append(f"- checkpoint/resume ({mode}): {'works' if ok else 'FAILS'}: {detail}")
    for n in res["notes"]:
        out.append(f"- note: {n}")
    for f in res["fails"]:
        out.append(f"- **MUST-HOLD FAILED**: {f}")
    out.append("")
    return "\n".join(out)


def environment() -> str:
    import importlib.metadata as md

    import torch

    import subprocess

    import lightning_overflow

    src = os.path.dirname(os.path.dirname(os.path.abspath(lightning_overflow.__file__)))
    try:
        rev = subprocess.run(["git", "-C", src, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", src, "status", "--porcelain", "--", "lightning_overflow"],
                               capture_output=True, text=True).stdout.strip()
        rev += " + uncommitted changes" if dirty else ""
    except Exception:  # noqa: BLE001
        rev = "unknown commit"
    vers = f"lightning_overflow from {src} at {rev}, " + ", ".join(f"{p} {md.version(p)}" for p in ("torch", "pytorch-lightning", "lightning", "neuralforecast",
                                                      "pytorch-forecasting", "lightly", "torchvision"))
    return (f"{platform.machine()}, {os.cpu_count()} CPUs ({platform.processor() or platform.platform()}), "
            f"Python {platform.python_version()}, {vers}; torch threads {torch.get_num_threads()}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="shorter runs (a smoke test)")
    ap.add_argument("--only", choices=LIBS, action="append", help="run only this library (repeatable)")
    ap.add_argument("--docs", default=os.path.join(HERE, "..", "..", "docs", "clients.md"),
                    help="where to write the markdown report")
    ap.add_argument("--no-docs", action="store_true", help="do not write docs/clients.md")
    args = ap.parse_args()
    quiet()
    libs = args.only or list(LIBS)
    t0 = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix="lo_clients_")
    log_path = os.path.join(workdir, "console.log")
    args.docs = os.path.abspath(args.docs)
    os.chdir(workdir)  # journals, checkpoints and lightning_logs land in the scratch dir, not in the repository
    print(f"real-client lane: {', '.join(libs)}{' (quick)' if args.quick else ''}; console of each run: {log_path}")
    results = []
    for lib in libs:
        tl = time.perf_counter()
        try:
            res = run_lib(lib, args.quick, workdir, log_path)
        except Exception as e:  # noqa: BLE001  (the lane's own setup failing for a library, e.g. an import)
            res = {"lib": lib, "error": f"{type(e).__name__}: {e}"}
        res["wall"] = time.perf_counter() - tl
        results.append(res)
    total = time.perf_counter() - t0

    parts = [f"# Real-client lane\n\nGenerated by `benchmarks/clients/run.py` on "
             f"{datetime.date.today().isoformat()}. Reproduce:\n\n```bash\nbenchmarks/clients/install.sh   # the "
             f"separate venv .venv-clients\n.venv-clients/bin/python benchmarks/clients/run.py"
             f"{' --quick' if args.quick else ''}{''.join(f' --only {l}' for l in args.only or [])}\n```\n",
             f"Machine: {environment()}.\n", PREFACE, CHECKS + "\n", "## Results\n"]
    summary = ["## Summary", "", "| library | wall s | healthy bare vs suite | resume (suite) | must-hold failures |",
               "| --- | --- | --- | --- | --- |"]
    n_fail = 0
    for res in results:
        if "error" in res:
            parts.append(f"### {res['lib']}\n\nthe lane could not run it: `{res['error']}`\n")
            summary.append(f"| {res['lib']} | {res['wall']:.0f} | - | - | lane error: {res['error'][:100]} |")
            n_fail += 1
            continue
        parts.append(render(res))
        ok, detail, _ = res["resume"]["suite"]
        n_fail += len(res["fails"])
        summary.append(f"| {res['lib']} | {res['wall']:.0f} | {res['healthy'][:60].replace('|', '/')} | "
                       f"{'works' if ok else 'FAILS'} | {len(res['fails'])} |")
    summary += ["", f"Lane wall time: {total:.0f} s. Must-hold failures: {n_fail}."]
    for res in results:
        for f in res.get("fails", []):
            summary.append(f"- {res['lib']}: {f}")
        for n in res.get("notes", []):
            summary.append(f"- {res['lib']} (note): {n}")
    text = "\n".join(parts + summary) + "\n"
    print("\n" + text)
    if not args.no_docs:
        with open(args.docs, "w") as f:
            f.write(text)
        print(f"written to {args.docs}")
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
