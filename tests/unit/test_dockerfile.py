"""The Dockerfile builds the image configs/rayservice.yaml runs, and both agree with this repository.

No image is built here (no Docker daemon in CI): the Dockerfile is read instruction by
instruction and held to what the build must produce for the manifest to work —
the official Ray GPU image of the installed Ray and Python; the manifest's image named as
the Dockerfile labels it; its ports exposed; KubeRay's `ray start` left to run the
container; the app the manifest imports copied and installed; every model it serves baked
in at the path it names; and a build context that lets all of that through.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import os
import re
import shlex
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import pytest
import yaml
from packaging.specifiers import SpecifierSet

REPO = Path(__file__).parents[2]
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
MANIFEST = REPO / "configs" / "rayservice.yaml"
SERVE_CONFIG = REPO / "configs" / "serve.yaml"
PYPROJECT = REPO / "pyproject.toml"

# The official images: rayproject/ray:<ray version>-py<major><minor>-gpu (the `-gpu` alias of a CUDA build).
BASE_IMAGE = re.compile(r"^rayproject/ray:(?P<ray>\d+\.\d+\.\d+)-py(?P<py>\d)(?P<py_minor>\d+)-gpu$")
# KubeRay runs the user's container command instead of its own `ray start` only with this annotation.
OVERWRITE_CMD_ANNOTATION = "ray.io/overwrite-container-cmd"


@dataclass
class Dockerfile:
    """The instructions of a single-stage Dockerfile, with build arguments substituted."""

    base: str
    args: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    exposed: set[int] = field(default_factory=set)
    copies: list[tuple[list[str], str]] = field(default_factory=list)  # (sources, destination)
    runs: list[str] = field(default_factory=list)
    workdir: str | None = None
    user: str | None = None
    commands: list[str] = field(default_factory=list)  # ENTRYPOINT / CMD instructions

    def image_path(self, repo_path: str) -> str | None:
        """Where a repository file lands in the image, or None where no COPY puts it."""
        found = None
        for sources, dest in self.copies:
            for src in sources:
                src = src.rstrip("/")
                if (REPO / src).is_dir() and (repo_path == src or repo_path.startswith(src + "/")):
                    found = str(PurePosixPath(dest) / PurePosixPath(repo_path).relative_to(src))
                elif repo_path == src:
                    into_dir = dest.endswith("/") or len(sources) > 1
                    found = str(PurePosixPath(dest) / PurePosixPath(src).name) if into_dir else dest
        return found


def _instructions(text: str) -> Iterator[tuple[str, str]]:
    """(INSTRUCTION, arguments), continuation lines joined and comments dropped, as Docker reads them."""
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # a comment, also inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, rest = (pending + line).partition(" ")
        pending = ""
        yield keyword.upper(), rest.strip()
    assert not pending, "the Dockerfile ends inside a continued instruction"


def _substitute(value: str, variables: Mapping[str, str]) -> str:
    def one(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        assert name in variables, f"${name} is not a build argument or ENV with a value: {value!r}"
        return variables[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, value)


def parse_dockerfile(path: Path = DOCKERFILE) -> Dockerfile:
    global_args: dict[str, str] = {}
    stage: Dockerfile | None = None
    for keyword, rest in _instructions(path.read_text()):
        if stage is None:
            if keyword == "ARG":
                name, _, default = rest.partition("=")
                global_args[name] = default.strip('"')
                continue
            assert keyword == "FROM", f"{keyword} before FROM"
            stage = Dockerfile(base=_substitute(rest, global_args))
            continue
        assert keyword != "FROM", "one stage only: the tests read the final image's instructions from it"
        variables = {**stage.args, **stage.env}
        if keyword == "ARG":
            name, eq, default = rest.partition("=")
            # An ARG without a default after FROM takes the global one (Docker's scoping rule).
            stage.args[name] = _substitute(default.strip('"'), variables) if eq else global_args[name]
        elif keyword in ("LABEL", "ENV"):
            target = stage.labels if keyword == "LABEL" else stage.env
            for pair in shlex.split(rest):
                key, eq, value = pair.partition("=")
                assert eq, f"{keyword} {pair!r}: write key=value"
                target[key] = _substitute(value, variables)
        elif keyword == "EXPOSE":
            for port in rest.split():
                stage.exposed.add(int(_substitute(port, variables).partition("/")[0]))
        elif keyword in ("COPY", "ADD"):
            words = [w for w in shlex.split(rest) if not w.startswith("--")]
            stage.copies.append(([_substitute(w, variables) for w in words[:-1]], _substitute(words[-1], variables)))
        elif keyword == "RUN":
            stage.runs.append(_substitute(rest, variables))
        elif keyword == "WORKDIR":
            workdir = _substitute(rest, variables)
            stage.workdir = workdir if workdir.startswith("/") else str(PurePosixPath(stage.workdir or "/") / workdir)
        elif keyword == "USER":
            stage.user = _substitute(rest, variables)
        elif keyword in ("ENTRYPOINT", "CMD"):
            stage.commands.append(f"{keyword} {rest}")
    assert stage is not None, "no FROM"
    return stage


def baked_models(dockerfile: Dockerfile | None = None) -> dict[str, str]:
    """Image path -> model name, for every `zq-weights fetch <name> -o <path>` the build runs."""
    dockerfile = dockerfile or parse_dockerfile()
    out = {}
    for run in dockerfile.runs:
        for command in re.split(r"&&|;|\|\|", run):
            words = shlex.split(command)
            if words[:2] != ["zq-weights", "fetch"]:
                continue
            positional, output, rest = [], None, iter(words[2:])
            for word in rest:
                if word in ("-o", "--output"):
                    output = next(rest)
                elif not word.startswith("-"):
                    positional.append(word)
            assert len(positional) == 1 and output, f"cannot read the model and its output from {command!r}"
            out[output] = positional[0]
    return out


@pytest.fixture(scope="module")
def dockerfile() -> Dockerfile:
    return parse_dockerfile()


@pytest.fixture(scope="module")
def manifest() -> dict:
    with open(MANIFEST) as f:
        return yaml.safe_load(f)


@pytest.fixture(scope="module")
def app(manifest: dict) -> dict:
    (app,) = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"]
    return app


@pytest.fixture(scope="module")
def pyproject() -> dict:
    if sys.version_info < (3, 11):
        pytest.skip("reading pyproject.toml needs tomllib (Python 3.11+)")
    import tomllib

    return tomllib.loads(PYPROJECT.read_text())


def _pods(manifest: dict) -> list[dict]:
    cluster = manifest["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]


def _containers(manifest: dict) -> list[dict]:
    return [c for pod in _pods(manifest) for c in pod["spec"]["containers"]]


def _pvc_mounts(pod: dict) -> list[dict]:
    """The volumeMounts of a pod template that a PersistentVolumeClaim backs."""
    claims = {v["name"] for v in pod["spec"].get("volumes", []) if "persistentVolumeClaim" in v}
    return [m for c in pod["spec"]["containers"] for m in c.get("volumeMounts", []) if m["name"] in claims]


def _installed_dir(dockerfile: Dockerfile) -> str:
    """The directory the build `pip install`s: where pyproject.toml was copied."""
    dest = dockerfile.image_path("pyproject.toml")
    assert dest, "the Dockerfile does not copy pyproject.toml"
    project = str(PurePosixPath(dest).parent)
    installs = [r for r in dockerfile.runs if re.search(rf"pip install\b.*\s{re.escape(project)}/?(\s|$)", r)]
    assert installs, f"no RUN pip-installs {project}, where pyproject.toml is copied"
    return project


def test_the_base_is_the_official_ray_gpu_image_of_the_installed_ray_and_python(
    dockerfile: Dockerfile, manifest: dict, pyproject: dict
) -> None:
    import ray

    m = BASE_IMAGE.match(dockerfile.base)
    assert m, f"FROM {dockerfile.base}: not rayproject/ray:<version>-py<XY>-gpu"
    assert m["ray"] == ray.__version__, f"FROM {dockerfile.base}: the venv resolves ray {ray.__version__}"
    python = (int(m["py"]), int(m["py_minor"]))
    assert python == sys.version_info[:2], f"the image's Python {python} is not the venv's"
    assert SpecifierSet(pyproject["project"]["requires-python"]).contains("{}.{}".format(*python))
    assert manifest["spec"]["rayClusterConfig"]["rayVersion"] == m["ray"]
    assert dockerfile.labels["org.opencontainers.image.base.name"] == dockerfile.base
    # The project's install pins ray to the base's, so resolving `ray[serve]>=...` can never swap it.
    installs = [r for r in dockerfile.runs if f"ray[serve]=={m['ray']}" in r]
    assert installs, "the project's pip install does not pin ray to the base image's version"


def test_torch_is_the_version_the_tests_run(dockerfile: Dockerfile) -> None:
    import torch

    assert dockerfile.args["TORCH_VERSION"] == torch.__version__.partition("+")[0]
    assert any(f"torch=={torch.__version__.partition('+')[0]}" in r for r in dockerfile.runs)


def test_every_pod_runs_the_image_the_dockerfile_labels(
    dockerfile: Dockerfile, manifest: dict, pyproject: dict
) -> None:
    name = dockerfile.labels["org.opencontainers.image.title"]
    version = dockerfile.labels["org.opencontainers.image.version"]
    assert version == pyproject["project"]["version"], "the image's version label is not the project's"
    for container in _containers(manifest):
        # A registry prefix is the deployer's (docs/kubernetes.md); name and tag are the build's.
        assert container["image"].rpartition("/")[2] == f"{name}:{version}", container["name"]
        # The build's own tag, not :latest, so IfNotPresent cannot keep a stale image.
        assert container.get("imagePullPolicy") == "IfNotPresent", container["name"]


def test_the_exposed_ports_are_the_head_containers_ports(dockerfile: Dockerfile, manifest: dict, app: dict) -> None:
    cluster = manifest["spec"]["rayClusterConfig"]
    head = {p["containerPort"] for c in cluster["headGroupSpec"]["template"]["spec"]["containers"]
            for p in c.get("ports", [])}
    assert dockerfile.exposed == head
    for group in cluster["workerGroupSpecs"]:
        ports = {p["containerPort"] for c in group["template"]["spec"]["containers"] for p in c.get("ports", [])}
        assert ports <= dockerfile.exposed, group["groupName"]
    serve_config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    assert serve_config["http_options"]["port"] in dockerfile.exposed
    assert int(cluster["headGroupSpec"]["rayStartParams"]["metrics-export-port"]) in dockerfile.exposed


def test_kuberay_starts_the_container(dockerfile: Dockerfile, manifest: dict) -> None:
    # KubeRay replaces the container's command with `/bin/bash -lc -- ray start ...` built from
    # rayStartParams: an ENTRYPOINT or CMD here would never run in the cluster, and a `command`
    # in the manifest would replace `ray start` only under the overwrite annotation.
    assert dockerfile.commands == [], "KubeRay's `ray start` is the container's process; declare none"
    annotated = [manifest["metadata"]] + [pod.get("metadata", {}) for pod in _pods(manifest)]
    assert not any(OVERWRITE_CMD_ANNOTATION in m.get("annotations", {}) for m in annotated)
    for container in _containers(manifest):
        assert "command" not in container and "args" not in container, container["name"]
    # `ray start` runs as the image's user: the base's `ray`, whose Python the project went into.
    assert dockerfile.user == "ray"


def test_the_app_the_manifest_imports_is_installed_in_the_image(
    dockerfile: Dockerfile, app: dict, pyproject: dict
) -> None:
    module, _, attr = app["import_path"].partition(":")
    package = module.partition(".")[0]
    project = _installed_dir(dockerfile)
    packages = pyproject["tool"]["setuptools"]["packages"]
    assert package in packages, f"{package} is not a package pyproject.toml installs"
    # `pip install <dir>` needs every package it names, and the readme pyproject.toml points at.
    for needed in [*packages, pyproject["project"]["readme"]]:
        assert dockerfile.image_path(needed) == f"{project}/{needed}", f"{needed} is not copied beside pyproject.toml"
    source = REPO / (module.replace(".", "/") + ".py")
    tree = ast.parse(source.read_text())
    assert any(isinstance(n, ast.FunctionDef) and n.name == attr for n in tree.body), f"no {attr} in {source}"
    # Not editable: the app imports from site-packages, whatever the working directory.
    assert not any(re.search(r"pip install\b.*\s(-e|--editable)\s", r) for r in dockerfile.runs)


def test_every_model_the_manifest_serves_is_baked_into_the_image(
    dockerfile: Dockerfile, manifest: dict, app: dict, pyproject: dict
) -> None:
    baked = baked_models(dockerfile)
    assert baked, "the Dockerfile bakes no model"
    # A model on a volume (configs/rayservice.yaml says how; test_rayservice.py checks the mounts)
    # needs no copy in the image; every other one must be baked at the very path the manifest names.
    mounted = {m["mountPath"] for pod in _pods(manifest) for m in _pvc_mounts(pod)}
    for model in app["args"]["models"]:
        assert model.get("zqs_path"), f"model {model['id']}: a demo preset would be synthesised at start"
        path = PurePosixPath(model["zqs_path"])
        if not any(path.is_relative_to(mount) for mount in mounted):
            assert str(path) in baked, f"model {model['id']}: {path} is neither baked into the image nor on a volume"
    # ... and the image carries no model nobody serves.
    assert set(baked) <= {m["zqs_path"] for m in app["args"]["models"]}, baked
    assert "zq-weights" in pyproject["project"]["scripts"]
    # `zq-weights` exists once the project is installed: the fetch must come after that install.
    project = _installed_dir(dockerfile)
    install = next(i for i, r in enumerate(dockerfile.runs) if "pip install" in r and project in r)
    fetches = [i for i, r in enumerate(dockerfile.runs) if "zq-weights fetch" in r]
    assert all(install < i for i in fetches), "a model is fetched before the project (zq-weights) is installed"


def test_the_fetched_models_are_ones_zq_weights_fetch_knows(dockerfile: Dockerfile) -> None:
    try:
        fetch = importlib.import_module("weights_tool.fetch")
    except ModuleNotFoundError as e:
        if e.name != "weights_tool.fetch":
            raise
        pytest.skip("weights_tool/fetch.py (`zq-weights fetch`) is not in this checkout yet: no registry to check")
    known: set[str] = set()
    for value in vars(fetch).values():
        if isinstance(value, Mapping):
            known.update(k for k in value if isinstance(k, str))
        elif isinstance(value, (list, tuple)):
            for item in value:
                known.update(getattr(item, a) for a in ("name", "id", "key") if isinstance(getattr(item, a, None), str))
    for path, name in baked_models(dockerfile).items():
        assert name in known, f"{path}: `zq-weights fetch {name}` names no model weights_tool/fetch.py registers"


def test_relative_paths_in_the_app_args_resolve_in_the_image(dockerfile: Dockerfile, app: dict) -> None:
    # Ray's processes run in the WORKDIR (KubeRay keeps it): a relative scorer path, as
    # configs/serve.yaml gives, must name a file the build copies there.
    with open(SERVE_CONFIG) as f:
        (local_app,) = yaml.safe_load(f)["applications"]
    assert dockerfile.workdir and dockerfile.workdir.startswith("/")
    for args in (app["args"], local_app["args"]):
        scorer = args.get("scorer_path")
        if scorer and not PurePosixPath(scorer).is_absolute():
            assert (REPO / scorer).is_file(), scorer
            assert dockerfile.image_path(scorer) == str(PurePosixPath(dockerfile.workdir) / scorer), scorer


def _ignore_patterns() -> list[tuple[bool, re.Pattern]]:
    """.dockerignore as (is an exception `!`, regex), in order: the last match decides."""
    out = []
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex = ""
        for token in re.split(r"(\*\*/|\*\*|\*|\?)", pattern):
            regex += {"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}.get(token, re.escape(token))
        out.append((negated, re.compile(regex + "$")))
    return out


def _ignored(path: str, patterns: list[tuple[bool, re.Pattern]]) -> bool:
    """Whether the build context leaves `path` out: a pattern matching a directory matches all below it."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for negated, regex in patterns:
        if any(regex.match(p) for p in prefixes):
            ignored = not negated
    return ignored


def test_the_build_context_has_what_the_copies_need_and_nothing_local(dockerfile: Dockerfile) -> None:
    patterns = _ignore_patterns()
    for sources, _ in dockerfile.copies:
        for src in sources:
            src = src.rstrip("/")
            assert (REPO / src).exists(), f"COPY {src}: no such file in the repository"
            files = [src] if (REPO / src).is_file() else [
                os.path.relpath(Path(d) / f, REPO)
                for d, dirs, names in os.walk(REPO / src)
                if "__pycache__" not in Path(d).parts
                for f in names
                if not f.endswith((".pyc", ".zqs"))
            ]
            left_out = [f for f in files if _ignored(f, patterns)]
            assert not left_out, f".dockerignore leaves out what COPY {src} needs: {left_out}"
    for local in (".venv", ".cache", ".git", "benchmarks/results", "tests", "configs/__pycache__/x.pyc"):
        assert _ignored(local, patterns), f"{local} would be sent to the Docker daemon"

