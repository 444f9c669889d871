"""npuw-kv: static-shape LLM execution on OpenVINO with one shared KV cache."""

__version__ = "0.1.0"
