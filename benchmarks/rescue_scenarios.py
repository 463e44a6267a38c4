"""The divergence scenarios of the rescue benchmark: tiny models, their data, and the fault each one carries.

Every scenario is a :class:`Scenario`: a name, a family, a builder ``seed -> LightningModule``, a step budget and the
faults injected at exact steps. Each module evaluates itself on clean held-out data (``evaluation_loss``), so a
scenario's fault never reaches its evaluation. The data of a family are fixed (the same for every seed); the seed
draws the initialisation and the order of the batches, through generators the module owns, so that nothing a
callback draws from the global RNG changes the run.

A family's reference is the scenario named by ``Scenario.reference``: the same model and data at the stable learning
rate, without the fault (``reference == name`` where the scenario is itself that run). The benchmark trains it
unprotected for every seed and keeps the best final evaluation.

Faults are properties of the data (a corrupt sample, a spiking or poisoned batch at an exact step), of the model (a
bad initialisation, an expansive recurrent matrix), of the loss as written (a raw ``exp``), of the schedule (a
learning rate too high, or a warm-up to too high a peak), or a NaN written into a weight or a gradient by
:class:`lightning_overflow.testing.FaultInjector` at an exact step. None is provoked by an absurd learning rate
except where the scenario is the learning rate.

Harmless scenarios (``Scenario.harmless``) carry no fault at all: a change of task, a stretch of noise labels, a
restarting schedule, loss that rises for good reasons. Nothing needed doing there, and the protection must leave them
alone; each is its own reference.

:data:`SCENARIOS` is the benchmark's matrix; :data:`HELD_OUT` holds the same families at other magnitudes (other
learning rates, spike and poison factors, fault steps, epoch lengths), to check that what passes the matrix was not
tuned to its exact numbers.

:data:`HARD` is a matrix of its own (``--set hard``), kept apart so that the tables of :data:`SCENARIOS` stay
comparable across releases: the classes of runs the suite still lost (a lasting disturbance that needs clipping, a
learning rate too high that never overflows, gradients out of scale from the first step, periodic input spikes under
SGD), with harmless twins of each that must be left alone. :data:`HARD_HELD_OUT` (``--set hard-held-out``) holds the
same families at other magnitudes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

from lightning_overflow.testing import Fault

__all__ = ["HARD", "HARD_HELD_OUT", "HELD_OUT", "SCENARIOS", "SETS", "Scenario", "scenario"]

DATA_SEED = 1234  # the data of every family; the run's seed never changes them


# ---- data -----------------------------------------------------------------------------------------------------------
def _batches(data: TensorDataset, batch_size: int, seed: int) -> DataLoader:
    """Shuffled whole batches, indexed at once (collating single samples costs more than a tiny model's step)."""
    order = RandomSampler(data, generator=torch.Generator().manual_seed(seed))
    return DataLoader(data, batch_size=None, sampler=BatchSampler(order, batch_size, drop_last=False))


@functools.lru_cache(maxsize=None)
def _teacher(in_features: int, task: int = 0) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(DATA_SEED + 1000 * task)
    return torch.randn(in_features, 16, generator=gen) / math.sqrt(in_features), torch.randn(16, 1, generator=gen)


def teacher_targets(x: Tensor, task: int = 0, scale: float = 1.0) -> Tensor:
    """The noise-free targets of regression task ``task`` (another teacher network), times ``scale``."""
    w1, w2 = _teacher(x.shape[-1], task)
    return scale * torch.tanh(x @ w1) @ w2


def regression_set(samples: int, in_features: int = 16, offset: int = 0, task: int = 0, scale: float = 1.0
                   ) -> TensorDataset:  # fmt: skip
    """A fixed nonlinear regression problem, ``y = tanh(x @ w1) @ w2 + 0.1 noise``; ``offset`` draws another split,
    ``task`` another teacher, ``scale`` multiplies its targets."""
    gen = torch.Generator().manual_seed(DATA_SEED + 1 + offset)
    x = torch.randn(samples, in_features, generator=gen)
    return TensorDataset(x, teacher_targets(x, task, scale) + 0.1 * torch.randn(samples, 1, generator=gen))


def step_noise(step: int, shape: torch.Size) -> Tensor:
    """Standard Gaussian noise for the batch of ``step``: a property of the data, the same for every seed."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(DATA_SEED * 1000 + step))


# ---- models ---------------------------------------------------------------------------------------------------------
class Benchmarked(pl.LightningModule):
    """What every scenario's module offers the benchmark.

    ``clip_manually`` is set by the benchmark for ``gradient_clip_val`` under manual optimization, where Lightning
    refuses the Trainer argument and the documented equivalent is ``self.clip_gradients`` before each step.
    """

    clip_manually: float | None = None

    def evaluation_loss(self) -> float:
        raise NotImplementedError


class Regression(Benchmarked):
    """An MLP regression (ReLU) on :func:`regression_set`, with the faults of its data and schedule.

    Args:
        seed: initialisation and batch order.
        optimizer: ``"sgd"`` (momentum 0.9) or ``"adam"``.
        lr: the learning rate.
        depth, width: hidden layers and their width.
        init_std: draw hidden weights from N(0, ``init_std``) (``None``: PyTorch's default).
        samples, batch_size: the training set and its batches.
        corrupt_index: the training sample whose features are all NaN (it comes back once an epoch).
        spike_every: every ``spike_every`` steps, starting at ``spike_every // 2``, the batch's inputs are multiplied
            by ``spike_factor``.
        poison_step: the step whose batch is multiplied by ``poison_factor``, once.
        schedule: ``"constant"``; ``"warmup"``, a linear rise from 1x to ``peak`` x the LR over ``total_steps``;
            ``"onecycle"``, PyTorch's ``OneCycleLR`` peaking at ``lr`` over ``total_steps``; or ``"restarts"``,
            PyTorch's ``CosineAnnealingWarmRestarts`` from ``lr`` down and back every ``total_steps`` steps.
        shift_step: from this step on the targets are another teacher's, ``shift_scale`` times larger (new data, a
            harder task: a legitimate rise of the loss); the evaluation is on that task.
        noise_step: for ``noise_steps`` steps from this one the batch's targets are replaced by Gaussian noise of
            ``noise_scale`` x the training targets' standard deviation (:func:`step_noise`: the same for every
            seed); the evaluation stays on clean data.
        label_noise: ``(first, last)``: the training targets' noise is drawn afresh at every step
            (:func:`step_noise`), its standard deviation growing linearly from ``first`` to ``last`` x the training
            targets' standard deviation over ``total_steps`` (in place of the data's own noise of 0.1); the
            evaluation stays on the usual held-out data.
        grow_step: from this step on the targets (the same teacher's, the same noise) grow linearly to ``grow_scale``
            x over ``grow_steps`` steps, then stay there; the evaluation is on the grown targets.
        kaiming: draw every hidden layer's weights from N(0, ``kaiming`` x Kaiming's std for its fan-in), biases 0
            (in place of ``init_std``).
    """

    def __init__(
        self,
        seed: int,
        optimizer: str = "sgd",
        lr: float = 0.01,
        depth: int = 2,
        width: int = 64,
        init_std: float | None = None,
        samples: int = 512,
        batch_size: int = 16,
        corrupt_index: int | None = None,
        spike_every: int | None = None,
        spike_factor: float = 100.0,
        poison_step: int | None = None,
        poison_factor: float = 1e4,
        schedule: str = "constant",
        peak: float = 1.0,
        total_steps: int = 1,
        shift_step: int | None = None,
        shift_scale: float = 2.0,
        noise_step: int | None = None,
        noise_steps: int = 20,
        noise_scale: float = 3.0,
        label_noise: tuple[float, float] | None = None,
        grow_step: int | None = None,
        grow_steps: int = 100,
        grow_scale: float = 3.0,
        kaiming: float | None = None,
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        features = 16
        for _ in range(depth):
            linear = nn.Linear(features, width)
            if init_std is not None or kaiming is not None:
                std = init_std if kaiming is None else kaiming * math.sqrt(2.0 / features)
                nn.init.normal_(linear.weight, 0.0, std)
                nn.init.zeros_(linear.bias)
            layers += [linear, nn.ReLU()]
            features = width
        self.net = nn.Sequential(*layers, nn.Linear(features, 1))
        self.seed, self.optimizer_name, self.lr, self.batch_size = seed, optimizer, lr, batch_size
        self.spike_every, self.spike_factor = spike_every, spike_factor
        self.poison_step, self.poison_factor = poison_step, poison_factor
        self.schedule, self.peak, self.total_steps = schedule, peak, total_steps
        self.shift_step, self.shift_scale = shift_step, shift_scale
        self.noise_step, self.noise_steps, self.noise_scale = noise_step, noise_steps, noise_scale
        self.label_noise = label_noise
        self.grow_step, self.grow_steps, self.grow_scale = grow_step, grow_steps, grow_scale
        self.data = regression_set(samples)
        self.target_std = float(self.data.tensors[1].std())
        if corrupt_index is not None:
            x, y = self.data.tensors
            x = x.clone()
            x[corrupt_index] = float("nan")
            self.data = TensorDataset(x, y)
        self.evaluation = regression_set(1024, offset=1, task=int(shift_step is not None), scale=shift_scale
                                         if shift_step is not None else 1.0)  # fmt: skip
        if grow_step is not None:
            self.evaluation = regression_set(1024, offset=1, scale=grow_scale)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        step = self.trainer.global_step
        if self.shift_step is not None and step >= self.shift_step:
            y = teacher_targets(x, task=1, scale=self.shift_scale) + (y - teacher_targets(x))  # the same noise
        if self.grow_step is not None and step >= self.grow_step:
            grown = 1.0 + (self.grow_scale - 1.0) * min(1.0, (step - self.grow_step) / self.grow_steps)
            y = y + (grown - 1.0) * teacher_targets(x)  # the same teacher and noise, the teacher's part grown
        if self.label_noise is not None:
            first, last = self.label_noise
            std = first + (last - first) * min(step, self.total_steps) / self.total_steps
            y = teacher_targets(x) + std * self.target_std * step_noise(step, y.shape)
        if self.noise_step is not None and 0 <= step - self.noise_step < self.noise_steps:
            y = self.noise_scale * self.target_std * step_noise(step, y.shape)
        if self.spike_every is not None and step % self.spike_every == self.spike_every // 2:
            x = x * self.spike_factor
        if step == self.poison_step:
            x = x * self.poison_factor
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "sgd":
            optimizer: torch.optim.Optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        else:
            optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        if self.schedule == "constant":
            return optimizer
        steps = self.total_steps
        if self.schedule == "onecycle":
            schedule: Any = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.lr, total_steps=steps + 1)
        elif self.schedule == "restarts":
            schedule = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=steps)
        else:
            rise = self.peak - 1.0
            schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 + rise * min(s, steps) / steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return _batches(self.data, self.batch_size, self.seed)

    def evaluation_loss(self) -> float:
        x, y = self.evaluation.tensors
        with torch.no_grad():
            return float(nn.functional.mse_loss(self.net(x), y))


class Contrastive(Benchmarked):
    """An encoder trained with InfoNCE on two noisy views of each point, at temperature 0.1 on unnormalised
    embeddings; ``raw_exp`` writes the loss as ``-log(exp(s_ii / t) / sum_j exp(s_ij / t))``, which overflows once
    the similarities pass 8.9. Evaluated with the stable form of the same loss on cosine similarities, so that the
    length of the embeddings (which the raw form cannot survive) does not enter the comparison."""

    TEMPERATURE = 0.1

    def __init__(self, seed: int, raw_exp: bool = True, lr: float = 5e-3, samples: int = 1024) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.encoder = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
        self.seed, self.raw_exp, self.lr = seed, raw_exp, lr
        self.noise = torch.Generator().manual_seed(seed)
        gen = torch.Generator().manual_seed(DATA_SEED)
        self.data = TensorDataset(torch.randn(samples, 32, generator=gen))
        held_out = torch.randn(256, 32, generator=gen)
        noise = 0.1 * torch.randn(2, 256, 32, generator=gen)
        self.evaluation = (held_out + noise[0], held_out + noise[1])

    def _views(self, x: Tensor) -> tuple[Tensor, Tensor]:
        noise = torch.randn((2, *x.shape), generator=self.noise)
        return x + 0.1 * noise[0], x + 0.1 * noise[1]

    def training_step(self, batch: tuple[Tensor], batch_idx: int) -> Tensor:
        (x,) = batch
        a, b = self._views(x)
        sim = self.encoder(a) @ self.encoder(b).T / self.TEMPERATURE
        if self.raw_exp:
            return -torch.log(torch.exp(sim.diagonal()) / torch.exp(sim).sum(dim=1)).mean()
        return nn.functional.cross_entropy(sim, torch.arange(len(x)))

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        return _batches(self.data, 64, self.seed)

    def evaluation_loss(self) -> float:
        a, b = self.evaluation
        with torch.no_grad():
            za = nn.functional.normalize(self.encoder(a), dim=1)
            zb = nn.functional.normalize(self.encoder(b), dim=1)
            return float(nn.functional.cross_entropy(za @ zb.T / self.TEMPERATURE, torch.arange(len(a))))


class GAN(Benchmarked):
    """A small GAN (manual optimization, two Adam optimizers, two optimizer steps per batch) learning a 2-D Gaussian,
    with the losses in their stable form (``logsigmoid``).

    Evaluated by the sliced 1-Wasserstein distance between 1024 generated points (fixed noise) and 1024 held-out
    real points, over 32 fixed directions.
    """

    def __init__(self, seed: int, lr_d: float = 5e-3, lr_g: float = 2e-3) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(seed)
        self.generator = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 2))
        self.discriminator = nn.Sequential(nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
        self.seed, self.lr_d, self.lr_g = seed, lr_d, lr_g
        self.noise = torch.Generator().manual_seed(seed)
        gen = torch.Generator().manual_seed(DATA_SEED)
        scale, shift = torch.tensor([0.5, 1.0]), torch.tensor([3.0, -2.0])
        self.data = TensorDataset(torch.randn(4096, 2, generator=gen) * scale + shift)
        self.real = torch.randn(1024, 2, generator=gen) * scale + shift
        self.latent = torch.randn(1024, 4, generator=gen)
        self.projections = nn.functional.normalize(torch.randn(2, 32, generator=gen), dim=0)

    def _step(self, optimizer: Any, loss: Tensor) -> None:
        optimizer.zero_grad()
        self.manual_backward(loss)
        if self.clip_manually is not None:
            self.clip_gradients(optimizer, gradient_clip_val=self.clip_manually, gradient_clip_algorithm="norm")
        optimizer.step()

    def training_step(self, batch: tuple[Tensor], batch_idx: int) -> None:
        (real,) = batch
        opt_d, opt_g = self.optimizers()  # type: ignore[misc]
        fake = self.generator(torch.randn(len(real), 4, generator=self.noise))
        logsigmoid = nn.functional.logsigmoid
        d_loss = -(logsigmoid(self.discriminator(real)) + logsigmoid(-self.discriminator(fake.detach()))).mean()
        self._step(opt_d, d_loss)
        self._step(opt_g, -logsigmoid(self.discriminator(fake)).mean())

    def configure_optimizers(self) -> Any:
        betas = (0.5, 0.999)
        return (
            torch.optim.Adam(self.discriminator.parameters(), lr=self.lr_d, betas=betas),
            torch.optim.Adam(self.generator.parameters(), lr=self.lr_g, betas=betas),
        )

    def train_dataloader(self) -> DataLoader:
        return _batches(self.data, 64, self.seed)

    def evaluation_loss(self) -> float:
        with torch.no_grad():
            fake = self.generator(self.latent) @ self.projections
        real = self.real @ self.projections
        return float((fake.sort(dim=0).values - real.sort(dim=0).values).abs().mean())


class SequenceRNN(Benchmarked):
    """A ReLU RNN over sequences of ``length`` steps that outputs, at every step, the first feature of two steps
    before (plus noise 0.1, so the best evaluation is about 0.01).

    Its recurrent matrix is orthogonal times ``gain``: above 1 some directions of the hidden state grow ``gain``x
    per time step, and backpropagation through time multiplies the gradient by the same matrix ``length`` times
    (Pascanu, Mikolov and Bengio, ICML 2013). ``nonlinearity="tanh"`` bounds the hidden state but not the gradients:
    while the state is off saturation the same product of matrices multiplies them.
    """

    def __init__(self, seed: int, gain: float = 1.5, length: int = 48, lr: float = 3e-3, nonlinearity: str = "relu"
                 ) -> None:  # fmt: skip
        super().__init__()
        torch.manual_seed(seed)
        self.rnn = nn.RNN(4, 32, nonlinearity=nonlinearity, batch_first=True)
        self.head = nn.Linear(32, 1)
        with torch.no_grad():
            nn.init.orthogonal_(self.rnn.weight_hh_l0)
            self.rnn.weight_hh_l0.mul_(gain)
        self.seed, self.lr = seed, lr
        gen = torch.Generator().manual_seed(DATA_SEED)
        x = torch.randn(768, length, 4, generator=gen)
        y = 0.1 * torch.randn(768, length, 1, generator=gen)
        y[:, 2:, 0] += x[:, :-2, 0]
        self.data = TensorDataset(x[:512], y[:512])
        self.evaluation = (x[512:], y[512:])

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.rnn(x)[0])

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return _batches(self.data, 32, self.seed)

    def evaluation_loss(self) -> float:
        x, y = self.evaluation
        with torch.no_grad():
            return float(nn.functional.mse_loss(self(x), y))


@functools.lru_cache(maxsize=None)
def _corpus(chars: int) -> tuple[Tensor, int]:
    """Text of random words from a fixed vocabulary of 24 made-up words (a to p), as symbol indices."""
    gen = torch.Generator().manual_seed(DATA_SEED)
    letters = "abcdefghijklmnop"
    words = []
    for _ in range(24):
        size = int(torch.randint(2, 7, (1,), generator=gen))
        words.append("".join(letters[int(i)] for i in torch.randint(0, len(letters), (size,), generator=gen)))
    text: list[str] = []
    while sum(map(len, text)) < chars:
        text.append(words[int(torch.randint(0, len(words), (1,), generator=gen))] + " ")
    alphabet = " " + letters
    return torch.tensor([alphabet.index(c) for c in "".join(text)[:chars]]), len(alphabet)


class CharTransformer(Benchmarked):
    """A causal transformer of ``layers`` blocks (d=32, 2 heads, post-norm, no warm-up) over a character corpus,
    trained with AdamW.

    Its causal mask is a buffer of ``-inf`` above the diagonal, a legitimate non-finite constant.
    """

    CONTEXT = 32

    def __init__(self, seed: int, lr: float = 3e-3, layers: int = 1) -> None:
        super().__init__()
        torch.manual_seed(seed)
        text, vocabulary = _corpus(40_000)
        self.embed = nn.Embedding(vocabulary, 32)
        self.position = nn.Parameter(0.02 * torch.randn(self.CONTEXT, 32))
        layer = nn.TransformerEncoderLayer(32, 2, dim_feedforward=64, dropout=0.0, batch_first=True, norm_first=False)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.out = nn.Linear(32, vocabulary)
        self.register_buffer("mask", torch.triu(torch.full((self.CONTEXT, self.CONTEXT), float("-inf")), 1))
        self.seed, self.lr = seed, lr
        windows = text[: (len(text) // (self.CONTEXT + 1)) * (self.CONTEXT + 1)].view(-1, self.CONTEXT + 1)
        self.data = TensorDataset(windows[:-128])
        self.evaluation = windows[-128:]

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens) + self.position[: tokens.shape[1]]
        return self.out(self.blocks(h, mask=self.mask, is_causal=True))

    def _loss(self, windows: Tensor) -> Tensor:
        logits = self(windows[:, :-1])
        return nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())

    def training_step(self, batch: tuple[Tensor], batch_idx: int) -> Tensor:
        return self._loss(batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)

    def train_dataloader(self) -> DataLoader:
        return _batches(self.data, 16, self.seed)

    def evaluation_loss(self) -> float:
        with torch.no_grad():
            return float(self._loss(self.evaluation))


class Hinge(Benchmarked):
    """A linear classifier with a hinge loss and weight decay on separable data: the loss sits at exactly 0 once every
    margin passes 1, until the weight decay shrinks the margins and it rises a little. A healthy run.

    Evaluated by the logistic loss of the held-out margins (the hinge loss of a good model is 0 there too, which
    no ratio can compare).
    """

    def __init__(self, seed: int, lr: float = 0.05, weight_decay: float = 1e-3) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.linear = nn.Linear(8, 1)
        self.seed, self.lr, self.weight_decay = seed, lr, weight_decay
        gen = torch.Generator().manual_seed(DATA_SEED)
        direction = nn.functional.normalize(torch.randn(8, generator=gen), dim=0)

        def separable(n: int) -> tuple[Tensor, Tensor]:
            x = torch.randn(n, 8, generator=gen)
            y = torch.where(x @ direction >= 0, 1.0, -1.0)
            return x + y[:, None] * direction, y  # a gap of 2 between the classes: margins of 1 fit

        self.data = TensorDataset(*separable(256))
        self.evaluation = separable(512)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return torch.relu(1.0 - y * self.linear(x).squeeze(1)).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)

    def train_dataloader(self) -> DataLoader:
        return _batches(self.data, 32, self.seed)

    def evaluation_loss(self) -> float:
        x, y = self.evaluation
        with torch.no_grad():
            return float(nn.functional.softplus(-y * self.linear(x).squeeze(1)).mean())


# ---- the catalogue --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Scenario:
    """One divergence scenario.

    Attributes:
        name: its key in :data:`SCENARIOS`.
        family: scenarios of one family share a model and data, and one reference.
        description: what goes wrong, for a person.
        build: ``seed -> module``.
        steps: the optimizer-step budget (``max_steps``; a GAN batch makes two steps).
        reference: the scenario whose best unprotected final evaluation over the seeds is the family's reference.
        faults: injected by ``FaultInjector`` at their exact steps.
        stable: a healthy run at a stable LR, which the suite must leave unchanged.
        harmless: a run where nothing needed doing (no fault), which the suite must leave alone.
        quick: part of the ``--quick`` subset.
        in_matrix: ``False`` for a reference that only serves as one (trained unprotected, no row of its own).
    """

    name: str
    family: str
    description: str
    build: Callable[[int], Benchmarked]
    steps: int
    reference: str
    faults: tuple[Fault, ...] = ()
    stable: bool = False
    harmless: bool = False
    quick: bool = False
    in_matrix: bool = True


SGD_LR, ADAM_LR, ADAMW_LR = 0.02, 1e-2, 1e-2  # the stable learning rates of the three sweeps
SWEEP = (1, 4, 8, 16)
STEPS = 400  # the budget of the MLP regressions
FAULT_STEP = 150  # where the one-off faults of the SGD regression strike
EARLY_FAULT_STEP = 77  # before default_callbacks()' first scheduled snapshot (every 100 steps)
SWITCH_LR = SGD_LR / 4  # SGD's LR for a switch to larger targets: at SGD_LR it cannot fit 2x larger ones, and diverges

# The regressions the catalogues share.
_SGD = functools.partial(Regression, optimizer="sgd", lr=SGD_LR)
_ADAM = functools.partial(Regression, optimizer="adam")
_DEEP = functools.partial(Regression, depth=8, lr=SGD_LR / 4)
_LARGE = functools.partial(Regression, samples=4096, batch_size=256)


def _sweep(prefix: str, what: str, build: Callable[..., Benchmarked], lr: float, steps: int, quick: tuple[int, ...],
           multiples: tuple[int, ...] = SWEEP) -> list[Scenario]:  # fmt: skip
    return [
        Scenario(
            name=f"{prefix}_lr{multiple}x",
            family=prefix,
            description=f"{what} at {multiple}x the stable LR ({lr * multiple:g})",
            build=functools.partial(build, lr=lr * multiple),
            steps=steps,
            reference=f"{prefix}_lr1x",
            stable=multiple == 1,
            quick=multiple in quick,
        )
        for multiple in multiples
    ]


def _fault_and_reference(name: str, family: str, description: str, build: Callable[[int], Benchmarked], steps: int,
                         reference: str, reference_description: str, reference_build: Callable[[int], Benchmarked],
                         quick: bool = False) -> list[Scenario]:  # fmt: skip
    """A scenario and the fault-free run of the same model that serves as its reference."""
    return [
        Scenario(name, family, description, build, steps, reference, quick=quick),
        Scenario(reference, family, reference_description, reference_build, steps, reference, in_matrix=False),
    ]


def _corrupt_sample(epoch: str, samples: int, quick: bool = False) -> list[Scenario]:
    """One NaN sample among ``samples`` (an epoch of ``samples // 16`` batches), and the same data without it."""
    return _fault_and_reference(
        f"corrupt_sample_{epoch}_epoch", f"corrupt_{epoch}",
        f"one sample of {samples} has NaN features; it is back once an epoch of {samples // 16} batches",
        functools.partial(_SGD, samples=samples, corrupt_index=samples // 3), STEPS,
        f"clean_{epoch}_epoch", f"the same {samples} samples without the corrupt one",
        functools.partial(_SGD, samples=samples), quick=quick,
    )  # fmt: skip


def _harmless(name: str, description: str, build: Callable[[int], Benchmarked], steps: int = STEPS,
              quick: bool = False, stable: bool = False) -> Scenario:  # fmt: skip
    """A run where nothing needs doing: its own family and its own reference."""
    return Scenario(name, name, description, build, steps, name, stable=stable, harmless=True, quick=quick)


def _catalogue() -> list[Scenario]:
    scenarios = [
        *_sweep("mlp_sgd", "MLP regression, SGD + momentum 0.9", Regression, SGD_LR, STEPS, quick=(1, 8)),
        *_sweep("mlp_adam", "MLP regression, Adam", _ADAM, ADAM_LR, STEPS, quick=()),
        *_sweep("transformer", "character transformer (post-norm), AdamW", CharTransformer, ADAMW_LR, 300, quick=()),
        *_fault_and_reference(
            "deep_mlp_bad_init", "deep_mlp",
            "8 ReLU layers of width 64 drawn from N(0, 0.25) (Kaiming: 0.18): the activations grow 1.4x a layer",
            functools.partial(_DEEP, init_std=0.25), STEPS,
            "deep_mlp_kaiming", "the same deep MLP drawn with Kaiming's std", functools.partial(_DEEP, init_std=0.177),
        ),
        *_fault_and_reference(
            "large_batch_high_lr", "large_batch",
            f"batches of 256 with the LR scaled up 8x for the batch ({8 * SGD_LR:g}), past the stability limit",
            functools.partial(_LARGE, lr=8 * SGD_LR), 200,
            "large_batch_stable", "the same large batches at the stable LR", functools.partial(_LARGE, lr=SGD_LR),
        ),
        *_corrupt_sample("short", 96, quick=True),
        *_corrupt_sample("long", 640),
        *_fault_and_reference(
            "infonce_raw_exp", "infonce",
            "InfoNCE at temperature 0.1 written with a raw exp() on unnormalised similarities: inf once they pass 8.9",
            Contrastive, 300,
            "infonce_stable", "the same InfoNCE through cross_entropy (log-sum-exp)",
            functools.partial(Contrastive, raw_exp=False),
        ),
        Scenario(
            "gan_nan_grad", "gan",
            "a GAN (manual optimization, two optimizers): a NaN in the generator's gradient at step 250",
            GAN, 500, "gan_clean", faults=(Fault(step=250, kind="nan_grad", parameter="generator.0.weight"),),
        ),
        Scenario("gan_clean", "gan", "the same GAN without the fault", GAN, 500, "gan_clean", in_matrix=False),
        *_fault_and_reference(
            "rnn_long_sequence", "rnn",
            "a ReLU RNN over 48 steps, recurrent matrix orthogonal x 1.5: the BPTT gradients explode",
            SequenceRNN, 250,
            "rnn_orthogonal", "the same RNN with an orthogonal recurrent matrix (gain 1)",
            functools.partial(SequenceRNN, gain=1.0),
        ),
        Scenario(
            "periodic_spikes", "mlp_sgd", "one batch in 50 has its inputs multiplied by 100 (steps 25, 75, ...)",
            functools.partial(Regression, spike_every=50), STEPS, "mlp_sgd_lr1x", quick=True,
        ),
        Scenario(
            "periodic_spikes_x10", "mlp_sgd",
            "one batch in 50 has its inputs multiplied by 10, a spike the loss statistics may take in",
            functools.partial(Regression, spike_every=50, spike_factor=10.0), STEPS, "mlp_sgd_lr1x", quick=True,
        ),
        Scenario(
            "poison_batch", "mlp_sgd", f"the batch of step {FAULT_STEP} has its inputs multiplied by 1e4, once",
            functools.partial(Regression, poison_step=FAULT_STEP), STEPS, "mlp_sgd_lr1x",
        ),
        Scenario(
            "nan_weight", "mlp_sgd", f"FaultInjector writes NaN into net.0.weight before step {FAULT_STEP}",
            Regression, STEPS, "mlp_sgd_lr1x",
            faults=(Fault(step=FAULT_STEP, kind="nan_weight", parameter="net.0.weight"),), quick=True,
        ),
        Scenario(
            "nan_weight_before_snapshot", "mlp_adam",
            f"Adam; FaultInjector writes NaN into net.0.weight before step {EARLY_FAULT_STEP}, before the first "
            "scheduled snapshot: the one to return to is the fit's first",
            functools.partial(_ADAM, lr=ADAM_LR), STEPS, "mlp_adam_lr1x",
            faults=(Fault(step=EARLY_FAULT_STEP, kind="nan_weight", parameter="net.0.weight"),), quick=True,
        ),
        Scenario(
            "slow_drift", "mlp_adam",
            "Adam warmed up linearly over the whole run to 40x the stable LR: the loss creeps up, no spike, no NaN",
            functools.partial(_ADAM, lr=ADAM_LR, schedule="warmup", peak=40.0, total_steps=STEPS), STEPS,
            "mlp_adam_lr1x",
        ),
        _harmless(
            "data_shift",
            "MLP regression, Adam, whose targets switch at step 100 to another teacher's, 2x larger: new data, a "
            "harder task (harmless)",
            functools.partial(_ADAM, lr=ADAM_LR, shift_step=100), quick=True,
        ),
        _harmless(
            "hinge_at_zero", "a hinge loss that sits at exactly 0 for stretches, then rises a little (harmless)",
            Hinge, 300, stable=True, quick=True,
        ),
        _harmless(
            "healthy", "MLP regression, Adam under OneCycleLR at the stable LR (harmless)",
            functools.partial(_ADAM, lr=ADAM_LR, schedule="onecycle", total_steps=STEPS), stable=True,
        ),
        _harmless(
            "small_batch",
            "MLP regression, Adam in batches of 2 at a stable LR: losses that scatter as much as they weigh (harmless)",
            functools.partial(_ADAM, lr=ADAM_LR / 4, batch_size=2), stable=True,
        ),
        *_harmless_regressions(),
    ]
    return scenarios


def _harmless_regressions() -> list[Scenario]:
    """The harmless MLP regressions: a change of task, a stretch of noise labels, input spikes under Adam, warm
    restarts and rising label noise."""
    return [
        _harmless(
            "task_switch_3x",
            f"MLP regression, SGD + momentum 0.9 at {SWITCH_LR:g} (at {SGD_LR:g} it cannot fit the larger targets and "
            f"diverges), whose targets switch at step {FAULT_STEP} to another teacher's, 3x larger: the loss jumps and "
            "stays higher on a harder task, evaluated on the new one (harmless)",
            functools.partial(_SGD, lr=SWITCH_LR, shift_step=FAULT_STEP, shift_scale=3.0),
        ),
        _harmless(
            "noise_labels",
            f"MLP regression, SGD + momentum 0.9: for 20 steps from step {FAULT_STEP} the targets are pure Gaussian "
            "noise (3x their std), then clean again; evaluated on clean data (harmless)",
            functools.partial(_SGD, noise_step=FAULT_STEP), quick=True,
        ),
        _harmless(
            "input_spikes_adam",
            "MLP regression, Adam: one batch in 50 has its inputs multiplied by 3 (steps 25, 75, ...), which Adam "
            "takes in (x10 and x5 left it up to 6.8x and 1.55x worse than without spikes) (harmless)",
            functools.partial(_ADAM, lr=ADAM_LR, spike_every=50, spike_factor=3.0),
        ),
        _harmless(
            "warm_restarts",
            "MLP regression, Adam at the stable LR under cosine annealing with warm restarts every 100 steps: the "
            "loss bumps up at each restart (harmless)",
            functools.partial(_ADAM, lr=ADAM_LR, schedule="restarts", total_steps=100),
        ),
        _harmless(
            "rising_noise",
            "MLP regression, SGD + momentum 0.9, whose training label noise grows linearly from 0.1 to 0.5x the "
            "targets' std over the run: the training loss rises from its lows, evaluated on clean data (harmless)",
            functools.partial(_SGD, label_noise=(0.1, 0.5), total_steps=STEPS),
        ),
    ]


def _held_out() -> list[Scenario]:
    """The families of :func:`_catalogue` at other magnitudes, each scored against its family's reference."""
    scenarios = [
        *_sweep("mlp_sgd", "MLP regression, SGD + momentum 0.9", Regression, SGD_LR, STEPS, quick=(6,),
                multiples=(2, 3, 6, 12)),
        *_sweep("mlp_adam", "MLP regression, Adam", _ADAM, ADAM_LR, STEPS, quick=(), multiples=(2, 5, 12)),
        *_sweep("transformer", "character transformer (post-norm), AdamW", CharTransformer, ADAMW_LR, 300, quick=(),
                multiples=(2,)),
        *_corrupt_sample("3_batch", 48, quick=True),
        *_corrupt_sample("10_batch", 160),
    ]  # fmt: skip
    scenarios += [
        Scenario(
            f"periodic_spikes_x{factor:g}", "mlp_sgd",
            f"one batch in 50 has its inputs multiplied by {factor:g} (steps 25, 75, ...)",
            functools.partial(Regression, spike_every=50, spike_factor=factor), STEPS, "mlp_sgd_lr1x",
            quick=factor < 100,
        )
        for factor in (30.0, 1000.0)
    ]  # fmt: skip
    scenarios += [
        Scenario(
            f"poison_batch_x{label}", "mlp_sgd",
            f"the batch of step {FAULT_STEP} has its inputs multiplied by {label}, once",
            functools.partial(Regression, poison_step=FAULT_STEP, poison_factor=float(label)), STEPS, "mlp_sgd_lr1x",
            quick=label == "1e6",
        )
        for label in ("1e2", "1e6")
    ]  # fmt: skip
    scenarios += [
        Scenario(
            f"nan_weight_step{step}", "mlp_sgd", f"FaultInjector writes NaN into net.0.weight before step {step}",
            Regression, STEPS, "mlp_sgd_lr1x", faults=(Fault(step=step, kind="nan_weight", parameter="net.0.weight"),),
            quick=step < EARLY_FAULT_STEP,
        )
        for step in (30, 250)
    ]  # fmt: skip
    scenarios += [
        Scenario(
            "slow_drift_20x", "mlp_adam",
            "Adam warmed up linearly over the whole run to 20x the stable LR: the loss creeps up, no spike, no NaN",
            functools.partial(_ADAM, lr=ADAM_LR, schedule="warmup", peak=20.0, total_steps=STEPS), STEPS,
            "mlp_adam_lr1x",
        ),
        Scenario(
            "large_batch_lr4x", "large_batch",
            f"batches of 256 with the LR scaled up 4x for the batch ({4 * SGD_LR:g})",
            functools.partial(_LARGE, lr=4 * SGD_LR), 200, "large_batch_stable",
        ),
        Scenario(
            "deep_mlp_init_std0.3", "deep_mlp",
            "8 ReLU layers of width 64 drawn from N(0, 0.3) (Kaiming: 0.18): the activations grow 1.7x a layer",
            functools.partial(_DEEP, init_std=0.3), STEPS, "deep_mlp_kaiming",
        ),
        Scenario(
            "rnn_gain1.3", "rnn",
            "a ReLU RNN over 48 steps, recurrent matrix orthogonal x 1.3: the BPTT gradients explode",
            functools.partial(SequenceRNN, gain=1.3), 250, "rnn_orthogonal",
        ),
        _harmless(
            "task_switch_2.5x",
            f"MLP regression, SGD + momentum 0.9 at {SWITCH_LR:g}, whose targets switch at step 200 to another "
            "teacher's, 2.5x larger: the loss jumps and stays higher on a harder task, evaluated on the new one "
            "(harmless)",
            functools.partial(_SGD, lr=SWITCH_LR, shift_step=200, shift_scale=2.5), quick=True,
        ),
        Scenario(
            "noise_labels_40_steps", "noise_labels",
            f"MLP regression, SGD + momentum 0.9: for 40 steps from step {FAULT_STEP} the targets are pure Gaussian "
            "noise (3x their std), then clean again; evaluated on clean data (harmless)",
            functools.partial(_SGD, noise_step=FAULT_STEP, noise_steps=40), STEPS, "noise_labels", harmless=True,
            quick=True,
        ),
    ]
    return scenarios


# ---- the hard matrix: the runs the suite still lost, and their harmless twins ----------------------------------------
_WIDE = functools.partial(Regression, width=128)  # another shape than the sweeps' (2 x 64)
_SLOW_START = functools.partial(Regression, depth=4, init_std=0.05)  # every layer small: a plateau, then it learns
_DEEP10 = functools.partial(Regression, depth=10, width=48, lr=SGD_LR / 4)
_TANH_RNN = functools.partial(SequenceRNN, nonlinearity="tanh", length=64, lr=1e-2)
GROW_STEP = 120  # where the targets of the growing regressions start to grow


def _growing(scale: float, start: int, steps: int, suffix: str = "") -> list[Scenario]:
    """Targets growing ``scale`` x over ``steps`` steps from ``start`` under SGD at the stable LR (which cannot fit
    them: a lasting disturbance that needs clipping), and the same growth at :data:`SWITCH_LR`, which fits them."""
    grow = functools.partial(Regression, grow_step=start, grow_steps=steps, grow_scale=scale)
    family = f"targets_grow_{scale:g}x{suffix}"
    what = f"whose targets grow linearly {scale:g}x from step {start} to {start + steps}"
    return [
        Scenario(
            family, family,
            f"MLP regression, SGD + momentum 0.9 at {SGD_LR:g}, {what}, then stay: the weights grow to fit them and "
            "the run loses stability; evaluated on the grown targets",
            functools.partial(grow, lr=SGD_LR), STEPS, f"{family}_fit",
        ),
        Scenario(
            f"{family}_fit", family,
            f"MLP regression, SGD + momentum 0.9 at {SWITCH_LR:g}, {what}, then stay: the gradient norms move to a "
            "new level that the run fits; evaluated on the grown targets (harmless)",
            functools.partial(grow, lr=SWITCH_LR), STEPS, f"{family}_fit", harmless=True,
        ),
    ]  # fmt: skip


def _reference_only(name: str, family: str, description: str, build: Callable[[int], Benchmarked],
                    steps: int) -> Scenario:  # fmt: skip
    return Scenario(name, family, description, build, steps, name, stable=True, in_matrix=False)


def _periodic(every: int, factor: float, quick: bool = False) -> Scenario:
    return Scenario(
        f"periodic_spikes_every{every}_x{factor:g}", "mlp_sgd",
        f"SGD: one batch in {every} has its inputs multiplied by {factor:g} (steps {every // 2}, "
        f"{every + every // 2}, ...)",
        functools.partial(Regression, spike_every=every, spike_factor=factor), STEPS, "mlp_sgd_lr1x", quick=quick,
    )  # fmt: skip


def _hard() -> list[Scenario]:
    """The classes of runs the suite still lost (:data:`HARD`): a lasting disturbance that needs clipping (growing
    targets, a high multiple of SGD's stable rate on another shape), a learning rate too high that never overflows
    (Adam at 5x, a post-norm transformer at a rate where it never learns), gradients out of scale from the first step
    (a deep ReLU net drawn too large, an explosive tanh recurrence), periodic input spikes under SGD; and the harmless
    twins that must be left alone (a level change of the gradient norms that the run fits, a slow starter, the deep
    net at the right initialisation, a healthy recurrent net, the other shape at its stable rate)."""
    return [
        *_growing(3.0, GROW_STEP, 100),
        Scenario(
            "wide_sgd_lr1x", "wide_sgd", f"MLP regression 2 x 128, SGD + momentum 0.9 at the stable LR ({SGD_LR:g})",
            functools.partial(_WIDE, lr=SGD_LR), STEPS, "wide_sgd_lr1x", stable=True,
        ),
        Scenario(
            "wide_sgd_lr6x", "wide_sgd", f"MLP regression 2 x 128, SGD + momentum 0.9 at 6x the stable LR "
            f"({6 * SGD_LR:g}): the gradient norms run away within a few steps",
            functools.partial(_WIDE, lr=6 * SGD_LR), STEPS, "wide_sgd_lr1x", quick=True,
        ),
        Scenario(
            "wide_adam_lr5x", "wide_adam", f"MLP regression 2 x 128, Adam at 5x the stable LR ({5 * ADAM_LR:g}): "
            "no overflow, a loss that never settles",
            functools.partial(_WIDE, optimizer="adam", lr=5 * ADAM_LR), STEPS, "wide_adam_lr1x",
        ),
        _reference_only("wide_adam_lr1x", "wide_adam", f"MLP regression 2 x 128, Adam at the stable LR ({ADAM_LR:g})",
                        functools.partial(_WIDE, optimizer="adam", lr=ADAM_LR), STEPS),
        Scenario(
            "transformer_lr25x", "transformer",
            f"character transformer (post-norm, no warm-up), AdamW at 25x the stable LR ({25 * ADAMW_LR:g}): it "
            "never learns (the loss stays at the letters' frequencies), never overflows",
            functools.partial(CharTransformer, lr=25 * ADAMW_LR), 300, "transformer_lr1x",
        ),
        Scenario(
            "deep10_init_x1.6", "deep10",
            "10 ReLU layers of width 48 drawn at 1.6x Kaiming's std: the activations grow 1.6x a layer (110x at the "
            "output), the gradients are out of scale from the first step",
            functools.partial(_DEEP10, kaiming=1.6), STEPS, "deep10_kaiming", quick=True,
        ),
        Scenario(
            "deep10_kaiming", "deep10", "the same 10 ReLU layers drawn at Kaiming's std (harmless)",
            functools.partial(_DEEP10, kaiming=1.0), STEPS, "deep10_kaiming", stable=True, harmless=True,
        ),
        Scenario(
            "tanh_rnn_gain2", "tanh_rnn",
            "a tanh RNN over 64 steps, SGD, recurrent matrix orthogonal x 2: the recurrence explodes until the "
            "state saturates",
            functools.partial(_TANH_RNN, gain=2.0), 200, "tanh_rnn_healthy",
        ),
        Scenario(
            "tanh_rnn_healthy", "tanh_rnn", "the same tanh RNN with an orthogonal recurrent matrix (gain 1) (harmless)",
            functools.partial(_TANH_RNN, gain=1.0), 200, "tanh_rnn_healthy", stable=True, harmless=True,
        ),
        _periodic(40, 50.0, quick=True),
        Scenario(
            "slow_starter", "slow_starter",
            "MLP regression 4 x 64, SGD, every layer drawn from N(0, 0.05): the loss sits flat near its start for "
            "about 150 steps, then it learns (harmless)",
            functools.partial(_SLOW_START, lr=SGD_LR), STEPS, "slow_starter", stable=True, harmless=True, quick=True,
        ),
    ]  # fmt: skip


def _hard_held_out() -> list[Scenario]:
    """The families of :func:`_hard` at other magnitudes (:data:`HARD_HELD_OUT`)."""
    return [
        *_growing(2.5, 150, 150, suffix="_slowly"),
        *[
            Scenario(
                f"wide_sgd_lr{m}x", "wide_sgd",
                f"MLP regression 2 x 128, SGD + momentum 0.9 at {m}x the stable LR ({m * SGD_LR:g})",
                functools.partial(_WIDE, lr=m * SGD_LR), STEPS, "wide_sgd_lr1x",
            )
            for m in (4, 10)
        ],
        *[
            Scenario(
                f"wide_adam_lr{m}x", "wide_adam",
                f"MLP regression 2 x 128, Adam at {m}x the stable LR ({m * ADAM_LR:g})",
                functools.partial(_WIDE, optimizer="adam", lr=m * ADAM_LR), STEPS, "wide_adam_lr1x",
            )
            for m in (3, 8)
        ],
        *[
            Scenario(
                f"transformer_lr{m}x", "transformer",
                f"character transformer (post-norm, no warm-up), AdamW at {m}x the stable LR ({m * ADAMW_LR:g})",
                functools.partial(CharTransformer, lr=m * ADAMW_LR), 300, "transformer_lr1x",
            )
            for m in (12, 40)
        ],
        *[
            Scenario(
                f"deep10_init_x{k:g}", "deep10",
                f"10 ReLU layers of width 48 drawn at {k:g}x Kaiming's std: the activations grow {k:g}x a layer",
                functools.partial(_DEEP10, kaiming=k), STEPS, "deep10_kaiming",
            )
            for k in (1.3, 2.2)
        ],
        Scenario(
            "tanh_rnn_gain2.5", "tanh_rnn", "a tanh RNN over 64 steps, SGD, recurrent matrix orthogonal x 2.5",
            functools.partial(_TANH_RNN, gain=2.5), 200, "tanh_rnn_healthy",
        ),
        _periodic(30, 300.0, quick=True),
        _periodic(70, 20.0),
        Scenario(
            "slow_starter_6_layers", "slow_starter_6_layers",
            "MLP regression 6 x 64, SGD, every layer drawn from N(0, 0.08): the loss sits flat near its start for "
            "about 300 steps, then it learns (harmless)",
            functools.partial(Regression, depth=6, init_std=0.08, lr=SGD_LR), 500, "slow_starter_6_layers",
            stable=True, harmless=True,
        ),
    ]  # fmt: skip


SCENARIOS: dict[str, Scenario] = {s.name: s for s in _catalogue()}
HELD_OUT: dict[str, Scenario] = {s.name: s for s in _held_out()}  # the references it names are in SCENARIOS or here
HARD: dict[str, Scenario] = {s.name: s for s in _hard()}  # references in SCENARIOS or here
HARD_HELD_OUT: dict[str, Scenario] = {s.name: s for s in _hard_held_out()}  # references in the three above or here
SETS: dict[str, dict[str, Scenario]] = {"matrix": SCENARIOS, "held-out": HELD_OUT, "hard": HARD,
                                        "hard-held-out": HARD_HELD_OUT}  # fmt: skip
_EVERY: dict[str, Scenario] = {**SCENARIOS, **HELD_OUT, **HARD, **HARD_HELD_OUT}


def scenario(name: str) -> Scenario:
    """The scenario called ``name``, in any of :data:`SETS`.

    Raises:
        ValueError: no scenario has that name.
    """
    if name not in _EVERY:
        raise ValueError(f"'scenario' must be one of {', '.join(map(repr, _EVERY))} (got {name!r})")
    return _EVERY[name]
