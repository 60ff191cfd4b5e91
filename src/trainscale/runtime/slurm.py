"""SLURM: reading the world from ``srun``'s environment, and writing an sbatch script.

Under ``srun`` each task gets SLURM_PROCID (global rank), SLURM_NTASKS (world size), SLURM_LOCALID
(local rank), SLURM_NODEID (node rank), SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE (tasks of
each node, e.g. ``4(x2)``) and SLURM_STEP_NODELIST / SLURM_JOB_NODELIST (a compressed hostlist such
as ``node[01-03,07],gpu5``); see https://slurm.schedmd.com/srun.html#SECTION_OUTPUT-ENVIRONMENT-VARIABLES.
The rendezvous address is the first host of the node list. Nothing here imports torch.

Launch choice: the sbatch script runs ``srun`` with one task per GPU and no torchrun. SLURM then
starts, signals (``--signal=USR1@90`` reaches every task) and kills the workers itself, and the
world is read from SLURM's variables with no second rendezvous. Restarts come from SLURM's requeue
(the Trainer checkpoints on SIGUSR1, requeues the job and exits; the requeued job resumes from
"last"). For torchrun's in-allocation elastic restarts instead, run ``srun --ntasks-per-node=1
trainscale run --nnodes $SLURM_NNODES -n GPUS --rdzv-endpoint $HEAD:29500 ...`` (docs/fault-tolerance.md).
"""

from __future__ import annotations

import re
import shlex
import warnings
from typing import Mapping

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in hostlist {text!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"unbalanced '[' in hostlist {text!r}")
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_one(pattern: str) -> list[str]:
    open_at = pattern.find("[")
    if open_at < 0:
        return [pattern]
    close_at = pattern.index("]", open_at)
    prefix, body, suffix = pattern[:open_at], pattern[open_at + 1:close_at], pattern[close_at + 1:]
    values = []
    for item in body.split(","):
        m = _RANGE.match(item.strip())
        if not m:
            raise ValueError(f"bad range {item!r} in hostlist pattern {pattern!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise ValueError(f"descending range {item!r} in hostlist pattern {pattern!r}")
        width = len(lo)  # "01-03" keeps its zero padding
        values += [str(v).zfill(width) for v in range(int(lo), int(hi) + 1)]
    return [prefix + v + rest for v in values for rest in _expand_one(suffix)]


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand SLURM's compressed hostlist: ``"node[01-03,07],gpu5"`` →
    ``["node01", "node02", "node03", "node07", "gpu5"]`` (what ``scontrol show hostnames`` prints).

    Raises:
        ValueError: unbalanced brackets or a malformed range.
    """
    hosts: list[str] = []
    for part in _split_top(hostlist.strip()):
        hosts += _expand_one(part)
    return hosts


def first_host(hostlist: str) -> str:
    """The first host of SLURM's compressed hostlist, ``expand_hostlist(hostlist)[0]`` without expanding the
    others (a job of N nodes would otherwise build N names on every rank): ``"node[0001-1024]"`` → ``"node0001"``.

    Raises:
        ValueError: unbalanced brackets or a malformed first range.
    """
    pattern, host = _split_top(hostlist.strip())[0], ""
    while (open_at := pattern.find("[")) >= 0:
        close_at = pattern.index("]", open_at)
        first = pattern[open_at + 1:close_at].split(",")[0]
        m = _RANGE.match(first.strip())
        if not m:
            raise ValueError(f"bad range {first!r} in hostlist pattern {pattern!r}")
        host, pattern = host + pattern[:open_at] + m.group(1), pattern[close_at + 1:]
    return host + pattern


def _tasks_entries(spec: str) -> list[tuple[int, int]]:
    """SLURM_TASKS_PER_NODE's ``"4(x2),3"`` → ``[(4, 2), (3, 1)]``: (tasks, nodes with that many)."""
    out = []
    for item in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not m:
            raise ValueError(f"bad SLURM_TASKS_PER_NODE entry {item!r} in {spec!r}")
        out.append((int(m.group(1)), int(m.group(2) or 1)))
    return out


def tasks_per_node(spec: str) -> list[int]:
    """SLURM_TASKS_PER_NODE's ``"4(x2),3"`` → ``[4, 4, 3]``."""
    return [tasks for tasks, nodes in _tasks_entries(spec) for _ in range(nodes)]


def tasks_on_node(spec: str, node: int) -> tuple[int | None, int]:
    """``(tasks on node index node, nodes)`` from SLURM_TASKS_PER_NODE, without expanding ``"8(x1024)"`` to a
    list per node: ``tasks_on_node("4(x2),3", 2)`` → ``(3, 3)``; tasks None when ``node`` is not in it."""
    entries, tasks, first = _tasks_entries(spec), None, 0
    for count, nodes in entries:
        if tasks is None and first <= node < first + nodes:
            tasks = count
        first += nodes
    return tasks, first


def is_slurm_task(env: Mapping[str, str]) -> bool:
    """True when SLURM's task variables are set (SLURM_PROCID and SLURM_NTASKS). Start the script with
    ``srun`` (one task per GPU): run directly in the batch script, SLURM_NTASKS still describes the
    whole allocation while one process runs, and the others never arrive (``timeout=`` then fails it)."""
    return "SLURM_PROCID" in env and "SLURM_NTASKS" in env


_warned_not_srun = False


def warn_if_not_srun(env: Mapping[str, str]) -> bool:
    """Warn once (``RuntimeWarning``) when SLURM describes several tasks (SLURM_NTASKS > 1) but this
    process was not started by ``srun`` (SLURM_STEP_ID or SLURM_PROCID absent): run directly in the
    batch script, one process waits for tasks that never come until ``timeout=`` (30 minutes by
    default), or (no SLURM_PROCID) trains alone. Returns whether the environment looks so.
    """
    global _warned_not_srun
    ntasks = env.get("SLURM_NTASKS", "")
    started_by_srun = "SLURM_STEP_ID" in env and "SLURM_PROCID" in env
    if started_by_srun or not ntasks.isdigit() or int(ntasks) <= 1:
        return False
    if not _warned_not_srun:
        _warned_not_srun = True
        warnings.warn(
            f"SLURM_NTASKS={ntasks} but this process was not started by srun (no SLURM_STEP_ID/SLURM_PROCID): "
            f"launch the script with `srun python train.py ...` (as `trainscale slurm` writes it); run directly "
            f"in the batch script, it runs alone, or waits (until timeout=) for {ntasks} tasks that never start",
            RuntimeWarning,
            stacklevel=4)
    return True


SLURM_VARS = ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_NODEID",
              "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_STEP_ID",
              "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "MASTER_ADDR", "MASTER_PORT")
# The world size an MPI launcher gives each process it starts (trainscale.runtime.mpi).
_MPI_SIZES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")


def read(env: Mapping[str, str]) -> dict | None:
    """The World fields of a task started by ``srun``, or None when this process is not one.

    Inside an allocation another launcher may start the processes from SLURM tasks, which they then
    inherit the variables of: ``mpirun`` starts one daemon task per node (SLURM_NTASKS counts the daemons,
    not the ranks), Ray and DeepSpeed set RANK and WORLD_SIZE per process. Their readers take those.
    """
    warn_if_not_srun(env)
    if not is_slurm_task(env) or ("RANK" in env and "WORLD_SIZE" in env):
        return None
    tasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")
    if any(env.get(name, tasks) != tasks for name in _MPI_SIZES):
        return None  # mpirun's ranks inside the allocation
    fields = world_fields(env)
    fields.update(launcher="slurm", detected_from="SLURM_PROCID and SLURM_NTASKS (a task started by srun)")
    return fields


def world_fields(env: Mapping[str, str]) -> dict:
    """The :class:`~trainscale.runtime.world.World` fields of a SLURM task.

    MASTER_ADDR/MASTER_PORT win when set; otherwise the first host of the node list and
    ``15000 + job id % 20000`` (every task of a job computes the same port).

    Raises:
        ValueError: a variable that is not an integer, or that disagrees with the others.
    """
    from trainscale.runtime.world import launcher_error, port_from_job_id, read_int

    def geti(name: str, default: int | None = None) -> int:
        return read_int(env, name, "slurm", SLURM_VARS, default)

    world_size = geti("SLURM_STEP_NUM_TASKS", geti("SLURM_NTASKS"))  # the step's tasks, when srun set them
    rank = geti("SLURM_PROCID")
    node_rank, local_rank = geti("SLURM_NODEID", 0), geti("SLURM_LOCALID", 0)
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if spec:  # per node, so nodes may differ (e.g. "8,4")
        local_world_size, nodes = tasks_on_node(spec, node_rank)
        if local_world_size is None or node_rank < 0:
            raise launcher_error("slurm", env, SLURM_VARS, f"SLURM_NODEID={node_rank} but the tasks per node are "
                                                           f"{spec!r}")
    else:
        local_world_size = geti("SLURM_NTASKS_PER_NODE", world_size)
        nodes = geti("SLURM_STEP_NUM_NODES", geti("SLURM_NNODES", 0)) or None
    nodelist_var = next((n for n in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if env.get(n)), None)
    master_addr = env.get("MASTER_ADDR") or "127.0.0.1"
    if nodelist_var and not env.get("MASTER_ADDR"):
        try:
            master_addr = first_host(env[nodelist_var])
        except ValueError as err:  # the rendezvous host cannot be known: say which variable, of which launcher
            raise launcher_error("slurm", env, SLURM_VARS, f"{nodelist_var}={env[nodelist_var]!r} is not a SLURM "
                                                           f"hostlist ({err}); set MASTER_ADDR to rank 0's host, or "
                                                           "run under srun, which sets it") from None
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    return dict(world_size=world_size, rank=rank, local_rank=local_rank, local_world_size=local_world_size,
                node_rank=node_rank, master_addr=master_addr, master_port=geti("MASTER_PORT", port_from_job_id(job_id)),
                restart_count=geti("SLURM_RESTART_COUNT", 0), job_id=job_id, group_world_size=nodes)


def check_allocation(world_size: int, local_world_size: int, num_nodes: int, devices: int,
                     requested_nodes: int) -> None:
    """The allocation must match ``devices`` × ``num_nodes``.

    Raises:
        ValueError: naming the #SBATCH lines (or the flags) to change.
    """
    if local_world_size == devices and num_nodes == requested_nodes and world_size == devices * requested_nodes:
        return
    raise ValueError(
        f"SLURM started {world_size} tasks on {num_nodes} node(s) ({local_world_size} on this node) but the job "
        f"asks for devices×num_nodes={devices}×{requested_nodes}; submit with `#SBATCH --nodes={requested_nodes}` "
        f"and `#SBATCH --ntasks-per-node={devices}` (see `trainscale slurm`), or pass "
        f"devices={local_world_size}, num_nodes={num_nodes} (devices='auto' follows the allocation)")


# SLURM's time formats (sbatch --time): "minutes", "minutes:seconds", "hours:minutes:seconds",
# "days-hours", "days-hours:minutes", "days-hours:minutes:seconds"; and UNLIMITED/INFINITE.
_TIME = re.compile(r"(\d+(:\d{1,2}){0,2}|\d+-\d{1,2}(:\d{1,2}){0,2}|UNLIMITED|INFINITE)")
# Names (job name, partition, account, output file): no whitespace, quote or shell metacharacter.
_NAME = re.compile(r"[A-Za-z0-9_.,+@%=:/-]+")


def check_sbatch_value(flag: str, value: str, *, time: bool = False) -> str:
    """``value`` of ``flag`` (e.g. ``"--job-name"``) if it is safe to write into an sbatch script.

    Names may hold letters, digits and ``_ . , + @ % = : / -`` only: no newline (which would end
    the ``#SBATCH`` line and start a shell command), whitespace, quote or shell metacharacter.
    With ``time=True`` the value must be in one of SLURM's ``--time`` formats
    (https://slurm.schedmd.com/sbatch.html#OPT_time).

    Raises:
        ValueError: one line naming the flag, the value and what is allowed.
    """
    if time:
        if not _TIME.fullmatch(value):
            raise ValueError(f"{flag} {value!r} is not a SLURM time: use minutes, minutes:seconds, "
                             f"hours:minutes:seconds, days-hours, days-hours:minutes or days-hours:minutes:seconds "
                             f"(e.g. 04:00:00 or 1-12)")
    elif not _NAME.fullmatch(value):
        raise ValueError(f"{flag} {value!r} may hold only letters, digits and _ . , + @ % = : / - "
                         f"(no newline, space, quote or shell metacharacter)")
    return value


SBATCH_MARK = "# Written by `trainscale slurm`."  # how an sbatch script of ours is recognised before it is replaced


def sbatch_script(command: list[str], *, nodes: int, gpus_per_node: int, job_name: str = "trainscale",
                  time: str = "04:00:00", cpus_per_task: int = 8, partition: str | None = None,
                  signal_seconds: int = 90, output: str = "%x-%j.out", cpu: bool = False,
                  account: str | None = None) -> str:
    """An sbatch script: ``nodes`` × ``gpus_per_node`` tasks, one per GPU, launched by ``srun``.

    ``--signal=USR1@{signal_seconds}`` asks SLURM to send SIGUSR1 to every task that long before the
    time limit; the Trainer then checkpoints, requeues the job (``scontrol requeue``) and exits.
    ``--requeue`` lets SLURM requeue it after a preemption or node failure too; ``--open-mode=append``
    keeps the log of every attempt. With ``cpu=True`` no GPU is requested (tasks are CPU processes).

    Every value is checked by :func:`check_sbatch_value` and written with ``shlex.quote``. ``srun``
    gets ``--cpus-per-task="$SLURM_CPUS_PER_TASK"``: since Slurm 22.05 srun no longer inherits the
    job's ``--cpus-per-task`` and would give each task one core.

    Raises:
        ValueError: non-positive counts, an empty command, or a name or time that is not safe or not
            in SLURM's format (naming the flag).
    """
    if nodes < 1 or gpus_per_node < 1 or cpus_per_task < 1 or signal_seconds < 1:
        raise ValueError(f"nodes={nodes}, gpus_per_node={gpus_per_node}, cpus_per_task={cpus_per_task} and "
                         f"signal_seconds={signal_seconds} must all be >= 1")
    if not command:
        raise ValueError("no command: pass the training script and its arguments, e.g. train.py --lr 1e-3")
    q = shlex.quote
    names = {"--job-name": job_name, "--partition": partition, "--account": account, "--output": output}
    for flag, value in names.items():
        if value is not None:
            check_sbatch_value(flag, value)
    check_sbatch_value("--time", time, time=True)
    lines = ["#!/bin/bash", f"#SBATCH --job-name={q(job_name)}", f"#SBATCH --nodes={nodes}",
             f"#SBATCH --ntasks-per-node={gpus_per_node}"]
    if not cpu:
        lines.append(f"#SBATCH --gpus-per-node={gpus_per_node}")
    lines += [f"#SBATCH --cpus-per-task={cpus_per_task}", f"#SBATCH --time={q(time)}"]
    lines += [f"#SBATCH {flag}={q(value)}" for flag, value in names.items()
              if value is not None and flag in ("--partition", "--account")]
    lines += [f"#SBATCH --signal=USR1@{signal_seconds}", "#SBATCH --requeue", "#SBATCH --open-mode=append",
              f"#SBATCH --output={q(output)}", "",
              SBATCH_MARK + " One task per GPU; trainscale reads SLURM_PROCID/NTASKS/LOCALID/",
              "# NODEID and the node list (the first node hosts the rendezvous). On SIGUSR1 the Trainer saves a",
              "# checkpoint, requeues this job and exits; the requeued job resumes from \"last\".",
              "set -euo pipefail",
              "export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}",
              'echo "job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST"',
              '# srun (Slurm 22.05+) does not inherit --cpus-per-task: pass it, or each task gets one core',
              'srun --kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" '
              + " ".join(q(c) for c in command), ""]
    return "\n".join(lines)
