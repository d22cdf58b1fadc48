"""Output paths are checked before any work (empty, a file where a folder goes, under a file, not writable) and
an earlier run's results are replaced only with --overwrite."""
import os

import pytest

from tailorkv.engine import ui
from tailorkv.engine.results import check_free, check_out, claimed_dir, refuse_existing


def test_check_out_refuses_what_cannot_be_written(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert check_out(str(tmp_path / "new" / "deeper")) == str(tmp_path / "new" / "deeper")
    assert check_out(str(tmp_path / "p.json"), kind="file") == str(tmp_path / "p.json")
    with pytest.raises(ValueError, match="--out is empty: give a folder name"):
        check_out("  ")
    with pytest.raises(ValueError, match="is a file: give a folder"):
        check_out(str(a_file))
    with pytest.raises(ValueError, match="is a folder: give a file name"):
        check_out(str(tmp_path), kind="file")
    with pytest.raises(ValueError, match=r"a_file is a file, not a folder: choose another path"):
        check_out(str(a_file / "sub"))
    with pytest.raises(ValueError, match=r"a_file is a file, not a folder"):
        check_out(str(a_file / "sub" / "p.json"), kind="file")
    assert not (tmp_path / "new").exists()  # checking creates nothing


def test_check_out_names_a_folder_it_cannot_write_in(tmp_path):
    with pytest.raises(ValueError, match=r"--out /proc/x: cannot write in /proc \(.*\): choose another path"):
        check_out("/proc/x")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in any folder")
def test_check_out_names_a_folder_this_user_may_not_write(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(ValueError, match="cannot write in .*locked .*Permission denied"):
            check_out(str(locked / "results"))
    finally:
        locked.chmod(0o700)


def test_refuse_existing_names_overwrite(tmp_path):
    path = tmp_path / "bench.json"
    refuse_existing(str(path), overwrite=False)  # nothing there: fine
    path.write_text("{}")
    with pytest.raises(ValueError, match="already holds an earlier run's results: pass --overwrite"):
        refuse_existing(str(path), overwrite=False)
    refuse_existing(str(path), overwrite=True)


@pytest.mark.parametrize("text", ["infk", "inf", "nan", "-8k", "1e400"])
def test_lengths_must_be_finite_and_positive(text):
    with pytest.raises(ValueError, match="is not a length"):
        ui.parse_length(text)


def test_claimed_dir_gives_commands_started_together_their_own_folders(tmp_path):
    root = str(tmp_path / "results")
    with claimed_dir("m", root, "bench.json") as a, claimed_dir("m", root, "bench.json") as b:
        assert a != b and os.path.isdir(a) and os.path.isdir(b) and b == a + "-2"
        open(os.path.join(a, "bench.json"), "w").close()  # a wrote its results; b wrote nothing
    assert sorted(os.listdir(root)) == [os.path.basename(a)]       # b's empty folder went with it
    assert os.listdir(a) == ["bench.json"]                          # the lock went, the results stay
    with claimed_dir("m", root, "bench.json") as c:
        assert c == a + "-2"


def test_claimed_dir_takes_over_a_lock_a_killed_command_left(tmp_path):
    """The lock is an flock, as --out's: a lock file nobody holds (its command was killed) does not cost a number."""
    root = str(tmp_path / "results")
    with claimed_dir("m", root, "bench.json") as a:
        pass
    os.makedirs(a)
    open(os.path.join(a, ".bench.json.lock"), "w").close()
    with claimed_dir("m", root, "bench.json") as b:
        assert b == a
        with claimed_dir("m", root, "bench.json") as c:  # while b holds it: the next number
            assert c == a + "-2"
    assert os.listdir(root) == [os.path.basename(a)] and os.listdir(a) == []


def test_claimed_dir_keeps_a_folder_it_did_not_make_and_names_one_it_cannot(tmp_path):
    root = tmp_path / "results"
    with claimed_dir("m", str(root), "eval.json") as a:
        pass
    os.makedirs(a)
    (tmp_path / "results" / "keep.txt").write_text("x")
    with claimed_dir("m", str(root), "eval.json") as b:
        assert b == a  # an empty folder is reused
    assert os.path.isdir(a)  # and not removed: this command did not make it
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"cannot make the results folder .*file/.*: run from a folder where you can "
                                         r"write, or pass --out DIR"):
        with claimed_dir("m", str(tmp_path / "file"), "eval.json"):
            pass


def test_check_free_names_a_folder_where_a_file_goes(tmp_path):
    check_free([str(tmp_path / "a.json")])
    (tmp_path / "a.png").mkdir()
    with pytest.raises(ValueError, match=r"a.png is a folder, and this run writes a file there: move the folder away "
                                         r"or choose another --out"):
        check_free([str(tmp_path / "a.json"), str(tmp_path / "a.png")])


def test_token_counts_take_ctx_suffixes():
    import click
    t = ui.Tokens()
    assert [t.convert(v, None, None) for v in ("1k", "0.5k", "1024", "-4", 64)] == [1024, 512, 1024, -4, 64]
    with pytest.raises(click.ClickException, match="is not a length: write e.g. 1024 or 1k"):
        t.convert("1x", None, None)


def test_held_dir_refuses_a_second_command_writing_the_same_file_there(tmp_path):
    """Two commands given the same --out: the second is refused before any work (it overwrote the first's
    results); another file in the folder (a second shard) is not held; a lock file that no process holds (its
    command was killed) is taken over, whatever it says."""
    import subprocess
    import sys
    from tailorkv.engine.results import held_dir
    out = str(tmp_path / "run")
    lock = os.path.join(out, ".bench.json.lock")
    with held_dir(out, "bench.json"):
        assert os.path.isdir(out)  # made before the model loads
        held = subprocess.run([sys.executable, "-c", "from tailorkv.engine.results import held_dir\n"
                               f"with held_dir({out!r}, 'bench.json'): pass"], capture_output=True, text=True)
        assert held.returncode == 1
        assert f"another tailorkv command is writing bench.json in {out} (it holds {lock}): wait for it to end, " \
               "or choose another --out" in held.stderr, held.stderr
        with held_dir(out, "eval.shard-1-of-2.json"):
            pass
    assert not os.path.exists(out)  # made by it, left empty: gone
    os.makedirs(out)
    with open(lock, "w") as f:
        f.write("1")  # a pid that runs, from a command long gone
    with held_dir(out, "bench.json"):
        (tmp_path / "run" / "bench.json").write_text("{}")
    assert os.listdir(out) == ["bench.json"]


def test_a_write_that_fails_for_space_names_its_file(tmp_path):
    """A full disk fails a Python write without a file name: the atomic writer names the file it was writing (the
    commands then say where, not 'stdout'), and leaves no temp file."""
    import errno
    from tailorkv.engine.results import write_files_atomically

    def full(tmp):
        raise OSError(errno.ENOSPC, "No space left on device")

    target = str(tmp_path / "r.json")
    with pytest.raises(OSError) as info:
        write_files_atomically([(target, full)])
    assert info.value.errno == errno.ENOSPC and info.value.filename == target
    assert os.listdir(tmp_path) == []
