"""gateway/fleet_view.py: the fleet as the heartbeats show it, read by attribute."""

from __future__ import annotations

import pytest

from gateway.fleet_view import FleetView

pytestmark = pytest.mark.timeout(10)


def test_a_model_is_loading_or_down_everywhere_only_when_no_holder_serves_it():
    fleet = FleetView(
        {"filter": 1, "inference": 2},
        models={"a": ["w0", "w1"], "b": ["w0"], "c": ["w1"]},
        loading={"a": ["w0"], "b": ["w0"]},
        unavailable={"c": ["w1"]},
    )
    assert (fleet.count("inference"), fleet.count("delivery")) == (2, 0)
    assert [fleet.loading_everywhere(m) for m in "abc"] == [False, True, False]
    assert [fleet.down_everywhere(m) for m in "abc"] == [False, False, True]


def test_readyz_shows_the_shape_it_always_had():
    fleet = FleetView({"filter": 1, "inference": 0}, models={"a": []})
    assert fleet.as_dict() == {"filter": 1, "inference": 0, "models": {"a": []}, "loading": {}, "unavailable": {}}
