"""The arithmetic behind ``calibrate``: the copy fit and the agreement figures (white-box: the
CLI's tests see them only through a real-time run, whose figures vary)."""

from __future__ import annotations

import pytest

from aiostream._bench.calibrate import Op, agreement, fit

SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20)


def test_the_fit_recovers_latency_and_bandwidth() -> None:
    seconds = [5e-6 + n / 10e9 for n in SIZES]
    latency, bandwidth, error = fit(SIZES, seconds)
    assert latency == pytest.approx(5e-6, rel=1e-9)
    assert bandwidth == pytest.approx(10e9, rel=1e-9)
    assert error < 1e-9


def test_the_fit_keeps_latency_at_least_zero_and_reports_its_error() -> None:
    seconds = [n / 10e9 * (1.5 if n == SIZES[0] else 1.0) for n in SIZES]
    seconds[0] = SIZES[0] / 20e9  # the small copy faster than the line: a negative intercept
    latency, bandwidth, error = fit(SIZES, seconds)
    assert latency == 0.0
    assert bandwidth > 0 and error > 0.1


def test_agreement_measures_totals_and_start_errors_against_the_device() -> None:
    device = [Op("a", 0.0, 1.0), Op("b", 1.0, 2.0), Op("c", 2.0, 4.0)]
    same = agreement(device, device)
    assert (same.total, same.total_error, same.start_error) == (4.0, 0.0, 0.0) and same.met()
    late = [Op("a", 0.0, 1.0), Op("b", 1.05, 2.05), Op("c", 2.5, 4.19)]
    a = agreement(device, late)
    assert a.total_error == pytest.approx(0.0475)
    assert a.start_error == pytest.approx(0.05)  # the median of 0, 0.05 and 0.25
    assert a.met()
    assert not agreement(device, [Op("a", 0.0, 1.0), Op("b", 1.2, 2.0), Op("c", 2.5, 4.3)]).met()
