"""A served model's `.zqs` file: the one named, or a demo model synthesised and packed on first use.

The demo model (a random-weight checkpoint of a synth.py preset, packed by pack.py) lets
`zq-generate --demo`, tests and benchmarks run with nothing downloaded. Making it is weight
tooling, so it lives here: the runtime's CLI (actors/cli.py) and the app's config
(serve_app/config.py) both call it without reaching into each other.
"""

from __future__ import annotations

import fcntl
import logging
from pathlib import Path

log = logging.getLogger(__name__)


def demo_model(directory: str | Path, preset: str = "small") -> Path:
    """The demo's `.zqs` file, synthesised and packed on first use."""
    # Imported here: synthesis needs torch, which resolving an existing file (the ingress's config) does not.
    from weights_tool.pack import pack
    from weights_tool.synth import synthesize

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    zqs = directory / f"{preset}.zqs"
    # Several processes (ingress replicas) may ask at once: one makes it, the others wait.
    with open(directory / f".{preset}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not zqs.exists():
            log.info("synthesising the %s demo model into %s (first use only)", preset, directory)
            hf = synthesize(preset, directory / f"{preset}-hf", dtype="bfloat16", seed=0)
            pack(hf, zqs)  # written to a temporary name and renamed: never seen half-made
    return zqs


def resolve_zqs(model_id: str, *, zqs_path: str | None, demo_preset: str | None, demo_dir: str | Path) -> Path:
    """The model's `.zqs` file: `zqs_path` if given (it must exist), else the demo model of `demo_preset`.

    `model_id` only names the model in the error, so that a config with several models says which one is missing.
    """
    if zqs_path is not None:
        path = Path(zqs_path)
        if not path.is_file():
            raise FileNotFoundError(f"model {model_id!r}: no .zqs file at {path} (make one with `zq-weights pack` "
                                    f"or `zq-weights fetch`; `make serve` fetches the default model)")
        return path
    assert demo_preset is not None, "a model names a .zqs file or a demo preset (ModelArgs checks one is given)"
    return demo_model(demo_dir, demo_preset).resolve()
