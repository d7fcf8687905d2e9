"""One module declares and reads the method, budget and knob flags of the CLI and the benchmarks: the same
flags, the same checks, the same messages everywhere."""
import argparse

import pytest

from benchmarks import engine_overhead, quality, speed
from prefixkv_core.__main__ import build_parser as cli_parser
from prefixkv_core.method_args import (MethodArgError, add_knob_flags, add_method_args, knob_flag, method_args,
                                       parse_budgets, resolve_knob_flags)
from prefixkv_core.policies import METHODS, Budget, ResolveContext


def cli(*flags):
    return cli_parser().parse_args(["compare", "--prompt", "Hi", *flags])


def quality_args(*flags):
    return quality.build_parser().parse_args(list(flags))


def speed_args(*flags):
    return speed.build_parser().parse_args(list(flags))


def test_parse_budgets_sorts_dedups_and_types():
    out = parse_budgets("0.5, 0.1,0.5,,0.3")
    assert out == [0.1, 0.3, 0.5] and all(isinstance(b, Budget) for b in out)
    assert parse_budgets(0.2) == [0.2] and parse_budgets("1") == [1.0]


@pytest.mark.parametrize("text, message", [
    ("", "--budgets is empty: give kept fractions in (0, 1], e.g. 0.1,0.3,0.5"),
    (" , ", "--budgets is empty: give kept fractions in (0, 1], e.g. 0.1,0.3,0.5"),
    ("0.1,half", "--budgets expects kept fractions in (0, 1], e.g. 0.1,0.3,0.5; got '0.1,half'"),
    ("0.1,0", "--budgets: budget must be a kept fraction in (0, 1], got 0"),
    ("1.5", "--budgets: budget must be a kept fraction in (0, 1], got 1.5"),
    ("nan", "--budgets: budget must be a number in (0, 1], got nan"),
])
def test_parse_budgets_names_the_flag(text, message):
    with pytest.raises(MethodArgError) as info:
        parse_budgets(text)
    assert str(info.value) == message


def test_cli_reads_one_budget_methods_knobs_and_modes():
    chosen = method_args(cli("--methods", "h2o, snapkv,h2o", "--budget", "0.2", "--knob", "snapkv.window=16",
                             "--knob", "prefixkv.ratios=0.5,0.3", "--equal-memory", "--query-agnostic"))
    assert chosen.methods == ["h2o", "snapkv"] and chosen.budgets == [0.2] and chosen.budget == 0.2
    assert isinstance(chosen.budget, Budget)
    assert chosen.knobs == {"snapkv": {"window": 16}, "prefixkv": {"ratios": [0.5, 0.3]}}
    assert chosen.budget_mode == "equal_memory" and chosen.query_agnostic is True
    assert chosen.reference is None  # the CLI compares what it is given
    default = method_args(cli())
    assert default.methods == list(METHODS) and default.budget == 0.3 and default.knobs == {}
    assert default.budget_mode == "published" and default.query_agnostic is False


@pytest.mark.parametrize("flags, message", [
    (("--budget", "0"), "--budget: budget must be a kept fraction in (0, 1], got 0"),
    (("--budget", "0.1,0.2"), "--budget takes one kept fraction in (0, 1], got '0.1,0.2'"),
    (("--methods", "full,nope"), "--methods: unknown method(s) 'nope'; accepted: full"),
    (("--knob", "snapkv.window"), "--knob: a knob is METHOD.KNOB=VALUE (e.g. snapkv.window=16), got 'snapkv.window'"),
    (("--knob", "window=4"), "--knob: a knob is METHOD.KNOB=VALUE"),
])
def test_cli_refuses_bad_flags_naming_them(flags, message):
    with pytest.raises(MethodArgError) as info:
        method_args(cli(*flags))
    assert str(info.value).startswith(message)


def test_cli_reports_a_bad_flag_before_loading_a_model(capsys):
    from prefixkv_core.__main__ import main

    assert main(["compare", "--prompt", "Hi", "--model", "no-such-model", "--budget", "2"]) == 2
    assert capsys.readouterr().err.strip() == "error: --budget: budget must be a kept fraction in (0, 1], got 2"


def test_quality_reads_several_budgets_and_always_runs_the_reference():
    chosen = method_args(quality_args("--methods", "h2o,prefixkv", "--budgets", "0.5,0.1"),
                         budgets_default="0.3", with_reference=True)
    assert chosen.methods == ["full", "h2o", "prefixkv"] and chosen.reference == "full"
    assert chosen.budgets == [0.1, 0.5]
    unset = method_args(quality_args("--methods", "snapkv,full"), budgets_default="0.3,0.2", with_reference=True)
    assert unset.methods == ["snapkv", "full"] and unset.budgets == [0.2, 0.3]  # the default when --budgets is unset
    with pytest.raises(MethodArgError, match="^--budgets: budget must be a kept fraction"):
        method_args(quality_args("--budgets", "0.2,7"), with_reference=True)


def test_speed_reads_the_same_flags_with_its_own_defaults():
    chosen = method_args(speed_args("--methods", "local", "--budgets", "0.8,0.2", "--knob", "local.window=8",
                                    "--query-agnostic"))
    assert chosen.methods == ["local"] and chosen.budgets == [0.2, 0.8] and chosen.knobs == {"local": {"window": 8}}
    assert chosen.query_agnostic and chosen.budget_mode == "published"
    assert method_args(speed_args()).budgets == [Budget(b) for b in (0.2, 0.4, 0.6, 0.8)]
    assert method_args(speed_args()).methods == list(METHODS)  # --methods unset: all
    with pytest.raises(MethodArgError, match="^--methods: unknown method"):
        method_args(speed_args("--methods", "fulll"))


def test_engine_overhead_takes_the_shared_flags_too():
    with pytest.raises(SystemExit, match=r"^--budget: budget must be a kept fraction in \(0, 1\], got 1.2$"):
        engine_overhead.main(["--budget", "1.2"])
    with pytest.raises(SystemExit, match="^--methods: unknown method"):
        engine_overhead.main(["--methods", "nope"])


# -- a knob a policy exposes as a flag of its own (--prefixkv-mode) --------------------------------------------
TINY = ResolveContext("tiny-llama", "tiny-llama", 2, 0.3)  # no calibrated ratios for this model
EMBEDDED = ResolveContext("embedded-smollm2-135m", "embedded", 30, 0.3)  # calibrated (assets/prefix_configs)


def test_the_prefixkv_mode_flag_is_built_from_the_policy_declaration():
    assert knob_flag("prefixkv", "mode") == "--prefixkv-mode"
    p = argparse.ArgumentParser()
    add_knob_flags(p)
    action = next(a for a in p._actions if "--prefixkv-mode" in a.option_strings)
    assert action.default == "auto" and tuple(action.choices) == ("auto", "online", "offline")
    assert "offline where this model is calibrated, else online" in action.help
    assert "--prefixkv-mode" in quality.build_parser().format_help()


@pytest.mark.parametrize("flags, context, mode", [
    ((), TINY, "online"),  # auto: the policy's pick for the model
    ((), EMBEDDED, "offline"),
    (("--prefixkv-mode", "online"), EMBEDDED, "online"),
    (("--prefixkv-mode", "offline"), TINY, "offline"),  # as asked: the run then says the model is not calibrated
    (("--prefixkv-mode", "offline", "--knob", "prefixkv.mode=online"), EMBEDDED, "online"),  # --knob wins
])
def test_the_prefixkv_mode_flag_resolves_into_the_knobs(flags, context, mode):
    chosen = method_args(quality_args("--methods", "h2o,prefixkv", *flags), budgets_default="0.3",
                         with_reference=True)
    assert resolve_knob_flags(quality_args("--methods", "h2o,prefixkv", *flags), chosen, context) == \
        {"prefixkv": {"mode": mode}}
    assert chosen.knobs["prefixkv"]["mode"] == mode and "h2o" not in chosen.knobs


def test_the_flag_leaves_a_run_without_its_method_alone():
    args = quality_args("--methods", "h2o", "--prefixkv-mode", "offline")
    chosen = method_args(args, budgets_default="0.3", with_reference=True)
    assert resolve_knob_flags(args, chosen, TINY) == {} and chosen.knobs == {}


def test_a_parser_without_knob_flags_runs_every_method_with_its_own_defaults():
    p = argparse.ArgumentParser()
    add_method_args(p)
    args = p.parse_args(["--methods", "prefixkv"])
    chosen = method_args(args)
    assert resolve_knob_flags(args, chosen, EMBEDDED) == {"prefixkv": {"mode": "offline"}}  # auto where unset
