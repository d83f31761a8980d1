"""The one base of safeio's patches of a framework's code: ``patch_save_pretrained`` (transformers'
classes), the Trainer's (``safeio.integrations.transformers``) and accelerate's
(``safeio.integrations._accelerate_patch``).

Each patch only says what it replaces (``apply``, calling ``replace``); the base owns the rest, once:
installs are counted per kind of patch (the first applies, the last restores; an install of one object
twice counts once, and patches what was imported since), everything is done under the kind's lock, an
install whose ``apply`` fails leaves nothing of itself, and the restore is exact: every attribute
replaced is put back as it was — the owner's own value, or no attribute of its own when it had none (a
class then inherits again) — and never over what someone else patched over ours since.
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar, Self

_MISSING = object()


class Patch:
    """``install()``/``uninstall()``, or a context manager. Subclasses supply ``apply`` (called under the
    lock whenever the installs change while one is installed) and keep their installs, replacements and
    lock apart from every other kind of patch."""

    _lock: ClassVar[threading.RLock]
    _installs: ClassVar[list[Patch]]  # innermost last
    # What was replaced, in order: (owner, attribute, the owner's own value before or _MISSING, ours).
    _replaced: ClassVar[list[tuple[Any, str, Any, Any]]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._lock = threading.RLock()
        cls._installs = []
        cls._replaced = []

    def __init__(self) -> None:
        self.installed = False

    # -- what a patch supplies ------------------------------------------------------------------------

    def apply(self) -> None:
        """Replace what the installed patches of this kind ask for and is not replaced yet
        (``replace``), or restore what they no longer ask for (``restore``). Called with the lock held,
        on the newest install."""
        raise NotImplementedError

    # -- the base --------------------------------------------------------------------------------------

    def install(self) -> Self:
        with self._lock:
            if not self.installed:
                type(self)._installs.append(self)
                self.installed = True
            try:
                self.sync()  # again for an install already counted: what was imported since is patched
            except BaseException:  # an unsupported framework: nothing of this install stays
                self.uninstall()
                raise
        return self

    def uninstall(self) -> None:
        with self._lock:
            if self.installed:
                type(self)._installs.remove(self)
                self.installed = False
                self.sync()

    def __enter__(self) -> Self:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    @classmethod
    def sync(cls) -> None:
        """Make what is patched match the installs: everything restored when none is left."""
        with cls._lock:
            if cls._installs:
                cls._installs[-1].apply()
            else:
                cls.restore()

    @classmethod
    def current(cls) -> Patch | None:
        """The innermost install of this kind (whose options apply), None when none is installed."""
        return cls._installs[-1] if cls._installs else None

    @classmethod
    def replace(cls, owner: Any, name: str, ours: Any) -> None:
        """Set ``owner.name`` to ``ours``, remembering what ``owner`` had as its own attribute."""
        cls._replaced.append((owner, name, vars(owner).get(name, _MISSING), ours))
        setattr(owner, name, ours)

    @classmethod
    def is_replaced(cls, owner: Any, name: str) -> bool:
        return any(where is owner and attribute == name for where, attribute, _, _ in cls._replaced)

    @classmethod
    def replaced_owners(cls, name: str) -> list[Any]:
        """Every owner whose ``name`` this kind of patch replaced, in the order it did."""
        return [where for where, attribute, _, _ in cls._replaced if attribute == name]

    @classmethod
    def restore(cls, owner: Any = _MISSING, name: str | None = None) -> None:
        """Put back what was replaced (only ``owner``'s, only its ``name``, when given), newest first."""
        kept = []
        for record in reversed(cls._replaced):
            where, attribute, before, ours = record
            if (owner is not _MISSING and where is not owner) or (name is not None and attribute != name):
                kept.append(record)
                continue
            if vars(where).get(attribute) is ours:  # never undo what someone patched over ours
                if before is _MISSING:
                    delattr(where, attribute)
                else:
                    setattr(where, attribute, before)
        cls._replaced[:] = reversed(kept)
