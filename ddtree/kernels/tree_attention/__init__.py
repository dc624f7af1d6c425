"""Paged split-KV attention for decode, chain/tree verify and causal extend.

`reference.paged_attention_reference` is the plain PyTorch oracle; `launch.paged_attention` runs the kernels
(`triton.py`, Hopper's `hopper*.py`; import it only where Triton is installed). Both share one contract,
documented in `launch.py`.
"""

from ddtree.kernels.tree_attention.reference import paged_attention_reference

__all__ = ["paged_attention_reference"]
