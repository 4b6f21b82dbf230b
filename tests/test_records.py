"""Records (vllm_cpu_launch/records.py): frozen values made by position or keyword, compared
and hashed by value, refused where dataclass would refuse them: what `dataclass(frozen=True)`
gave, at a cost the exec path can afford (docs/design.md, "Records")."""

from __future__ import annotations

import pytest

from vllm_cpu_launch.records import field, record, replace


def test_a_record_is_a_frozen_value_made_by_position_or_keyword() -> None:
    from vllm_cpu_launch.libraries import Host, PreloadEntry
    from vllm_cpu_launch.records import FrozenRecordError
    from vllm_cpu_launch.rules import Setting

    setting = Setting(None, "a note", tcmalloc=True)
    assert setting == Setting(note="a note", rule=None, tcmalloc=True) != Setting(None, "a note")
    assert hash(setting) == hash(Setting(None, "a note", (), True))
    shown = "Setting(rule=None, note='a note', variables=(), tcmalloc=True, read=False)"
    assert repr(setting) == shown
    assert replace(setting, note="changed") == Setting(None, "changed", tcmalloc=True)
    with pytest.raises(FrozenRecordError):
        setting.note = "changed"  # type: ignore[misc]
    with pytest.raises(TypeError, match=r": unexpected \['nothing'\]$"):
        Setting(None, "", nothing=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"^Setting\(\) takes rule, note, .*: missing \['note'\]$"):
        Setting(rule=None)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Setting(None, "a note", note="twice")  # type: ignore[misc]
    # A derived value: the host's preload, a property read once per LD_PRELOAD text.
    host = Host({"LD_PRELOAD": "/lib/libiomp5.so"}, "x86_64", 0, "/usr")
    assert [entry.path for entry in host.preload] == ["/lib/libiomp5.so"]
    assert isinstance(host.preload[0], PreloadEntry)
    with pytest.raises(TypeError):
        replace(host, preload=())


def test_a_record_is_refused_where_dataclass_would_refuse_it() -> None:
    """Refused when the class is made, not when a record is: what dataclass checked."""
    from typing import ClassVar

    with pytest.raises(TypeError, match="shared by every instance"):

        @record
        class Shared:
            items: list[str] = []  # noqa: RUF012

    with pytest.raises(TypeError, match="without a default follows"):

        @record
        class Order:
            first: int = 0
            second: int  # type: ignore[misc]

    @record
    class Counted:
        seen: ClassVar[int] = 0
        name: str

    assert Counted("x").name == "x" and Counted.__match_args__ == ("name",)

    @record
    class Forgotten:
        name: str
        derived: str = field(init=False)

    with pytest.raises(TypeError, match="left a field unset"):
        Forgotten("x")
    # Fields in the order they are declared, however the record was made (JSON keeps it).
    from vllm_cpu_launch.rules import Setting

    assert list(vars(Setting(note="a", rule=None))) == [
        "rule",
        "note",
        "variables",
        "tcmalloc",
        "read",
    ]
