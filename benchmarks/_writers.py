"""The single-file writers compared in figure 2, each streaming ``payload`` in 1 MB slices.

Shared by the timing loop and the peak-RSS child process so both measure exactly the same code.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterator

CHUNK = 1 << 20

Writer = Callable[[str, memoryview], None]


def chunks(payload: memoryview) -> Iterator[memoryview]:
    for offset in range(0, len(payload), CHUNK):
        yield payload[offset : offset + CHUNK]


def plain_open(path: str, payload: memoryview) -> None:
    with open(path, "wb") as f:
        for part in chunks(payload):
            f.write(part)


def plain_open_fsync(path: str, payload: memoryview) -> None:
    # Durable but not atomic: a reader (or a crash) can see a truncated file. The reference for cost.
    with open(path, "wb") as f:
        for part in chunks(payload):
            f.write(part)
        f.flush()
        os.fsync(f.fileno())


def safeio_durable(path: str, payload: memoryview) -> None:
    import safeio

    with safeio.atomic_open(path, "wb", durable=True) as f:
        for part in chunks(payload):
            f.write(part)


def safeio_fast(path: str, payload: memoryview) -> None:
    import safeio

    with safeio.atomic_open(path, "wb", durable=False) as f:
        for part in chunks(payload):
            f.write(part)


def atomicwrites_write(path: str, payload: memoryview) -> None:
    # python-atomicwrites: temp file beside the target, fsync file, rename, fsync directory.
    from atomicwrites import atomic_write  # type: ignore[import-untyped]

    with atomic_write(path, mode="wb", overwrite=True) as f:
        for part in chunks(payload):
            f.write(part)


def fsspec_transaction(path: str, payload: memoryview) -> None:
    # fsspec's local transaction: the file is written to tempfile.mkstemp() in $TMPDIR and moved into
    # place with shutil.move on commit; nothing is fsynced.
    import fsspec

    fs = fsspec.filesystem("file")
    with fs.transaction, fs.open(path, "wb") as f:
        for part in chunks(payload):
            f.write(part)


def lightning_buffer(path: str, payload: memoryview) -> None:
    # Lightning's approach (lightning_fabric/utilities/cloud_io.py, `_atomic_save`): serialise the whole
    # checkpoint into a BytesIO (`torch.save(checkpoint, bytesbuffer)`), then write the buffer through
    # an fsspec transaction (`with fs.transaction, fs.open(urlpath, "wb") as f: f.write(buf.getvalue())`).
    # Reimplemented inline (lightning is not a dependency); the BytesIO writes stand in for torch.save.
    import fsspec

    buffer = io.BytesIO()
    for part in chunks(payload):
        buffer.write(part)
    fs = fsspec.filesystem("file")
    with fs.transaction, fs.open(path, "wb") as f:
        f.write(buffer.getvalue())


DURABLE: dict[str, Writer] = {
    "safeio": safeio_durable,
    "atomicwrites": atomicwrites_write,
    "open+fsync (not atomic)": plain_open_fsync,
}
NON_DURABLE: dict[str, Writer] = {
    "safeio durable=False": safeio_fast,
    "fsspec transaction": fsspec_transaction,
    "Lightning (buffer, then write)": lightning_buffer,
    "open (not atomic)": plain_open,
}
ALL: dict[str, Writer] = {**DURABLE, **NON_DURABLE}
# Atomic competitors of safeio at each durability (the non-atomic ones are references only).
ATOMIC_DURABLE = ("atomicwrites",)
ATOMIC_NON_DURABLE = ("fsspec transaction", "Lightning (buffer, then write)")


def make_payload(size: int) -> memoryview:
    # Filled, not calloc'd: untouched zero pages would not count in RSS, and the payload (the state a
    # trainer holds anyway) must be resident before the write starts.
    return memoryview(b"\x5a" * size)
