"""The scheduling policy on an in-memory fleet: no database, plain data in and out."""

import random

from jobs.policy import (
    FreeNode,
    ProjectLimits,
    QueuedJob,
    Request,
    RunningAttempt,
    estimate_starts,
    mark_borrowed,
    plan,
)

URGENT, HIGH, NORMAL, LOW, SCAVENGER = 40, 30, 20, 10, 0


def node(node_id: int, free: list[int] | int = 8, model: str = "H100", gpus: int = 8, envs=()) -> FreeNode:
    free = list(range(free)) if isinstance(free, int) else free
    return FreeNode(node_id, model, free, frozenset(envs), gpus)


def job(job_id: int, gpus: int = 1, nodes: int = 1, rank: int = NORMAL, project: int = 1, **fields) -> QueuedJob:
    request = Request(gpus, fields.pop("gpu_type", ""), nodes, fields.pop("environment", ""))
    return QueuedJob(job_id, request, project, fields.pop("user", 1), rank, rank >= HIGH, **fields)


def running(attempt_id: int, placement, rank: int = SCAVENGER, preemptible: bool = True, **fields) -> RunningAttempt:
    """A running attempt; with no quotas set, everything runs on borrowed GPUs."""
    fields = {"borrowed": True, **fields}
    return RunningAttempt(attempt_id, 1000 + attempt_id, placement, rank=rank, preemptible=preemptible, **fields)


def placed(result) -> dict[int, list[tuple[int, list[int]]]]:
    return {p.job_id: p.ranks for p in result.placements}


# --- gang placement and packing ---------------------------------------------------


def test_a_gang_starts_only_when_every_rank_fits():
    fleet = [node(1, 8), node(2, 2)]

    result = plan([job(1, gpus=4, nodes=2)], fleet)

    assert result.placements == []
    assert result.waiting[1].code == "capacity"
    assert "on each of 2 nodes at once" in result.waiting[1].message


def test_a_gang_gets_distinct_nodes_each_with_its_gpus():
    result = plan([job(1, gpus=4, nodes=2)], [node(1, 8), node(2, 8), node(3, [0, 1, 2, 3])])

    ranks = placed(result)[1]
    assert [n for n, _ in ranks] == [3, 1]  # the partly used node first, then the lowest id
    assert all(len(g) == 4 for _, g in ranks)


def test_a_one_gpu_job_does_not_break_into_an_empty_node():
    result = plan([job(1, gpus=1)], [node(1, 8), node(2, [5, 6]), node(3, 8)])

    assert placed(result) == {1: [(2, [5])]}


def test_small_jobs_fill_one_node_before_the_next():
    result = plan([job(i, gpus=2) for i in range(4)] + [job(9, gpus=8)], [node(1, 8), node(2, 8)])

    assert {ranks[0][0] for i, ranks in placed(result).items() if i < 4} == {1}
    assert placed(result)[9] == [(2, list(range(8)))]


def test_a_gang_of_any_type_stays_on_one_gpu_model():
    fleet = [node(1, 4, model="A100", gpus=4), node(2, 8, model="H100"), node(3, 8, model="H100")]

    ranks = placed(plan([job(1, gpus=4, nodes=2)], fleet))[1]

    assert sorted(n for n, _ in ranks) == [2, 3]


def test_no_gpu_is_handed_out_twice_in_a_pass():
    rng = random.Random(4)
    for _ in range(30):
        fleet = [node(i, rng.randint(0, 8)) for i in range(1, 12)]
        jobs = [job(j, gpus=rng.choice([1, 2, 4, 8]), nodes=rng.choice([1, 1, 2, 3])) for j in range(40)]
        taken = [(n, g) for p in plan(jobs, fleet).placements for n, gpus in p.ranks for g in gpus]
        assert len(taken) == len(set(taken))
        free = {(f.node_id, g) for f in fleet for g in f.free}
        assert set(taken) <= free


def test_it_says_when_no_node_can_ever_run_a_job():
    fleet = [node(1, 8), node(2, 4, model="A100", gpus=4)]

    result = plan([job(1, gpus=2, gpu_type="B300"), job(2, gpus=8, nodes=3), job(3, environment="ai")], fleet)

    assert result.waiting[1].code == "gpu_type" and "B300" in result.waiting[1].message
    assert result.waiting[2].code == "gpu_type"
    assert result.waiting[3].code == "environment" and "'ai'" in result.waiting[3].message


def test_a_job_goes_only_where_its_environment_is():
    fleet = [node(1, 8), node(2, 8, envs=["ai"])]

    assert placed(plan([job(1, environment="ai")], fleet))[1][0][0] == 2


# --- priorities, quotas, borrowing, limits ------------------------------------------


def test_a_higher_class_goes_first():
    result = plan([job(1, gpus=8, rank=HIGH), job(2, gpus=8, rank=LOW)], [node(1, 8)])

    assert list(placed(result)) == [1]


def test_guaranteed_quota_goes_before_borrowing_whatever_the_class():
    projects = {1: ProjectLimits(quota=0), 2: ProjectLimits(quota=8)}
    jobs = [job(1, gpus=8, rank=HIGH, project=1), job(2, gpus=8, rank=LOW, project=2)]

    result = plan(jobs, [node(1, 8)], projects=projects)

    assert list(placed(result)) == [2]
    assert result.placements[0].borrowed is False


def test_a_project_borrows_idle_gpus_beyond_its_quota():
    projects = {1: ProjectLimits(quota=2)}

    result = plan([job(1, gpus=2), job(2, gpus=4)], [node(1, 8)], projects=projects)

    assert [p.borrowed for p in result.placements] == [False, True]


def test_a_project_that_may_not_borrow_waits_for_its_quota():
    projects = {1: ProjectLimits(quota=2, may_borrow=False)}
    busy = [running(1, [(1, [0, 1])], project_id=1, rank=NORMAL, preemptible=False)]

    result = plan([job(1, gpus=1)], [node(1, [2, 3, 4, 5, 6, 7])], busy, projects)

    assert result.placements == []
    assert result.waiting[1].code == "quota"


def test_borrowed_gpus_are_taken_back_first_under_contention():
    projects = {1: ProjectLimits(quota=4), 2: ProjectLimits(quota=4)}
    busy = [
        running(1, [(1, [0, 1, 2, 3])], project_id=1, rank=NORMAL, preemptible=False, borrowed=False, elapsed=60),
        running(2, [(1, [4, 5, 6, 7])], project_id=1, rank=NORMAL, preemptible=False, borrowed=True, elapsed=60),
    ]

    result = plan([job(7, gpus=4, project=2)], [node(1, [])], busy, projects)

    assert result.preemptions == {2: 7}
    assert result.waiting[7].code == "preempting"


def test_project_and_user_limits_hold_jobs_back():
    projects = {1: ProjectLimits(max_running_jobs=2), 2: ProjectLimits(max_running_per_user=1, max_gpus_per_job=4)}
    busy = [running(1, [(1, [0])], project_id=1, user_id=5), running(2, [(1, [1])], project_id=2, user_id=5)]
    jobs = [job(1, project=1), job(2, project=1), job(3, project=2, user=5), job(4, project=2, user=6, gpus=8)]

    result = plan(jobs, [node(1, [2, 3, 4, 5, 6, 7]), node(2, 8)], busy, projects)

    assert list(placed(result)) == [1]
    assert result.waiting[2].code == "project_limit"
    assert result.waiting[3].code == "user_limit"
    assert result.waiting[4].code == "project_limit" and "4 a job" in result.waiting[4].message


# --- preemption -----------------------------------------------------------------------


def test_preemption_stops_the_cheapest_set_of_lower_preemptible_attempts():
    busy = [
        running(1, [(1, [0, 1, 2, 3])], elapsed=10 * 3600),  # 40 GPU-hours lost
        running(2, [(2, [0, 1])], elapsed=3600),  # 2
        running(3, [(2, [2, 3])], elapsed=3600),  # 2
        running(4, [(3, [0, 1, 2, 3])], rank=NORMAL, preemptible=False),
    ]
    fleet = [node(i, [], gpus=4) for i in (1, 2, 3)]

    result = plan([job(9, gpus=4, rank=URGENT)], fleet, busy)

    assert result.preemptions == {2: 9, 3: 9}
    assert result.placements == []


def test_a_class_that_may_not_preempt_waits():
    busy = [running(1, [(1, [0, 1, 2, 3])])]

    result = plan([job(9, gpus=4, rank=NORMAL)], [node(1, [], gpus=4)], busy)

    assert result.preemptions == {}
    assert result.waiting[9].code == "capacity"


def test_the_oldest_attempts_fill_a_quota_and_the_rest_borrow():
    busy = [running(i, [(1, [i, i + 4])], project_id=1) for i in range(3)]

    mark_borrowed(busy, {1: ProjectLimits(quota=4)})

    assert [a.borrowed for a in busy] == [False, False, True]


def test_a_borrowing_job_does_not_preempt_work_within_its_projects_quota():
    projects = {2: ProjectLimits(quota=4)}
    busy = [running(1, [(1, [0, 1, 2, 3])], project_id=2, borrowed=False)]

    result = plan([job(9, gpus=4, rank=URGENT)], [node(1, [], gpus=4)], busy, projects)

    assert result.preemptions == {}


def test_only_lower_classes_and_preemptible_ones_are_stopped():
    busy = [running(1, [(1, [0, 1, 2, 3])], rank=URGENT), running(2, [(2, [0, 1, 2, 3])], rank=LOW, preemptible=False)]

    result = plan([job(9, gpus=4, rank=HIGH)], [node(1, [], gpus=4), node(2, [], gpus=4)], busy)

    assert result.preemptions == {}


def test_attempts_already_stopping_are_waited_for_not_added_to():
    busy = [running(1, [(1, [0, 1, 2, 3])], preempting=True), running(2, [(2, [0, 1, 2, 3])])]

    result = plan([job(9, gpus=4, rank=URGENT)], [node(1, [], gpus=4), node(2, [], gpus=4)], busy)

    assert result.preemptions == {}
    assert result.waiting[9].code == "preempting"


def test_gpus_freed_for_a_preempting_job_are_not_given_to_a_lower_one():
    busy = [running(1, [(1, [0, 1, 2, 3])])]  # node 1: 4 busy, 4 free

    result = plan([job(9, gpus=8, rank=URGENT), job(10, gpus=1, rank=LOW)], [node(1, [4, 5, 6, 7])], busy)

    assert result.preemptions == {1: 9}
    assert placed(result) == {}


# --- backfill and estimates -----------------------------------------------------------


def test_backfill_does_not_delay_the_waiting_big_job():
    busy = [running(1, [(1, [0, 1, 2, 3])], rank=NORMAL, remaining=3600)]
    fleet = [node(1, [4, 5, 6, 7])]
    big, long_small, short_small = job(1, gpus=8), job(2, gpus=2, runtime=7200), job(3, gpus=2, runtime=1800)

    result = plan([big, long_small, short_small], fleet, busy)

    assert list(placed(result)) == [3]
    assert result.waiting[1].code == "capacity"
    assert result.waiting[2].code == "reserved" and "job 1" in result.waiting[2].message


def test_backfill_may_use_gpus_the_big_job_will_not_need():
    busy = [running(1, [(1, [0, 1, 2, 3])], rank=NORMAL, remaining=3600)]
    fleet = [node(1, [4, 5, 6, 7]), node(2, [0], gpus=1)]

    result = plan([job(1, gpus=8), job(2, gpus=1, runtime=7200)], fleet, busy)

    assert placed(result) == {2: [(2, [0])]}


def test_two_backfilled_jobs_do_not_share_one_spare_gpu():
    busy = [running(1, [(1, [0, 1, 2, 3, 4])], rank=NORMAL, remaining=3600)]
    fleet = [node(1, [5, 6, 7])]  # at the big job's start: 8 free, it needs 7, one spare

    result = plan([job(1, gpus=7), job(2, gpus=1, runtime=7200), job(3, gpus=1, runtime=7200)], fleet, busy)

    assert list(placed(result)) == [2]
    assert result.waiting[3].code == "reserved"


def test_estimated_starts_follow_the_queue_and_running_work():
    busy = [running(1, [(1, [0, 1, 2, 3])], remaining=600), running(2, [(1, [4, 5, 6, 7])], remaining=1200)]
    jobs = [job(1, gpus=4, runtime=300), job(2, gpus=8, runtime=100), job(3, gpus=2, gpu_type="B300")]

    starts = estimate_starts(jobs, [node(1, [])], busy)

    assert starts == {1: 600, 2: 1200, 3: None}


# --- a long queue on a busy fleet ------------------------------------------------------


class Forgetful(dict):
    """A pass's memo of settled shapes that never keeps one: every job decided in full."""

    def __setitem__(self, key, value) -> None:
        pass


def test_a_long_queue_is_decided_as_if_each_job_were_looked_at_in_full():
    """Once a shape finds no free GPUs, no victims and no reservation left to make, the pass
    tells its later jobs why they wait without deciding each again (policy.Pass.settled). On
    random busy fleets and long mixed queues, that changes no placement, preemption or reason."""
    from jobs.policy import Pass

    rng = random.Random(11)
    for _ in range(60):
        free = [(n, rng.choice([0, 0, 1, 2, 8]), rng.choice(["H100", "B300"])) for n in range(1, 5)]
        busy = [
            running(a, [(rng.randint(1, 4), [0])], rank=rng.choice([SCAVENGER, NORMAL, HIGH]),
                    preemptible=rng.random() < 0.5, borrowed=rng.random() < 0.5, project_id=rng.randint(1, 3))
            for a in range(1, rng.randint(2, 12))
        ]  # fmt: skip
        projects = {p: ProjectLimits(quota=rng.choice([0, 2, 8]), may_borrow=rng.random() < 0.8) for p in (1, 2, 3)}
        queue = [
            job(j, gpus=rng.choice([1, 1, 1, 2, 8]), nodes=rng.choice([1, 1, 2]), rank=rng.choice([LOW, NORMAL, HIGH]),
                project=rng.randint(1, 3), gpu_type=rng.choice(["", "", "B300"]),
                avoid=frozenset({rng.randint(1, 4)}) if rng.random() < 0.1 else frozenset())
            for j in range(1, 150)
        ]  # fmt: skip
        # Each pass takes GPUs out of its own lists and marks its own victims: a copy each.
        memo = Pass([node(*n) for n in free], [RunningAttempt(**vars(a)) for a in busy], projects)
        full = Pass([node(*n) for n in free], [RunningAttempt(**vars(a)) for a in busy], projects)
        full.settled = Forgetful()
        got, want = memo.run(queue), full.run(queue)

        assert got.placements == want.placements
        assert got.preemptions == want.preemptions
        assert got.waiting == want.waiting
        assert memo.settled  # the memo was used: most of such a queue waits


def test_a_shape_settled_for_one_project_is_decided_again_for_another():
    """Project 1's jobs find the fleet full of its own borrowed attempts (no victims for them)
    and use up the reservations; project 2's job of the same shape may still take back what
    project 1 borrowed."""
    fleet = [node(1, 0)]
    busy = [running(a, [(1, [a])], rank=NORMAL, project_id=1) for a in range(8)]  # borrowed
    projects = {1: ProjectLimits(quota=16), 2: ProjectLimits(quota=8)}
    queue = [job(j, project=1) for j in range(1, 11)] + [job(50, project=2)]

    result = plan(queue, fleet, busy, projects)

    assert all(result.waiting[j].code == "capacity" for j in range(1, 11))
    assert list(result.preemptions.values()) == [50]
    assert result.waiting[50].code == "preempting"
