"""What the fault-tolerance checks cost per step, next to a plain PyTorch training step.

    PYTHONPATH=src python benchmarks/fault_overhead.py

Measures, in one run on this machine: a plain ConvNet SGD step (batch 32, CPU), the per-micro-batch
non-finite bookkeeping (``FaultTolerance.observe_loss``: the loss kept, stacked on the device every 256), the per-step watchdog ``pet`` and
``due`` (a clock read), the per-step host sync of ``on_nonfinite="skip"``, and the 3·W-element
all-reduce of ``poll`` on 2 gloo ranks (run after about a second of steps, at most every
``log_every_n_steps`` steps). Prints microseconds
and ratios to the step.
"""

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn import functional as F


def per_call(fn, n=2000) -> float:
    for _ in range(50):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def _poll_rank(rank, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    vec = torch.zeros(2, 3, dtype=torch.float32)  # as in FaultTolerance.poll: (signal, loss sum, step time) per rank
    us = per_call(lambda: dist.all_reduce(vec), n=500)
    if rank == 0:
        q.put(us)
    dist.destroy_process_group()


def main() -> None:
    from trainscale.models import ConvNet
    from trainscale.runtime.hangs import Watchdog
    from trainscale.runtime.runtime import Runtime
    from trainscale.faults.tolerance import FaultTolerance

    torch.manual_seed(0)
    model = ConvNet(batchnorm=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))

    def step():
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    step_us = per_call(step, n=100)
    rt = Runtime(accelerator="cpu")
    rt.launch()
    ft = FaultTolerance(rt)
    loss = step().detach()
    observe_us = per_call(lambda: ft.observe_loss(loss, 3))
    dog = Watchdog("/tmp/trainscale-bench-stacks/rank0.txt", 600).start()
    ft.watchdog = dog
    due_us = per_call(lambda: ft.due(7))
    rearm_us = per_call(dog._arm, n=500)
    dog.stop()
    sync_us = per_call(lambda: bool(torch.isfinite(loss).item()))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_poll_rank, args=(port, q), nprocs=2, start_method="spawn")
    poll_us = q.get()
    print(f"plain PyTorch ConvNet SGD step (batch 32, CPU, {torch.get_num_threads()} threads): {step_us:9.1f} us")
    for name, us in (("observe_loss (per micro-batch, stacking amortized)", observe_us),
                     ("due + watchdog pet (per step)", due_us),
                     ("watchdog re-arm (every timeout/4 s)", rearm_us),
                     ("'skip' host sync (.item(), per step)", sync_us),
                     ("poll all-reduce, 2 gloo ranks (every ~1 s of steps)", poll_us)):
        print(f"{name:52s} {us:9.1f} us  = {us / step_us:7.2%} of a step")


if __name__ == "__main__":
    main()
