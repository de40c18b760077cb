"""Type checks of config options against the signature of the class they are passed to.

A value of the wrong kind (``data.batch_size=abc``, ``optimizer.lr=fast``) is an error naming
the option before anything is built, instead of a ``TypeError`` deep inside a library.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, ListConfig
from omegaconf.errors import OmegaConfBaseException

# Annotations checked; a union holding anything else (a tensor, a sequence, a class) is checked
# only where all of its scalar members are known.
_SCALARS = {int: "an int", float: "a number", bool: "true or false", str: "a string"}


def _target(path: str) -> Any:
    module, _, name = path.rpartition(".")
    try:
        obj = __import__(module, fromlist=[name]) if module else None
        return getattr(obj, name)
    except (ImportError, AttributeError, ValueError):
        return None  # Hydra reports a bad _target_ itself


def _hints(cls: Any) -> dict[str, Any]:
    fn = cls.__init__ if inspect.isclass(cls) else cls
    try:
        return typing.get_type_hints(fn)
    except Exception:  # unresolvable annotations: nothing to check
        return {}


def _allowed(hint: Any) -> tuple[type, ...] | None:
    """The scalar types ``hint`` accepts, or ``None`` when it accepts other things too."""
    origin = typing.get_origin(hint)
    members = typing.get_args(hint) if origin in (typing.Union, types.UnionType) else (hint,)
    allowed: list[type] = []
    for m in members:
        if m is type(None) or m in _SCALARS:
            allowed.append(m)
        elif getattr(m, "__name__", "") == "Tensor":  # e.g. torch's ``lr: float | Tensor``
            continue
        else:
            return None
    return tuple(allowed) or None


def _accepts(value: Any, allowed: tuple[type, ...]) -> bool:
    if value is None:
        return type(None) in allowed
    if isinstance(value, bool):
        return bool in allowed
    if isinstance(value, int):
        return int in allowed or float in allowed
    if isinstance(value, float):
        return float in allowed
    if isinstance(value, str):
        return str in allowed
    return False  # a list or mapping where a scalar is expected


def check_option_types(node: Any, where: str) -> None:
    """Check the scalar options of ``node`` (a Hydra ``_target_`` config, and the configs
    nested in it) against the type hints of the target's constructor.

    Args:
        node: a composed config node; nodes without ``_target_`` are searched for nested ones.
        where: the node's dotted name in the config, for the message (``"data"``).

    Raises:
        ValueError: ``option <where>.<key> must be <kind>, got <value>``, or a number out of
            range (NaN, infinite, past float32's range or past 64-bit integers).
    """
    if isinstance(node, ListConfig):
        for i, child in enumerate(node):
            check_option_types(child, f"{where}[{i}]")
        return
    if not isinstance(node, DictConfig | Mapping):
        return
    hints = {}
    if isinstance(node.get("_target_"), str):
        target = _target(node["_target_"])
        hints = _hints(target) if target is not None else {}
    for key in node:
        if str(key).startswith("_"):
            continue
        try:
            value = node[key]
        except OmegaConfBaseException:  # an interpolation that cannot resolve yet: not ours
            continue
        if isinstance(value, DictConfig | ListConfig):
            check_option_types(value, f"{where}.{key}")
            continue
        allowed = _allowed(hints[key]) if key in hints else None
        if allowed is not None and not _accepts(value, allowed):
            kinds = [_SCALARS[t] for t in allowed if t in _SCALARS]
            kinds += ["null"] if type(None) in allowed else []
            raise ValueError(f"option {where}.{key} must be {' or '.join(kinds)}, got {value!r}")
        _check_range(value, f"{where}.{key}")


# Numbers past these overflow where they are used: float options end up in float32 tensors
# (learning rates, scales), int options in int64 ones (step counts, sizes).
FLOAT_LIMIT = 3.4028234663852886e38
INT_LIMIT = 2**63 - 1


def _check_range(value: Any, name: str) -> None:
    """Refuse a number that overflows where it is used: NaN, +-inf, floats past float32's
    range, ints past int64's."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return
    if isinstance(value, int) and abs(value) > INT_LIMIT:
        digits = len(str(abs(value)))
        raise ValueError(
            f"option {name} is out of range: a {digits}-digit integer, past 64-bit integers"
        )
    if isinstance(value, float) and not abs(value) <= FLOAT_LIMIT:  # also NaN
        raise ValueError(
            f"option {name}={value!r} is out of range: numbers beyond +-3.4e38 overflow in "
            "float32 arithmetic"
        )
