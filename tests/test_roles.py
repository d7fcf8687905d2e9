"""Roles: the parts a method plays beyond its own panel are declared by its policy, checked at registration, and
everything that needs one (record, charts, tables, benchmarks) asks the registry."""
import dataclasses

import pytest

from prefixkv_core import describe
from prefixkv_core.policies import (REGISTRY, ROLES, PolicyError, register, role_label, role_method, role_methods,
                                    unregister)
from prefixkv_core.policies.base import Policy


def _policy(name: str, colour: str, **attrs) -> type[Policy]:
    body = {"name": name, "label": name.title(), "summary": "a method for a test", "colour": colour,
            "prefill": lambda self, view: None, **attrs}
    return dataclasses.dataclass(frozen=True)(type(name.title() + "Policy", (Policy,), body))


def test_every_role_is_played_by_one_built_in_method():
    assert role_methods() == {"reference": "full", "lorenz": "prefixkv", "featured": "prefixkv"}
    assert set(role_methods()) == set(ROLES)
    assert role_label("reference") == "Full" and role_label("lorenz") == "PrefixKV"
    roles = {d["name"]: d["roles"] for d in describe()}
    assert roles["full"] == ["reference"] and roles["prefixkv"] == ["lorenz", "featured"] and roles["h2o"] == []


def test_an_unknown_role_is_refused():
    cls = _policy("judge", "#010203", roles=("referee",))
    with pytest.raises(PolicyError, match=r"JudgePolicy.roles: 'referee' is not one of 'reference', 'lorenz', "
                                          r"'featured'"):
        register(cls)
    assert "judge" not in REGISTRY
    with pytest.raises(PolicyError, match="unknown role 'referee'"):
        role_method("referee")


@pytest.mark.parametrize("role, holder", [("reference", "full"), ("lorenz", "prefixkv"), ("featured", "prefixkv")])
def test_a_second_method_claiming_a_taken_role_is_refused(role, holder):
    cls = _policy("usurper", "#0A0B0C", roles=(role,))
    with pytest.raises(PolicyError, match=f"UsurperPolicy plays the '{role}' role, which {holder} already plays"):
        register(cls)
    assert "usurper" not in REGISTRY and role_method(role) == holder


def test_a_method_playing_no_role_registers():
    cls = _policy("bystander", "#0D0E0F")
    register(cls)
    try:
        assert REGISTRY["bystander"] is cls and "bystander" not in role_methods().values()
    finally:
        unregister("bystander")


def test_flag_knobs_must_name_a_knob_with_named_choices():
    with pytest.raises(PolicyError, match="'speed' is not one of its knobs with named choices"):
        register(_policy("flagged", "#102030", flag_knobs={"speed": "fast"}))
    assert "flagged" not in REGISTRY
