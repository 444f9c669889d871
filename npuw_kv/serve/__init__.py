"""``npuw-kv serve``: an OpenAI-compatible HTTP server over one :class:`~npuw_kv.LLMPipeline`
(needs the ``serve`` extra: uvicorn and Starlette)."""
