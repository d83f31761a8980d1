"""Every ```python block of README.md and docs/ runs (tests/_markdown_blocks.py says how), and every
relative link of those pages points at a file that exists.

Examples are written as users write them: they load their model and tokenizer from a local directory,
``my-model/``, which every block finds in its working directory (a tiny Llama and a word-level fast
tokenizer saved with ``save_pretrained``, built once per session: no model hub is reachable here)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests._bounds import PATIENT
from tests._markdown_blocks import ROOT, Block, all_blocks, markdown_files, relative_links

BLOCKS = all_blocks()
TIMEOUT = PATIENT  # a net for a block that hangs; 120 s was exceeded on a loaded machine (issue 37)

# Runs one block: the gloo process group first when the block is marked for ranks, then the block,
# compiled under the Markdown file's name and padded so that a traceback's line is the page's line.
RUNNER = """
import os, sys
path, line, code_file, ranks = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
code = open(code_file, encoding="utf-8").read()
if ranks:
    import datetime
    import torch.distributed as dist
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
try:
    exec(compile("\\n" * line + code, path, "exec"), {"__name__": "__main__"})
finally:
    if ranks:
        dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


MODEL_DIR = "my-model"  # what the examples load, as a user's script loads its base model


@pytest.fixture(scope="session")
def saved_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from safeio.testing import hf_objects

    where = tmp_path_factory.mktemp("model") / MODEL_DIR
    hf_objects.tiny_model().save_pretrained(where)
    hf_objects.fast_tokenizer().save_pretrained(where)
    return where


def _run(block: Block, workdir: Path) -> None:
    code_file = workdir.parent / "block.py"
    code_file.write_text(block.code, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFEIO_PATCH")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    ranks = max(block.ranks, 1)
    port = str(_free_port())
    procs = []
    for rank in range(ranks):
        rank_env = dict(env)
        if block.ranks:
            rank_env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(ranks),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
            )
        argv = [sys.executable, "-c", RUNNER, block.path, str(block.line), str(code_file), str(block.ranks)]
        procs.append(
            subprocess.Popen(
                argv, cwd=workdir, env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=TIMEOUT)
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    failed = [(rank, proc.returncode) for rank, proc in enumerate(procs) if proc.returncode != 0]
    report = "\n".join(f"--- rank {rank} ---\n{out[-4000:]}" for rank, out in enumerate(outputs))
    assert failed == [], f"{block.id} failed on {failed}:\n{report}"


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_example_runs(block: Block, tmp_path: Path, saved_model: Path) -> None:
    assert block.errors == [], "\n".join(block.errors)
    if block.skip is not None:
        pytest.skip(f"{block.id}: {block.skip}")
    if "fuse" in block.needs:
        from safeio.testing.pytest_plugin import require_fuse

        require_fuse()
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    workdir.chmod(0o755)
    shutil.copytree(saved_model, workdir / MODEL_DIR)
    _run(block, workdir)


def test_the_collector_finds_the_examples() -> None:
    files = {b.path for b in BLOCKS}
    assert "README.md" in files and any(f.startswith("docs/") for f in files)
    assert sum(1 for b in BLOCKS if b.ranks) >= 3  # multi-rank blocks run too
    assert all(b.skip for b in BLOCKS if b.skip is not None)  # every skip says why


def test_the_collector_refuses_markers_it_does_not_know(tmp_path: Path) -> None:
    from tests import _markdown_blocks

    page = tmp_path / "probe.md"
    page.write_text(
        "<!-- skip -->\n```python\npass\n```\n\n<!-- ranks: many -->\n```python\npass\n```\n\n"
        "<!-- sikp: typo -->\n```python\npass\n```\n\n<!-- continue -->\n```python\nx = 1\n```\n",
        encoding="utf-8",
    )
    blocks = _markdown_blocks.blocks_of(page)
    assert [len(b.errors) for b in blocks] == [1, 1, 1]  # the continuation joined the third block
    assert "must say why" in blocks[0].errors[0] and "unknown marker" in blocks[2].errors[0]
    assert blocks[2].code == "pass\nx = 1\n"


def test_relative_links_resolve() -> None:
    broken = []
    for page in markdown_files():
        for line, target in relative_links(page):
            file = target.split("#", 1)[0]
            if file and not (page.parent / file).exists():
                broken.append(f"{page.relative_to(ROOT)}:{line}: {target}")
    assert broken == []


def test_every_public_error_is_documented() -> None:
    import safeio

    errors = [
        name
        for name in safeio.__all__
        if isinstance(getattr(safeio, name), type) and issubclass(getattr(safeio, name), safeio.SafeIOError)
    ]
    page = (ROOT / "docs" / "errors.md").read_text(encoding="utf-8")
    assert len(errors) >= 12 and [e for e in errors if f"| `{e}` |" not in page] == []


def test_every_environment_variable_is_documented() -> None:
    import re

    used = set()
    for path in (ROOT / "safeio").rglob("*"):
        if path.suffix in (".py", ".pth"):
            used |= set(re.findall(r"\bSAFEIO_[A-Z_]*[A-Z]\b", path.read_text(encoding="utf-8")))
    page = (ROOT / "docs" / "environment-variables.md").read_text(encoding="utf-8")
    assert "SAFEIO_PATCH" in used and sorted(v for v in used if f"`{v}`" not in page) == []


def test_the_architecture_page_names_every_private_module() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    layout = page[page.index("```\nsafeio/") :]
    layout = layout[: layout.index("```", 4)]
    package = ROOT / "safeio"
    modules = [
        p.relative_to(package).as_posix()
        for p in package.rglob("*.py")
        if p.parts[len(package.parts)] not in ("cli", "testing", "integrations")
        and p.name not in ("__init__.py", "__main__.py")
    ]
    assert len(modules) > 40 and sorted(m for m in modules if m.rsplit("/", 1)[-1] not in layout) == []
