"""Where the plugin's files are. Those the package reads at run time that live at a checkout's top level: ``configs/``
(the experiment configs) and the kernel sources ``cpu_ext/`` and ``cuda_ext/``.

A wheel ships copies of them inside the package, under ``_resources/`` (``setup.py`` puts them
there), so an installed copy finds them as a checkout (or an editable install) does.
"""

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
SHIPPED = ("configs", "cpu_ext", "cuda_ext")  # top-level folders a wheel carries
_BASES = (PACKAGE_DIR / "_resources", PACKAGE_DIR.parent)  # installed wheel first, then a checkout


def resource_dir(name: str) -> Path:
    """The folder ``name`` (one of ``SHIPPED``) of this installation."""
    if name not in SHIPPED:
        raise ValueError(f"unknown resource folder {name!r}; known: {SHIPPED}")
    for base in _BASES:
        if (base / name).is_dir():
            return base / name
    raise FileNotFoundError(
        f"{name}/ is neither shipped in {_BASES[0]} nor beside the package in {_BASES[1]}: "
        "reinstall the plugin (pip install fairseq-multiscale-plugins, or pip install . from a checkout)")


def user_dir() -> Path:
    """The folder to pass to fairseq's ``--user-dir``: this package."""
    return PACKAGE_DIR


def cache_root() -> Path:
    """The per-user cache of what the plugin builds: compiled kernels, the fixed fairseq wheel."""
    return Path(os.environ.get("FAIRSEQ_PLUGINS_CACHE", Path.home() / ".cache" / "fairseq_plugins"))
