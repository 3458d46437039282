"""Free-form values (a run's ``config``) made JSON-able without losing the record.

A training script passes whatever its config holds: ``torch.bfloat16``, numpy arrays,
``argparse.Namespace`` objects, a dict that refers to itself. pydantic accepts them into
a ``dict[str, Any]`` field but cannot serialize them; :func:`json_safe` turns such values
into text so the record still goes out, with everything JSON can hold kept as it was.
"""

from __future__ import annotations

import numbers
from typing import Any

CIRCULAR = "<circular reference>"
TOO_DEEP = "<nested too deep>"
# Consumers parse with pydantic-core, which refuses JSON nested 200 levels deep; a record
# sits one or two levels down, so a value is cut well before that.
MAX_DEPTH = 100
_MAX_TEXT = 10_000  # the text of one odd value (a numpy array's str is already summarized)


def json_safe(value: Any, *, max_depth: int = MAX_DEPTH) -> Any:
    """``value`` with every part JSON cannot hold turned into text.

    - None, bool, str, int and float (NaN / Inf included: trainmon's JSON keeps them) stay,
      and other real numbers (numpy scalars, Fraction) become int / float;
    - dicts stay dicts (a key that is not a string becomes its text), lists, tuples and
      sets become lists;
    - a container met again inside itself becomes ``"<circular reference>"``, anything
      nested deeper than ``max_depth`` becomes ``"<nested too deep>"``;
    - anything else becomes ``str(value)`` (``repr`` if ``str`` fails), e.g.
      ``torch.bfloat16`` -> ``"torch.bfloat16"``.

    Never raises. Shared containers that are not circular are copied where they occur.
    """
    return _safe(value, set(), max_depth)


def _safe(value: Any, path: set[int], depth: int) -> Any:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return _utf8(value)
    if isinstance(value, numbers.Integral):  # int subclasses, numpy integers
        try:
            return int(value)
        except Exception:  # noqa: BLE001
            return _text(value)
    if isinstance(value, numbers.Real):  # float subclasses, numpy floats; NaN / Inf stay
        try:
            return float(value)
        except Exception:  # noqa: BLE001
            return _text(value)
    if isinstance(value, (dict, list, tuple, set, frozenset)):
        if id(value) in path:
            return CIRCULAR
        if depth <= 0:
            return TOO_DEEP
        path.add(id(value))
        try:
            if isinstance(value, dict):
                return {_key(k): _safe(v, path, depth - 1) for k, v in list(value.items())}
            items = list(value)
            if isinstance(value, (set, frozenset)):
                try:
                    items = sorted(items)
                except Exception:  # noqa: BLE001 -- unorderable members keep set order
                    pass
            return [_safe(v, path, depth - 1) for v in items]
        finally:
            path.discard(id(value))
    return _text(value)


def _utf8(text: str) -> str:
    """``text``, or where it holds lone surrogates (bytes that were not UTF-8, decoded with
    surrogateescape: a path from sys.argv or os.listdir), the same with each such byte as
    U+FFFD: JSON cannot hold a lone surrogate, and the record would be lost."""
    if text.isascii():
        return text
    try:
        text.encode()
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    return text


def _key(key: Any) -> str:
    if isinstance(key, str):
        return _utf8(key)
    if key is None or isinstance(key, (bool, int, float)):
        return "null" if key is None else str(key).lower() if isinstance(key, bool) else str(key)
    return _text(key)


def _text(value: Any) -> str:
    for render in (str, repr):
        try:
            text = render(value)
            if isinstance(text, str):
                return _utf8(text if len(text) <= _MAX_TEXT else text[:_MAX_TEXT] + "...")
        except Exception:  # noqa: BLE001 -- a broken __str__ must not cost the record
            continue
    return f"<{type(value).__name__}>"
