"""Training: causal-LM pretraining of small Qwen3 targets, the DFlash drafter recipe, token datasets, and the
tiny toy (target, drafter) pair used as the engine's test fixture."""

from ddtree.tools.train.drafter import (
    block_acceptance,
    chain_acceptance,
    default_gamma,
    drafter_config_for,
    train_drafter,
)
from ddtree.tools.train.lm import generate, qwen3_config, train_lm
from ddtree.tools.train.toy import build_toy_pair

__all__ = [
    "block_acceptance",
    "build_toy_pair",
    "chain_acceptance",
    "default_gamma",
    "drafter_config_for",
    "generate",
    "qwen3_config",
    "train_drafter",
    "train_lm",
]
