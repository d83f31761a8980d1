"""The built distribution works where nothing of the checkout is: ``python -m build`` makes a wheel and
an sdist, and the wheel installed into a fresh virtual environment gives the ``safeio`` command, an
``import safeio`` that needs no torch, and the ``SAFEIO_PATCH`` start-up hook."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DIST = "safeio_ckpt"  # the distribution's normalised name: "safeio" on the index is another project


def _run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False, **kwargs)  # type: ignore[call-overload]
    assert done.returncode == 0, f"{argv}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # --no-isolation: the build back end (setuptools) comes from this environment, not a download.
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)])
    return out


def test_the_sdist_holds_setup_py_and_the_start_up_hook(built: Path) -> None:
    (sdist,) = built.glob(f"{DIST}-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    assert {"setup.py", "pyproject.toml", "README.md", "safeio/_autopatch/safeio-autopatch.pth"} <= names


def test_the_wheel_installs_into_a_fresh_environment(built: Path, tmp_path: Path) -> None:
    (wheel,) = built.glob(f"{DIST}-*.whl")
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
    assert "safeio-autopatch.pth" in names  # at the wheel's root: the top of site-packages
    assert "safeio/__init__.py" in names and "safeio/py.typed" in names

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    python, script = venv / "bin" / "python", venv / "bin" / "safeio"
    # The dependencies (fsspec, filelock, xxhash) come from the package index or pip's cache; torch does not.
    _run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(wheel)])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SAFEIO_", "PYTHON"))}

    assert "usage: safeio" in _run([str(script), "--help"], env=env).stdout

    probe = (
        "import sys, safeio; print(safeio.__file__); "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, sorted(sys.modules)"
    )
    imported = _run([str(python), "-c", probe], env=env, cwd=tmp_path).stdout
    assert imported.startswith(str(venv)), imported  # the installed wheel, not the checkout
    missing = subprocess.run([str(python), "-c", "import torch"], env=env, capture_output=True, check=False)
    assert missing.returncode != 0  # torch is really absent there: safeio imported without it

    # SAFEIO_PATCH=1 in a new process: the wheel's .pth runs at start-up and the patch is installed when
    # transformers is imported. transformers and torch are borrowed from this environment through
    # PYTHONPATH (a directory there is searched, its .pth files are not run, so safeio stays the wheel's).
    borrowed = {**env, "PYTHONPATH": sysconfig.get_paths()["purelib"], "SAFEIO_PATCH": "1"}
    probe = (
        "import os, transformers, safeio; print(safeio.__file__); "
        "active = os.environ.get('SAFEIO_PATCH_ACTIVE', '').split(':'); "
        "print('active' if active[0] == str(os.getpid()) and 'save_pretrained' in active[-1] else 'inactive')"
    )
    patched = _run([str(python), "-c", probe], env=borrowed, cwd=tmp_path).stdout.split()
    assert patched[0].startswith(str(venv)) and patched[-1] == "active", patched
    unset = {k: v for k, v in borrowed.items() if k != "SAFEIO_PATCH"}
    assert _run([str(python), "-c", probe], env=unset, cwd=tmp_path).stdout.split()[-1] == "inactive"


def _readme_install_lines() -> list[str]:
    """The ``pip install`` lines of the README's Install section, as a user copies them."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Install") :]
    section = section[: section.index("\n## ", 1)]
    start = section.index("```bash") + len("```bash")
    block = section[start : section.index("```", start)]
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.startswith("pip install")]


def test_the_readme_install_lines_install_a_working_safeio(tmp_path: Path) -> None:
    """A new user follows the README: ``pip install .`` in a clone, or the git URL form, into a fresh
    virtual environment; then ``safeio demo`` runs there (torch and transformers borrowed from this
    environment, as a user would have installed them for their platform first)."""
    lines = _readme_install_lines()
    in_clone = next(line for line in lines if line == "pip install .")
    from_git = next(line for line in lines if "git+URL" in line)
    clone = tmp_path / "clone"
    _run(["git", "clone", "-q", str(ROOT), str(clone)])  # what is committed: a user's clone has no .venv
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SAFEIO_", "PYTHON", "VIRTUAL_ENV"))}
    # The git URL form without its extras: torch and transformers are borrowed below, not downloaded.
    for name, line, cwd in (
        ("venv-clone", in_clone, clone),
        ("venv-git", from_git.replace("git+URL", f"git+file://{clone}").replace("[torch,hf]", ""), tmp_path),
    ):
        venv = tmp_path / name
        _run([sys.executable, "-m", "venv", str(venv)])
        # A current pip, as a user's: the one Python 3.11.7 bundles (23.2) refuses a git+file:// URL
        # requirement (its parser wants a host in a non-file scheme).
        _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--upgrade", "pip"], env=env)
        # The line as a shell runs it, the new environment's pip first on PATH (as after `activate`).
        activated = {
            **env,
            "PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
            "VIRTUAL_ENV": str(venv),
        }
        _run(["bash", "-c", f"{line} -q --disable-pip-version-check"], cwd=cwd, env=activated)
        assert "usage: safeio" in _run([str(venv / "bin" / "safeio"), "--help"], env=env).stdout

    borrowed = {**env, "PYTHONPATH": sysconfig.get_paths()["purelib"]}
    venv = tmp_path / "venv-clone"
    probe = [str(venv / "bin" / "python"), "-c", "import safeio; print(safeio.__file__)"]
    where = _run(probe, env=borrowed, cwd=tmp_path)
    assert where.stdout.startswith(str(venv)), where.stdout  # the installed copy, not a checkout
    demo = _run(
        [str(venv / "bin" / "safeio"), "demo", "--ranks", "2", "--iterations", "1", "--local", "--json"],
        env=borrowed,
        cwd=tmp_path,
    )
    assert '"failed_saves": 0' in demo.stdout, demo.stdout
