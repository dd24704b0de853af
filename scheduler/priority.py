"""A request's priority: ``high|normal|low|<int>`` as SGLang's signed 64-bit integer.

Pure: the one parser behind the ``X-Flying-Priority`` header, the body field and the
load generators' names (higher is more urgent; SGLang's own bound on the value).
"""

from __future__ import annotations

import re

PRIORITY_NAMES = {"low": -1, "normal": 0, "high": 1}


#: SGLang's own bound on a request's priority (a signed 64-bit integer).
PRIORITY_MIN, PRIORITY_MAX = -(1 << 63), (1 << 63) - 1
_INTEGER = re.compile(r"[+-]?[0-9]{1,19}")


def parse_priority(value: str | int | None) -> int:
    """``high|normal|low|<int>`` -> int (higher is more urgent). Raises ValueError.

    Integers are ASCII digits with an optional sign, within SGLang's signed 64-bit range;
    booleans, floats and anything else are refused."""
    if value is None:
        return 0
    if isinstance(value, bool):
        raise ValueError(f"invalid priority {value!r}: expected high, normal, low or an integer")
    if isinstance(value, int):
        number = value
    else:
        text = str(value).strip().lower()
        if text in PRIORITY_NAMES:
            return PRIORITY_NAMES[text]
        if not isinstance(value, str) or not _INTEGER.fullmatch(text):
            raise ValueError(
                f"invalid priority {value!r}: expected high, normal, low or an integer"
            )
        number = int(text)
    if not PRIORITY_MIN <= number <= PRIORITY_MAX:
        raise ValueError(f"invalid priority {value!r}: outside the signed 64-bit range")
    return number
