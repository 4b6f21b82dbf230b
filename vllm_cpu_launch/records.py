"""Frozen record classes that cost nothing to import.

`import dataclasses` pulls in `inspect` and took 14 ms in a clean venv here, more
than the interpreter's whole start-up (8 ms); the exec path must stay close to the
latter (see scripts/bench_overhead.py). `record` gives what the launcher uses of
`dataclass(frozen=True)`: keyword or positional construction with defaults,
immutability, equality, hashing and a readable repr. Type checkers see it as a
frozen dataclass through `dataclass_transform` (PEP 681).
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, TypeVar

    from typing_extensions import dataclass_transform

    _T = TypeVar("_T")
else:

    def dataclass_transform(**_kwargs):
        return lambda decorator: decorator


@dataclass_transform(frozen_default=True)
def record(cls: type[_T]) -> type[_T]:
    """Make `cls` an immutable record of its annotated fields."""
    # Not inspect.get_annotations: importing inspect is the cost this module avoids.
    names = tuple(cls.__dict__.get("__annotations__", {}))  # noqa: RUF063
    defaults = {name: cls.__dict__[name] for name in names if name in cls.__dict__}

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if len(args) > len(names):
            raise TypeError(f"{cls.__name__}() takes {len(names)} fields, got {len(args)}")
        values = dict(defaults)
        values.update(zip(names, args, strict=False))
        for key, value in kwargs.items():
            if key not in names or key in names[: len(args)]:
                raise TypeError(f"{cls.__name__}() got an unexpected or repeated field {key!r}")
            values[key] = value
        missing = [name for name in names if name not in values]
        if missing:
            raise TypeError(f"{cls.__name__}() missing fields: {', '.join(missing)}")
        for name in names:
            object.__setattr__(self, name, values[name])

    def _fields(self: Any) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in names)

    def __setattr__(self: Any, name: str, value: Any) -> None:
        raise AttributeError(f"{cls.__name__} is immutable: cannot assign {name!r}")

    def __delattr__(self: Any, name: str) -> None:
        raise AttributeError(f"{cls.__name__} is immutable: cannot delete {name!r}")

    def __eq__(self: Any, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return bool(_fields(self) == _fields(other))

    def __hash__(self: Any) -> int:
        return hash(_fields(self))

    def __repr__(self: Any) -> str:
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in names)
        return f"{cls.__name__}({shown})"

    methods: dict[str, Callable[..., Any]] = {
        "__init__": __init__,
        "__setattr__": __setattr__,
        "__delattr__": __delattr__,
        "__eq__": __eq__,
        "__hash__": __hash__,
        "__repr__": __repr__,
    }
    for name, method in methods.items():
        method.__qualname__ = f"{cls.__qualname__}.{name}"
        setattr(cls, name, method)
    setattr(cls, "__match_args__", names)  # noqa: B010 (mypy rejects the plain assignment)
    return cls
