"""neuralforecast 3.3.0: NHITS on its shipped AirPassengers series (no download).

Trainer kwargs (callbacks, gradient_clip_val) go through the model's constructor, which calls
``save_hyperparameters()`` with them. Train on the first 132 months, MAE on the held-out last 12.
"""

from __future__ import annotations

import math
import os

import numpy as np

from common import Outcome, snapshot

NAME = "neuralforecast"
CLIP = 1.0  # neuralforecast's docs set no clipping; 1.0 is the common user value
FAULT_ROW = 60  # the exact training row (month 61, 1954-01) a data fault is written to


def _data():
    from neuralforecast.utils import AirPassengersDF

    df = AirPassengersDF.copy()
    return df.iloc[:-12].reset_index(drop=True), df.iloc[-12:].reset_index(drop=True)


def _model(steps: int, lr: float, callbacks=None, clip=None, **extra):
    from neuralforecast.models import NHITS

    kw = dict(enable_progress_bar=False, logger=False, enable_model_summary=False)
    if callbacks is not None:
        kw["callbacks"] = callbacks
    if clip is not None:
        kw["gradient_clip_val"] = clip
    kw.update(extra)
    return NHITS(h=12, input_size=24, max_steps=steps, learning_rate=lr, mlp_units=[[64, 64]] * 3,
                 windows_batch_size=64, scaler_type="robust", random_seed=1, **kw)


def _fit_predict(model, train, test):
    from neuralforecast import NeuralForecast

    nf = NeuralForecast(models=[model], freq="ME")
    nf.fit(train)
    pred = nf.predict()["NHITS"].to_numpy()
    mae = float(np.abs(pred - test["y"].to_numpy()).mean())
    return nf, pred, mae


CASES = {
    # name: (what, fault kind, lr multiplier)
    "healthy": ("clean data, lr 1e-3", None, 1.0),
    "huge 1e30": (f"y[{FAULT_ROW}] = 1e30 (a finite value 1e28x the series)", 1e30, 1.0),
    "inf": (f"y[{FAULT_ROW}] = inf (neuralforecast refuses NaN, not inf)", math.inf, 1.0),
    "lr 300x": ("learning_rate 0.3 instead of 1e-3", None, 300.0),
}


def train(case: str, mode: str, steps: int, workdir: str):
    from lightning_overflow import default_callbacks

    _, fault, lr_mult = CASES[case]
    train_df, test_df = _data()
    if fault is not None:
        train_df.loc[FAULT_ROW, "y"] = fault
    cbs = default_callbacks() if "suite" in mode else None
    clip = CLIP if "clip" in mode else None
    model = _model(steps, 1e-3 * lr_mult, callbacks=cbs, clip=clip)
    nf, _, mae = _fit_predict(model, train_df, test_df)
    fitted = nf.models[0]
    return Outcome(mae, snapshot(fitted), {"train_trajectories": len(fitted.train_trajectories)})


def resume(mode: str, steps: int, workdir: str) -> tuple[Outcome, str]:
    """Checkpoint during the fit (Lightning ModelCheckpoint, enable_checkpointing=True), then the library's own
    save/load (nf.save / NeuralForecast.load): the loaded model must predict bit for bit what the fitted one did."""
    from lightning.pytorch.callbacks import ModelCheckpoint  # neuralforecast builds a lightning.pytorch Trainer
    from lightning_overflow import default_callbacks
    from neuralforecast import NeuralForecast

    train_df, test_df = _data()
    ckdir = os.path.join(workdir, f"nf_ckpt_{mode}")
    cbs = [ModelCheckpoint(dirpath=ckdir, every_n_train_steps=max(1, steps // 3), save_last=True)]
    if "suite" in mode:
        cbs += default_callbacks()
    model = _model(steps, 1e-3, callbacks=cbs, enable_checkpointing=True)
    nf, pred, mae = _fit_predict(model, train_df, test_df)
    written = sorted(f for f in os.listdir(ckdir) if f.endswith(".ckpt")) if os.path.isdir(ckdir) else []
    path = os.path.join(workdir, f"nf_saved_{mode}")
    nf.save(path, overwrite=True, save_dataset=True)
    nf2 = NeuralForecast.load(path)
    pred2 = nf2.predict()["NHITS"].to_numpy()
    same = bool(np.array_equal(pred, pred2))
    detail = (f"{len(written)} Lightning checkpoints written; nf.save/NeuralForecast.load: predictions "
              f"{'bit-identical' if same else f'differ by up to {float(np.abs(pred - pred2).max()):.3g}'}")
    return Outcome(mae, snapshot(nf.models[0]), {"resume_ok": same and len(written) > 0}), detail

STEPS = {"quick": 30, "full": 100}
METRIC = "MAE of the 12-month forecast on the held-out last year (passengers, lower is better)"


def LENGTH(steps: int) -> str:  # noqa: N802
    return f"NHITS max_steps={steps}"
