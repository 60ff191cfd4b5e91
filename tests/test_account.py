"""The speed-up account as pure arithmetic: made-up telemetry whose every second is known."""

import math

import pytest

from trainscale.telemetry.account import (COMM, DATA, OVERHEAD, RESIDUAL, SLOWDOWN, STRONG, WAIT, WEAK, account, bar,
                                          fit_compute, infer_scaling, render, step_split)


def tele(walls, data, forward, backward, optimizer, exposed=None):
    """A ``summary["telemetry"]`` with per-rank fields (seconds per step)."""
    phases = {"data": data, "forward": forward, "backward": backward, "optimizer": optimizer}
    return {"step_time_s": sum(walls) / len(walls), "phase_s": {p: sum(v) / len(v) for p, v in phases.items()},
            "exposed_comm_s": None if exposed is None else sum(exposed) / len(exposed),
            "rank_step_time_s": walls, "rank_phase_s": phases, "rank_exposed_comm_s": exposed}


# one device: 10 data + 60 forward/backward + 10 optimizer = 80 ms
BASE = tele([0.080], [0.010], [0.020], [0.040], [0.010])
# two devices, weak scaling: rank 1 computes 30 ms longer (a straggler), rank 0 waits for it; the all-reduce's own
# exposed cost is 5 ms; data grew by 20 ms on both ranks; forward by 4 ms (the processes share the cores)
RUN = tele([0.139, 0.139], [0.030, 0.030], [0.024, 0.054], [0.040 + 0.035, 0.045], [0.010, 0.010],
           exposed=[0.035, 0.005])


def test_split_reads_the_rank_that_waited_and_the_slowest_rank():
    s = step_split(RUN, devices=2, per_device_batch=32)
    assert (s.rank, s.slowest_rank) == (0, 1)
    assert s.comm_s == pytest.approx(0.005) and s.wait_s == pytest.approx(0.030)
    assert s.data_s == pytest.approx(0.030) and s.compute_s == pytest.approx(0.024 + 0.040 + 0.010)
    assert s.other_s == pytest.approx(0.0, abs=1e-12)


def test_weak_scaling_terms_recover_each_known_part_and_add_up_to_the_gap():
    acc = account(step_split(RUN, 2, 32), step_split(BASE, 1, 32), WEAK)
    assert acc.ideal_s == pytest.approx(0.080) and acc.measured_s == pytest.approx(0.139)
    assert acc.gap_s == pytest.approx(0.059) and acc.efficiency == pytest.approx(0.080 / 0.139)
    expected = {COMM: 0.005, DATA: 0.020, WAIT: 0.030, SLOWDOWN: 0.004, RESIDUAL: 0.0}
    assert {t.name: t.seconds for t in acc.terms} == pytest.approx(expected, abs=1e-12)
    assert math.fsum(t.seconds for t in acc.terms) == pytest.approx(acc.gap_s, abs=1e-15)
    assert acc.term(OVERHEAD) is None  # one batch size: not separated from the slowdown
    data = acc.term(DATA)
    assert data.share == pytest.approx(0.020 / 0.059)
    assert data.efficiency_without == pytest.approx(0.080 / (0.139 - 0.020))
    assert "1 DataLoader worker" in data.fix  # 30 ms of data against 109 ms of the rest: one worker keeps up


def test_time_outside_the_phases_and_unequal_walls_land_in_the_residual():
    run = tele([0.150, 0.146], [0.030, 0.030], [0.024, 0.054], [0.075, 0.045], [0.010, 0.010], exposed=[0.035, 0.005])
    acc = account(step_split(run, 2, 32), step_split(BASE, 1, 32), WEAK)
    # rank 0's wall is 11 ms longer than its phases; the mean wall is 2 ms shorter than rank 0's
    assert acc.term(RESIDUAL).seconds == pytest.approx(0.148 - 0.139, abs=1e-12)
    assert math.fsum(t.seconds for t in acc.terms) == pytest.approx(acc.gap_s, abs=1e-15)


def test_strong_scaling_divides_the_baseline_and_fits_split_overhead_from_slowdown():
    # compute = 8 ms fixed + 1 ms/sample on one device; 10 ms fixed + 1.1 ms/sample on two
    one = [step_split(tele([0.008 + 0.001 * b], [0.0], [0.0], [0.008 + 0.001 * b], [0.0]), 1, b) for b in (16, 64)]
    two = [step_split(tele([0.010 + 0.0011 * b] * 2, [0.0] * 2, [0.0] * 2, [0.010 + 0.0011 * b] * 2, [0.0] * 2,
                           exposed=[0.0, 0.0]), 2, b) for b in (8, 32)]
    fits = fit_compute(two), fit_compute(one)
    assert fits[1].fixed_s == pytest.approx(0.008) and fits[1].per_sample_s == pytest.approx(0.001)
    acc = account(two[1], one[1], STRONG, fits)  # global batch 64: 32 per device
    assert acc.ideal_s == pytest.approx((0.008 + 0.064) / 2)
    # the fixed 8 ms does not halve (and grew to 10 ms); each of the 32 samples takes 0.1 ms longer
    assert acc.term(OVERHEAD).seconds == pytest.approx(0.010 - 0.004)
    assert acc.term(SLOWDOWN).seconds == pytest.approx(0.0001 * 32)
    assert acc.term(RESIDUAL).seconds == pytest.approx(0.0, abs=1e-12)
    assert "shrinks it N-fold" in acc.term(OVERHEAD).fix


def test_fit_needs_two_batch_sizes():
    assert fit_compute([step_split(BASE, 1, 32)] * 3) is None


@pytest.mark.parametrize("args, expected", [((64, 2, 64, 1), STRONG), ((64, 2, 32, 1), WEAK), ((128, 4, 64, 2), WEAK)])
def test_scaling_is_inferred_from_the_global_batches(args, expected):
    assert infer_scaling(*args) == expected


def test_bad_input_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="neither the same global batch"):
        infer_scaling(48, 2, 64, 1)
    with pytest.raises(ValueError, match="needs fewer devices"):
        account(step_split(BASE, 1, 32), step_split(BASE, 1, 32), WEAK)
    with pytest.raises(ValueError, match="'weak' or 'strong'"):
        account(step_split(RUN, 2, 32), step_split(BASE, 1, 32), "linear")
    with pytest.raises(ValueError, match="enable_telemetry"):
        step_split({"step_time_s": float("nan"), "phase_s": {}}, 1, 32)


def test_older_telemetry_without_per_rank_fields_reads_as_one_rank():
    old = {"step_time_s": 0.1, "phase_s": {"data": 0.01, "forward": 0.03, "backward": 0.05, "optimizer": 0.01},
           "exposed_comm_s": 0.02}
    s = step_split(old, 2, 8)
    assert (s.comm_s, s.wait_s) == (0.02, 0.0) and s.compute_s == pytest.approx(0.07)


def test_text_shows_a_bar_as_long_as_the_step_and_each_term_with_its_fix():
    acc = account(step_split(RUN, 2, 32), step_split(BASE, 1, 32), WEAK)
    b = bar(acc, width=139)  # 1 character per ms
    assert len(b) == 141 and b.count("=") == 80 and b.count("W") == 30 and b.count("D") == 20 and b.count("C") == 5
    text = render(acc, "bs 32 on 2 devices")
    assert text.startswith("bs 32 on 2 devices: ideal 80.0 ms, measured 139.0 ms, gap 59.0 ms, efficiency 0.58 "
                           "(weak scaling")
    [line] = [line for line in text.splitlines() if line.startswith("  W waiting for the slowest rank ")]
    assert line.split()[6:16] == ["30.0", "ms", "51%", "of", "the", "gap;", "without", "it", "efficiency", "0.58"]
    assert "efficiency 0.58 → 0.73: " in line
    assert "rank 1 is slower than rank 0" in text
    assert "includes any per-step fixed overhead: they are separated by timings" in text
    faster = account(step_split(RUN, 2, 32), step_split(tele([0.080], [0.002], [0.028], [0.040], [0.010]), 1, 32),
                     WEAK)  # compute 4 ms faster than on one device: a negative term, not drawn
    assert faster.term(SLOWDOWN).seconds < 0 and len(bar(faster, 40)) == 42 and "S" not in bar(faster, 40)
    assert "? residual" in text and "not a loss" in text and ", ? residual" not in text  # 0 s: listed, not drawn
    short = render(acc, detail=False).splitlines()
    assert len(short) == 2 and short[1].endswith("= ideal, W waiting for the slowest rank 30.0 ms, D data wait "
                                                 "20.0 ms, C exposed communication 5.0 ms, S compute slowdown 4.0 ms")
