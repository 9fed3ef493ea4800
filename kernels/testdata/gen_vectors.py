#!/usr/bin/env python3
"""Generate kernels/testdata/gguf_py_vectors.json: reference vectors for the weight types
candle-core lacks (IQ4_NL, IQ4_XS, MXFP4), produced by gguf-py's numpy implementation
(`gguf.quants`, the reference llama.cpp publishes beside ggml and uses to check conversions).

    pip install gguf numpy
    python3 kernels/testdata/gen_vectors.py

Deterministic: a fixed numpy seed, so re-running with the same gguf-py gives the same file.
Blocks are random bytes with sane scales (finite, non-huge f16 `d`; E8M0 exponents across the
range, including the subnormal ones 0 and 1), plus edge cases. Every float is stored as its
little-endian bytes in hex, so values round-trip exactly.
"""

import importlib.metadata
import json
import pathlib

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

rng = np.random.default_rng(20240607)


def hexs(a: np.ndarray) -> str:
    return np.ascontiguousarray(a).tobytes().hex()


def f16_scales(n: int) -> np.ndarray:
    """Sane f16 scales: magnitudes 2^-14 .. 2^2, both signs, plus zero and a subnormal."""
    mags = 2.0 ** rng.uniform(-14, 2, size=n)
    signs = rng.choice([-1.0, 1.0], size=n)
    d = (mags * signs).astype(np.float16)
    if n >= 2:
        d[0] = np.float16(0.0)
        d[1] = np.float16(2.0 ** -20)  # subnormal f16
    return d


def iq4_nl_blocks(n: int) -> np.ndarray:
    d = f16_scales(n).view(np.uint8).reshape(n, 2)
    qs = rng.integers(0, 256, size=(n, 16), dtype=np.uint8)
    return np.concatenate([d, qs], axis=1)


def iq4_xs_blocks(n: int) -> np.ndarray:
    d = f16_scales(n).view(np.uint8).reshape(n, 2)
    scales_h = rng.integers(0, 1 << 16, size=n, dtype=np.uint16).view(np.uint8).reshape(n, 2)
    scales_l = rng.integers(0, 256, size=(n, 4), dtype=np.uint8)
    qs = rng.integers(0, 256, size=(n, 128), dtype=np.uint8)
    return np.concatenate([d, scales_h, scales_l, qs], axis=1)


def mxfp4_blocks(n: int) -> np.ndarray:
    e = rng.integers(100, 150, size=(n, 1), dtype=np.uint8)
    edge = [0, 1, 2, 127, 128, 200]
    e[: len(edge), 0] = edge
    qs = rng.integers(0, 256, size=(n, 16), dtype=np.uint8)
    return np.concatenate([e, qs], axis=1)


def dequant_case(qtype, blocks: np.ndarray) -> dict:
    raw = blocks.reshape(-1)
    out = quants.dequantize(raw, qtype).astype(np.float32).reshape(-1)
    return {"blocks": hexs(raw), "f32": hexs(out.astype("<f4"))}


def mxfp4_quant_input() -> np.ndarray:
    blocks = []
    for b in range(8):
        scale = 2.0 ** rng.uniform(-8, 8)
        blocks.append(rng.standard_normal(32) * scale)
    blocks.append(np.zeros(32))  # all zero: e = 0
    x = np.linspace(-3.0, 3.0, 32)  # exact levels and midpoints at d = 0.5
    blocks.append(x)
    return np.concatenate(blocks).astype(np.float32)


def main() -> None:
    x = mxfp4_quant_input()
    q = quants.quantize(x.reshape(-1, 32), T.MXFP4).reshape(-1)
    doc = {
        "generator": f"kernels/testdata/gen_vectors.py with gguf-py {importlib.metadata.version('gguf')}, numpy {np.__version__}",
        "dequantize": {
            "iq4_nl": dequant_case(T.IQ4_NL, iq4_nl_blocks(12)),
            "iq4_xs": dequant_case(T.IQ4_XS, iq4_xs_blocks(2)),
            "mxfp4": dequant_case(T.MXFP4, mxfp4_blocks(12)),
        },
        "quantize": {
            "mxfp4": {"f32": hexs(x.astype("<f4")), "blocks": hexs(q)},
        },
    }
    path = pathlib.Path(__file__).with_name("gguf_py_vectors.json")
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
