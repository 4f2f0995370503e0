"""gloo's connection lines never reach the launcher's console, also when a process with several
devices writes them from several threads at once and they interleave; the rank's other lines
do, and the log file keeps everything."""
import io

# private: the internals this test checks have no public name
from jdp.launch import _supervisor

INTERLEAVED = (
    "step 1 loss 0.5\n"
    "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n"
    "[Gloo] Rank [Gloo] Rank 01 is connected to  is connected to 11 peer ranks. peer ranks. "
    "Expected number of connected peer ranks is : Expected number of connected peer ranks is : "
    "11\n"
    " is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n"
    "step 2 loss 0.25\n")


def test_interleaved_gloo_lines_stay_off_the_console_and_in_the_log(capsys, tmp_path):
    log = open(tmp_path / "stdout", "w", encoding="utf-8")
    _supervisor._pump(io.BytesIO(INTERLEAVED.encode()), log, True, "stdout", "[rank0]: ", None)
    console = capsys.readouterr().out
    assert console == "[rank0]: step 1 loss 0.5\n[rank0]: step 2 loss 0.25\n", console
    assert (tmp_path / "stdout").read_text() == INTERLEAVED
