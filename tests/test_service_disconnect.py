"""GenerationService.run: a client's ``http.disconnect`` cancels its sequence at once, iterated or not."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from server.engine.sampling import SamplingParams
from server.engine.sequence import FinishReason, TokenEvent
from server.service import GenerationRequest, GenerationService, Limits
from tests.conftest import MODEL_DIR


class FakeEngine:
    """The engine core's client as the service uses it (:class:`server.engine.core_client.CoreClient`): records
    submissions, each taken at once (an answered future), and wake-ups; never runs anything."""

    backends = {"full": None, "dca": None}

    def __init__(self):
        self.submitted, self.wakes = [], 0

    def submit(self, seq) -> asyncio.Future:
        self.submitted.append(seq)
        taken = asyncio.get_running_loop().create_future()
        taken.set_result(None)
        return taken

    def wake(self):
        self.wakes += 1


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(MODEL_DIR)


def _service(tok):
    return GenerationService(FakeEngine(), tok, Limits(1023, 1024, 4), "full")


def _request():
    return GenerationRequest(prompt="And God said", max_new_tokens=500, params=SamplingParams(), stop=[],
                             backend="full")


class Channel:
    """An ASGI receive channel whose ``http.disconnect`` arrives when :meth:`leave` is called."""

    def __init__(self):
        self.gone = asyncio.Event()

    async def receive(self) -> dict:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    def leave(self):
        self.gone.set()


def test_disconnect_cancels_a_request_nobody_is_iterating(tok):
    """A non-streaming route waits on the whole result; the disconnect must not wait for a token."""

    async def scenario():
        service, client = _service(tok), Channel()
        seq, events = await service.run(_request(), client.receive)
        for _ in range(3):
            await asyncio.sleep(0)
        assert not seq.cancelled and service.engine.wakes == 0
        client.leave()
        for _ in range(3):
            await asyncio.sleep(0)
        assert seq.cancelled and service.engine.wakes == 1
        await events.aclose()

    asyncio.run(scenario())


def test_a_finished_request_is_not_cancelled_when_its_response_ends(tok):
    """After the last event the channel reports the end of the response as a disconnect: no cancel."""

    async def scenario():
        service, client = _service(tok), Channel()
        seq, events = await service.run(_request(), client.receive)
        seq.finish_reason = FinishReason.LENGTH
        seq.emit(TokenEvent(index=0, token_id=5, text="x", logprob=0.0, special=False,
                            finish_reason=FinishReason.LENGTH))
        got = [ev async for ev in events]
        assert [ev.finish_reason for ev in got] == [FinishReason.LENGTH]
        client.leave()
        for _ in range(3):
            await asyncio.sleep(0)
        assert not seq.cancelled and service.engine.wakes == 0

    asyncio.run(scenario())


def test_a_consumer_that_stops_early_cancels(tok):
    async def scenario():
        service = _service(tok)
        seq, events = await service.run(_request())
        seq.emit(TokenEvent(index=0, token_id=5, text="x", logprob=0.0, special=False))
        async for _ in events:
            break
        await events.aclose()
        assert seq.cancelled and service.engine.wakes == 1

    asyncio.run(scenario())
