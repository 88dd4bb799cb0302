"""Fixtures of the unit tests: the encoder stage the tests build themselves (tiny_encoder.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.unit import tiny_encoder as tiny


@pytest.fixture(scope="session")
def tiny_encoder(tmp_path_factory):
    """(the torch model, its exported artifact directory), built once per run."""
    return tiny.build(tmp_path_factory.mktemp("tiny-encoder") / "prompt-encoder")


@pytest.fixture(scope="session")
def tiny_manifest(tiny_encoder, tmp_path_factory) -> Path:
    """The committed lexical stages and the tiny encoder in one manifest (ensemble-encoder.json)."""
    out = tmp_path_factory.mktemp("tiny-manifest")
    shutil.copytree(tiny_encoder[1], out / "prompt-encoder")
    return tiny.manifest(out / "prompt-encoder", out)
