"""Build a random LoRA adapter for an optimum-intel IR, and the IR with an adapter merged.

The adapter is written as PEFT saves one (``adapter_model.safetensors``: tensors named
``base_model.model.<layer>.lora_A.weight`` [rank, in] and ``...lora_B.weight`` [out, rank]),
for the layers of the IR whose MatMul names end in one of ``--targets``.  ``merge_lora`` writes
a copy of the IR whose adapted weights are ``W + alpha * B @ A`` in f32: the reference that
tests hold LoRA through the alpha input against.

Usage: ``python models/make_lora_adapter.py IR_DIR OUT.safetensors [--rank 4] [--seed 0]``.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops

PREFIX = "base_model.model."
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_LAYER = re.compile(r"__module\.(?P<layer>.+)/aten::linear/MatMul$")


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray]) -> None:
    """Tensors as float32 in the safetensors layout."""
    header: dict[str, object] = {}
    blobs, offset = [], 0
    for name, value in tensors.items():
        data = np.ascontiguousarray(value, np.float32).tobytes()
        header[name] = {
            "dtype": "F32",
            "shape": list(value.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    Path(path).write_bytes(len(text).to_bytes(8, "little") + text + b"".join(blobs))


def linear_layers(model: ov.Model, targets: Sequence[str] = TARGETS) -> dict[str, ov.Node]:
    """The IR's linear layers named after ``targets``: layer name -> its MatMul (an IR without
    layer names, as a GGUF-converted one, named by npuw-kv's structural names)."""
    from npuw_kv.model.lora import structural_names, weight_matmuls

    weights = weight_matmuls(model)
    aliases = structural_names(model, weights)
    out = {}
    for node in weights:
        match = _LAYER.match(node.get_friendly_name())
        layer = match["layer"] if match else aliases.get(node.get_name())
        if layer and layer.rsplit(".", 1)[-1] in targets:
            out[layer] = node
    return out


def weight(node: ov.Node) -> np.ndarray:
    """The MatMul's weight as [out, in] float32 (the decompression evaluated on CPU)."""
    source = node.input_value(1)
    exact = {"INFERENCE_PRECISION_HINT": "f32"}
    result = ov.Core().compile_model(ov.Model([ops.result(source)], []), "CPU", exact)({})
    w = np.asarray(next(iter(result.values())), np.float32)
    return w if node.get_attributes().get("transpose_b", False) else w.T


def make_lora_adapter(
    ir_dir: str | Path,
    out: str | Path,
    rank: int = 4,
    std: float = 0.1,
    seed: int = 0,
    targets: Sequence[str] = TARGETS,
) -> Path:
    """A random adapter of ``rank`` for the IR's ``targets`` layers, written to ``out``."""
    model = ov.Core().read_model(Path(ir_dir) / "openvino_model.xml")
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer, node in linear_layers(model, targets).items():
        outputs, inputs = weight(node).shape
        tensors[f"{PREFIX}{layer}.lora_A.weight"] = rng.normal(0, std, (rank, inputs))
        tensors[f"{PREFIX}{layer}.lora_B.weight"] = rng.normal(0, std, (outputs, rank))
    if not tensors:
        raise SystemExit(f"no layer of {ir_dir} is named after {list(targets)}")
    write_safetensors(out, tensors)
    return Path(out)


def merge_lora(
    ir_dir: str | Path, adapters: Sequence[tuple[str | Path, float]], out_dir: str | Path
) -> Path:
    """A copy of the IR directory whose adapted weights are ``W + sum(alpha * B @ A)``."""
    from npuw_kv.model.safetensors import read_safetensors

    src, dst = Path(ir_dir), Path(out_dir)
    shutil.copytree(src, dst, dirs_exist_ok=True)
    model = ov.Core().read_model(src / "openvino_model.xml")
    layers = linear_layers(model, targets=tuple(TARGETS) + ("lm_head",))
    updates: dict[str, np.ndarray] = {}
    for path, alpha in adapters:
        tensors = read_safetensors(path)
        for layer in layers:
            a = tensors.get(f"{PREFIX}{layer}.lora_A.weight")
            if a is not None:
                b = tensors[f"{PREFIX}{layer}.lora_B.weight"]
                updates[layer] = updates.get(layer, 0) + alpha * (b @ a)
    for layer, delta in updates.items():
        node = layers[layer]
        merged = (weight(node) + delta).astype(np.float32)
        node.input(1).replace_source_output(ops.constant(merged).output(0))
        node.set_attribute("transpose_b", True)
    ov.save_model(model, dst / "openvino_model.xml", compress_to_fp16=False)
    return dst


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ir_dir")
    parser.add_argument("out")
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--std", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(make_lora_adapter(args.ir_dir, args.out, args.rank, args.std, args.seed))


if __name__ == "__main__":
    main()
