"""The openvino-genai-shaped surface around the pipeline: its inputs (prompts, generation and
scheduler configs), its results and metrics, and chat bookkeeping."""
