"""Probe: the static prefill with attention cut out of the layers (model/layer_split.py).

A pyramid of whole static models pays ~40 MB per past length at 4k, so only a few fit in the
memory bound (docs/measurements.md).  This runs the other design, NPUW's: per chunk, segment 0
(embeddings -> layer 0's Q, K, V), then for each layer attention over exactly the slots before
the chunk (one weightless model per multiple of the chunk, shared by all layers) and the next
segment (one graph for every middle layer, that layer's weights bound as inputs).  New K/V rows
go straight into per-layer buffers, which attention then reads as ROI views.  It prints each
run's TTFT, the chunk times, and the resident set once loaded and at its peak; ``--check``
then runs the pipeline's plain static path on the same prompt and prints the largest logit
difference.  Prefill only: it is a measurement, not a runtime.

    python scripts/attention_split_probe.py --model /tmp/smol-opt --prompt-len 4000 \\
        --max-prompt-len 4096
    python scripts/attention_split_probe.py --prompt-len 300 --max-prompt-len 512 --check \\
        -p INFERENCE_PRECISION_HINT=f32 -p KV_CACHE_PRECISION=f32
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import openvino as ov

from npuw_kv import LLMPipeline
from npuw_kv.bench_worker import status_mb
from npuw_kv.config import PipelineConfig
from npuw_kv.model.layer_split import split_layers
from npuw_kv.model.source import resolve_model
from npuw_kv.model.split import EMBEDS_INPUT, split_model
from npuw_kv.model.variants import StaticShapes, prepare, read_ir, static_ladder
from npuw_kv.runtime.compile import _head_target
from npuw_kv.runtime.device import device_properties, resolve_kv_precision
from npuw_kv.runtime.plan import PromptPlan, prefill_inputs


class Chain:
    """The compiled segments and attention models, the per-layer K/V buffers, and the loop."""

    def __init__(self, core: ov.Core, model_dir: Any, config: PipelineConfig) -> None:
        shapes = StaticShapes.of(config, config.max_prompt_len + config.min_response_len - 1)
        model, layout = prepare(
            read_ir(core, model_dir), resolve_kv_precision(core, config), shapes=shapes
        )
        parts = split_model(model, layout)
        body = static_ladder(parts.body, layout, shapes).prefill[-1][1]
        split = split_layers(body, layout)
        device, props = device_properties(core, config)
        if device == "NPU":
            # NPUW's f16 tensors between its sub-graphs refuse the f32 tensors bound between
            # segments; one sub-graph per segment keeps its per-call overhead low
            props = {"NPUW_F16IC": "NO", "NPUW_ONLINE_PIPELINE": "NONE", **props}
        self.split, self.chunk = split, config.prefill_chunk_size
        self.seconds: dict[str, float] = {}

        def compile_(m: ov.Model) -> ov.InferRequest:
            return core.compile_model(m, device, props).create_infer_request()

        self.first, self.middle, self.last = (
            compile_(s.model) for s in (split.first, split.middle, split.last)
        )
        heads, dim, c = layout.num_kv_heads, layout.head_dim, self.chunk
        self.pasts = list(range(0, shapes.prefill_past + 1, c))
        self.attention = {p: compile_(split.attention(p, c, heads, dim)) for p in self.pasts}
        host: dict[str, Any] = {"INFERENCE_PRECISION_HINT": "f32"}
        self.embed = core.compile_model(parts.embed, "CPU", host).create_infer_request()
        head = core.compile_model(parts.head, *_head_target(config, device, props))
        self.head = head.create_infer_request()
        # per layer, K and V of every prompt slot; a chunk writes [s, s + C), reads [0, s + C)
        kv_type = split.kv_type
        slots = shapes.prefill_past + c
        self.buffers = [
            [ov.Tensor(kv_type, [1, heads, slots, dim]) for _ in "kv"] for _ in range(split.layers)
        ]

        def view(t: ov.Tensor, a: int, b: int) -> ov.Tensor:
            return ov.Tensor(t, ov.Coordinate([0, 0, a, 0]), ov.Coordinate([1, heads, b, dim]))

        self.writes = {
            s: [[view(t, s, s + c) for t in kv] for kv in self.buffers] for s in self.pasts
        }
        self.reads = {
            s: [[view(t, 0, s + c) for t in kv] for kv in self.buffers] for s in self.pasts
        }
        self.query = ov.Tensor(split.query_type, split.query_shape)
        self.attended = ov.Tensor(split.query_type, split.query_shape)
        self.outputs: dict[tuple[int, int], ov.Tensor] = {}  # (segment or parity, output)
        for k, request in ((0, self.first), (1, self.middle), (2, self.middle)):
            for j, out in enumerate(request.get_compiled_model().outputs[3:], 3):
                self.outputs[(k, j)] = ov.Tensor(out.get_element_type(), out.get_shape())
        for k, sources in enumerate(split.wiring):
            for src in sources:
                if src[0] == "segment" and 1 <= src[1] < split.layers and src[1] != k - 1:
                    raise ValueError(f"segment {k} reads segment {src[1]}: not a chain")
                if src[0] == "input" and src[1] not in (EMBEDS_INPUT, "position_ids"):
                    raise ValueError(f"segment {k} reads input {src[1]}")

    def _segment(self, layer: int) -> ov.InferRequest:
        """The request that computes layer ``layer``'s Q, K, V (the hidden state after the last)."""
        if layer == 0:
            return self.first
        return self.last if layer == self.split.layers else self.middle

    def _tensor(self, src: tuple, inputs: dict[str, ov.Tensor]) -> ov.Tensor:
        if src[0] == "attention":
            return self.attended
        if src[0] == "input":
            return inputs[src[1]]
        k, j = src[1], src[2]
        return self.outputs[(0 if k == 0 else 1 + k % 2, j)]

    def _mask(self, attention_mask: np.ndarray, start: int) -> ov.Tensor:
        """The chunk's rows over slots ``[0, start + C)``: live slots, causal within the chunk,
        tiled for the query heads of a KV group."""
        c = self.chunk
        cols = np.arange(start + c)
        allowed = (attention_mask[0] > 0)[None, :] & (
            cols[None, :] <= (start + np.arange(c))[:, None]
        )
        dtype = self.split.mask_type.to_dtype()
        mask = np.where(allowed, 0, np.finfo(dtype).min).astype(dtype)
        tiled = np.tile(mask, (self.split.query_shape[2] // c, 1))[None, None]
        return ov.Tensor(np.ascontiguousarray(tiled))

    def _timed(self, kind: str, request: ov.InferRequest) -> None:
        started = time.perf_counter()
        request.infer()
        self.seconds[kind] += time.perf_counter() - started

    def prefill(self, ids: np.ndarray) -> tuple[np.ndarray, list[float]]:
        """The last prompt token's logits and each chunk's milliseconds."""
        plan = PromptPlan(int(ids.size), self.chunk)
        split, times = self.split, []
        self.seconds = {"segments": 0.0, "attention": 0.0}
        for k in range(plan.num_chunks):
            started = time.perf_counter()
            start = plan.chunk_slots(k)[0]
            step = prefill_inputs(ids, plan, k, start)
            self.embed.set_tensor("input_ids", ov.Tensor(step.input_ids))
            self.embed.infer()
            inputs = {
                EMBEDS_INPUT: self.embed.get_output_tensor(0),
                "position_ids": ov.Tensor(step.position_ids),
            }
            attention = self.attention[start]
            attention.set_input_tensor(0, self.query)
            attention.set_input_tensor(3, self._mask(step.attention_mask, start))
            attention.set_output_tensor(0, self.attended)
            for layer in range(split.layers + 1):
                request = self._segment(layer)
                sources = split.wiring[layer]
                for j, src in enumerate(sources):
                    request.set_input_tensor(j, self._tensor(src, inputs))
                if layer == split.layers:
                    self._timed("segments", request)
                    break
                if layer:
                    for j, weight in enumerate(split.middle.weights[layer], len(sources)):
                        request.set_input_tensor(j, weight)
                request.set_output_tensor(0, self.query)
                for j, view in enumerate(self.writes[start][layer], 1):
                    request.set_output_tensor(j, view)
                for j in range(3, len(request.get_compiled_model().outputs)):
                    request.set_output_tensor(j, self._tensor(("segment", layer, j), inputs))
                self._timed("segments", request)
                for j, view in enumerate(self.reads[start][layer], 1):
                    attention.set_input_tensor(j, view)
                self._timed("attention", attention)
            times.append((time.perf_counter() - started) * 1e3)
        self.head.set_input_tensor(self.last.get_output_tensor(0))
        self.head.infer()
        return self.head.get_output_tensor(0).data.reshape(-1).copy(), times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="IR directory or .gguf (default: SmolLM2)")
    parser.add_argument("--device", default="NPU", choices=("NPU", "CPU"))
    parser.add_argument("--prompt-len", type=int, default=1000)
    parser.add_argument("--max-prompt-len", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--check", action="store_true", help="compare with the static path")
    parser.add_argument("-p", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    settings = dict(kv.split("=", 1) for kv in args.p)
    model_dir = resolve_model(args.model)
    config = PipelineConfig.from_kwargs(
        args.device,
        max_prompt_len=args.max_prompt_len,
        prefill_chunk_size=args.chunk,
        static_models=True,
        **settings,
    )
    chain = Chain(ov.Core(), model_dir, config)
    print(f"loaded: {status_mb('VmRSS'):.0f} MB", flush=True)
    ids = np.random.default_rng(0).integers(100, 10000, args.prompt_len)
    for _ in range(args.repeats):
        started = time.perf_counter()
        logits, times = chain.prefill(ids)
        ttft = time.perf_counter() - started
        spent = chain.seconds
        print(
            f"TTFT {ttft:.2f} s (segments {spent['segments']:.2f}, attention "
            f"{spent['attention']:.2f}, the rest {ttft - sum(spent.values()):.2f}); chunk ms: "
            + " ".join(f"{t:.0f}" for t in times),
            flush=True,
        )
    print(f"peak: {status_mb('VmHWM'):.0f} MB", flush=True)
    if args.check:
        pipe = LLMPipeline(
            model_dir,
            args.device,
            max_prompt_len=args.max_prompt_len,
            prefill_chunk_size=args.chunk,
            static_models=True,
            prefill_attention="static",
            prefix_reuse=False,
            **settings,
        )
        static = pipe.runner.prefill(ids)
        print(
            f"static path: max |dlogit| {np.abs(static - logits).max():.3g}, "
            f"argmax {int(static.argmax())} vs {int(logits.argmax())}"
        )


if __name__ == "__main__":
    main()
