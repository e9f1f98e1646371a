"""The generated directory put first on ``PYTHONPATH``: a ``deepspeed`` package and its distribution metadata.

``<dir>/deepspeed/__init__.py`` hands its namespace to :func:`zerospeed.deepspeed_alias.top.install` (the
top-level names and the finder for submodules); ``<dir>/deepspeed-<version>.dist-info/`` is what
``importlib.metadata`` reads for ``deepspeed`` (name, version, the files it owns). The directory is written
whole into a fresh temporary folder and removed by its creator when done, so two runs never share one.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from zerospeed.deepspeed_alias.names import MARKER, alias_version

INIT_SOURCE = f'''"""DeepSpeed's names, served by zerospeed ({MARKER}; generated, do not edit)."""
from zerospeed.deepspeed_alias.top import install as _install
_install(globals())
'''


def _metadata() -> str:
    return (f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {alias_version()}\n"
            f"Summary: zerospeed serving DeepSpeed's module paths ({MARKER}); not DeepSpeed\n"
            "Home-page: https://github.com/zerospeed/zerospeed\nLicense: Apache-2.0\n")


def write(parent: str | None = None) -> str:
    """Create the directory (in a new temporary folder under ``parent``) and return its path."""
    root = tempfile.mkdtemp(prefix="zerospeed-as-deepspeed-", dir=parent)
    try:
        package = os.path.join(root, "deepspeed")
        os.mkdir(package)
        with open(os.path.join(package, "__init__.py"), "w", encoding="utf-8") as f:
            f.write(INIT_SOURCE)
        info = os.path.join(root, f"deepspeed-{alias_version()}.dist-info")
        os.mkdir(info)
        files = {"METADATA": _metadata(), "INSTALLER": f"{MARKER}\n", "top_level.txt": "deepspeed\n"}
        files["RECORD"] = "".join(f"{name},,\n" for name in ["deepspeed/__init__.py"] +
                                  [f"{os.path.basename(info)}/{n}" for n in [*files, "RECORD"]])
        for name, text in files.items():
            with open(os.path.join(info, name), "w", encoding="utf-8") as f:
                f.write(text)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return root


def remove(root: str) -> None:
    shutil.rmtree(root, ignore_errors=True)


__all__ = ["INIT_SOURCE", "remove", "write"]
