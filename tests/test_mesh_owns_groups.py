"""Every process group comes from the one mesh (issue #34): outside ``src/zerospeed/comm/`` no file creates one.

An ``ast`` walk of ``src/zerospeed`` (``source_tree.py``; nothing is imported) flags every call of ``new_group``,
``new_subgroups`` or ``init_device_mesh`` (a bare name or any attribute: ``dist.new_group``, ``comm.new_group``,
``torch.distributed.device_mesh.init_device_mesh``) and every import of those names, in any file outside the comm
package. A group a layer needs beside the mesh's axes is asked of the mesh (``Mesh.subgroups``: created on first
use, cached, in the same order on every rank), so the creation order that keeps ranks from hanging lives in one place.
"""
from __future__ import annotations

import ast

from source_tree import PACKAGE, module_path, modules, tree

#: The group-creating functions of torch.distributed.
CREATORS = frozenset({"new_group", "new_subgroups", "new_subgroups_by_enumeration", "init_device_mesh"})

#: Where groups may be created: the comm package (the mesh and the wrappers it uses).
OWNER = f"{PACKAGE}.comm"

#: ``"module:line" -> reason`` for a creation that must stay outside the comm package. Empty: none does.
ALLOWED: dict[str, str] = {}


def _creations(module: str) -> list[str]:
    found = []
    for node in ast.walk(tree(module)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if name in CREATORS:
                found.append(f"{module_path(module)}:{node.lineno} calls {name}")
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name in CREATORS:
                    found.append(f"{module_path(module)}:{node.lineno} imports {alias.name}")
    return found


def _outside_comm(module: str) -> bool:
    return module != OWNER and not module.startswith(OWNER + ".")


def test_no_group_is_created_outside_the_mesh():
    offenders = []
    for module in modules():
        if not _outside_comm(module):
            continue
        for hit in _creations(module):
            location = hit.split(" ", 1)[0]
            if location not in ALLOWED:
                offenders.append(hit)
    assert not offenders, ("process groups must come from the mesh (zerospeed.comm.Mesh.subgroups or an axis "
                           "group), not be created here:\n" + "\n".join(offenders))


def test_allowlist_entries_still_exist_and_give_a_reason():
    hits = {hit.split(" ", 1)[0] for module in modules() if _outside_comm(module) for hit in _creations(module)}
    for location, reason in ALLOWED.items():
        assert reason.strip(), f"{location}: an allowlisted creation needs a reason"
        assert location in hits, f"{location}: allowlisted but creates no group any more; remove the entry"


def test_the_walk_sees_the_comm_package_creations():
    """The check is not vacuous: the mesh's own creations are found by the same walk."""
    inside = [hit for module in modules() if not _outside_comm(module) for hit in _creations(module)]
    assert any(hit.startswith("src/zerospeed/comm/mesh.py:") and "new_group" in hit for hit in inside), inside
