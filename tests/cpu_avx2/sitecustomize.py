"""Hold the CPU plugin to what an AVX2-only CPU gives, in every Python process of a test run.

``PYTHONPATH=tests/cpu_avx2 ONEDNN_MAX_CPU_ISA=AVX2 python -m pytest ...`` (as ``.ci/run``
does for the tests that run at device defaults): oneDNN's kernels are capped at AVX2 by the
environment variable, and this module gives every ``openvino.Core`` and every openvino-genai
pipeline the defaults the plugin picks on such a CPU, which it would otherwise take from this
CPU's features: f32 compute (no BF16) and no int8 dynamic quantization (no VNNI).  Settings
given explicitly still win.  Being ``sitecustomize``, it also reaches the CLI subprocesses.
"""

from __future__ import annotations

import os
from typing import Any

if os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() != "AVX2":
    raise RuntimeError("tests/cpu_avx2 on PYTHONPATH needs ONEDNN_MAX_CPU_ISA=AVX2 as well")

import openvino as ov  # noqa: E402
import openvino_genai  # noqa: E402

AVX2_DEFAULTS = {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}
_core_init = ov.Core.__init__
_genai_pipeline = openvino_genai.LLMPipeline


def _core(self: ov.Core, *args: Any, **kwargs: Any) -> None:
    _core_init(self, *args, **kwargs)
    self.set_property("CPU", dict(AVX2_DEFAULTS))


def _genai(*args: Any, **kwargs: Any) -> Any:
    for key, value in AVX2_DEFAULTS.items():
        kwargs.setdefault(key, value)
    return _genai_pipeline(*args, **kwargs)


ov.Core.__init__ = _core  # type: ignore[method-assign]
openvino_genai.LLMPipeline = _genai  # type: ignore[misc]
os.environ["NPUW_KV_TEST_CPU"] = "avx2"  # tests may say which profile they ran under
