"""The engines that run a compiled model over the KV cache: the static-shape engine
(:mod:`.static`) and the PagedAttention engine (:mod:`.paged`), built by :mod:`.build` behind
the :class:`~npuw_kv.runtime.runner.Runner` contract."""
