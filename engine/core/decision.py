"""The one place a Decision is checked: what the engine applies is whole numbers within bounds.

A controller's Decision is used as it is when its numbers are plainly usable (the common case,
one cheap test); otherwise :func:`bounded` copies it with every number made whole and clamped,
or says which field is not a number, and the engine then takes a conservative step instead.
"""

from __future__ import annotations

import math
import numbers

from tidegate.ctrl.base import UNLIMITED, Decision

#: reserving all of a request's remaining max_tokens; more would never fit
MAX_RESERVE_RATIO = 1.0


def plainly_usable(d: Decision) -> bool:
    """Whether ``d``'s numbers are whole and within bounds as they are (the common case)."""
    act, tok, cap, ratio, late = d.activation_budget, d.token_budget, d.running_cap, d.kv_reserve_ratio, d.late_after_s
    return (type(act) is int and type(tok) is int and type(cap) is int and d.class_budgets is None
            and 0 <= act <= UNLIMITED and 0 < tok <= UNLIMITED and 0 <= cap <= UNLIMITED
            and (ratio is None or type(ratio) is float and 0.0 <= ratio <= MAX_RESERVE_RATIO)
            and (late is None or type(late) is float and late >= 0.0))



def bounded(d: Decision) -> Decision | str:
    """A plain copy of ``d`` with whole numbers within bounds, or what is unusable in it (a phrase
    such as ``"an unusable token_budget"``) when a field is not a number (or NaN)."""
    act = whole_number(d.activation_budget, 0)
    tok = whole_number(d.token_budget, 1)
    cap = whole_number(d.running_cap, 0)
    for name, value in (("activation_budget", act), ("token_budget", tok), ("running_cap", cap)):
        if value is None:
            return f"an unusable {name}"
    ratio = d.kv_reserve_ratio
    if ratio is not None:
        ratio = real_number(ratio)
        if ratio is None:
            return "an unusable kv_reserve_ratio"
        ratio = min(max(ratio, 0.0), MAX_RESERVE_RATIO)
    classes = d.class_budgets
    if classes is not None:
        if not isinstance(classes, dict):
            return "unusable class_budgets"
        whole: dict[int, int] = {}
        for k, v in classes.items():
            n = whole_number(v, 0)
            if n is None or not isinstance(k, numbers.Integral):
                return "unusable class_budgets"
            whole[int(k)] = n
        classes = whole
    late = d.late_after_s
    if late is not None:
        late = real_number(late)
        if late is None:
            return "an unusable late_after_s"
        late = max(late, 0.0)
    assert act is not None and tok is not None and cap is not None
    return Decision(act, tok, cap, ratio, classes, late)


def real_number(x: object) -> float | None:
    """``x`` as a float (possibly infinite) when it is a real number; None when it is not, or NaN."""
    if not isinstance(x, numbers.Real):
        return None
    try:
        v = float(x)
    except OverflowError:  # a huge int or Fraction
        return -math.inf if x < 0 else math.inf
    return None if v != v else v


def whole_number(x: object, floor: int) -> int | None:
    """``x`` as a whole number in [``floor``, ``UNLIMITED``]; None when it is not a number or NaN."""
    if type(x) is int:
        return floor if x < floor else UNLIMITED if x > UNLIMITED else x
    v = real_number(x)
    if v is None:
        return None
    return UNLIMITED if v >= UNLIMITED else floor if v <= floor else int(v)
