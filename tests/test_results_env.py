"""The commit and dirty flag that results record, in a checkout and in a copy sent to a lent GPU machine."""
import subprocess

import pytest

from tailorkv.engine import results


def test_a_checkout_records_its_head_and_whether_tracked_files_differ(monkeypatch):
    monkeypatch.delenv("TAILORKV_COMMIT", raising=False)
    head = results._run(["git", "rev-parse", "HEAD"])
    if head is None:
        pytest.skip("not a git checkout")
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                            text=True, cwd=results.REPO).stdout.strip()
    assert results.git_commit() == head
    assert results.git_dirty() is bool(status)


@pytest.mark.parametrize(("flag", "dirty"), [("0", False), ("1", True), ("", None), ("yes", None)])
def test_a_copy_records_the_named_commit_and_only_the_sender_s_dirty_flag(monkeypatch, flag, dirty):
    monkeypatch.setenv("TAILORKV_COMMIT", "abc1234")
    monkeypatch.setenv("TAILORKV_DIRTY", flag)
    monkeypatch.setattr(results, "_run", lambda cmd: pytest.fail(f"ran {cmd} in a copy whose .git is stale"))
    assert results.git_commit() == "abc1234"
    assert results.git_dirty() is dirty
