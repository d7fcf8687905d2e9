"""A step's parts timed without waiting for the device (`decoding/stopwatch.py`): the seconds are read only when
asked for, a row's share of joint work is weighted, and the policy calls hand back such lazy seconds (on a
clock the tests drive, so nothing here depends on how fast the machine is)."""
import pytest
import torch

from prefixkv_core.decoding import runner, stopwatch
from prefixkv_core.decoding.stopwatch import Elapsed, Stopwatch


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = _Clock()
    monkeypatch.setattr(stopwatch.time, "perf_counter", fake)
    return fake


def test_elapsed_sums_its_weighted_spans(clock):
    watch = Stopwatch(torch.device("cpu"))
    a = watch.mark()
    clock.now += 2.0
    b = watch.mark()
    clock.now += 1.0
    c = watch.mark()
    both = Elapsed(watch)
    both.add(a, b)
    both.add(b, c, 0.5)
    assert watch.seconds(a, b) == 2.0 and float(both) == 2.5
    assert float(Elapsed()) == 0.0


class _Row:
    """A stand-in DecodeRow whose planning and holding take known times on the test's clock, or whose policy
    fails."""

    def __init__(self, clock: _Clock, plan_s: float, hold_s: float, fail: bool = False):
        self.clock, self.plan_s, self.hold_s, self.fail, self.held = clock, plan_s, hold_s, fail, False
        self.attention = None  # (the step recorded none for it)

    def plans(self):
        self.clock.now += self.plan_s
        if self.fail:
            raise ValueError("this policy failed")
        return None

    def hold(self):
        self.clock.now += self.hold_s
        self.held = True


def test_each_row_gets_its_own_policy_seconds_and_a_failing_row_fails_alone(clock):
    rows = [_Row(clock, 1.0, 0.25), _Row(clock, 4.0, 8.0, fail=True), _Row(clock, 2.0, 0.5)]
    (s0, e0), (s1, e1), (s2, e2) = runner.compress_decode_rows(rows, torch.device("cpu"))
    assert e0 is None and e2 is None and isinstance(e1, ValueError)
    assert rows[0].held and not rows[1].held and rows[2].held
    assert isinstance(s0, Elapsed) and (float(s0), float(s1), float(s2)) == (1.25, 4.0, 2.5)
