"""The actors' own CPU kernels (csrc/), built as torch C++ extensions: one for CPUs with AVX512-BF16 (and VNNI),

    bf16_linear        a bf16 linear layer reading its weight once, in pairs (bf16_linear.py)
    decode_attention   every decoding row of a batch attends in one call, over bf16 or 8-bit caches (attention.py)
    rms_norm           RMSNorm of bf16 rows in one pass (layers.py)
    argmax_rows        greedy sampling's argmax over every row's fp32 logits in one call (sampling.py)
    silu_mul           the MLP's silu(gate) * up in one pass (layers.py)
    DecodeLayers       every decoder layer of a decode-only step in one call (decode_layers.py)

and one for CPUs with AVX2 and FMA, which compute a bf16 file in fp32 (compute_dtype.py) where there is no
AVX512-BF16, or where fp32 is asked for:

    bf16_weight_linear an fp32 linear layer over its bf16 weight, half the bytes of the widened one
                       (bf16_weight_linear.py)
    rms_norm_f32       RMSNorm of fp32 rows in one pass (layers.py)
    decode_attention_f32  every decoding fp32 row of a batch attends in one call (attention.py)
    DecodeLayers       every decoder layer of a decode-only step in one call (decode_layers.py), as above

Both instantiate decode_layers.h's layer loop with their own kernels.

Compiled on first use with torch's C++ extension builder and kept in its cache (a minute or so
on 2 cores, timed by hand); `make setup` builds it ahead (`python -m actors.cpu_kernels`), so an actor only loads
it. Packing loads them (packed_weights.py, off the stepping thread); attention uses them only once
loaded (`loaded()`). Where the CPU lacks AVX512-BF16, or the build fails, `extension()` is None and
the runtime uses torch's kernels (oneDNN's packed linear, SDPA row by row).

Each checkout builds in a folder of its own under torch's extension root (named by the digest of its csrc/
path): two clones on one machine would otherwise rebuild each other's objects in turn. A build holds an
`flock` on that folder, which the kernel drops if the builder dies. Torch's own lock is a bare `lock` file
that a builder killed mid-build (an actor stopped while packing) leaves behind, and every later build of
that folder waited on it for ever; under the flock any such file is a dead builder's and is removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(CSRC / f for f in ("bindings.cpp", "bf16_linear.cpp", "decode_attention.cpp",
                                      "decode_attention_i8.cpp", "rms_norm.cpp",
                                      "argmax.cpp", "silu_mul.cpp"))
AVX2_SOURCES = tuple(CSRC / f for f in ("avx2_bindings.cpp", "bf16_weight_linear.cpp", "rms_norm_f32.cpp",
                                         "decode_attention_f32.cpp"))
# -fopenmp: at::parallel_for is an OpenMP pragma inlined from torch's headers; compiled without it, the
# kernels run on one thread whatever torch.set_num_threads says. Linked by soname, libgomp.so.1 resolves to
# the copy torch has already loaded: one thread pool, not two.
FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-fopenmp")
AVX2_FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp")


@functools.cache
def is_cpu_supported() -> bool:
    """This CPU has AVX512-BF16 (VDPBF16PS), the instruction the kernels are built on, and AVX512-VNNI (VPDPBUSD,
    8-bit caches' keys; every CPU with the first has it). Asked once: attention asks it each step of 8-bit caches."""
    return torch.cpu._is_avx512_bf16_supported() and torch.cpu._is_vnni_supported()


def is_avx2_supported() -> bool:
    """torch dispatches its own kernels at AVX2 here (which implies FMA) or higher: the AVX2 kernels run. Where the
    CPU also has AVX512-BF16, a bf16 model computes in bf16 on the kernels above (compute_dtype.py's `auto`); these
    serve a model computed in fp32 there (forced by `actor.compute_dtype`), and are tested there too."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def build_directory(name: str) -> Path:
    """This checkout's build folder for extension `name`, under torch's extension root."""
    from torch.utils.cpp_extension import _get_build_directory

    checkout = hashlib.sha1(str(CSRC.resolve()).encode()).hexdigest()[:10]
    return Path(_get_build_directory(f"{name}-{checkout}", verbose=False))


@contextlib.contextmanager
def build_lock(folder: Path):
    """Held while building in `folder`: one builder at a time, and a dead builder's lock file gone."""
    with open(folder / "zq-build.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released by the kernel if this process dies
        try:
            stale = folder / "lock"  # torch's FileBaton: only a builder that died holding it leaves it now
            if stale.exists():
                log.warning("removing %s, left by a build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build(name: str, sources: tuple[Path, ...], flags: tuple[str, ...]):
    from torch.utils.cpp_extension import load

    if shutil.which("ninja") is None:  # the `ninja` wheel's binary beside this interpreter, not on PATH
        os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    # torch rebuilds an extension when its sources or flags change, not its headers: their digest is a flag.
    headers = hashlib.sha1(b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))).hexdigest()[:16]
    folder = build_directory(name)
    try:
        with build_lock(folder):
            return load(name, [str(s) for s in sources], extra_cflags=[*flags, f"-DZQ_HEADERS_DIGEST={headers}"],
                        extra_ldflags=["-fopenmp"], build_directory=str(folder), verbose=False)
    except Exception as e:  # no compiler, or no ninja: torch's own kernels serve instead
        log.warning("the actors' CPU kernels (%s) could not be built (%s); torch's kernels serve", name, e)
        return None


@functools.cache
def extension():
    """The compiled kernels, built once per machine (torch's extension cache), or None where they cannot be."""
    return _build("zq_cpu_kernels", SOURCES, FLAGS) if is_cpu_supported() else None


@functools.cache
def avx2_extension():
    """The AVX2 kernels, built once per machine, or None where the CPU lacks AVX2 or has AVX512-BF16, or no build."""
    return _build("zq_avx2_kernels", AVX2_SOURCES, AVX2_FLAGS) if is_avx2_supported() else None


def loaded():
    """The kernels if this process has loaded them already (packing does, off the stepping thread), else None:
    a step never pays for a load or a build."""
    return extension() if extension.cache_info().currsize else None


def avx2_loaded():
    """The AVX2 kernels if this process has loaded them already (packing does), else None: a step never builds."""
    return avx2_extension() if avx2_extension.cache_info().currsize else None


def loaded_for(dtype: torch.dtype):
    """The loaded extension whose kernels compute rows of `dtype` (bf16: the AVX512-BF16 one; fp32: the AVX2 one,
    over bf16 weights), or None."""
    if dtype == torch.bfloat16:
        return loaded()
    if dtype == torch.float32:
        return avx2_loaded()
    return None


def is_available() -> bool:
    """The kernels run here: the CPU has AVX512-BF16 and the extension is built (building it if needed)."""
    return extension() is not None


def main() -> int:
    """`python -m actors.cpu_kernels`: build (or find) the kernels, and say whether this machine runs them."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if is_cpu_supported():
        print(f"the actors' CPU kernels: {'built' if is_available() else 'NOT built (see the warning above)'}")
    if is_avx2_supported():
        print(f"the actors' AVX2 kernels: {'built' if avx2_extension() else 'NOT built (see the warning above)'}")
    if not is_cpu_supported() and not is_avx2_supported():
        print("the actors' CPU kernels: this CPU has neither AVX512-BF16 nor AVX2 with FMA; torch's kernels serve")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
