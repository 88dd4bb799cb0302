"""Threads sized to the load (consumers/inference/runners/cores.py): an engine takes `alone` threads
while no other engine of the machine noted a step within the window, its share otherwise.
Real files in a real directory; the other engine is a real process where it matters."""

import os
import subprocess
import sys
import textwrap
import time

from consumers.inference.runners.cores import CoreShare, alone_threads, share_or_none

WINDOW = 0.3


def recorder(calls: list[int]):
    return calls.append


def test_a_small_model_keeps_its_share():
    assert alone_threads(1, 2, params=135_000_000, min_params=10_000_000) == 2
    assert alone_threads(1, 2, params=260_000, min_params=10_000_000) == 1
    assert alone_threads(2, 2, params=135_000_000, min_params=10_000_000) == 2
    assert alone_threads(3, 2, params=135_000_000, min_params=10_000_000) == 3  # never fewer than the share


def test_an_engine_alone_takes_the_cores_and_gives_them_back_while_another_steps(tmp_path):
    calls: list[int] = []
    mine = CoreShare(tmp_path, 1, 2, recorder(calls), window_s=WINDOW, name="engine-a")
    other = CoreShare(tmp_path, 1, 2, None, window_s=WINDOW, name="engine-b")
    assert mine.before_step() == 2 and calls == [2]
    assert mine.before_step() == 2 and calls == [2]  # set once, not at every step
    other.before_step()
    assert mine.before_step() == 1 and calls == [2, 1]
    time.sleep(WINDOW + 0.1)  # the other stopped stepping
    assert mine.before_step() == 2 and calls == [2, 1, 2]


def test_notes_only_where_threads_do_not_change(tmp_path):
    calls: list[int] = []
    same = CoreShare(tmp_path, 1, 1, recorder(calls), window_s=WINDOW, name="engine-a")
    notes = CoreShare(tmp_path, 0, 0, None, window_s=WINDOW, name="engine-b")  # a llama.cpp server's runner
    assert not same.sizing and not notes.sizing
    notes.before_step()
    same.before_step()
    assert calls == []
    assert {p.name for p in tmp_path.iterdir()} == {"engine-a", "engine-b"}
    watcher = CoreShare(tmp_path, 1, 2, recorder(calls), window_s=WINDOW, name="engine-c")
    assert watcher.others_stepping()
    same.close()
    assert {p.name for p in tmp_path.iterdir()} == {"engine-b"}  # a note is made by a step


OTHER_ENGINE = textwrap.dedent(
    """
    import sys, time
    from consumers.inference.runners.cores import CoreShare
    share = CoreShare(sys.argv[1], 0, 0)
    end = time.monotonic() + float(sys.argv[2])
    print("stepping", flush=True)
    while time.monotonic() < end:
        share.before_step()
        time.sleep(0.03)
    """
)


def test_another_process_stepping_takes_the_second_thread_and_a_dead_ones_note_is_swept(tmp_path):
    calls: list[int] = []
    mine = CoreShare(tmp_path, 1, 2, recorder(calls), window_s=WINDOW)
    assert mine.before_step() == 2
    other = subprocess.Popen(
        [sys.executable, "-c", OTHER_ENGINE, str(tmp_path), "1.5"], stdout=subprocess.PIPE, text=True, cwd=os.getcwd()
    )
    assert other.stdout is not None and other.stdout.readline().strip() == "stepping"
    time.sleep(0.1)
    assert mine.before_step() == 1
    other.wait(timeout=30)
    time.sleep(WINDOW + 0.1)
    assert mine.before_step() == 2
    assert (tmp_path / str(other.pid)).exists()  # it ended without closing (as a kill -9 would)
    CoreShare(tmp_path, 1, 2, None, window_s=WINDOW)  # the next engine to start sweeps it
    assert not (tmp_path / str(other.pid)).exists()
    assert (tmp_path / str(os.getpid())).exists()
    assert calls == [2, 1, 2]


def test_no_notes_where_the_directory_cannot_be_made(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert share_or_none(str(blocker / "cores"), 1, 2) is None  # a read-only home does the same
    assert "engine threads stay at 1" in caplog.text
