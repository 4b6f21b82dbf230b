"""`record`: the package's immutable values, `dataclasses.dataclass(frozen=True)`.

One name for the one way the package makes a record: keyword or positional construction
with defaults, immutability, equality, hashing and a readable repr.
"""

from __future__ import annotations

from dataclasses import MISSING, FrozenInstanceError, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import TypeVar

    from typing_extensions import dataclass_transform

    _T = TypeVar("_T")
else:

    def dataclass_transform(**_kwargs):
        return lambda decorator: decorator


def _values(self: object) -> tuple[object, ...]:
    return tuple(getattr(self, name) for name in self.__match_args__)  # type: ignore[attr-defined]


def _init(self: object, *args: object, **kwargs: object) -> None:
    """A frozen dataclass's __init__: positional or keyword, defaults filled in."""
    cls = self.__class__
    name_of = cls.__qualname__
    names: tuple[str, ...] = cls.__match_args__  # type: ignore[attr-defined]
    fields = cls.__dataclass_fields__  # type: ignore[attr-defined]
    if len(args) > len(names):
        raise TypeError(f"{name_of}() takes {len(names)} arguments but {len(args)} were given")
    values = dict(zip(names, args, strict=False))  # fewer args: defaults below
    for name, value in kwargs.items():
        if name not in fields or name in values:
            raise TypeError(f"{name_of}() got an unexpected or repeated argument {name!r}")
        values[name] = value
    for name in names:
        if name not in values:
            field = fields[name]
            if field.default is not MISSING:
                values[name] = field.default
            elif field.default_factory is not MISSING:
                values[name] = field.default_factory()
            else:
                raise TypeError(f"{name_of}() missing required argument: {name!r}")
        object.__setattr__(self, name, values[name])


def _frozen(self: object, name: str, value: object = None) -> None:
    raise FrozenInstanceError(f"cannot assign to field {name!r}")


def _eq(self: object, other: object) -> object:
    if other.__class__ is not self.__class__:
        return NotImplemented
    return _values(self) == _values(other)


def _hash(self: object) -> int:
    return hash(_values(self))


def _repr(self: object) -> str:
    names = self.__match_args__  # type: ignore[attr-defined]
    fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in names)
    return f"{self.__class__.__qualname__}({fields})"


@dataclass_transform(frozen_default=True)
def record(cls: type[_T]) -> type[_T]:
    """Make `cls` a frozen dataclass of its annotated fields.

    dataclasses reads the fields; the methods a frozen dataclass would generate (init,
    frozen assignment, equality, hash, repr) are written once here and behave alike:
    dataclasses compiles each generated method with exec, and the exec path defines some
    thirty records, which cost the launcher's start more than all its own work (issue 29,
    measured with scripts/bench_overhead.py)."""
    made = dataclass(init=False, repr=False, eq=False)(cls)
    made.__init__ = _init  # type: ignore[method-assign]
    made.__setattr__ = _frozen  # type: ignore[method-assign]
    made.__delattr__ = _frozen  # type: ignore[method-assign]
    made.__eq__ = _eq  # type: ignore[assignment,method-assign]
    made.__hash__ = _hash  # type: ignore[method-assign]
    made.__repr__ = _repr  # type: ignore[method-assign]
    made.__dataclass_params__.frozen = True  # type: ignore[attr-defined]  # as it behaves
    return made
