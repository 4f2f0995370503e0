"""What jdp's agreement points cost the coordination service, at up to 1,024 simulated
processes: threads that run the real agreement logic against the counting in-memory store
(`tests/doubles/memstore.py`). Each process must make the same few requests whatever the
number of processes, and the store must not grow with the number of agreement points.
"""
import threading

import pytest
from doubles import memstore

# private: the internals this test checks have no public name
from jdp.distributed import _agree

FIX = "build the same thing everywhere"


def _run(store, count, facts_of, topic_of=lambda rank, i: "tree", points=1, timeout_s=30.0,
         poll_s=60.0, ranks=None):
    """Every rank (a thread) makes `points` agreement points; rank -> exception or None."""
    outcome = {}

    def process(rank):
        me = _agree.Process(rank, count, {})
        try:
            for i in range(points):
                _agree.agree_in_store(store.client(rank), me, topic_of(rank, i),
                                      facts_of(rank, i), f"who{rank}", FIX, timeout_s, poll_s)
            outcome[rank] = None
        except Exception as e:  # noqa: BLE001 - the outcome under test
            outcome[rank] = e

    old = threading.stack_size(256 * 1024)
    try:
        threads = [threading.Thread(target=process, args=(r,), daemon=True)
                   for r in (range(count) if ranks is None else ranks)]
    finally:
        threading.stack_size(old)
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "an agreement point hung"
    return outcome


def _same(rank, i):
    return [("['w']", "float32[3]"), ("['b']", f"float32[{i % 3}]")]


@pytest.mark.parametrize("count", [8, 1024])
def test_one_agreement_point_costs_each_process_a_constant_number_of_requests(count):
    store = memstore.Store()
    assert _run(store, count, _same) == dict.fromkeys(range(count))
    requests = sorted(store.counts[r].requests for r in range(count))
    # the protocol: note where it waits, set its hash, count itself in, get the verdict;
    # the last to arrive also reads the hashes, writes the verdict and deletes the hashes
    assert requests == [4] * (count - 1) + [7]
    # and small messages: keys, a hash, the verdict; only the last reads every hash
    assert max(store.counts[r].sent for r in range(count)) < 300
    received = sorted(store.counts[r].received for r in range(count))
    assert received[-2] < 64 and received[-1] >= 32 * count


def test_a_thousand_agreement_points_leave_no_more_keys_than_one():
    store = memstore.Store()
    assert _run(store, 3, _same, points=1) == dict.fromkeys(range(3))
    after_one = store.keys()
    assert _run(store, 3, _same, points=999) == dict.fromkeys(range(3))
    assert len(store.keys()) <= len(after_one)
    # the `at` key of each process, and the last point's counter and verdict
    assert sorted(k.rsplit("/", 2)[-1] if "/at/" not in k else "at" for k in store.keys()) == [
        "arrived", "at", "at", "at", "verdict"]


def test_a_difference_names_the_first_differing_fact_and_both_sides_on_every_process():
    store = memstore.Store()
    odd = {5, 9}

    def facts(rank, i):
        return [("['w']", "float32[3]"), ("['b']", "float32[4]" if rank in odd else "float32[2]")]

    outcome = _run(store, 16, facts)
    want = ("the processes disagree on ['b']: float32[2] on process(es) 0, 1, 2, 3, 4, 6, 7, 8, "
            f"... but float32[4] on process(es) 5, 9; {FIX}")
    for rank in range(16):
        assert isinstance(outcome[rank], ValueError), outcome[rank]
        assert str(outcome[rank]) == f"who{rank}: {want}"


def test_processes_on_different_paths_are_named_on_every_process_within_a_poll():
    store = memstore.Store()
    outcome = _run(store, 4, _same, topic_of=lambda rank, i: "loader" if rank == 1 else "tree",
                   timeout_s=60.0, poll_s=0.05)
    assert str(outcome[0]).startswith("who0: process 0 waits here (call 1) while process 1 "
                                      "waits in who1 (call 1), which process 0 has not reached")
    assert str(outcome[1]).startswith("who1: process 1 waits here (call 1) while process 0 "
                                      "waits in who0 (call 1), which process 1 has not reached")
    for rank in (2, 3):   # process 0's finding is their verdict
        assert str(outcome[rank]) == str(outcome[0])
    assert all(isinstance(e, RuntimeError) for e in outcome.values())


def test_a_process_that_never_comes_is_named_after_the_timeout():
    store = memstore.Store()
    outcome = _run(store, 5, _same, timeout_s=0.3, poll_s=0.05, ranks=[0, 1, 2, 4])
    for rank in (0, 1, 2, 4):
        assert isinstance(outcome[rank], TimeoutError), outcome[rank]
        assert "process(es) 3 did not reach this call within 0.3 s" in str(outcome[rank])


def test_the_in_job_watchdog_names_a_stuck_rank_of_a_job_without_a_launcher(tmp_path, tag):
    # the srun/mpirun path (JDP_PROGRESS_TIMEOUT, no supervisor) with torchrun's variables
    from conftest import run_ranks, wait_until_gone, write_script
    from test_fault_mpirun import STUCK, STUCK_LINE
    script = write_script(tmp_path, "stuck.py", STUCK)
    codes, logs = run_ranks([script], timeout=90, JDP_PROGRESS_TIMEOUT="4", JDP_TEST_TAG=tag)
    assert codes == [124, 124], logs
    report = logs[0][logs[0].index("jdp: no rank made progress"):]
    assert "(JDP_PROGRESS_TIMEOUT): rank 1 stuck at step 4 in phase step" in report, report
    assert f'File "{script}", line {STUCK_LINE}, in <module>' in report, report
    assert wait_until_gone(tag, timeout=5.0) < 5.0


def test_the_roll_call_gathers_hundreds_of_processes_with_one_connection_each():
    from conftest import free_port

    # private: the internals this test checks have no public name
    from jdp.distributed import _rendezvous
    count, port, left = 300, free_port(), {}

    def process(rank):
        try:
            conns, left[rank] = _rendezvous.roll_call("127.0.0.1", port, rank, count, 60)
            for conn in conns.values():   # kept open for the job's lost-peer watch: close here
                conn.close()
        except Exception as e:  # noqa: BLE001 - the outcome under test
            left[rank] = e

    threads = [threading.Thread(target=process, args=(r,), daemon=True) for r in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert sorted(left) == list(range(count))
    assert all(isinstance(s, int) and 1 <= s <= 60 for s in left.values()), left


def test_the_scaling_table_rows_are_counted_not_guessed():
    from benchmarks import bench_coordination
    rows = bench_coordination.agreement_rows(counts=(2, 16), before_up_to=16)
    for row in rows:
        n = row[0]
        # after, over 3 points: 4 requests per process, and the one that judges a point 3 more
        # (4 from the second point on: it deletes the previous point's keys);
        # before: N + 3 requests per process (3 sets, N gets), N^2 + 3N at the coordinator
        assert row[1].startswith(f"{4 + (3 + 4 + 4) / (3 * n):.2f}"), row
        assert row[2] == f"{n + 3} / {n + 3}" and row[6] == f"{n * n + 3 * n:,}", row
    (n, _, period, per_s, *_), = bench_coordination.watchdog_rows(((4, 10.0),), seconds=1.0)
    assert (n, period) == (4, "0.5") and 0 < float(per_s) <= 2 / 0.5 + 1   # set + wait a period
    assert [r[-1] for r in bench_coordination.roll_call_rows(counts=(2, 8))] == ["ok", "ok"]


ROLL_CALL_UNDER_A_LOW_LIMIT = """
import resource, socket, sys, threading
# private: the internals this test checks have no public name
from jdp.distributed import _rendezvous
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
count, failed = 100, []

def process(rank):
    try:
        conns, _ = _rendezvous.roll_call("127.0.0.1", port, rank, count, 60)
        for conn in conns.values():
            conn.close()
    except Exception as e:
        failed.append(repr(e))

threads = [threading.Thread(target=process, args=(r,)) for r in range(count)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("FAILED", len(failed), failed[:1])
"""


def test_process_0_makes_room_for_every_connection_of_the_roll_call(tmp_path):
    # 100 processes in one: ~200 sockets under a soft limit of 64 open files
    from conftest import run_python, write_script
    done = run_python([write_script(tmp_path, "low.py", ROLL_CALL_UNDER_A_LOW_LIMIT)],
                      timeout=120)
    assert "FAILED 0 []" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
