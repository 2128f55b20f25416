"""ThreadedEngine: the engine thread behind the worker's asyncio service."""
import asyncio
import threading
import time

import pytest

from pdserve.common.engine_api import OUTPUT_SINK
from pdserve.common.errors import DuplicateRequestError, InvalidRequestError
from pdserve.common.ids import RequestId
from pdserve.common.stats import ModelInfo, WorkerRole
from pdserve.common.request import RequestOutput
from pdserve.worker.async_engine import ThreadedEngine, _put_all
from pdserve.worker.engine_inbox import Stream
from tests.unit.engine.test_llm_engine import make_engine, reference, request

INFO = ModelInfo("toy", 128, 4, "sha256-v1", WorkerRole.BOTH, 97, (0,))


@pytest.fixture
def threaded():
    engine = ThreadedEngine(make_engine(), INFO, idle_wait_s=0.005)
    engine.start()
    yield engine
    engine.stop()


def _serve_one_request(threaded: ThreadedEngine) -> None:
    """Start `threaded`, stream one request through it (its reference tokens), stop it."""
    threaded.start()
    try:
        tokens, _ = asyncio.run(_collect(threaded, request("r", [5, 6, 7])))
    finally:
        threaded.stop()
    assert tokens == reference([5, 6, 7], 8)


async def _collect(engine, req):
    tokens, reasons = [], []
    async for out in engine.generate(req):
        tokens += out.token_ids
        reasons.append(out.finish_reason)
    return tokens, reasons


def test_concurrent_generations_match_reference(threaded):
    prompts = [[5, 6, 7], list(range(10, 31)), [40] * 9]

    async def main():
        return await asyncio.gather(*(_collect(threaded, request(f"r{i}", p)) for i, p in enumerate(prompts)))

    results = asyncio.run(main())
    assert [t for t, _ in results] == [reference(p, 8) for p in prompts]
    expected_reasons = ["stop" if reference(p, 8)[-1] == 0 else "length" for p in prompts]
    assert [r[-1] for _, r in results] == expected_reasons


def test_bad_request_raises_typed_error(threaded):
    async def main():
        async for _ in threaded.generate(request("bad", [])):
            pass

    with pytest.raises(InvalidRequestError):
        asyncio.run(main())


def test_abandoning_the_stream_aborts_and_frees_blocks(threaded):
    async def main():
        agen = threaded.generate(request("long", range(10, 30), max_tokens=100))
        await agen.__anext__()
        await agen.aclose()
        for _ in range(200):
            await asyncio.sleep(0.01)
            if threaded.stats().num_used_blocks == 0 and threaded.stats().num_running == 0:
                return True
        return False

    assert asyncio.run(main())
    threaded.stop()
    threaded.engine.kv.check_integrity()


def test_admission_for_decode_reserves_in_one_hop_and_a_failed_transfer_recomputes(threaded):
    async def main():
        req = request("r", [5, 6, 7])
        verdict, stream = await threaded.admit_for_decode(req, remote_possible=True, min_remote_tokens=1, lease_s=5.0)
        assert verdict.local_reason is None and verdict.claim.num_cached_tokens == 0
        await threaded.fail_remote(RequestId("r"), recompute=True, reason="x")
        return [t async for out in threaded.outputs(req, stream) for t in out.token_ids]

    assert asyncio.run(main()) == reference([5, 6, 7], 8)


def test_admission_for_decode_prefills_locally_when_few_tokens_are_missing(threaded):
    async def main():
        req = request("r", [5, 6, 7])
        verdict, stream = await threaded.admit_for_decode(req, remote_possible=True, min_remote_tokens=4, lease_s=5.0)
        assert verdict.claim is None and verdict.local_reason == "few_missing_tokens"
        return [t async for out in threaded.outputs(req, stream) for t in out.token_ids]

    assert asyncio.run(main()) == reference([5, 6, 7], 8)


def test_a_duplicate_id_is_refused_alone_and_the_other_streams_finish(threaded):
    prompts = {"a": list(range(10, 30)), "x": [5, 6, 7]}

    async def refused(req, error):
        with pytest.raises(error) as info:
            async for _ in threaded.generate(req):
                pass
        return str(info.value)

    async def main():
        a = threaded.generate(request("a", prompts["a"], max_tokens=30, ignore_eos=True))
        x = threaded.generate(request("x", prompts["x"], max_tokens=30, n=2, ignore_eos=True))
        firsts = [await a.__anext__(), await x.__anext__()]  # both admitted and past their prefill
        duplicate = await refused(request("a", [1, 2]), DuplicateRequestError)
        sibling = await refused(request("x#1", [1, 2]), InvalidRequestError)
        tokens: dict[tuple, list[int]] = {}
        reasons = {}
        for out in firsts + [out async for out in a] + [out async for out in x]:
            tokens.setdefault((out.request_id, out.index), []).extend(out.token_ids)
            reasons[(out.request_id, out.index)] = out.finish_reason
        return duplicate, sibling, tokens, reasons, await threaded.check_integrity()

    duplicate, sibling, tokens, reasons, integrity = asyncio.run(main())
    assert "'a' is in use" in duplicate and "'x#1'" in sibling
    assert tokens == {("a", 0): reference(prompts["a"], 30, eos=None), ("x", 0): reference(prompts["x"], 30, eos=None),
                      ("x", 1): reference(prompts["x"], 30, eos=None)}
    assert set(reasons.values()) == {"length"}
    assert (integrity.ok, integrity.num_used_blocks) == (True, 0)


def test_an_engine_built_on_its_loop_thread_steps_there():
    """The build runs on a new thread, and the steps on that same thread once started."""
    seen = {}

    def build():
        seen["build"] = threading.current_thread()
        engine = make_engine()
        step = engine.step

        def recording_step():
            seen["step"] = threading.current_thread()
            return step()

        engine.step = recording_step
        return engine, INFO

    threaded = ThreadedEngine.built_on_loop_thread(build)
    assert seen["build"] is not threading.current_thread()
    assert "step" not in seen  # nothing runs before start()
    _serve_one_request(threaded)
    assert seen["step"] is seen["build"]
    assert not seen["build"].is_alive()


def test_a_failed_build_on_the_loop_thread_raises_to_the_caller():
    def build():
        raise ValueError("no weights")

    with pytest.raises(ValueError, match="no weights"):
        ThreadedEngine.built_on_loop_thread(build)


def test_an_engine_stopped_before_it_started_ends_its_thread():
    threaded = ThreadedEngine.built_on_loop_thread(lambda: (make_engine(), INFO))
    threaded.stop(timeout_s=5)
    assert not threaded._thread.is_alive()


class RecordingCores:
    """Stands in for a CoreShare: what the loop asked, on which thread."""

    def __init__(self):
        self.calls = []

    def before_step(self, while_waiting=lambda: None):
        self.calls.append(("before_step", threading.current_thread().name))

    def idle(self):
        self.calls.append(("idle", threading.current_thread().name))

    def close(self):
        self.calls.append(("close", threading.current_thread().name))


def test_the_loop_asks_its_core_share_before_each_step_and_when_idle():
    cores = RecordingCores()
    _serve_one_request(ThreadedEngine.built_on_loop_thread(lambda: (make_engine(), INFO), cores=cores))
    kinds = [kind for kind, _ in cores.calls]
    assert kinds.count("before_step") >= len(reference([5, 6, 7], 8))  # a step per token
    assert kinds[-2:] == ["idle", "close"]  # idle once the work is done; the slot given back at stop
    assert {thread for _, thread in cores.calls} == {"engine-loop"}


class HeldCores(RecordingCores):
    """A peer holds the cores: each step waits until `released` is set, running `while_waiting`
    between polls as CoreShare does."""

    def __init__(self):
        super().__init__()
        self.released, self.waiting = threading.Event(), threading.Event()

    def before_step(self, while_waiting=lambda: None):
        super().before_step(while_waiting)
        while not self.released.is_set():
            self.waiting.set()
            while_waiting()
            time.sleep(0.001)


def _with_cores_held(scenario):
    """Run `scenario(threaded, cores)` on an engine whose steps wait for `cores.released`."""
    cores = HeldCores()
    threaded = ThreadedEngine.built_on_loop_thread(lambda: (make_engine(), INFO), cores=cores)
    threaded.start()
    try:
        return asyncio.run(scenario(threaded, cores))
    finally:
        cores.released.set()
        threaded.stop()


def test_commands_are_taken_while_a_step_waits_for_a_core():
    """A decode worker's remote first tokens, aborts and queries do not wait out a peer's step."""
    async def scenario(threaded, cores):
        generation = asyncio.ensure_future(_collect(threaded, request("r", [5, 6, 7])))
        assert await asyncio.to_thread(cores.waiting.wait, 10)
        report = await asyncio.wait_for(threaded.check_integrity(), 5)  # taken by the engine thread
        assert not generation.done()  # the step itself still waits
        cores.released.set()
        return report, await generation

    report, (tokens, _) = _with_cores_held(scenario)
    assert report.ok
    assert tokens == reference([5, 6, 7], 8)


def test_an_admission_while_a_step_waits_for_a_core_waits_for_the_step_and_keeps_order():
    async def scenario(threaded, cores):
        first = asyncio.ensure_future(_collect(threaded, request("r", [5, 6, 7])))
        assert await asyncio.to_thread(cores.waiting.wait, 10)
        second = asyncio.ensure_future(_collect(threaded, request("q", [8, 9])))
        await asyncio.sleep(0.05)
        behind = asyncio.ensure_future(threaded.ping(10))
        await asyncio.sleep(0.1)
        assert not behind.done()  # commands keep their order: this one follows q's admission
        cores.released.set()
        return await first, await second, await behind

    (tokens_r, _), (tokens_q, _), answer = _with_cores_held(scenario)
    assert (tokens_r, tokens_q, answer) == (reference([5, 6, 7], 8), reference([8, 9], 8), None)


@pytest.mark.parametrize("takes", [True, False])  # False: a sink whose stream closed takes nothing
def test_with_an_output_sink_every_output_arrives_once_in_order(threaded, takes):
    """The Worker service forwards most outputs as they come: the engine may put them on its
    sink straight from the hand-off; the first and each completion's last are yielded, and so is
    any the sink refuses, so that the caller fails as it would."""
    prompts = {f"r{i}": p for i, p in enumerate([[5, 6, 7], list(range(10, 31)), [40] * 9])}

    async def one(rid: str) -> list[tuple[str, object]]:
        seen = []  # (how, output) in the order they reached the caller
        OUTPUT_SINK.set(lambda output: seen.append(("sunk", output)) or takes)  # this task's context only
        async for output in threaded.generate(request(rid, prompts[rid], max_tokens=12, ignore_eos=True)):
            seen.append(("yielded", output))
        return [(how, o) for how, o in seen if takes or how == "yielded"]

    async def main():
        return await asyncio.gather(*(one(rid) for rid in prompts))

    for seen, prompt in zip(asyncio.run(main()), prompts.values()):
        assert [t for _, o in seen for t in o.token_ids] == reference(prompt, 12, eos=None)
        assert seen[0][0] == seen[-1][0] == "yielded" and seen[-1][1].finish_reason == "length"
    assert threaded.engine.kv.num_used_blocks == 0


def _stream(direct) -> Stream:
    return Stream(asyncio.get_running_loop(), asyncio.Queue(), 1, direct=direct)


def test_the_hand_off_uses_the_sink_only_while_the_reader_has_taken_all_and_never_for_a_last_output():
    async def main():
        sunk = []
        taking, refusing = _stream(lambda o: sunk.append(o.text) or True), _stream(lambda o: False)
        behind, unset = _stream(lambda o: sunk.append(o.text) or True), _stream(None)
        behind.outputs.put_nowait("an output the reader has not taken")
        middle = RequestOutput(RequestId("r"), 0, (1,), "middle")
        last = RequestOutput(RequestId("r"), 0, (2,), "last", finish_reason="stop")
        _put_all([(taking, middle), (taking, last), (refusing, middle), (behind, middle), (unset, middle)])
        return sunk, [s.outputs.qsize() for s in (taking, refusing, behind, unset)]

    sunk, queued = asyncio.run(main())
    assert sunk == ["middle"] and queued == [1, 1, 2, 1]
