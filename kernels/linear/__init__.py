"""Linear layers: the batch-invariant Triton matmul, GGUF block formats (K-quant fields) with
their native matmul, int8-packed weights, and the fixed-order float sum."""
