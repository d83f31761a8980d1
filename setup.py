"""Installs ``safeio-autopatch.pth`` at the top of site-packages, for ``SAFEIO_PATCH=1``.

Everything else about the package is in pyproject.toml. A ``.pth`` file runs at interpreter start-up
only from the top of site-packages, and setuptools has no declarative way to put a file there: a wheel
gets it from ``build_py`` (copied to the build's top level, which is the wheel's root), an editable
install (``pip install -e``) from ``editable_wheel`` (copied into the unpacked wheel's root).
"""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "safeio-autopatch.pth"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "safeio", "_autopatch", PTH)


class BuildWithPth(build_py):
    def run(self):
        super().run()
        if not getattr(self, "editable_mode", False):
            self.copy_file(SOURCE, os.path.join(self.build_lib, PTH), preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if getattr(self, "editable_mode", False):
            return outputs
        return [*outputs, os.path.join(self.build_lib, PTH)]


class EditableWithPth(editable_wheel):
    def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):
        result = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
        shutil.copyfile(SOURCE, os.path.join(unpacked_wheel, PTH))
        return result


setup(cmdclass={"build_py": BuildWithPth, "editable_wheel": EditableWithPth})
