"""`record`: the package's immutable values, `dataclasses.dataclass(frozen=True)`.

One name for the one way the package makes a record: keyword or positional construction
with defaults, immutability, equality, hashing and a readable repr.
"""

from __future__ import annotations

from dataclasses import dataclass
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

    Its equality, hash and repr are the ones a frozen dataclass generates, written once
    here rather than generated per class: dataclasses compiles each generated method, and
    the exec path defines some thirty records (docs/benchmarks.md, start-up overhead)."""
    made = dataclass(frozen=True, eq=False, repr=False)(cls)
    made.__eq__ = _eq  # type: ignore[assignment,method-assign]
    made.__hash__ = _hash  # type: ignore[method-assign]
    made.__repr__ = _repr  # type: ignore[method-assign]
    return made
