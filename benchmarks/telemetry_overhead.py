"""What does telemetry cost? Step time with telemetry on vs off, beside a plain PyTorch loop.

    python benchmarks/telemetry_overhead.py                      # 1 and 2 processes, 5 repeats
    python benchmarks/telemetry_overhead.py --devices 2 --repeats 9 --log-every 10

Workload: the tutorial ConvNet on MNIST-5k digits, AdamW, per-device batch 64, ``--samples`` samples
per device (default 2,048: 32 steps per epoch), CPU, one thread per process. Each run trains 3
epochs; the second is timed (the first is warm-up), from the first sample it fetches to the first
sample of the third — the same clock for every variant, read by the data set (rank 0), outside
anything telemetry touches. Wall time (perf_counter) and this process's CPU time (process_time,
less disturbed by other jobs on a shared machine) are both reported. Three variants run
interleaved in the same processes — plain PyTorch (DDP by hand), ``Trainer(enable_telemetry=False)``,
``Trainer(enable_telemetry=True)`` — in a rotating order, ``--repeats`` times; the table shows the
median ms/step of each and the median of the per-repeat ratios. With ``--devices 2`` the runs use
two gloo processes started like torchrun starts them.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

VARIANTS = ("plain", "off", "on")
EPOCHS = 3


class ClockedDataset(torch.utils.data.Dataset):
    """A data set that reads (perf_counter, process_time) at the first fetch of each epoch."""

    def __init__(self, base, per_epoch: int) -> None:
        self.base, self.per_epoch = base, per_epoch
        self.calls, self.marks = 0, []

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i):
        if self.calls % self.per_epoch == 0:
            self.marks.append((time.perf_counter(), time.process_time()))
        self.calls += 1
        return self.base[i]

    def epoch_2(self) -> tuple[float, float]:
        """(wall s, CPU s) of the second epoch; resets the clock for the next run."""
        (w1, c1), (w2, c2) = self.marks[1], self.marks[2]
        self.calls, self.marks = 0, []
        return w2 - w1, c2 - c1


def _data(samples_per_device: int, world_size: int) -> ClockedDataset:
    from trainscale.data import load_mnist5k

    train, _ = load_mnist5k()
    n = min(len(train), samples_per_device * world_size)
    return ClockedDataset(torch.utils.data.TensorDataset(*(t[:n] for t in train.tensors)), -(-n // world_size))


def _plain(dataset, batch_size: int, epochs: int, seed: int) -> None:
    """A hand-written DDP loop (no trainscale)."""
    import torch.distributed as dist
    from torch.nn import functional as F
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    from trainscale.models import ConvNet

    torch.manual_seed(seed)
    model = ConvNet()
    distributed = dist.is_initialized()
    if distributed:
        model = DistributedDataParallel(model)
        sampler = DistributedSampler(dataset, shuffle=True, seed=seed)
    else:
        sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=seed)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        loss_sum = torch.zeros(())
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss_sum += loss.detach()
        if distributed:
            dist.all_reduce(loss_sum)
        print(f"epoch {epoch} loss {loss_sum.item():.3f}", file=io.StringIO())


def _trainer(dataset, batch_size: int, epochs: int, seed: int, telemetry: bool, log_every: int, root: str) -> None:
    from torch.utils.data import DataLoader

    from trainscale.models import ConvNet
    from trainscale.loop.trainer import Trainer

    with contextlib.redirect_stdout(io.StringIO()):
        trainer = Trainer(devices="auto", max_epochs=epochs, seed=seed, default_root_dir=root,
                          enable_progress_bar=False, enable_checkpointing=False, log_every_n_steps=log_every,
                          enable_telemetry=telemetry, timeout=120)
        torch.manual_seed(seed)
        trainer.fit(ConvNet(), DataLoader(dataset, batch_size=batch_size, shuffle=True),
                    optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))


def _worker(rank: int, world_size: int, port: int, args: argparse.Namespace, out: str) -> None:
    if world_size > 1:
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                           "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    dataset = _data(args.samples, world_size)
    steps = -(-len(dataset) // world_size // args.batch_size)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as root:
        if world_size > 1:  # the Trainer's Runtime creates the process group the plain loop reuses
            _trainer(dataset, args.batch_size, 1, 0, False, args.log_every, root)
        dataset.calls, dataset.marks = 0, []
        for r in range(args.repeats):
            order = VARIANTS[r % 3:] + VARIANTS[:r % 3]  # rotate so no variant always runs first
            for v in order:
                if v == "plain":
                    _plain(dataset, args.batch_size, EPOCHS, r)
                else:
                    _trainer(dataset, args.batch_size, EPOCHS, r, v == "on", args.log_every, root)
                wall, cpu_s = dataset.epoch_2()
                times[v].append(wall / steps)
                cpu[v].append(cpu_s / steps)
    if world_size > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps({"steps": steps, "times": times, "cpu": cpu}))


def run(world_size: int, args: argparse.Namespace) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        if world_size == 1:
            _worker(0, 1, port, args, out)
        else:
            torch.multiprocessing.spawn(_worker, args=(world_size, port, args, out), nprocs=world_size)
        return json.loads(Path(out).read_text())


def bookkeeping(iterations: int = 2000) -> tuple[float, float]:
    """Microseconds of telemetry calls per step (4 marks + end_step, batch counting) and
    milliseconds per ``log()`` (world size 1: no all_gather), without any training around them."""
    from trainscale.runtime.runtime import Runtime
    from trainscale.telemetry.processor import Telemetry

    rt = Runtime(accelerator="cpu", devices=1)
    rt.launch()
    tele = Telemetry(rt)
    batch = (torch.zeros(64, 1, 28, 28), torch.zeros(64, dtype=torch.long))
    tele.start()
    t0 = time.perf_counter()
    for _ in range(iterations):
        tele.mark("data", batch)
        tele.mark("forward")
        tele.mark("backward")
        tele.end_step()
    per_step = (time.perf_counter() - t0) / iterations
    t0 = time.perf_counter()
    for i in range(20):
        tele.log(i, 0, 1.0)
    per_log = (time.perf_counter() - t0) / 20
    tele.close()
    return per_step * 1e6, per_log * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2], help="world sizes to measure (default 1 2)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats of each variant (default 5)")
    parser.add_argument("--batch-size", type=int, default=64, help="per-device batch size (default 64)")
    parser.add_argument("--samples", type=int, default=2048, help="training samples per device (default 2048)")
    parser.add_argument("--log-every", type=int, default=50, help="Trainer log_every_n_steps (default 50)")
    args = parser.parse_args()

    print(f"torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start")
    print(f"ConvNet on MNIST-5k, batch {args.batch_size}/device, {args.samples} samples/device, "
          f"log_every_n_steps={args.log_every}, {args.repeats} interleaved repeats, 1 thread/process\n")
    header = (f"{'devices':>7} {'clock':>5} {'plain ms':>9} {'off ms':>9} {'on ms':>9} {'on/off':>7} "
              f"{'on/off min..max':>16} {'on÷off medians':>14} {'off/plain':>9}")
    rows = []
    for world_size in args.devices:
        result = run(world_size, args)
        for clock in ("times", "cpu"):
            t = result[clock]
            on_off = [a / b for a, b in zip(t["on"], t["off"])]
            off_plain = [a / b for a, b in zip(t["off"], t["plain"])]
            rows.append(f"{world_size:>7} {'wall' if clock == 'times' else 'cpu':>5} "
                        f"{1e3 * statistics.median(t['plain']):>9.2f} "
                        f"{1e3 * statistics.median(t['off']):>9.2f} {1e3 * statistics.median(t['on']):>9.2f} "
                        f"{statistics.median(on_off):>7.3f} {min(on_off):>7.3f}..{max(on_off):<7.3f} "
                        f"{statistics.median(t['on']) / statistics.median(t['off']):>14.3f} "
                        f"{statistics.median(off_plain):>9.3f}")
            print(f"  devices={world_size} {clock}: " + ", ".join(
                f"{v} " + " ".join(f"{1e3 * x:.1f}" for x in t[v]) for v in VARIANTS) + " ms/step", file=sys.stderr)
    print(header)
    print("\n".join(rows))
    us, ms = bookkeeping()
    print(f"\ntelemetry bookkeeping alone: {us:.1f} µs per step (marks, counting), {ms:.2f} ms per log() "
          f"at world size 1 (one per log_every_n_steps steps; plus one all_gather when world size > 1)")
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
