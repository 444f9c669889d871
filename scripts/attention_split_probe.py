"""Probe: the static-shape path with attention cut out of the layers (model/layer_split.py).

A pyramid of whole static models pays ~40 MB per past length at 4k, so only a few fit in the
memory bound (docs/measurements.md).  This runs the other design, NPUW's: per chunk, segment 0
(embeddings -> layer 0's Q, K, V), then for each layer attention over exactly the slots up to
the chunk's last (one weightless model per multiple of the chunk, shared by all layers) and the
next segment (one graph for every middle layer, that layer's weights bound as inputs).  New K/V
rows go straight into per-layer buffers, which attention then reads as ROI views.  With
``--new-tokens`` the generate steps run as the same kind of chain (one token a call, attention
over 512, 1024, 2048, ... slots), so the weights are held once for both phases.  It prints each
run's TTFT and how it splits, the chunk times, the decode speed, and the resident set once
loaded and at its peak; ``--check`` then runs the pipeline's plain static path on the same
prompt and prints the largest logit difference and how many greedy tokens agree.  It is a
measurement, not a runtime.

    python scripts/attention_split_probe.py --model /tmp/smol-opt --prompt-len 4000 \\
        --max-prompt-len 4096 --new-tokens 64
    python scripts/attention_split_probe.py --prompt-len 300 --max-prompt-len 512 --check \\
        --new-tokens 8 -p INFERENCE_PRECISION_HINT=f32 -p KV_CACHE_PRECISION=f32
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import openvino as ov

from npuw_kv import LLMPipeline
from npuw_kv.config.pipeline_config import PipelineConfig
from npuw_kv.model.layer_split import LayerSplit, split_layers
from npuw_kv.model.layout import KVLayout
from npuw_kv.model.source import resolve_model
from npuw_kv.model.split import EMBEDS_INPUT, split_model
from npuw_kv.model.variants import StaticShapes, prepare, read_ir, static_pair
from npuw_kv.runtime.compile import _head_target
from npuw_kv.runtime.device import device_properties, resolve_kv_precision
from npuw_kv.runtime.static.plan import PromptPlan, prefill_inputs
from npuw_kv.tools.bench_worker import status_mb


class Phase:
    """One phase's chain (``rows`` new tokens a call: the chunk, or 1 for a generate step):
    its three compiled segments and one attention model per KV length it reads."""

    def __init__(
        self,
        compile_: Callable[[ov.Model], ov.InferRequest],
        split: LayerSplit,
        lengths: list[int],
        rows: int,
        layout: KVLayout,
    ) -> None:
        self.split, self.rows, self.lengths = split, rows, lengths
        self.first, self.middle, self.last = (
            compile_(s.model) for s in (split.first, split.middle, split.last)
        )
        heads, dim = layout.num_kv_heads, layout.head_dim
        self.attention = {n: compile_(split.attention(n - rows, rows, heads, dim)) for n in lengths}
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
        self.seconds = {"segments": 0.0, "attention": 0.0}

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

    def _mask(self, start: int, length: int, first: int) -> ov.Tensor:
        """Rows ``[start, start + rows)`` over slots ``[0, length)``: live slots (from ``first``
        on), causal, tiled for the query heads of a KV group (as the folded query is)."""
        cols = np.arange(length)[None, :]
        allowed = (cols >= first) & (cols <= start + np.arange(self.rows)[:, None])
        dtype = self.split.mask_type.to_dtype()
        mask = np.where(allowed, 0, np.finfo(dtype).min).astype(dtype)
        tiled = np.tile(mask, (self.split.query_shape[2] // self.rows, 1))[None, None]
        return ov.Tensor(np.ascontiguousarray(tiled))

    def _timed(self, kind: str, request: ov.InferRequest) -> None:
        started = time.perf_counter()
        request.infer()
        self.seconds[kind] += time.perf_counter() - started

    def run(self, inputs: dict[str, ov.Tensor], start: int, first: int, cache: Cache) -> ov.Tensor:
        """Write the K/V of slots ``[start, start + rows)``; the hidden state of the last row."""
        length = next(n for n in self.lengths if n >= start + self.rows)
        split, attention = self.split, self.attention[length]
        attention.set_input_tensor(0, self.query)
        attention.set_input_tensor(3, self._mask(start, length, first))
        attention.set_output_tensor(0, self.attended)
        for layer in range(split.layers + 1):
            request = self._segment(layer)
            sources = split.wiring[layer]
            for j, src in enumerate(sources):
                request.set_input_tensor(j, self._tensor(src, inputs))
            if layer == split.layers:
                self._timed("segments", request)
                return request.get_output_tensor(0)
            if layer:
                for j, weight in enumerate(split.middle.weights[layer], len(sources)):
                    request.set_input_tensor(j, weight)
            request.set_output_tensor(0, self.query)
            for j, view in enumerate(cache.views(layer, start, start + self.rows), 1):
                request.set_output_tensor(j, view)
            for j in range(3, len(request.get_compiled_model().outputs)):
                request.set_output_tensor(j, self._tensor(("segment", layer, j), inputs))
            self._timed("segments", request)
            for j, view in enumerate(cache.views(layer, 0, length), 1):
                attention.set_input_tensor(j, view)
            self._timed("attention", attention)
        raise AssertionError("unreachable")


class Cache:
    """Per layer, K and V of every slot, and ROI views of them (made once, reused)."""

    def __init__(self, layers: int, kv_type: ov.Type, layout: KVLayout, slots: int) -> None:
        self.heads, self.dim = layout.num_kv_heads, layout.head_dim
        shape = [1, self.heads, slots, self.dim]
        self.buffers = [[ov.Tensor(kv_type, shape) for _ in "kv"] for _ in range(layers)]
        for pair in self.buffers:  # zeroed: a masked slot still enters the attention's sums,
            for tensor in pair:  # and 0 x NaN from uninitialised memory would be NaN
                tensor.data[...] = 0
        self._views: dict[tuple[int, int, int], list[ov.Tensor]] = {}

    def views(self, layer: int, a: int, b: int) -> list[ov.Tensor]:
        key = (layer, a, b)
        if key not in self._views:
            begin, end = ov.Coordinate([0, 0, a, 0]), ov.Coordinate([1, self.heads, b, self.dim])
            self._views[key] = [ov.Tensor(t, begin, end) for t in self.buffers[layer]]
        return self._views[key]


class Chain:
    """The prefill chain (and, for ``new_tokens``, the generate chain) over one cache."""

    def __init__(
        self, core: ov.Core, model_dir: Any, config: PipelineConfig, decode: bool = False
    ) -> None:
        total = config.max_prompt_len + config.min_response_len
        shapes = StaticShapes.of(config, total)
        model, layout = prepare(
            read_ir(core, model_dir), resolve_kv_precision(core, config), shapes=shapes
        )
        parts = split_model(model, layout)
        # the segments are the same at any past: the whole-past pair is enough to carve them
        prefill_body, generate_body = static_pair(parts.body, layout, shapes)
        device, props = device_properties(core, config)
        if device == "NPU":
            # NPUW's f16 tensors between its sub-graphs refuse the f32 tensors bound between
            # segments; one sub-graph per segment keeps its per-call overhead low
            props = {"NPUW_F16IC": "NO", "NPUW_ONLINE_PIPELINE": "NONE", **props}

        def compile_(m: ov.Model) -> ov.InferRequest:
            return core.compile_model(m, device, props).create_infer_request()

        c = self.chunk = config.prefill_chunk_size
        split = split_layers(prefill_body, layout)
        # attention over exactly the slots up to the chunk's last
        pasts = range(0, shapes.prefill_past + 1, c)
        self.prefill = Phase(compile_, split, [p + c for p in pasts], c, layout)
        self.generate: Phase | None = None
        if decode:
            # a step reads the smallest of 512, 1024, 2048, ... slots that holds its own
            lengths = [n for n in (512 << i for i in range(16)) if n < total] + [total]
            generate = split_layers(generate_body, layout)
            self.generate = Phase(compile_, generate, lengths, 1, layout)
        del prefill_body, generate_body, model
        host: dict[str, Any] = {"INFERENCE_PRECISION_HINT": "f32"}
        self.embed = core.compile_model(parts.embed, "CPU", host).create_infer_request()
        head = core.compile_model(parts.head, *_head_target(config, device, props))
        self.head = head.create_infer_request()
        self.cache = Cache(split.layers, split.kv_type, layout, total)

    def _logits(self, hidden: ov.Tensor) -> np.ndarray:
        self.head.set_input_tensor(hidden)
        self.head.infer()
        return self.head.get_output_tensor(0).data.reshape(-1).copy()

    def _inputs(self, ids: np.ndarray, positions: np.ndarray) -> dict[str, ov.Tensor]:
        self.embed.set_tensor("input_ids", ov.Tensor(ids[None, :]))
        self.embed.infer()
        return {
            EMBEDS_INPUT: self.embed.get_output_tensor(0),
            "position_ids": ov.Tensor(positions[None, :]),
        }

    def prefill_prompt(self, ids: np.ndarray) -> tuple[np.ndarray, list[float]]:
        """The last prompt token's logits and each chunk's milliseconds."""
        plan = PromptPlan(int(ids.size), self.chunk)
        times, hidden = [], None
        for k in range(plan.num_chunks):
            started = time.perf_counter()
            start = plan.chunk_slots(k)[0]
            step = prefill_inputs(ids, plan, k, start)
            inputs = self._inputs(step.input_ids[0], step.position_ids[0])
            hidden = self.prefill.run(inputs, start, plan.pad, self.cache)
            times.append((time.perf_counter() - started) * 1e3)
        assert hidden is not None
        self.pad, self.next = plan.pad, plan.padded_len
        return self._logits(hidden), times

    def step(self, token: int) -> np.ndarray:
        """Feed ``token`` after the prompt (greedy decode); the next logits."""
        assert self.generate is not None
        position = self.next - self.pad
        inputs = self._inputs(np.array([token]), np.array([position]))
        hidden = self.generate.run(inputs, self.next, self.pad, self.cache)
        self.next += 1
        return self._logits(hidden)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="IR directory or .gguf (default: SmolLM2)")
    parser.add_argument("--device", default="NPU", choices=("NPU", "CPU"))
    parser.add_argument("--prompt-len", type=int, default=1000)
    parser.add_argument("--max-prompt-len", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--new-tokens", type=int, default=0, help="greedy tokens after the prompt (generate chain)"
    )
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
    if args.prompt_len > config.max_prompt_len:
        parser.error(f"--prompt-len {args.prompt_len} exceeds --max-prompt-len")
    if args.new_tokens > config.min_response_len:
        parser.error(
            f"--new-tokens above MIN_RESPONSE_LEN ({config.min_response_len}): set it with -p"
        )
    chain = Chain(ov.Core(), model_dir, config, decode=args.new_tokens > 0)
    print(f"loaded: {status_mb('VmRSS'):.0f} MB", flush=True)
    ids = np.random.default_rng(0).integers(100, 10000, args.prompt_len)
    tokens: list[int] = []
    for _ in range(args.repeats):
        chain.prefill.seconds = {"segments": 0.0, "attention": 0.0}
        started = time.perf_counter()
        logits, times = chain.prefill_prompt(ids)
        ttft = time.perf_counter() - started
        spent = chain.prefill.seconds
        print(
            f"TTFT {ttft:.2f} s (segments {spent['segments']:.2f}, attention "
            f"{spent['attention']:.2f}, the rest {ttft - sum(spent.values()):.2f}); chunk ms: "
            + " ".join(f"{t:.0f}" for t in times),
            flush=True,
        )
        tokens = [int(logits.argmax())]
        started = time.perf_counter()
        for _ in range(args.new_tokens):
            tokens.append(int(chain.step(tokens[-1]).argmax()))
        if args.new_tokens:
            per_token = (time.perf_counter() - started) * 1e3 / args.new_tokens
            print(f"decode: {per_token:.1f} ms/token over {args.new_tokens} tokens", flush=True)
    print(f"peak: {status_mb('VmHWM'):.0f} MB", flush=True)
    if args.check:
        pipe = LLMPipeline(
            model_dir,
            args.device,
            max_prompt_len=args.max_prompt_len,
            prefill_chunk_size=args.chunk,
            static_models=True,
            prefill_attention="static",
            generate_pyramid=False,
            prefix_reuse=False,
            **settings,
        )
        static = pipe.runner.prefill(ids)
        print(
            f"static path: max |dlogit| {np.abs(static - logits).max():.3g}, "
            f"argmax {int(static.argmax())} vs {int(logits.argmax())}"
        )
        if args.new_tokens:
            same = [int(static.argmax())]
            for _ in range(args.new_tokens):
                same.append(int(pipe.runner.step(same[-1]).argmax()))
            pairs = enumerate(zip(same, tokens, strict=True))
            agree = next((i for i, (a, b) in pairs if a != b), len(same))
            print(f"static path: greedy tokens agree {agree}/{len(same)}")


if __name__ == "__main__":
    main()
