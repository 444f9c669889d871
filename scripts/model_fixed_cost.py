"""Probe: the memory each further static model costs on the NPU path, and where it goes.

Every rung of a ladder is one more NPUW compiled model.  With the weights in one bank it still
costs tens of MB here: 10-17 MB at compile whatever its shapes, then its first call's buffers.
``npuw`` compiles the real ladder's models one after another (as the pipeline does: one bank)
and prints the resident-set growth of each compile, its request and its first call.  ``cpu``
shows the likely cause on the CPU plugin alone: a model whose weights are f16 *inputs* (as NPUW
passes folded weights to its functions) gets an input buffer of its own for each of them at
compile, although the caller binds its own tensors zero-copy; the growth per compile is printed
against the f16 bytes of those inputs.

    python scripts/model_fixed_cost.py npuw --model /tmp/smol-opt --max-prompt-len 4096
    python scripts/model_fixed_cost.py npuw -m /tmp/smol-opt -p NPUW_CWAI=YES
    python scripts/model_fixed_cost.py cpu --layers 8
"""

from __future__ import annotations

import argparse

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from npuw_kv.config.decide import decide
from npuw_kv.config.pipeline_config import PipelineConfig
from npuw_kv.model.families import wide_activations
from npuw_kv.model.source import read_ir, resolve_model
from npuw_kv.model.split import split_model
from npuw_kv.model.variants import prepare, static_ladder
from npuw_kv.runtime.device import device_properties
from npuw_kv.runtime.shapes import shapes_for
from npuw_kv.tools.bench_worker import status_mb


def rss_mb() -> float:
    mb = status_mb("VmRSS")
    if mb is None:
        raise SystemExit("this probe reads /proc/self/status (Linux only)")
    return mb


def zeros(port: ov.Output) -> ov.Tensor:
    """A zero tensor for ``port``, its pages touched (``np.zeros`` would map them lazily and the
    first call would count them)."""
    data = np.empty(port.get_shape(), port.get_element_type().to_dtype())
    data.fill(0)
    return ov.Tensor(data)


def compile_and_call(
    core: ov.Core, model: ov.Model, device: str, props: dict, inputs: list[ov.Tensor]
) -> tuple[list[object], float, float, float]:
    """Compile ``model``, bind ``inputs`` zero-copy and run it once; the compiled model and its
    request (to keep them alive) and the MB the compile, the request and the first call added."""
    before = rss_mb()
    compiled = core.compile_model(model, device, props)
    compiled_at = rss_mb()
    request = compiled.create_infer_request()
    requested = rss_mb()
    for k, tensor in enumerate(inputs):
        request.set_input_tensor(k, tensor)
    request.infer()
    return [compiled, request], compiled_at - before, requested - compiled_at, rss_mb() - requested


def npuw_ladder(args: argparse.Namespace) -> None:
    core = ov.Core()
    config = PipelineConfig.from_kwargs(
        "NPU",
        max_prompt_len=args.max_prompt_len,
        min_response_len=args.min_response_len,
        prefill_attention="pyramid",
        generate_pyramid=True,
    )
    model_dir = resolve_model(args.model)
    wide = wide_activations(model_dir)
    shapes = shapes_for(config, config.max_prompt_len + config.min_response_len)
    decided = decide(core, config, wide)
    assert decided.kv_precision is not None
    model, layout = prepare(read_ir(core, model_dir), decided.kv_precision, shapes=shapes)
    ladder = static_ladder(split_model(model, layout).body, layout, shapes)
    device, props = device_properties(decided)
    props.update(dict(kv.split("=", 1) for kv in args.prop))
    models = [("prefill", p, m) for p, m in ladder.prefill[: args.models]]
    models += [("generate", p, m) for p, m in ladder.generate[: args.models]]
    held = []
    print(
        f"{device} {props.get('NPUW_DEVICES', '')}, KV {decided.kv_precision}; MB of resident set:"
    )
    for phase, past, m in models:
        inputs = [zeros(port) for port in m.inputs]  # ours, before the model's are counted
        kept, compile_mb, request_mb, call_mb = compile_and_call(core, m, device, props, inputs)
        held.append(kept)
        print(
            f"{phase} past {past}: compile +{compile_mb:.1f} request +{request_mb:.1f} "
            f"first call +{call_mb:.1f}"
        )
    print("(the first model also builds the weights bank)")


def mlp_layers(layers: int, tokens: int) -> ov.Model:
    """``layers`` MLP blocks of SmolLM2-135M's size, the weights f16 inputs upcast in the graph."""
    x = ops.parameter([1, tokens, 576], np.float32, name="x")
    params, hidden = [x], x.output(0)
    for _ in range(layers):
        weights = []
        for shape in ([1536, 576], [1536, 576], [576, 1536]):
            param = ops.parameter(shape, np.float16)
            params.append(param)
            weights.append(ops.convert(param, np.float32))
        gate = ops.matmul(hidden, weights[0], False, True)
        up = ops.matmul(hidden, weights[1], False, True)
        down = ops.matmul(ops.multiply(ops.swish(gate), up), weights[2], False, True)
        hidden = ops.add(hidden, down).output(0)
    return ov.Model([hidden], params)


def cpu_inputs(args: argparse.Namespace) -> None:
    core = ov.Core()
    tensors = [zeros(p.output(0)) for p in mlp_layers(args.layers, args.tokens).get_parameters()]
    f16_mb = sum(t.byte_size for t in tensors[1:]) / 2**20
    print(f"{args.layers} MLP layers, f16 weight inputs {f16_mb:.1f} MB, bound zero-copy:")
    held = []
    for i in range(args.compiles):
        model = mlp_layers(args.layers, args.tokens)
        kept, compile_mb, request_mb, call_mb = compile_and_call(core, model, "CPU", {}, tensors)
        held.append(kept)
        print(f"compile {i + 1}: +{compile_mb:.1f} MB, first call +{request_mb + call_mb:.1f} MB")
    print("(the first compile also loads the plugin's code)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="part", required=True)
    npuw = sub.add_parser("npuw", help="the real ladder's models under NPUW")
    npuw.add_argument("--model", "-m", default=None, help="IR dir, .gguf or smollm2")
    npuw.add_argument("--max-prompt-len", type=int, default=4096)
    npuw.add_argument("--min-response-len", type=int, default=128)
    npuw.add_argument("--models", type=int, default=3, help="of each phase, smallest first")
    npuw.add_argument(
        "--prop", "-p", action="append", default=[], metavar="KEY=VALUE", help="NPU setting"
    )
    cpu = sub.add_parser("cpu", help="f16 weight inputs on the CPU plugin alone")
    cpu.add_argument("--layers", type=int, default=8)
    cpu.add_argument("--tokens", type=int, default=256)
    cpu.add_argument("--compiles", type=int, default=3)
    args = parser.parse_args()
    (npuw_ladder if args.part == "npuw" else cpu_inputs)(args)


if __name__ == "__main__":
    main()
