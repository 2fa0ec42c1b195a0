import os

# Triton picks interpreter or compiler when a kernel is *defined*, so this must be set before
# hf_csa2.kernels.sparse_read.kernel is imported. TRITON_INTERPRET=0 on a CUDA machine runs the
# compiled kernels instead.
os.environ.setdefault("TRITON_INTERPRET", "1")
