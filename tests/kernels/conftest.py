"""Kernel tests run the Triton kernels under the interpreter on CPU. TRITON_INTERPRET
must be set before triton builds the kernels (at import); the root conftest sets it for
the whole run, and this covers running this folder on its own."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
