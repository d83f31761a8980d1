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
