"""The command-line tools the recipes run (fairseq's, torchrun): found on PATH, or named plainly.

A dry run prints the plan with the tool's bare name when it is missing and says so once; a real
run stops with one line saying how to install it, before any work starts.
"""

import shutil
from typing import Dict, Set

from ..resources import setup_command

INSTALL = {"torchrun": "it comes with torch (pip install torch)"}


def _install(name: str) -> str:
    return INSTALL.get(name) or f"install fairseq with the plugin's fixes: {setup_command()}"


class MissingTool(RuntimeError):
    pass


class Tools:
    """Where each tool is; in a dry run, the missing ones are collected instead of refused."""

    def __init__(self, dry_run: bool = False):
        self.dry_run = dry_run
        self.missing: Set[str] = set()
        self._found: Dict[str, str] = {}

    def __call__(self, name: str) -> str:
        if name not in self._found:
            path = shutil.which(name)
            if path is None:
                if not self.dry_run:
                    raise MissingTool(f"{name} not found on PATH: {_install(name)}")
                self.missing.add(name)
            self._found[name] = path or name
        return self._found[name]

    def report(self) -> str:
        """One line naming the tools a real run would need and not find, or ''."""
        if not self.missing:
            return ""
        names = ", ".join(sorted(self.missing))
        hints = sorted({_install(n) for n in self.missing})
        return f"note: {names} not found on PATH (a real run stops there): {'; '.join(hints)}"
