"""``Guard`` in a plain DDP loop and in a Fabric DDP loop, 2 CPU processes on gloo: a fault on rank 1 only, or a
learning rate too high for the data of each rank, leads to the same decision on both ranks, and the replicas stay
identical."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

pytestmark = [pytest.mark.ddp, pytest.mark.timeout(180)]

STEPS = 12
DIVERGING_STEPS = 200


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _digest(module: nn.Module) -> str:
    """The parameters' bytes (BatchNorm's running statistics are each rank's own under DDP: not compared)."""
    params = [p.detach().cpu().numpy().tobytes() for p in module.parameters()]
    return hashlib.sha256(b"".join(params)).hexdigest()


def _worker(rank: int, port: int, directory: str, scenario: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    report: dict[str, Any] = {"rank": rank, "error": None}
    try:
        from lightning_overflow import Guard, default_callbacks
        from lightning_overflow.testing import regression_data

        torch.manual_seed(0)
        diverging = scenario.startswith("diverging")  # "diverging_bare": the same loop without the guard
        norm = nn.Identity() if diverging else nn.BatchNorm1d(32)
        module = nn.Sequential(nn.Linear(4, 32), norm, nn.Tanh(), nn.Linear(32, 1))
        model = DistributedDataParallel(module)
        x, y = regression_data(n_samples=64).tensors
        x, y = x[rank::2], y[rank::2]  # each rank its own half of the data
        scheduler = None
        if diverging:  # SGD at 10x the rate that trains, warmed up over 100 steps
            optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
            scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 0.05, total_iters=100)
            callbacks = default_callbacks(lr_factor=0.5)
        elif scenario.startswith("zero"):  # each rank holds its part of the state; Rollback refuses that
            from torch.distributed.optim import ZeroRedundancyOptimizer

            optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
            callbacks = default_callbacks(rollback=False)
        else:
            optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
            callbacks = default_callbacks(snapshot_every_n_steps=4)
        plateau = scenario.startswith("plateau")  # ReduceLROnPlateau, stepped every 4 steps on each rank's own value
        clipped = scenario == "nan_loss_clipped"  # the loop's own clipping, at a norm every step reaches
        if plateau:
            scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
        raising = scenario.startswith("raises")  # loss_fn raises on a NaN batch: after the forward pass, or in it
        runs_steps = scenario == "diverging_steps" or raising  # the guard runs each step: trials beside the loop
        if raising:
            module = nn.Sequential(_FiniteInput(scenario == "raises_in_forward"), nn.Linear(4, 32), nn.Tanh(),
                                   nn.Linear(32, 1))  # fmt: skip
            model = DistributedDataParallel(module)
            optimizer = torch.optim.Adam(model.parameters(), lr=0.01)

        def loss_fn(net: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            output = net(batch[0])
            if raising:  # a likelihood that checks its arguments, as torch.distributions does
                torch.distributions.Normal(output, 1.0, validate_args=True)
            return nn.functional.mse_loss(output, batch[1])

        scaler = torch.amp.GradScaler("cpu") if scenario.endswith("_scaled") else None
        guard = None if scenario == "diverging_bare" else Guard(model, optimizer, scheduler, callbacks=callbacks,
                                                                 default_root_dir=directory,
                                                                 loss_fn=loss_fn if runs_steps else None,
                                                                 scheduler_interval="epoch" if plateau else "step",
                                                                 gradient_clip_val=0.05 if clipped else None,
                                                                 scaler=scaler,
                                                                 )  # fmt: skip
        outcomes, snapshots, lrs = [], {}, []
        for step in range(DIVERGING_STEPS if diverging else STEPS):
            snapshots[step] = _digest(module)
            if scenario == "nan_weight" and step == 6 and rank == 1:
                with torch.no_grad():
                    module[0].weight.view(-1)[0] = float("nan")
            batch = slice((step % 4) * 8, (step % 4) * 8 + 8)
            lrs.append(optimizer.param_groups[0]["lr"])  # the rate this step trains with
            if guard is not None and runs_steps:
                inputs = x[batch].clone()
                if raising and step == 3 and (rank == 1 or scenario == "raises_in_forward"):
                    inputs[2, 0] = float("nan")
                outcome = guard.train_step((inputs, y[batch]))
            else:
                loss = loss_fn(model, (x[batch], y[batch]))
                if scenario == "zero_nan_state" and step == 3:  # a NaN loss on every rank: the state is looked at
                    loss = loss * float("nan")
                    if rank == 1:  # and a NaN in the moments of rank 1's first parameter, which only it holds
                        own = optimizer.optim.param_groups[0]["params"][0]  # type: ignore[attr-defined]
                        optimizer.optim.state[own]["exp_avg"].view(-1)[0] = float("nan")  # type: ignore[attr-defined]
                        report["poisoned"] = next(n for n, p in module.named_parameters() if p is own)
                if scenario in ("nan_loss", "nan_loss_clipped", "zero_nan_loss") and step == 3 and rank == 1:
                    loss = loss * float("nan")
                loss.backward()
                if scenario.startswith("nan_grad_after_reduce") and step == 3 and rank == 1:  # after DDP's reduce
                    with torch.no_grad():
                        module[3].weight.grad.view(-1)[0] = float("nan")
                if guard is None:
                    optimizer.step()
                    scheduler.step()  # type: ignore[union-attr]
                    optimizer.zero_grad()
                    continue
                outcome = guard.step(loss)
            if plateau and step % 4 == 3:  # rank 0's value falls, rank 1's rises; their mean stays at 0.5
                epoch = step // 4
                value = 1 / (epoch + 1) if rank == 0 else 1 - 1 / (epoch + 1)
                guard.end_epoch(None if scenario == "plateau_rank_0_only" and rank == 1 else value)
            if outcome.rolled_back:
                report["restored"] = _digest(module)
            outcomes.append([outcome.step, outcome.skipped, outcome.rolled_back, outcome.backed_off,
                             [e.kind for e in outcome.events]])  # fmt: skip
            if scaler is not None:
                report.setdefault("scales", []).append(scaler.get_scale())
        if guard is not None:
            guard.close()
        report.update(
            outcomes=outcomes,
            digest=_digest(module),
            snapshots=snapshots,
            global_step=guard.global_step if guard is not None else None,
            lrs=lrs,
            loss=float(nn.functional.mse_loss(model(x), y)),
            finite=all(bool(torch.isfinite(v).all()) for v in module.state_dict().values() if v.is_floating_point()),
        )
    except Exception:
        report["error"] = traceback.format_exc()
    finally:
        Path(directory, f"rank{rank}.json").write_text(json.dumps(report))
        dist.destroy_process_group()
        # No interpreter teardown in the forked worker: there the DDP reducer's destructor joins gloo's threads while
        # holding the GIL one of them waits for (a deadlock now and then, which hung the whole session at its exit).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


class _FiniteInput(nn.Module):
    """Identity; with ``check``, a forward pass that raises on a non-finite input, inside DDP's forward."""

    def __init__(self, check: bool) -> None:
        super().__init__()
        self.check = check

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.check and not torch.isfinite(x).all():
            raise ValueError("the input holds inf/NaN")
        return x


def run(tmp_path: Path, scenario: str, errors: tuple[str | None, str | None] = (None, None)) -> list[dict[str, Any]]:
    context = mp.get_context("fork")
    processes = [context.Process(target=_worker, args=(r, _free_port_once(tmp_path), str(tmp_path), scenario))
                 for r in range(2)]  # fmt: skip
    for process in processes:
        process.start()
    for process in processes:
        process.join(150)
    for process in processes:  # a worker that never ended must not outlive the test (the session would wait for it)
        if process.is_alive():
            process.kill()
            process.join()
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for report, expected in zip(reports, errors):
        if expected is None:
            assert report["error"] is None, reports
        else:
            assert report["error"] is not None and expected in report["error"], reports
    return reports


def _free_port_once(tmp_path: Path) -> int:
    """One port for both ranks of a run."""
    marker = tmp_path / "port"
    if not marker.exists():
        marker.write_text(str(_free_port()))
    return int(marker.read_text())


def test_a_nan_loss_on_rank_1_only_is_skipped_on_both_ranks(tmp_path: Path) -> None:
    reports = run(tmp_path, "nan_loss")
    assert reports[0]["outcomes"] == reports[1]["outcomes"]
    assert [o[0] for o in reports[0]["outcomes"] if o[1]] == [3]
    assert reports[0]["digest"] == reports[1]["digest"]
    assert all(r["finite"] and r["global_step"] == STEPS for r in reports)
    journal = [json.loads(line) for line in (tmp_path / "overflow_events.jsonl").read_text().splitlines()]
    assert journal[0]["kind"] == "nonfinite" and journal[0]["details"]["ranks"] == [1]


def test_a_nan_written_into_rank_1s_gradient_after_the_all_reduce_is_skipped_on_both_ranks(tmp_path: Path) -> None:
    """A rank-local write after DDP's all-reduce (a hook, a bit flip) leaves the replicas' gradients different. Each
    rank judged its own: rank 0 went ahead into the next step's all-reduce while rank 1 looked for the tensor, and
    gloo aborted the job on the mismatched collective (NCCL hangs). Every rank now judges the step by every rank's
    gradients: both skip step 3, and both name rank 1 and the tensor."""
    reports = run(tmp_path, "nan_grad_after_reduce")
    assert reports[0]["outcomes"] == reports[1]["outcomes"]
    assert [o[0] for o in reports[0]["outcomes"] if o[1]] == [3]
    assert reports[0]["snapshots"]["4"] == reports[0]["snapshots"]["3"]  # the skipped step changed nothing
    assert reports[0]["digest"] == reports[1]["digest"]
    assert all(r["finite"] and r["global_step"] == STEPS for r in reports)
    journal = [json.loads(line) for line in (tmp_path / "overflow_events.jsonl").read_text().splitlines()]
    assert journal[0]["kind"] == "nonfinite" and journal[0]["details"]["ranks"] == [1]
    assert journal[0]["message"].startswith("NonFiniteDetector: the gradients contained inf/NaN in 3.weight (gradient "
                                            "norm nan) at step 3 (epoch 0) on rank(s) 1.")


def test_with_a_grad_scaler_a_nan_in_rank_1s_gradient_after_the_all_reduce_is_skipped_alike(tmp_path: Path) -> None:
    """Each rank's GradScaler found inf/NaN in its own gradients only: rank 1's skipped the step and halved its scale,
    rank 0's stepped, and the next all-reduce averaged gradients scaled apart. Every rank's scaler now skips the step
    and lowers its scale alike."""
    reports = run(tmp_path, "nan_grad_after_reduce_scaled")
    assert reports[0]["outcomes"] == reports[1]["outcomes"]
    assert [o[0] for o in reports[0]["outcomes"] if o[1]] == [3]
    assert reports[0]["snapshots"]["4"] == reports[0]["snapshots"]["3"]  # the skipped step changed nothing
    assert reports[0]["snapshots"] == reports[1]["snapshots"] and reports[0]["digest"] == reports[1]["digest"]
    assert reports[0]["scales"] == reports[1]["scales"] and reports[0]["scales"][3] == reports[0]["scales"][2] / 2


def test_a_zero_redundancy_optimizer_without_rollback_trains_and_skips_a_nan_loss_on_both_ranks(tmp_path: Path) -> None:
    """``Rollback`` refuses a ``ZeroRedundancyOptimizer`` and says to remove it. Without it the guard raised at its
    first weights check (step 0) on every rank: the check read ``optimizer.state_dict()``, which a ZeRO optimizer
    refuses until its parts are consolidated. The check reads each rank's own part now, and the run goes on."""
    reports = run(tmp_path, "zero_nan_loss")
    assert reports[0]["outcomes"] == reports[1]["outcomes"]
    assert [o[0] for o in reports[0]["outcomes"] if o[1]] == [3]
    assert reports[0]["digest"] == reports[1]["digest"]
    assert all(r["finite"] and r["global_step"] == STEPS for r in reports)


def test_a_nan_in_a_zero_redundancy_optimizers_part_of_the_state_is_named_by_its_parameter(tmp_path: Path) -> None:
    """Rank 1's own part of the moments: labelled by the ZeRO optimizer's numbering of every rank's parameters, the
    error named another rank's parameter (rank 0's first) for rank 1's first. Its advice was to add Rollback, which
    refuses this optimizer: it says what can bring the state back."""
    reports = run(tmp_path, "zero_nan_state", errors=("NonFiniteError", "NonFiniteError"))
    poisoned = reports[1]["poisoned"]
    assert poisoned != "0.weight"  # rank 0 holds the first parameter's moments
    for report in reports:
        assert f"the optimizer state contained inf/NaN in {poisoned}.exp_avg at step 3 (epoch 0) on rank(s) 1." in (
            report["error"])
        assert report["error"].rstrip().endswith(
            "HINT: the optimizer state (e.g. Adam's exp_avg_sq) is non-finite and poisons every later step: resume "
            "from your last checkpoint (Rollback cannot restore a ZeroRedundancyOptimizer's state; with a plain torch "
            "optimizer it can).")


def test_the_loops_own_clipping_clips_both_ranks_alike_and_a_nan_loss_on_rank_1_is_skipped_on_both(
    tmp_path: Path,
) -> None:
    (tmp_path / "clipped").mkdir()
    (tmp_path / "plain").mkdir()
    reports = run(tmp_path / "clipped", "nan_loss_clipped")
    unclipped = run(tmp_path / "plain", "nan_loss")
    assert reports[0]["outcomes"] == reports[1]["outcomes"]
    assert [o[0] for o in reports[0]["outcomes"] if o[1]] == [3]
    assert reports[0]["snapshots"]["4"] == reports[0]["snapshots"]["3"]  # nothing moved at step 3
    assert reports[0]["digest"] == reports[1]["digest"] != unclipped[0]["digest"]  # the clip changed the run
    assert all(r["finite"] and r["global_step"] == STEPS for r in reports)


def test_a_loss_fn_that_raises_on_a_nan_batch_of_rank_1_only_is_skipped_on_both_ranks(tmp_path: Path) -> None:
    """The likelihood raises on rank 1's NaN output after DDP's forward pass: rank 1 answers it with the stand-in
    loss, whose backward enters the same gradient reduction as rank 0's, and both skip step 3 with identical
    replicas."""
    reports = run(tmp_path, "raises")
    assert reports[0]["outcomes"] == reports[1]["outcomes"]
    assert [o[0] for o in reports[0]["outcomes"] if o[1]] == [3]
    assert reports[0]["digest"] == reports[1]["digest"]
    assert reports[0]["snapshots"]["4"] == reports[0]["snapshots"]["3"]  # nothing moved at step 3
    assert all(r["finite"] and r["global_step"] == STEPS for r in reports)
    journal = [json.loads(line) for line in (tmp_path / "overflow_events.jsonl").read_text().splitlines()]
    assert journal[0]["kind"] == "data_fault" and journal[0]["step"] == 3 and journal[0]["details"]["ranks"] == [1]


def test_a_forward_pass_that_raises_inside_ddp_keeps_its_error(tmp_path: Path) -> None:
    """Raised inside DDP's forward pass, the step left the reducer awaiting no backward: a stand-in's would leave
    the other rank waiting in its reduction, so the module's own error stands, on each rank whose forward raised."""
    run(tmp_path, "raises_in_forward", errors=("ValueError: the input holds inf/NaN",) * 2)


def test_a_plateau_scheduler_steps_on_the_mean_of_the_ranks_values_and_lowers_the_rate_on_both_alike(
    tmp_path: Path,
) -> None:
    """Each rank hands ``end_epoch`` its own value (one falls, one rises): alone, rank 0 would never lower its rate
    and rank 1 would at every epoch. On their mean, a plateau, both lower it at the same epochs."""
    reports = run(tmp_path, "plateau")
    assert reports[0]["lrs"] == reports[1]["lrs"]
    assert reports[0]["lrs"][::4] == [0.01, 0.01, 0.005]  # the first epoch sets the best; the second stalls at it
    assert reports[0]["digest"] == reports[1]["digest"]


def test_a_plateau_value_passed_on_rank_0_only_is_refused_on_both_ranks_alike(tmp_path: Path) -> None:
    """Rank 1 hands end_epoch no value (a validation run on rank 0 only): both ranks raise the same error after the
    one all-reduce they both enter, instead of rank 0 waiting in it for ever."""
    message = ("ValueError: guard.end_epoch() at epoch 0: the ReduceLROnPlateau scheduler steps on the value it "
               "watches: rank(s) 1 passed none: pass it as a number, guard.end_epoch(metric) on every rank (it steps "
               "on the mean over the ranks)")  # fmt: skip
    run(tmp_path, "plateau_rank_0_only", errors=(message, message))


def test_a_nan_weight_on_rank_1_only_rolls_both_ranks_back_to_the_same_snapshot(tmp_path: Path) -> None:
    reports = run(tmp_path, "nan_weight")
    assert reports[0]["outcomes"] == reports[1]["outcomes"]
    rolled = [o[0] for o in reports[0]["outcomes"] if o[2]]
    assert rolled == [6]
    assert reports[0]["restored"] == reports[1]["restored"] == reports[0]["snapshots"]["4"]  # the snapshot of step 4
    assert reports[0]["digest"] == reports[1]["digest"]
    assert all(r["finite"] for r in reports)


def test_a_learning_rate_too_high_for_the_data_of_both_ranks_is_backed_off_on_both_at_the_same_step(
    tmp_path: Path,
) -> None:
    """Each rank trains on its own half of the data, so each sees its own losses; the decision rests on what both
    saw. Guarded, the level of the loss settles far above its best at step 161 on both ranks: both back off and roll
    back there, then train at exactly half the unprotected loop's rate, with identical replicas, and each rank ends
    with less than half the loss it ends with bare (2x and 6x)."""
    (tmp_path / "bare").mkdir()
    (tmp_path / "guarded").mkdir()
    bare = run(tmp_path / "bare", "diverging_bare")
    reports = run(tmp_path / "guarded", "diverging")
    assert reports[0]["outcomes"] == reports[1]["outcomes"] and reports[0]["digest"] == reports[1]["digest"]
    acted = [(o[0], o[2], o[3], o[4]) for o in reports[0]["outcomes"] if o[4]]
    assert acted == [(161, True, True, ["loss_divergence", "backoff", "rollback"])]
    assert reports[0]["lrs"] == reports[1]["lrs"] == bare[0]["lrs"][:162] + [0.5 * lr for lr in bare[0]["lrs"][162:]]
    assert all(r["finite"] and r["loss"] < 0.05 for r in reports)
    assert [b["loss"] > 2 * r["loss"] for b, r in zip(bare, reports)] == [True, True]


def test_a_guard_that_runs_each_step_tries_the_suspicion_on_both_ranks_alike(tmp_path: Path) -> None:
    """With ``loss_fn`` the guard runs each step, and a trial's candidate trains beside the DDP loop on each rank's
    batch (on the module without the DDP wrapper, its gradients averaged across the ranks): the suspicion at step 161
    is tried instead of answered at once, the remedy kept where it does better, on both ranks at the same step."""
    reports = run(tmp_path, "diverging_steps")
    assert reports[0]["outcomes"] == reports[1]["outcomes"] and reports[0]["digest"] == reports[1]["digest"]
    kinds = [kind for o in reports[0]["outcomes"] for kind in o[4]]
    assert "trial" in kinds and kinds.index("loss_divergence") < kinds.index("trial")
    assert reports[0]["lrs"] == reports[1]["lrs"]
    assert all(r["finite"] and r["loss"] < 0.05 for r in reports)


def test_a_fabric_ddp_loop_makes_the_same_decisions_on_both_ranks(tmp_path: Path) -> None:
    """Under Fabric's DDP strategy (2 processes, a script Fabric relaunches for rank 1): rank 1's NaN loss at step 3
    is skipped on both ranks, its NaN weight at step 6 rolls both back; the replicas end identical and finite."""
    script = Path(__file__).parent / "scripts" / "fabric_ddp_guard.py"
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert reports[0]["outcomes"] == reports[1]["outcomes"]
    acted = [(o[0], o[1], o[2], o[3]) for o in reports[0]["outcomes"] if o[3]]
    assert acted == [(3, True, False, ["nonfinite", "skip"]), (6, False, True, ["nonfinite", "backoff", "rollback"])]
    assert reports[0]["digest"] == reports[1]["digest"] and all(r["finite"] for r in reports)


def test_a_fabric_ddp_loop_whose_loss_fn_raises_on_rank_1_skips_the_step_on_both_ranks(tmp_path: Path) -> None:
    """Under Fabric's DDP strategy the guard runs each step (``train_step`` with ``fabric.backward``): the loss
    function raises on rank 1's NaN batch at step 3, after the forward pass; both ranks skip that step alike."""
    script = Path(__file__).parent / "scripts" / "fabric_ddp_guard.py"
    done = subprocess.run([sys.executable, str(script), str(tmp_path), "raises"], capture_output=True, text=True,
                          timeout=150)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert reports[0]["outcomes"] == reports[1]["outcomes"]
    acted = [(o[0], o[1], o[2], o[3]) for o in reports[0]["outcomes"] if o[3]]
    assert acted == [(3, True, False, ["data_fault", "skip"])]
    assert reports[0]["digest"] == reports[1]["digest"] and all(r["finite"] for r in reports)
