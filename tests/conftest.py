import os
import tempfile

# Triton kernels run on CPU tensors through its interpreter; it must be chosen before any kernel
# module is imported (Triton decides per @jit function at import), hence the top-level conftest.
os.environ.setdefault("TRITON_INTERPRET", "1")

# The disk prefix cache defaults to $XDG_CACHE_HOME/deepinfer: keep every test session's cache
# private and fresh, so no test hits (or pollutes) a user's cache or an earlier run's.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="deepinfer-test-cache-")
