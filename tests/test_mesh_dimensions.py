"""The one mesh holds every dimension (issue #34): pipeline, data, sequence and tensor axes, expert-parallel groups
carved out of the data groups, and the ranks grouped by host; each validated when the mesh is built.

Layout (tp fastest, then sp, then dp, then pp): rank = ((pp_rank * dp + dp_rank) * sp + sp_rank) * tp + tp_rank;
with sp = 1 it is the (pp, dp, tp) layout of test_tp_mesh.py.
"""
import pytest

from mesh_cases import expert_groups_of_meshes, host_groups_from_the_launcher, mesh_with_sequence_axis
from zerospeed import comm
from zerospeed.comm.hosts import host_layout
from zerospeed.comm.mesh import MeshError, validate_degrees
from zerospeed.testing import run_distributed


def test_sequence_degree_is_validated_with_the_others():
    assert validate_degrees(8, pp=2, tp=2, sp=2) == (2, 1, 2)
    assert validate_degrees(8, tp=2, sp=2) == (1, 2, 2)
    with pytest.raises(MeshError, match=r"world size 6 is not divisible by pp=1 x sp=4 x tp=1 = 4"):
        validate_degrees(6, sp=4)
    with pytest.raises(MeshError, match=r"pp=1 x dp=2 x sp=2 x tp=1 = 4 does not equal the world size 8"):
        validate_degrees(8, dp=2, sp=2)
    with pytest.raises(MeshError, match=r"sequence-parallel degree sp: must be a positive int, got 0"):
        validate_degrees(4, sp=0)


def test_world_of_one_has_every_dimension():
    mesh = comm.build_mesh()
    assert mesh.sizes == {"pp": 1, "dp": 1, "sp": 1, "tp": 1, "hosts": 1}
    assert mesh.group_ranks("sequence") == [0] and mesh.expert_groups(1).ep_size == 1
    comm.reset_mesh()
    world = comm.world_mesh()
    assert world.dp_group is None and comm.get_mesh() is None and comm.current_mesh() == world


def test_hosts_follow_the_launchers_numbering():
    env = {"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "1", "GROUP_RANK": "1"}
    layout = host_layout(8, 5, env)
    assert layout.hosts == ((0, 1, 2, 3), (4, 5, 6, 7)) and (layout.host_rank, layout.local_rank) == (1, 1)
    assert layout.host_ranks == [4, 5, 6, 7] and layout.cross_host_ranks == [1, 5] and layout.num_hosts == 2
    assert host_layout(4, 3, {}).hosts == ((0, 1, 2, 3),)  # no launcher numbering: one host
    with pytest.raises(MeshError, match=r"LOCAL_WORLD_SIZE=3 does not divide the world size 8"):
        host_layout(8, 0, {"LOCAL_WORLD_SIZE": "3"})
    with pytest.raises(MeshError, match=r"rank 5 has LOCAL_RANK=2, but with LOCAL_WORLD_SIZE=4"):
        host_layout(8, 5, {**env, "LOCAL_RANK": "2"})
    with pytest.raises(MeshError, match=r"LOCAL_WORLD_SIZE='x' is not an integer"):
        host_layout(8, 5, {"LOCAL_WORLD_SIZE": "x"})


@pytest.mark.timeout(90)
def test_sequence_axis_layout_at_world_4():
    dp_sp = run_distributed(mesh_with_sequence_axis, 4, 1, 2, 1, timeout=60)
    for rank, r in enumerate(dp_sp):
        assert r["sizes"] == {"pp": 1, "dp": 2, "sp": 2, "tp": 1, "hosts": 1} and r["mpu_sp"] == (2, rank % 2)
        assert r["coord"] == (0, rank // 2, rank % 2, 0)
        assert r["sequence"] == [rank - rank % 2, rank - rank % 2 + 1] and r["data"] == [rank % 2, rank % 2 + 2]
        assert r["pipe"] == [rank] and r["model"] == [rank]
        assert all(r[f"sum_{axis}"] == sum(r[axis]) for axis in ("pipe", "data", "sequence", "model"))
    sp_tp = run_distributed(mesh_with_sequence_axis, 4, 1, 2, 2, timeout=60)
    for rank, r in enumerate(sp_tp):
        assert r["coord"] == (0, 0, rank // 2, rank % 2)
        assert r["model"] == [rank - rank % 2, rank - rank % 2 + 1] and r["sequence"] == [rank % 2, rank % 2 + 2]
        assert r["data"] == [rank] and r["sum_sequence"] == sum(r["sequence"])


@pytest.mark.timeout(90)
def test_expert_groups_come_from_the_mesh():
    results = run_distributed(expert_groups_of_meshes, 4, 2, timeout=60)
    for rank, r in enumerate(results):
        assert r["world_dp_group_is_default"]
        # DeepSpeed's layout over dp ranks [0, 1, 2, 3]: ep groups [0, 1], [2, 3]; expert-dp groups [0, 2], [1, 3]
        ep_group = [rank - rank % 2, rank - rank % 2 + 1]
        assert r["plain"] == ("ep_size_2", rank % 2, rank // 2, float(sum(ep_group)), float(rank % 2 + rank % 2 + 2))
        assert r["tp2"] == (2, 1, float(rank % 2 + rank % 2 + 2))  # tp=2: dp groups [0, 2], [1, 3]
        assert r["bad"] == "MoE: ep_size=3 does not divide the data-parallel world size 2"


@pytest.mark.timeout(90)
def test_host_groups_and_their_validation():
    results = run_distributed(host_groups_from_the_launcher, 4, 2, timeout=60)
    for rank, r in enumerate(results):
        assert r["hosts"] == [[0, 1], [2, 3]] and r["host_rank"] == rank // 2 and r["num_hosts"] == 2
        assert r["sum_intra"] == (0 + 1 if rank < 2 else 2 + 3) and r["sum_inter"] == rank % 2 + rank % 2 + 2
        assert "ranks are numbered host by host" in r["bad"]
