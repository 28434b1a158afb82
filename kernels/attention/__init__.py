"""Paged attention over the KV layout (launcher, Triton kernels, torch reference with its per-step
plan, native CPU decode) and the store of new keys and values into the caches."""
