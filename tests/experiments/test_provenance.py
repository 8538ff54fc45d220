"""A cell records the commit it ran and whether the tree was clean (issue: cells recorded no code commit)."""
import subprocess

import pytest

from iga_ds.experiments import provenance


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                   check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path, monkeypatch):
    monkeypatch.delenv(provenance.COMMIT_ENV, raising=False)
    monkeypatch.delenv(provenance.CLEAN_ENV, raising=False)
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "a.py")
    _git(tmp_path, "commit", "-q", "-m", "one")
    monkeypatch.setattr(provenance, "_ROOT", tmp_path)
    return tmp_path


def test_a_clean_checkout_records_its_head(repo):
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert provenance.source_state() == {"commit": head, "clean": True}


def test_an_edited_tracked_file_makes_the_tree_unclean_and_an_untracked_one_does_not(repo):
    (repo / "runs").mkdir()
    (repo / "runs" / "out.json").write_text("{}")
    assert provenance.source_state()["clean"] is True
    (repo / "a.py").write_text("x = 2\n")
    assert provenance.source_state()["clean"] is False


def test_a_copy_without_git_takes_the_environment_or_records_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(provenance, "_ROOT", tmp_path)
    monkeypatch.delenv(provenance.COMMIT_ENV, raising=False)
    assert provenance.source_state() == {"commit": None, "clean": None}
    monkeypatch.setenv(provenance.COMMIT_ENV, "abc123")
    monkeypatch.setenv(provenance.CLEAN_ENV, "0")
    assert provenance.source_state() == {"commit": "abc123", "clean": False}
