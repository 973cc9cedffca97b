"""GenerationService.run and fanout.submit_all: a client's ``http.disconnect`` cancels its sequences at once,
iterated or not, submitted or still to submit."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from server.api.fanout import submit_all
from server.engine.sampling import SamplingParams
from server.engine.sequence import FinishReason, TokenEvent
from server.service import ClientGone, GenerationRequest, GenerationService, Limits
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


class LeavingEngine(FakeEngine):
    """A :class:`FakeEngine` whose client disconnects as its first submission is taken."""

    def __init__(self, client: Channel):
        super().__init__()
        self.client = client

    def submit(self, seq) -> asyncio.Future:
        self.client.leave()
        return super().submit(seq)


def test_a_disconnect_while_prompts_are_submitted_stops_the_rest_and_cancels_the_submitted(tok):
    """A prompt list (or ``n`` > 1) whose client leaves after its first prompt was submitted: the watcher runs
    from before the first submit, so no more than the one in flight is submitted after the disconnect, every
    submitted one is cancelled, and the route gets :class:`ClientGone` (499). Before, the watcher started after
    the last submit: all 64 prompts reached the engine and were prefilled."""

    async def scenario():
        client = Channel()
        service = GenerationService(LeavingEngine(client), tok, Limits(1023, 1024, 4), "full")
        with pytest.raises(ClientGone):
            await submit_all(service, [_request() for _ in range(64)], client.receive)
        submitted = service.engine.submitted
        assert 1 <= len(submitted) <= 2, len(submitted)
        assert all(seq.cancelled for seq in submitted)
        assert service.engine.wakes >= 1

    asyncio.run(scenario())


def test_a_request_whose_client_stays_is_submitted_whole_and_watched(tok):
    """Without a disconnect every prompt is submitted; a disconnect afterwards still cancels them all."""

    async def scenario():
        service, client = _service(tok), Channel()
        started = await submit_all(service, [_request() for _ in range(4)], client.receive)
        assert len(started) == 4 and not any(seq.cancelled for seq, _ in started)
        client.leave()
        for _ in range(3):
            await asyncio.sleep(0)
        assert all(seq.cancelled for seq, _ in started)
        for _, events in started:
            await events.aclose()

    asyncio.run(scenario())


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_client_gone_is_499_in_the_route_s_error_form(path):
    """:class:`ClientGone` reaches the route's error handler as 499 ``cancelled``, never the catch-all 500."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from server.errors import install_error_handlers

    app = FastAPI()
    install_error_handlers(app)

    @app.post(path)
    async def gone():
        raise ClientGone("client closed request")

    r = TestClient(app).post(path)
    assert r.status_code == 499, r.text
    body = r.json()
    if path.startswith("/v1"):
        assert body["error"]["message"] == "client closed request" and body["error"]["code"] == "cancelled"
    else:
        assert body == {"error": "client closed request", "error_type": "cancelled"}
