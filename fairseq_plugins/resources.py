"""Where the plugin's files are. Those the package reads at run time that live at a checkout's top level: ``configs/``
(the experiment configs) and the kernel sources ``cpu_ext/`` and ``cuda_ext/``.

A wheel ships copies of them inside the package, under ``_resources/`` (``setup.py`` puts them
there), so an installed copy finds them as a checkout (or an editable install) does.

Whether this copy runs from a clone or from an installed wheel also decides which commands
exist to repair it, so the messages that name one ask here (``setup_command``, ``extra_command``).
"""

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
SHIPPED = ("configs", "cpu_ext", "cuda_ext")  # top-level folders a wheel carries
_BASES = (PACKAGE_DIR / "_resources", PACKAGE_DIR.parent)  # installed wheel first, then a checkout
PROJECT = "fairseq-multiscale-plugins"  # the name pip knows the plugin by (pyproject.toml)


def resource_dir(name: str) -> Path:
    """The folder ``name`` (one of ``SHIPPED``) of this installation."""
    if name not in SHIPPED:
        raise ValueError(f"unknown resource folder {name!r}; known: {SHIPPED}")
    for base in _BASES:
        if (base / name).is_dir():
            return base / name
    raise FileNotFoundError(
        f"{name}/ is neither shipped in {_BASES[0]} nor beside the package in {_BASES[1]}: "
        "reinstall the plugin from its clone: pip install . (nothing is published on PyPI)")


def user_dir() -> Path:
    """The folder to pass to fairseq's ``--user-dir``: this package."""
    return PACKAGE_DIR


def cache_root() -> Path:
    """The per-user cache of what the plugin builds: compiled kernels, the fixed fairseq wheel."""
    return Path(os.environ.get("FAIRSEQ_PLUGINS_CACHE", Path.home() / ".cache" / "fairseq_plugins"))


def in_clone() -> bool:
    """This copy runs from a clone of the repository (editable install or PYTHONPATH), whose
    ``scripts/`` sit beside the package; an installed wheel has none of them."""
    return (PACKAGE_DIR.parent / "scripts" / "setup.sh").is_file()


def setup_command() -> str:
    """The command that installs the fixed fairseq (and, in a clone, all the rest) for this copy."""
    return f"bash {PACKAGE_DIR.parent / 'scripts' / 'setup.sh'}" if in_clone() else "fairseq-plugins-install-fairseq"


def extra_command(extra: str) -> str:
    """The pip command that adds the optional dependencies ``extra`` to this copy: by the clone's
    path in a clone; by the project's name in an install (pip then keeps the installed plugin and
    fetches only the extra's packages)."""
    if in_clone():
        return f'pip install -e "{PACKAGE_DIR.parent}[{extra}]"'
    return f'pip install "{PROJECT}[{extra}]"'

