"""The tables of docs/cli.md, read for the tests that check them against the code."""

from __future__ import annotations

from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs" / "cli.md"


def docs_table(heading: str) -> list[list[str]]:
    """The cells of the first table under ``heading`` (a ``## `` line) of docs/cli.md, without its header
    row and rule."""
    text = DOCS.read_text()
    section = text[text.index(f"\n{heading}\n") + len(heading) + 2 :]
    rows = []
    for line in section.splitlines():
        if line.startswith("## "):
            break
        if line.startswith("| ") and not line.startswith("| ---"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    return rows[1:]
