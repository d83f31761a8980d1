"""One back end per location: picked once from the target, the only place that knows its kind, and open to a
new kind by a subclass alone (``tests/_marker_backend.py``: a local directory that refuses directory
renames, committed by a marker, defined outside ``safeio/``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import fsspec
import pytest

import safeio
from safeio._options import SaveOptions
from safeio._promotion.backends import Backend, ObjectStoreBackend, PosixBackend, backend_for
from safeio._storage.location import resolve
from safeio.testing.ranks import run_ranks
from tests._bounds import PATIENT, RUN
from tests._marker_backend import PROTOCOL, DirectoryRenameRefused, MarkerDirectoryBackend
from tests.test_checkpoints import _save_loop


def test_each_kind_of_location_gets_its_back_end(tmp_path: Path) -> None:
    assert type(backend_for(tmp_path / "tok")) is PosixBackend
    assert type(backend_for(f"file://{tmp_path}/tok")) is PosixBackend
    assert type(backend_for("memory://bucket/tok")) is ObjectStoreBackend
    assert type(backend_for(f"{PROTOCOL}://{tmp_path}/tok")) is MarkerDirectoryBackend


def test_a_back_end_missing_a_part_fails_when_it_is_made_not_later(tmp_path: Path) -> None:
    class Forgetful(Backend):  # everything but the reader (and the rest): abstract, so never made
        protocols = ("forgetful-test",)

        def promotion(self, options: SaveOptions, **kwargs: Any) -> Any:
            raise AssertionError("never reached")

    with pytest.raises(TypeError, match="abstract"):
        Forgetful(resolve(tmp_path / "tok"))  # type: ignore[abstract]


def test_the_test_only_back_end_really_refuses_directory_renames(tmp_path: Path) -> None:
    fs = fsspec.filesystem(PROTOCOL)
    (tmp_path / "a").mkdir()
    with pytest.raises(DirectoryRenameRefused):
        fs.mv(f"{PROTOCOL}://{tmp_path}/a", f"{PROTOCOL}://{tmp_path}/b")
    # A save there commits by its marker instead (the contract tests run every promise on it).
    with safeio.replicated(f"{PROTOCOL}://{tmp_path}/tok", timeout=PATIENT) as stage:
        Path(stage.path, "tokenizer.json").write_text("{}")
    assert safeio.verify(f"{PROTOCOL}://{tmp_path}/tok") == []
    assert sorted(os.listdir(tmp_path / "tok")) == [".safeio-manifest.json", "tokenizer.json"]


def _save_loop_on_marker_dirs(*args: Any) -> dict[str, Any]:
    # This module, imported in each rank to find this function, registers the back end there too.
    return _save_loop(*args)


def test_whole_checkpoints_on_ranks_through_the_new_back_end(tmp_path: Path) -> None:
    """Four gloo ranks: DCP shards from every rank, a tokenizer and trainer state written once, committed
    by the marker, ``latest`` and retention, each rank loading what it saved."""
    root = f"{PROTOCOL}://{tmp_path}/run"
    steps = [1, 2, 3]
    results = run_ranks(_save_loop_on_marker_dirs, 4, root, steps, 2, None, timeout=RUN)
    for r in results:
        assert r.value["seen"] == steps and r.value["steps"] == steps[-2:], r
        assert r.value["same_model"] is True and r.value["trainer_state"] == {"step": 3}, r
        assert r.value["tokenizer_version"].endswith("v3"), r
    run = tmp_path / "run"
    assert (run / "latest").read_text() == "step_3"
    # No stage: written in place. The sequence of the last commit beside the pointer.
    assert sorted(os.listdir(run)) == [".checkpoints.safeio.sequence", "latest", "step_2", "step_3"]
    names = os.listdir(run / "step_3")
    assert len([n for n in names if n.endswith(".distcp")]) == 4  # every rank's shard, committed
    assert ".safeio-in-progress" not in names and "tokenizer.json" in names and "trainer_state.pt" in names
    assert safeio.verify(f"{root}/step_3") == []
