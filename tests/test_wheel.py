"""The built wheel is enough: it holds every file `run`, `trace`, `check` and
`demo` read at run time, installs in a fresh venv (bcc from Debian through a
.pth file, as `make venv` does), and `check` and a short `demo` run from it
with the working directory outside the repository. About a minute; the demo
uses BPF and network namespaces (the fixtures take the heavy lock).

Also: one version string, in one place (exporter/__init__.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from conftest import REPO

import exporter

BCC_SRC = Path("/usr/lib/python3/dist-packages/bcc")
SYSPYTHON = "/usr/bin/python3"

pytestmark = pytest.mark.slow


def expected_data_files() -> set[str]:
    """Repository files the package reads at run time -> their names in the wheel."""
    out = {f"exporter/_bpf/{p.name}" for p in (REPO / "bpf").iterdir() if p.suffix in (".c", ".h")}
    out |= {f"exporter/_plugin/{p.name}" for p in (REPO / "plugin").iterdir() if p.suffix in (".c", ".h")}
    out |= {f"exporter/simulator/nccl_sim/{p.name}" for p in (REPO / "exporter/simulator/nccl_sim").iterdir()
            if p.suffix in (".c", ".h")}
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # from a clean copy: setuptools' build/ in the checkout may hold stale files
    src = out / "src"
    shutil.copytree(REPO, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "__pycache__", "*.egg-info", ".pytest_cache"))
    # the copy has no .git: the checkout's version, as setuptools-scm found it at install
    env = {**os.environ, "SETUPTOOLS_SCM_PRETEND_VERSION": exporter.__version__}
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "-w", str(out), "--no-deps",
                        "-q"], capture_output=True, text=True, timeout=300, cwd=str(out), env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    (whl,) = out.glob("nccl_exporter-*.whl")
    return whl


def test_symlinks_are_committed_as_symlinks():
    for name, target in (("_bpf", "../bpf"), ("_plugin", "../plugin")):
        path = REPO / "exporter" / name
        assert path.is_symlink() and os.readlink(path) == target, path


def test_wheel_contains_the_run_time_sources(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = expected_data_files() - names
    assert not missing, f"not in {wheel.name}: {sorted(missing)}"
    assert f"nccl_exporter-{exporter.__version__}.dist-info/METADATA" in names
    assert wheel.name.startswith(f"nccl_exporter-{exporter.__version__}-")
    # the entry point
    entry = zipfile.ZipFile(wheel).read(
        f"nccl_exporter-{exporter.__version__}.dist-info/entry_points.txt").decode()
    assert "nccl-exporter = exporter.cli:main" in entry


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A fresh venv (no access to the repository) with the wheel and its deps."""
    if not BCC_SRC.is_dir():
        pytest.skip(f"{BCC_SRC} missing (python3-bpfcc; make deps)")
    venv = tmp_path_factory.mktemp("venv") / "v"
    subprocess.run([SYSPYTHON, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    (venv / "bcc-site").mkdir()
    (venv / "bcc-site" / "bcc").symlink_to(BCC_SRC)
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "bcc-site.pth").write_text("../../../bcc-site\n")
    p = subprocess.run([str(py), "-m", "pip", "install", "-q", str(wheel)],
                       capture_output=True, text=True, timeout=600, cwd=str(venv))
    assert p.returncode == 0, p.stdout + p.stderr
    return venv


def run_installed(venv: Path, *args: str, timeout: float = 120, env: dict | None = None
                  ) -> subprocess.CompletedProcess:
    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
    return subprocess.run([str(venv / "bin" / "nccl-exporter"), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=str(venv.parent), env=env)


def test_installed_package_is_the_wheel(installed):
    p = subprocess.run([str(installed / "bin" / "python"), "-c",
                        "import exporter, bcc; print(exporter.__file__)"],
                       capture_output=True, text=True, cwd=str(installed.parent))
    assert p.returncode == 0, p.stderr
    assert str(installed) in p.stdout and str(REPO) not in p.stdout


def test_check_runs_from_the_wheel(installed):
    p = run_installed(installed, "check")
    out = p.stdout + p.stderr
    assert "Traceback" not in out, out
    assert p.returncode in (0, 1, 2), out  # a host may lack something; the command still answers
    assert "bpf" in out.lower(), out  # it compiled/inspected the shipped BPF sources


def test_version_from_the_wheel(installed):
    p = run_installed(installed, "--version")
    assert p.returncode == 0 and p.stdout.splitlines()[0] == f"nccl-exporter {exporter.__version__}", p
    # the plugin's interfaces, read from the sources the wheel ships
    assert p.stdout.splitlines()[1].startswith("profiler plugin interfaces: ncclProfiler_v"), p


def test_demo_runs_from_the_wheel(installed, tmp_path, bpf, netns):
    """The demo builds the simulator and the plugin outside the (absent) repository."""
    cache = tmp_path / "cache"
    p = run_installed(installed, "demo", "--seconds", "5", "--ranks", "4", "--lossy-rank", "1", "--straggler-rank", "2",
                      timeout=240,
                      env={"XDG_CACHE_HOME": str(cache)})
    out = p.stdout + p.stderr
    assert "Traceback" not in out, out
    assert p.returncode == 0, out
    assert "AllReduce calls seen by the exporter" in out, out
    assert (cache / "nccl-exporter" / "sim" / "libnccl.so.2").is_file(), out


def test_one_version_string():
    """__version__ is written once; nothing else in the tree restates it."""
    version = exporter.__version__
    tracked = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=str(REPO),
                             check=True).stdout.split()
    # alerts/tests: a promtool fixture's build_info sample, any value would do
    # deploy/kubernetes/daemonset.yaml: the image's version tag (a manifest cannot
    # import it; test_deploy.py checks that it equals __version__)
    allowed = {"exporter/__init__.py", "alerts/tests/nccl_test.yml", "deploy/kubernetes/daemonset.yaml"}
    found = []
    for name in tracked:
        path = REPO / name
        if name in allowed or path.is_symlink() or not path.is_file() or path.stat().st_size > 2_000_000:
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        for i, line in enumerate(text.splitlines(), 1):
            if f'"{version}"' in line or f":{version}" in line or f"=={version}" in line \
                    or f"version = {version}" in line:
                found.append(f"{name}:{i}: {line.strip()}")
    assert not found, "the version is restated:\n" + "\n".join(found)


def test_build_dirs_outside_a_checkout(tmp_path, monkeypatch):
    """Installed (no pyproject.toml beside the package): the simulator and the
    plugin build in a writable cache dir, not in site-packages' parent."""
    from exporter.simulator import build as sim_build
    from exporter.sources.plugin import build as plugin_build

    monkeypatch.delenv("NCCL_SIM_BUILD", raising=False)
    monkeypatch.delenv("NCCL_EXPORTER_PLUGIN_BUILD", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(sim_build, "REPO_ROOT", tmp_path / "site-packages-parent")
    monkeypatch.setattr(plugin_build, "REPO_ROOT", tmp_path / "site-packages")
    assert sim_build.default_outdir() == tmp_path / "xdg" / "nccl-exporter" / "sim"
    assert plugin_build.default_outdir() == tmp_path / "xdg" / "nccl-exporter" / "plugin"
    # a read-only cache home (ProtectHome=read-only): the next writable place
    monkeypatch.setenv("XDG_CACHE_HOME", "/etc/hostname/not-a-directory")
    monkeypatch.setenv("HOME", "/etc/hostname/not-a-directory")
    assert sim_build.default_outdir() in (Path("/var/cache/nccl-exporter/sim"),
                                          Path(tempfile.gettempdir()) / "nccl-exporter" / "sim")


def test_build_dirs_in_a_checkout():
    from exporter.simulator import build as sim_build

    if os.environ.get("NCCL_SIM_BUILD"):
        pytest.skip("NCCL_SIM_BUILD set")
    assert sim_build.default_outdir() == REPO / "build" / "sim"
