"""DFlash2 drafter (z-lab `DFlash2DraftModel` checkpoint layout): DFlash plus, in every layer, a
grouped dynamic causal convolution around attention (`attention_conv`) and around the MLP
(`mlp_conv`), and a candidate selector after the LM head.

A convolution's `kernel_projection` maps the sublayer's normed input to two sets of per-row,
per-group tap offsets: `prepare` convolves the sublayer input with `base_kernel[0]` + the first set,
`finish` convolves the sublayer output with `base_kernel[1]` + the second (kernels/dynamic_conv).
Both run over a block's own rows (causal within the block), so the drafter's context KV and the
paged attention are DFlash's unchanged.

The selector keeps, per block position d, the top-`selector_top_k` candidates c of the unary logits
u_d and scores them against the token p chosen before them (the root for d = 1):
    s(c | p) = u_d[c] + <predecessor_codebook[p] * hidden_projection(h_d), successor_codebook[c]>.
The chain decodes left to right (argmax of s); its draft distribution is q(. | p) = softmax_c s(c | p).
So a child's distribution depends on its parent's token: `propose` returns the per-position pieces
(`MarkovDraft`) and the tree is built path-conditioned (speculative/markov_tree.py).
"""

from __future__ import annotations

import torch
from torch import nn

from ddtree.kernels import selector
from ddtree.kernels.dynamic_conv import dynamic_conv
from ddtree.models.configs import DrafterConfig
from ddtree.models.dflash import DFlashDrafter, DFlashLayer
from ddtree.models.parallel import TPGroup
from ddtree.speculative.markov_tree import MarkovDraft, build_markov_chain, build_markov_tree


class GroupedDynamicConv(nn.Module):
    """`base_kernel` [2, k, H] and `kernel_projection` H -> 2 * k * (H / group_size): z-lab names.
    `block`: the rows of one block (the engine's drafting block; several blocks may lie along the
    rows in training)."""

    def __init__(self, hidden: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.taps = kernel_size * (hidden // group_size)
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * self.taps, bias=False)

    def prepare(self, x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the sublayer input convolved, the output-side tap offsets for `finish`)."""
        dyn = self.kernel_projection(x)
        inp, out = dyn[..., : self.taps], dyn[..., self.taps :]
        return dynamic_conv(x, inp, self.base_kernel[0], self.group_size, block), out

    def finish(self, x: torch.Tensor, dyn: torch.Tensor, block: int) -> torch.Tensor:
        return dynamic_conv(x, dyn, self.base_kernel[1], self.group_size, block)


class CandidateSelector(nn.Module):
    """The codebooks are bare parameters, so the state dict has z-lab's checkpoint names
    (`candidate_selector.predecessor_codebook`, no `.weight`); the loader takes either spelling."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        V, r = cfg.vocab_size, cfg.selector_rank
        self.top_k = cfg.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(V, r))
        self.successor_codebook = nn.Parameter(torch.empty(V, r))
        self.hidden_projection = nn.Linear(cfg.hidden_size, r, bias=False)

    def draft(self, hidden: torch.Tensor, logits: torch.Tensor) -> MarkovDraft:
        """hidden [..., D, H] (final-normed), logits [..., D, V] (unary) -> the MarkovDraft."""
        unary, cand = logits.topk(self.top_k, dim=-1)  # sorted: ties in s go to the higher unary
        wh = self.hidden_projection(hidden).float()
        edge = self.successor_codebook[cand].float() * wh[..., None, :]
        # the tree build is inference only: the codebook enters it without autograd
        return MarkovDraft(logits, unary.float(), cand, edge, self.predecessor_codebook.detach())

    def scores(
        self,
        hidden: torch.Tensor,
        unary: torch.Tensor,
        predecessors: torch.Tensor,
        candidates: torch.Tensor,
    ) -> torch.Tensor:
        """s(c | p) [..., K] fp32 for hidden [..., H], the candidates' unary logits [..., K],
        predecessor ids [...] and candidate ids [..., K] (the training loss's teacher-forced form:
        the candidates need not be the unary top-k)."""
        ctx = (
            self.predecessor_codebook[predecessors].float() * self.hidden_projection(hidden).float()
        )
        pair = (self.successor_codebook[candidates].float() * ctx[..., None, :]).sum(-1)
        return unary.float() + pair


class DFlash2Layer(DFlashLayer):
    def __init__(self, cfg: DrafterConfig, tp: TPGroup | None = None):
        super().__init__(cfg, tp)
        args = (cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        self.attention_conv = GroupedDynamicConv(*args)
        self.mlp_conv = GroupedDynamicConv(*args)


class DFlash2Drafter(DFlashDrafter):
    """DFlash's context path, block attention and TP layout; the convolutions and the selector are
    replicated under tensor parallelism (they act on the all-reduced residual width).
    `tree`: path (the path-conditioned DDTree) or marginal (--speculative-ddtree-dflash2-tree
    marginal: DDTREE over the unary marginals instead of the selector; `marginal_tree`, which a
    study may flip before a runner captures its graphs)."""

    layer_class = DFlash2Layer

    def __init__(self, cfg: DrafterConfig, tp: TPGroup | None = None, tree: str = "path"):
        super().__init__(cfg, tp)
        self.candidate_selector = CandidateSelector(cfg)
        if tree not in ("path", "marginal"):
            raise ValueError(f"DFlash2Drafter(tree={tree!r}): use path or marginal")
        self.marginal_tree = tree == "marginal"

    def propose(self, hidden: torch.Tensor, lm_head: nn.Module) -> MarkovDraft:
        return self.candidate_selector.draft(hidden, self.logits(hidden, lm_head))

    def proposal_logits(self, proposal: MarkovDraft) -> torch.Tensor:
        return proposal.logits

    def build_tree(self, roots, proposal: MarkovDraft, spec, max_depth=None, budgets=None):
        """The DFLASH chain (argmax left to right) or the path-conditioned DDTree (spec: the
        decoder's (algorithm, budget, topk_cap, shadow_linear)); tree=marginal:
        DDTree over the unary marginals (the A/B)."""
        algorithm, budget, topk_cap, shadow_linear = spec
        if algorithm == "DFLASH":  # the walk one launch where kernels run (kernels/selector)
            return build_markov_chain(roots, proposal, max_depth, selector.selector_chain)
        if self.marginal_tree:
            return super().build_tree(roots, proposal.logits, spec, max_depth, budgets)
        return build_markov_tree(
            roots,
            proposal,
            budget,
            topk_cap,
            shadow_linear,
            max_depth,
            budgets,
            select=selector.select_markov_nodes,  # its beams one launch where kernels run
        )
