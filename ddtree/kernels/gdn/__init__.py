"""Gated DeltaNet kernels. `reference` is plain PyTorch (the oracle and the CPU path); GPU backends will
sit behind the same signatures."""
from ddtree.kernels.gdn.reference import (
    causal_conv1d_prefill,
    causal_conv1d_step,
    causal_conv1d_varlen,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
    gather_node_state,
    gdn_gating,
    replay_conv_path,
    replay_path,
    tree_causal_conv1d,
    tree_gated_delta_rule,
)

__all__ = [
    "causal_conv1d_prefill",
    "causal_conv1d_step",
    "causal_conv1d_varlen",
    "gated_delta_rule_chunked",
    "gated_delta_rule_recurrent",
    "gather_node_state",
    "gdn_gating",
    "replay_conv_path",
    "replay_path",
    "tree_causal_conv1d",
    "tree_gated_delta_rule",
]
