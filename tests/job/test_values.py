"""jdp.job.values, the one rule for the values users give: what each check takes, what it
refuses with which error, and that every refusal is one line naming the argument, the value,
what it takes and the fix. NumPy's types are recognised although the module never imports it."""
import fractions
import math

import numpy as np
import pytest
from conftest import assert_one_line

from jdp.job import values

WHO = "jdp.example"


def refused(error, check, *args, **kwargs) -> str:
    """`check(WHO, "n", *args, **kwargs)` raises `error` with one line; the line."""
    with pytest.raises(error) as info:
        check(WHO, "n", *args, **kwargs)
    assert type(info.value) is error
    assert_one_line(info.value, [f"{WHO}: n=", " must be "])
    return str(info.value)


@pytest.mark.parametrize("value", [3, np.int64(3), np.int8(3), np.uint16(3), np.array(3)])
def test_integer_takes_python_and_numpy_integers_as_an_int(value):
    got = values.integer(WHO, "n", value, minimum=1)
    assert got == 3 and type(got) is int


@pytest.mark.parametrize("value, kind", [(True, "a bool"), (np.True_, "a numpy.bool"),
                                         (3.0, "a float"), (np.float64(3), "a numpy.float64"),
                                         ("3", "a str"), (None, "None"), (1j, "a complex"),
                                         (fractions.Fraction(3), "a fractions.Fraction")])
def test_integer_refuses_bools_floats_and_text_as_a_type_error(value, kind):
    line = refused(TypeError, values.integer, value, minimum=1, fix="a count")
    assert line.startswith(f"{WHO}: n={value!r} must be an int >= 1, not {kind}")   # bool_
    assert line.endswith("; a count")


@pytest.mark.parametrize("value, limits, what", [
    (0, {"minimum": 1}, "an int >= 1"),
    (np.int64(17), {"minimum": 1, "maximum": 16}, "an int in 1..16"),
    (-1, {"minimum": 0}, "an int >= 0"),
    (9, {"maximum": 8}, "an int <= 8"),
])
def test_integer_out_of_bounds_is_a_value_error_naming_the_bounds(value, limits, what):
    line = refused(ValueError, values.integer, value, **limits)
    assert line == f"{WHO}: n={value!r} must be {what}"


@pytest.mark.parametrize("value, want", [(1, 1.0), (0.5, 0.5), (np.float32(0.25), 0.25),
                                         (np.int64(7), 7.0), (fractions.Fraction(1, 2), 0.5)])
def test_seconds_take_finite_positive_numbers_as_floats(value, want):
    got = values.seconds(WHO, "n", value)
    assert got == want and type(got) is float


@pytest.mark.parametrize("value", [True, np.False_, "60", None, [60]])
def test_seconds_refuse_bools_and_text_as_a_type_error(value):
    assert "must be a finite number of seconds > 0, not " in refused(TypeError, values.seconds,
                                                                      value)


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, np.float64("inf"), 0, -1,
                                   1e300])
def test_seconds_refuse_waits_that_never_end_or_end_before_they_start(value):
    line = refused(ValueError, values.seconds, value, maximum=604800.0, fix="e.g. 60")
    assert line == (f"{WHO}: n={value!r} must be a finite number of seconds > 0 and <= 604800; "
                    "e.g. 60")


def test_seconds_may_take_zero_when_asked():
    assert values.seconds(WHO, "n", 0, zero=True) == 0.0
    assert "seconds >= 0" in refused(ValueError, values.seconds, -0.5, zero=True)


@pytest.mark.parametrize("value", [True, False, np.True_, np.False_, np.bool_(1)])
def test_flag_takes_python_and_numpy_bools(value):
    got = values.flag(WHO, "n", value)
    assert got is bool(value)


@pytest.mark.parametrize("value", ["False", "no", "", 0, 1, np.int64(1), 1.0, None])
def test_flag_refuses_strings_and_numbers_zero_and_one_included(value):
    line = refused(TypeError, values.flag, value, fix="a flag")
    assert line.startswith(f"{WHO}: n={value!r} must be True or False, not ")
    assert line.endswith("; a flag")


@pytest.mark.parametrize("value, options, want", [
    ("sum", ("mean", "sum"), "sum"), (None, ("mean", None), None),
    (np.str_("mean"), ("mean", None), "mean"), (np.False_, (False, "node"), False),
    (2, (1, 2, 3), 2), (np.int64(2), (1, 2, 3), 2),
])
def test_choice_takes_a_value_of_the_set(value, options, want):
    got = values.choice(WHO, "n", value, options)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("value, options, what", [
    ("avg", ("mean", "sum"), "'mean' or 'sum'"),
    ("None", ("mean", None), "'mean' or None"),    # the text is not the value
    (True, (1, 2, 3), "one of 1, 2, 3"),           # nor is a bool its int
    (0, (False, True), "False or True"),
    ([1], ("a", "b"), "'a' or 'b'"),               # unhashable: compared, not looked up
])
def test_choice_refuses_anything_else_naming_the_set(value, options, what):
    line = refused(ValueError, values.choice, value, options)
    assert line == f"{WHO}: n={value!r} must be {what}"


def test_a_command_line_option_is_shown_as_typed():
    with pytest.raises(ValueError) as info:
        values.from_text(values.integer, "", "--nproc_per_node", "2.5", minimum=1, fix="one each")
    assert str(info.value) == "--nproc_per_node 2.5: must be an int >= 1; one each"


@pytest.mark.parametrize("check, text, limits, what", [
    (values.integer, "0", {"minimum": 1}, "an int >= 1"),
    (values.integer, "x", {}, "an int"),
    (values.integer, "70000", {"minimum": 1, "maximum": 65535}, "an int in 1..65535"),
    (values.seconds, "inf", {}, "a finite number of seconds > 0"),
    (values.seconds, "-1", {"zero": True}, "a finite number of seconds >= 0"),
    (values.seconds, "soon", {"maximum": 10.0}, "a finite number of seconds > 0 and <= 10"),
])
def test_text_is_parsed_then_checked_and_refused_as_a_value_error(check, text, limits, what):
    with pytest.raises(ValueError) as info:
        values.from_text(check, "", "--opt", text, **limits)
    assert str(info.value) == f"--opt {text}: must be {what}"
    with pytest.raises(ValueError) as info:
        values.from_text(check, "", "JDP_OPT", text, **limits)
    assert str(info.value) == f"JDP_OPT={text!r} must be {what}"


@pytest.mark.parametrize("check, text, want", [(values.integer, " 4 ", 4),
                                               (values.seconds, "2.5", 2.5),
                                               (values.seconds, "30", 30.0)])
def test_text_that_parses_comes_back_as_the_number(check, text, want):
    got = values.from_text(check, "", "--opt", text)
    assert got == want and type(got) is type(want)


def test_the_module_imports_the_standard_library_alone():
    """The launcher imports it: no NumPy, no JAX (read from its import statements)."""
    import ast
    import pathlib
    names = set()
    for node in ast.walk(ast.parse(pathlib.Path(values.__file__).read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add((node.module or "").split(".")[0])
    assert names <= {"__future__", "collections", "math", "numbers", "operator", "typing"}
