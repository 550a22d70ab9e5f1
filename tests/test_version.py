"""Versions come from git tags (setuptools-scm, pyproject.toml): in a clone,
in a `git archive` tarball (.git_archival.txt, filled in by export-subst),
in an sdist (PKG-INFO), and a fallback in a copy with none of these. `--version` names the build's
contracts: the profiler interfaces the plugin offers and the recording
schema."""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import sys
import tarfile

import pytest

import exporter
from conftest import REPO, run_cli
from exporter.sinks.recording.schema import SCHEMA_VERSION
from exporter.sources.plugin.build import build_plugin, interface_versions

TAG = "v9.8.7"


def scm_version(path) -> str:
    p = subprocess.run([sys.executable, "-m", "setuptools_scm"], cwd=str(path), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip().splitlines()[-1]


def git(*args, cwd) -> str:
    return subprocess.run(["git", *args], cwd=str(cwd), check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def tagged_clone(tmp_path_factory):
    """A fresh clone of this checkout's HEAD, tagged TAG (the repository itself is not touched)."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    clone = tmp_path_factory.mktemp("clone") / "nccl-exporter"
    git("clone", "--quiet", "--no-hardlinks", str(REPO), str(clone), cwd=REPO)
    git("-c", "user.name=t", "-c", "user.email=t@t", "tag", "-a", TAG, "-m", TAG, cwd=clone)
    return clone


def test_version_from_the_tag_of_a_clone(tagged_clone):
    assert scm_version(tagged_clone) == TAG[1:]
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "--quiet", "--allow-empty", "-m", "next",
        cwd=tagged_clone)
    after = scm_version(tagged_clone)
    assert re.fullmatch(r"9\.8\.8\.dev1\+g[0-9a-f]+", after), after  # one commit past the tag
    git("reset", "--quiet", "--hard", TAG, cwd=tagged_clone)


def test_version_from_a_git_archive(tagged_clone, tmp_path):
    """What a release tarball (or GitHub's "Source code" download) holds: no .git."""
    data = subprocess.run(["git", "archive", TAG], cwd=str(tagged_clone), check=True,
                          capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        t.extractall(tmp_path)
    assert not (tmp_path / ".git").exists()
    assert "$Format" not in (tmp_path / ".git_archival.txt").read_text()
    assert scm_version(tmp_path) == TAG[1:]


def test_version_from_an_sdist(tagged_clone, tmp_path):
    """An sdist (PKG-INFO holds the version) unpacked where there is no .git."""
    code = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=str(tagged_clone), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    name = p.stdout.strip().splitlines()[-1]
    assert re.fullmatch(rf"nccl[-_]exporter-{re.escape(TAG[1:])}\.tar\.gz", name), name
    with tarfile.open(tmp_path / name) as t:
        t.extractall(tmp_path / "unpacked")
    (src,) = (tmp_path / "unpacked").iterdir()
    assert not (src / ".git").exists() and (src / "PKG-INFO").is_file()
    assert scm_version(src) == TAG[1:]


def test_fallback_version_without_git(tmp_path):
    """A copy with neither .git nor a filled-in .git_archival.txt still builds."""
    src = tmp_path / "src"
    shutil.copytree(REPO, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "__pycache__", "*.egg-info", ".pytest_cache",
        ".git_archival.txt"))  # filled in where this tree is itself a git archive (the clean room)
    assert scm_version(src) == "0.0.0"


def test_version_flag_names_the_plugin_interfaces_and_the_schema():
    p = run_cli("--version")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == f"nccl-exporter {exporter.__version__}"
    offered = interface_versions()
    assert lines[1] == "profiler plugin interfaces: " + ", ".join(f"ncclProfiler_v{v}" for v in offered)
    assert lines[2] == f"recording schema: {SCHEMA_VERSION}"
    # what the built library really exports
    lib = build_plugin()
    syms = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True,
                          check=True).stdout
    exported = sorted({int(v) for v in re.findall(r"\bncclProfiler_v(\d+)\b", syms)}, reverse=True)
    assert offered == exported and offered, (offered, exported)
