"""The image's definition (docs/deploy.md, "The image"): the top-level
Dockerfile, the base images `make image` makes for it, the registry path
named once. Static checks of the files; `make test-image` builds and runs
the image itself (scripts/test-image.sh)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True)
    except FileNotFoundError:
        out = None
    if out is None or out.returncode != 0:  # no git, or an unpacked archive: all but the venv and build/
        return [p for p in REPO.rglob("*") if p.is_file() and not {".venv", "build", ".git"} & set(p.parts)]
    return [REPO / name for name in out.stdout.split("\0") if name]


def makefile_image() -> str:
    """$(IMAGE) as make sees it (it reads it from the DaemonSet)."""
    p = subprocess.run(["make", "-s", "--no-print-directory", "-C", str(REPO), "--eval",
                        "print-image: ; @echo $(IMAGE)", "print-image"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


# Where the registry path may stand: the DaemonSet (the one place it is
# named), the example overlay's `images:` (the name it replaces), and docs
# quoting it.
NAMED_IN = ("deploy/kubernetes/daemonset.yaml", "deploy/overlays/gpu-cluster/kustomization.yaml")


def test_the_registry_path_is_named_once():
    path = makefile_image()
    assert re.fullmatch(r"ghcr\.io/[a-z0-9-]+/nccl-exporter", path), path
    for f in tracked_files():
        if f.name == "Makefile" or not f.is_file():
            continue
        text = f.read_text(errors="replace")
        for named in re.findall(r"ghcr\.io/[\w./-]+", text):
            # docs quote it, the overlay replaces it; scripts take $IMAGE
            where = f.relative_to(REPO).as_posix()
            assert (f.suffix == ".md" or where in NAMED_IN) and named.split(":")[0].rstrip(".`") == path, \
                f"{where}: {named}"


def test_the_dockerfile_is_multi_stage_on_the_bases_make_image_makes():
    lines = (REPO / "Dockerfile").read_text().splitlines()
    froms = [line.split()[1:] for line in lines if line.startswith("FROM ")]
    assert froms[0][1:] == ["AS", "build"] and len(froms) == 2
    assert froms[-1] == ["debian:bookworm-slim"], "the runtime stage: Debian slim"
    made = re.search(r"^\s*for name in (.+); do$", (REPO / "scripts" / "lib-debian.sh").read_text(), re.M)
    for image, *_ in froms:
        repo, tag = image.split(":")
        assert repo == "debian" and tag in made.group(1).split(), f"make image cannot build FROM {image}"
    # the runtime stage takes what the build stage made, not the sources
    start = next(i for i, line in enumerate(lines) if line.startswith("FROM debian:bookworm-slim"))
    runtime = [line for line in "\n".join(lines[start:]).replace("\\\n", " ").splitlines()
               if not line.lstrip().startswith("#")]
    assert "COPY --from=build /opt/nccl-exporter /opt/nccl-exporter" in runtime
    assert "COPY . ." not in runtime
    (install,) = [line for line in runtime if "apt-get install" in line]
    assert "python3-bpfcc" in install.split() and not {"gcc", "python3-pip", "libc6-dev"} & set(install.split())


def test_the_build_context_leaves_build_outputs_out():
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", "build"} <= ignored, "the venv and build/image/storage (gigabytes) stay out"
    assert not (REPO / "deploy" / "image" / "Containerfile").exists(), "one definition: the Dockerfile"
