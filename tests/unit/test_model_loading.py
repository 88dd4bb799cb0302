"""A model `arena models add` is loading (weights, then its engine started) that no worker
holds ready: a request for it is answered 503 model_loading with Retry-After at once, not
a 504 once its deadline has passed; held ready by one worker, it is served."""

from __future__ import annotations

import time

from fastapi.testclient import TestClient

from events.fleet import InferenceBeat
from gateway.app import build_app
from gateway.fleet_view import FleetView
from gateway.pipeline import Pipeline
from gateway.serving import LOADING_RETRY_S
from tests.unit.fake_pipeline import FakePipeline, chat, settings


class Beating(FakePipeline):
    """The fake pipeline with the real fleet, folded from the workers' heartbeats."""

    def fleet(self) -> FleetView:
        return Pipeline.fleet(self)

    def worker(self, instance: str, resident: tuple[str, ...], loading: tuple[str, ...]) -> None:
        beat = InferenceBeat(
            instance=instance,
            ready=True,
            ts=time.time() + 3600,
            pid=1,
            models=("stories-260k", "big"),
            resident=resident,
            loading=loading,
        )
        self.beats[(beat.role, beat.instance)] = beat


def test_a_model_loading_on_every_worker_that_lists_it_is_refused_at_once_with_retry_after():
    s = settings()
    pipeline = Beating(s)
    pipeline.worker("w0", resident=("stories-260k",), loading=("big",))
    client = TestClient(build_app(s, pipeline))
    assert pipeline.fleet().loading == {"big": ["w0"]}
    started = time.monotonic()
    r = client.post("/v1/chat/completions", json=chat(model="big"))
    assert time.monotonic() - started < 5
    assert r.status_code == 503 and r.headers["retry-after"] == str(LOADING_RETRY_S), r.text
    assert r.json()["error"]["code"] == "model_loading" and "'big' is loading" in r.json()["error"]["message"]
    assert not pipeline.requests()  # nothing published: no request waits out its deadline on it
    pipeline.worker("w0", resident=("stories-260k", "big"), loading=("big",))  # its engine starting
    assert client.post("/v1/chat/completions", json=chat(model="big")).status_code == 503
    pipeline.worker("w1", resident=("stories-260k", "big"), loading=())  # ready on another: served
    assert client.post("/v1/chat/completions", json=chat(model="big")).status_code == 200
