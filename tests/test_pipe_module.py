"""PipelineModule, LayerSpec/TiedLayerSpec, partitioning and the pipe x data topology (no processes)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from zerospeed.pipe import (
    LayerSpec,
    PipeDataParallelTopology,
    PipelineModule,
    PipeTopology,
    ProcessTopology,
    TiedLayerSpec,
    partition_balanced,
    partition_layers,
    partition_uniform,
)
from zerospeed.pipe.partition import count_layer_parameters


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


CONSTRUCTED: list[torch.device] = []


class Recorder(nn.Module):
    """Records the device of the parameter each construction creates."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(numel))
        CONSTRUCTED.append(self.weight.device)

    def forward(self, x):
        return x


def reshape(x):
    return x.reshape(x.shape[0], -1)


# --------------------------------------------------------------------------- partitioning
def test_uniform_gives_remainder_to_first_stages():
    assert partition_uniform(10, 4) == [0, 3, 6, 8, 10]
    assert partition_layers([reshape] * 10, 4, "uniform") == [0, 3, 6, 8, 10]
    assert partition_layers([reshape] * 3, 3, "Uniform") == [0, 1, 2, 3]


def test_parameters_balances_uneven_layers():
    layers = [LayerSpec(nn.Linear, 100, 100)] + [LayerSpec(nn.Linear, 10, 10) for _ in range(9)]
    # one layer of 10,100 parameters against nine of 110: it gets a stage of its own
    assert partition_layers(layers, 2, "parameters") == [0, 1, 10]
    assert partition_layers(layers, 2, "uniform") == [0, 5, 10]
    mixed = [nn.Linear(10, 10), reshape, LayerSpec(nn.Linear, 30, 30), nn.Linear(10, 10), nn.Linear(10, 10)]
    # weights 110, 0, 930, 110, 110: the big layer is alone, the zero-weight reshape rides along
    assert partition_layers(mixed, 3, "parameters") == [0, 2, 3, 5]


def test_parameters_counts_only_trainable():
    frozen = nn.Linear(4, 4)
    frozen.bias.requires_grad_(False)
    assert count_layer_parameters(frozen) == 16
    assert count_layer_parameters(reshape) == 0
    assert count_layer_parameters(LayerSpec(nn.Linear, 4, 4, bias=False)) == 16


def test_parameter_counting_builds_on_meta_only():
    CONSTRUCTED.clear()
    specs = [LayerSpec(Recorder, 1_000), LayerSpec(Recorder, 3_000), LayerSpec(Recorder, 1_000),
             LayerSpec(Recorder, 2_000)]
    assert partition_layers(specs, 2, "parameters") == [0, 2, 4]
    assert len(CONSTRUCTED) == 4
    assert all(device.type == "meta" for device in CONSTRUCTED)


def test_type_regex_balances_matching_layers():
    layers = ([LayerSpec(nn.Embedding, 10, 8)] + [LayerSpec(Block, 8) for _ in range(4)]
              + [LayerSpec(nn.LayerNorm, 8), LayerSpec(nn.Linear, 8, 10)])
    assert partition_layers(layers, 2, "type:block") == [0, 3, 7]
    assert partition_layers(layers, 4, "type:Block") == [0, 2, 3, 4, 7]
    # one match per stage; DeepSpeed puts the boundary at the latest tie
    assert partition_layers(layers, 2, "type:^(Embedding|Linear)$") == [0, 6, 7]  # as DeepSpeed 0.19.8


def test_balanced_breaks_ties_as_deepspeed():
    # DeepSpeed 0.19.8's partition_balanced gives these (see tests/test_compat_pipe.py)
    assert partition_balanced([1] * 10, 4) == [0, 3, 6, 8, 10]
    assert partition_balanced([0] * 6, 3) == [0, 4, 5, 6]
    assert partition_balanced([10] + [1] * 8 + [10], 3) == [0, 1, 9, 10]


def test_explicit_boundaries():
    layers = [reshape] * 5
    assert partition_layers(layers, 2, [0, 2, 5]) == [0, 2, 5]
    assert partition_layers(layers, 2, (0, 4, 5)) == [0, 4, 5]


@pytest.mark.parametrize(
    "num_stages, method, message",
    [
        (6, "uniform", "num_stages: 6 stages for 5 layers"),
        (0, "uniform", "num_stages"),
        (2, "profile", "partition_method: 'profile' is not one of"),
        (2, "type:Attention", "partition_method: 'type:Attention' matches no layer"),
        (2, "type:(", "partition_method: bad regex"),
        (2, [0, 3, 2, 5], "partition_method"),
        (2, [0, 3, 3], "partition_method: .*boundaries"),
        (2, [0, 3, 5, 5], "partition_method: 2 stages need 3 boundaries"),
        (2, [1, 3, 5], "partition_method: boundaries must start at 0 and end at 5"),
        (2, [0, 2, 4], "partition_method: boundaries must start at 0 and end at 5"),
        (2, [0, 2.5, 5], "partition_method: boundaries must be ints"),
        (2, [0, 3, 2], "strictly increasing"),
        (2, 7, "partition_method"),
    ],
)
def test_partition_errors(num_stages, method, message):
    layers = [reshape, nn.Linear(2, 2), reshape, nn.Linear(2, 2), reshape]
    if method == [0, 3, 2]:
        layers = layers[:2]
    with pytest.raises(ValueError, match=message):
        partition_layers(layers, num_stages, method)


# --------------------------------------------------------------------------- topology
def test_pipe_topology_matches_deepspeed_layout():
    topo = PipeTopology(num_pp=2, num_dp=3)
    assert topo.get_axis_names() == ["pipe", "data"]
    assert topo.world_size() == 6
    assert [topo.get_rank(pipe=p, data=d) for p in range(2) for d in range(3)] == list(range(6))
    assert topo.get_rank(pipe=1, data=2) == 5
    assert topo.get_coord(4) == (1, 1) and topo.get_coord(4).pipe == 1 and topo.stage_of(4) == 1
    assert topo.dp_rank_of(4) == 1
    assert topo.pipe_groups() == [[0, 3], [1, 4], [2, 5]]
    assert topo.data_groups() == [[0, 1, 2], [3, 4, 5]]
    assert topo.get_axis_list("pipe", 1) == [3, 4, 5]
    assert topo.filter_match(data=0) == [0, 3]
    assert PipeDataParallelTopology is PipeTopology
    assert PipeTopology.from_world_size(8, 4).num_dp == 2


def test_general_topology_and_errors():
    topo = ProcessTopology(axes=["x", "y"], dims=[2, 3])
    assert topo.get_axis_list("x", 0) == [0, 1, 2]
    assert topo.get_axis_list("y", 0) == [0, 3]
    with pytest.raises(ValueError, match="num_pp: world size 6 is not divisible by 4"):
        PipeTopology.from_world_size(6, 4)
    with pytest.raises(ValueError, match="num_dp"):
        PipeTopology(2, 0)
    with pytest.raises(ValueError, match="axis: 'model'"):
        topo.get_axis_comm_lists("model")
    with pytest.raises(ValueError, match="rank"):
        topo.get_coord(6)
    with pytest.raises(ValueError, match="coord"):
        topo.get_rank(x=0)


# --------------------------------------------------------------------------- PipelineModule
VOCAB, WIDTH = 16, 8


def lm_head(embedding: nn.Embedding, x):
    return x @ embedding.weight.t()


def gpt_like_layers():
    return [
        TiedLayerSpec("embed", nn.Embedding, VOCAB, WIDTH),
        LayerSpec(Block, WIDTH),
        nn.GELU(),
        LayerSpec(nn.Linear, WIDTH, WIDTH),
        lambda x: x * 2,
        LayerSpec(nn.LayerNorm, WIDTH),
        TiedLayerSpec("embed", nn.Embedding, VOCAB, WIDTH, forward_fn=lm_head),
    ]


def reference_model(layers, base_seed=1234):
    """The same network built in one piece, each layer seeded as seed_layers does."""
    built = {}
    modules = []
    for index, layer in enumerate(layers):
        if isinstance(layer, TiedLayerSpec):
            if layer.key not in built:
                torch.manual_seed(base_seed + index)
                built[layer.key] = layer.build()
            module = built[layer.key]
            modules.append(module if layer.forward_fn is None else
                           (lambda m, fn: (lambda x: fn(m, x)))(module, layer.forward_fn))
        elif isinstance(layer, LayerSpec):
            torch.manual_seed(base_seed + index)
            modules.append(layer.build())
        else:
            modules.append(layer)

    class Reference(nn.Module):
        def __init__(self):
            super().__init__()
            self.mods = nn.ModuleList([m for m in modules if isinstance(m, nn.Module)])

        def forward(self, x):
            for m in modules:
                x = m(x)
            return x

    return Reference(), built


def build_stages(layers, num_stages, **kwargs):
    return [PipelineModule(layers, num_stages=num_stages, seed_layers=True, stage_id=s, **kwargs)
            for s in range(num_stages)]


def run_chain(stages, x):
    for stage in stages:
        x = stage(x)
    return x


@pytest.mark.parametrize("num_stages", [1, 2, 3, 7])
def test_stages_chained_equal_the_whole_model(num_stages):
    layers = gpt_like_layers()
    tokens = torch.randint(0, VOCAB, (4, 5))
    stages = build_stages(layers, num_stages, partition_method="uniform")
    reference, _ = reference_model(layers)
    assert torch.equal(run_chain(stages, tokens), reference(tokens))


@pytest.mark.parametrize("method", ["parameters", "uniform", "type:Linear", [0, 1, 4, 6]])
def test_stages_chained_equal_nn_sequential(method):
    specs = [LayerSpec(nn.Linear, 6, 32), LayerSpec(nn.ReLU), LayerSpec(nn.Linear, 32, 32),
             LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 32, 4), LayerSpec(nn.LogSoftmax, dim=-1)]
    sequential = []
    for index, spec in enumerate(specs):
        torch.manual_seed(1234 + index)
        sequential.append(spec.build())
    sequential = nn.Sequential(*sequential)
    stages = build_stages(specs, 3, partition_method=method)
    assert sum(len(s.local_layer_indices) for s in stages) == len(specs)
    x = torch.randn(5, 6)
    assert torch.equal(run_chain(stages, x), sequential(x))
    # module instances are used as given, no seeding involved
    shared = list(sequential)
    instance_stages = [PipelineModule(shared, num_stages=3, stage_id=s, partition_method=method)
                       for s in range(3)]
    assert torch.equal(run_chain(instance_stages, x), sequential(x))


def test_stage_builds_only_its_layers_with_global_names():
    layers = gpt_like_layers()
    stages = build_stages(layers, 3, partition_method="uniform")
    assert [s.parts for s in stages] == [[0, 3, 5, 7]] * 3
    assert stages[1].local_layer_indices == [3, 4]
    assert sorted(stages[1].state_dict()) == ["3.bias", "3.weight"]
    assert sorted(stages[2].state_dict()) == ["5.bias", "5.weight", "tied_modules.embed.weight"]
    assert stages[0].tied_stages == {"embed": [0, 2]}
    assert sorted(stages[0].tied_weights) == ["embed"] and stages[1].tied_weights == {}
    assert stages[2].tied_parameters("embed") == [stages[2].tied_modules["embed"].weight]
    assert [s.stage_of_layer(i) for s in stages[:1] for i in range(7)] == [0, 0, 0, 1, 1, 2, 2]
    # both owners of the tied embedding start from identical weights
    assert torch.equal(stages[0].tied_modules["embed"].weight, stages[2].tied_modules["embed"].weight)
    with pytest.raises(ValueError, match="key: 'embed' is not tied on stage 1"):
        stages[1].tied_parameters("embed")


def test_tied_gradients_sum_to_the_reference_gradient():
    layers = gpt_like_layers()
    tokens = torch.randint(0, VOCAB, (4, 5))
    stages = build_stages(layers, 3, partition_method="uniform")
    reference, built = reference_model(layers)
    run_chain(stages, tokens).square().mean().backward()
    reference(tokens).square().mean().backward()
    summed = stages[0].tied_parameters("embed")[0].grad + stages[2].tied_parameters("embed")[0].grad
    torch.testing.assert_close(summed, built["embed"].weight.grad, rtol=1e-6, atol=1e-7)


def test_single_process_stage_building_allocates_only_local_layers():
    CONSTRUCTED.clear()
    layers = [LayerSpec(Recorder, 10) for _ in range(6)]
    module = PipelineModule(layers, num_stages=3, stage_id=1)  # "parameters" counts on meta
    real = [d for d in CONSTRUCTED if d.type != "meta"]
    assert len(real) == 2 and module.local_layer_indices == [2, 3]


def test_activation_checkpointing_recomputes_and_matches():
    calls = {"n": 0}

    class Counting(Block):
        def forward(self, x):
            calls["n"] += 1
            return super().forward(x)

    layers = [LayerSpec(Counting, WIDTH) for _ in range(4)] + [reshape]
    x = torch.randn(3, WIDTH)
    plain = PipelineModule(layers, num_stages=1, seed_layers=True)
    ckpt = PipelineModule(layers, num_stages=1, seed_layers=True, activation_checkpoint_interval=2)
    out_plain = plain(x)
    out_plain.sum().backward()
    calls["n"] = 0
    out_ckpt = ckpt(x)
    out_ckpt.sum().backward()
    assert calls["n"] == 8  # 4 forwards + 4 recomputed in backward
    assert torch.equal(out_plain, out_ckpt)
    for (name, p), (_, q) in zip(plain.named_parameters(), ckpt.named_parameters()):
        assert torch.equal(p.grad, q.grad), name
    with torch.no_grad():
        calls["n"] = 0
        ckpt(x)
        assert calls["n"] == 4


def test_checkpointable_layers_restricts_checkpointing():
    seen = []

    def spy(function, *args):
        seen.append(len(args))
        return function(*args)

    layers = [LayerSpec(Block, WIDTH), LayerSpec(nn.Linear, WIDTH, WIDTH), reshape]
    module = PipelineModule(layers, num_stages=1, activation_checkpoint_interval=1,
                            activation_checkpoint_func=spy, checkpointable_layers=["Block"])
    module(torch.randn(2, WIDTH, requires_grad=True))
    assert seen == [1]  # only the Block chunk; Linear is not listed, reshape has no parameters


def test_topology_argument_and_loss_fn():
    loss = nn.MSELoss()
    module = PipelineModule([nn.Linear(2, 2) for _ in range(4)], topology=PipeTopology(2, 1),
                            loss_fn=loss, stage_id=1)
    assert module.num_stages == 2 and module.topology().get_dim("pipe") == 2
    assert module.loss_fn is loss and module.local_layer_indices == [2, 3]
    virtual = PipelineModule([nn.Linear(2, 2) for _ in range(4)], num_stages=4,
                             topology=PipeTopology(2, 1), stage_id=3)
    assert virtual.local_layer_indices == [3]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_stages=None), "num_stages: give num_stages or topology"),
        (dict(num_stages=2), "stage_id: required"),
        (dict(num_stages=2, stage_id=2), r"stage_id: must be in \[0, 2\)"),
        (dict(num_stages=0, stage_id=0), "num_stages"),
        (dict(num_stages=5, stage_id=0), "num_stages: 5 stages for 4 layers"),
        (dict(num_stages=3, topology=PipeTopology(2, 1), stage_id=0), "num_stages: 3 is not a multiple"),
        (dict(topology="2x1", stage_id=0), "topology"),
        (dict(num_stages=1, activation_checkpoint_interval=-1), "activation_checkpoint_interval"),
        (dict(num_stages=1, partition_method="profile"), "partition_method"),
    ],
)
def test_pipeline_module_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PipelineModule([nn.Linear(2, 2) for _ in range(4)], **kwargs)


def test_bad_layers_are_rejected():
    with pytest.raises(ValueError, match=r"layers\[1\]: expected an nn.Module"):
        PipelineModule([nn.Linear(2, 2), 42], num_stages=1)
    with pytest.raises(ValueError, match="layers: the list of layers is empty"):
        PipelineModule([], num_stages=1)
    with pytest.raises(ValueError, match=r"layers\[1\]: tied key 'w' is a Linear"):
        PipelineModule([TiedLayerSpec("w", nn.Linear, 2, 2), TiedLayerSpec("w", nn.Embedding, 2, 2)],
                       num_stages=1)
    with pytest.raises(ValueError, match="typename"):
        LayerSpec(len)
    with pytest.raises(ValueError, match="key"):
        TiedLayerSpec("a.b", nn.Linear, 2, 2)
    with pytest.raises(ValueError, match="tied_weight_attr"):
        TiedLayerSpec("a", nn.Linear, 2, 2, tied_weight_attr=[])


def test_layer_spec_build_and_repr():
    spec = LayerSpec(nn.Linear, 3, 4, bias=False)
    layer = spec.build()
    assert isinstance(layer, nn.Linear) and layer.bias is None
    assert repr(spec) == "LayerSpec(Linear(3, 4, bias=False))"
    tied = TiedLayerSpec("emb", nn.Embedding, 5, 2, tied_weight_attr=["weight"])
    assert repr(tied) == "TiedLayerSpec(key='emb', Embedding(5, 2))"
    with torch.device("meta"):
        assert spec.build().weight.is_meta
