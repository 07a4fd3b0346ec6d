"""The `zstd-bytegroup` transform: each block of a frame's bytes regrouped by byte position in the element.

For a block of n bytes of w-byte elements, byte k of every element goes to plane k, so a
block becomes byte 0 of each element, then byte 1, ... (docs/zqs-format.md, "zstd-bytegroup").
Why: in float weights the sign and exponent bytes take few values and entropy-code well,
while mantissa bytes are close to random. zstd's Huffman literals ignore byte order, so
this helps only because each plane run fills whole zstd blocks, each with its own table:
normal(0, 0.02) bf16 weights compress 1.46x grouped against 1.28x plain, both at level 1
(docs/zqs-format.md, "Measured"). Working block by block bounds the decoder's scratch
memory to one block.
"""

from __future__ import annotations

import sys

import numpy as np

_IS_LITTLE_ENDIAN = sys.byteorder == "little"


def byte_group(src: np.ndarray, element_size: int, block_size: int) -> np.ndarray:
    """Transpose each block of `src` (uint8) into element_size planes: byte k of every element, then k+1.

    Within a block of n bytes, plane k holds byte k of each of the n/element_size elements
    (little-endian, so the last plane holds the sign and exponent bits of a float).
    """
    out = np.empty_like(src)
    for start in range(0, len(src), block_size):
        block = src[start : start + block_size]
        num_elements = len(block) // element_size
        for k in range(element_size):
            out[start + k * num_elements : start + (k + 1) * num_elements] = block[k::element_size]
    return out


def byte_ungroup(planes: np.ndarray, out: np.ndarray, element_size: int) -> None:
    """Inverse of `byte_group` for ONE block: interleave the planes of `planes` into `out` (both uint8)."""
    num_elements = len(planes) // element_size
    if element_size == 2 and _IS_LITTLE_ENDIAN and out.ctypes.data % 2 == 0:
        # 16-bit words as (high << 8) | low: two contiguous SIMD passes instead of two
        # strided byte stores (out[k::2] = plane), which numpy cannot vectorise.
        words = out.view(np.uint16)
        np.left_shift(planes[num_elements:], 8, out=words, dtype=np.uint16)
        np.bitwise_or(words, planes[:num_elements], out=words)
        return
    for k in range(element_size):
        out[k::element_size] = planes[k * num_elements : (k + 1) * num_elements]
