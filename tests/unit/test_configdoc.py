"""docs/configuration.md is generated from the settings classes (`python -m infra.configdoc`):
it must match them, every field must say what it does, and no settings class may be left
off the page."""

from __future__ import annotations

import ast
import subprocess
import sys

from pydantic import BaseModel

from infra import configdoc

PACKAGES = ("events", "runtime", "consumers", "gateway", "infra", "bench")


def test_committed_configuration_page_is_generated():
    assert configdoc.PATH.read_text() == configdoc.render(), "docs/configuration.md is stale: python -m infra.configdoc"


def test_every_setting_has_a_description():
    missing = []
    for section in configdoc.sections():
        for name, field in section.settings.model_fields.items():
            if not (field.description or "").strip():
                missing.append(f"{section.settings.__name__}.{name}")
            model = field.annotation
            if isinstance(model, type) and issubclass(model, BaseModel):
                missing += [f"{model.__name__}.{n}" for n, f in model.model_fields.items() if not f.description]
    assert not missing, f"fields without a description (they make docs/configuration.md): {missing}"


def _settings_classes_in_tree() -> dict[str, str]:
    """Every class of the tree that derives, by name, from pydantic-settings' BaseSettings:
    name -> file (an AST read: nothing is imported)."""
    bases: dict[str, set[str]] = {}
    where: dict[str, str] = {}
    for package in PACKAGES:
        for path in (configdoc.REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef):
                    names = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                    bases[node.name] = names
                    where[node.name] = str(path.relative_to(configdoc.REPO))
    found = {"BaseSettings"}
    grew = True
    while grew:
        new = {name for name, of in bases.items() if of & found} - found
        found |= new
        grew = bool(new)
    return {name: where[name] for name in found - {"BaseSettings"}}


def test_every_settings_class_is_on_the_page():
    listed = {s.settings.__name__ for s in configdoc.sections()}
    mixins = {base.__name__ for s in configdoc.sections() for base in s.settings.__mro__[1:]}
    unlisted = {name: path for name, path in _settings_classes_in_tree().items() if name not in listed | mixins}
    assert not unlisted, f"settings classes missing from infra.configdoc.sections(): {unlisted}"


def test_machine_specific_defaults_are_written_the_same_everywhere():
    text = configdoc.render()
    assert str(configdoc.REPO) not in text and "<hostname>-<pid>" in text


def test_help_writes_nothing():
    run = subprocess.run(
        [sys.executable, "-m", "infra.configdoc", "--help"],
        cwd=configdoc.REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0 and run.stdout.startswith("usage: python -m infra.configdoc"), run
    assert "wrote" not in run.stderr, run.stderr


def test_a_nested_model_gets_a_row_per_field():
    from pydantic import Field
    from pydantic_settings import BaseSettings, SettingsConfigDict

    class Inner(BaseModel):
        threshold: float = Field(0.75, description="Reject at or above this.")

    class Outer(BaseSettings):
        model_config = SettingsConfigDict(env_prefix="ARENA_", env_nested_delimiter="__")
        filter: Inner = Field(default_factory=Inner, description="The filter's config.")

    rows = list(configdoc.rows(Outer))
    assert [(r.env, r.type, r.default) for r in rows] == [
        ("`ARENA_FILTER`", "Inner", '`{"threshold":0.75}`'),
        ("`ARENA_FILTER__THRESHOLD`", "float", "`0.75`"),
    ]
    assert rows[1].description == "Reject at or above this."
