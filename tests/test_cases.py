"""The case runner itself (``tests/cases.py``, ``tests/workers/cases.py``): what it records for a case that
ends well, one that raises and one that hangs, in one real launch of a plain ``python`` process."""

from __future__ import annotations

import pytest

from tests.cases import Launch, case

PROBE = Launch("python", 1, group="probe")  # its hanging case ends the launch: none other shares it
OK, RAISES = case(PROBE, "probe-ok", "probe", "ok"), case(PROBE, "probe-raises", "probe", "raise")
HANGS = case(PROBE, "probe-hangs", "probe", "hang", timeout=3)
AFTER = case(PROBE, "probe-after-the-hang", "probe", "ok")


@pytest.mark.cases(OK, RAISES, HANGS, AFTER)
def test_each_case_is_recorded_and_a_hang_fails_its_case_only(cases):
    assert cases[OK].ranks == [{"mode": "ok", "rank": 0}]
    assert [(s["status"], s["type"], s["message"]) for s in cases[RAISES].statuses] == [
        ("error", "ValueError", "refused, as a strategy refuses")
    ]
    assert cases[RAISES].errors() == [("ValueError", "refused, as a strategy refuses")]
    hung = cases[HANGS]
    assert [s["status"] for s in hung.statuses] == ["running"]  # the watchdog ended the process in the case
    assert "Timeout (0:00:03)!" in hung.case_output and "in <module>" in hung.case_output  # the traceback
    assert [s["status"] for s in cases[AFTER].statuses] == ["not run"]
    with pytest.raises(pytest.fail.Exception, match="case 'probe-hangs' .* rank 0: running"):
        hung.ranks  # noqa: B018
