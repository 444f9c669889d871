"""The runners that run a compiled model over the KV cache: the static-shape runner
(:mod:`.static`) and the PagedAttention runner and its scheduler (:mod:`.paged`), built by
:mod:`.build` behind the :class:`~npuw_kv.runtime.runner.Runner` contract."""
