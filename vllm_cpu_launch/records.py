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


@dataclass_transform(frozen_default=True)
def record(cls: type[_T]) -> type[_T]:
    """Make `cls` a frozen dataclass of its annotated fields."""
    return dataclass(frozen=True)(cls)
