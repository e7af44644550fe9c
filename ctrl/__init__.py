"""Controllers behind the Observation -> Decision interface, and ``build_controller`` to make
one from a command-line spec such as ``flow:budget=2,dist=poisson``."""

from __future__ import annotations

import ast
import inspect
import sys
import types
from pathlib import Path

from tidegate.ctrl.base import UNLIMITED, Controller, Decision, Observation, Rejection
from tidegate.ctrl.class_budgets import ClassBudgetsController
from tidegate.ctrl.flow import FlowController
from tidegate.ctrl.greedy import GreedyController
from tidegate.ctrl.no_evict import NoEvictController
from tidegate.ctrl.sglang import SGLangController
from tidegate.ctrl.slo_flow import SloFlowController
from tidegate.ctrl.theory import lifetime_kv_workload
from tidegate.ctrl.watermark import WatermarkController

CONTROLLERS: dict[str, type[Controller]] = {
    c.name: c for c in (GreedyController, NoEvictController, SGLangController, WatermarkController,
                        ClassBudgetsController, FlowController, SloFlowController)
}

#: the server's default controller: the best controller of the evaluation matrix (docs/BENCHMARKS.md).
#: ``learned`` becomes the default once it holds 0.97 x the best heuristic in every cell of the
#: matrix and beats slo-flow by more than a cell's chance spread; the shipped policy holds the
#: floor and beats its prior by 1.5% on average, under that spread.
DEFAULT_CONTROLLER = "slo-flow"

# Options filled from the profile when the user does not set them.
_PROFILE_DEFAULTS = {
    "max_num_seqs": lambda p: p.max_num_seqs,
    "max_num_batched_tokens": lambda p: p.max_num_batched_tokens,
    "tpot_slo_s": lambda p: p.tpot_slo_s,
    "ttft_slo_s": lambda p: p.ttft_slo_s,
    "profile": lambda p: p,
}

__all__ = ["CONTROLLERS", "DEFAULT_CONTROLLER", "Controller", "ControllerSpecError", "Decision", "Observation",
           "Rejection", "UNLIMITED", "build_controller", "controller_options", "parse_spec"]


class ControllerSpecError(ValueError):
    """A controller spec that names an unknown controller or option, or a bad value."""


def controller_options(cls: type[Controller]) -> dict[str, inspect.Parameter]:
    """The options a controller accepts: its own and the overload options of every controller."""
    params: dict[str, inspect.Parameter] = {}
    for klass in (cls, Controller):
        for name, p in _init_parameters(klass).items():
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                params.setdefault(name, p)
    return params


def _init_parameters(klass: type) -> dict[str, inspect.Parameter]:
    """The parameters of ``klass(...)``, without ``self``.

    A class compiled by mypyc (``tidegate compile``, engine/sim/compiled.py) has no signature of its
    own to inspect. For one, the first ``__init__`` along its MRO is read from its module's
    Python file, which the compiled copy keeps beside the extension: the annotations are the
    strings the interpreted class has (``from __future__ import annotations``) and the defaults
    are evaluated in the module's namespace, so the options parse exactly as interpreted."""
    for owner in klass.__mro__:
        if "__init__" not in owner.__dict__:
            continue
        if isinstance(owner.__dict__["__init__"], types.FunctionType):  # interpreted: its own signature
            return dict(list(inspect.signature(owner.__dict__["__init__"]).parameters.items())[1:])
        module = sys.modules.get(owner.__module__)
        built = Path(getattr(module, "__file__", None) or "")
        source = built.with_name(built.name.split(".", 1)[0] + ".py")
        init = _source_init(source, owner.__name__)
        if init is None:
            raise ControllerSpecError(f"the options of {owner.__name__} cannot be read: it is compiled and "
                                      f"{source} is missing")
        a = init.args
        args = [*a.posonlyargs, *a.args][1:]
        defaults = [None] * (len(args) - len(a.defaults)) + list(a.defaults)
        namespace = vars(module)
        out = {}
        for arg, default in (*zip(args, defaults), *zip(a.kwonlyargs, a.kw_defaults)):
            kind = inspect.Parameter.KEYWORD_ONLY if arg in a.kwonlyargs else inspect.Parameter.POSITIONAL_OR_KEYWORD
            out[arg.arg] = inspect.Parameter(
                arg.arg, kind,
                default=inspect.Parameter.empty if default is None else eval(ast.unparse(default), namespace),
                annotation=inspect.Parameter.empty if arg.annotation is None else ast.unparse(arg.annotation))
        return out
    return {}


def _source_init(path: Path, class_name: str) -> ast.FunctionDef | None:
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    return item
    return None


def _convert(name: str, text: str, param: inspect.Parameter):
    ann = str(param.annotation)
    try:
        if ann.startswith("list"):
            return [float(x) for x in text.split("/") if x]
        if "bool" in ann:
            low = text.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if "int" in ann and "float" not in ann:
            return int(float(text)) if float(text).is_integer() else int(text)
        if "float" in ann:
            return float(text)
        return text
    except ValueError:
        kind = "a list like 0.5/1.5" if ann.startswith("list") else ann.split("|")[0].strip()
        raise ControllerSpecError(f"option {name}={text!r} is not valid: expected {kind}") from None


def _options(name: str, raw: dict[str, str], params: dict[str, inspect.Parameter]) -> dict:
    """Typed keyword arguments from raw ``key=value`` options, refusing unknown keys."""
    kwargs = {}
    for key, text in raw.items():
        if key == "profile":
            raise ControllerSpecError(f"controller {name!r} takes its profile from the replica, not from an option")
        if key not in params:
            raise ControllerSpecError(
                f"controller {name!r} has no option {key!r}; it accepts {', '.join(sorted(params))}")
        kwargs[key] = _convert(key, text, params[key])
    return kwargs


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """Split ``name:key=value,key=value`` into the name and the raw options."""
    name, _, rest = spec.partition(":")
    options = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise ControllerSpecError(f"controller option {item!r} needs the form key=value")
        options[key.strip()] = value.strip()
    return name.strip(), options


def build_controller(spec: str, profile=None, workload=None) -> Controller:
    """Make a controller from a spec, with defaults from the profile.

    :param spec: ``name`` or ``name:key=value,...``; names are the keys of ``CONTROLLERS``.
    :param profile: fills ``max_num_seqs``, ``max_num_batched_tokens`` and ``tpot_slo_s``.
    :param workload: the arrivals, used by ``class-budgets`` to derive budgets when none are given.
    """
    name, raw = parse_spec(spec)
    if name == "learned":
        return _learned(raw, profile)
    cls = CONTROLLERS.get(name)
    if cls is None:
        raise ControllerSpecError(
            f"unknown controller {name!r}; choose one of {', '.join(sorted([*CONTROLLERS, 'learned']))}")
    params = controller_options(cls)
    kwargs = _options(name, raw, params)
    if profile is not None:
        for key, get in _PROFILE_DEFAULTS.items():
            if key in params and key not in kwargs:
                kwargs[key] = get(profile)
    try:
        if cls is ClassBudgetsController and "budgets" not in kwargs:
            return _class_budgets_from_workload(profile, workload, kwargs)
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        raise ControllerSpecError(f"controller {name!r}: {exc}") from None


def _class_budgets_from_workload(profile, workload, kwargs) -> Controller:
    if profile is None or not workload:
        raise ValueError("needs budgets=b0/b1/... or a workload to derive them from")
    by_class: dict[int, list] = {}
    for a in workload:
        by_class.setdefault(a.class_id, []).append(a)
    span = max(workload[-1].arrival_time_s - workload[0].arrival_time_s, 1e-9)
    step_s = profile.base_s  # one step per slot in the paper's model; only the ratios matter
    ids = range(max(by_class) + 1)
    rates = [len(by_class.get(k, ())) / span * step_s for k in ids]
    works = [float(lifetime_kv_workload([a.prompt_tokens for a in by_class[k]],
                                        [a.output_tokens for a in by_class[k]]).mean())
             if k in by_class else 0.0 for k in ids]
    biggest = [max((a.prompt_tokens + a.output_tokens for a in by_class.get(k, ())), default=0) for k in ids]
    return ClassBudgetsController.from_classes(rates, works, biggest, profile.kv_capacity_tokens, **kwargs)


def _learned(raw: dict[str, str], profile) -> Controller:
    """The shipped (or a given) policy, always inside the shield."""
    import inspect as _inspect

    from tidegate.ctrl.learned import make_learned_controller

    params = {k: p for k, p in _inspect.signature(make_learned_controller).parameters.items()
              if p.kind is not p.VAR_KEYWORD and k != "profile"}
    if "policy" in raw:  # `learned:policy=FILE`, what `tidegate tune` prints, is `path`
        if "path" in raw:
            raise ControllerSpecError("controller 'learned': give the policy file once, as path= or policy=")
        raw = {("path" if k == "policy" else k): v for k, v in raw.items()}
    kwargs = _options("learned", raw, params)
    if profile is None:
        raise ControllerSpecError("controller 'learned' needs the replica's profile (its step time, KV size and SLOs)")
    path = kwargs.pop("path", None)
    try:
        controller = make_learned_controller(path, profile=profile, **kwargs)
    except (ValueError, TypeError) as exc:
        raise ControllerSpecError(f"controller 'learned': {exc}") from None
    error = getattr(controller.inner, "load_error", None)
    if path is not None and error:  # a policy named on purpose that does not load is the user's to fix
        raise ControllerSpecError(f"controller 'learned': {error}")
    return controller
