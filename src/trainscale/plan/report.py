"""The plan as text: one table per strategy (bench's layout: one line per device count and batch size)."""

from __future__ import annotations

from trainscale.jobs.format import fmt_time, text_table


def fmt_bytes(n: int | None) -> str:
    """``"1.50 GiB"``, ``"120.0 MiB"``, ``"3.1 KiB"``; "—" for None."""
    if n is None:
        return "—"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" if unit == "GiB" else f"{n / size:.1f} {unit}"
    return f"{n} B"


def _line(row) -> list[str]:
    m = row.memory
    mem = [fmt_bytes(getattr(m, k, None)) for k in ("parameters", "gradients", "optimizer", "activations", "peak")]
    fits = "—" if row.fits is None else ("yes" if row.fits else "NO")
    span = f" ({row.step_interval[0] * 1e3:.1f}–{row.step_interval[1] * 1e3:.1f})" if row.step_interval else ""
    time = [f"{row.step_s * 1e3:.1f} ms{span}" if row.step_s is not None else "—",
            f"{row.comm_s * 1e3:.1f} ms" if row.comm_s is not None else "—", fmt_time(row.epoch_s),
            f"{row.gain:.2f}×" if row.gain is not None else "—",
            f"{row.efficiency:.2f}" if row.efficiency is not None else "—"]
    return [str(row.devices), str(row.batch_size), *mem, fits, *time, row.note]


def format_plan(result) -> str:
    """Tables of ``result`` (a :class:`~trainscale.plan.planner.PlanResult`) and the two picks."""
    head = ["devices", "bs/device", "params", "grads", "optimizer", "activations", "peak", "fits", "step", "comm",
            "epoch", "gain", "eff", ""]
    out = _setting_lines(result)
    for strategy in dict.fromkeys(r.strategy for r in result.rows):
        rows = [r for r in result.rows if r.strategy == strategy]
        out.append(f"\n{strategy} · {rows[0].precision} (bytes per device; epoch mm:ss.s; gain over 1 device)")
        out.append(text_table(head, [_line(r) for r in rows]))
    small, fast = result.smallest(), result.fastest()
    out.append("")
    out.append(f"Smallest memory that fits: {_name(small)}" + (f", peak {fmt_bytes(small.memory.peak)}" if small else ""))
    if result.link:
        out.append(f"Fastest that fits: {_name(fast)}" + (f", epoch {fmt_time(fast.epoch_s)}, step "
                                                          f"{fast.step_s * 1e3:.1f} ms" if fast else ""))
    if result.constants:
        out.append("Time model constants (the step's interval spans their ranges):")
        out.extend(f"  - {c}" for c in result.constants)
    return "\n".join(out)


def _setting_lines(result) -> list[str]:
    """The lines above the tables: the device memory, the link (or none), the hardware, the overlap used."""
    out = [f"Device memory {fmt_bytes(result.device_memory)}; "
           + (f"link: {result.link}" if result.link else "no link given (--bandwidth or --probe): memory only")]
    if result.hardware:
        out.append(f"Hardware: {result.hardware}")
    if result.link and result.overlap:
        shares = sorted(set(result.overlap.values()))
        span = f"{shares[0]:.2f}" if len(shares) == 1 else f"{shares[0]:.2f}–{shares[-1]:.2f}"
        out.append(f"Overlap of communication and backward: {span} of backward ({result.overlap_source})")
    return out


def _name(row) -> str:
    if row is None:
        return "none"
    return f"{row.strategy} on {row.devices} device{'s' if row.devices > 1 else ''} at bs {row.batch_size}/device"
