"""Who this process is in the job: rank, world size, the writer, and the key-value store peers share.

The writer's outcome is *published* through the store rather than agreed through a collective: code
that already guards its save with "rank 0 only" would otherwise leave rank 0 in a barrier nobody else
enters. A group without a store (``RANK``/``WORLD_SIZE`` from a launcher, no process group) can only
learn the outcome from the filesystem.
"""

from __future__ import annotations

import hashlib
import os
import socket
import sys
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

from safeio._errors import InvalidOptionError, InvalidTypeError


@runtime_checkable
class Store(Protocol):
    """The subset of ``torch.distributed.Store`` safeio uses (TCPStore, FileStore, PrefixStore, ...)."""

    def set(self, key: str, value: str | bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def add(self, key: str, value: int) -> int: ...
    def check(self, keys: list[str]) -> bool: ...
    def wait(self, keys: list[str], timeout: timedelta) -> None: ...
    def delete_key(self, key: str) -> bool: ...


class Group:
    """A set of ranks that save together. Rank ``writer`` (default 0) writes; the others wait for it."""

    def __init__(
        self,
        rank: int = 0,
        world_size: int = 1,
        *,
        store: Store | None = None,
        writer: int = 0,
        name: str = "",
    ) -> None:
        for label, value in (("rank", rank), ("world_size", world_size), ("writer", writer)):
            if isinstance(value, bool) or not isinstance(value, int):  # "0" from an environment variable
                raise InvalidTypeError(f"{label} must be an int, got {type(value).__name__} {value!r}", None)
        if world_size < 1:
            raise InvalidOptionError(f"world_size must be >= 1, got {world_size}", None)
        if not 0 <= rank < world_size:
            raise InvalidOptionError(f"rank {rank} is outside a world of size {world_size}", None)
        if not 0 <= writer < world_size:
            raise InvalidOptionError(f"writer {writer} is outside a world of size {world_size}", None)
        self.rank = rank
        self.world_size = world_size
        self.store = store
        self.writer = writer
        self.is_writer = rank == writer  # read on every step of a save: a field, not a property
        self.name = name
        self.host = socket.gethostname()

    def with_writer(self, writer: int) -> Group:
        """The same group with another writer rank."""
        if writer == self.writer:
            return self
        return Group(self.rank, self.world_size, store=self.store, writer=writer, name=self.name)

    def for_another_thread(self) -> Group:
        """The same group with its own connection to the store, for a background thread: a TCPStore
        client serialises its requests, so a long ``wait`` on one thread would hold up every other
        thread's store calls (the training thread's next save)."""
        clone = getattr(self.store, "clone", None)
        if clone is None:
            return self
        return Group(self.rank, self.world_size, store=clone(), writer=self.writer, name=self.name)

    def __repr__(self) -> str:
        store = type(self.store).__name__ if self.store is not None else "no store"
        return f"Group(rank={self.rank}, world_size={self.world_size}, writer={self.writer}, {store})"


def _torch_distributed() -> Any:
    """torch.distributed if torch is already imported and a default process group exists, else None."""
    if "torch" not in sys.modules:  # never import torch just to find out there is no group
        return None
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def from_process_group(process_group: Any = None) -> Group:
    """A Group for a torch.distributed process group (default: the default group)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        raise InvalidOptionError(
            "group: torch.distributed is not initialized: call init_process_group first", None
        )
    store: Any = c10d._get_default_store()
    rank = dist.get_rank(process_group)
    world_size = dist.get_world_size(process_group)
    name = "world"
    if process_group is not None and process_group is not dist.group.WORLD:
        # Distinct subgroups must not read each other's keys.
        members = ",".join(map(str, dist.get_process_group_ranks(process_group)))
        name = "pg-" + hashlib.sha256(members.encode()).hexdigest()[:12]
        store = c10d.PrefixStore(f"safeio/{name}/", store)
    return Group(rank, world_size, store=store, name=name)


def from_environment(environ: dict[str, str] | None = None) -> Group | None:
    """A store-less Group from launcher variables (torchrun, SLURM, Ray conventions), or None."""
    env = os.environ if environ is None else environ
    for rank_var, size_var in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        if rank_var in env and size_var in env:
            try:
                rank, size = int(env[rank_var]), int(env[size_var])
            except ValueError:
                raise InvalidOptionError(
                    f"cannot read the group from {rank_var}={env[rank_var]!r} {size_var}={env[size_var]!r}",
                    None,
                ) from None
            return Group(rank, size, name="env")
    return None


def current_group() -> Group:
    """The group safeio uses when ``group=None``: torch.distributed's default group, the launcher's
    environment, or a single process."""
    if _torch_distributed() is not None:
        return from_process_group()
    return from_environment() or Group()


def resolve_group(group: Any) -> Group:
    if group is None:
        return current_group()
    if isinstance(group, Group):
        return group
    if type(group).__name__ == "ProcessGroup":
        return from_process_group(group)
    raise InvalidOptionError(
        f"group must be a safeio.Group, a torch ProcessGroup or None, got {type(group).__name__}", None
    )


def job_id(environ: dict[str, str] | None = None) -> str:
    """An identifier every rank of this job shares, used to match a promoted target to this save."""
    env = os.environ if environ is None else environ
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "RAY_JOB_ID"):
        if env.get(var):
            return env[var]
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    return ""
