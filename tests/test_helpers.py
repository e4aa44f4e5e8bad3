"""The test plumbing itself: a hung run reports where each of its processes was."""

from __future__ import annotations

import pytest

from tests.helpers import run_script

HANGS = """
import os, signal, time
if os.fork() == 0:
    os.setpgrp()  # as a DataLoader worker does: out of the process group, found through its parent
    time.sleep(600)  # the child's line
time.sleep(600)  # the parent's line
"""


@pytest.mark.slow  # a torchrun of 2 processes (fast tier budget)
def test_a_hung_run_reports_the_stacks_of_all_its_processes(tmp_path):
    script = tmp_path / "hangs.py"
    script.write_text(HANGS)
    with pytest.raises(AssertionError, match="hung: still running after 3 s") as failure:
        run_script(str(script), timeout=3)
    report = str(failure.value)
    assert "Fatal Python error: Aborted" in report
    assert f'File "{script}", line 5 in <module>' in report  # the child, outside the process group
    assert f'File "{script}", line 6 in <module>' in report  # the parent
