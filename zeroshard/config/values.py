"""Value checks shared by the config sections (schema.py, blocks.py).

Each check raises a pydantic custom error whose message reads
"<requirement>; got <value as JSON>[ <note>]"; `describe` puts the
dotted key in front.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any

from pydantic import BeforeValidator, ConfigDict
from pydantic_core import ErrorDetails, PydanticCustomError

AUTO = "auto"  # DeepSpeed's value for "fill this in from what is known"

# extra="forbid" and strict=True are a backstop: `Config.load` checks the keys
# itself and every field has a validator, with clearer messages.
FROZEN_STRICT = ConfigDict(frozen=True, extra="forbid", strict=True)


def invalid(requirement: str, value: Any, note: str = "") -> PydanticCustomError:
    # A custom error keeps our wording verbatim (no "Value error, " prefix); the
    # value goes in as context so braces in it are not read as a template.
    return PydanticCustomError("zeroshard", requirement + "; got {got}" + note, {"got": show(value)})


def show(value: Any) -> str:
    """A value as the user wrote it in JSON (true, "yes", 7), else its repr."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def number_in_string(value: Any) -> Any:
    """A JSON string that spells a number ("5e8", "500000000", "1e-3"), as that number, as DeepSpeed's
    configs are read (pydantic's lax mode); any other value as it is."""
    if not isinstance(value, str):
        return value
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def integer(value: Any, minimum: int, requirement: str, float_note: str = "") -> int:
    """An int >= `minimum`, or a whole float such as DeepSpeed's 5e8 (also spelled as a string, "5e8");
    `requirement` starts the message.

    A float that is not whole gets `float_note` after the value, where one is given.
    """
    number = number_in_string(value)
    if isinstance(number, float) and number.is_integer():
        number = int(number)
    elif isinstance(number, float) and float_note:
        raise invalid(requirement, value, float_note)
    # bool is a subclass of int, but `true` is not a count.
    if isinstance(number, bool) or not isinstance(number, int) or number < minimum:
        raise invalid(requirement, value if isinstance(value, str) else number)  # a string as written
    return number


def positive_int(value: Any) -> int:
    """Accept an int > 0, or a whole float such as DeepSpeed's 5e8."""
    return integer(value, 1, "must be a positive integer",
                   " (a float is accepted only when it is a whole number, such as 5e8)")


def optional_positive_int(value: Any) -> int | None:
    """null, or what `positive_int` accepts."""
    return None if value is None else positive_int(value)


def non_negative_int(value: Any) -> int:
    """An int >= 0, or a whole float such as DeepSpeed's 1e5."""
    return integer(value, 0, "must be an integer >= 0")


def strict_bool(value: Any) -> bool:
    # "true", "yes" and 1 are mistakes, not booleans.
    if not isinstance(value, bool):
        raise invalid("must be true or false (a JSON boolean)", value)
    return value


def any_case_choice(value: Any, choices: tuple[str, ...]) -> str:
    """One of `choices` in any case, returned spelled as in `choices`."""
    spelled = {choice.upper(): choice for choice in choices}
    if not isinstance(value, str) or value.upper() not in spelled:
        raise invalid(f"must be one of {', '.join(map(json.dumps, choices))} (any case)", value)
    return spelled[value.upper()]


def finite_number(value: Any, minimum: float, inclusive: bool, meaning: str = "",
                  noun: str = "a finite number") -> float:
    """A finite number above `minimum` (or equal to it, if `inclusive`), stored as a float.

    The message reads "must be <noun> > <minimum><meaning>". A string that spells a number is that number.
    """
    number = number_in_string(value)
    is_number = isinstance(number, (int, float)) and not isinstance(number, bool)
    if not is_number or not math.isfinite(number) or number < minimum or (number == minimum and not inclusive):
        raise invalid(f"must be {noun} {'>=' if inclusive else '>'} {minimum:g}{meaning}", value)
    return float(number)


def non_negative_float(value: Any, meaning: str = "") -> float:
    """A finite number >= 0 (an int is accepted and stored as a float)."""
    return finite_number(value, 0, True, meaning)


PositiveInt = Annotated[int, BeforeValidator(positive_int)]
NonNegativeInt = Annotated[int, BeforeValidator(non_negative_int)]
StrictBool = Annotated[bool, BeforeValidator(strict_bool)]
NonNegativeFloat = Annotated[float, BeforeValidator(non_negative_float)]


def describe(detail: ErrorDetails, prefix: str = "") -> str:
    """One line for one pydantic error: the dotted key, what is allowed, the value given."""
    path = prefix + ".".join(str(part) for part in detail["loc"]) or "config"
    if detail["type"] == "zeroshard":  # a check across keys has no location of its own
        return f"{path} {detail['msg']}" if detail["loc"] else detail["msg"]
    # Every field has its own validator; this is only a backstop.
    return f"{path}: {detail['msg']}; got {show(detail['input'])}"


def _betas(value: Any) -> tuple[float, float]:
    ok = (isinstance(value, (list, tuple)) and len(value) == 2
          and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in value))
    if not ok:
        raise invalid("must be two numbers in [0, 1), such as [0.9, 0.999]", value)
    return float(value[0]), float(value[1])


Betas = Annotated[tuple[float, float], BeforeValidator(_betas)]  # Adam's (beta1, beta2)
