"""Pure placement: the queue's decisions from jobs, GPU views, limits and order (no I/O, no clock)."""

from __future__ import annotations

import dataclasses

from gpu_mon.config import QueueSection
from gpu_mon.policy.decisions import Busy, Reason, Who
from gpu_mon.queue import jobs as J
from gpu_mon.queue.jobs import Job
from gpu_mon.queue.placement import (
    CancelJob,
    ConfirmJob,
    GpuView,
    PreemptJob,
    PreemptWorkload,
    StartJob,
    TimeUp,
    Waiting,
    later,
    never_fits,
    place,
    stops,
)
from gpu_mon.queue.words import refusal, waiting

G0, G1 = "GPU-0", "GPU-1"
NOW, WALL = 1000.0, 1_700_000_000.0
BOB = Reason(Busy.HOLDER, who=Who("bob", "python3", 4242), path="/dev/nvidia1")


def job(i: int, user: str = "alice", **kw: object) -> Job:
    base = dict(
        id=i, user=user, uid=1000, gid=1000, command=("x",), cwd="/", env=(), output="", submitted=WALL
    )
    base.update(kw)
    return Job(**base)  # type: ignore[arg-type]


def free(uuid: str, since: float = 0.0, **kw: object) -> GpuView:
    return GpuView(uuid, False, None, since, **kw)  # type: ignore[arg-type]


TWO_FREE = (free(G0), free(G1))


def run(jobs, gpus=TWO_FREE, delay=0.0, **queue: object):
    return place(jobs, gpus, QueueSection(**queue), delay, NOW, WALL)  # type: ignore[arg-type]


def test_a_queued_job_starts_on_a_free_gpu_and_the_next_one_on_the_other():
    p = run([job(1), job(2, "bob"), job(3)])
    assert p.starts == (StartJob(1, (G0,)), StartJob(2, (G1,)))
    assert p.waiting == {3: Waiting("taken", gpu=G0, by_job="1")}
    assert p.claimed == {G0: 1, G1: 2}


def test_a_busy_gpu_is_never_used_and_the_first_waiter_says_why_the_rest_how_many_are_ahead():
    gpus = (GpuView(G0, True, BOB), GpuView(G1, True, BOB))
    p = run([job(1), job(2), job(3)], gpus)
    assert p.starts == ()
    assert p.waiting[1] == Waiting("busy", gpu=G0, reason=BOB)
    assert p.waiting[2] == Waiting("ahead", count=1)
    assert p.waiting[3] == Waiting("ahead", count=2)
    index = {G0: 0, G1: 1}
    assert waiting(p.waiting[1], "alice", index, NOW) == (
        "waiting: GPU 0 busy: bob python3[4242] holds /dev/nvidia1"
    )
    assert waiting(p.waiting[3], "alice", index, NOW) == "waiting: 2 jobs ahead"


def test_someone_else_on_a_running_jobs_gpu_preempts_it():
    running = job(1, state=J.RUNNING, gpus=(G0,), started=WALL - 5)
    p = run([running], (GpuView(G0, True, BOB), free(G1)))
    assert p.preempt_jobs == (PreemptJob(1, G0, BOB),)
    assert p.starts == ()


def test_a_holder_of_a_running_jobs_gpu_stops_it_only_once_it_has_held_it_brief_open_seconds():
    running = job(1, state=J.RUNNING, gpus=(G0,), started=WALL - 5)
    held = lambda since: (GpuView(G0, True, BOB, held_since=since), free(G1))  # noqa: E731
    # first seen 0.125 s ago: looked at again 0.125 s from now (brief_open_seconds 0.25), running meanwhile
    for p in (
        run([running], held(NOW - 0.125), brief_open_seconds=0.25),
        stops([running], held(NOW - 0.125), NOW, WALL, 0.25),
    ):
        assert p.preempt_jobs == () and p.confirms == (ConfirmJob(1, G0, BOB, NOW + 0.125),)
        assert p.next_wake == NOW + 0.125
    # still held 0.3 s (the default) after it was first seen: stopped
    for p in (run([running], held(NOW - 0.3)), stops([running], held(NOW - 0.3), NOW, WALL, 0.3)):
        assert p.preempt_jobs == (PreemptJob(1, G0, BOB),) and p.confirms == ()
    # 0: at once (as before)
    p = run([running], held(NOW), brief_open_seconds=0.0)
    assert p.preempt_jobs == (PreemptJob(1, G0, BOB),)
    # busy for another reason (a context, memory, an unreadable process: held_since None): at once
    ctx = Reason(Busy.CONTEXT, who=Who("bob", "python3", 4242), pid=4242, context="compute", mib=500)
    p = stops([running], (GpuView(G0, True, ctx), free(G1)), NOW, WALL, 0.3)
    assert p.preempt_jobs == (PreemptJob(1, G0, ctx),)


def test_a_job_with_a_holder_to_confirm_still_meets_its_time_limit_and_its_other_gpus_stop_it():
    over = job(1, state=J.RUNNING, gpus=(G0,), started=WALL - 10, time_limit=5.0)
    p = stops([over], (GpuView(G0, True, BOB, held_since=NOW),), NOW, WALL, 0.25)
    assert p.time_up == (TimeUp(1),) and p.confirms == (ConfirmJob(1, G0, BOB, NOW + 0.25),)
    two = job(2, state=J.RUNNING, gpus=(G0, G1), started=WALL - 5, gpus_wanted=2)
    gpus = (GpuView(G0, True, BOB, held_since=NOW), GpuView(G1, True, BOB, held_since=NOW - 1))
    assert stops([two], gpus, NOW, WALL, 0.3).preempt_jobs == (PreemptJob(2, G1, BOB),)


def test_the_start_delay_is_waited_for_and_woken_up_for():
    p = run([job(1)], (free(G0, since=NOW - 1),), delay=5.0)
    # the wake is monotonic (as the GPUs' times); the reason's time wall-clock (as `jobs` reads it)
    assert p.starts == () and p.waiting[1] == Waiting("start_delay", until=WALL + 4, starting=0)
    assert p.next_wake == NOW + 4
    assert waiting(p.waiting[1], "alice", {}, WALL + 1) == "waiting: GPU free, starting in 3 s"


def test_a_job_in_its_start_delay_counts_as_starting_for_the_running_limit():
    p = run([job(1), job(2)], (free(G0, since=NOW), free(G1, since=NOW)), delay=5.0, max_running_per_user=1)
    assert p.waiting[2] == Waiting("running_limit", count=1, limit=1, starting=1)
    assert waiting(p.waiting[2], "alice", {}, WALL) == "waiting: alice has 1 starting (limit 1)"
    running = job(3, state=J.RUNNING, gpus=(G0,), started=WALL)
    p = run([running, job(1), job(2)], (free(G0), free(G1, since=NOW)), delay=5.0, max_running_per_user=2)
    assert waiting(p.waiting[2], "alice", {}, WALL) == "waiting: alice has 1 running and 1 starting (limit 2)"


def test_a_placement_carried_on_in_time_starts_what_placing_again_then_would():
    # At a start delay's end the runner carries the placement on instead of placing every job again.
    g2 = "GPU-2"
    timed = job(4, state=J.RUNNING, gpus=(g2,), started=WALL - 1, time_limit=60.0)
    jobs = [job(1), job(2, "bob"), job(3), timed]
    gpus = (free(G0, since=NOW - 1), free(G1, since=NOW - 3), free(g2))
    q = QueueSection(order="fifo")
    then = place(jobs, gpus, q, 5.0, NOW, WALL)
    assert then.starts == () and [(s.start.job, s.at) for s in then.soon] == [(1, NOW + 4), (2, NOW + 2)]
    assert then.next_wake == NOW + 2
    for t in (NOW + 1, NOW + 2, NOW + 3, NOW + 4, NOW + 59, NOW + 70):
        carried, fresh = later(then, t), place(jobs, gpus, q, 5.0, t, WALL + (t - NOW))
        assert carried.starts == fresh.starts
        assert carried.waiting == fresh.waiting and carried.claimed == fresh.claimed
        assert carried.next_wake == fresh.next_wake  # (the time limit's wake, once no start is left)
    assert later(then, NOW + 2).starts == (StartJob(2, (G1,)),)
    assert later(then, NOW + 4).next_wake == NOW + 59


def test_fifo_runs_one_users_ten_jobs_before_anothers_one_and_fair_does_not():
    jobs = [job(i) for i in range(1, 11)] + [job(11, "bob")]
    fifo = run(jobs, (free(G0), free(G1)), order="fifo")
    assert [s.job for s in fifo.starts] == [1, 2]
    fair = run(jobs, (free(G0), free(G1)), order="fair")
    assert [s.job for s in fair.starts] == [1, 11]


def test_fair_puts_the_user_with_fewer_gpu_seconds_first_then_priority():
    used = job(1, state=J.DONE, gpu_seconds=3600.0, ended=WALL - 60)
    jobs = [used, job(2), job(3, "bob"), job(4, "carol", priority=5)]
    p = run(jobs, (free(G0),), order="fair")
    assert p.starts == (StartJob(4, (G0,)),)  # carol and bob have used nothing; carol's priority is higher
    old = dataclasses.replace(used, ended=WALL - 2 * 86400)  # outside the 24 h window: it no longer counts
    p = run([old, job(2), job(3, "bob")], (free(G0),), order="fair")
    assert p.starts == (StartJob(2, (G0,)),)


def test_limits_per_user():
    running = job(1, state=J.RUNNING, gpus=(G0,), started=WALL)
    p = run([running, job(2), job(3, "bob")], max_running_per_user=1)
    assert p.starts == (StartJob(3, (G1,)),)
    assert p.waiting[2] == Waiting("running_limit", count=1, limit=1)
    assert waiting(p.waiting[2], "alice", {}, NOW) == "waiting: alice has 1 running (limit 1)"
    p = run([running, job(2, gpus_wanted=1)], max_gpus_per_user=1)
    assert p.waiting[2] == Waiting("gpu_limit", count=1, limit=1)


def test_after_waits_for_done_and_cancels_on_a_failed_dependency():
    p = run([job(1, state=J.RUNNING, gpus=(G0,), started=WALL), job(2, after=(1,))])
    assert p.waiting[2] == Waiting("after", after="1") and p.starts == ()
    assert waiting(p.waiting[2], "alice", {}, NOW) == "waiting: after job 1"
    p = run([job(1, state=J.DONE), job(2, after=(1,))])
    assert p.starts == (StartJob(2, (G0,)),)
    p = run([job(1, state=J.FAILED), job(2, after=(1,)), job(3, after=(9,), state=J.HELD)])
    assert p.cancels == (CancelJob(2, 1, J.FAILED), CancelJob(3, 9, ""))


def test_jobs_after_the_same_jobs_each_get_their_own_cancel_wait_or_start():
    # (judged once for all of them: a sweep behind one job)
    behind = [job(2, after=(1,)), job(3, after=(1,), state=J.HELD), job(4, after=(1,))]
    p = run([job(1, state=J.FAILED), *behind])
    assert p.cancels == (CancelJob(2, 1, J.FAILED), CancelJob(3, 1, J.FAILED), CancelJob(4, 1, J.FAILED))
    p = run([job(1, state=J.RUNNING, gpus=(G0,)), job(2, after=(1,)), job(3, after=(1,), state=J.HELD)])
    assert p.waiting == {2: Waiting("after", after="1")}
    p = run([job(1, state=J.DONE), job(2, after=(1,)), job(3, after=(1,)), job(4, after=(1,))])
    assert p.starts == (StartJob(2, (G0,)), StartJob(3, (G1,)))
    assert p.waiting == {4: Waiting("taken", gpu=G0, by_job="2")}


def test_a_job_takes_a_gpu_from_a_workload_unless_told_not_to():
    gpus = (free(G0, workload="miner"),)
    p = run([job(1)], gpus)
    assert p.preempt_workloads == (PreemptWorkload("miner", 1, G0),)
    assert p.starts == () and p.claimed == {G0: 1}
    p = run([job(1)], (free(G0, workload="miner", workload_stopping=True),))
    assert p.preempt_workloads == () and p.claimed == {G0: 1}  # (already stopping: wait for it)
    p = run([job(1)], gpus, preempt_workloads=False)
    assert p.preempt_workloads == () and p.claimed == {}
    assert p.waiting[1] == Waiting("taken", gpu=G0, by_workload="miner")


def test_a_free_gpu_is_preferred_over_one_a_workload_uses():
    p = run([job(1)], (free(G0, workload="miner"), free(G1)))
    assert p.starts == (StartJob(1, (G1,)),) and p.preempt_workloads == ()


def test_multi_gpu_jobs_and_too_many_gpus():
    p = run([job(1, gpus_wanted=2)])
    assert p.starts == (StartJob(1, (G0, G1)),)
    p = run([job(1, gpus_wanted=3)])
    assert p.waiting[1] == Waiting("too_many_gpus", count=2)
    assert waiting(p.waiting[1], "alice", {}, NOW) == "waiting: wants more GPUs than the queue has (2)"


def test_a_job_over_a_per_job_or_per_user_gpu_limit_says_it_can_never_start():
    for limits, kind, words in (
        ({"max_gpus_per_job": 1}, "over_job_limit", "waiting: wants 2 GPUs, over the limit of 1 per job"),
        ({"max_gpus_per_user": 1}, "over_user_limit", "waiting: wants 2 GPUs, over the limit of 1 per user"),
    ):
        p = run([job(1, gpus_wanted=2)], **limits)
        assert p.waiting[1] == Waiting(kind, count=2, limit=1) and p.starts == ()
        assert waiting(p.waiting[1], "alice", {}, NOW) == words
    assert never_fits(2, 2, QueueSection(max_gpus_per_user=2, max_gpus_per_job=2)) is None
    assert never_fits(3, 2, QueueSection()) == Waiting("too_many_gpus", count=2)
    assert (
        refusal(never_fits(3, 2, QueueSection()), 3)
        == "--gpus 3: the queue has 2 GPUs; the job could never start"
    )
    assert refusal(never_fits(3, 8, QueueSection(max_gpus_per_user=2)), 3) == (
        "--gpus 3 is over the limit of 2 per user"
    )


def test_a_time_limit_ends_a_running_job_and_is_woken_up_for():
    p = run([job(1, state=J.RUNNING, gpus=(G0,), started=WALL - 10, time_limit=5.0)])
    assert p.time_up == (TimeUp(1),)
    p = run([job(1, state=J.RUNNING, gpus=(G0,), started=WALL - 1, time_limit=5.0)])
    assert p.time_up == () and p.next_wake == NOW + 4


def test_held_and_ended_jobs_never_start():
    p = run([job(1, state=J.HELD), job(2, state=J.CANCELLED), job(3, state=J.DONE)])
    assert p.starts == () and p.waiting == {}


def test_ten_thousand_queued_jobs_each_get_a_reason():
    jobs = [job(i, f"user{i % 50}") for i in range(1, 10001)]
    gpus = tuple(GpuView(f"GPU-{i}", True, BOB) for i in range(8))
    p = run(jobs, gpus)
    assert len(p.waiting) == 10000
    assert sorted(w.count for w in p.waiting.values() if w.kind == "ahead") == list(range(1, 10000))


def test_the_yield_path_part_sees_only_running_jobs():
    running = job(1, state=J.RUNNING, gpus=(G0,), started=WALL - 10, time_limit=60.0)
    over = job(2, state=J.RUNNING, gpus=(G1,), started=WALL - 10, time_limit=5.0)
    s = stops([running, over, job(3)], (GpuView(G0, True, BOB), free(G1)), NOW, WALL)
    assert s.preempt_jobs == (PreemptJob(1, G0, BOB),) and s.time_up == (TimeUp(2),)
    assert s.starts == () and s.waiting == {}


# ---------------------------------------------------------------- the head's reservation (backfill)

A_RUNS = job(1, "alice", state=J.RUNNING, gpus=(G0,), started=WALL - 1)  # one GPU, no time limit


def test_the_head_keeps_a_gpu_that_frees_from_a_stream_of_one_gpu_jobs_in_fair_order():
    # The case: alice streams one-GPU jobs; carol, first in the fair order, wants both GPUs. G1
    # freed: it is kept for carol, not handed to alice's next job.
    used = job(9, "alice", state=J.DONE, gpu_seconds=600.0, ended=WALL - 5)
    p = run([used, A_RUNS, job(2, "alice"), job(3, "carol", gpus_wanted=2)], (free(G0), free(G1)))
    assert p.starts == ()
    assert p.waiting[3] == Waiting("taken", gpu=G0, by_job="1")
    assert p.waiting[2] == Waiting("kept", gpu=G1, by_job="3")
    assert waiting(p.waiting[2], "alice", {G0: 0, G1: 1}, NOW) == "waiting: GPU 1 kept for job 3"
    assert p.reservation is not None and p.reservation.job == 3
    assert set(p.reservation.gpus) == {G0, G1} and p.reservation.start is None  # (alice's job: no limit)
    assert p.kept == {G1: 3} and p.claimed == {G0: 1}
    assert 3 not in p.estimates and 2 not in p.estimates  # unknown: the job ahead has no time limit
    # alice's job ends: carol's starts on both
    p = run([used, job(2, "alice"), job(3, "carol", gpus_wanted=2)], (free(G0), free(G1)))
    assert p.starts == (StartJob(3, (G0, G1)),) and p.waiting[2] == Waiting("taken", gpu=G0, by_job="3")


def test_fifo_reserves_for_the_first_submitted_and_fair_for_the_first_in_fair_order():
    used = job(9, "alice", state=J.DONE, gpu_seconds=600.0, ended=WALL - 5)
    jobs = [used, A_RUNS, job(2, "alice"), job(3, "carol", gpus_wanted=2)]
    fifo = run(jobs, (free(G0), free(G1)), order="fifo")
    assert fifo.starts == (StartJob(2, (G1,)),)  # alice's job 2 is first: it is not kept from anything
    assert fifo.reservation is not None and fifo.reservation.job == 3 and fifo.kept == {}
    fair = run(jobs, (free(G0), free(G1)), order="fair")
    assert fair.starts == () and fair.kept == {G1: 3}
    # fifo with carol's job first: kept for her
    jobs = [used, A_RUNS, job(2, "carol", gpus_wanted=2), job(3, "alice")]
    fifo = run(jobs, (free(G0), free(G1)), order="fifo")
    assert fifo.starts == () and fifo.waiting[3] == Waiting("kept", gpu=G1, by_job="2")


def test_a_later_job_backfills_a_kept_gpu_only_when_its_time_limit_ends_before_the_reserved_start():
    limited = dataclasses.replace(A_RUNS, started=WALL - 10, time_limit=100.0)  # ends at WALL + 90
    head = job(2, "carol", gpus_wanted=2, time_limit=60.0)
    for delay in (0.0, 5.0):  # (a GPU is ready for the head the start delay after the job on it ends)
        gpus = (free(G0, since=NOW - 10), free(G1, since=NOW - 10))
        short = run([limited, head, job(3, "bob", time_limit=90.0)], gpus, delay, order="fifo")
        assert short.reservation is not None and short.reservation.start == WALL + 90 + delay
        assert short.starts == (StartJob(3, (G1,)),) and short.kept == {G1: 2}
        assert short.estimates[2] == WALL + 90 + delay
        long = run([limited, head, job(3, "bob", time_limit=91.0)], gpus, delay, order="fifo")
        assert long.starts == () and long.waiting[3] == Waiting("kept", gpu=G1, by_job="2")
        assert long.estimates[3] == WALL + 90 + delay + 60 + delay  # (behind the head, after its limit)
        unlimited = run([limited, head, job(3, "bob")], gpus, delay, order="fifo")
        assert unlimited.starts == () and unlimited.waiting[3].kind == "kept"


def test_estimates_follow_the_time_limits_of_the_jobs_ahead():
    limited = dataclasses.replace(A_RUNS, started=WALL - 10, time_limit=100.0)  # G0 ready at WALL + 90
    other = job(5, "dave", state=J.RUNNING, gpus=(G1,), started=WALL, time_limit=30.0)  # G1 at WALL + 30
    jobs = [limited, other, job(2, "carol", gpus_wanted=2, time_limit=60.0), job(3, "bob"), job(4, "bob")]
    p = run(jobs, (free(G0), free(G1)), order="fifo")
    assert p.reservation is not None and p.reservation.start == WALL + 90
    assert p.estimates == {2: WALL + 90, 3: WALL + 150, 4: WALL + 150}  # (after carol's 60 s, on both)
    assert p.waiting[3] == Waiting("ahead", count=1)


def test_a_gpu_busy_with_a_foreign_user_is_not_ours_to_promise_no_reservation_keeps_the_other():
    gpus = (free(G0), GpuView(G1, True, BOB))
    p = run([job(2, "carol", gpus_wanted=2), job(3, "alice")], gpus, order="fifo")
    assert p.reservation is None and p.kept == {}
    assert p.waiting[2] == Waiting("busy", gpu=G1, reason=BOB)
    assert p.starts == (StartJob(3, (G0,)),)
    # nor a workload's GPU the queue may not stop
    gpus = (free(G0), free(G1, workload="miner"))
    p = run([job(2, "carol", gpus_wanted=2), job(3, "alice")], gpus, order="fifo", preempt_workloads=False)
    assert p.reservation is None and p.starts == (StartJob(3, (G0,)),)


def test_a_job_held_by_its_own_limit_or_dependency_is_not_the_head():
    running = job(1, "carol", state=J.RUNNING, gpus=(G0,), started=WALL)
    jobs = [running, job(2, "carol", gpus_wanted=2), job(3, "alice")]
    p = run(jobs, (free(G0), free(G1)), order="fifo", max_running_per_user=1)
    assert p.waiting[2].kind == "running_limit" and p.starts == (StartJob(3, (G1,)),)
    jobs = [running, job(2, "bob", gpus_wanted=2, after=(1,)), job(3, "alice")]
    p = run(jobs, (free(G0), free(G1)), order="fifo")
    assert p.waiting[2].kind == "after" and p.starts == (StartJob(3, (G1,)),) and p.reservation is None
