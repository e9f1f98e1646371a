"""Pipeline schedules as data: generation, validation, deadlock detection, simulation formulas."""
from __future__ import annotations

from fractions import Fraction

import pytest

from zerospeed.pipe import (
    Action,
    ActionCosts,
    ActionKind,
    ScheduleError,
    build_schedule,
    execute,
    format_timeline,
    gpipe,
    insert_communication,
    interleaved_1f1b,
    one_f_one_b,
    simulate,
    stage_to_rank,
    stages_of_rank,
    validate_schedule,
    zero_bubble_h1,
)

F, B, I, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT
SA, RA, SG, RG = ActionKind.SEND_ACT, ActionKind.RECV_ACT, ActionKind.SEND_GRAD, ActionKind.RECV_GRAD

STAGES = range(1, 9)
MICROBATCHES = range(1, 17)


def compute_only(actions):
    return [(a.kind.value, a.stage, a.microbatch) for a in actions if a.kind.is_compute]


# --------------------------------------------------------------------------- generation + validation
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zero_bubble"])
@pytest.mark.parametrize("num_stages", STAGES)
def test_flat_schedules_validate_for_all_sizes(name, num_stages):
    for m in MICROBATCHES:
        schedule = build_schedule(name, num_stages, m)
        assert sorted(schedule) == list(range(num_stages))
        validate_schedule(schedule, num_stages, m)
        validate_schedule(schedule, num_stages, m, p2p="eager")
        assert stage_to_rank(schedule) == {s: s for s in range(num_stages)}


@pytest.mark.parametrize("num_ranks", STAGES)
@pytest.mark.parametrize("virtual", [1, 2, 3])
def test_interleaved_validates_for_all_sizes(num_ranks, virtual):
    for m in range(num_ranks, 17, num_ranks):
        schedule = interleaved_1f1b(num_ranks, m, virtual)
        validate_schedule(schedule, num_ranks * virtual, m)
        assert stage_to_rank(schedule) == {s: s % num_ranks for s in range(num_ranks * virtual)}


def test_one_f_one_b_compute_order_is_deepspeeds():
    schedule = one_f_one_b(4, 6)
    assert compute_only(schedule[0]) == [
        ("F", 0, 0), ("F", 0, 1), ("F", 0, 2),
        ("F", 0, 3), ("B", 0, 0), ("F", 0, 4), ("B", 0, 1), ("F", 0, 5), ("B", 0, 2),
        ("B", 0, 3), ("B", 0, 4), ("B", 0, 5),
    ]
    assert compute_only(schedule[3]) == [x for mb in range(6) for x in (("F", 3, mb), ("B", 3, mb))]


def test_communication_is_explicit_and_complete():
    p, m = 3, 4
    schedule = one_f_one_b(p, m)
    for rank, actions in schedule.items():
        kinds = [a.kind for a in actions]
        assert kinds.count(SA) == (m if rank < p - 1 else 0)
        assert kinds.count(RA) == (m if rank > 0 else 0)
        assert kinds.count(SG) == (m if rank > 0 else 0)
        assert kinds.count(RG) == (m if rank < p - 1 else 0)


def test_zero_bubble_splits_backward_and_delays_weight_grads():
    p, m = 4, 8
    schedule = zero_bubble_h1(p, m)
    for stage, actions in schedule.items():
        kinds = [a.kind for a in actions if a.kind.is_compute]
        assert B not in kinds and kinds.count(I) == m and kinds.count(W) == m
        order = compute_only(actions)
        # W of microbatch 0 comes `stage` steady (F, I) pairs after its input-gradient
        steady_start = order.index(("I", stage, 0))
        assert order.index(("W", stage, 0)) == steady_start + 2 * stage + 1


def test_single_rank_interleaving_has_no_communication():
    schedule = interleaved_1f1b(1, 3, 4)
    assert all(a.kind.is_compute for a in schedule[0])
    assert stages_of_rank(schedule) == {0: [0, 1, 2, 3]}
    validate_schedule(schedule, 4, 3)


def test_build_schedule_arguments():
    assert build_schedule("1F1B", 2, 2) == one_f_one_b(2, 2)
    assert build_schedule("zb-h1", num_ranks=2, num_microbatches=2) == zero_bubble_h1(2, 2)
    assert build_schedule("interleaved_1f1b", 4, 2, virtual_stages_per_rank=2) == interleaved_1f1b(2, 2, 2)
    assert build_schedule("interleaved", num_microbatches=2, num_ranks=2,
                          virtual_stages_per_rank=2) == interleaved_1f1b(2, 2, 2)


@pytest.mark.parametrize(
    "call, argument",
    [
        (lambda: build_schedule("pipedream_2bw", 2, 2), "name"),
        (lambda: build_schedule(None, 2, 2), "name"),
        (lambda: build_schedule("gpipe", 0, 2), "num_stages"),
        (lambda: build_schedule("gpipe", 2, 0), "num_microbatches"),
        (lambda: build_schedule("gpipe", 2, None), "num_microbatches"),
        (lambda: build_schedule("1f1b", None, 2), "num_stages"),
        (lambda: build_schedule("1f1b", 2, 2, num_ranks=3), "num_ranks"),
        (lambda: build_schedule("1f1b", 2, 2, virtual_stages_per_rank=2), "virtual_stages_per_rank"),
        (lambda: build_schedule("interleaved_1f1b", 6, 4, virtual_stages_per_rank=4), "num_stages"),
        (lambda: build_schedule("interleaved_1f1b", 6, 4, num_ranks=2, virtual_stages_per_rank=2),
         "num_stages"),
        (lambda: build_schedule("interleaved_1f1b", None, 4), "num_ranks"),
        (lambda: gpipe(2.0, 2), "num_stages"),
        (lambda: one_f_one_b(True, 2), "num_stages"),
        (lambda: interleaved_1f1b(2, 4, 0), "virtual_stages_per_rank"),
    ],
)
def test_bad_arguments_name_the_argument(call, argument):
    with pytest.raises(ValueError, match=argument):
        call()


def test_interleaved_requires_microbatches_multiple_of_ranks():
    with pytest.raises(ValueError, match=r"num_microbatches: .*multiple of num_ranks \(4\), got 6"):
        interleaved_1f1b(4, 6, 2)


# --------------------------------------------------------------------------- broken schedules
def small_1f1b():
    schedule = one_f_one_b(2, 2)
    return {rank: list(actions) for rank, actions in schedule.items()}


def test_swapped_forward_and_its_receive_is_rejected():
    schedule = small_1f1b()
    actions = schedule[1]
    i = actions.index(Action(RA, 1, 0))
    j = actions.index(Action(F, 1, 0))
    actions[i], actions[j] = actions[j], actions[i]
    with pytest.raises(ScheduleError, match=r"needs RECV_ACT\(stage=1, mb=0\) before it") as info:
        validate_schedule(schedule, 2, 2)
    assert (info.value.rank, info.value.index, info.value.action) == (1, i, Action(F, 1, 0))
    assert str(info.value).startswith(f"rank 1, action {i} (FORWARD(stage=1, mb=0))")


def test_missing_receive_is_rejected():
    schedule = small_1f1b()
    schedule[1].remove(Action(RA, 1, 1))
    with pytest.raises(ScheduleError, match=r"rank 1, .*needs RECV_ACT\(stage=1, mb=1\) .*missing"):
        validate_schedule(schedule, 2, 2)


def test_missing_send_is_rejected():
    schedule = small_1f1b()
    schedule[0].remove(Action(SA, 0, 1))
    with pytest.raises(ScheduleError, match=r"RECV_ACT\(stage=1, mb=1\).*no matching "
                                            r"SEND_ACT\(stage=0, mb=1\) on rank 0"):
        validate_schedule(schedule, 2, 2)


def test_missing_gradient_receive_is_rejected():
    schedule = small_1f1b()
    schedule[0].remove(Action(RG, 0, 0))
    with pytest.raises(ScheduleError, match=r"BACKWARD\(stage=0, mb=0\).*RECV_GRAD\(stage=0, mb=0\)"):
        validate_schedule(schedule, 2, 2)


def test_receive_order_mismatch_is_rejected():
    schedule = {
        0: [Action(F, 0, 0), Action(SA, 0, 0), Action(F, 0, 1), Action(SA, 0, 1),
            Action(RG, 0, 0), Action(B, 0, 0), Action(RG, 0, 1), Action(B, 0, 1)],
        1: [Action(RA, 1, 1), Action(F, 1, 1), Action(RA, 1, 0), Action(F, 1, 0),
            Action(B, 1, 0), Action(SG, 1, 0), Action(B, 1, 1), Action(SG, 1, 1)],
    }
    with pytest.raises(ScheduleError, match="out of order") as info:
        validate_schedule(schedule, 2, 2)
    assert info.value.rank == 1 and info.value.index == 0


def test_deadlock_cycle_is_reported():
    schedule = {
        0: [Action(F, 0, 0), Action(RG, 0, 0), Action(SA, 0, 0), Action(B, 0, 0)],
        1: [Action(RA, 1, 0), Action(F, 1, 0), Action(B, 1, 0), Action(SG, 1, 0)],
    }
    expected = (r"deadlock under rendezvous .*rank 0 at action 1 \(RECV_GRAD\(stage=0, mb=0\)\) "
                r"waits for rank 1; rank 1 at action 0 \(RECV_ACT\(stage=1, mb=0\)\) waits for rank 0")
    with pytest.raises(ScheduleError, match=expected):
        validate_schedule(schedule, 2, 1)
    with pytest.raises(ScheduleError, match="deadlock under eager"):
        validate_schedule(schedule, 2, 1, p2p="eager")


def test_send_send_exchange_deadlocks_only_with_blocking_sends():
    # both ranks send before receiving: fine with isend, a deadlock with blocking send/recv
    schedule = {
        0: [Action(F, 0, 0), Action(SA, 0, 0), Action(F, 0, 1), Action(SA, 0, 1),
            Action(RG, 0, 0), Action(B, 0, 0), Action(RG, 0, 1), Action(B, 0, 1)],
        1: [Action(RA, 1, 0), Action(F, 1, 0), Action(B, 1, 0), Action(SG, 1, 0),
            Action(RA, 1, 1), Action(F, 1, 1), Action(B, 1, 1), Action(SG, 1, 1)],
    }
    validate_schedule(schedule, 2, 2, p2p="eager")
    with pytest.raises(ScheduleError, match="deadlock under rendezvous") as info:
        validate_schedule(schedule, 2, 2)
    assert info.value.rank == 0 and info.value.action == Action(SA, 0, 1)


def test_waiting_for_a_finished_rank_is_reported():
    schedule = {0: [Action(F, 0, 0), Action(B, 0, 0)], 1: [Action(RA, 1, 0)]}
    with pytest.raises(ScheduleError, match=r"rank 0 finished without reaching SEND_ACT\(stage=0, mb=0\)"):
        execute(schedule)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda s: s[0].append(Action(F, 0, 0)), "appears twice"),
        (lambda s: s[0].remove(Action(B, 0, 1)), r"no backward for stage 0, microbatch 1"),
        (lambda s: s[0].append(Action(F, 0, 5)), "microbatch out of range"),
        (lambda s: s[0].append(Action(F, 7, 0)), "stage out of range"),
        (lambda s: s[1].insert(0, Action(F, 0, 1)), "stage 0 runs on rank 0"),
        (lambda s: s[0].insert(0, Action(SG, 1, 0)), "stage 1 runs on rank 1, not here"),
        (lambda s: s[0].append("F0"), "expected an Action"),
    ],
)
def test_malformed_schedules_are_rejected(mutate, message):
    schedule = small_1f1b()
    mutate(schedule)
    with pytest.raises(ScheduleError, match=message):
        validate_schedule(schedule, 2, 2)


def test_split_backward_rules():
    schedule = {r: list(a) for r, a in zero_bubble_h1(2, 2).items()}
    weight = Action(W, 0, 0)
    schedule[0].remove(weight)
    with pytest.raises(ScheduleError, match=r"BACKWARD_WEIGHT\(stage=0, mb=0\) is missing"):
        validate_schedule(schedule, 2, 2)
    schedule[0].insert(0, weight)
    with pytest.raises(ScheduleError, match=r"needs BACKWARD_INPUT\(stage=0, mb=0\) before it"):
        validate_schedule(schedule, 2, 2)
    schedule[0].remove(weight)
    schedule[0].append(Action(B, 0, 0))
    with pytest.raises(ScheduleError, match="both a full BACKWARD and the split"):
        validate_schedule(schedule, 2, 2)


def test_local_handover_must_not_be_communication():
    schedule = {0: list(interleaved_1f1b(1, 1, 2)[0])}
    schedule[0].insert(1, Action(SA, 0, 0))
    with pytest.raises(ScheduleError, match="both on this rank"):
        validate_schedule(schedule, 2, 1)


def test_stage_to_rank_argument_is_enforced():
    with pytest.raises(ScheduleError, match="stage 0 runs on rank 1"):
        validate_schedule(one_f_one_b(2, 2), 2, 2, stage_to_rank={0: 1, 1: 1})
    with pytest.raises(ScheduleError, match="stage_to_rank: stage 0 maps to rank 5"):
        validate_schedule(one_f_one_b(2, 2), 2, 2, stage_to_rank={0: 5})


def test_insert_communication_rejects_cyclic_compute_orders():
    orders = {0: [Action(B, 0, 0), Action(F, 0, 0)], 1: [Action(F, 1, 0), Action(B, 1, 0)]}
    with pytest.raises(ScheduleError, match="cannot run"):
        insert_communication(orders)


def test_custom_compute_order_gets_valid_communication():
    # a user-written order (every stage forwards microbatches in reverse) is made runnable
    p, m = 3, 3
    orders = {s: [Action(F, s, mb) for mb in reversed(range(m))] + [Action(B, s, mb) for mb in range(m)]
              for s in range(p)}
    validate_schedule(insert_communication(orders), p, m)


# --------------------------------------------------------------------------- simulation
def test_one_f_one_b_bubble_formula():
    # forward f, backward b: step = (m + p - 1)(f + b), every rank idles (p - 1)(f + b)
    for f, b in [(1, 2), (1, 3), (2, 1)]:
        costs = ActionCosts(forward=f, backward=b)
        for p in STAGES:
            for m in MICROBATCHES:
                assert simulate(one_f_one_b(p, m), costs, p2p="rendezvous").step_time == \
                    (m + p - 1) * (f + b)
                result = simulate(one_f_one_b(p, m), costs)
                assert result.step_time == (m + p - 1) * (f + b)
                for rank in range(p):
                    assert Fraction(result.bubble_fraction[rank]).limit_denominator(10_000) == \
                        Fraction(p - 1, m + p - 1)
                assert result.peak_activations == {s: min(p - s, m) for s in range(p)}


def test_gpipe_same_bubble_more_activations():
    for p in STAGES:
        for m in MICROBATCHES:
            ref = simulate(one_f_one_b(p, m))
            result = simulate(gpipe(p, m))
            assert result.step_time == ref.step_time == 3 * (m + p - 1)
            assert result.bubble_fraction == pytest.approx(ref.bubble_fraction)
            assert result.peak_activations == {s: m for s in range(p)}
            assert max(result.peak_activations.values()) == m
            assert max(ref.peak_activations.values()) == min(p, m)


def test_interleaved_bubble_shrinks_by_virtual_stages():
    # each virtual stage costs F=1, B=2; with v stages per rank the bubble is (p-1)*3 instead of
    # plain 1F1B's v*(p-1)*3 on the same model: fraction (p-1)/(v*m + p-1), i.e. Megatron's
    # (p-1)/(v*m) of the ideal time. Exact with asynchronous sends (the runtime contract).
    for p in range(2, 9):
        for v in (2, 3, 4):
            for m in range(p, 17, p):
                schedule = interleaved_1f1b(p, m, v)
                result = simulate(schedule)
                assert result.step_time == 3 * (v * m + p - 1)
                assert result.max_bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
                flat = simulate(one_f_one_b(p, m), ActionCosts(forward=v, backward=2 * v))
                assert flat.max_bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
                assert result.max_bubble_fraction < flat.max_bubble_fraction
                # blocking sends cannot deadlock, but some hand-overs then wait for a busy peer
                assert simulate(schedule, p2p="rendezvous").step_time >= result.step_time


def test_zero_bubble_h1_bubble_and_memory():
    # F = B(input) = W = 1: ZB-H1's bubble is (p-1)(T_F + T_B - T_W) = p - 1 units (a third of
    # 1F1B's 3(p-1)) when m >= p, with the same peak stash (p microbatches) as 1F1B.
    split_costs = ActionCosts(forward=1, backward_input=1, backward_weight=1)
    for p in STAGES:
        for m in MICROBATCHES:
            ref = simulate(one_f_one_b(p, m))
            for p2p in ("rendezvous", "eager"):
                result = simulate(zero_bubble_h1(p, m), split_costs, p2p=p2p)
                if m >= p:
                    assert result.step_time == 3 * m + p - 1
                    assert result.max_bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1))
                if p > 1:
                    assert result.step_time < ref.step_time
                    assert result.max_bubble_fraction < ref.max_bubble_fraction
                assert max(result.peak_activations.values()) == max(ref.peak_activations.values())


@pytest.mark.parametrize("f, i, w", [(2, 2, 1), (2, 1, 1), (1, 2, 1), (3, 2, 2)])
def test_zero_bubble_h1_paper_formula_for_other_costs(f, i, w):
    # Qi et al.: ZB-H1's bubble is (p - 1)(T_F + T_B - T_W) (1F1B's: (p - 1)(T_F + T_B + T_W))
    costs = ActionCosts(forward=f, backward_input=i, backward_weight=w)
    for p in (2, 3, 4, 8):
        for m in (p, p + 1, 2 * p, 16):
            result = simulate(zero_bubble_h1(p, m, costs=costs), costs)
            assert result.step_time == m * (f + i + w) + (p - 1) * (f + i - w)


def test_communication_cost_is_charged():
    schedule = one_f_one_b(4, 8)
    free = simulate(schedule)
    costly = simulate(schedule, ActionCosts(comm=0.5))
    assert costly.step_time > free.step_time
    assert costly.compute_time == free.compute_time


def test_timeline_and_chart():
    result = simulate(one_f_one_b(2, 2))
    first = result.timeline[1][0]
    assert first.action == Action(RA, 1, 0) and (first.start, first.end) == (0.0, 1.0)
    chart = format_timeline(result).splitlines()
    assert chart[0].startswith("rank 0: F0 F1 .") and len(chart) == 2


def test_costs_and_semantics_are_checked():
    with pytest.raises(ValueError, match="forward"):
        ActionCosts(forward=-1)
    with pytest.raises(ValueError, match="p2p"):
        simulate(one_f_one_b(2, 2), p2p="async")
    with pytest.raises(ValueError, match="costs"):
        one_f_one_b(2, 2, costs=ActionCosts(forward=0))
