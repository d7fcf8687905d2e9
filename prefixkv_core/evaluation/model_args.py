"""lmms-eval's `--model_args` (key=value pairs, already split and typed by lmms-eval) read into what the engine
runs: the model, one method or a sweep of methods and budgets, the budget mode, the query mode and knobs.

Everything is checked here, at model construction, with the engine's own messages (unknown method, knob or
budget), so a bad argument fails before any sample runs. Lists inside one value are separated by `+` (lmms-eval
splits model_args on commas): `methods=snapkv+pyramidkv,budgets=0.1+0.3`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..method_args import MethodArgError, parse_budgets
from ..policies import REGISTRY, BUDGET_MODES, Budget, PolicyError, make_policy, parse_knobs, resolve_methods, role_method

ACCEPTED = ("pretrained", "method", "methods", "budget", "budgets", "budget_mode", "query_agnostic", "knobs",
            "device", "dtype", "seed", "reference", "frames")
# passed by lmms-eval itself to every model (its --batch_size, --device, ...); None when unset
LMMS_EVAL_EXTRAS = ("batch_size", "max_batch_size")


def split_list(value: Any) -> list[str]:
    """'a+b', 'a|b', '[a,b]' or 'a' -> ['a', 'b']; numbers as text."""
    text = str(value).strip().strip("[]'\"")
    for sep in ("+", "|", ";"):
        text = text.replace(sep, ",")
    return [t.strip() for t in text.split(",") if t.strip()]


def _flag(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "1", "yes"):
        return True
    if str(value).lower() in ("false", "0", "no"):
        return False
    raise MethodArgError(f"{name} must be true or false, got {value!r}")


@dataclass(frozen=True)
class EvalSettings:
    pretrained: str
    methods: list[str]  # the methods reported (a sweep: several)
    budgets: list[Budget]  # one, or several for a sweep
    budget_mode: str
    query_agnostic: bool
    knobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    reference: str | None = None  # the uncompressed method decoded beside the others (agreement); None: not run
    frames: int = 8  # frames sampled uniformly from a video sample

    @property
    def is_sweep(self) -> bool:
        return len(self.methods) * len(self.budgets) > 1

    def runs(self) -> list[tuple[str, Budget]]:
        """Every (method, budget) the sweep reports; a method without a budget (Full, ZipVL) once, at the first."""
        out = []
        for j, budget in enumerate(self.budgets):
            out += [(m, budget) for m in self.methods if REGISTRY[m].uses_budget or j == 0]
        return out

    def batch(self, budget: Budget) -> list[str]:
        """The methods decoded together at one budget: the budgeted ones, plus (at the first budget) the ones
        without a budget and the reference."""
        first = budget == self.budgets[0]
        names = [m for m in self.methods if REGISTRY[m].uses_budget or first]
        if first and self.reference and self.reference not in names:
            names.insert(0, self.reference)
        return names


def parse_model_args(args: dict[str, Any]) -> EvalSettings:
    """lmms-eval's parsed model_args (plus the extras it adds) -> EvalSettings; MethodArgError (naming the
    argument, with the engine's message) on anything unknown or out of range."""
    args = {k: v for k, v in args.items() if not (k in LMMS_EVAL_EXTRAS or (k == "device" and v is None))}
    unknown = sorted(set(args) - set(ACCEPTED))
    if unknown:
        raise MethodArgError(f"model_args: unknown {', '.join(unknown)}; accepted: {', '.join(ACCEPTED)}")
    if "method" in args and "methods" in args:
        raise MethodArgError("model_args: give method= (one) or methods= (a sweep), not both")
    try:
        methods = resolve_methods(split_list(args.get("methods", args.get("method", role_method("reference")))))
    except PolicyError as exc:
        raise MethodArgError(f"method: {exc}") from None
    if "budget" in args and "budgets" in args:
        raise MethodArgError("model_args: give budget= (one) or budgets= (a sweep), not both")
    raw = args.get("budgets", args.get("budget", 1.0))
    budgets = parse_budgets(",".join(split_list(raw)) if isinstance(raw, str) else raw,
                            "budgets" if "budgets" in args else "budget")
    budget_mode = str(args.get("budget_mode", "published"))
    if budget_mode not in BUDGET_MODES:
        raise MethodArgError(f"budget_mode must be one of {', '.join(BUDGET_MODES)}, got {budget_mode!r}")
    try:
        knobs = parse_knobs(split_list_knobs(args.get("knobs", "")))
    except ValueError as exc:
        raise MethodArgError(f"knobs: {exc}") from None
    for method, given in knobs.items():
        if method not in REGISTRY:
            raise MethodArgError(f"knobs: unknown method {method!r}; methods: {', '.join(REGISTRY)}")
        try:  # built once now so an unknown knob or a value out of range fails at construction
            make_policy(method, budgets[0], budget_mode, **given)
        except (PolicyError, TypeError) as exc:
            raise MethodArgError(f"knobs: {exc}") from None
    from ..session.video_input import DEFAULT_FRAMES, MAX_FRAMES

    try:
        frames = int(str(args.get("frames", DEFAULT_FRAMES)))
    except ValueError:
        frames = -1
    if not 1 <= frames <= MAX_FRAMES:
        raise MethodArgError(f"frames must be a whole number from 1 to {MAX_FRAMES}, got {args.get('frames')!r}")
    reference = role_method("reference")
    # a sweep decodes Full beside its methods (agreement with it costs one more row of the batch); one method
    # alone does not unless asked
    with_reference = _flag("reference", args.get("reference", len(methods) * len(budgets) > 1))
    return EvalSettings(
        pretrained=str(args.get("pretrained", "embedded")), methods=methods, budgets=budgets, budget_mode=budget_mode,
        query_agnostic=_flag("query_agnostic", args.get("query_agnostic", False)), knobs=knobs,
        device=str(args.get("device") or "auto"), dtype=str(args.get("dtype", "auto")), seed=int(args.get("seed", 0)),
        reference=reference if with_reference else None, frames=frames)


def split_list_knobs(value: Any) -> list[str]:
    """'snapkv.window=16;h2o.recent=0.5' (or '+'-separated) -> one METHOD.KNOB=VALUE per item. A knob's own
    list value keeps its commas inside quotes (lmms-eval splits model_args on bare commas):
    knobs='prefixkv.ratios=0.5,0.3'."""
    text = str(value or "").strip().strip("'\"")
    return [part.strip() for part in text.replace("+", ";").split(";") if part.strip()]
