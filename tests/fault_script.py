"""A training script for the fault tests, started by ``trainscale run`` (torchrun).

Each rank appends the sample ids of every micro-batch it trains on to
``OUT/ids-rank{R}-attempt{A}.jsonl`` (one line per micro-batch, flushed, so a SIGKILL loses nothing
written before it) and, at the end, saves its weights to ``OUT/final-rank{R}.pt``.
``--kill-at-step S`` makes rank 1 SIGKILL itself at optimizer step S of the first attempt;
``--stall-at-step S`` makes it stall there for good (after writing ``OUT/stalled``).
``--strategy fsdp --checkpoint-async --hold-async-save-at S``: checkpoints written in the background, and each
rank's writer of the step-S checkpoint stops for good once its shards are on disk (before the metadata and
the rename), after writing ``OUT/held-rank{R}`` (its pid); the test then kills the job. ``--hold-save-at S
--hold-rank R``: the same for rank R only, in whichever thread writes (synchronous or background saves): a
checkpoint file stops half written (rank 0 writes it), a sharded one once rank R's shards are on disk; the test
then kills that rank alone. ``--resume``: ``ckpt_path="last"``.

:func:`run_rank` runs the same job on a rank that ``tests.helpers.run_distributed`` forked (no torchrun): the
uninterrupted runs the tests compare with, and the resumed runs after a kill.
"""

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from trainscale import Trainer
from trainscale.models import ConvNet


class Indexed(Dataset):
    """Random images whose third field is the sample's own index."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 1, 28, 28, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i], i


class Recording(torch.nn.Module):
    def __init__(self, out: Path, kill_at: int | None, stall_at: int | None = None) -> None:
        super().__init__()
        self.out, self.stall_at = out, stall_at
        torch.manual_seed(0)
        self.net = ConvNet(batchnorm=False)
        self.trainer = None
        self.kill_at = kill_at
        rank, attempt = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        self.rank, self.attempt = rank, attempt
        self.log = open(out / f"ids-rank{rank}-attempt{attempt}.jsonl", "a")

    def training_step(self, batch):
        x, y, ids = batch
        step, epoch = self.trainer.global_step, self.trainer.current_epoch
        if self.kill_at is not None and self.attempt == 0 and self.rank == 1 and step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.stall_at is not None and self.rank == 1 and step == self.stall_at:
            (self.out / "stalled").write_text(str(time.time()))
            threading.Event().wait()  # a deadlock, as far as the loop can tell
        self.log.write(json.dumps({"epoch": epoch, "step": step, "ids": ids.tolist()}) + "\n")
        self.log.flush()
        return F.cross_entropy(self.net(x), y)


def hold_async_save_at(step: int, out: Path, rank: int) -> None:
    """Make the background writer of the step-``step`` checkpoint stop for good after this rank's shards."""
    from trainscale.runtime import checkpoint_io

    def event(stage, path):
        if stage == "shards-written" and f"-step={step}." in path.name and threading.current_thread().name != "MainThread":
            (out / f"held-rank{rank}").write_text(str(os.getpid()))
            threading.Event().wait()  # the write never ends, as far as the loop can tell

    checkpoint_io._write_event = event


def hold_save_of_one_rank_at(step: int, out: Path, rank: int, seconds: float | None = None) -> None:
    """Make this rank's write of the step-``step`` checkpoint stop for good, half written (a checkpoint file:
    stage "partial") or once its shards are on disk (sharded: "shards-written"), in any thread; for ``seconds``
    only, when given."""
    from trainscale.runtime import checkpoint_io

    def event(stage, path):
        if stage in ("partial", "shards-written") and f"-step={step}." in path.name:
            (out / f"held-rank{rank}").write_text(str(os.getpid()))
            threading.Event().wait(seconds)

    checkpoint_io._write_event = event


def final_weights(module) -> dict:
    """Full weights (a sharded DTensor gathered: every rank calls this)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in module.state_dict().items()}


@record
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--kill-at-step", type=int, default=None)
    p.add_argument("--stall-at-step", type=int, default=None)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--timeout", type=float, default=60)
    p.add_argument("--strategy", default="auto")
    p.add_argument("--checkpoint-async", action="store_true")
    p.add_argument("--hold-async-save-at", type=int, default=None)
    p.add_argument("--hold-save-at", type=int, default=None)
    p.add_argument("--hold-rank", type=int, default=0)
    p.add_argument("--hold-for", type=float, default=None)
    p.add_argument("--resume", action="store_true")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(accelerator="cpu", devices="auto", strategy=args.strategy, max_epochs=args.epochs, seed=0,
                      default_root_dir=out / "runs", enable_progress_bar=False, checkpoint_every_n_steps=args.every,
                      log_every_n_steps=5, timeout=args.timeout, checkpoint_async=args.checkpoint_async)
    model = Recording(out, args.kill_at_step, args.stall_at_step)
    model.trainer = trainer
    if args.hold_async_save_at is not None:
        hold_async_save_at(args.hold_async_save_at, out, model.rank)
    if args.hold_save_at is not None and model.rank == args.hold_rank:
        hold_save_of_one_rank_at(args.hold_save_at, out, model.rank, args.hold_for)
    trainer.fit(model, DataLoader(Indexed(96), batch_size=4, shuffle=True),
                optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
                ckpt_path="last" if args.resume else None)
    torch.save(final_weights(model.net), out / f"final-rank{model.rank}.pt")
    trainer.runtime.teardown()


def run_rank(rank: int, argv: list[str], log: str | None = None) -> None:
    """``main(argv)`` on a rank of ``run_distributed``, with ``sys.argv`` as under torchrun (a run is tied to
    its script: ``ckpt_path="last"`` finds this script's runs); its output (file descriptors 1 and 2) to
    ``log`` if given."""
    sys.argv = [__file__, *argv]
    if log is not None:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    main(argv)


if __name__ == "__main__":
    main()
