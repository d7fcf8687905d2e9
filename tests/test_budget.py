"""The budget type: checked once where a budget enters, a plain float after that."""
import copy
import json
import math
import pickle

import numpy as np
import pytest

from prefixkv_core import Engine, EngineError
from prefixkv_core.policies import Budget, PolicyError, check_budget, make_policy


@pytest.mark.parametrize("value", [1e-6, 0.1, 0.3, 0.5, 1, 1.0, np.float64(0.25)])
def test_kept_fractions_in_range_are_budgets(value):
    b = Budget(value)
    assert isinstance(b, Budget) and isinstance(b, float)
    assert b == float(value) and type(float(b)) is float


@pytest.mark.parametrize("value, message", [
    (0, "budget must be a kept fraction in (0, 1], got 0"),
    (0.0, "budget must be a kept fraction in (0, 1], got 0"),
    (-0.2, "budget must be a kept fraction in (0, 1], got -0.2"),
    (1.0000001, "budget must be a kept fraction in (0, 1], got 1.0000001"),  # never shown as an accepted value
    (1 + 2 ** -52, "budget must be a kept fraction in (0, 1], got 1.0000000000000002"),
    (30, "budget must be a kept fraction in (0, 1], got 30"),
    (math.nan, "budget must be a number in (0, 1], got nan"),
    (math.inf, "budget must be a number in (0, 1], got inf"),
    ("0.3", "budget must be a number in (0, 1], got '0.3'"),
    (None, "budget must be a number in (0, 1], got None"),
    (True, "budget must be a number in (0, 1], got True"),
    ([0.3], r"budget must be a number in (0, 1], got [0.3]"),
])
def test_out_of_range_and_non_numbers_are_refused_with_what_is_accepted(value, message):
    with pytest.raises(PolicyError) as info:
        Budget(value)
    assert str(info.value) == message


def test_a_long_bad_value_is_shown_cut():
    with pytest.raises(PolicyError) as info:
        Budget("x" * 500)
    shown = str(info.value).split("got ", 1)[1]
    assert len(shown) == 40 and shown.endswith("…")


def test_wrapping_is_idempotent():
    b = Budget(0.3)
    assert Budget(b) is b and check_budget(b) is b
    assert Budget(Budget(Budget(0.7))) == 0.7
    assert make_policy("h2o", b).budget is b  # a policy keeps the checked value as it is


def test_a_budget_behaves_as_the_number_it_is():
    b = Budget(0.25)
    assert b * 4 == 1.0 and type(b * 4) is float  # arithmetic gives plain floats (no range to keep)
    assert 1 - b == 0.75 and b / 2 == 0.125 and round(b * 100) == 25
    assert f"{b:.2f}" == "0.25" and str(b) == "0.25" and repr(b) == "0.25"
    assert json.dumps({"budget": b}) == '{"budget": 0.25}'
    assert hash(b) == hash(0.25) and {b: 1}[0.25] == 1 and len({b, Budget(0.25), 0.25}) == 1
    assert sorted([Budget(0.5), Budget(0.1), 0.3]) == [0.1, 0.3, 0.5]
    assert Budget(0.1) < Budget(0.2) <= 0.2
    assert np.isclose(np.float64(b), 0.25) and np.array([b]).dtype == np.float64
    for again in (copy.copy(b), copy.deepcopy(b), pickle.loads(pickle.dumps(b))):
        assert again == b and isinstance(again, Budget)
    with pytest.raises(AttributeError):
        b.note = "a Budget carries nothing but its value"


def test_the_boundaries_refuse_with_their_own_error(tiny_llama):
    with pytest.raises(PolicyError, match=r"budget must be a kept fraction in \(0, 1\], got 1.5"):
        make_policy("snapkv", 1.5)
    with pytest.raises(EngineError, match=r"budget must be a kept fraction in \(0, 1\], got 0"):
        Engine(tiny_llama).new_session(None, "Hi", ["h2o"], budget=0)
