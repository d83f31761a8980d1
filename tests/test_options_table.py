"""docs/options.md's option x entry-point table says what the definition and the signatures say (issues 35, 36).

Each cell is the default of that option in that entry point's signature, or a dash where the entry point
does not take the option. The rows of the shared options are rendered from ``safeio._options`` (which
``tests/test_options_definition.py`` holds every signature to), the rows of an entry point's own options
from its signature, and the list of gaps from the reasons the definition gives; a change to any of them
fails here, printing the lines the page should have, until the page says so too.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import safeio
from safeio._options import ENTRY_POINTS, OPTIONS

OPTIONS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "options.md"
HEADING = "## Which entry point takes which option"
NOT_TAKEN = "—"
# Parameters that are what is saved or where, not how: not options.
NOT_OPTIONS = {"obj", "target", "path", "root", "args", "hf_kwargs", "save_kwargs", "step", "self"}


def _table() -> tuple[list[str], dict[str, dict[str, str]]]:
    section = OPTIONS_PAGE.read_text(encoding="utf-8").split(HEADING, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    header = [cell.strip().strip("`") for cell in rows[0].strip("|").split("|")]
    entry_points = header[1:]
    cells: dict[str, dict[str, str]] = {}
    for row in rows[2:]:  # after the header and its --- line
        option, *values = (cell.strip() for cell in row.strip("|").split("|"))
        cells[option.strip("`")] = dict(zip(entry_points, values, strict=True))
    return entry_points, cells


def _options(entry_point: str) -> dict[str, Any]:
    parameters = inspect.signature(getattr(safeio, entry_point)).parameters
    return {
        name: parameter.default
        for name, parameter in parameters.items()
        if name not in NOT_OPTIONS and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
    }


def _cell(value: object) -> str:
    return f'`"{value}"`' if isinstance(value, str) else f"`{value!r}`"


def _expected_table() -> list[str]:
    """The table as the definition (``safeio._options.ENTRY_POINTS``) and the extras' signatures say it."""
    entry_points = list(ENTRY_POINTS)
    lines = [
        "| option | " + " | ".join(f"`{name}`" for name in entry_points) + " |",
        "| --- |" + " --- |" * len(entry_points),
    ]
    for option in OPTIONS:
        cells = [
            _cell(entry.default(option)) if option in entry.takes else NOT_TAKEN
            for entry in ENTRY_POINTS.values()
        ]
        lines.append(f"| `{option}` | " + " | ".join(cells) + " |")
    extras: dict[str, dict[str, object]] = {}
    for entry_point in entry_points:
        for option, default in _options(entry_point).items():
            if option not in OPTIONS:
                extras.setdefault(option, {})[entry_point] = default
    for option, defaults in extras.items():
        cells = [_cell(defaults[name]) if name in defaults else NOT_TAKEN for name in entry_points]
        lines.append(f"| `{option}` | " + " | ".join(cells) + " |")
    return lines


def _expected_gaps() -> list[str]:
    return [
        f"- `{entry.name}` takes no `{option}`: {reason}."
        for entry in ENTRY_POINTS.values()
        for option, reason in entry.not_taken.items()
    ]


def _section() -> str:
    return OPTIONS_PAGE.read_text(encoding="utf-8").split(HEADING, 1)[1].split("\n## ", 1)[0]


def test_the_table_is_the_definition_and_the_extras_signatures() -> None:
    table = [line for line in _section().splitlines() if line.startswith("|")]
    expected = _expected_table()
    assert table == expected, "docs/options.md's table should read:\n" + "\n".join(expected)


def test_every_gap_is_listed_with_its_reason_from_the_definition() -> None:
    gaps = [line for line in _section().splitlines() if line.startswith("- `")]
    expected = _expected_gaps()
    assert gaps == expected, "docs/options.md's gaps should read:\n" + "\n".join(expected)


def test_the_table_names_every_public_save_entry_point() -> None:
    entry_points, _ = _table()
    assert entry_points == list(ENTRY_POINTS)
    assert all(name in safeio.__all__ for name in entry_points)


def test_the_mode_defaults_the_page_states_in_prose_match_the_table() -> None:
    _, cells = _table()
    page = OPTIONS_PAGE.read_text(encoding="utf-8")
    assert cells["mode"]["save_pretrained"] == cells["mode"]["patch_save_pretrained"] == '`"merge"`'
    assert cells["mode"]["replicated"] == '`"replace"`'
    assert '`"merge"` for `save_pretrained` and `patch_save_pretrained`' in page
    assert '`"replace"` for `replicated()`' in page


def test_the_first_table_says_what_every_defined_option_means() -> None:
    page = OPTIONS_PAGE.read_text(encoding="utf-8")
    first = page.split("## Options", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in first.splitlines() if line.startswith("| `")]
    assert sorted(row.split("|")[1].strip().strip("`") for row in rows) == sorted(OPTIONS)
