"""How jdp checks the values given to its public functions and to the launcher's options.

One rule everywhere, so that a value is taken or refused the same way by `jdp.train_step`,
`jdp.barrier`, the sampler or `python -m jdp.launch`:

- `integer`: a Python int or a NumPy integer (anything `operator.index` takes), never a bool
  or a float (`2.0` is a mistake, not a count), within optional bounds; returned as an int;
- `seconds`: an int or float (NumPy's too: `numbers.Real`), finite and > 0 (or >= 0), never a
  bool or a string; returned as a float, since a wait without an end is a hang;
- `flag`: True or False (a Python bool or NumPy's `bool_`); strings ("False" is truthy) and
  ints, 0 and 1 included, are refused: a flag is a yes or a no, not a count;
- `choice`: one value of a named set (`grad_reduce="mean" | "sum"`), compared by kind too, so
  `True` is not `1` and `"None"` is not `None` (a NumPy integer is its int).

Each refusal is one line, `who: name=value must be <what>; <fix>`: a TypeError for a value of
the wrong type, a ValueError for a value of the right type out of range. A name spelled as a
command-line option (`--stop_grace`) is shown as typed, `--stop_grace -1: must be ...`;
`from_text` parses an option's or variable's text with the same checks. Standard library only
(the launcher imports it): NumPy's types are recognised without importing NumPy.
"""
from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable, Iterable
from typing import Any


def message(who: str, name: str, value: Any, what: str, fix: str = "") -> str:
    """The one line every check raises: `who: name=value must be what; fix`.

    A command-line option (a name starting with "-") is shown as typed, `--name value:`.

    Example:
        >>> message("jdp.barrier", "timeout_s", -1, "a finite number of seconds > 0", "e.g. 60")
        'jdp.barrier: timeout_s=-1 must be a finite number of seconds > 0; e.g. 60'
    """
    subject = f"{name} {value}:" if name.startswith("-") else f"{name}={value!r}"
    return f"{who + ': ' if who else ''}{subject} must be {what}{'; ' + fix if fix else ''}"


def wrong_type(who: str, name: str, value: Any, what: str, fix: str = "") -> TypeError:
    """The error for a value of the wrong type: the line says which type it was."""
    return TypeError(message(who, name, value, f"{what}, {_not(value)}", fix))


def wrong_value(who: str, name: str, value: Any, what: str, fix: str = "") -> ValueError:
    """The error for a value of the right type that cannot work (out of range, not allowed)."""
    return ValueError(message(who, name, value, what, fix))


def integer(who: str, name: str, value: Any, *, minimum: int | None = None,
            maximum: int | None = None, fix: str = "") -> int:
    """`value` as an int: a Python or NumPy integer in `minimum..maximum` (either bound
    optional). TypeError for a bool, a float or anything else; ValueError out of bounds.

    Example:
        >>> import numpy as np
        >>> integer("jdp.train_step", "accum_steps", np.int64(2), minimum=1)
        2
    """
    what = _int_range(minimum, maximum)
    if is_bool(value):
        raise wrong_type(who, name, value, what, fix)
    try:
        number = operator.index(value)
    except TypeError:
        raise wrong_type(who, name, value, what, fix) from None
    if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        raise wrong_value(who, name, value, what, fix)
    return number


def seconds(who: str, name: str, value: Any, *, zero: bool = False,
            maximum: float | None = None, fix: str = "") -> float:
    """`value` as a float number of seconds: finite, > 0 (>= 0 with `zero`), at most
    `maximum`. TypeError for a bool, a string or a non-number; ValueError for inf, nan or a
    number out of bounds (a wait that never ends, or ends before it starts).

    Example:
        >>> seconds("jdp.barrier", "timeout_s", 60)
        60.0
    """
    what = _seconds_range(zero, maximum)
    if is_bool(value) or not isinstance(value, numbers.Real):
        raise wrong_type(who, name, value, what, fix)
    number = float(value)
    if not (math.isfinite(number) and (number >= 0 if zero else number > 0)
            and (maximum is None or number <= maximum)):
        raise wrong_value(who, name, value, what, fix)
    return number


def flag(who: str, name: str, value: Any, *, fix: str = "") -> bool:
    """`value` as a bool: True or False (NumPy's `bool_` too). A string, an int (0 and 1
    included) or None is a TypeError: `shuffle="no"` would be truthy.

    Example:
        >>> flag("jdp.layer_policy", "enabled", False)
        False
    """
    if not is_bool(value):
        raise wrong_type(who, name, value, "True or False", fix)
    return bool(value)


def choice(who: str, name: str, value: Any, options: Iterable[Any], *, fix: str = "") -> Any:
    """`value` if it is one of `options` (same type and equal: True is not 1, "None" is not
    None), else a ValueError listing them.

    Example:
        >>> choice("jdp.train_step", "grad_reduce", "sum", ("mean", "sum"))
        'sum'
    """
    options = tuple(options)
    for option in options:
        if _same(value, option):
            return option
    listed = " or ".join(map(repr, options)) if len(options) < 3 else (
        "one of " + ", ".join(map(repr, options)))
    raise wrong_value(who, name, value, listed, fix)


def from_text(check: Callable[..., Any], who: str, name: str, text: str, **limits: Any) -> Any:
    """`check` (`integer` or `seconds`) applied to `text`, a command-line option's value or an
    environment variable's, parsed as an int or a float first. Anything refused, text that is
    no number included, is a ValueError showing the text as given.

    Example:
        >>> from_text(integer, "", "--nproc_per_node", "4", minimum=1)
        4
    """
    try:
        return check(who, name, (int if check is integer else float)(str(text).strip()),
                     **limits)
    except (TypeError, ValueError):
        what = (_int_range(limits.get("minimum"), limits.get("maximum")) if check is integer
                else _seconds_range(limits.get("zero", False), limits.get("maximum")))
        raise wrong_value(who, name, text, what, limits.get("fix", "")) from None


def is_bool(value: Any) -> bool:
    """A Python bool or NumPy's `bool_` (checked by name: NumPy is not imported here)."""
    kind = type(value)
    return isinstance(value, bool) or (kind.__module__ == "numpy"
                                       and kind.__name__ in ("bool", "bool_"))


def _same(value: Any, option: Any) -> bool:
    """`value` is `option`: equal, and of its kind (a bool, None, a string, an integer, or
    the same type)."""
    if option is None or isinstance(option, bool):
        return value is option or (is_bool(value) and bool(value) is option)
    if isinstance(option, str):
        return isinstance(value, str) and value == option
    if isinstance(option, int):   # a NumPy integer counts as its int
        try:
            return not is_bool(value) and operator.index(value) == option
        except TypeError:
            return False
    return type(value) is type(option) and value == option


def _int_range(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f"an int in {minimum}..{maximum}"
    if minimum is not None:
        return f"an int >= {minimum}"
    return "an int" if maximum is None else f"an int <= {maximum}"


def _seconds_range(zero: bool, maximum: float | None) -> str:
    bound = f" and <= {maximum:g}" if maximum is not None else ""
    return f"a finite number of seconds {'>=' if zero else '>'} 0{bound}"


def _not(value: Any) -> str:
    """What the value is instead, by its type: `not a float`, `not an int`, `not a
    numpy.float64`."""
    if value is None:
        return "not None"
    kind = type(value)
    module = kind.__module__.split(".")[0]
    name = kind.__name__ if module == "builtins" else f"{module}.{kind.__name__}"
    return f"not {'an' if name[0] in 'aeiou' else 'a'} {name}"
