"""Where ``trainscale slurm -o`` and ``trainscale k8s -o`` may write: a new file, or one the same command wrote."""

from __future__ import annotations

import os


def check_output_file(path: str, script: str, mark: str, command: str, example: str) -> None:
    """Refuse to write a generated job file over anything but a file that ``command`` wrote before.

    A file of ours is recognised by ``mark`` at the start of one of its first 40 lines (the sbatch script's
    ``#!/bin/bash`` comes first). ``trainscale slurm -o train.py train.py`` would otherwise replace the
    training script.

    Raises:
        ValueError: ``path`` is the training script, a directory or other non-file, unreadable, in a directory
            that does not exist, or a file ``command`` did not write; the message names it and suggests ``example`` instead.
    """
    if os.path.abspath(path) == os.path.abspath(script) or (
            os.path.exists(path) and os.path.exists(script) and os.path.samefile(path, script)):
        raise ValueError(f"-o {path} is the training script itself: writing there would replace it; pick another "
                         f"name, e.g. -o {example}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"-o {path}: the directory {parent} does not exist; create it first (mkdir -p {parent}) or "
                         f"pick another path, e.g. -o {example}")
    if not os.path.lexists(path):
        return
    if not os.path.isfile(path):
        raise ValueError(f"-o {path} exists and is not a file: name a file, e.g. -o {example}")
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            head = [f.readline() for _ in range(40)]
    except OSError as err:
        raise ValueError(f"-o {path} exists and cannot be read ({err}); pick another name") from None
    if not any(line.startswith(mark) for line in head):
        raise ValueError(f"-o {path} exists and was not written by `{command}`: it is left as it is; pick another "
                         "name, or move that file away first")
