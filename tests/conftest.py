import os

import torch

# Without a GPU, Triton kernels run in Triton's interpreter (must be set before kernels are defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
