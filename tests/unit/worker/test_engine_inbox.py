"""The engine thread's inbox: commands in order, an admission held back while a step waits."""
from pdserve.common.ids import RequestId
from pdserve.worker.engine_inbox import Abort, Admit, Inbox


def admission() -> Admit:
    return Admit(None, None, None, False, 30.0, 0.0)  # the inbox never looks inside


def test_commands_come_out_in_order_and_an_admission_waits_for_a_full_take():
    inbox = Inbox()
    first, admit, last = Abort(RequestId("a")), admission(), Abort(RequestId("b"))
    for command in (first, admit, last):
        inbox.put(command)
    assert inbox.take(until_admission=True) is first
    assert inbox.take(until_admission=True) is None  # the admission is held back...
    assert inbox.take(until_admission=True) is None  # ...and so is all that follows it
    assert inbox.take() is admit  # handed out first once admissions are taken again
    assert inbox.take() is last
    assert inbox.take() is None
