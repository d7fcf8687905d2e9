"""The arguments of the command line, declared and read in one place for the CLI (`python -m prefixkv_core
compare`), the app, the benchmarks and the training: the model flags (--model, --device, --dtype) and the
method, budget and knob flags, with the same names, help and checks everywhere. A budget is range-checked
here, once, and travels on as a `Budget`."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from .models.device import DEVICES_ACCEPTED, DTYPES_ACCEPTED
from .policies import (REGISTRY, Budget, PolicyError, ResolveContext, knob_fields, parse_knobs, resolve_methods,
                       role_method)

AUTO = "auto"  # a knob flag's default: the policy's own pick for the model

EQUAL_MEMORY_HELP = ("also hold the prompt-only methods (schedule 'prompt only' in `python -m prefixkv_core methods`, "
                     "and PrefixKV with decode=grow) at r·N_t while decoding, so every budgeted method holds the same "
                     "memory (default: each as published)")
QUERY_AGNOSTIC_HELP = ("compress the image and any text before the question first, then feed the question and answer "
                       "on the compressed cache, as in a chat about one image (default: compress with the question "
                       "in the prompt)")


MODEL_HELP = ("'embedded' (works offline), 'tiny-llama'/'tiny-qwen2' or tiny-<family> (random, for tests: "
              "tiny-llava-1.5, tiny-llava-interleave, tiny-llava-next, tiny-llava-onevision), a Hugging Face hub id of "
              "a LLaVA-1.5, -Interleave, -NeXT or -OneVision checkpoint such as "
              "llava-hf/llava-onevision-qwen2-0.5b-ov-hf, or a local model directory")
DEVICE_HELP = f"{DEVICES_ACCEPTED}; auto: CUDA if present, else CPU; auto-multi: the model spread over every GPU"
DTYPE_HELP = f"{DTYPES_ACCEPTED}; auto: bfloat16 on CUDA, float32 on CPU"


def add_model_args(p: argparse.ArgumentParser, *, default_model: str | None = "embedded",
                   default_device: str = "auto", default_dtype: str = "auto", model_help: str | None = None,
                   device_help: str | None = None) -> None:
    """--model, --device and --dtype (what `load_model` takes). Each command passes its documented defaults;
    `model_help` / `device_help` replace the common wording where a command reads the flag its own way."""
    p.add_argument("--model", default=default_model, help=model_help or f"{MODEL_HELP} (default {default_model})")
    add_device_arg(p, default_device, device_help)
    p.add_argument("--dtype", default=default_dtype, help=f"{DTYPE_HELP} (default {default_dtype})")


def add_device_arg(p: argparse.ArgumentParser, default: str = "auto", help: str | None = None) -> None:
    """--device alone, for a command whose model is fixed (the training stages)."""
    p.add_argument("--device", default=default, help=help or f"{DEVICE_HELP} (default {default})")


class MethodArgError(ValueError):
    """A bad method, budget or knob argument; the message starts with the flag."""


@dataclass(frozen=True)
class MethodArgs:
    methods: list[str]
    budgets: list[Budget]  # one for `compare`, sorted and without duplicates for the benchmarks
    knobs: dict[str, dict[str, Any]]
    budget_mode: str  # "published" or "equal_memory"
    query_agnostic: bool
    # with_reference: the method the others are measured against (one of `methods`)
    reference: str | None = None

    @property
    def budget(self) -> Budget:
        return self.budgets[0]


def add_method_args(p: argparse.ArgumentParser, *, several_budgets: bool = False, methods_default: str | None = "all",
                    methods_help: str = "'all' or a comma-separated list (see `python -m prefixkv_core methods`)",
                    budget_default: str | float | None = 0.3, budget_help: str | None = None,
                    equal_memory_help: str = EQUAL_MEMORY_HELP,
                    query_agnostic_help: str = QUERY_AGNOSTIC_HELP) -> None:
    """--methods, --budget (or --budgets), --knob, --equal-memory and --query-agnostic."""
    p.add_argument("--methods", default=methods_default, help=methods_help)
    if several_budgets:
        p.add_argument("--budgets", default=budget_default,
                       help=budget_help or f"comma-separated kept fractions in (0, 1] (default {budget_default})")
    else:
        p.add_argument("--budget", default=budget_default,
                       help=budget_help or "kept fraction of the KV cache, in (0, 1]")
    p.add_argument("--knob", action="append", default=[], metavar="METHOD.KNOB=VALUE",
                   help="a method's own setting, repeatable, e.g. snapkv.window=16; `python -m prefixkv_core "
                        "methods` lists every method's knobs, defaults and accepted values")
    p.add_argument("--equal-memory", action="store_true", help=equal_memory_help)
    p.add_argument("--query-agnostic", action="store_true", help=query_agnostic_help)


def knob_flag(method: str, knob: str) -> str:
    """The flag of a method's knob that its policy declares in `flag_knobs`: --prefixkv-mode."""
    return f"--{method}-{knob}".replace("_", "-")


def _knob_dest(method: str, knob: str) -> str:
    return f"knob_flag__{method}__{knob}"


def add_knob_flags(p: argparse.ArgumentParser) -> None:
    """A flag --<method>-<knob> for every knob a registered policy declares in `flag_knobs`: the knob's own
    choices, or auto (the default), the policy's pick for the model. An explicit --knob METHOD.KNOB=VALUE wins."""
    for method, cls in REGISTRY.items():
        infos = {name: info for name, _, info in knob_fields(cls)}
        for knob, auto_picks in cls.flag_knobs.items():
            info = infos[knob]
            p.add_argument(knob_flag(method, knob), dest=_knob_dest(method, knob), default=AUTO,
                           choices=(AUTO, *map(str, info.choices)),
                           help=f"{cls.label}'s {knob} knob ({info.help}); {AUTO} (default): {auto_picks}")


def resolve_knob_flags(args: argparse.Namespace, chosen: MethodArgs, context: ResolveContext
                       ) -> dict[str, dict[str, Any]]:
    """The knobs the flags of `add_knob_flags` set, for the chosen methods, with auto resolved for the model
    in `context` (`Policy.auto_knob`); a knob given with --knob keeps its value. They are written into
    `chosen.knobs`; returns {method: {knob: value}} as the methods will run."""
    out: dict[str, dict[str, Any]] = {}
    for method in chosen.methods:
        flagged = flag_knob_values(args, method, chosen.knobs.get(method, {}), context)
        if flagged:
            chosen.knobs.setdefault(method, {}).update(flagged)
            out[method] = flagged
    return out


def flag_knob_values(args: argparse.Namespace, method: str, given: dict[str, Any], context: ResolveContext
                     ) -> dict[str, Any]:
    """One method's knobs that the flags of `add_knob_flags` set, auto resolved for the model and budget in
    `context`; a knob in `given` (from --knob) keeps its value."""
    cls = REGISTRY[method]
    out: dict[str, Any] = {}
    for knob in cls.flag_knobs:
        value = given.get(knob, getattr(args, _knob_dest(method, knob), AUTO))
        if value == AUTO:
            try:
                value = cls.auto_knob(knob, context)
            except (PolicyError, ValueError) as exc:
                raise MethodArgError(f"{knob_flag(method, knob)}: {exc}") from None
        out[knob] = value
    return out


def parse_budgets(text: Any, flag: str = "--budgets") -> list[Budget]:
    """'0.1,0.3' (or a number) -> sorted Budgets without duplicates; MethodArgError names the flag."""
    items = [text] if isinstance(text, (int, float)) else [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise MethodArgError(f"{flag} is empty: give kept fractions in (0, 1], e.g. 0.1,0.3,0.5")
    out = []
    for item in items:
        try:
            out.append(Budget(float(item)))
        except PolicyError as exc:
            raise MethodArgError(f"{flag}: {exc}") from None
        except ValueError:
            raise MethodArgError(f"{flag} expects kept fractions in (0, 1], e.g. 0.1,0.3,0.5; got {text!r}") from None
    return sorted(set(out))


def method_args(args: argparse.Namespace, *, budgets_default: Any = None,
                with_reference: bool = False) -> MethodArgs:
    """Read the flags `add_method_args` declared. `budgets_default`: used when --budgets was left unset;
    `with_reference`: the method the others are measured against (its policy plays the "reference" role) is
    added first when missing. Raises MethodArgError with a message that names the flag."""
    several = hasattr(args, "budgets")
    raw = args.budgets if several else args.budget
    budgets = parse_budgets(budgets_default if raw is None else raw, "--budgets" if several else "--budget")
    if not several and len(budgets) > 1:  # one comparison runs at one budget
        raise MethodArgError(f"--budget takes one kept fraction in (0, 1], got {raw!r}")
    try:
        methods = resolve_methods(args.methods or "all")
    except PolicyError as exc:
        raise MethodArgError(f"--methods: {exc}") from None
    reference = role_method("reference") if with_reference else None
    if reference is not None and reference not in methods:
        methods = [reference, *methods]
    try:
        knobs = parse_knobs(args.knob)
    except ValueError as exc:
        raise MethodArgError(f"--knob: {exc}") from None
    return MethodArgs(methods, budgets, knobs, "equal_memory" if args.equal_memory else "published",
                      bool(args.query_agnostic), reference)

