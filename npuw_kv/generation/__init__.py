"""The token loop and its policies: decode steps, sampling, logits processing, beam search,
speculative decoding, stop strings and structured output.  It knows token ids and logits; the
runners (:mod:`npuw_kv.runtime`) produce the logits."""
