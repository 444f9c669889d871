"""Exact Q4_1 zero points for the IR that openvino-genai makes from a GGUF file.

A Q4_1 block stores 32 four-bit values q with a scale d and a *minimum* m: w = d*q + m.
openvino-genai's converter expresses that as OpenVINO's ``(q - z) * d`` with z a 4-bit
*integer*, i.e. it rounds z = -m/d, shifting every weight of the block by up to d/2.  On
SmolLM2-135M Q4_1 that costs perplexity 11.6 -> 14.2 (stdlib text, 1k tokens; transformers
running the same GGUF gives 11.6).  Here the rounded zero points are replaced by the exact
-m/d in f16, read back from the GGUF.  The IR's rows can be a permutation of the GGUF's (the
converter undoes llama.cpp's Q/K row order), so rows are matched by content (q and d).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops

_Q4_1_BLOCK = 20  # bytes: f16 d, f16 m, 16 bytes of nibbles (32 values)


def _q4_1_rows(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q [rows, groups, 32] uint8, d [rows, groups] f16, m [rows, groups] f16) of a Q4_1 tensor."""
    blocks = np.ascontiguousarray(raw, np.uint8).reshape(raw.shape[0], -1, _Q4_1_BLOCK)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    nibbles = blocks[..., 4:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)  # low nibbles hold values 0..15
    return q, d, m


def _unpack_u4(packed: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    flat = np.asarray(packed, np.uint8).reshape(-1)
    out = np.empty(flat.size * 2, np.uint8)
    out[0::2], out[1::2] = flat & 0x0F, flat >> 4
    return out.reshape(shape)


def _gguf_zero_points(gguf_path: Path) -> dict[bytes, np.ndarray]:
    """Row content (q bytes + d bytes) -> exact zero points -m/d of that row, for Q4_1 tensors."""
    import gguf

    rows: dict[bytes, np.ndarray] = {}
    for tensor in gguf.GGUFReader(gguf_path).tensors:
        if tensor.tensor_type != gguf.GGMLQuantizationType.Q4_1:
            continue
        q, d, m = _q4_1_rows(np.asarray(tensor.data))
        with np.errstate(divide="ignore", invalid="ignore"):
            z = np.where(d != 0, -m.astype(np.float32) / d.astype(np.float32), 0.0)
        for r in range(q.shape[0]):
            rows[q[r].tobytes() + d[r].tobytes()] = z[r].astype(np.float16)
    return rows


def exact_q4_1_zero_points(model: ov.Model, gguf_path: Path) -> int:
    """Swap each rounded u4 zero point for the exact f16 one; return how many tensors changed.

    A weight is changed only if every one of its rows is found in the GGUF; anything else
    (other quantizations, a different file) is left as it is.
    """
    exact = _gguf_zero_points(gguf_path)
    if not exact:
        return 0
    changed = 0
    for const in model.get_ordered_ops():
        if const.get_type_name() != "Constant" or const.get_output_element_type(0) != ov.Type.u4:
            continue
        shape = tuple(const.get_output_shape(0))
        if len(shape) != 3 or shape[2] == 1:
            continue  # a zero-point constant itself
        convert = next(iter(const.output(0).get_target_inputs())).get_node()
        subtract = next(iter(convert.output(0).get_target_inputs())).get_node()
        if subtract.get_type_name() != "Subtract":
            continue
        multiply = next(iter(subtract.output(0).get_target_inputs())).get_node()
        scale = multiply.input(1).get_source_output().get_node()
        zp_convert = subtract.input(1).get_source_output().get_node()
        if scale.get_type_name() != "Constant" or zp_convert.get_type_name() != "Convert":
            continue
        q = _unpack_u4(const.get_data(), shape)
        d = np.asarray(scale.get_data(), np.float16).reshape(shape[0], shape[1])
        keys = [q[r].tobytes() + d[r].tobytes() for r in range(shape[0])]
        if not all(k in exact for k in keys):
            continue
        z = np.stack([exact[k] for k in keys])[..., None]
        zp = ops.constant(z.astype(np.float16))
        subtract.input(1).replace_source_output(zp.output(0))
        changed += 1
    if changed:
        model.validate_nodes_and_infer_types()
    return changed
