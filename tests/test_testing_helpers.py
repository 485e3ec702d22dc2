"""fived.testing's forked runs (run_forked: a CLI command in a forked child instead of a subprocess):
the child's exit code and output come back, a failure or a hang in it cannot pass for success."""

import sys
import time

import pytest

from fived.cli.main import main
from fived.testing import run_forked


def test_the_exit_code_and_the_output_come_back():
    done = run_forked(main, ["dryrun", "--model", "llama3-71b", "--nproc", "8", "--rank", "0"])
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("fived: error: model.name=llama3-71b: unknown preset"), done.stderr


def _prints_then_raises():
    print("before the failure")
    print("on stderr", file=sys.stderr)
    raise RuntimeError("the child failed")


def test_an_exception_in_the_child_is_a_failure_with_its_traceback():
    done = run_forked(_prints_then_raises)
    assert done.returncode == 1 and done.stdout == "before the failure\n"
    assert done.stderr.startswith("on stderr\n") and "RuntimeError: the child failed" in done.stderr


def test_a_child_past_its_time_is_killed():
    with pytest.raises(TimeoutError, match="still running after 0.5 s"):
        run_forked(time.sleep, 60, timeout_s=0.5)
