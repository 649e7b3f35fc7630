"""The chaos suite's short form, as CI runs it (the long form: see tests/chaos/chaos.py)."""

from __future__ import annotations

import pytest

from tests.chaos import chaos
from tests.support.services import Services

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # it restarts the broker


# Slow (~16 s): three relay processes, six SIGKILLs 2 s apart while 3,000 messages are committed,
# a broker restart, then the drain (tests/chaos/chaos.py); every kill must hit traffic. Serial: it
# restarts the broker.
def test_chaos_short_form(svc: Services) -> None:
    report = chaos.run(svc, chaos.Plan(messages=3000, kills=6, kill_every=2.0))
    print("\n".join(report.lines()))  # shown with -s, and on failure
    assert report.broker_restarts == 1
    assert report.sessions_terminated >= 1
    assert report.kills == 6
    assert report.lost == 0
    assert report.leaked == 0
    assert report.strangers == 0
    assert report.unexplained == 0
    assert report.keyed > 1000
    assert report.out_of_order == 0
    assert report.overtaken == 0
    assert report.regressed == 0
    assert report.multi_key > 10
    assert report.left_waiting == 0
    assert report.archived == report.committed >= 3000
    assert report.dead == 0
    assert report.relay_exit_codes == [0, 0, 0]
