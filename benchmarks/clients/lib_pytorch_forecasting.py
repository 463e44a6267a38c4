"""pytorch-forecasting 1.8.0: NBeats and DeepAR on `pytorch_forecasting.data.examples.generate_ar_data` (synthetic,
no download).

NBeats is set up as its N-BEATS tutorial (TimeSeriesDataSet, `NBeats.from_dataset`, learning_rate 3e-2, weight_decay
1e-2, backcast_loss_ratio 0.1, `gradient_clip_val=0.01`), smaller: 12 series, context 30, horizon 10, widths [32, 128].
DeepAR (2 LSTM layers of 32, learning_rate 1e-2, the same clipping) scores a Normal likelihood from
`torch.distributions`, which raises on a NaN argument, and on a target of 1e30 its loss comes back cut from the
graph: both end a bare fit with an exception, not a NaN loss.
"""

from __future__ import annotations

import math
import os

import numpy as np

from common import Outcome, snapshot

NAME = "pytorch_forecasting"
CLIP = 0.01  # the tutorial's own value
FAULT_SERIES, FAULT_T = 3, 60  # the exact (series, time_idx) a data fault is written to
STEPS = {"quick": (2, 15), "full": (3, 30)}  # (max_epochs, limit_train_batches)
METRIC = "MAE of the 10-step forecast on the held-out last window (validation set), lower is better"
CTX, HOR = 30, 10


def LENGTH(steps) -> str:  # noqa: N802
    return f"max_epochs={steps[0]}, limit_train_batches={steps[1]}, batch_size 64"


CASES = {
    "healthy": ("clean data, lr 3e-2", None, 1.0),
    "huge 1e30": (f"value[series {FAULT_SERIES}, t {FAULT_T}] = 1e30", 1e30, 1.0),
    "FLT_MAX": (f"value[series {FAULT_SERIES}, t {FAULT_T}] = 3.4e38 (float32 max as a fill value)",
                float(np.finfo(np.float32).max), 1.0),
    "nan": (f"value[series {FAULT_SERIES}, t {FAULT_T}] = NaN (the library refuses it)", math.nan, 1.0),
    "lr 30x": ("learning_rate 0.9 instead of 3e-2", None, 30.0),
    "lr 300x": ("learning_rate 9.0 instead of 3e-2", None, 300.0),
    "DeepAR healthy": ("DeepAR, clean data, lr 1e-2", None, 1.0),
    "DeepAR 1e30": (f"DeepAR, value[series {FAULT_SERIES}, t {FAULT_T}] = 1e30", 1e30, 1.0),
    "DeepAR lr 300x": ("DeepAR, learning_rate 3.0 instead of 1e-2", None, 300.0),
}
HEALTHY = ("healthy", "DeepAR healthy")
# The user's own clipping plus the suite, on clean data and on a fault.
EXTRA_ROWS = [("healthy", "clip"), ("healthy", "clip+suite"), ("lr 30x", "clip+suite"),
              ("DeepAR lr 300x", "clip+suite")]


def _data(fault):
    import pandas as pd
    from pytorch_forecasting import TimeSeriesDataSet
    from pytorch_forecasting.data import NaNLabelEncoder
    from pytorch_forecasting.data.examples import generate_ar_data

    data = generate_ar_data(seasonality=10.0, timesteps=120, n_series=12, seed=42)
    data["static"] = 2
    data["date"] = pd.Timestamp("2020-01-01") + pd.to_timedelta(data.time_idx, "D")
    if fault is not None:
        at = (data.series == FAULT_SERIES) & (data.time_idx == FAULT_T)
        assert at.sum() == 1
        data.loc[at, "value"] = fault
    cutoff = data["time_idx"].max() - HOR
    training = TimeSeriesDataSet(
        data[lambda x: x.time_idx <= cutoff], time_idx="time_idx", target="value",
        categorical_encoders={"series": NaNLabelEncoder().fit(data.series)}, group_ids=["series"],
        time_varying_unknown_reals=["value"], max_encoder_length=CTX, max_prediction_length=HOR)
    validation = TimeSeriesDataSet.from_dataset(training, data, min_prediction_idx=cutoff + 1)
    return training, validation


def _net(training, lr, case="healthy"):
    from pytorch_forecasting import DeepAR, NBeats
    from pytorch_forecasting.metrics import NormalDistributionLoss

    if case.startswith("DeepAR"):
        return DeepAR.from_dataset(training, learning_rate=1e-2 * lr, hidden_size=32, rnn_layers=2,
                                   loss=NormalDistributionLoss())
    return NBeats.from_dataset(training, learning_rate=3e-2 * lr, weight_decay=1e-2, widths=[32, 128],
                               backcast_loss_ratio=0.1)


def _trainer(steps, callbacks, clip, **kw):
    import lightning.pytorch as pl

    return pl.Trainer(max_epochs=steps[0], limit_train_batches=steps[1], accelerator="cpu", devices=1,
                      gradient_clip_val=clip, callbacks=callbacks, enable_progress_bar=False,
                      enable_model_summary=False, logger=False, deterministic=True, **kw)


def _mae(net, validation) -> float:
    import torch

    dl = validation.to_dataloader(train=False, batch_size=64, num_workers=0)
    pred = net.predict(dl, return_y=True, trainer_kwargs=dict(accelerator="cpu", logger=False,
                                                              enable_progress_bar=False))
    y = pred.y[0] if isinstance(pred.y, (tuple, list)) else pred.y
    return float(torch.mean(torch.abs(pred.output - y)))


def _clean_validation():
    return _data(None)[1]


def train(case: str, mode: str, steps, workdir: str) -> Outcome:
    import lightning.pytorch as pl
    from lightning_overflow import default_callbacks

    _, fault, lr_mult = CASES[case]
    pl.seed_everything(42, verbose=False)
    training, validation = _data(fault)
    net = _net(training, lr_mult, case)
    cbs = default_callbacks() if "suite" in mode else []
    trainer = _trainer(steps, cbs, CLIP if "clip" in mode else None, enable_checkpointing=False)
    trainer.fit(net, train_dataloaders=training.to_dataloader(train=True, batch_size=64, num_workers=0),
                val_dataloaders=validation.to_dataloader(train=False, batch_size=64, num_workers=0))
    # score on the clean series: the fault is in training data only
    return Outcome(_mae(net, _clean_validation()), snapshot(net), {"steps": trainer.global_step})


def resume(mode: str, steps, workdir: str):
    """ModelCheckpoint(save_last) after epoch 1, a fresh Trainer and `fit(ckpt_path=last)` to the full length; the
    resumed weights are compared with an uninterrupted run's. `weights_only=False`: pytorch-forecasting checkpoints
    pickle the dataset parameters, which torch 2.13's default weights-only load refuses (bare as well)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_overflow import default_callbacks

    from common import resume_outcome

    def cbs(extra=()):
        return list(extra) + (default_callbacks() if "suite" in mode else [])

    def fit(n_epochs, callbacks, ckpt=None):
        pl.seed_everything(42, verbose=False)
        training, validation = _data(None)
        net = _net(training, 1.0)
        trainer = _trainer((n_epochs, steps[1]), callbacks, None)
        trainer.fit(net, train_dataloaders=training.to_dataloader(train=True, batch_size=64, num_workers=0),
                    val_dataloaders=validation.to_dataloader(train=False, batch_size=64, num_workers=0),
                    ckpt_path=ckpt, weights_only=False)
        return net, validation, trainer

    straight, _, _ = fit(steps[0], cbs())
    ckdir = os.path.join(workdir, f"pf_ckpt_{mode}")
    fit(1, cbs([ModelCheckpoint(dirpath=ckdir, save_last=True)]))
    last = os.path.join(ckdir, "last.ckpt")
    resumed, validation, trainer = fit(steps[0], cbs(), ckpt=last)
    return resume_outcome(snapshot(straight), snapshot(resumed), _mae(resumed, validation),
                          _mae(straight, validation), trainer.global_step, "MAE")
