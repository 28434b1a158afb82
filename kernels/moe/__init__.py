"""Mixture-of-Experts layers: routing and torch experts, the Triton grouped matmul, and the
quantized experts in one native call."""
