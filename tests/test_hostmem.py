"""megatrain_jax/hostmem.py: the training commands run with glibc's allocations on transparent
huge pages (a re-run of the command with GLIBC_TUNABLES), unless told not to or unavailable."""

import os
import subprocess
import sys

import pytest

from megatrain_jax import hostmem


def test_huge_pages_env_adds_the_tunable_once_and_respects_the_user():
    env = hostmem.huge_pages_env({"PATH": "/bin"}, "madvise")
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": hostmem.TUNABLE}
    env = hostmem.huge_pages_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "always")
    assert env["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{hostmem.TUNABLE}"
    assert hostmem.huge_pages_env({"GLIBC_TUNABLES": hostmem.TUNABLE}, "madvise") is None  # done
    # the user's own setting of the tunable, the opt-out, and a kernel without THP: left alone
    assert hostmem.huge_pages_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "madvise") is None
    assert hostmem.huge_pages_env({hostmem.OPT_OUT: "0"}, "madvise") is None
    assert hostmem.huge_pages_env({}, "never") is None


def test_thp_setting_reads_the_kernels_mode(tmp_path):
    path = tmp_path / "enabled"
    path.write_text("always [madvise] never\n")
    assert hostmem.thp_setting(str(path)) == "madvise"
    assert hostmem.thp_setting(str(tmp_path / "missing")) == "never"


CHILD = ("import os; from megatrain_jax import hostmem; hostmem.with_huge_pages(); "
         "print(os.environ.get('GLIBC_TUNABLES'), hostmem.huge_pages_on())")


@pytest.mark.parametrize("opt_out", [False, True], ids=["default", "opted_out"])
def test_with_huge_pages_runs_the_command_again_with_the_tunable(opt_out):
    if hostmem.thp_setting() == "never":
        pytest.skip("this kernel has no transparent huge pages")
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", hostmem.OPT_OUT)}
    if opt_out:
        env[hostmem.OPT_OUT] = "0"
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    expected = "None False" if opt_out else f"{hostmem.TUNABLE} True"
    assert proc.stdout.strip() == expected
