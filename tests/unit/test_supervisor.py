"""What `arena up` prints while the stack starts (`waiting_line`), and the cores it gives each replica."""

from __future__ import annotations

from infra.supervisor import waiting_line


def test_the_waiting_line_says_which_models_load_and_which_are_resident():
    ready = {
        "filter": 1,
        "delivery": 1,
        "inference": 0,
        "models": {"smollm2-135m": [], "stories-260k": ["inference-1"], "smollm2-135m-brief": []},
    }
    assert waiting_line(ready) == (
        "waiting: filter=1 delivery=1 inference=0; "
        "models: smollm2-135m loading, stories-260k resident, smollm2-135m-brief loading"
    )
    assert waiting_line({"filter": 0, "delivery": 0, "inference": 0}).endswith("models: none listed yet")


def test_the_waiting_line_names_the_models_warmed_at_start():
    ready = {"filter": 1, "delivery": 1, "inference": 1, "models": {"tiny": [], "tinier": [], "other": []}}
    assert waiting_line(ready, ["tiny"]).endswith("; warming: tiny loading; 2 more load on their first request")
    ready["models"]["tiny"] = ["inference-0"]
    assert waiting_line(ready, ["tiny"]).endswith("; warming: tiny resident; 2 more load on their first request")
    assert waiting_line({"inference": 0}, ["a", "b"]).endswith("; warming: a, b (no worker lists them yet)")


def test_a_conversion_child_that_fails_is_said_and_start_goes_on(monkeypatch, tmp_path):
    """The model sources' converting child killed or failing before a word: the
    supervisor says so (the workers convert what they need and name what fails)."""
    import sys

    from infra import supervisor

    script = tmp_path / "convert.py"
    script.write_text("import sys\nprint('model m: converting', flush=True)\nsys.exit(3)\n")
    command: list[str] = []
    real_popen = supervisor.subprocess.Popen
    monkeypatch.setattr(
        supervisor.subprocess,
        "Popen",
        lambda cmd, **kw: command.extend(cmd) or real_popen([sys.executable, str(script)], **kw),
    )
    lines: list[str] = []
    supervisor.convert_sources("models.yaml", {}, lines.append)
    assert command[1:] == ["-m", "infra.convert_sources", "models.yaml"]
    assert lines[0] == "model m: converting"
    assert "exit code 3" in lines[1] and "each worker converts" in lines[1]
    lines.clear()
    script.write_text("print('model m: ready')\n")
    supervisor.convert_sources("models.yaml", {}, lines.append)
    assert lines == ["model m: ready"]  # a clean exit says nothing more


def test_replicas_share_the_cores_torch_leaving_one_to_the_stack_and_llama_cpp_not(monkeypatch):
    from infra.supervisor import thread_shares

    monkeypatch.setattr("os.cpu_count", lambda: 2)
    # One thread shared (no parallel region: nothing spins), both cores for a model alone,
    # whose threads spin between its products (no OMP_WAIT_POLICY=PASSIVE).
    assert thread_shares({}, 1) == {
        "ARENA_TORCH_THREADS": "1",
        "ARENA_TORCH_THREADS_ALONE": "2",
        "ARENA_LLAMA_CPP_THREADS": "2",
    }
    assert thread_shares({}, 2) == {  # two replicas on two cores: a core each, always
        "OMP_WAIT_POLICY": "PASSIVE",
        "ARENA_TORCH_THREADS": "1",
        "ARENA_TORCH_THREADS_ALONE": "1",
        "ARENA_LLAMA_CPP_THREADS": "1",
    }
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    shares = thread_shares({}, 2)
    assert (shares["ARENA_TORCH_THREADS"], shares["ARENA_TORCH_THREADS_ALONE"]) == ("7", "8")
    assert shares["OMP_WAIT_POLICY"] == "PASSIVE"  # engines stepping together would spin on each other's cores
    assert shares["ARENA_LLAMA_CPP_THREADS"] == "8"
    given = {
        "OMP_WAIT_POLICY": "ACTIVE",
        "ARENA_TORCH_THREADS": "3",
        "ARENA_TORCH_THREADS_ALONE": "4",
        "ARENA_LLAMA_CPP_THREADS": "5",
    }
    assert thread_shares(given, 2) == {}  # what the operator set is kept
    assert thread_shares({"ARENA_TORCH_THREADS": "1"}, 1)["ARENA_TORCH_THREADS_ALONE"] == "16"
