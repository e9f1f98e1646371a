"""The import graph of src/zerospeed has no cycles, and each package imports only the layers below it (issue #34).

Both checks read the source (``source_tree.py``: an ``ast`` walk, nothing is imported) and count *every* import
statement, function-local ones included: a function-local import still runs, it only hides a cycle from a
module-level reading.

``if TYPE_CHECKING:`` imports: they never run, so they are left out of the cycle check (an annotation-only import
in both directions is not a runtime cycle); they are *kept* in the layer check, since a lower layer that needs an
upper layer's types for its annotations depends on it all the same (pass a Protocol or a lower type instead).
"""

from __future__ import annotations

from collections import defaultdict

from source_tree import Edge, edges, module_path, modules, one_cycle, strongly_connected

#: The layers of DESIGN.md ("Layers"), bottom first. A file may import files of its own unit and of units in lower
#: layers; units that share a layer are siblings and do not import each other. A unit is a package, or one module
#: where named (the longest matching name wins). One line per unit, its comment saying why it sits there.
LAYERS: list[tuple[int, str, str]] = [
    (0, "zerospeed.config", "the schema: DeepSpeed JSON in, frozen typed objects out; the floor everything reads"),
    (0, "zerospeed.accelerator", "DeepSpeed's get_accelerator(): a device abstraction over torch alone"),
    (0, "zerospeed._import_noise", "logging filters for optional dependencies' import-time noise (torchao)"),
    (0, "zerospeed._version", "the version string, for the facade and for checkpoint metadata"),
    (1, "zerospeed.git_version_info", "DeepSpeed's build record (version, compiled ops, torch_info): torch and "
                                      "_version only"),
    (-1, "zerospeed._submodules", "each package's lazy __getattr__ for its submodules (DeepSpeed's attribute chains "
                                 "after the top-level import); importlib only"),
    (0, "zerospeed.arguments", "DeepSpeed's argparse helpers (add_config_arguments), read by the facade"),
    (0, "zerospeed.testing", "the multi-process test harness offered to users: torch.multiprocessing only"),
    (0, "zerospeed.launcher", "torchrun wrapper, hostfile, multi-node set-up: the lowest floor; the commands above it "
                              "register in its table (zerospeed.cli), it imports none of them"),
    (1, "zerospeed.comm", "the one mesh (pp, dp, sp, tp, ep, hosts) and every collective, counted"),
    (2, "zerospeed.ops", "optimizers, async I/O, kernels: their typed config sections in, no process groups"),
    (2, "zerospeed.utils", "DeepSpeed's logging helpers, which filter by rank (comm)"),
    (3, "zerospeed.zero", "ZeRO stages 1-3, zero.Init, offload tiers: sharding over the mesh's dp group"),
    (4, "zerospeed.checkpoint", "checkpoint formats: written from and read into ZeRO's sharded layout"),
    (4, "zerospeed.utils.z3_leaf_module", "DeepSpeed's set_z3_leaf_modules names over ZeRO-3's registry of leaf "
                                         "modules (zero/), so this one module of utils/ sits above zero/"),
    (5, "zerospeed.utils.tensor_fragment", "DeepSpeed's safe_get_full_grad family over the strategies' shards "
                                          "(zero/) and the checkpoint's shard addressing (checkpoint/)"),
    (5, "zerospeed.utils.zero_to_fp32", "DeepSpeed's zero_to_fp32 helper names over checkpoint/'s readers (both "
                                       "layouts), so this one module of utils/ sits above checkpoint/"),
    (5, "zerospeed.profiling", "flops profiler and counters (reads ZeRO-3's registry to see whole parameters)"),
    (5, "zerospeed.monitor", "TensorBoard / CSV / W&B writers and per-step events"),
    (5, "zerospeed.checkpointing", "activation checkpointing (DeepSpeed's deepspeed.checkpointing)"),
    (6, "zerospeed.module_inject", "AutoTP: how a layer is split over the mesh's tp group"),
    (6, "zerospeed.sequence", "Ulysses attention over the mesh's sp group, the SP loss average, ALST's tiled compute"),
    (7, "zerospeed.moe", "mixture of experts: expert layers (split with module_inject, sharded by zero)"),
    (8, "zerospeed.compression", "quantization, pruning, layer reduction of (tensor-parallel) layers"),
    (9, "zerospeed.compile", "torch.compile backend and its graph passes over ZeRO's collectives"),
    (10, "zerospeed.pipe", "PipelineModule, schedules as data, the schedule executor"),
    (11, "zerospeed.runtime", "the Engine: forward, backward, step, checkpoint I/O, composing the layers below"),
    (12, "zerospeed.pipe.engine", "PipelineEngine is an Engine (as DeepSpeed's subclasses DeepSpeedEngine), so this one "
                                  "file of pipe/ sits above runtime/; the rest of pipe/ stays below it"),
    (13, "zerospeed.inference", "inference engine, model families, serving; uses compression for int8 weights"),
    (14, "zerospeed.rl", "RL post-training: rollouts on the live training weights, weight sync to a generator; "
                         "uses runtime/ and inference/, reached by the engine through the facade's engine.rl"),
    (14, "zerospeed.autotuning", "experiments as subprocesses through the launcher"),
    (15, "zerospeed.runtime.initialize", "the facade's initialize(): parses the config once, builds the mesh, "
                                         "dispatches to runtime/ or pipe/ (its module path is public)"),
    (15, "zerospeed.cli", "the command table: `zerospeed serve`, `zerospeed --autotuning` registered for the launcher"),
    (16, "zerospeed", "the package root: DeepSpeed's top-level names, loaded lazily from the facade and below"),
    (17, "zerospeed.integrations", "HuggingFace Trainer integration: builds engines through zerospeed.initialize"),
    (18, "zerospeed.deepspeed_alias", "zerospeed-as-deepspeed: zerospeed under DeepSpeed's package name for other "
                                      "libraries (finder, generated directory, launcher); nothing imports it"),
    (19, "zerospeed.as_deepspeed", "`import zerospeed.as_deepspeed`: switches the alias on in-process at import, so "
                                   "it sits above the alias and nothing (the launcher included) imports it"),
]

_LAYER = {unit: layer for layer, unit, _ in LAYERS}


def unit_of(module: str) -> str:
    """The table's unit of ``module``: the longest unit name that is the module or a package above it."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in _LAYER:
            return candidate
    raise KeyError(module)


def test_table_has_one_line_per_unit() -> None:
    units = [unit for _, unit, _ in LAYERS]
    assert len(units) == len(set(units)), "a unit is listed twice in LAYERS"
    assert all(comment.strip() for _, _, comment in LAYERS)


def test_every_file_has_a_layer() -> None:
    missing = []
    for module in modules():
        try:
            unit_of(module)
        except KeyError:
            missing.append(module_path(module))
    assert not missing, "files of no unit in LAYERS (add their package, with a comment): " + ", ".join(missing)


def _runtime_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for edge in edges():
        if not edge.type_checking:
            graph[edge.source].add(edge.target)
    return graph


def test_no_import_cycles() -> None:
    graph = _runtime_graph()
    by_pair: dict[tuple[str, str], list[Edge]] = defaultdict(list)
    for edge in edges():
        by_pair[edge.source, edge.target].append(edge)
    problems = []
    for component in strongly_connected(graph):
        cycle = one_cycle(graph, component)
        steps = []
        for a, b in zip(cycle, cycle[1:]):
            first = by_pair[a, b][0]
            steps.append(f"{first.where()}{' (in a function)' if first.local else ''} imports {b}")
        problems.append(f"{len(component)} files in a cycle ({', '.join(component)}), e.g. " + "; ".join(steps))
    assert not problems, "import cycles between files of src/zerospeed:\n" + "\n".join(problems)


def test_each_package_imports_only_layers_below() -> None:
    climbs = []
    for edge in edges():
        source, target = unit_of(edge.source), unit_of(edge.target)
        if source == target:
            continue
        if _LAYER[target] >= _LAYER[source]:
            how = "under TYPE_CHECKING, " if edge.type_checking else "in a function, " if edge.local else ""
            relation = "a sibling" if _LAYER[target] == _LAYER[source] else "a higher layer"
            climbs.append(f"{edge.where()}: {source} (layer {_LAYER[source]}) imports {edge.target}, {how}"
                          f"{relation}: {target} (layer {_LAYER[target]})")
    assert not climbs, "imports outside the layering (see LAYERS):\n" + "\n".join(sorted(climbs))
