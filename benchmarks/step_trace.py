"""How much of trainscale one training step runs: the distinct functions and files of ``src/trainscale`` called
between ``Trainer.train_step``'s entry and its return, for a step that writes a step record and for one that does not.

    python benchmarks/step_trace.py                # ddp on 2 CPU processes (gloo): Trainer(devices=2) relaunches
    python benchmarks/step_trace.py --devices 1    # one process
    python benchmarks/step_trace.py --list         # also every function counted, file by file

Counted, not timed: the same code gives the same figures on any machine and load. The run is a default
``Trainer`` fit (telemetry, the CSV logger, the progress bar and the checkpoint callback as a user gets them) of a
tiny linear model, ``strategy="ddp"``, ``accumulate_grad_batches=2``, ``log_every_n_steps=2``, four optimizer steps
(``straggler_margin`` set out of reach: whether a rank of the 2 here reads as a straggler depends on the machine's
load, and its message would change the count from run to run);
on rank zero ``sys.settrace`` (https://docs.python.org/3/library/sys.html#sys.settrace) is on from the entry of the
third ``train_step`` (a plain step) to its return, and again for the fourth (a logging step: its record is reduced
across the ranks and written). The first two steps are left out: they hold one-off work (first calls, the first
record's files opened).

Figures per step:
- functions: distinct functions and methods of ``src/trainscale`` that ran; a nested function, lambda,
  comprehension or generator expression counts as the function it is written in;
- code objects: the same with each nested function, lambda and comprehension counted on its own;
- files: the distinct source files of those;
- lines: distinct source lines executed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parents[1] / "src"
TRACED = {3: "plain", 4: "logging"}  # the train_step calls traced (1-based) and what each is
STEPS = 4


def _package_file(filename: str) -> str | None:
    """``trainscale/loop/trainer.py`` for a file of the installed or checked-out package; None for any other."""
    parts = Path(filename).parts
    if "trainscale" not in parts:
        return None
    i = len(parts) - 1 - parts[::-1].index("trainscale")  # the last: a checkout may sit under a trainscale folder
    return "/".join(parts[i:])


def _enclosing(qualname: str) -> str:
    """The function a nested function, lambda or comprehension is written in (``Trainer.fit.<locals>.f`` ->
    ``Trainer.fit``; ``Trainer.fit.<lambda>`` -> ``Trainer.fit``)."""
    outer = qualname.split(".<locals>")[0]
    while outer.rsplit(".", 1)[-1].startswith("<") and "." in outer:  # <lambda>, <genexpr>, <listcomp>, ...
        outer = outer.rsplit(".", 1)[0]
    return outer


def summarise(code_objects: set, lines: set) -> dict[str, Any]:
    """The figures of one traced step from the ``(file, qualname, first line)`` of each code object that ran and the
    ``(file, line)`` of each line executed."""
    functions = {(f, _enclosing(q)) for f, q, _ in code_objects}
    return {"functions": len(functions), "code_objects": len(code_objects),
            "files": sorted({f for f, _ in functions}), "lines": len(lines),
            "function_names": sorted(f"{f}:{q}" for f, q in functions)}


class StepTracer:
    """``sys.settrace`` over chosen calls of a function; collects the package's code objects and lines that ran."""

    def __init__(self) -> None:
        self.code_objects: set[tuple[str, str, int]] = set()
        self.lines: set[tuple[str, int]] = set()

    def _trace(self, frame, event, arg):
        file = _package_file(frame.f_code.co_filename)
        if file is None:
            return None  # no line events inside other code (calls from it are still seen)
        if event == "call":
            self.code_objects.add((file, frame.f_code.co_qualname, frame.f_code.co_firstlineno))
        return self._line

    def _line(self, frame, event, arg):
        if event == "line":
            self.lines.add((_package_file(frame.f_code.co_filename), frame.f_lineno))
        return self._line

    def ran(self, code) -> None:
        """Count ``code`` (a function's ``__code__``) and its lines as run, where the trace cannot see it run."""
        file = _package_file(code.co_filename)
        self.code_objects.add((file, code.co_qualname, code.co_firstlineno))
        self.lines.update((file, line) for _, _, line in code.co_lines() if line not in (None, code.co_firstlineno))

    def run(self, fn, *args: Any) -> Any:
        previous = sys.gettrace()
        sys.settrace(self._trace)
        try:
            return fn(*args)
        finally:
            sys.settrace(previous)


def trace_steps(rank: int, root: str, devices: int = 2) -> dict[str, dict] | None:
    """Fit the traced run (module docstring) on this rank; on rank zero the figures of each traced step by its kind
    ("plain", "logging"), None on the others. ``devices``: processes (``strategy="ddp"`` when 2 or more)."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from trainscale.loop.trainer import Trainer
    from trainscale.telemetry.timers import StepTimer

    class TracedTrainer(Trainer):
        calls = 0

        def train_step(self, fit, steps):
            self.calls += 1
            kind = TRACED.get(self.calls) if self.runtime.is_rank_zero else None
            if kind is None:
                return super().train_step(fit, steps)
            tracer = StepTracer()
            out = tracer.run(super().train_step, fit, steps)
            # DDP's timing hook hands each all-reduce's readings to StepTimer.record_comm from the callback of the
            # all-reduce's future, which runs on gloo's thread when the all-reduce ends after DDP waits for it and on
            # the step's thread otherwise; settrace follows the step's thread only, so the callback is counted as
            # run in every step whose all-reduce is timed (it runs in each)
            if fit.telemetry.comm_timed:
                tracer.ran(StepTimer.record_comm.__code__)
            assert self.global_step == self.calls and self.is_log_step == (kind == "logging"), (kind, self.global_step)
            found[kind] = summarise(tracer.code_objects, tracer.lines)
            return out

    found: dict[str, dict] = {}
    strategy = {"strategy": "ddp"} if devices > 1 else {}
    trainer = TracedTrainer(accelerator="cpu", devices=devices, **strategy, max_epochs=1, max_steps=STEPS,
                            accumulate_grad_batches=2, log_every_n_steps=2, default_root_dir=root, seed=0,
                            timeout=60, straggler_margin=1e9)
    g = torch.Generator().manual_seed(0)
    per_rank_batches, batch = STEPS * 2, 4  # micro-batches per rank: accumulation 2 × STEPS
    data = TensorDataset(torch.randn(devices * per_rank_batches * batch, 8, generator=g),
                         torch.randint(0, 2, (devices * per_rank_batches * batch,), generator=g))
    torch.manual_seed(0)
    trainer.fit(torch.nn.Linear(8, 2), DataLoader(data, batch_size=batch, shuffle=True),
                loss_fn=torch.nn.functional.cross_entropy, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    if devices > 1:
        trainer.runtime.teardown()
    if not trainer.runtime.is_rank_zero:
        return None
    assert set(found) == set(TRACED.values()), found
    return found


def report(found: dict[str, dict], listing: bool = False) -> str:
    rows = [f"{'step':8s} {'functions':>9s} {'code objects':>12s} {'files':>5s} {'lines':>5s}"]
    for kind, f in found.items():
        rows.append(f"{kind:8s} {f['functions']:9d} {f['code_objects']:12d} {len(f['files']):5d} {f['lines']:5d}")
    for kind, f in found.items():
        rows.append(f"\n## {kind} step: files ({len(f['files'])})")
        rows += [f"  {name}" for name in f["files"]]
        if listing:
            rows.append(f"## {kind} step: functions ({f['functions']})")
            rows += [f"  {name}" for name in f["function_names"]]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2, help="processes (ddp from 2; Trainer relaunches the script)")
    parser.add_argument("--list", action="store_true", help="list every function counted")
    parser.add_argument("--quick", action="store_true", help="the same run (it is already short)")
    args = parser.parse_args(argv)
    import os
    import shutil
    import tempfile

    import torch

    torch.set_num_threads(1)
    # one directory for every rank: the ranks' parent is the process that relaunched itself as torchrun's agent
    launcher = os.getppid() if "RANK" in os.environ else os.getpid()
    root = Path(tempfile.gettempdir()) / f"trainscale-step-trace-{launcher}"
    found = trace_steps(int(os.environ.get("RANK", "0")), str(root), args.devices)
    if found is not None:
        shutil.rmtree(root, ignore_errors=True)
        run = f"ddp × {args.devices} (cpu, gloo)" if args.devices > 1 else "1 process (cpu)"
        print(f"# step_trace: {run}, accumulate_grad_batches=2, torch {torch.__version__}, "
              f"Python {sys.version.split()[0]}")
        print(report(found, args.list))


if __name__ == "__main__":
    main()
