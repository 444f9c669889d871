"""Runtime: compiled requests, the chunk loop and the generate step over the shared KV cache."""
