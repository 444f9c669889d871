"""Probe: what a strided past costs one static model of the NPU path, against a dense one.

Every static model but the whole-buffer generate model reads its past as a view ``[0, P)`` of
the shared ``[1, H, L, D]`` buffer, which is strided when H > 1.  The runtime binds such views
as they are (``kv_binding=roi``), and the device may copy them before each call.  This compiles
one model the way the pipeline does (NPU: NPUW on the CPU unless an NPU is present), binds its
past first as dense tensors of the view's shape, then as strided views of a whole-length buffer,
alternating, and prints the median time of a call for each.  Nothing else changes between the
two, so the difference is what the device does with the strides.

    python scripts/strided_view_cost.py --model /tmp/smol-opt --max-prompt-len 4096
    python scripts/strided_view_cost.py --phase prefill --max-prompt-len 4096
    python scripts/strided_view_cost.py --phase prefill --past 3840 --max-prompt-len 4096
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import openvino as ov

from npuw_kv.config.decide import decide
from npuw_kv.config.pipeline_config import PipelineConfig
from npuw_kv.model.families import wide_activations
from npuw_kv.model.source import read_ir, resolve_model
from npuw_kv.model.split import split_model
from npuw_kv.model.variants import prepare, static_ladder
from npuw_kv.runtime.device import device_properties
from npuw_kv.runtime.shapes import shapes_for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", "-m", default=None, help="IR dir, .gguf or smollm2")
    parser.add_argument("--max-prompt-len", type=int, default=4096)
    parser.add_argument("--min-response-len", type=int, default=128)
    parser.add_argument(
        "--phase",
        choices=("generate", "prefill"),
        default="generate",
        help="the smallest generate variant, or the smallest prefill rung",
    )
    parser.add_argument(
        "--past", type=int, default=None, help="the model of this past (default: the smallest)"
    )
    parser.add_argument("--calls", type=int, default=20, help="timed calls per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    core = ov.Core()
    config = PipelineConfig.from_kwargs(
        "NPU", max_prompt_len=args.max_prompt_len, min_response_len=args.min_response_len
    )
    shapes = shapes_for(config, config.total_len)
    model_dir = resolve_model(args.model)
    wide = wide_activations(model_dir)  # as the pipeline: Gemma keeps f32 between sub-graphs
    decided = decide(core, config, wide)
    assert decided.kv_precision is not None
    model, layout = prepare(read_ir(core, model_dir), decided.kv_precision, shapes=shapes)
    ladder = static_ladder(split_model(model, layout).body, layout, shapes)
    if args.phase == "generate":
        variants, phase_layout = ladder.generate, ladder.generate_layout
    else:
        variants, phase_layout = ladder.prefill, ladder.prefill_layout
    pasts = [p for p, _ in variants]
    if args.past is not None and args.past not in pasts:
        raise SystemExit(f"no {args.phase} model of past {args.past}; there are {pasts}")
    past, chosen = next(v for v in variants if args.past in (None, v[0]))
    capacity = shapes.generate_past
    if past in (0, capacity):
        reads = "no past" if past == 0 else f"the whole buffer ({capacity} slots)"
        raise SystemExit(
            f"the smallest {args.phase} model reads {reads}: its past is dense either way; "
            "raise --max-prompt-len"
        )
    device, props = device_properties(decided)
    request = core.compile_model(chosen, device, props).create_infer_request()
    dense: dict[str, ov.Tensor] = {}
    strided: dict[str, ov.Tensor] = {}
    # the views' parents stay referenced: NPUW on the CPU corrupted the heap when a past bound
    # dense was rebound to a view whose parent tensor had been dropped (docs/measurements.md)
    buffers: list[ov.Tensor] = []
    for port in phase_layout.ports:
        shape = list(request.get_compiled_model().input(port.input_name).get_shape())
        kind = request.get_compiled_model().input(port.input_name).get_element_type()
        whole = list(shape)
        whole[port.seq_axis] = capacity
        buffer = ov.Tensor(kind, whole)
        buffer.data[...] = 0.01
        buffers.append(buffer)
        strided[port.input_name] = ov.Tensor(buffer, [0] * len(shape), shape)
        dense[port.input_name] = ov.Tensor(kind, shape)
        dense[port.input_name].data[...] = 0.01
    for inp in request.get_compiled_model().inputs:
        name = inp.get_any_name()
        if name in dense:
            continue
        tensor = ov.Tensor(inp.get_element_type(), inp.get_shape())
        values = tensor.data
        if "position" in name:
            values[...] = np.arange(values.size).reshape(values.shape)
        else:
            values[...] = 1 if "mask" in name else 0.1
        request.set_tensor(name, tensor)

    def timed(bound: dict[str, ov.Tensor]) -> float:
        for name, tensor in bound.items():
            request.set_tensor(name, tensor)
        request.infer()  # a first call after rebinding is not timed
        times = []
        for _ in range(args.calls):
            start = time.perf_counter()
            request.infer()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1000

    print(f"{args.phase} model, past {past} of a {capacity}-slot buffer ({model_dir.name})")
    for round_ in range(1, args.rounds + 1):
        a, b = timed(dense), timed(strided)
        print(f"round {round_}: dense {a:.2f} ms, strided {b:.2f} ms a call ({b / a:.2f}x)")


if __name__ == "__main__":
    main()
