"""Lightning-style modules and the bodies of their multi-process tests (module level for ``spawn``)."""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from tests import workers
from trainscale.lightning.module import TrainingModule


class LitClassifier(TrainingModule):
    """The shape of Lightning's MNIST example: batch_idx, self.log, [opt], [sched]."""

    def __init__(self):
        super().__init__()
        self.net = workers.make_model(0)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss_logged", loss, prog_bar=True)
        return {"loss": loss}

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(1) == y).float().mean())

    def configure_optimizers(self):
        opt = workers.sgd(self.parameters())
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=100)]  # steps at epoch ends: lr unchanged here


def lit_body(rank: int, root: str) -> dict:
    from trainscale.loop.trainer import Trainer

    trainer = Trainer(accelerator="cpu", devices="auto", max_epochs=2, seed=0, default_root_dir=root,
                      enable_progress_bar=False, timeout=60)
    model = LitClassifier()
    trainer.fit(model, DataLoader(workers.tiny_dataset(96), batch_size=8, shuffle=True),
                DataLoader(workers.tiny_dataset(50, seed=1), batch_size=8))
    trainer.runtime.teardown()
    return {"state": {k: v.detach().clone() for k, v in model.net.state_dict().items()}, "history": trainer.history}


def indexed_dataset(n: int) -> TensorDataset:
    """Sample i is (x = i as a float feature, y = i % 2)."""
    x = torch.arange(n, dtype=torch.float32).reshape(n, 1)
    return TensorDataset(x, torch.arange(n) % 2)


class Logger(TrainingModule):
    """Logs values whose exact reduction over all samples is known."""

    def __init__(self, extra_on_rank: int | None = None, with_metric: bool = False):
        super().__init__()
        self.lin = nn.Linear(1, 2)
        self.extra_on_rank = extra_on_rank
        self.metric_x = None
        if with_metric:  # a torchmetrics Metric logged as the object: compute() syncs its states (3 s to import)
            import torchmetrics

            self.metric_x = torchmetrics.MeanMetric()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.lin(x), y)

    def validation_step(self, batch, batch_idx):
        x, _ = batch
        self.log("mean_x", x.mean())
        self.log("count", float(len(x)), reduce_fx="sum")
        self.log("max_x", x.max(), reduce_fx="max")
        if self.metric_x is not None:
            self.metric_x.update(x)
            self.log("metric_mean_x", self.metric_x)
        if self.extra_on_rank == self.global_rank:
            self.log("only_here", 1.0)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def log_reduction_body(rank: int, n: int, extra_on_rank: int | None = None, strategy: str = "auto",
                       with_metric: bool = False) -> dict | str:
    from trainscale.loop.trainer import Trainer

    trainer = Trainer(accelerator="cpu", devices="auto", strategy=strategy, enable_progress_bar=False, timeout=60,
                      enable_checkpointing=False, default_root_dir=f"/tmp/unused-{n}")
    try:
        return trainer.validate(Logger(extra_on_rank, with_metric), DataLoader(indexed_dataset(n), batch_size=4))[0]
    except ValueError as err:
        return f"ValueError: {err}"
    finally:
        trainer.runtime.teardown()


class Returner(TrainingModule):
    """``validation_step`` returns "mean_x" for every batch, "odd_x" only for batches of odd ``batch_idx``, and
    "only_here" on rank ``extra_on_rank`` only; ``predict_step`` returns a dict of the sample's index and an
    output tensor."""

    def __init__(self, extra_on_rank: int | None = None, with_metric: bool = False):
        super().__init__()
        self.lin = nn.Linear(1, 2)
        self.extra_on_rank = extra_on_rank
        self.metric_x = None
        if with_metric:  # a torchmetrics Metric logged as the object: compute() syncs its states (3 s to import)
            import torchmetrics

            self.metric_x = torchmetrics.MeanMetric()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.lin(x), y)

    def validation_step(self, batch, batch_idx):
        x, _ = batch
        out = {"mean_x": x.mean()}
        if batch_idx % 2 == 1:
            out["odd_x"] = x.mean()
        if self.extra_on_rank == self.global_rank:
            out["only_here"] = x.mean()
        return out

    def predict_step(self, batch, batch_idx):
        x, _ = batch
        return {"index": x[:, 0].long(), "doubled": 2 * x, "names": [f"s{int(v)}" for v in x[:, 0]]}


def returned_keys_body(rank: int, n: int, root: str) -> dict:
    """What a fit's epoch record holds of :class:`Returner`'s returned validation keys (and the error when a key is
    returned on rank 1 only), what ``validate`` returns (only logged values, as Lightning's: none), and what
    ``predict`` gathers, with batches of 4 samples of :func:`indexed_dataset`."""
    from trainscale.loop.trainer import Trainer

    trainer = Trainer(accelerator="cpu", devices="auto", enable_progress_bar=False, timeout=60, max_steps=1,
                      num_sanity_val_steps=0, enable_checkpointing=False, default_root_dir=root)
    loader = DataLoader(indexed_dataset(n), batch_size=4)
    trainer.fit(Returner(), loader, loader, optimizer=lambda params: torch.optim.SGD(params, lr=0.0))
    out = {"recorded": trainer.history[-1], "validated": trainer.validate(Returner(), loader)[0],
           "predicted": trainer.predict(Returner(), loader)}
    try:
        trainer.validate(Returner(extra_on_rank=1), loader)
    except ValueError as err:
        out["error"] = str(err)
    trainer.runtime.teardown()
    return out


def tp_log_reduction_body(rank: int, n: int) -> dict:
    """``log_reduction_body`` under tensor parallelism over all ranks (one data-parallel rank: every rank
    reads all ``n`` samples)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel

    from trainscale.loop.trainer import Trainer

    trainer = Trainer(accelerator="cpu", devices="auto", strategy="tp", enable_progress_bar=False, timeout=60,
                      enable_checkpointing=False, default_root_dir=f"/tmp/unused-tp-{n}",
                      tp_plan={"lin": ColwiseParallel(output_layouts=Replicate())})
    try:
        return trainer.validate(Logger(), DataLoader(indexed_dataset(n), batch_size=4))[0]
    finally:
        trainer.runtime.teardown()


# -- a GAN with manual optimization ------------------------------------------------------------------
def gan_dataset(n: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 8, generator=g) + 1.0)  # (noise z, real x)


def make_gan() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8)), nn.Sequential(nn.Linear(8, 1))


ACCUMULATE = 2


def gan_losses(generator, discriminator, z, x):
    ones, zeros = torch.ones(len(x), 1), torch.zeros(len(x), 1)
    d_loss = lambda: (F.binary_cross_entropy_with_logits(discriminator(x), ones)  # noqa: E731
                      + F.binary_cross_entropy_with_logits(discriminator(generator(z).detach()), zeros))
    g_loss = lambda: F.binary_cross_entropy_with_logits(discriminator(generator(z)), ones)  # noqa: E731
    return d_loss, g_loss


def gan_optimizers(discriminator, generator, momentum: float = 0.5):
    """Both optimizers keep state (momentum), so a resume that loses it ends at other weights."""
    return (torch.optim.SGD(discriminator.parameters(), lr=0.1, momentum=momentum),
            torch.optim.SGD(generator.parameters(), lr=0.1, momentum=momentum))


CLIP = 0.05  # below the gradient norms of this GAN: every step clips (asserted in gan_reference)


class GAN(TrainingModule):
    """Lightning's GAN with accumulation, a step every ACCUMULATE batches: toggle_optimizer/untoggle_optimizer;
    with ``sync_control`` Lightning's ``opt.toggle_model(sync_grad=boundary)`` instead (gradients synchronised
    on the accumulation boundary only); with ``clip``, ``self.clip_gradients(opt, gradient_clip_val=clip)``."""

    automatic_optimization = False
    sync_control = False
    clip: float | None = None

    def __init__(self, momentum: float = 0.5):
        super().__init__()
        self.save_hyperparameters()  # saved in its checkpoints: load_from_checkpoint rebuilds it
        self.generator, self.discriminator = make_gan()

    @contextlib.contextmanager
    def _toggled(self, opt, boundary: bool):
        if self.sync_control:
            with opt.toggle_model(sync_grad=boundary):
                yield
            return
        self.toggle_optimizer(opt)
        yield
        self.untoggle_optimizer(opt)

    def training_step(self, batch, batch_idx):
        z, x = batch
        d_loss, g_loss = gan_losses(self.generator, self.discriminator, z, x)
        boundary = (batch_idx + 1) % ACCUMULATE == 0
        for opt, loss_fn in zip(self.optimizers(), (d_loss, g_loss)):
            with self._toggled(opt, boundary):
                loss = loss_fn()
                self.manual_backward(loss / ACCUMULATE)
            if boundary:
                if self.clip is not None:
                    self.clip_gradients(opt, gradient_clip_val=self.clip)
                opt.step()
                opt.zero_grad()
        self.log("g_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        z, x = batch
        self.log("d_real", self.discriminator(x).mean())

    def configure_optimizers(self):
        return gan_optimizers(self.discriminator, self.generator, self.hparams.momentum)


class SyncGAN(GAN):
    sync_control = True


class ClippedGAN(GAN):
    clip = CLIP


class GANWithOwnParameter(GAN):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(2))


def gan_reference(batch_size: int, epochs: int, clip: float | None = None) -> dict:
    """The same GAN in a hand-written loop, one process, sequential batches; ``clip``: each optimizer's
    gradients clipped to that total norm before its step (they must exceed it)."""
    generator, discriminator = make_gan()
    opts = gan_optimizers(discriminator, generator)
    for _ in range(epochs):
        for batch_idx, (z, x) in enumerate(DataLoader(gan_dataset(), batch_size=batch_size)):
            d_loss, g_loss = gan_losses(generator, discriminator, z, x)
            for opt, loss_fn, other in ((opts[0], d_loss, generator), (opts[1], g_loss, discriminator)):
                for p in other.parameters():
                    p.requires_grad_(False)
                (loss_fn() / ACCUMULATE).backward()
                if (batch_idx + 1) % ACCUMULATE == 0:
                    if clip is not None:
                        params = [p for group in opt.param_groups for p in group["params"]]
                        assert torch.nn.utils.clip_grad_norm_(params, clip) > clip
                    opt.step()
                    opt.zero_grad()
                for p in other.parameters():
                    p.requires_grad_(True)
    return {**{f"generator.{k}": v for k, v in generator.state_dict().items()},
            **{f"discriminator.{k}": v for k, v in discriminator.state_dict().items()}}


def gan_body(rank: int, root: str, batch_size: int, epochs: int, gan: type = GAN, teardown: bool = True) -> dict:
    from trainscale.loop.trainer import Trainer

    trainer = Trainer(accelerator="cpu", devices="auto", max_epochs=epochs, default_root_dir=root,
                      enable_progress_bar=False, timeout=60)
    model = gan()
    trainer.fit(model, DataLoader(gan_dataset(), batch_size=batch_size))
    if teardown:  # False: another Trainer follows in these processes, on the same process group
        trainer.runtime.teardown()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def ddp_gans_body(rank: int, root: str) -> dict:
    """The GAN and the clipping GAN under ddp (2 ranks × batch 4, 2 epochs), in the same processes."""
    return {"GAN": gan_body(rank, f"{root}/gan", 4, 2, GAN, teardown=False),
            "ClippedGAN": gan_body(rank, f"{root}/clipped", 4, 2, ClippedGAN)}


def _full_weights(model: nn.Module) -> dict:
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()}


def _fit_gan(gan: type, root: str, epochs: int, ckpt_path: str | None = None) -> tuple[dict, int, object]:
    """Fit ``gan`` under fsdp (2 ranks × batch 4): its full weights, the reduce-scatters FSDP issued, the Trainer."""
    import torch.distributed as dist

    from trainscale.loop.trainer import Trainer

    calls = []
    reduce_scatter = dist.reduce_scatter_single  # what FSDP2's DefaultReduceScatter calls (torch 2.13)

    def counted(*args, **kwargs):
        calls.append(1)
        return reduce_scatter(*args, **kwargs)

    dist.reduce_scatter_single = counted
    try:
        trainer = Trainer(accelerator="cpu", devices="auto", strategy="fsdp", max_epochs=epochs, default_root_dir=root,
                          enable_progress_bar=False, timeout=60)
        model = gan()
        trainer.fit(model, DataLoader(gan_dataset(), batch_size=4), DataLoader(gan_dataset(8), batch_size=2),
                    ckpt_path=ckpt_path)  # evaluation runs through the FSDP root
        return {**_full_weights(model), "d_real": trainer.callback_metrics["d_real"]}, len(calls), trainer
    finally:
        dist.reduce_scatter_single = reduce_scatter


def fsdp_gan_body(rank: int, root: str) -> dict:
    """Under fsdp: the synced GAN for 2 epochs straight; for 1 epoch, then resumed to 2 from its checkpoint;
    the toggle_optimizer GAN; the GAN clipping its gradients; the refusal of a parameter on the GAN itself."""
    out = {}
    out["sync"], out["sync_reduce_scatters"], _ = _fit_gan(SyncGAN, f"{root}/sync", 2)
    _fit_gan(SyncGAN, f"{root}/resumed", 1)
    out["resumed"], _, _ = _fit_gan(SyncGAN, f"{root}/resumed", 2, ckpt_path="last")
    out["toggle"], out["toggle_reduce_scatters"], _ = _fit_gan(GAN, f"{root}/toggle", 2)
    out["clipped"], _, trainer = _fit_gan(ClippedGAN, f"{root}/clipped", 2)
    try:
        _fit_gan(GANWithOwnParameter, f"{root}/own", 1)
    except ValueError as err:
        out["own_parameter"] = str(err)
    trainer.runtime.teardown()
    return out


def mesh_gan_body(rank: int, root: str) -> dict:
    """The synced GAN under model_parallel with dp_shard 2 (FSDP2 on the mesh's data-parallel dimension, as
    hsdp shards within a replica), under tp (each Linear split over 2 ranks, which share every batch) and
    under fsdp with "16-mixed" (float16 autocast, GradScaler), 2 epochs each, in the same processes: full
    weights and the discriminator's validation output."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from trainscale.loop.trainer import Trainer

    runs = {"dp_shard": dict(strategy="model_parallel", parallel={"dp_shard": 2}),
            "tp": dict(strategy="tp", tp_plan={"generator.0": ColwiseParallel(), "generator.2": RowwiseParallel(),
                                               "discriminator.0": RowwiseParallel(input_layouts=Replicate())}),
            "fsdp-16-mixed": dict(strategy="fsdp", precision="16-mixed")}
    out = {}
    for name, flags in runs.items():
        trainer = Trainer(accelerator="cpu", devices="auto", max_epochs=2, default_root_dir=f"{root}/{name}",
                          enable_progress_bar=False, timeout=60, **flags)
        model = SyncGAN()
        trainer.fit(model, DataLoader(gan_dataset(), batch_size=4), DataLoader(gan_dataset(8), batch_size=2))
        out[name] = {**_full_weights(model), "d_real": trainer.callback_metrics["d_real"]}
    trainer.runtime.teardown()
    return out


# -- callbacks and prediction --------------------------------------------------------------------------
def early_stopping_body(rank: int, root: str) -> tuple[int, int, int, bool]:
    """(epochs recorded, the stopped epoch, ``trainer.current_epoch`` after fit, whether this rank warned that the
    sequential training loader is not shuffled)."""
    import warnings

    from trainscale.callbacks import EarlyStopping
    from trainscale.loop.trainer import Trainer

    stop = EarlyStopping("mean_x", patience=1)
    trainer = Trainer(accelerator="cpu", devices="auto", max_epochs=10, default_root_dir=root,
                      enable_progress_bar=False, timeout=60, callbacks=[stop], enable_checkpointing=False)
    model = Logger()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, DataLoader(indexed_dataset(16), batch_size=4), DataLoader(indexed_dataset(9), batch_size=4))
    trainer.runtime.teardown()
    warned = any("Lightning would shuffle it" in str(w.message) for w in caught)
    return len(trainer.history), stop.stopped_epoch, trainer.current_epoch, warned


def predict_body(rank: int, n: int) -> torch.Tensor:
    from trainscale.loop.trainer import Trainer

    trainer = Trainer(accelerator="cpu", devices="auto", enable_progress_bar=False, timeout=60)
    out = trainer.predict(workers.make_model(0), DataLoader(workers.tiny_dataset(n, seed=3), batch_size=4))
    trainer.runtime.teardown()
    return out


def evaluate_checkpoint_body(rank: int, root: str, strategy: str) -> dict:
    """Fit 3 epochs with a ModelCheckpoint that keeps the epoch of the lowest val_loss (random labels: the first,
    the model overfits) and one that saves every epoch (so "last" is the final epoch's: the first saves only what
    enters its top 1), then validate with the model's own weights, with ckpt_path="best", and predict with
    ckpt_path="last"; the full weights after each (DTensors gathered under fsdp)."""
    from trainscale.callbacks import ModelCheckpoint
    from trainscale.loop.trainer import Trainer

    callback = ModelCheckpoint(monitor="val_loss", mode="min")
    newest = ModelCheckpoint(filename="newest-{epoch}")
    trainer = Trainer(accelerator="cpu", devices="auto", strategy=strategy, max_epochs=3, default_root_dir=root,
                      timeout=60, enable_progress_bar=False, callbacks=[callback, newest])
    model, val = workers.make_model(0), DataLoader(workers.tiny_dataset(20, seed=3), batch_size=4)
    trainer.fit(model, DataLoader(workers.tiny_dataset(48), batch_size=8), val, optimizer=workers.sgd)
    out = {"history": [r["val_loss"] for r in trainer.history], "best_path": callback.best_model_path,
           "own": trainer.validate(model, val)[0]["val_loss"]}
    out["best"] = trainer.validate(model, val, ckpt_path="best")[0]["val_loss"]
    out["best_weights"] = _full_weights(model)
    out["last_predictions"] = trainer.predict(model, val, ckpt_path="last")
    out["last_weights"] = _full_weights(model)
    trainer.runtime.teardown()
    return out


class RankScored(TrainingModule):
    """Logs ``score`` per step, unsynced, falling on rank 0 and rising on rank 1: the ranks disagree on whether a
    step's checkpoint enters a top 1."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(1, 2)

    def training_step(self, batch, batch_idx):
        step = float(self.global_step)
        self.log("score", 10.0 - step if self.global_rank == 0 else step)
        x, y = batch
        return F.cross_entropy(self.lin(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def top_k_decision_body(rank: int, root: str) -> list[str]:
    """A 2-rank fit whose ModelCheckpoint(monitor="score", save_top_k=1) saves every step by rank zero's values
    (rank 1's own would save only the first, and the ranks would wait for each other); the steps taken and each
    rank's best checkpoint."""
    from trainscale.callbacks import ModelCheckpoint
    from trainscale.loop.trainer import Trainer

    callback = ModelCheckpoint(dirpath=f"{root}/ckpts", monitor="score", save_top_k=1, every_n_train_steps=1,
                               filename="{step}")
    trainer = Trainer(accelerator="cpu", devices="auto", strategy="ddp", max_epochs=1, default_root_dir=root,
                      timeout=60, enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    trainer.fit(RankScored(), DataLoader(indexed_dataset(16), batch_size=2))
    trainer.runtime.teardown()
    return [str(trainer.global_step), os.path.basename(callback.best_model_path)]


class MNISTShapedData:
    """A LightningDataModule's shape (duck-typed: no base class): the data of ``lit_body`` behind the hooks."""

    def __init__(self):
        self.calls: list[str] = []

    def prepare_data(self):
        self.calls.append("prepare_data")

    def setup(self, stage):
        self.calls.append(f"setup:{stage}")
        self.train, self.val = workers.tiny_dataset(96), workers.tiny_dataset(50, seed=1)

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=8, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=8)

    def test_dataloader(self):
        return DataLoader(self.val, batch_size=8)


class LitClassifierWithTest(LitClassifier):
    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("loss", F.cross_entropy(self(x), y))


def datamodule_body(rank: int, root: str) -> dict:
    """``lit_body`` with its loaders in a data module: ``fit(model, datamodule=dm)``, then ``test``."""
    from trainscale.loop.trainer import Trainer

    trainer = Trainer(accelerator="cpu", devices="auto", max_epochs=2, seed=0, default_root_dir=root,
                      enable_progress_bar=False, timeout=60)
    model, dm = LitClassifierWithTest(), MNISTShapedData()
    trainer.fit(model, datamodule=dm)
    calls = list(dm.calls)
    (tested,) = trainer.test(model, datamodule=dm)
    trainer.runtime.teardown()
    return {"state": {k: v.detach().clone() for k, v in model.net.state_dict().items()}, "calls": calls,
            "test": tested}


class SyncDistOnOneRank(TrainingModule):
    """Logs "acc" with ``sync_dist=True`` on rank 1 only (a branch some ranks take)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(1, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.lin(x)
        if self.global_rank == 1:
            self.log("acc", (logits.argmax(1) == y).float().mean(), sync_dist=True)
        return F.cross_entropy(logits, y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class BackwardSkippedOnOneRank(SyncDistOnOneRank):
    """Manual optimization whose rank 1 skips ``self.manual_backward`` (its batch "has nothing to learn")."""

    automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        loss = F.cross_entropy(self.lin(x), y)
        if self.global_rank != 1:
            self.manual_backward(loss)
        opt.step()
        opt.zero_grad()
        return loss


def rank_mismatch_body(rank: int, root: str) -> dict:
    """Under ddp, then fsdp, on 2 ranks, one process group for all: :class:`SyncDistOnOneRank` and
    :class:`BackwardSkippedOnOneRank`; each one's error as "Type: message" ("none" if it trained), keyed
    "sync_dist", "manual_backward" (ddp) and "fsdp/sync_dist", "fsdp/manual_backward"."""
    import warnings

    from trainscale.loop.trainer import Trainer

    out = {}
    for name, strategy, model in (("sync_dist", "ddp", SyncDistOnOneRank()),
                                  ("manual_backward", "ddp", BackwardSkippedOnOneRank()),
                                  ("fsdp/sync_dist", "fsdp", SyncDistOnOneRank()),
                                  ("fsdp/manual_backward", "fsdp", BackwardSkippedOnOneRank())):
        trainer = Trainer(accelerator="cpu", devices="auto", strategy=strategy, max_steps=2, log_every_n_steps=1,
                          logger=False, default_root_dir=f"{root}/{name}", enable_progress_bar=False, timeout=30)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # rank 1's own "step() with no gradients" warning
                trainer.fit(model, DataLoader(indexed_dataset(16), batch_size=4))
            out[name] = "none"
        except (ValueError, RuntimeError) as err:
            out[name] = f"{type(err).__name__}: {err}"
    trainer.runtime.teardown()
    return out


# -- the PyTorch profiler on two ranks ----------------------------------------------------------------
def pytorch_profiler_body(rank: int, root: str) -> dict:
    """3 optimizer steps under ``Trainer(profiler="pytorch")`` (Lightning's default schedule records the 3rd):
    each rank's trace files and the run directory."""
    from trainscale.loop.trainer import Trainer

    trainer = Trainer(accelerator="cpu", devices="auto", profiler="pytorch", max_steps=3, timeout=60,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      logger=False, default_root_dir=root)
    trainer.fit(workers.make_model(0), DataLoader(workers.tiny_dataset(24), batch_size=4), optimizer=workers.sgd)
    trainer.runtime.teardown()
    return {"traces": [str(p) for p in trainer.profiler.trace_paths], "run_dir": str(trainer.run_dir)}


class SyncDistSteps(TrainingModule):
    """Logs on every step, with ``sync_dist=True``, ``rank + 1`` reduced by "sum", "mean" and "max", and the
    rank unsynced; trains nothing (lr 0)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(1, 1)

    def training_step(self, batch, batch_idx):
        value = float(self.trainer.global_rank + 1)
        for fx in ("sum", "mean", "max"):
            self.log(f"by_{fx}", value, on_step=True, on_epoch=False, sync_dist=True, reduce_fx=fx)
        self.log("own_rank", float(self.trainer.global_rank), on_step=True, on_epoch=False)
        return self.lin(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def sync_dist_steps_body(rank: int, root: str, log_every_n_steps: int) -> dict:
    """``callback_metrics`` (as floats) after a fit of 3 steps of :class:`SyncDistSteps` on each rank."""
    from trainscale.loop.trainer import Trainer

    trainer = Trainer(accelerator="cpu", devices="auto", max_epochs=1, enable_progress_bar=False, timeout=60,
                      enable_checkpointing=False, default_root_dir=root, log_every_n_steps=log_every_n_steps)
    trainer.fit(SyncDistSteps(), DataLoader(indexed_dataset(12), batch_size=2))
    trainer.runtime.teardown()
    return {name: float(v) for name, v in trainer.callback_metrics.items()}


def two_loaders_body(rank: int, set_a: list, set_b: list, root: str, strategy: str = "auto") -> dict:
    """``validate`` and ``predict`` of ``test_lightning_compat._TwoSets`` with two loaders (batches of 2) on this
    process's world: the per-loader results, every sample's prediction per loader, and this rank's batches per
    loader during a 1-epoch fit."""
    from tests.test_lightning_compat import _TwoSets, _values
    from trainscale.loop.trainer import Trainer

    trainer = Trainer(accelerator="cpu", devices="auto", strategy=strategy, enable_progress_bar=False, timeout=60,
                      max_epochs=1, enable_checkpointing=False, logger=False, enable_model_summary=False,
                      default_root_dir=root)
    try:
        model = _TwoSets()
        trainer.fit(model, _values(set_a), [_values(set_a), _values(set_b)])
        num_val_batches = trainer.num_val_batches
        validated = trainer.validate(model, [_values(set_a), _values(set_b)], verbose=False)
        predicted = trainer.predict(model, [_values(set_a), _values(set_b)])
        return {"validate": validated, "num_val_batches": num_val_batches,
                "predict": [torch.cat(p).flatten().tolist() for p in predicted]}
    finally:
        trainer.runtime.teardown()


class SkipsSecondBatch(LitClassifier):
    """Returns None from ``training_step`` for its second batch (batch_idx 1) on every rank."""

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        return None if batch_idx == 1 else out


def skipped_step_body(rank: int) -> str:
    """A fit whose ``training_step`` returns None on every rank at batch 1: the error's text (each rank raises it,
    so no rank waits in the gradient all-reduce)."""
    from trainscale.loop.trainer import Trainer

    trainer = Trainer(accelerator="cpu", devices="auto", strategy="ddp", max_epochs=1, enable_progress_bar=False,
                      enable_checkpointing=False, logger=False, timeout=30)
    try:
        trainer.fit(SkipsSecondBatch(), DataLoader(workers.tiny_dataset(32), batch_size=4))
    except RuntimeError as err:
        return str(err)
    finally:
        trainer.runtime.teardown()
    return "no error"


class LBFGSRegression(TrainingModule):
    """A linear regression fitted with L-BFGS under automatic optimization; keeps its first weights and the batch of
    each step (its first evaluation's)."""

    def __init__(self, line_search_fn):
        super().__init__()
        self.net = nn.Linear(3, 1)
        self.first = {k: v.clone() for k, v in self.net.state_dict().items()}
        self.line_search_fn = line_search_fn
        self.steps: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.evaluations = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        if len(self.steps) == batch_idx:  # the step's first evaluation
            self.steps.append((x.clone(), y.clone()))
        self.evaluations += 1
        return (self.net(x).squeeze(-1) - y).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=6, line_search_fn=self.line_search_fn)


def regression_dataset(n: int = 32) -> TensorDataset:
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(n, 3, generator=generator)
    return TensorDataset(x, x @ torch.tensor([1.0, -2.0, 0.5]) + 0.1 * torch.randn(n, generator=generator))


def lbfgs_ddp_body(rank: int, line_search_fn) -> dict:
    """Three L-BFGS steps under ddp, 4 samples per rank and step: the first and last weights, each step's batch and
    the evaluations of the loss."""
    from trainscale.loop.trainer import Trainer

    torch.manual_seed(rank)  # different first weights on each rank: ddp broadcasts rank 0's
    model = LBFGSRegression(line_search_fn)
    trainer = Trainer(accelerator="cpu", devices="auto", strategy="ddp", max_steps=3, enable_progress_bar=False,
                      enable_checkpointing=False, logger=False, num_sanity_val_steps=0, timeout=30)
    try:
        trainer.fit(model, DataLoader(regression_dataset(), batch_size=4))
    finally:
        trainer.runtime.teardown()
    return {"first": model.first, "last": {k: v.detach().clone() for k, v in model.net.state_dict().items()},
            "steps": model.steps, "evaluations": model.evaluations}
