"""Attribution of py-spy samples to Flying's code or SGLang's (``bench_hooks``)."""

import pytest

from workloads.microbench.bench_hooks import attribute, owner

pytestmark = pytest.mark.unit

SG = "run_batch (/v/site-packages/sglang/srt/managers/scheduler.py:4614)"
HOOK = "run_batch (/w/main/sglang_patches/scheduler.py:30)"
ENGINE = "next_batch (/w/main/flying/session/engine.py:160)"
TORCH = "forward (/v/site-packages/torch/nn/modules/module.py:1)"
JSON = "dumps (/py/lib/python3.11/json/__init__.py:231)"


def test_a_sample_belongs_to_the_innermost_project_or_sglang_frame():
    assert owner([SG, HOOK, SG, TORCH]) == "sglang"  # the original, called by the hook
    assert owner([SG, ENGINE, JSON]) == "flying"  # Flying's own work in a library
    assert owner([TORCH]) == "other"


def test_raw_stacks_are_counted_per_thread_and_owner():
    writer = "run (/w/main/flying/session/status_writer.py:80)"
    raw = (f"thread (7): MainThread;{SG};{HOOK};{SG};{TORCH} 40\n"
           f"thread (7): MainThread;{SG};{ENGINE};{JSON} 2\n\nthread (idle) x\n"
           f"thread (9): flying-status-0;{writer} 3\n"
           f"{SG};{ENGINE} 1\n")  # no thread prefix: counted as the loop's
    counts = attribute(raw)
    assert counts == {("loop", "sglang"): 40, ("loop", "flying"): 3,
                      ("off-loop", "flying"): 3}
