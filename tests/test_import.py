"""The ways users import jdp."""
import subprocess
import sys

from conftest import REPO, child_env


def test_import_jdp_gives_the_core_step():
    code = ("import jdp, jdp.core; "
            "assert jdp.train_step is jdp.core.train_step, jdp.train_step; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], env=child_env(), cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_every_public_name_is_exported():
    import jdp
    missing = [name for name in jdp.__all__ if not hasattr(jdp, name)]
    assert missing == []
    for name in ("broadcast", "mesh", "preempted", "train_step", "eval_step", "replicate"):
        assert name in jdp.__all__
