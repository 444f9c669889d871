"""Developer tools behind ``npuw-kv bench`` and ``npuw-kv accuracy``: measuring npuw-kv beside
openvino-genai and NPUW, never needed to run a model."""
