"""The (pp, dp, tp) mesh: DeepSpeed/Megatron rank layout, validation before any group, mpu input.

Layout (tp fastest, then dp, then pp): rank = (pp_rank * dp + dp_rank) * tp + tp_rank.
"""
import pytest

from tp_cases import mesh_error, mesh_from_mpu, mesh_layout
from zerospeed import comm
from zerospeed.comm.mesh import MeshError, validate_degrees
from zerospeed.testing import run_distributed


def test_validate_degrees_arithmetic_and_errors():
    assert validate_degrees(8, pp=2, tp=2) == (2, 2, 2)
    assert validate_degrees(4, tp=4) == (1, 1, 4)
    assert validate_degrees(6, pp=3) == (3, 2, 1)
    with pytest.raises(MeshError, match=r"world size 4 is not divisible by pp=1 x tp=3 = 3"):
        validate_degrees(4, tp=3)
    with pytest.raises(MeshError, match=r"pp=1 x dp=4 x tp=2 = 8 does not equal the world size 4"):
        validate_degrees(4, tp=2, dp=4)
    with pytest.raises(MeshError, match=r"tensor-parallel degree tp: must be a positive int, got 0"):
        validate_degrees(4, tp=0)


def test_world_of_one_without_process_group():
    mesh = comm.build_mesh()
    assert mesh.degrees == (1, 1, 1) and (mesh.pp_rank, mesh.dp_rank, mesh.tp_rank) == (0, 0, 0)
    assert mesh.group_ranks("model") == [0] and comm.get_mesh() is mesh
    assert mesh.get_model_parallel_world_size() == 1 and mesh.get_data_parallel_rank() == 0
    comm.reset_mesh()
    assert comm.get_mesh() is None
    with pytest.raises(MeshError, match="world size 1 is not divisible by pp=1 x tp=2"):
        comm.build_mesh(tp=2)


@pytest.mark.timeout(60)
def test_rank_layout_tp2xdp2_and_pp2xtp2_at_world_4():
    tp_dp = run_distributed(mesh_layout, 4, 1, 2, timeout=50)
    for rank, r in enumerate(tp_dp):
        assert r["degrees"] == (1, 2, 2)
        assert r["coord"] == (0, rank // 2, rank % 2)
        assert r["model"] == [rank - rank % 2, rank - rank % 2 + 1]  # tp neighbours are adjacent
        assert r["data"] == [rank % 2, rank % 2 + 2]
        assert r["pipe"] == [rank]
        assert r["sum_model"] == sum(r["model"]) and r["sum_data"] == sum(r["data"])
    pp_tp = run_distributed(mesh_layout, 4, 2, 2, timeout=50)
    for rank, r in enumerate(pp_tp):
        assert r["degrees"] == (2, 1, 2)
        assert r["coord"] == (rank // 2, 0, rank % 2)
        assert r["pipe"] == [rank % 2, rank % 2 + 2] and r["data"] == [rank]
        assert r["sum_pipe"] == sum(r["pipe"])


@pytest.mark.timeout(60)
def test_bad_degree_is_refused_on_every_rank_and_mpu_is_accepted():
    errors = run_distributed(mesh_error, 2, 1, 4, timeout=30)
    assert errors == ["mesh: world size 2 is not divisible by pp=1 x tp=4 = 4"] * 2
    from_mpu = run_distributed(mesh_from_mpu, 4, timeout=30)
    assert [m[0] for m in from_mpu] == [(1, 2, 2)] * 4
    assert [m[1] for m in from_mpu] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
