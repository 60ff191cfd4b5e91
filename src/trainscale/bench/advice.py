"""Advice from measured rows: the fastest configuration, time-to-accuracy, and for each poor cell where its
speed-up went. Every sentence quotes the numbers it rests on. Pure logic, no torch.

A cell is *poor* when it failed, when its scaling efficiency is below ``POOR_EFFICIENCY``, or when
data loading takes at least ``DATA_SHARE`` of its step. Its class, first that applies:

- memory-bound: it ran out of memory (``oom``);
- failed: timeout, exception or crash (the reason is quoted);
- when the cell and its baseline (fewest devices, same batch column) both have telemetry, the speed-up account
  (:func:`trainscale.bench.analysis.cell_account`) decides: its largest term names the class (exposed
  communication → communication-bound, data wait → data-bound, waiting for the slowest rank → imbalance-bound,
  per-step fixed overhead → overhead-bound, compute slowdown → compute-bound, residual → unexplained), and the
  sentence quotes each large term with its share of the lost time, its fix, and the efficiency without it;
- otherwise the shares of the step: exposed communication ≥ ``COMM_SHARE`` → communication-bound, data wait ≥
  ``DATA_SHARE`` → data-bound, else compute-bound;
- a compute-bound cell whose compute growth was not split by a fit (one batch size timed) is overhead-bound instead
  when its steps are tiny (the baseline's step under ``TINY_STEP_S``) and efficiency rises by ≥ ``OVERHEAD_RISE``
  at a larger batch with the same devices;
- unexplained: nothing was measured.

What would help is said only where the table supports it: a larger batch is recommended when a larger
batch with the same devices was more efficient, and reported as no help when it was not.

Without telemetry on both cells the shares come from the cell's probes (a lone gradient-sized all-reduce; a
data-only pass over the loader), which bound them from above.
"""

from __future__ import annotations

from trainscale.bench.analysis import cell_account, find, fmt_time, shares
from trainscale.telemetry.account import COMM, DATA, OVERHEAD, RESIDUAL, SLOWDOWN, WAIT, Account, Term

POOR_EFFICIENCY = 0.75
COMM_SHARE = 0.25
DATA_SHARE = 0.25
OVERHEAD_RISE = 0.10
SUPERLINEAR = 1.10
TINY_STEP_S = 0.05
EXPOSED = COMM  # the part of the all-reduce a step waits for
KINDS = {COMM: "communication", DATA: "data", WAIT: "imbalance", OVERHEAD: "overhead", SLOWDOWN: "compute",
         RESIDUAL: "unexplained"}
RESIDUAL_NONE = Term(RESIDUAL, 0.0, 0.0, 0.0, "")
QUOTED_SHARE = 0.10  # terms quoted besides the largest: at least this share of the lost time


def label(row: dict) -> str:
    """``"bs 64 on 2 devices (ddp, 32-true)"``; strong scaling adds the per-device batch."""
    d = row["devices"]
    what = f"bs {row['batch_size']}" if row.get("scaling", "weak") == "weak" else \
        f"global bs {row['batch_size']} ({row['per_device_batch']}/device)"
    return f"{what} on {d} device{'s' if d > 1 else ''} ({row['run_strategy']}, {row['precision']})"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def is_poor(row: dict) -> bool:
    if row.get("status") != "ok":
        return True
    if row.get("efficiency") is not None and row["devices"] > row.get("baseline_devices", 1) \
            and row["efficiency"] < POOR_EFFICIENCY:
        return True
    s = shares(row)
    return s["data_share"] is not None and s["data_share"] >= DATA_SHARE


def _larger_batches(row: dict, rows: list[dict]) -> tuple[str, bool]:
    """What the table's larger batches with the same devices show: ``(sentence, efficiency rose?)``."""
    best = _best_larger(row, rows)
    eff = row.get("efficiency")
    if best is None:
        return "", False
    if best["efficiency"] > eff:
        return f"efficiency rises to {best['efficiency']:.2f} at bs {best['batch_size']}", True
    return (f"larger batches did not help here (best efficiency {best['efficiency']:.2f}, at bs "
            f"{best['batch_size']})"), False


def _classify(row: dict, rows: list[dict], s: dict) -> str:
    """The bottleneck class of an ``ok`` poor row without an account, by the shares of its step (module
    docstring)."""
    if s["comm_share"] is not None and s["comm_share"] >= COMM_SHARE and \
            (s["data_share"] is None or s["data_share"] < DATA_SHARE or s["comm_share"] >= s["data_share"]):
        return "communication"
    if s["data_share"] is not None and s["data_share"] >= DATA_SHARE:
        return "data"
    if s["comm_share"] is None and s["data_share"] is None:
        return "unexplained"
    return "overhead" if _tiny_steps_and_batch_helps(row, rows, s["step_time_s"]) else "compute"


def _tiny_steps_and_batch_helps(row: dict, rows: list[dict], step_s: float | None) -> bool:
    """The baseline's step is under ``TINY_STEP_S`` and a larger batch on the same devices is ``OVERHEAD_RISE``
    more efficient: a fixed cost per step, read from the table when no fit separated it."""
    base = find(rows, row["strategy"], row["precision"], row.get("baseline_devices", 1), row["batch_size"])
    base_step = (base or row).get("step_time_s") or step_s
    best = _best_larger(row, rows)
    return best is not None and base_step is not None and base_step < TINY_STEP_S \
        and best["efficiency"] >= row["efficiency"] + OVERHEAD_RISE


def _best_larger(row: dict, rows: list[dict]) -> dict | None:
    """The most efficient row with the same devices, strategy and precision at a larger batch size."""
    if row.get("efficiency") is None:
        return None
    larger = [r for r in rows if r.get("efficiency") is not None and r["devices"] == row["devices"]
              and r["precision"] == row["precision"] and r["run_strategy"] == row["run_strategy"]
              and r["batch_size"] > row["batch_size"]]
    return max(larger, key=lambda r: r["efficiency"], default=None)


def _failed(row: dict, rows: list[dict], name: str) -> tuple[str, str]:
    if row.get("status") != "oom":
        return "failed", f"{name} failed ({row.get('status')}): {row.get('reason')}."
    ran = [r for r in rows if r.get("status") == "ok" and r["devices"] == row["devices"]
           and r["precision"] == row["precision"] and r["run_strategy"] == row["run_strategy"]
           and r.get("peak_memory_bytes")]
    biggest = max(ran, key=lambda r: r["per_device_batch"], default=None)
    more = ""
    if biggest is not None:
        more = (f"; the largest batch that ran here, {biggest['per_device_batch']}/device, peaked at "
                f"{_gib(max(biggest['peak_memory_bytes']))} ({biggest.get('peak_memory_kind')})")
    return "memory", (f"{name} is memory-bound: it ran out of memory ({row.get('reason')}){more}. Use a smaller "
                      "per-device batch, bf16-mixed precision, or a sharded strategy (fsdp); `trainscale plan` "
                      "predicts the peak of each before running.")


def diagnose(row: dict, rows: list[dict]) -> tuple[str, str]:
    """``(class, sentence)`` for one poor row (see the module docstring for the classes).

    ``rows`` (all rows, after :func:`trainscale.bench.analysis.add_scaling`) supply the comparison
    cells: the baseline at the same batch size (the account, or which share), the efficiency at larger batches
    (whether a larger batch helps). Every number quoted is one of the table's or the telemetry's.
    """
    name = label(row)
    if row.get("status") != "ok":
        return _failed(row, rows, name)
    acc = cell_account(row, rows)
    if acc is not None and any(t.seconds > 0 for t in acc.terms):
        return _from_account(row, rows, acc)
    s = shares(row)
    step, eff = s["step_time_s"], row.get("efficiency")
    kind = _classify(row, rows, s)
    eff_txt = f"efficiency {eff:.2f}, " if eff is not None and row["devices"] > row.get("baseline_devices", 1) else ""
    head = f"{name} is {kind}-bound ({eff_txt}step {_ms(step) if step else '—'})"
    if kind == "unexplained":
        return kind, (f"{name} scales poorly ({eff_txt}step {_ms(step) if step else '—'}) but the step-phase "
                      "split was not measured (no telemetry and no probe), so the cause cannot be named.")
    src = f" (source: {s['source']})" if s["source"] else ""
    larger, helps = _larger_batches(row, rows)
    base = find(rows, row["strategy"], row["precision"], row.get("baseline_devices", 1), row["batch_size"]) or row
    s = dict(s, base_step_s=base.get("step_time_s") or step, base_devices=base["devices"])
    return kind, head + ": " + _CAUSES[kind](row, s, src, larger, helps)


def _from_account(row: dict, rows: list[dict], acc: Account) -> tuple[str, str]:
    """``(class, sentence)`` of a cell with an account: its largest term names the class; each term of at least
    ``QUOTED_SHARE`` of the lost time is quoted with its fix and the efficiency without it."""
    losses = sorted((t for t in acc.terms if t.seconds > 0), key=lambda t: -t.seconds)
    kind = KINDS[losses[0].name]
    if kind == "compute" and acc.term(OVERHEAD) is None and _tiny_steps_and_batch_helps(row, rows, acc.measured_s):
        kind = "overhead"
    quoted = [t for t in losses if (t is losses[0] or t.share >= QUOTED_SHARE) and t.name != RESIDUAL]
    terms = "".join(f"{t.name} {_ms(t.seconds)} ({t.share:.0%} of it; without it efficiency {acc.efficiency:.2f} → "
                    f"about {t.efficiency_without:.2f}): {t.fix}; " for t in quoted)
    residual = acc.term(RESIDUAL)
    if abs(residual.seconds) < 5e-5:  # under 0.05 ms: printed as 0.0, not as "-0.0 ms (-0%)"
        residual = RESIDUAL_NONE
    eff = f"efficiency {row['efficiency']:.2f}, " if row.get("efficiency") is not None else ""
    text = (f"{label(row)} is {kind}-bound ({eff}step {_ms(acc.measured_s)}): against the ideal {_ms(acc.ideal_s)} "
            f"({acc.scaling} scaling) each step loses {_ms(acc.gap_s)}; {terms}unattributed residual "
            f"{_ms(residual.seconds)} ({residual.share:.0%}).")
    return kind, text + _table_notes(row, rows, kind)


def _table_notes(row: dict, rows: list[dict], kind: str) -> str:
    """What the table adds to an account: whether larger batches on the same devices were more efficient, and for
    a compute-bound CPU cell that its processes share the machine."""
    larger, helps = _larger_batches(row, rows)
    text = ""
    if larger:
        text += " A larger per-device batch helps here: " + larger + "." if helps else \
            " " + larger[0].upper() + larger[1:] + "."
    if kind == "compute" and str(row.get("device", "")).startswith("cpu"):
        text += (f" On CPU the {row['devices']} processes share the machine's cores and memory bandwidth "
                 f"({row.get('omp_num_threads', '?')} thread(s) each).")
    return text


def _comm_cause(row, s, src, larger, helps) -> str:
    taken = ""
    if s["comm_s"] is not None:
        taken = (f"{EXPOSED} (backward's wait for the gradient all-reduce) takes {_ms(s['comm_s'])}, "
                 f"{s['comm_share']:.0%} of the step{src}. ")
    batch = ("A larger per-device batch amortizes it: " + larger + ". ") if helps else \
        (larger[0].upper() + larger[1:] + ". " if larger else "")
    return (taken + batch + "Gradient accumulation (accumulate_grad_batches=k) all-reduces once per k micro-batches; "
            "a faster interconnect shortens each all-reduce (`trainscale plan --probe` measures this one).")


def _data_cause(row, s, src, larger, helps) -> str:
    taken = f"fetching a batch takes {_ms(s['data_s'])}, {s['data_share']:.0%} of the step{src}. " \
        if s["data_s"] is not None else ""
    return (taken + "Load in parallel: return 'dataloader': {'num_workers': 2, 'pin_memory': True} from the entry "
            "(pinned memory on GPU).")


def _compute_cause(row, s, src, larger, helps) -> str:
    measured = ", ".join(f"{what} {_ms(s[key + '_s'])} ({s[key + '_share']:.0%})" for what, key in
                         ((EXPOSED, "comm"), ("data", "data")) if s[key + "_share"] is not None)
    small = "" if s["base_step_s"] < TINY_STEP_S else \
        f" and the steps are not tiny ({_ms(s['base_step_s'])} on {s['base_devices']} device(s))"
    text = (f"neither communication nor data explains the loss ({measured}{src}){small}: the devices compute "
            "slower together than alone.") if measured else f"the devices compute slower together than alone{small}."
    if str(row.get("device", "")).startswith("cpu"):
        text += (f" On CPU the {row['devices']} processes share the machine's cores and memory bandwidth "
                 f"({row.get('omp_num_threads', '?')} thread(s) each): more cores per process, or GPUs, would help.")
    return text + (f" {larger[0].upper() + larger[1:]}." if larger else "")


def _overhead_cause(row, s, src, larger, helps) -> str:
    return (f"the work per step is tiny, so a fixed cost per step (kernel launches, DDP hooks, Python) weighs "
            f"heavily; {larger}. Use a larger per-device batch.")


_CAUSES = {"communication": _comm_cause, "data": _data_cause, "compute": _compute_cause, "overhead": _overhead_cause}


def _time_to(row: dict, target: float) -> float | None:
    """Training seconds until validation accuracy first reached ``target`` (None if never)."""
    elapsed = 0.0
    for h in row.get("history") or []:
        elapsed += h.get("epoch_time_s") or 0.0
        if h.get("val_accuracy") is not None and h["val_accuracy"] >= target:
            return elapsed
    return None


def advise(rows: list[dict], target_accuracy: float | None = None) -> list[str]:
    """Advice sentences for rows that went through :func:`trainscale.bench.analysis.add_scaling`."""
    ok = [r for r in rows if r.get("status") == "ok" and r.get("samples_per_s")]
    out = []
    if not ok:
        out.append(f"No cell finished ({len(rows)} failed), so there is no throughput to compare.")
    else:
        best = max(ok, key=lambda r: r["samples_per_s"])
        gain = ""
        if best.get("gain") is not None and best["devices"] > best["baseline_devices"]:
            faster = "faster" if best["gain"] > 1 else "slower"
            ratio = best["gain"] if best["gain"] > 1 else 1 / best["gain"]
            gain = f", {ratio:.2f}× {faster} than {best['baseline_devices']} device(s) at this batch size"
        out.append(f"Fastest for throughput: {label(best)}: {best['samples_per_s']:,.0f} samples/s, epoch "
                   f"{fmt_time(best['epoch_time_s'])}{gain}.")
        for key in sorted({(r["strategy"], r["precision"], r["devices"]) for r in ok
                           if r.get("gain") is not None and r["devices"] > r["baseline_devices"]}):
            group = sorted((r for r in ok if (r["strategy"], r["precision"], r["devices"]) == key
                            and r.get("gain") is not None), key=lambda r: r["batch_size"])
            faster = [str(r["batch_size"]) for r in group if r["gain"] > 1]
            slower = [str(r["batch_size"]) for r in group if r["gain"] <= 1]
            lo, hi = min(group, key=lambda r: r["gain"]), max(group, key=lambda r: r["gain"])
            sentence = (f"{key[2]} devices ({key[0]}, {key[1]}): gain {lo['gain']:.2f}× (bs {lo['batch_size']}) to "
                        f"{hi['gain']:.2f}× (bs {hi['batch_size']}), efficiency {lo['efficiency']:.2f} to "
                        f"{hi['efficiency']:.2f}")
            sentence += f"; faster than {group[0]['baseline_devices']} device(s) at bs {', '.join(faster)}" \
                if faster else f"; never faster than {group[0]['baseline_devices']} device(s)"
            sentence += f", slower or equal at bs {', '.join(slower)}." if slower and faster else "."
            out.append(sentence)
    for r in sorted((r for r in ok if r.get("efficiency") is not None and r["efficiency"] > SUPERLINEAR),
                    key=lambda r: -r["efficiency"])[:3]:
        base = find(rows, r["strategy"], r["precision"], r["baseline_devices"], r["batch_size"])
        threads = f" (threads per process: {base.get('omp_num_threads')} vs {r.get('omp_num_threads')})" \
            if base and base.get("omp_num_threads") and r.get("omp_num_threads") else ""
        out.append(f"Check {label(r)}: efficiency {r['efficiency']:.2f} is above 1, i.e. more than linear; its "
                   f"baseline step took {_ms(base['step_time_s'])} against {_ms(r['step_time_s'])} here{threads}. "
                   "Super-linear gains usually mean the baseline was slowed (a loaded machine, CPU threads "
                   "competing, caches): rerun the baseline on an idle machine before trusting this cell.")
    if target_accuracy is not None:
        reached = [(t, r) for r in ok if (t := _time_to(r, target_accuracy)) is not None]
        if reached:
            t, r = min(reached, key=lambda tr: tr[0])
            out.append(f"Fastest to val_accuracy ≥ {target_accuracy:g}: {label(r)}, after {fmt_time(t)} of training "
                       f"({len(reached)} of {len(ok)} cells reached it).")
        else:
            acc = [r for r in ok if r.get("val_accuracy") is not None]
            if acc:
                r = max(acc, key=lambda r: r["val_accuracy"])
                out.append(f"No cell reached val_accuracy ≥ {target_accuracy:g}; the best was {r['val_accuracy']:.4f} "
                           f"({label(r)}). Train longer (--epochs) or lower the target.")
            else:
                out.append(f"Time to val_accuracy ≥ {target_accuracy:g} is unknown: no cell measured validation "
                           "accuracy (the entry returned no 'val' set, or no cell finished).")
    poor = [r for r in rows if is_poor(r)]
    for r in sorted(poor, key=lambda r: (r["strategy"], r["precision"], r["devices"], r["batch_size"])):
        out.append(diagnose(r, rows)[1])
    loaded = [r for r in rows if r.get("load_avg_1m") is not None and r.get("cpu_count")
              and r["load_avg_1m"] > r["cpu_count"]]
    if loaded:
        worst = max(loaded, key=lambda r: r["load_avg_1m"])
        out.append(f"Caution: the machine was busy while {len(loaded)} of {len(rows)} cells started (load average up to "
                   f"{worst['load_avg_1m']:.1f} on {worst['cpu_count']} cores, at {label(worst)}); other processes "
                   "took CPU time, so these timings are noisy: rerun on an idle machine before drawing conclusions.")
    if ok and not any(r.get("telemetry") for r in ok):
        out.append("Note: no cell recorded telemetry (step-phase split); the communication and data shares come "
                   "from each cell's probes: one gradient-sized all-reduce and one data-only pass over the loader, "
                   "timed alone (upper bounds of what a step waits for).")
    return out
