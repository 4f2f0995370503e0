"""A failure no restart can mend (an error with `jdp_exit_code = FINAL_EXIT`: a replica
group whose set-up differs from the others') ends its rank with status 78."""
from jdp.job.run import FINAL_EXIT, failure_code


def test_the_exit_status_of_a_failed_rank():
    final = RuntimeError("groups differ")
    final.jdp_exit_code = FINAL_EXIT
    assert failure_code(final) == 78
    assert failure_code(RuntimeError("x")) == 1
    assert failure_code(KeyboardInterrupt()) == 130
    odd = RuntimeError("x")
    odd.jdp_exit_code = "no"
    assert failure_code(odd) == 1
