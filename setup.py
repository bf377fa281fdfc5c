"""Wheel builds copy the top-level folders that the package reads at run time (``configs/``,
``cpu_ext/``, ``cuda_ext/``; see ``fairseq_plugins/resources.py``) into the package, under
``fairseq_plugins/_resources/``. Everything else is in ``pyproject.toml``."""

import runpy
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
SHIPPED = runpy.run_path(str(ROOT / "fairseq_plugins" / "resources.py"))["SHIPPED"]


class BuildPyWithResources(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads them from the checkout
        target = Path(self.build_lib) / "fairseq_plugins" / "_resources"
        for name in SHIPPED:
            shutil.copytree(ROOT / name, target / name, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.o"))


setup(cmdclass={"build_py": BuildPyWithResources})
