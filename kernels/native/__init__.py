"""The native CPU kernels' build, load and ABI (`cpu_native`, `cpu_abi`; the C sources are
kernels/cpu/), and the sampler's greedy pick, which needs nothing else of them."""
