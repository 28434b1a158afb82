"""deepinfer's compute kernels, imported as `deepinfer.kernels` (never as a top-level `kernels`).

One family per module. Each module has a plain-torch `*_reference` function (the CPU path and the
tests' oracle) and, where written, a Triton kernel with a launcher that checks shapes, dtypes and
strides. This package imports only torch and triton.

KV layout (shared by every attention kernel): per layer, `k_cache` and `v_cache` of shape
`[num_blocks, block_size, num_kv_heads, head_dim]`. A token's slot is
`block_id * block_size + offset_in_block`. Block tables are `int32 [B, max_blocks]`, padded with 0.
"""
