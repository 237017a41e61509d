"""A model and its KV cache, fed from the token buffer and rolled back per row (`cached_model.CachedModel`), the per-row
operations on cache layers, and compiled forwards."""
