"""lightly 1.6.0: SimCLR (`NTXentLoss`, `SimCLRProjectionHead`) and SwaV (`SwaVLoss`, `SwaVProjectionHead`,
`SwaVPrototypes`) as in lightly's own examples, with a small CNN backbone (no torchvision model, no download), on
synthetic images: 512 noisy 3x16x16 images of 8 random templates, two augmented views each (random crop of a padded
image, flip, brightness, noise), drawn once from a seeded generator.
"""

from __future__ import annotations

import math
import os

import torch
from torch import nn

from common import Outcome, snapshot

NAME = "lightly"
CLIP = 1.0
N_TRAIN, N_EVAL, BATCH = 512, 128, 64
FAULT_IMAGE = 37  # the exact training image a data fault is written to (pixel [0, 5, 5] of both views)
STEPS = {"quick": 2, "full": 4}  # epochs of 8 steps
METRIC = ("the model's own loss at the healthy setting (NTXent temperature 0.5 / SwaV sinkhorn_epsilon 0.05) on 128 "
          "held-out clean images after training, lower is better")


def LENGTH(epochs: int) -> str:  # noqa: N802
    return f"max_epochs={epochs} x {N_TRAIN // BATCH} steps, batch {BATCH}, Adam lr 1e-3"


CASES = {
    "simclr healthy": ("SimCLR, clean data", "simclr", {}),
    "simclr NaN pixel": (f"SimCLR, image {FAULT_IMAGE} has one NaN pixel", "simclr", {"pixel": math.nan}),
    "simclr tau 1e-4": ("SimCLR, NTXentLoss(temperature=1e-4)", "simclr", {"temperature": 1e-4}),
    "simclr 1e30 pixel": (f"SimCLR, image {FAULT_IMAGE} has one pixel 1e30", "simclr", {"pixel": 1e30}),
    "swav healthy": ("SwaV, clean data", "swav", {}),
    "swav eps 1e-3": ("SwaV, SwaVLoss(sinkhorn_epsilon=1e-3): exp(scores/eps) overflows", "swav",
                      {"epsilon": 1e-3}),
    "swav 1e30 pixel": (f"SwaV, image {FAULT_IMAGE} has one pixel 1e30", "swav", {"pixel": 1e30}),
}
HEALTHY = ("simclr healthy", "swav healthy")
# Not a row: lr 300x (0.3) does not hurt this SimCLR (Adam + BatchNorm): bare ended at 4.615 vs 4.501 healthy.


def _views(n: int, gen: torch.Generator, templates: torch.Tensor):
    labels = torch.randint(0, templates.shape[0], (n,), generator=gen)
    base = templates[labels] + 0.3 * torch.randn(n, 3, 16, 16, generator=gen)

    def aug(x):
        pad = nn.functional.pad(x, (2, 2, 2, 2), mode="reflect")
        out = torch.empty_like(x)
        for i in range(x.shape[0]):
            dx, dy = torch.randint(0, 5, (2,), generator=gen).tolist()
            v = pad[i, :, dy:dy + 16, dx:dx + 16]
            if torch.rand((), generator=gen) < 0.5:
                v = v.flip(-1)
            out[i] = v * (0.8 + 0.4 * torch.rand((), generator=gen)) + 0.1 * torch.randn(v.shape, generator=gen)
        return out

    return aug(base), aug(base)


def _data(pixel=None):
    gen = torch.Generator().manual_seed(1234)
    templates = torch.randn(8, 3, 16, 16, generator=gen)
    tr = _views(N_TRAIN, gen, templates)
    ev = _views(N_EVAL, gen, templates)
    if pixel is not None:
        for v in tr:
            v[FAULT_IMAGE, 0, 5, 5] = pixel
    return tr, ev


def _backbone():
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten())


def _module(kind: str, opts: dict):
    import pytorch_lightning as pl
    from lightly.loss import NTXentLoss, SwaVLoss
    from lightly.models.modules import SimCLRProjectionHead, SwaVProjectionHead, SwaVPrototypes

    lr = 1e-3 * opts.get("lr", 1.0)

    class SimCLR(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.backbone = _backbone()
            self.projection_head = SimCLRProjectionHead(32, 64, 32)
            self.criterion = NTXentLoss(temperature=opts.get("temperature", 0.5))
            self.eval_criterion = NTXentLoss(temperature=0.5)

        def forward(self, x):
            return self.projection_head(self.backbone(x))

        def training_step(self, batch, batch_idx):
            x0, x1 = batch
            loss = self.criterion(self(x0), self(x1))
            self.log("train_loss", loss)
            return loss

        def eval_loss(self, x0, x1):
            return self.eval_criterion(self(x0), self(x1))

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=lr)

    class SwaV(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.backbone = _backbone()
            self.projection_head = SwaVProjectionHead(32, 64, 32)
            self.prototypes = SwaVPrototypes(32, n_prototypes=16)
            self.criterion = SwaVLoss(sinkhorn_epsilon=opts.get("epsilon", 0.05))
            self.eval_criterion = SwaVLoss()

        def forward(self, x):
            x = nn.functional.normalize(self.projection_head(self.backbone(x)), dim=1, p=2)
            return self.prototypes(x)

        def training_step(self, batch, batch_idx):
            self.prototypes.normalize()
            x0, x1 = batch
            loss = self.criterion([self(x0), self(x1)], [])
            self.log("train_loss", loss)
            return loss

        def eval_loss(self, x0, x1):
            return self.eval_criterion([self(x0), self(x1)], [])

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=lr)

    return SimCLR() if kind == "simclr" else SwaV()


def _loader(views):
    from torch.utils.data import DataLoader, TensorDataset

    return DataLoader(TensorDataset(*views), batch_size=BATCH, shuffle=True,
                      generator=torch.Generator().manual_seed(0))


def _trainer(epochs, callbacks, clip, **kw):
    import pytorch_lightning as pl

    return pl.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, gradient_clip_val=clip, callbacks=callbacks,
                      enable_progress_bar=False, enable_model_summary=False, logger=False, deterministic=True, **kw)


def _metric(model, ev) -> float:
    model.eval()
    with torch.no_grad():
        return float(model.eval_loss(*ev))


def train(case: str, mode: str, epochs: int, workdir: str) -> Outcome:
    import pytorch_lightning as pl
    from lightning_overflow import default_callbacks

    _, kind, opts = CASES[case]
    pl.seed_everything(0, verbose=False)
    tr, ev = _data(opts.get("pixel"))
    model = _module(kind, opts)
    trainer = _trainer(epochs, default_callbacks() if "suite" in mode else [], CLIP if "clip" in mode else None,
                       enable_checkpointing=False)
    trainer.fit(model, _loader(tr))
    return Outcome(_metric(model, ev), snapshot(model), {"steps": trainer.global_step})


def resume(mode: str, epochs: int, workdir: str):
    """SimCLR: ModelCheckpoint(save_last) after epoch 1, a fresh Trainer and `fit(ckpt_path=last)`; the resumed
    weights are compared with an uninterrupted run's."""
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint
    from lightning_overflow import default_callbacks

    from common import resume_outcome

    def fit(n, extra=(), ckpt=None):
        pl.seed_everything(0, verbose=False)
        tr, ev = _data()
        model = _module("simclr", {})
        cbs = list(extra) + (default_callbacks() if "suite" in mode else [])
        trainer = _trainer(n, cbs, None)
        trainer.fit(model, _loader(tr), ckpt_path=ckpt)
        return model, ev, trainer

    straight, ev, _ = fit(epochs)
    ckdir = os.path.join(workdir, f"ly_ckpt_{mode}")
    fit(1, [ModelCheckpoint(dirpath=ckdir, save_last=True)])
    resumed, _, trainer = fit(epochs, ckpt=os.path.join(ckdir, "last.ckpt"))
    return resume_outcome(snapshot(straight), snapshot(resumed), _metric(resumed, ev), _metric(straight, ev),
                          trainer.global_step, "loss")
