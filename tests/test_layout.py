"""The package's layout is a contract: the public names, the layer order, and no import cycles."""

from __future__ import annotations

import ast
from pathlib import Path

import safeio

PACKAGE = Path(safeio.__file__).parent

# Lowest first; a module may import only from its own layer or the ones before it.
LAYERS: list[tuple[str, ...]] = [
    ("safeio._errors", "safeio._who", "safeio._stalls", "safeio._threads"),
    ("safeio._options",),
    ("safeio._boundary",),
    ("safeio._storage",),
    ("safeio._promotion",),
    ("safeio._coordination",),
    ("safeio._diagnostics",),
    ("safeio._saves",),
    ("safeio._checkpoints",),
    ("safeio._autopatch",),
    ("safeio", "safeio.__main__", "safeio.cli", "safeio.testing", "safeio.integrations"),
]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int:
    best = (-1, -1)  # (length of the matching prefix, layer)
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best[0]:
                best = (len(prefix), index)
    assert best[1] >= 0, f"{module} belongs to no layer: add it to LAYERS"
    return best[1]


def _imports(path: Path) -> set[str]:
    """safeio modules imported at module level (imports inside functions are lazy by design)."""
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("safeio"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("safeio"):
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                is_module = (PACKAGE.parent / (candidate.replace(".", "/") + ".py")).exists() or (
                    PACKAGE.parent / candidate.replace(".", "/")
                ).is_dir()
                found.add(candidate if is_module else node.module)
    return found


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in PACKAGE.rglob("*.py") if "testing" not in p.parts}


def test_public_names_are_pinned() -> None:
    assert safeio.__all__ == [
        "Checkpoint",
        "CheckpointError",
        "Checkpoints",
        "CollectiveInWriterSection",
        "CollectiveMismatch",
        "Group",
        "InvalidOptionError",
        "InvalidTargetError",
        "InvalidTypeError",
        "LockTimeout",
        "PeerTimeout",
        "PromotionError",
        "RemoteWriterError",
        "SafeIOError",
        "Stage",
        "TargetExistsError",
        "UnsafeWriteError",
        "UnsupportedSaveError",
        "__version__",
        "atomic_open",
        "audit",
        "current_group",
        "is_complete",
        "patch_save_pretrained",
        "replicated",
        "save_pretrained",
        "snapshot",
        "torch_save",
        "verify",
        "write_pointer",
        "writer_only_section",
    ]


def test_only_the_documented_modules_look_public() -> None:
    public = sorted(
        p.name for p in PACKAGE.iterdir() if not p.name.startswith(("_", ".")) and p.name != "py.typed"
    )
    assert public == ["cli", "frameworks.py", "integrations", "shares.py", "testing"]


# The outer layer: the framework adapters and the command line are built on the public API (``safeio``,
# ``safeio.frameworks``, ``safeio.shares``), never on private modules, so that the core can be rearranged
# under them. ``safeio._errors`` is the exception: the error tree is public through ``safeio``, and the CLI
# maps it to exit codes without importing the whole package first.
OUTER = ("safeio.integrations", "safeio.cli")
ALLOWED_PRIVATE = {"safeio._errors"}


def _is_private(name: str) -> bool:
    if not name.startswith("safeio.") or name.startswith(OUTER):
        return False  # safeio.integrations._accelerate_files is the outer layer's own: only the core is
    if any(name == allowed or name.startswith(allowed + ".") for allowed in ALLOWED_PRIVATE):
        return False
    return any(part.startswith("_") and not part.startswith("__") for part in name.split(".")[1:])


def _private_imports(tree: ast.AST) -> list[str]:
    """Every private safeio module an ``import``/``from ... import`` anywhere in ``tree`` names (inside
    functions too), every relative import, and every ``importlib.import_module`` of a literal name."""
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            found.append(f"line {node.lineno}: a relative import")  # checked by nothing below: refused
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = (
                [node.module] if _is_private(node.module) else [f"{node.module}.{a.name}" for a in node.names]
            )
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names = [node.args[0].value]
        found.extend(f"line {node.lineno}: {name}" for name in names if _is_private(name))
    return sorted(set(found))


def test_the_outer_layer_uses_only_the_public_api() -> None:
    private = {
        _module_name(path): found
        for path in PACKAGE.rglob("*.py")
        if _module_name(path).startswith(OUTER)
        if (found := _private_imports(ast.parse(path.read_text())))
    }
    assert private == {}


def test_the_outer_layer_check_can_fail() -> None:
    code = (
        "from safeio._storage.dirfd import walk\n"
        "def f():\n    import safeio._promotion.active\n    from safeio._who import who\n"
        "from safeio import _options\n"
        "importlib.import_module('safeio._diagnostics.audit_report')\n"
        "from safeio._errors import SafeIOError\nfrom safeio.integrations._accelerate_files import x\n"
        "from .._x import y\nfrom safeio.frameworks import is_staged\n"
    )
    assert _private_imports(ast.parse(code)) == [
        "line 1: safeio._storage.dirfd",
        "line 3: safeio._promotion.active",
        "line 4: safeio._who",
        "line 5: safeio._options",
        "line 6: safeio._diagnostics.audit_report",
        "line 9: a relative import",
    ]


def test_lower_layers_never_import_upper_ones() -> None:
    upward = [
        f"{module} (layer {_layer(module)}) imports {imported} (layer {_layer(imported)})"
        for module, imports in _graph().items()
        for imported in imports
        if _layer(imported) > _layer(module) and not module.startswith(("safeio.cli", "safeio.testing"))
    ]
    assert upward == []


def test_no_import_cycles() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for imported in sorted(graph.get(module, ())):
            if imported == module or imported not in graph:
                continue
            if state.get(imported) == 1:
                cycles.append([*path[path.index(imported) :], imported] if imported in path else [imported])
            elif imported not in state:
                visit(imported, [*path, imported])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_the_layer_check_can_fail() -> None:
    # The checks above are only worth something if they see imports: a known edge must be found.
    assert "safeio._promotion.base" in _graph()["safeio._promotion.local"]
    assert _layer("safeio._saves.replicated") > _layer("safeio._promotion.resolver")


# Where the kind of a location is decided: the resolver of paths and URLs, and the back ends. Everything
# else asks its back end (fsspec's one filesystem object per protocol, asked, never tested for its kind).
BACKEND_MODULES = {"safeio._storage.location", "safeio._promotion.backends"}
_KIND_CLASSES = {"LocalReader", "ObjectStoreReader", "PosixBackend", "ObjectStoreBackend", "LocalFileSystem"}


def _kind_branches(tree: ast.AST) -> list[str]:
    """``x.is_local``, ``x.fs is (not) None``, ``isinstance(x, <a back end's class>)``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "is_local":
            found.append(f"line {node.lineno}: .is_local")
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            operands = [node.left, *node.comparators]
            tests_fs = any(isinstance(o, ast.Attribute) and o.attr == "fs" for o in operands)
            tests_none = any(isinstance(o, ast.Constant) and o.value is None for o in operands)
            if tests_fs and tests_none:
                found.append(f"line {node.lineno}: .fs is None")
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
            names = (
                {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)} if node.args[1:] else set()
            )
            if names & _KIND_CLASSES:
                found.append(f"line {node.lineno}: isinstance(..., {sorted(names & _KIND_CLASSES)})")
    return found


def test_only_the_back_ends_branch_on_the_kind_of_location() -> None:
    branches = {
        _module_name(path): found
        for path in PACKAGE.rglob("*.py")
        if "testing" not in path.parts and _module_name(path) not in BACKEND_MODULES
        if (found := _kind_branches(ast.parse(path.read_text())))
    }
    assert branches == {}


def test_the_kind_check_can_fail() -> None:
    code = "if location.is_local: pass\nif backend.location.fs is None: pass\nisinstance(r, LocalReader)\n"
    assert len(_kind_branches(ast.parse(code))) == 3
    backends = PACKAGE / "_promotion" / "backends.py"
    assert _kind_branches(ast.parse(backends.read_text()))  # the one place that does branch


def _store_uses(tree: ast.AST) -> list[str]:
    """Every ``<something>.store`` (the group's key-value store) and every ``store.<method>`` call."""
    methods = {"set", "get", "add", "wait", "check", "delete_key", "compare_set", "num_keys"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "store":
            found.append(f"line {node.lineno}: .store")
        elif (
            isinstance(node, ast.Attribute)
            and node.attr in methods
            and isinstance(node.value, ast.Name)
            and node.value.id == "store"
        ):
            found.append(f"line {node.lineno}: store.{node.attr}")
    return found


def test_only_coordination_talks_to_the_store() -> None:
    uses = {
        _module_name(path): found
        for path in PACKAGE.rglob("*.py")
        if "testing" not in path.parts and not _module_name(path).startswith("safeio._coordination")
        if (found := _store_uses(ast.parse(path.read_text())))
    }
    assert uses == {}
    assert _store_uses(ast.parse((PACKAGE / "_coordination" / "calls.py").read_text()))  # it can fail


def test_no_two_classes_share_a_name() -> None:
    where: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(_module_name(path))
    assert {name: modules for name, modules in where.items() if len(modules) > 1} == {}


# Small modules with one job: none longer than this (safeio.testing aside). A module listed in LONGER is
# one another piece of work is shrinking; its line count here may only go down.
MODULE_LINES = 450
LONGER = {"safeio.integrations.transformers": 473}


def test_no_module_is_longer_than_the_rule() -> None:
    lengths = {
        _module_name(path): len(path.read_text().splitlines())
        for path in PACKAGE.rglob("*.py")
        if "testing" not in path.parts
    }
    too_long = {m: n for m, n in lengths.items() if n > max(MODULE_LINES, LONGER.get(m, 0))}
    assert too_long == {}
    assert max(lengths.values()) > 100  # the count sees the modules


def test_a_steps_commit_never_imports_its_roots_storage() -> None:
    # The commit of a step gets what it needs from its root as one object (RootCommit), handed in: it
    # never calls back into the storage that made it (LocalSteps, ObjectSteps), nor picks one.
    graph = _graph()
    storage = {
        "safeio._checkpoints.step_directories",
        "safeio._checkpoints.step_prefixes",
        "safeio._checkpoints.storage",
    }
    assert graph["safeio._checkpoints.step_rename"] & storage == set()
    assert "safeio._checkpoints.steps" in graph["safeio._checkpoints.step_rename"]  # it can fail
    # Back ends know nothing of checkpoints: the checkpoint layer registers the steps of each.
    assert not any(m.startswith("safeio._checkpoints") for m in graph["safeio._promotion.backends"])


def test_back_ends_are_registered_not_found_by_subclassing() -> None:
    tree = ast.parse((PACKAGE / "_promotion" / "backends.py").read_text())
    walks = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "__subclasses__"]
    assert walks == []
    registers = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "register_backend"]
    assert registers  # it can fail: the registry is where the check looks
