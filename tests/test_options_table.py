"""docs/options.md's option x entry-point table says what the signatures say (issue 36).

Each cell is the default of that option in that entry point's signature, or a dash where the entry point
does not take the option; a signature that gains, loses or changes an option fails here until the page
says so too.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import safeio

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


def test_the_table_names_every_public_save_entry_point() -> None:
    entry_points, _ = _table()
    assert entry_points == [
        "save_pretrained",
        "replicated",
        "torch_save",
        "patch_save_pretrained",
        "Checkpoints",
    ]
    assert all(name in safeio.__all__ for name in entry_points)


def test_every_cell_is_the_signature_default_or_a_dash_where_the_option_is_not_taken() -> None:
    entry_points, cells = _table()
    for entry_point in entry_points:
        taken = _options(entry_point)
        documented = {option for option, row in cells.items() if row[entry_point] != NOT_TAKEN}
        assert documented == set(taken), (
            f"{entry_point}: the table says {sorted(documented)}, the signature {sorted(taken)}"
        )
        for option in documented:
            cell = cells[option][entry_point]
            assert cell.startswith("`") and cell.endswith("`"), f"{entry_point} {option}: {cell!r}"
            assert ast.literal_eval(cell.strip("`")) == taken[option], f"{entry_point} {option}: {cell}"


def test_the_mode_defaults_the_page_states_in_prose_match_the_table() -> None:
    _, cells = _table()
    page = OPTIONS_PAGE.read_text(encoding="utf-8")
    assert cells["mode"]["save_pretrained"] == cells["mode"]["patch_save_pretrained"] == '`"merge"`'
    assert cells["mode"]["replicated"] == '`"replace"`'
    assert '`"merge"` for `save_pretrained` and `patch_save_pretrained`' in page
    assert '`"replace"` for `replicated()`' in page
