"""Bodies of the fault-tolerance tests (module level so the ranks of ``run_distributed`` can import them)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from trainscale.models import ConvNet


class Indexed(Dataset):
    """Random images whose third field is the sample's own index."""

    def __init__(self, n: int = 96) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 1, 28, 28, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i], i


class Recorder(torch.nn.Module):
    """ConvNet + dropout (so RNG state matters) that records the ids it trains on, with the step.
    ``hook(step)`` runs at the start of each micro-batch (sleep, send a signal, poison the loss)."""

    def __init__(self, hook=None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = ConvNet(batchnorm=False)
        self.drop = torch.nn.Dropout(0.2)
        self.seen: list[tuple[int, int, list[int]]] = []
        self.trainer = None
        self.hook = hook

    def training_step(self, batch):
        x, y, ids = batch
        step = self.trainer.global_step
        scale = self.hook(self, step) if self.hook else None
        self.seen.append((self.trainer.current_epoch, step, ids.tolist()))
        loss = F.cross_entropy(self.net(self.drop(x)), y)
        return loss * scale if scale is not None else loss

    def weights(self) -> dict:
        return {k: v.detach().clone() for k, v in self.net.state_dict().items()}


def fit(root, *, hook=None, n=96, batch=4, epochs=2, ckpt_path=None, teardown=True, own_sampler=False, **kwargs):
    """Train a :class:`Recorder`; ``own_sampler`` gives the loader a ``DistributedSampler`` of one
    replica, which the Trainer keeps (and resumes mid-epoch by skipping batches)."""
    from torch.utils.data import DistributedSampler

    from trainscale.loop.trainer import Trainer

    trainer = Trainer(accelerator="cpu", devices="auto", max_epochs=epochs, seed=0, default_root_dir=root,
                      enable_progress_bar=False,
                      log_every_n_steps=kwargs.pop("log_every_n_steps", 5), timeout=kwargs.pop("timeout", 60), **kwargs)
    model = Recorder(hook)
    model.trainer = trainer
    try:
        data = Indexed(n)
        loader = (DataLoader(data, batch_size=batch, sampler=DistributedSampler(data, 1, 0, shuffle=True))
                  if own_sampler else DataLoader(data, batch_size=batch, shuffle=True))
        summary = trainer.fit(model, loader,
                              optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), ckpt_path=ckpt_path)
    finally:
        if teardown:
            trainer.runtime.teardown()
    return model, summary


def start_ranks(fn, args: tuple, out_dir: str, world_size: int = 2):
    """Start ``fn(rank, *args)`` on ``world_size`` ranks as ``tests.helpers.run_distributed`` does (forked from its
    server, which has imported torch; each rank a real process), without waiting: the caller signals or kills
    them. Returns torch's ``ProcessContext`` (``.processes``)."""
    import multiprocessing

    import torch.multiprocessing as mp

    from tests.helpers import PRELOAD, START_METHOD, _child, free_port

    multiprocessing.get_context(START_METHOD).set_forkserver_preload(PRELOAD)
    return mp.start_processes(_child, args=(fn, world_size, free_port(), out_dir, args, dict(os.environ)),
                              nprocs=world_size, join=False, start_method=START_METHOD)


# -- 2 -> 1 ---------------------------------------------------------------------------------------
def stop_mid_epoch_body(rank: int, root: str) -> dict:
    """2 ranks, checkpoint every 5 steps, stop at step 5 (mid-epoch 0: 40 of 96 samples)."""
    model, summary = fit(root, epochs=1, max_steps=5, checkpoint_every_n_steps=5)
    return {"seen": model.seen, "summary": summary}


# -- hang ------------------------------------------------------------------------------------------
def hang_body(rank: int, root: str, timeout: float) -> dict:
    """Rank 1 sleeps before the gradient all-reduce of step 2 until rank 0 has failed (or 6 × timeout)."""
    flag = Path(root) / "rank0-failed"
    times = []

    def hook(model, step):
        times.append(time.monotonic())
        if rank == 1 and step == 2 and not hook.slept:
            hook.slept = True
            deadline = time.monotonic() + 6 * timeout
            while not flag.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return None

    hook.slept = False
    try:
        fit(root, hook=hook, epochs=1, timeout=timeout)
    except Exception as err:  # noqa: BLE001 - returned to the test
        failed_at = time.monotonic()
        if rank == 0:
            flag.touch()
        return {"error": f"{type(err).__name__}: {err}", "after_last_step_s": failed_at - times[-1]}
    return {"error": None}


# -- signals ---------------------------------------------------------------------------------------
def slow_steps_sigterm_body(rank: int, root: str, step_s: float, signal_at: int) -> dict:
    """Steps of at least ``step_s`` seconds, ``log_every_n_steps=50``; rank 1 alone receives SIGTERM
    during optimizer step ``signal_at``. Returns what ``Preempted`` carried (or that fit ended)."""
    from trainscale.faults.tolerance import Preempted

    def hook(model, step):
        time.sleep(step_s)
        if rank == 1 and step == signal_at and not hook.sent:
            hook.sent = True
            os.kill(os.getpid(), signal.SIGTERM)

    hook.sent = False
    try:
        _, summary = fit(root, hook=hook, n=192, epochs=1, log_every_n_steps=50)
    except Preempted as stop:
        return {"code": stop.code, "path": stop.path}
    return {"code": None, "steps": summary["steps"]}


def stuck_rank_body(rank: int, root: str, grace_s: float) -> None:
    """Rank 1 stalls for good in optimizer step 2 (after writing ``rank1-stuck``); rank 0 then blocks in
    the gradient all-reduce. The collective timeout (300 s) is far away: only a signal ends them, after a
    SIGTERM grace of ``grace_s`` seconds (``FaultTolerance(signal_grace_s=...)``, which the Trainer does not
    pass: its FaultTolerance is given this value here)."""
    import functools
    import threading

    from trainscale.faults import tolerance

    tolerance.FaultTolerance.__init__ = functools.partialmethod(tolerance.FaultTolerance.__init__,
                                                                signal_grace_s=grace_s)

    def hook(model, step):
        if rank == 1 and step == 2:
            (Path(root) / "rank1-stuck").touch()
            threading.Event().wait()  # a deadlock, as far as the loop can tell

    fit(root, hook=hook, n=96, epochs=1, timeout=300)


# -- save crash ------------------------------------------------------------------------------------
def crash_scenarios(rank: int, root: str) -> list[dict]:
    """For each write stage of the second checkpoint, fork a child that trains and is SIGKILLed at that
    stage; return one record per scenario: what "last" points to and whether it loads. Runs as the one
    process of ``run_distributed(..., world_size=1)``, without its launcher variables (a world of one)."""
    from trainscale.runtime import checkpoint_io
    from trainscale.runtime.world import TORCHRUN_VARS
    from trainscale.checkpointing import run_dirs as ckpt

    for name in TORCHRUN_VARS:
        os.environ.pop(name, None)
    fit(str(Path(root) / "warm-up"), epochs=1, n=8)  # first-call costs, paid once before forking
    stages = [("ckpt", stage) for stage in ("partial", "digest", "before-rename", "after-rename")]
    stages += [("last", stage) for stage in ("partial", "before-rename", "after-rename")]
    cases = []
    for name, stage in stages:
        case_root = Path(root) / f"{name}-{stage}"
        pid = os.fork()
        if pid == 0:  # child: die at the stage of the second save's write of `name`
            saves = {"n": 0}

            def event(at, path, name=name, stage=stage):
                if not (path.name == "last" or path.name.startswith("epoch=")):
                    return  # the run directory's own small files (job_id, script)
                kind = "last" if path.name == "last" else "ckpt"
                if kind == "ckpt" and at == "partial":
                    saves["n"] += 1
                if saves["n"] == 2 and kind == name and at == stage:
                    os.kill(os.getpid(), signal.SIGKILL)

            checkpoint_io._write_event = event
            try:
                fit(str(case_root), epochs=1, n=48, checkpoint_every_n_steps=2, max_steps=5)
            finally:
                os._exit(3)  # not killed: the scenario failed to inject
        _, status = os.waitpid(pid, 0)
        last = ckpt.find_last(case_root)
        out = {"case": f"{name}-{stage}", "killed": os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL,
               "last": last.name if last else None}
        try:
            out["step"] = int(checkpoint_io.load_file(last)["train_state"]["global_step"]) if last else None
        except Exception as err:  # noqa: BLE001
            out["error"] = f"{type(err).__name__}: {err}"
        out["tmp_left"] = len(list((case_root / "version_0" / "checkpoints").glob(".*.tmp")))
        cases.append(out)
    return cases
