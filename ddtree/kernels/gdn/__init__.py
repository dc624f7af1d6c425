"""Gated DeltaNet kernels. `reference` is plain PyTorch (the oracle and the CPU path); `dispatch` runs the
same signatures on fla / the Triton tree kernel (`triton_tree`) on CUDA; `backend` picks and records which."""

from ddtree.kernels.gdn.reference import (
    causal_conv1d_prefill,
    causal_conv1d_step,
    causal_conv1d_varlen,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
    gather_node_state,
    gdn_gating,
    path_inputs,
    replay_conv_path,
    replay_path,
    root_causal_conv1d,
    tree_causal_conv1d,
    tree_gated_delta_rule,
    tree_gated_delta_rule_rows,
)

__all__ = [
    "causal_conv1d_prefill",
    "causal_conv1d_step",
    "causal_conv1d_varlen",
    "gated_delta_rule_chunked",
    "gated_delta_rule_recurrent",
    "gather_node_state",
    "gdn_gating",
    "path_inputs",
    "replay_conv_path",
    "replay_path",
    "root_causal_conv1d",
    "tree_causal_conv1d",
    "tree_gated_delta_rule",
    "tree_gated_delta_rule_rows",
]
