"""A worker's load book keeps its figure between changes; every change shows in the next `load()`."""
from pdserve.router.routing.cost import WorkerLoad
from pdserve.router.routing.worker_load import LoadBook
from tests.unit.router.routing.cluster_fakes import stats


def test_each_change_shows_in_the_next_load() -> None:
    book = LoadBook()
    book.record_report(stats(running=1, used=10, queued=32), asked_at=1.0)
    assert book.load() == WorkerLoad(1, 10, 32)
    assert book.load() is book.load()  # kept between changes
    entry = book.dispatch(2.0, num_prefill_tokens=64, num_blocks=4)
    assert book.load() == WorkerLoad(2, 14, 96)
    book.prefill_done(entry, 3.0)
    assert book.load() == WorkerLoad(2, 14, 32)
    book.finish(entry, 4.0)
    assert book.load() == WorkerLoad(1, 10, 32)
    book.record_report(stats(running=5, used=50, queued=0), asked_at=5.0)
    assert book.load() == WorkerLoad(5, 50, 0)
    book.dispatch(6.0, num_prefill_tokens=16, num_blocks=1)
    book.clear()
    assert book.load() == WorkerLoad(5, 50, 0)
