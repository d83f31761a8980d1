"""The ```python blocks of the README and the docs, with the markers that say how each one runs.

A block runs as written, as a script in a fresh temporary directory (its cwd), in a new process. HTML
comments on the lines right before its fence (blank lines between them allowed) change that:

- ``<!-- ranks: N -->``: the block runs on N processes at once, each with ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``MASTER_ADDR`` (loopback) and ``MASTER_PORT`` set, as torchrun sets them, and with
  a gloo process group already initialised before the block's first line (as the training script around
  the example would have done) and destroyed after its last; the ranks share the directory.
- ``<!-- skip: reason -->``: not run; the reason is required and shown as the skip's reason.
- ``<!-- needs: fuse -->``: the NFS-like FUSE filesystem must be available (skipped with the reason
  otherwise, or failed under ``SAFEIO_REQUIRE_FUSE=1``).
- ``<!-- continue -->``: the block continues the previous block of the same file (a fragment split by
  prose); it is appended to it and runs with it, under the first block's markers.

An unknown marker, a skip without a reason or a continuation with nothing before it is an error the
test reports: a block either runs or says why not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("README.md", "docs")

_FENCE = re.compile(r"^```(\S*)\s*$")
_MARKER = re.compile(r"^<!--\s*([a-z]+)\s*(?::\s*(.*?))?\s*-->\s*$")
KNOWN = {"ranks", "skip", "needs", "continue"}


@dataclass
class Block:
    path: str  # relative to the repository
    line: int  # of the opening fence, 1-based
    code: str
    ranks: int = 0  # 0: one plain process, no process group
    skip: str | None = None
    needs: set[str] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)  # every fence joined into this block

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def markdown_files() -> list[Path]:
    files = [ROOT / "README.md"]
    files += sorted((ROOT / "docs").rglob("*.md"))
    return files


def _markers(lines: list[str], fence: int) -> list[tuple[str, str | None, int]]:
    """The marker comments right above line index `fence` (blank lines between them allowed)."""
    found = []
    i = fence - 1
    while i >= 0 and (not lines[i].strip() or _MARKER.match(lines[i].strip())):
        if m := _MARKER.match(lines[i].strip()):
            found.append((m.group(1), m.group(2), i + 1))
        i -= 1
    return list(reversed(found))


def blocks_of(path: Path) -> list[Block]:
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
    result: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m or not m.group(1):
            i += 1
            continue
        language, start = m.group(1), i
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        i = j + 1
        if language != "python":
            continue
        code = "\n".join(lines[start + 1 : j]) + "\n"
        block = Block(rel, start + 1, code, lines=[start + 1])
        joined = False
        for name, value, line in _markers(lines, start):
            where = f"{rel}:{line}"
            if name not in KNOWN:
                block.errors.append(f"{where}: unknown marker {name!r} (known: {sorted(KNOWN)})")
            elif name == "ranks":
                if not (value or "").isdigit() or not 1 <= int(value or 0) <= 8:
                    block.errors.append(f"{where}: ranks needs a number of ranks from 1 to 8, got {value!r}")
                else:
                    block.ranks = int(value or 0)
            elif name == "skip":
                if not value:
                    block.errors.append(f"{where}: a skip must say why (<!-- skip: reason -->)")
                block.skip = value or "(no reason given)"
            elif name == "needs":
                if value != "fuse":
                    block.errors.append(f"{where}: needs takes 'fuse', got {value!r}")
                block.needs.add(value or "")
            elif name == "continue":
                if not result:
                    block.errors.append(f"{where}: continue, but no python block before it in {rel}")
                else:
                    previous = result[-1]
                    previous.code += block.code
                    previous.lines.append(block.line)
                    previous.errors += block.errors
                    joined = True
        if not joined:
            result.append(block)
    return result


def all_blocks() -> list[Block]:
    return [block for path in markdown_files() for block in blocks_of(path)]


# Links: [text](target) in prose, not in code spans or fenced blocks.
_LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def relative_links(path: Path) -> list[tuple[int, str]]:
    """Every relative link target of a Markdown file, outside fenced blocks and code spans."""
    found = []
    in_fence = False
    for number, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
        if line.startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        prose = re.sub(r"`[^`]*`", "", line)
        for m in _LINK.finditer(prose):
            target = m.group(1) or m.group(2)
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target) and not target.startswith("#"):
                found.append((number, target))
    return found
