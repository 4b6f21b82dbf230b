"""Records: the frozen values that flow between modules, made by `record` (docs/design.md,
"Records": why not dataclasses or NamedTuple on the exec path)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any, Literal, TypeVar

    from typing_extensions import dataclass_transform

    _T = TypeVar("_T")
else:

    def dataclass_transform(**_kwargs):
        return lambda decorator: decorator


# Records: frozen values with keyword or positional construction, equality, hashing and a
# readable repr, as `dataclass(frozen=True)` makes them. Not dataclasses: importing it (with
# inspect) and the six functions it compiles for each class took 23 ms of a 49 ms launch
# (issue 35, Python 3.11); the exec path makes 30 records.
NOT_A_PARAMETER: Any = object()


def field(*, init: Literal[False]) -> Any:
    """A field that the record's `__post_init__` sets, not a parameter of its constructor."""
    return NOT_A_PARAMETER


class FrozenRecordError(AttributeError):
    """Assigning to a record's field: records are values."""


def fields_of(cls: type) -> tuple[tuple[str, ...], dict[str, Any], tuple[str, ...]]:
    """The record's fields (its bases' first, ClassVars not), their defaults and its
    parameters, refused at once where dataclass would refuse them."""
    fields = tuple(
        dict.fromkeys(
            name
            for base in reversed(cls.__mro__[:-1])
            for name, annotation in getattr(base, "__annotations__", {}).items()
            if not str(annotation).startswith(("ClassVar", "typing.ClassVar"))
        )
    )
    defaults = {name: getattr(cls, name) for name in fields if hasattr(cls, name)}
    parameters = tuple(name for name in fields if defaults.get(name) is not NOT_A_PARAMETER)
    has_default = [name in defaults for name in parameters]
    problems = {
        "no annotated field (from __future__ import annotations is needed)": not fields,
        "a list, dict or set default is shared by every instance": any(
            isinstance(value, (list, dict, set)) for value in defaults.values()
        ),
        "a field without a default follows one with a default": has_default != sorted(has_default),
    }
    found = [problem for problem, failed in problems.items() if failed]
    if found:
        raise TypeError(f"record {cls.__qualname__}: {found[0]}")
    return fields, defaults, parameters


@dataclass_transform(frozen_default=True, field_specifiers=(field,))
def record(cls: type[_T]) -> type[_T]:
    """Make `cls` a frozen record of its annotated fields (its bases' first)."""
    fields, defaults, parameters = fields_of(cls)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        given = dict(zip(parameters, args, strict=False))
        unknown = [name for name in kwargs if name not in parameters or name in given]
        given.update(kwargs)
        missing = [name for name in parameters if name not in given and name not in defaults]
        wrong = [f"{len(args)} positional"] if len(args) > len(parameters) else []
        if unknown:
            wrong.append(f"unexpected {unknown}")
        if missing:
            wrong.append(f"missing {missing}")
        if wrong:
            raise TypeError(f"{cls.__name__}() takes {', '.join(parameters)}: {', '.join(wrong)}")
        # In field order, so that vars() of a record lists its fields as they are declared.
        self.__dict__.update({name: given.get(name, defaults.get(name)) for name in parameters})
        if hasattr(self, "__post_init__"):
            self.__post_init__()
        if len(self.__dict__) < len(fields):
            raise TypeError(f"{cls.__name__}.__post_init__ left a field unset")

    def values(self: Any) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in fields)

    def __eq__(self: Any, other: object) -> bool:
        return (
            values(self) == values(other) if other.__class__ is self.__class__ else NotImplemented
        )

    def __repr__(self: Any) -> str:
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in fields)
        return f"{type(self).__qualname__}({shown})"

    def frozen(self: Any, name: str, *_value: Any) -> None:
        raise FrozenRecordError(f"cannot assign to field {name!r}")

    made: dict[str, object] = {
        "__init__": __init__,
        "__eq__": __eq__,
        "__hash__": lambda self: hash(values(self)),
        "__repr__": __repr__,
        "__setattr__": frozen,
        "__delattr__": frozen,
        "__match_args__": parameters,
    }
    for name, value in made.items():
        if vars(cls).get(name) is None:  # what the class defines itself stays
            setattr(cls, name, value)
    return cls


def replace(item: _T, /, **changes: Any) -> _T:
    """A copy of the record `item` with `changes` to its fields."""
    parameters: tuple[str, ...] = type(item).__match_args__  # type: ignore[attr-defined]
    return type(item)(**{name: getattr(item, name) for name in parameters} | changes)
