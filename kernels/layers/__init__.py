"""A whole decoder stack in one native call, composed of the attention, linear and per-token
kernels."""
