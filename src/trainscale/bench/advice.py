"""Advice from measured rows: the fastest configuration, time-to-accuracy, and for each poor cell the
bottleneck its numbers show. Every sentence quotes the numbers it rests on. Pure logic, no torch.

A cell is *poor* when it failed, when its scaling efficiency is below ``POOR_EFFICIENCY``, or when
data loading takes at least ``DATA_SHARE`` of its step. Its class, first that applies:

- memory-bound: it ran out of memory (``oom``);
- failed: timeout, exception or crash (the reason is quoted);
- communication-bound: all-reduce time ≥ ``COMM_SHARE`` of the step;
- data-bound: data wait ≥ ``DATA_SHARE`` of the step;
- overhead-bound: neither, the steps are tiny (the baseline's step at this batch size under
  ``TINY_STEP_S``), and efficiency rises by ≥ ``OVERHEAD_RISE`` at a larger batch size with the same
  devices — a fixed cost per step (kernel launches, DDP hooks, Python) that small steps do not amortize;
- compute-bound: none of the above: the devices themselves run slower together (on CPU, processes
  share the cores and memory bandwidth);
- unexplained: the step-phase split was not measured.

Shares come from telemetry (``summary["telemetry"]``) when the run recorded it, else from the cell's
probes (a lone gradient-sized all-reduce; a data-only pass over the loader), which bound them from above.
"""

from __future__ import annotations

from trainscale.bench.analysis import find, fmt_time, shares

POOR_EFFICIENCY = 0.75
COMM_SHARE = 0.25
DATA_SHARE = 0.25
OVERHEAD_RISE = 0.10
SUPERLINEAR = 1.10
TINY_STEP_S = 0.05


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


def diagnose(row: dict, rows: list[dict]) -> tuple[str, str]:
    """``(class, sentence)`` for one poor row (see the module docstring for the classes).

    ``rows`` (all rows, after :func:`trainscale.bench.analysis.add_scaling`) supply the comparison
    cells: the largest batch that ran, the efficiency at larger batches.
    """
    name = label(row)
    status = row.get("status")
    if status == "oom":
        ran = [r for r in rows if r.get("status") == "ok" and r["devices"] == row["devices"]
               and r["precision"] == row["precision"] and r["run_strategy"] == row["run_strategy"]
               and r.get("peak_memory_bytes")]
        biggest = max(ran, key=lambda r: r["per_device_batch"], default=None)
        more = ""
        if biggest is not None:
            more = (f"; the largest batch that ran here, {biggest['per_device_batch']}/device, peaked at "
                    f"{_gib(max(biggest['peak_memory_bytes']))} ({biggest.get('peak_memory_kind')})")
        return "memory", (f"{name} is memory-bound: it ran out of memory ({row.get('reason')}){more}. Use a smaller "
                          "per-device batch, bf16-mixed precision, or a sharded strategy (fsdp) if available.")
    if status != "ok":
        return "failed", f"{name} failed ({status}): {row.get('reason')}."

    s = shares(row)
    step = s["step_time_s"]
    eff = row.get("efficiency")
    eff_txt = f"efficiency {eff:.2f}, " if eff is not None and row["devices"] > row.get("baseline_devices", 1) else ""
    src = f" (source: {s['source']})" if s["source"] else ""
    comm_high = s["comm_share"] is not None and s["comm_share"] >= COMM_SHARE
    data_high = s["data_share"] is not None and s["data_share"] >= DATA_SHARE
    if comm_high and (not data_high or s["comm_share"] >= s["data_share"]):
        return "communication", (f"{name} is communication-bound ({eff_txt}step {_ms(step)}): the gradient all-reduce "
                                 f"takes {_ms(s['comm_s'])}, {s['comm_share']:.0%} of the step{src}. Larger batches "
                                 "amortize it; so do gradient accumulation (accumulate_grad_batches) and a faster "
                                 "interconnect.")
    if data_high:
        return "data", (f"{name} is data-bound ({eff_txt}step {_ms(step)}): fetching a batch takes {_ms(s['data_s'])}, "
                        f"{s['data_share']:.0%} of the step{src}. Load in parallel: return "
                        "'dataloader': {'num_workers': 2, 'pin_memory': True} from the entry (pinned memory on GPU).")
    if s["comm_share"] is None and s["data_share"] is None:
        return "unexplained", (f"{name} scales poorly ({eff_txt}step {_ms(step) if step else '—'}) but the step-phase "
                               "split was not measured (no telemetry and no probe), so the cause cannot be named.")
    measured = ", ".join(f"{what} {_ms(s[key + '_s'])} ({s[key + '_share']:.0%})" for what, key in
                         (("all-reduce", "comm"), ("data", "data")) if s[key + "_share"] is not None)
    larger = [r for r in rows if r.get("efficiency") is not None and r["devices"] == row["devices"]
              and r["precision"] == row["precision"] and r["run_strategy"] == row["run_strategy"]
              and r["batch_size"] > row["batch_size"]]
    best = max(larger, key=lambda r: r["efficiency"], default=None)
    base = find(rows, row["strategy"], row["precision"], row.get("baseline_devices", 1), row["batch_size"])
    base_step = (base or row).get("step_time_s") or step
    if eff is not None and best is not None and best["efficiency"] >= eff + OVERHEAD_RISE and base_step < TINY_STEP_S:
        return "overhead", (f"{name} is overhead-bound ({eff_txt}step {_ms(step)}, of which {measured}{src}): the "
                            f"work per step is tiny ({_ms(base_step)} on {(base or row)['devices']} device(s)), so "
                            f"a fixed cost per step weighs heavily; efficiency rises to {best['efficiency']:.2f} at "
                            f"bs {best['batch_size']}. Use a larger per-device batch.")
    cpu = ""
    if str(row.get("device", "")).startswith("cpu"):
        cpu = (f" On CPU the {row['devices']} processes share the machine's cores and memory bandwidth "
               f"({row.get('omp_num_threads', '?')} thread(s) each).")
    small = "" if base_step < TINY_STEP_S else f" and the steps are not tiny ({_ms(base_step)} on " \
        f"{(base or row)['devices']} device(s))"
    return "compute", (f"{name} is compute-bound ({eff_txt}step {_ms(step)}, of which {measured}{src}): neither "
                       f"communication nor data explains the loss{small}; the devices run slower together than "
                       f"alone.{cpu}")


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
        gain = f", {best['gain']:.2f}× the {best['baseline_devices']}-device epoch time at this batch size" \
            if best.get("gain") is not None and best["devices"] > best["baseline_devices"] else ""
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
