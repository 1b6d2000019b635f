"""docs/plugin-reference.md is generated from the code, and every field of every
data object a plugin receives is documented in its class docstring."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import pytest

from vframe.plugins import reference


def test_checked_in_reference_is_current(capsys: pytest.CaptureFixture[str]) -> None:
    status = reference.main(["--check"])
    assert status == 0, f"docs/plugin-reference.md is out of date: run `make docs`\n{capsys.readouterr().err}"


def test_check_fails_on_a_stale_file_and_writing_fixes_it(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plugin-reference.md"
    out.write_text("# Plugin API reference\n\nstale\n")
    assert reference.main(["--check", "--output", str(out)]) == 1
    assert "is out of date" in capsys.readouterr().err
    assert reference.main(["--output", str(out)]) == 0
    assert reference.main(["--check", "--output", str(out)]) == 0


@pytest.mark.parametrize("cls", reference.data_object_classes(), ids=lambda cls: cls.__name__)
def test_every_field_of_a_data_object_is_documented(cls: type) -> None:
    assert reference.attribute_problems(cls) == []


def test_every_listed_interface_and_data_object_exists() -> None:
    paths = list(reference.INTERFACES) + [p for _, paths in reference.DATA_OBJECTS for p in paths]
    assert len(set(paths)) == len(paths)
    for path in paths:
        assert isinstance(reference.load(path), type), path


# --------------------------------------------------------------------------- #
# The field check itself: it must catch a field added without documentation.
# --------------------------------------------------------------------------- #


@dataclass
class _Step:
    """A throwaway data object.

    Attributes:
        num_tokens: documented.
        removed: an entry whose field is gone.
    """

    num_tokens: int
    block_table: list[int]  # added without an entry
    _private: int = 0  # not part of the contract


def test_field_check_reports_an_undocumented_field_and_a_stale_entry() -> None:
    where = f"{__name__}._Step"
    assert reference.attribute_problems(_Step) == [
        f"{where}.block_table: no entry in its docstring's Attributes: section",
        f"{where}: the Attributes: entry 'removed' names no field",
    ]


class _Color(enum.Enum):
    """A throwaway enum.

    Attributes:
        RED: documented.
    """

    RED = 1
    BLUE = 2


class _Plain:
    """A throwaway class with attributes set in ``__init__``.

    Attributes:
        name (str): documented, typed here.
        num_tokens: documented, typed by its annotation.
        size: a property.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.num_tokens: int = 0
        self.ids = [1]  # undocumented
        self._cache: dict[str, int] = {}

    @property
    def size(self) -> int:
        return self.num_tokens


def test_field_check_covers_enums_and_plain_classes() -> None:
    assert reference.attribute_problems(_Color) == [
        f"{__name__}._Color.BLUE: no entry in its docstring's Attributes: section"
    ]
    assert [(f.name, f.type) for f in reference.fields_of(_Plain)] == [
        ("name", "str"),
        ("num_tokens", "int"),
        ("ids", ""),
        ("size", "int"),
    ]
    assert reference.attribute_problems(_Plain) == [
        f"{__name__}._Plain.ids: no entry in its docstring's Attributes: section"
    ]


def test_attributes_section_is_parsed_and_removed_from_the_text() -> None:
    doc = """Summary.

    Attributes:
        a (int): first line
            continued.
        b: second.

    After the section.
    """
    rest, entries = reference.split_attributes(doc)
    assert rest == "Summary.\n\nAfter the section."
    assert entries == {
        "a": reference.AttributeDoc("int", "first line continued."),
        "b": reference.AttributeDoc(None, "second."),
    }
    with pytest.raises(ValueError, match="not an 'name: text' entry"):
        reference.split_attributes("Summary.\n\nAttributes:\n    a first line without a colon\n")


def test_reference_shows_types_shapes_and_abstract_methods() -> None:
    text = reference.render()
    # The host copies are lists, not tensors (calling .tolist() on them fails).
    assert "| `query_start_loc_cpu` | `list[int]` |" in text
    assert "| `block_table` | `torch.Tensor` | ``[B, max_blocks_per_req]`` int32;" in text
    assert "#### `build(common: CommonAttentionMetadata) -> Any`\n\n*abstract*" in text
    assert "#### `get_stats() -> dict[str, float]`\n\n*has a default*" in text
    assert text == reference.render()
