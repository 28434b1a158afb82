"""Triton kernels behind `paged_attention.py` (launch them through its launchers only).

Keys are read in tiles of BLOCK_N tokens gathered through the block table, so the tile size is
independent of the cache's block size. Softmax is online, in the log2 domain, accumulated in
fp32. A request's reduction order depends only on its own context length and the fixed tile and
partition sizes, never on the rest of the batch. A query attends to its last `window` keys (the
launchers pass a window longer than any context for full attention): tiles and partitions stay
where they are, those wholly before a window are skipped, and keys before it are masked, never
loaded.
"""

from __future__ import annotations

from ..triton_common import dot, jit, tl


@jit
def _attend_tile(
    q,
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    kv_head,
    tokens,
    visible,
    m_i,
    l_i,
    acc,
    stride_cb,
    stride_cs,
    stride_ch,
    qk_scale,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One online-softmax step over the key tile `tokens` [BLOCK_N]; `visible` [M, BLOCK_N]."""
    token_mask = tokens >= 0
    block_ids = tl.load(table_ptr + tokens // BLOCK_SIZE, mask=token_mask, other=0).to(tl.int64)
    rows = block_ids * stride_cb + (tokens % BLOCK_SIZE).to(tl.int64) * stride_cs
    offsets = (rows + kv_head * stride_ch)[:, None] + tl.arange(0, HEAD_DIM)[None, :]
    k = tl.load(k_cache_ptr + offsets, mask=token_mask[:, None], other=0.0)  # [BLOCK_N, D]
    scores = dot(q, tl.trans(k), tl.zeros(visible.shape, tl.float32), UPCAST, PRECISION)
    scores = tl.where(visible, scores * qk_scale, float("-inf"))  # [M, BLOCK_N]
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    # a row that has seen no key yet (a sliding window starting past this tile) stays empty
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_cache_ptr + offsets, mask=token_mask[:, None], other=0.0)  # [BLOCK_N, D]
    acc = dot(p.to(v.dtype), v, acc * alpha[:, None], UPCAST, PRECISION)
    return m_new, l_i, acc


@jit
def decode_partition_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    stride_qb,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ob,
    stride_oh,
    num_partitions,
    qk_scale,
    window,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTITION: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Grid (B, Hkv, partitions): one KV head's whole query group over one partition of keys.

    A request with one partition holding its window writes its output directly; otherwise each
    such partition writes (acc, m, l) to the partials, combined by `decode_reduce_kernel`.
    """
    batch = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + batch).to(tl.int32)
    first = tl.maximum(context_len - window, 0)
    start = part * PARTITION
    if start >= context_len or start + PARTITION <= first:
        return
    end = tl.minimum(start + PARTITION, context_len)
    group = tl.arange(0, BLOCK_G)
    heads = (kv_head * GROUP + group).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    q_mask = (group < GROUP)[:, None]
    q = tl.load(
        q_ptr + batch * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=q_mask,
        other=0.0,
    )
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    table_ptr = block_tables_ptr + batch * stride_bt
    skipped = (tl.maximum(first, start) - start) // BLOCK_N * BLOCK_N  # tiles before the window
    for n0 in range(start + skipped, end, BLOCK_N):
        tokens = n0 + tl.arange(0, BLOCK_N)
        in_range = (tokens < end) & (tokens >= first)
        visible = tl.broadcast_to(in_range[None, :], [BLOCK_G, BLOCK_N])
        m_i, l_i, acc = _attend_tile(
            q, k_cache_ptr, v_cache_ptr, table_ptr, kv_head, tl.where(in_range, tokens, -1),
            visible, m_i, l_i, acc, stride_cb, stride_cs, stride_ch, qk_scale,
            BLOCK_SIZE, HEAD_DIM, UPCAST, PRECISION,
        )  # fmt: skip
    if tl.cdiv(context_len, PARTITION) - first // PARTITION == 1:
        out = acc / l_i[:, None]
        out_ptrs = out_ptr + batch * stride_ob + heads[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        slot = ((batch * (GROUP * tl.num_programs(1)) + heads) * num_partitions + part)[:, None]
        tl.store(part_acc_ptr + slot * HEAD_DIM + dims[None, :], acc, mask=q_mask)
        tl.store(part_ml_ptr + slot * 2, m_i[:, None], mask=q_mask)
        tl.store(part_ml_ptr + slot * 2 + 1, l_i[:, None], mask=q_mask)


@jit
def decode_reduce_kernel(
    context_lens_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    stride_ob,
    stride_oh,
    num_partitions,
    window,
    HEAD_DIM: tl.constexpr,
    PARTITION: tl.constexpr,
):
    """Grid (B, H): combines a request's partitions (those holding its window) in ascending
    order (skips single ones)."""
    batch = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    context_len = tl.load(context_lens_ptr + batch).to(tl.int32)
    first = tl.maximum(context_len - window, 0) // PARTITION
    count = tl.cdiv(context_len, PARTITION)
    if count - first <= 1:
        return
    dims = tl.arange(0, HEAD_DIM)
    base = (batch * tl.num_programs(1) + head) * num_partitions + first
    m = tl.load(part_ml_ptr + base * 2)
    l_sum = tl.load(part_ml_ptr + base * 2 + 1)
    acc = tl.load(part_acc_ptr + base * HEAD_DIM + dims)
    for part in range(1, count - first):
        m_p = tl.load(part_ml_ptr + (base + part) * 2)
        l_p = tl.load(part_ml_ptr + (base + part) * 2 + 1)
        acc_p = tl.load(part_acc_ptr + (base + part) * HEAD_DIM + dims)
        m_new = tl.maximum(m, m_p)
        alpha = tl.math.exp2(m - m_new)
        beta = tl.math.exp2(m_p - m_new)
        l_sum = l_sum * alpha + l_p * beta
        acc = acc * alpha + acc_p * beta
        m = m_new
    out = acc / l_sum
    tl.store(
        out_ptr + batch * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty)
    )


@jit
def prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    context_lens_ptr,
    out_ptr,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ot,
    stride_oh,
    qk_scale,
    window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Grid (B, query tiles, H): BLOCK_M new tokens of one request and one head, attending to
    the cached prefix and causally to the new tokens, all read from the paged cache."""
    batch = tl.program_id(0).to(tl.int64)
    m0 = tl.program_id(1) * BLOCK_M
    head = tl.program_id(2).to(tl.int64)
    q_lo = tl.load(query_start_loc_ptr + batch).to(tl.int64)
    q_len = (tl.load(query_start_loc_ptr + batch + 1) - q_lo).to(tl.int32)
    if m0 >= q_len:
        return
    context_len = tl.load(context_lens_ptr + batch).to(tl.int32)
    prefix_len = context_len - q_len
    rows = m0 + tl.arange(0, BLOCK_M)
    row_mask = (rows < q_len)[:, None]
    dims = tl.arange(0, HEAD_DIM)
    q_offsets = (q_lo + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_mask, other=0.0)  # [BLOCK_M, D]
    positions = prefix_len + rows
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table_ptr = block_tables_ptr + batch * stride_bt
    kv_end = tl.minimum(context_len, prefix_len + m0 + BLOCK_M)
    # keys from the first row's window on (each row's own window in the mask), tiles aligned
    below = prefix_len + m0 - window  # no row sees a key at or below it
    kv_start = tl.maximum(below + 1, 0) // BLOCK_N * BLOCK_N
    for n0 in range(kv_start, kv_end, BLOCK_N):
        tokens = n0 + tl.arange(0, BLOCK_N)
        in_range = (tokens < kv_end) & (tokens > below)
        visible = in_range[None, :] & (tokens[None, :] <= positions[:, None])
        visible = visible & (tokens[None, :] > positions[:, None] - window)
        m_i, l_i, acc = _attend_tile(
            q, k_cache_ptr, v_cache_ptr, table_ptr, head // GROUP, tl.where(in_range, tokens, -1),
            visible, m_i, l_i, acc, stride_cb, stride_cs, stride_ch, qk_scale,
            BLOCK_SIZE, HEAD_DIM, UPCAST, PRECISION,
        )  # fmt: skip
    # rows past the chunk (not stored) may see no key of a window: no 0 / 0 for them
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_offsets = (q_lo + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_mask)
