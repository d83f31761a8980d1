"""One base under safeio's three patches (``patch_save_pretrained``, the Trainer's, accelerate's): installs
counted per kind, a failed install leaving nothing, and an exact restore that never undoes what someone
else patched over safeio's."""

from __future__ import annotations

from typing import Any

import pytest

from safeio.frameworks import Patch


class _Framework:
    def save(self) -> str:
        return "framework's"


class _Subclass(_Framework):
    pass


class _SaveThroughSafeio(Patch):
    def apply(self) -> None:
        if not self.is_replaced(_Subclass, "save"):
            self.replace(_Subclass, "save", lambda self: "safeio's")


class _Unsupported(Patch):
    def apply(self) -> None:
        self.replace(_Subclass, "save", lambda self: "half")
        raise TypeError("this framework version is not supported")


def test_installs_are_counted_and_the_last_uninstall_restores_exactly() -> None:
    first, second = _SaveThroughSafeio(), _SaveThroughSafeio()
    with first:
        second.install()
        second.install()  # the same object twice counts once
        assert _Subclass().save() == "safeio's"
        second.uninstall()
        assert _Subclass().save() == "safeio's"  # first is still installed
    # The subclass had no save of its own: it has none again and inherits the framework's.
    assert "save" not in vars(_Subclass)
    assert _Subclass().save() == "framework's"
    assert _SaveThroughSafeio.current() is None


def test_a_failed_install_leaves_nothing_of_itself() -> None:
    patch = _Unsupported()
    with pytest.raises(TypeError, match="not supported"):
        patch.install()
    assert not patch.installed
    assert "save" not in vars(_Subclass)


def test_what_someone_patched_over_safeios_is_not_undone() -> None:
    def theirs(self: Any) -> str:
        return "another library's"

    with _SaveThroughSafeio():
        _Subclass.save = theirs  # type: ignore[method-assign]
    assert vars(_Subclass)["save"] is theirs
    del _Subclass.save


def test_the_three_patches_share_the_base() -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from safeio._saves.hf_patch import SaveRouting
    from safeio.integrations._accelerate_patch import AcceleratorPatch
    from safeio.integrations.transformers import TrainerPatch

    assert all(issubclass(kind, Patch) for kind in (SaveRouting, TrainerPatch, AcceleratorPatch))
    # Each kind counts its own installs: installing one installs nothing of another.
    with TrainerPatch():
        assert TrainerPatch.current() is not None
        assert SaveRouting.current() is None and AcceleratorPatch.current() is None


def test_accelerates_methods_patched_over_safeios_survive_its_uninstall() -> None:
    pytest.importorskip("accelerate")
    from accelerate.accelerator import Accelerator

    from safeio.integrations._accelerate_patch import patch_accelerator

    own = vars(Accelerator)["save_state"]

    def theirs(self: Any, *args: Any, **kwargs: Any) -> Any:
        return None

    with patch_accelerator():
        assert vars(Accelerator)["save_state"] is not own
        Accelerator.save_state = theirs  # type: ignore[method-assign]
    try:
        # Before the base, the last uninstall put accelerate's own method back over theirs.
        assert vars(Accelerator)["save_state"] is theirs
        assert vars(Accelerator)["load_state"] is not None
    finally:
        Accelerator.save_state = own  # type: ignore[method-assign]


def test_a_tokenizers_save_pretrained_patched_over_safeios_survives_its_uninstall() -> None:
    transformers = pytest.importorskip("transformers")

    import safeio

    base = transformers.PreTrainedTokenizerBase
    own = vars(base)["save_pretrained"]

    def theirs(self: Any, *args: Any, **kwargs: Any) -> Any:
        return None

    with safeio.patch_save_pretrained():
        assert vars(base)["save_pretrained"] is not own
        base.save_pretrained = theirs
    try:
        assert vars(base)["save_pretrained"] is theirs
    finally:
        base.save_pretrained = own
    with safeio.patch_save_pretrained():
        pass
    assert vars(base)["save_pretrained"] is own  # and nothing else changed it: restored exactly
