"""Figure 10 — a checkpoint root's history and retention off the critical path.

History: a commit and ``latest()`` into a root holding a few committed steps against one holding
thousands (``keep=None``: nothing retired), interleaved. ``latest()`` reads the pointer and checks the one
step it names; the commit gives the next sequence number from the root's record: neither lists or reads
the other steps. Retention: a save whose commit retires a large step (``keep=1``; the retired step is
renamed aside under the lock and deleted on a background thread) against one that retires nothing, timed
from entering ``save`` to its return; the deletion is joined (``ckpts.wait()``) outside the timing.
One process on local disk, durable saves of a 1 MB file.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from benchmarks._core import Result, interleave, ratio_row, ratios, scratch

NAME = "history"
PAYLOAD = os.urandom(1 << 20)


def _fill(ckpts: Any, count: int) -> None:
    for step in range(count):
        with ckpts.save(step) as ckpt, open(os.path.join(ckpt.path, "model.bin"), "wb") as f:
            f.write(PAYLOAD[:1024])


def _history(root: str, few: int, many: int, reps: int) -> dict[str, list[float]]:
    import time

    import safeio

    roots = {"few": os.path.join(root, "few"), "many": os.path.join(root, "many")}
    fast = {k: safeio.Checkpoints(r, keep=None, durable=False) for k, r in roots.items()}
    _fill(fast["few"], few)
    _fill(fast["many"], many)
    ckpts = {k: safeio.Checkpoints(r, keep=None) for k, r in roots.items()}
    next_step = {"few": few, "many": many}

    def commit(which: str) -> Any:
        def method() -> float:
            step = next_step[which]
            next_step[which] += 1
            start = time.perf_counter()
            with ckpts[which].save(step) as ckpt, open(os.path.join(ckpt.path, "model.bin"), "wb") as f:
                f.write(PAYLOAD)
            return time.perf_counter() - start

        return method

    def latest(which: str) -> Any:
        def method() -> float:
            start = time.perf_counter()
            found = ckpts[which].latest()
            elapsed = time.perf_counter() - start
            assert found is not None
            assert found.step == next_step[which] - 1, found
            return elapsed

        return method

    methods = {"commit few": commit("few"), "commit many": commit("many")}
    methods.update({"latest few": latest("few"), "latest many": latest("many")})
    return interleave(methods, reps, warmup=2)


def _retention(root: str, retired_mb: int, files: int, reps: int) -> dict[str, list[float]]:
    import time

    import safeio

    retiring = safeio.Checkpoints(os.path.join(root, "retiring"), keep=1)
    keeping = safeio.Checkpoints(os.path.join(root, "keeping"), keep=None)
    chunk = os.urandom(retired_mb * (1 << 20) // files)
    step = {"retiring": 0, "keeping": 0}

    def big(ckpts: Any, which: str) -> None:
        """The step the next timed save retires (or, for ``keeping``, keeps): ``retired_mb`` in files."""
        with ckpts.save(step[which]) as ckpt:
            for i in range(files):
                with open(os.path.join(ckpt.path, f"shard_{i}.bin"), "wb") as f:
                    f.write(chunk)
        step[which] += 1

    def save(ckpts: Any, which: str) -> Any:
        def method() -> float:
            big(ckpts, which)
            ckpts.wait()
            start = time.perf_counter()
            with ckpts.save(step[which]) as ckpt, open(os.path.join(ckpt.path, "model.bin"), "wb") as f:
                f.write(PAYLOAD)
            elapsed = time.perf_counter() - start
            step[which] += 1
            ckpts.wait()  # the retired step's deletion, joined outside the timing
            if which == "keeping":  # by hand, untimed: the disk holds one large step at a time
                shutil.rmtree(os.path.join(root, which, f"step_{step[which] - 2}"))
            return elapsed

        return method

    return interleave({"retiring": save(retiring, "retiring"), "keeping": save(keeping, "keeping")}, reps)


def run(quick: bool, *, disk: str) -> Result:
    few, many = (3, 300) if quick else (3, 3000)
    retired_mb, files = (32, 64) if quick else (1024, 1024)
    reps = 5 if quick else 15
    result = Result(
        NAME,
        "10. Checkpoint history and retention off the critical path",
        __doc__.split("\n\n", 1)[1].strip(),
        params={"steps": [few, many], "retired_mb": retired_mb, "files": files, "reps": reps, "disk": disk},
    )
    with scratch(disk) as root:
        history = _history(root, few, many, reps)
    with scratch(disk) as root:
        retention = _retention(root, retired_mb, files, max(3, reps // 3))
    result.samples = {"history": history, "retention": retention}
    result.rows.append(
        ratio_row(
            f"10. commit with {many} committed steps / with {few}",
            "a durable Checkpoints.save (1 MB) into a root with many committed steps over one with few",
            "≤ 1.2x",
            ratios(history["commit many"], history["commit few"]),
            1.2,
        )
    )
    result.rows.append(
        ratio_row(
            f"10. latest() with {many} committed steps / with {few}",
            "the pointer read and the one step it names checked, whatever the history",
            "≤ 1.2x",
            ratios(history["latest many"], history["latest few"]),
            1.2,
        )
    )
    result.rows.append(
        ratio_row(
            f"10. a save retiring a {retired_mb} MB step ({files} files) / one retiring nothing",
            "time to the save's return: the retired step is renamed aside under the lock and deleted after",
            "≤ 1.1x",
            ratios(retention["retiring"], retention["keeping"]),
            1.1,
        )
    )
    return result
