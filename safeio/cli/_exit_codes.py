"""Every command's exit codes, defined once: ``--help`` renders them, ``docs/cli.md`` lists them (and
``tests/test_cli_exit_codes.py`` checks that page against this table and runs every code it lists).

The same situation has the same code in every command: a path that names no directory is bad input (2)
whether ``ls``, ``gc`` or ``verify`` is given it (``verify`` once said "is not a directory" and exited 1,
issue 36); a missing dependency is 2 for ``demo`` and ``autopatch`` alike.
"""

from __future__ import annotations

import textwrap

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

HEADINGS = {
    EXIT_OK: "success",
    EXIT_PROBLEMS: "problems found",
    EXIT_USAGE: "usage error or bad input",
    EXIT_INTERRUPTED: "interrupted",
}

EVERY = "every command"
COMMANDS = ("doctor", "gc", "verify", "ls", "demo", "audit report", "autopatch")

# command -> code -> when. EVERY's codes apply to every command besides its own.
CODES: dict[str, dict[int, str]] = {
    EVERY: {
        EXIT_PROBLEMS: "the filesystem failed under the command (an I/O error, named with its path)",
        EXIT_USAGE: "an unknown command or option, a missing argument, or a path that names no directory "
        "(no such file or directory, not a directory, permission denied)",
        EXIT_INTERRUPTED: "Ctrl-C (demo: also SIGTERM); whatever the command had created is removed first",
    },
    "doctor": {
        EXIT_OK: "printed its report, whatever risks it lists",
        EXIT_PROBLEMS: "the filesystem breaks a guarantee safeio relies on (atomic rename, exclusive "
        "create), or the probe's second process could not start",
        EXIT_USAGE: "no write permission in PATH; --peer-path is not the same directory; --probe-timeout "
        "out of range",
    },
    "gc": {
        EXIT_OK: "finished, also when nothing was removable (what it keeps is listed, not an error)",
        EXIT_PROBLEMS: "something could not be removed (an error line names it and why)",
        EXIT_USAGE: "--older-than is not a duration",
    },
    "verify": {
        EXIT_OK: "the target matches its manifest, or its framework's own marker says it is complete "
        "(listed as not checked); for a root: so does every step of this user, and latest names a "
        "committed step",
        EXIT_PROBLEMS: "the target, or a step of the root, is damaged, uncommitted or "
        "written-without-safeio-incomplete, or latest does not name a committed step",
        EXIT_USAGE: "an object-store prefix with no object under it; an empty PATH",
    },
    "ls": {
        EXIT_OK: "listed the root, and latest (if there is one) names a committed step",
        EXIT_PROBLEMS: "latest names something that is not a committed step, or is not a pointer safeio "
        "can read",
    },
    "demo": {
        EXIT_OK: "the safeio pattern ran clean",
        EXIT_PROBLEMS: "the safeio pattern was not clean, or a process of the demo stopped (the error "
        "names it and why)",
        EXIT_USAGE: "torch, transformers or tokenizers is not installed; --nfslike where FUSE cannot "
        "mount; --ranks over 64 or --hazard-timeout out of range",
    },
    "audit report": {
        EXIT_OK: "no conflicts",
        EXIT_PROBLEMS: "conflicts: several processes wrote one path",
        EXIT_USAGE: "the audit sanitizer is not installed",
    },
    "autopatch": {
        EXIT_OK: "a new process with this SAFEIO_PATCH is patched",
        EXIT_PROBLEMS: "a new process is not patched (the start-up hook is not installed, or SAFEIO_PATCH "
        "names no part)",
        EXIT_USAGE: "transformers is not installed: there is nothing to patch",
    },
}

WIDTH = 79
_CODE_INDENT = " " * 2
_ENTRY_INDENT = " " * 7
_MORE_INDENT = " " * 9


def codes_of(command: str) -> dict[int, str]:
    """What each exit code of ``command`` means, ``every command``'s situations included."""
    own, every = CODES[command], CODES[EVERY]
    return {
        code: "; ".join(text for text in (own.get(code), every.get(code)) if text)
        for code in sorted({*own, *every})
    }


def entries(command: str | None) -> list[tuple[int, str]]:
    """The lines of the exit-code block: (code, text), each text one whole entry (a command's, labelled
    with its name when ``command`` is None: the block of ``safeio --help``)."""
    found: list[tuple[int, str]] = []
    for code in HEADINGS:
        if command is None:
            found.extend(
                (code, f"{name}: {CODES[name][code]}") for name in (*COMMANDS, EVERY) if code in CODES[name]
            )
        elif code in codes_of(command):
            found.append((code, codes_of(command)[code]))
    return found


def epilog(command: str | None = None) -> str:
    """The ``exit codes:`` block of ``safeio --help`` (every command) or of ``safeio COMMAND --help``:
    one heading line per code, then each entry on its own lines, wrapped at word boundaries (never
    inside a hyphenated word or an option) and indented under its code."""
    lines = ["exit codes:"]
    for code, heading in HEADINGS.items():
        texts = [text for found, text in entries(command) if found == code]
        if not texts:
            continue
        lines.append(f"{_CODE_INDENT}{code:<4} {heading}")
        for text in texts:
            lines.extend(
                textwrap.wrap(
                    text,
                    WIDTH,
                    initial_indent=_ENTRY_INDENT,
                    subsequent_indent=_MORE_INDENT,
                    break_long_words=False,
                    break_on_hyphens=False,
                )
            )
    return "\n".join(lines) + "\n"
