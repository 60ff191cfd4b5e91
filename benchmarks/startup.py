"""Start-up costs: imports, ``trainscale --help``, time to the first optimizer step, and what a script
asking for ``devices=2`` from plain ``python`` costs against the same script under raw torchrun.

    python benchmarks/startup.py             # about 1 minute here
    python benchmarks/startup.py --quick     # smoke run
    python benchmarks/startup.py --part two-ranks   # only the 2-rank launches (--part one-process: the rest)

Every measurement is a fresh Python process (``sys.executable``, OMP_NUM_THREADS=1), timed from
just before it is started to its exit (imports, ``--help``) or to the end of its first
``optimizer.step()`` (an optimizer step post-hook reads ``time.time()``). The commands run
interleaved (A, B, C, ..., A, B, C, ...) after one warm-up round (a cold file cache would
otherwise charge the first command); medians and min–max over rounds. "− torch" columns are the
median over rounds of (this command − ``import torch`` of the same round). CPU = user + system
time of the process (``os.wait4``), which a busy machine inflates far less than wall time.

- ``python -c pass``: the interpreter alone.
- ``import torch``: the reference.
- ``import trainscale``: the package (public names are imported on first use).
- ``from trainscale import Trainer``: what a training script imports (torch and the train layer).
- ``trainscale --help``: the command line's help; also checked: torch is not imported.
- first step, plain / Runtime / Trainer: import, build the MLP 784-128-10 and AdamW, 64 samples of
  synthetic data in a DataLoader (batch 64), one optimizer step; the Trainer with its defaults
  (progress bar to a pipe, checkpointing on; the step hook fires before any checkpoint is written).
- 2 ranks, python / torchrun: the Trainer's script with ``devices=2`` (ddp on 2 CPU processes) started
  as ``python script.py`` (it re-executes itself under torchrun: ``launch.relaunch_current_script``) and
  as ``python -m torch.distributed.run --standalone --nproc-per-node=2 script.py``, to the first optimizer
  step of the later of the two ranks. The last lines give the medians of the paired differences.
- 2 ranks factory: the same with ``optimizer=`` a factory (``params -> AdamW``, as for fsdp): the script's top
  level builds no optimizer, so its process does not import ``torch._dynamo`` (which the first optimizer
  construction does, about 1.1 s) before it becomes torchrun's agent.
- 2 ranks Trainer first: the first script with ``Trainer(devices=2)`` made before the model and the AdamW (as
  README's example orders it): the script becomes torchrun at that line, so only the workers build them.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_SETUP = """
import sys, time, torch
from torch.utils.data import DataLoader, TensorDataset
from trainscale.models import MLP
torch.set_num_threads(1)
data = TensorDataset(torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,)))
model = MLP()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
def first_step(opt, args, kwargs):
    print(f"FIRST_STEP {time.time():.6f}", flush=True)
    sys.stdout.flush(); import os; os._exit(0)
optimizer.register_step_post_hook(first_step)
"""

FIRST_STEP = {
    "first step, plain": _SETUP + """
from torch.nn import functional as F
for x, y in DataLoader(data, batch_size=64):
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
""",
    "first step, Runtime": "from trainscale import Runtime\n" + _SETUP + """
from torch.nn import functional as F
rt = Runtime(accelerator="cpu", devices=1)
model, optimizer = rt.setup(model, optimizer)
for batch in rt.setup_dataloader(DataLoader(data, batch_size=64)):
    x, y = rt.to_device(batch)
    rt.backward(F.cross_entropy(model(x), y))
    rt.step(optimizer)
""",
    "first step, Trainer": "from trainscale import Trainer\n" + _SETUP + """
Trainer(accelerator="cpu", devices=1, default_root_dir=sys.argv[1]).fit(model, DataLoader(data, batch_size=64),
                                                                     optimizer=optimizer)
""",
}

# The Trainer's job on 2 processes, run as a script file (torchrun takes a file).
DDP_SCRIPT = "from trainscale import Trainer\n" + _SETUP + """
Trainer(accelerator="cpu", devices=2, default_root_dir=sys.argv[1]).fit(model, DataLoader(data, batch_size=64),
                                                                     optimizer=optimizer)
"""
# The same job with the optimizer passed as a factory (built by fit, after the model is wrapped): the script's
# top level then builds no optimizer, whose first construction imports torch._dynamo (about 1.1 s).
DDP_FACTORY_SCRIPT = "from trainscale import Trainer\n" + _SETUP.split("optimizer = ")[0] + """
def first_step(opt, args, kwargs):
    print(f"FIRST_STEP {time.time():.6f}", flush=True)
    sys.stdout.flush(); import os; os._exit(0)
def adamw(params):
    opt = torch.optim.AdamW(params, lr=1e-3)
    opt.register_step_post_hook(first_step)
    return opt
Trainer(accelerator="cpu", devices=2, default_root_dir=sys.argv[1]).fit(model, DataLoader(data, batch_size=64),
                                                                     optimizer=adamw)
"""

# The same job with the Trainer made first, as README's example does: `Trainer(devices=2)` is where the script
# becomes torchrun, so the model and the AdamW built after it are built by the workers only.
DDP_TRAINER_FIRST_SCRIPT = """import sys
from trainscale import Trainer
trainer = Trainer(accelerator="cpu", devices=2, default_root_dir=sys.argv[1])
""" + _SETUP + """
trainer.fit(model, DataLoader(data, batch_size=64), optimizer=optimizer)
"""

HELP_PROBE = ("import sys\nfrom trainscale.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
              "print('TORCH_IMPORTED', 'torch' in sys.modules)")


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def _time(cmd: list[str], first_step: bool) -> tuple[float, float]:
    """(wall s, CPU s) of one fresh process; CPU = user + system time of that process (``wait4``)."""
    t0 = time.time()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, env=_env(), stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        end = time.time()
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        sys.exit(f"{cmd} failed (exit {proc.returncode}):\n{stderr[-3000:]}")
    cpu = usage.ru_utime + usage.ru_stime
    if first_step:
        # two ranks print to one pipe: their lines may interleave mid-line, so find the stamps, not the lines
        stamps = [float(t) for t in re.findall(r"FIRST_STEP (\d+\.\d{6})", stdout)]
        if not stamps:
            sys.exit(f"{cmd} never reached an optimizer step:\n{stdout[-2000:]}\n{stderr[-2000:]}")
        return max(stamps) - t0, cpu  # the later rank's, under ddp
    return end - t0, cpu


def trainscale_import_ms(py: str) -> float:
    """Import time of trainscale's own modules once torch is loaded, from ``python -X importtime``
    (the interpreter's per-module timer: cumulative µs of each top-level import after torch's)."""
    proc = subprocess.run([py, "-X", "importtime", "-c", "import torch; from trainscale import Trainer"],
                          env=_env(), capture_output=True, text=True, timeout=300)
    lines = [ln.split("|") for ln in proc.stderr.splitlines() if ln.startswith("import time:") and "|" in ln]
    after_torch = [i for i, parts in enumerate(lines) if parts[2].rstrip() == " torch"]
    if proc.returncode != 0 or not after_torch:
        sys.exit(f"python -X importtime failed:\n{proc.stderr[-2000:]}")
    top_level = [parts for parts in lines[after_torch[-1] + 1:] if not parts[2].startswith("  ")]
    return sum(int(parts[1]) for parts in top_level) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 timed round")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 7, quick 1)")
    parser.add_argument("--part", choices=("all", "one-process", "two-ranks"), default="all",
                        help="time only the one-process commands (imports, --help, first steps) or only the 2-rank "
                             "launches (default: all)")
    parser.add_argument("--scripts", default="plain,factory,trainer-first",
                        help="the 2-rank jobs to time, comma-separated: plain (the optimizer built before fit), "
                             "factory (an optimizer factory), trainer-first (the Trainer made first, as README's "
                             "example); default all three")
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.quick else 7)

    import platform

    py = sys.executable
    cli = str(Path(py).parent / "trainscale")
    help_cmd = [cli, "--help"] if os.path.exists(cli) else [py, "-m", "trainscale.cli", "--help"]
    with tempfile.TemporaryDirectory() as root:
        ddp_script = os.path.join(root, "ddp_first_step.py")
        Path(ddp_script).write_text(DDP_SCRIPT)
        factory_script = os.path.join(root, "ddp_factory_first_step.py")
        Path(factory_script).write_text(DDP_FACTORY_SCRIPT)
        first_script = os.path.join(root, "ddp_trainer_first_step.py")
        Path(first_script).write_text(DDP_TRAINER_FIRST_SCRIPT)
        torchrun = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        one_process = {
            "python -c pass": ([py, "-c", "pass"], False),
            "import torch": ([py, "-c", "import torch"], False),
            "import trainscale": ([py, "-c", "import trainscale"], False),
            "from trainscale import Trainer": ([py, "-c", "from trainscale import Trainer"], False),
            "trainscale --help": (help_cmd, False),
            **{name: ([py, "-c", code, root], True) for name, code in FIRST_STEP.items()},
        }
        jobs = {"plain": ("2 ranks, python (relaunch)", "2 ranks, torchrun", ddp_script),
                "factory": ("2 ranks factory, python", "2 ranks factory, torchrun", factory_script),
                "trainer-first": ("2 ranks Trainer first, python", "2 ranks Trainer first, torchrun", first_script)}
        unknown = set(args.scripts.split(",")) - set(jobs)
        if unknown:
            parser.error(f"--scripts: unknown {', '.join(sorted(unknown))}; choose from {', '.join(jobs)}")
        two_ranks = {"import torch": ([py, "-c", "import torch"], False)}  # the baseline of the "− torch" columns
        for key in args.scripts.split(","):
            python_name, torchrun_name, script = jobs[key]
            two_ranks[python_name] = ([py, script, root], True)
            two_ranks[torchrun_name] = ([*torchrun, script, root], True)
        commands = {"all": {**one_process, **two_ranks}, "one-process": one_process, "two-ranks": two_ranks}[args.part]
        print(f"# startup: Python {platform.python_version()}, {os.cpu_count()} CPUs, load average "
              f"{os.getloadavg()[0]:.2f} at start, {rounds} interleaved rounds after {0 if args.quick else 1} warm-up round"
              f"{', QUICK (smoke run, numbers not meaningful)' if args.quick else ''}")
        t_start = time.perf_counter()
        times: dict[str, list[float]] = {name: [] for name in commands}
        cpus: dict[str, list[float]] = {name: [] for name in commands}
        warmup = 0 if args.quick else 1
        for r in range(warmup + rounds):
            for name, (cmd, first_step) in commands.items():
                t, cpu = _time(cmd, first_step)
                if r >= warmup:
                    times[name].append(t)
                    cpus[name].append(cpu)
        if "trainscale --help" in commands:
            probe = subprocess.run([py, "-c", HELP_PROBE], env=_env(), capture_output=True, text=True, timeout=120)
            torch_in_help = "TORCH_IMPORTED True" in probe.stdout
            if "TORCH_IMPORTED" not in probe.stdout:
                sys.exit(f"the --help probe failed:\n{probe.stderr[-2000:]}")

    torch_wall, torch_cpu = times["import torch"], cpus["import torch"]
    header = (f"{'command':<32} {'wall s':>7} {'wall min–max':>13} {'wall − torch':>12} "
              f"{'CPU s':>6} {'CPU min–max':>12} {'CPU − torch':>11}")
    print()
    print(header)
    print("-" * len(header))
    for name in times:
        wall, cpu = times[name], cpus[name]
        d_wall = statistics.median([a - b for a, b in zip(wall, torch_wall)])  # paired per round
        d_cpu = statistics.median([a - b for a, b in zip(cpu, torch_cpu)])
        print(f"{name:<32} {statistics.median(wall):>7.3f} {min(wall):>6.3f}–{max(wall):<6.3f} {d_wall:>+12.3f} "
              f"{statistics.median(cpu):>6.3f} {min(cpu):>5.3f}–{max(cpu):<6.3f} {d_cpu:>+11.3f}")
    print()
    if "trainscale --help" in commands:
        print(f"# trainscale --help imports torch: {'YES' if torch_in_help else 'no'}")
        print(f"# python -X importtime: trainscale's modules after torch (from trainscale import Trainer) take "
              f"{trainscale_import_ms(py):.1f} ms")
    print("# 'first step' = from process start to the end of the first optimizer.step()")
    for label, python, raw in (("", "2 ranks, python (relaunch)", "2 ranks, torchrun"),
                               (", optimizer factory", "2 ranks factory, python", "2 ranks factory, torchrun"),
                               (", Trainer first", "2 ranks Trainer first, python", "2 ranks Trainer first, torchrun")):
        if python not in commands:
            continue
        relaunch = statistics.median([a - b for a, b in zip(times[python], times[raw])])
        print(f"# devices=2 from `python script.py` (relaunched under torchrun{label}) against raw torchrun: "
              f"{relaunch:+.3f} s to the first step (median of {rounds} paired differences)")
    print(f"# total {time.perf_counter() - t_start:.0f} s; load average {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
