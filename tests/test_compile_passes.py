"""DeepCompile's graph passes on small FX graphs, without processes: gather/release placement,
prefetch within a memory limit, selective unsharding by cost per byte, reductions placed right
after their last gradient, ZeRO-1/2 gradient outputs routed to the reducer, and backend_fn running
passes over the forward and backward graphs. A local owner stands in for an engine's buckets."""


import pytest
import torch
from torch.fx import Graph, GraphModule
from torch.utils.checkpoint import CheckpointPolicy

from zerospeed.compile import ops
from zerospeed.compile.backend import backend_fn, run_passes
from zerospeed.compile.zero_passes import (Candidate, Profile, async_reduce, choose_unsharded, coalesce, gather_release,
                                           insert_reduce_grads, live_bytes, prefetch, reduce_early, tag_recompute)

SHAPES = {0: [(4, 5)], 1: [(5, 2)], 2: [(2, 2)]}


class LocalOwner:
    """Buckets of one parameter each; the 'shard' is the whole flat parameter (world of one)."""

    def __init__(self):
        self.log = []

    def full_numel(self, b):
        return torch.Size(SHAPES[b][0]).numel()

    def shard_numel_dtype(self, b):
        return sum(torch.Size(s).numel() for s in SHAPES[b]), torch.float32

    def gather_start(self, shards, buckets):
        self.log.append(("start", *buckets))

    def gather(self, shard, b):
        self.log.append(("gather", b))
        return shard.reshape(-1).clone()

    def reduce_bucket(self, grads, b):
        self.log.append(("reduce", b))
        return torch.cat([g.reshape(-1) for g in grads])

    def reduce_start(self, grads, buckets):
        self.log.append(("reduce_start", *buckets))
        self.started = getattr(self, "started", {})
        if len(buckets) == 1:
            grads = [torch.cat([g.reshape(-1) for g in grads])]
        for b, g in zip(buckets, grads):
            self.started[b] = g.reshape(-1).clone()

    def reduce_wait(self, b):
        self.log.append(("reduce_wait", b))
        return self.started.pop(b)

    def reduce_grads(self, grads, params):
        self.log.append(("reduce_grads", tuple(params)))


OWNER = LocalOwner()
KEY = ops.register_owner(OWNER)


def three_layer_graph() -> GraphModule:
    """x -> relu(x @ w0) -> @ w1 -> @ w2 with all gathers at the top (as aot_autograd traces them); each
    weight is a view of its bucket's flat gathered buffer."""
    g = Graph()
    x = g.placeholder("x")
    shards = [g.placeholder(f"shard{i}") for i in range(3)]
    ws = []
    for i, s in enumerate(shards):
        gathered = g.call_function(ops.GATHER, (s, KEY, i))
        ws.append(g.call_function(torch.ops.aten.view.default, (gathered, list(SHAPES[i][0]))))
    h = g.call_function(torch.ops.aten.mm.default, (x, ws[0]))
    h = g.call_function(torch.ops.aten.relu.default, (h,))
    h = g.call_function(torch.ops.aten.mm.default, (h, ws[1]))
    h = g.call_function(torch.ops.aten.mm.default, (h, ws[2]))
    g.output((h,))
    return GraphModule(torch.nn.Module(), g)


def _inputs():
    torch.manual_seed(0)
    return [torch.randn(3, 4), torch.randn(20), torch.randn(10), torch.randn(4)]


def _names(gm):
    return [(n.target.name() if hasattr(n.target, "name") else str(n.target)) for n in gm.graph.nodes
            if n.op == "call_function"]


def test_gather_goes_right_before_the_first_use_and_release_right_after_the_last():
    gm = three_layer_graph()
    args = _inputs()
    (expected,) = gm(*args)
    gather_release(gm, Profile())
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    for g in (n for n in nodes if n.target is ops.GATHER):
        (item,) = [u for u in g.users if u.target is not ops.RELEASE]  # the weight: a view of the buffer
        (user,) = item.users
        (rel,) = [u for u in g.users if u.target is ops.RELEASE]
        assert pos[item] == pos[g] + 1 and pos[user] == pos[item] + 1  # gathered just before its use
        assert pos[rel] == pos[user] + 1  # released right after its last use
    OWNER.log.clear()
    (got,) = gm(*args)
    assert torch.equal(got, expected)
    assert OWNER.log == [("gather", 0), ("gather", 1), ("gather", 2)]
    assert [t for t in _names(gm) if "zerospeed" in t] == ["zerospeed::gather", "zerospeed::release"] * 3


def test_a_bucket_saved_for_backward_is_not_released():
    gm = three_layer_graph()
    out = next(n for n in gm.graph.nodes if n.op == "output")
    item1 = [n for n in gm.graph.nodes if n.target is torch.ops.aten.view.default][1]
    view = gm.graph.call_function(torch.ops.aten.t.default, (item1,))
    out.prepend(view)
    out.args = ((out.args[0][0], view),)  # a view of w1 leaves the graph (saved for the backward)
    gm.recompile()
    gather_release(gm, Profile())
    released = [n.args[0][0].args[2] for n in gm.graph.nodes if n.target is ops.RELEASE]
    assert sorted(released) == [0, 2]


def test_prefetch_starts_gathers_early_but_never_beyond_the_memory_limit():
    seconds = {"mm_default": 1.0, "relu_default": 1.0, "mm_default_1": 1.0, "mm_default_2": 1.0}
    nbytes = {0: 80, 1: 40, 2: 16}

    def run(limit):
        gm = gather_release(three_layer_graph(), Profile())
        prof = Profile(node_seconds=seconds, bucket_bytes=nbytes, gather_seconds={0: 9.0, 1: 9.0, 2: 9.0},
                       memory_limit_bytes=limit)
        prefetch(gm, prof)
        return gm, prof

    # unlimited: buckets 1 and 2 start right after the inputs (bucket 0 is used first: nothing to hide it)
    gm, prof = run(None)
    nodes = list(gm.graph.nodes)
    starts = [n for n in nodes if n.target is ops.GATHER_START]
    assert sorted(s.args[2][0] for s in starts) == [1, 2]
    assert all(nodes[i].op == "placeholder" for i in range(4)) and all(nodes.index(s) <= 5 for s in starts)
    assert max(live_bytes(gm, prof)) == 136
    # a limit of 100 bytes: bucket 1 (40) may not start while bucket 0 (80) is live; bucket 2 (16) may
    gm, prof = run(100)
    assert max(live_bytes(gm, prof)) <= 100
    nodes = list(gm.graph.nodes)
    start = {s.args[2][0]: nodes.index(s) for s in nodes if s.target is ops.GATHER_START}
    release0 = next(nodes.index(n) for n in nodes if n.target is ops.RELEASE
                    and n.args[0][0].args[2] == 0)
    assert start[1] > release0  # waited for bucket 0's release
    waits = {n.args[2]: n for n in nodes if n.target is ops.GATHER_WAIT}
    assert all(waits[b].args[3].target is ops.GATHER_START for b in start)
    # the rewritten graph still computes the same thing
    gm0 = three_layer_graph()
    args = _inputs()
    OWNER.log.clear()
    assert torch.equal(gm(*args)[0], gm0(*args)[0])
    assert ("start", 1) in OWNER.log and OWNER.log.index(("start", 1)) < OWNER.log.index(("gather", 1))
    # a profile saying the all-gather is short keeps the start close to the gather
    gm = gather_release(three_layer_graph(), Profile())
    prefetch(gm, Profile(node_seconds=seconds, bucket_bytes=nbytes, gather_seconds={0: 0.5, 1: 0.5, 2: 0.5}))
    nodes = list(gm.graph.nodes)
    for s in (n for n in nodes if n.target is ops.GATHER_START):
        wait = next(n for n in nodes if n.target is ops.GATHER_WAIT and n.args[3] is s)
        between = nodes[nodes.index(s) + 1:nodes.index(wait)]
        assert 0.5 <= sum(seconds.get(n.name, 0.0) for n in between) <= 1.0  # just enough to hide it


def test_prefetch_window_starts_gathers_as_early_as_it_allows_in_the_order_of_use():
    seconds = {"mm_default": 1.0, "relu_default": 1.0, "mm_default_1": 1.0, "mm_default_2": 1.0}
    nbytes = {0: 80, 1: 40, 2: 16}

    def starts(window, limit=None):
        gm = gather_release(three_layer_graph(), Profile())
        prefetch(gm, Profile(node_seconds=seconds, bucket_bytes=nbytes, gather_seconds={0: 0.5, 1: 0.5, 2: 0.5},
                             memory_limit_bytes=limit, prefetch_window_bytes=window))
        nodes = list(gm.graph.nodes)
        return gm, {s.args[2][0]: nodes.index(s) for s in nodes if s.target is ops.GATHER_START}

    # no window limit: both all-gathers start right after the inputs, in the order the graph uses them
    gm, pos = starts(None)
    assert pos == {1: 4, 2: 5}
    args = _inputs()
    OWNER.log.clear()
    assert torch.equal(gm(*args)[0], three_layer_graph()(*args)[0])
    assert OWNER.log[:2] == [("start", 1), ("start", 2)]
    # a window of 56 bytes: bucket 2 (16) may be gathered ahead of bucket 1 (40) but not also of bucket 0 (80),
    # and bucket 1 not ahead of bucket 0: both start right after bucket 0's gather
    gm, pos = starts(56)
    names = [n.name for n in gm.graph.nodes]
    assert names[4:7] == ["gather_default", "gather_start_default", "gather_start_default_1"]
    _, pos0 = starts(0)  # no window: each start only as early as its profiled time needs
    assert pos0 == {1: 8, 2: 12}
    # the memory limit still wins over the window
    gm, _ = starts(None, limit=100)
    assert max(live_bytes(gm, Profile(bucket_bytes=nbytes))) <= 100


def test_async_reduce_waits_at_the_end_or_when_the_bytes_in_flight_would_exceed_the_limit():
    def graph():
        g = Graph()
        xs = [g.placeholder(f"x{i}") for i in range(3)]
        outs = []
        for i, x in enumerate(xs):
            grad = g.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))
            outs.append(g.call_function(ops.REDUCE_BUCKET, ([grad], KEY, i)))
        g.output(tuple(outs))
        return GraphModule(torch.nn.Module(), g)

    args = [torch.randn(20), torch.randn(10), torch.randn(4)]
    expected = graph()(*args)
    nbytes = {0: 80, 1: 40, 2: 16}
    for limit, log in [(None, [0, 1, 2, "w0", "w1", "w2"]), (120, [0, 1, "w0", 2, "w1", "w2"]),
                       (10, [0, "w0", 1, "w1", 2, "w2"])]:
        gm = async_reduce(graph(), Profile(phase="backward", bucket_bytes=nbytes, reduce_limit_bytes=limit))
        assert not [n for n in gm.graph.nodes if n.target is ops.REDUCE_BUCKET]
        out = next(n for n in gm.graph.nodes if n.op == "output")
        assert all(v.target is ops.REDUCE_WAIT for v in out.args[0])
        OWNER.log.clear()
        got = gm(*args)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        assert OWNER.log == [("reduce_start", e) if isinstance(e, int) else ("reduce_wait", int(e[1])) for e in log]


def test_coalesced_groups_double_and_respect_the_cap():
    items = [(c, n) for c, n in zip("abcdefg", [10, 4, 4, 8, 5, 9, 30])]
    # a: first (10); then at most 10 (done): b c; then at most 18: d e; then at most 31: f; then g
    assert coalesce(items, None) == [["a"], ["b", "c"], ["d", "e"], ["f"], ["g"]]
    assert coalesce(items, 8) == [["a"], ["b", "c"], ["d"], ["e"], ["f"], ["g"]]
    assert coalesce([], None) == []


def test_async_reduce_shares_one_collective_between_small_buckets_counted_from_the_end():
    g = Graph()
    xs = [g.placeholder(f"x{i}") for i in range(3)]
    outs = []
    for i, x in enumerate(xs):
        grad = g.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))
        outs.append(g.call_function(ops.REDUCE_BUCKET, ([grad], KEY, i)))
    g.output(tuple(outs))
    gm = GraphModule(torch.nn.Module(), g)
    args = [torch.randn(20), torch.randn(10), torch.randn(4)]
    expected = gm(*args)
    # from the end: bucket 2 (16 bytes) alone, then buckets 1 and 0 (8 + 8 <= 16) in one reduce-scatter
    async_reduce(gm, Profile(phase="backward", bucket_bytes={0: 8, 1: 8, 2: 16}))
    (shared, last) = [n for n in gm.graph.nodes if n.target is ops.REDUCE_START]
    assert shared.args[2] == [0, 1] and last.args[2] == [2]
    OWNER.log.clear()
    got = gm(*args)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert OWNER.log == [("reduce_start", 0, 1), ("reduce_start", 2), ("reduce_wait", 0), ("reduce_wait", 1),
                         ("reduce_wait", 2)]


def test_selective_unsharding_picks_by_cost_per_byte_within_the_budget():
    cands = [Candidate("big_cheap", 1000, 1.0), Candidate("small_costly", 100, 0.5),
             Candidate("mid", 400, 1.0), Candidate("tiny", 10, 0.001)]
    # per byte: small_costly 5e-3, mid 2.5e-3, big_cheap 1e-3, tiny 1e-4
    assert choose_unsharded(cands, 520) == ["small_costly", "mid", "tiny"]
    assert choose_unsharded(cands, 100) == ["small_costly"]
    assert choose_unsharded(cands, 0) == []
    assert choose_unsharded(cands, 10_000) == ["small_costly", "mid", "big_cheap", "tiny"]
    with pytest.raises(ValueError, match="budget_bytes must be >= 0"):
        choose_unsharded(cands, -1)


def test_tag_recompute_marks_every_gather_but_the_kept_ones():
    gm = tag_recompute(three_layer_graph(), keep=[1])
    for n in gm.graph.nodes:
        if n.target is ops.GATHER or n.target is torch.ops.aten.view.default:
            bucket = (n if n.target is ops.GATHER else n.args[0]).args[2]
            want = None if bucket == 1 else CheckpointPolicy.MUST_RECOMPUTE
            assert n.meta.get("recompute") == want


def test_reduce_early_and_insert_reduce_grads():
    g = Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    ga = g.call_function(torch.ops.aten.mul.Tensor, (a, 2.0))
    other = g.call_function(torch.ops.aten.exp.default, (b,))
    gb = g.call_function(torch.ops.aten.mul.Tensor, (other, 3.0))
    gc = g.call_function(torch.ops.aten.neg.default, (other,))
    g.output((ga, gb, gc, None))
    gm = GraphModule(torch.nn.Module(), g)
    prof = Profile(phase="backward", owner_key=KEY,
                   data={"param_of_output": {0: (0, 10), 1: (1, 11), 2: (0, 12)}, "num_inputs": 4})
    insert_reduce_grads(gm, prof)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    assert list(out.args[0]) == [None, None, None, None]
    reds = [n for n in gm.graph.nodes if n.target is ops.REDUCE_GRADS]
    assert [(len(r.args[0]), r.args[2]) for r in reds] == [(1, [11]), (2, [10, 12])]  # in graph order
    nodes = list(gm.graph.nodes)
    for r in reds:  # right after the last gradient of its bucket
        assert nodes.index(r) == max(nodes.index(x) for x in r.args[0]) + 1
    # reduce_early moves a reduction that sits late up to its last input
    late = Graph()
    x = late.placeholder("x")
    grad = late.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))
    busy = late.call_function(torch.ops.aten.exp.default, (x,))
    red = late.call_function(ops.REDUCE_BUCKET, ([grad], KEY, 2))
    late.output((busy, red))
    lm = reduce_early(GraphModule(torch.nn.Module(), late), Profile())
    assert [n.target for n in lm.graph.nodes][1:4] == [torch.ops.aten.mul.Tensor, ops.REDUCE_BUCKET,
                                                       torch.ops.aten.exp.default]
    with pytest.raises(RuntimeError, match="4 outputs for 5 forward inputs"):
        insert_reduce_grads(GraphModule(torch.nn.Module(), g), Profile(data={"param_of_output": {0: (0, 1)},
                                                                            "num_inputs": 5}))


def test_backend_fn_runs_passes_over_forward_and_backward_graphs():
    seen = []

    def record(gm, profile):
        seen.append((profile.phase, profile.data["tag"], len(gm.graph.nodes)))
        return gm

    w = torch.randn(4, 3, requires_grad=True)

    def step(x):
        return torch.tanh(x @ w).sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=backend_fn([record], {"tag": 7}))
    x = torch.randn(2, 4)
    loss = compiled(x)
    loss.backward()
    grad = w.grad.clone()
    w.grad = None
    step(x).backward()
    assert torch.allclose(grad, w.grad, rtol=1e-6, atol=1e-7)
    assert [p for p, _, _ in seen] == ["forward", "backward"] and all(t == 7 for _, t, _ in seen)


def test_a_pass_that_does_not_return_a_graph_is_named():
    def bad_pass(gm, profile):
        return None

    with pytest.raises(TypeError, match="compile pass bad_pass returned NoneType"):
        run_passes(three_layer_graph(), [bad_pass], Profile())
    with pytest.raises(TypeError, match="a pass must be callable"):
        backend_fn([3])
    with pytest.raises(ValueError, match="compiler must be one of inductor, eager, profile"):
        backend_fn([], compiler="tvm")


def _with_values(gm, *args):
    """Record each node's value as its meta["val"] (what aot_autograd's fake values would be)."""

    class Record(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            n.meta["val"] = out
            return out

    return Record(gm).run(*args)


def test_activation_offload_moves_large_saved_tensors_to_host_and_back():
    from zerospeed.compile.activation_offload import ActivationStore, offload_activations

    fw_g = Graph()
    x = fw_g.placeholder("x")
    a = fw_g.call_function(torch.ops.aten.relu.default, (x,))
    b = fw_g.call_function(torch.ops.aten.mul.Tensor, (a, 2.0))
    loss = fw_g.call_function(torch.ops.aten.sum.default, (b,))
    small = fw_g.call_function(torch.ops.aten.amax.default, (x, [0]))
    fw_g.output((loss, a, small))  # user output, then what the backward needs: a (400 bytes), small (4)
    fw = GraphModule(torch.nn.Module(), fw_g)
    bw_g = Graph()
    a_in, small_in, tangent = bw_g.placeholder("relu_default"), bw_g.placeholder("amax_default"), \
        bw_g.placeholder("tangents_1")
    g = bw_g.call_function(torch.ops.aten.mul.Tensor, (a_in, tangent))
    h = bw_g.call_function(torch.ops.aten.add.Tensor, (g, small_in))
    bw_g.output((h,))
    bw = GraphModule(torch.nn.Module(), bw_g)
    xv = torch.randn(100)
    ref_fw = _with_values(fw, xv)
    ref_bw = _with_values(bw, ref_fw[1], ref_fw[2], torch.tensor(1.5))
    store = ActivationStore()
    key = ops.register_owner(store)
    assert offload_activations(fw, bw, store, key, threshold_bytes=100) == ["relu_default"]
    fw_names = _names(fw)
    assert fw_names.index("zerospeed::offload") == fw_names.index("aten::mul.Tensor") + 1  # after its last use
    bw_nodes = [n for n in bw.graph.nodes if n.op == "call_function"]
    assert bw_nodes[0].target is ops.RELOAD and bw_nodes[1].args[0] is bw_nodes[0]  # right before its first use
    outs = fw(xv)
    assert outs[1].numel() == 0 and torch.equal(outs[2], ref_fw[2])  # a token is saved instead of the activation
    assert store.held_bytes() == 400
    (got,) = bw(outs[1], outs[2], torch.tensor(1.5))
    assert torch.equal(got, ref_bw[0]) and store.held_bytes() == 0
    assert store.counts == {"offloaded": 1, "reloaded": 1, "offloaded_bytes": 400}
    with pytest.raises(RuntimeError, match="nothing stored for slot 0"):
        bw(outs[1], outs[2], torch.tensor(1.5))
