"""The launcher's scratch directories (`jdp.launch._scratch`): named for their owner, and
those of a launcher that is gone removed by the next one on the host, never another's."""
import os

from jdp.launch import _scratch


def _gone_pid() -> int:
    """A pid no process has: Linux gives pids below pid_max."""
    with open("/proc/sys/kernel/pid_max") as f:
        return int(f.read())


def test_a_pid_is_alive_while_its_process_runs():
    assert _scratch._alive(os.getpid()) and _scratch._alive(os.getppid())
    assert not _scratch._alive(_gone_pid())


def test_only_the_directories_of_a_gone_launcher_of_this_host_are_removed(tmp_path):
    host, gone = _scratch._host(), _gone_pid()
    names = {
        "gone": f"jdp-watch-{host}-{gone}-abc123",
        "mine": f"jdp-watch-{host}-{os.getpid()}-def456",
        "alive": f"jdp-watch-{host}-{os.getppid()}-ghi789",
        "other host": f"jdp-watch-{host}x-{gone}-jkl012",
        "other kind": f"jdp-ft-{host}-{gone}-mno345",
        "no pid": f"jdp-watch-{host}-notapid-pqr678",
    }
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "progress.0").write_bytes(b"\0" * 64)
    (tmp_path / f"jdp-watch-{host}-{gone}-afile").write_text("a file, not a directory")
    assert _scratch.sweep("watch", str(tmp_path)) == [str(tmp_path / names["gone"])]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [*(n for k, n in names.items() if k != "gone"), f"jdp-watch-{host}-{gone}-afile"])


def test_a_new_directory_is_named_for_its_owner_and_sweeps_first(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    stale = tmp_path / f"jdp-spawn-{_scratch._host()}-{_gone_pid()}-old000"
    stale.mkdir()
    with _scratch.held("spawn") as path:
        assert os.path.basename(path).startswith(f"jdp-spawn-{_scratch._host()}-{os.getpid()}-")
        assert os.path.isdir(path) and not stale.exists()
    assert not os.path.exists(path)


def test_a_host_name_with_dashes_keeps_the_name_s_fields_apart(monkeypatch):
    monkeypatch.setattr("socket.gethostname", lambda: "node-1-a")
    assert _scratch._host() == "node_1_a"
    assert _scratch._prefix("watch", 42) == "jdp-watch-node_1_a-42-"
