"""Tensor dtype names: the one table of each spelling, and the maps between them.

Three spellings meet in this project:

    safetensors   "F32", "BF16", "I64", ...: safetensors headers, and `.zqs` headers after them
    model         "float32", "bfloat16", "float16": config.json's `torch_dtype`, --dtype, a model's build dtype
    torch         torch.float32, ...: `torch_dtype` / `model_dtype` only

A model is built, and its weights stored, in one of the three model dtypes. Importing
this module needs no torch: the CLI and the format code run without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Bytes per element of every whole-byte safetensors dtype.
SAFETENSORS_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}
SAFETENSORS_FLOATS = ("F16", "BF16", "F32", "F64")

# Model dtype -> its safetensors name; this order is the one every "supported: ..." lists.
MODEL_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
MODEL_DTYPE_BYTES = {name: SAFETENSORS_SIZES[stored] for name, stored in MODEL_DTYPES.items()}
# Safetensors name -> model dtype, for the stored dtypes a model can be built in.
MODEL_DTYPE_OF = {stored: name for name, stored in MODEL_DTYPES.items()}


def torch_dtype(name: str) -> torch.dtype:
    """torch.bfloat16 for "bfloat16", ...; ValueError naming the model dtypes for anything else."""
    if name not in MODEL_DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; supported: {', '.join(MODEL_DTYPES)}")
    import torch  # imported here: see the module docstring

    return getattr(torch, name)  # the model dtypes' names are torch's own


def model_dtype(dtype: torch.dtype | str) -> str:
    """"float32" / "bfloat16" / "float16" for a torch dtype or such a name; ValueError otherwise."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in MODEL_DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {', '.join(MODEL_DTYPES)}")
    return name
