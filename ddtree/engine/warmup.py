"""Start-up warm-up: run the engine's own paths once on throwaway requests, so every kernel variant
is compiled (Triton, fla's autotuned GDN chunk kernels, cuBLAS heuristics) before the server
reports healthy, and the first real request costs what the thousandth does.

The CUDA graphs are captured when the runner is built; what remains lazy is the eager work around
them: prefill (one extend per shape bucket: Triton specialises and fla autotunes per shape, a first
27B hybrid prefill took ~1 minute) and the round's eager steps (sampling, the accept walk, the
draft LM head where no graph covers it). So: one prefill per bucket of `prefill_buckets`, then the
prefills the buckets miss (`extra_prefill_lengths`: the short prompts whose rows take the extend
kernel's smaller tiles, and lengths that are not a multiple of 16, since Triton specialises every
int argument on divisibility by 16), cached-prefix extends of two lengths (the split merge is
compiled per power of two of the split count), all of them with the extend graphs off (so the
eager extend compiles for the prompts the graphs do not take: long ones, too many passes), then a
turn-sized prompt through the extend graphs at batch 1 and their largest bucket (the graphs
themselves are captured with the runner: `CudaGraphRunner.build`), then a few decode rounds at
batch 1 and at the largest captured batch (and, where `auto` may pack a batch-wide budget, a few
packed rounds there: their verify replays its graphs where they hold the rows, else runs
eagerly). Warm-up requests go through
`LLMEngine.add_request` / `step` like any other and leave nothing behind (their pages, slots and
state rows are freed when they finish; `check_clean` says so). Before all that, the block-FP8
library's kernels for every row count a forward may meet (`_fp8_library`: they compile per row
count's tile config, at first use).
"""

from __future__ import annotations

import contextlib
import logging
import time

import numpy as np

from ddtree.engine.budget.planner import ScriptedPolicy
from ddtree.engine.budget.policy import Decision
from ddtree.engine.scheduling.request import SamplingParams

logger = logging.getLogger("ddtree")

EXTEND_TOKENS = 190  # the graphed extend's warm-up prompt: a chat turn's new tokens
# prefill shape buckets (tokens): the kernels' tile choices change with the rows per request
PREFILL_BUCKETS = (16, 128, 512, 2048)
DECODE_TOKENS = 4  # tokens per prefill warm-up request: a few rounds after the first token
# the decode warm-up's requests run past the drafter's block, so at least one round drafts at full
# depth (rounds at the max_tokens edge are depth-limited: the only kind DECODE_TOKENS gives)
FULL_ROUNDS = 2


def prefill_buckets(chunk: int, max_prompt: int) -> list[int]:
    """Prompt lengths to prefill once: each bucket below the prefill chunk and the chunk itself,
    none past the longest prompt the engine takes."""
    top = min(chunk, max_prompt)
    return sorted({b for b in PREFILL_BUCKETS if b < top} | {top})


def extra_prefill_lengths(buckets: list[int], group: int, head_dim: int) -> list[int]:
    """Prompt lengths a first request takes that the buckets do not compile: per tile config of
    the extend kernel (`tuning.default_config` over rows = tokens x GQA group) its shortest
    prompt (the buckets' 16+ tokens all take the widest tiles at group >= 2: a 5-token prompt
    compiled a new variant on its first request), and one token less than each bucket over 16 (a
    length that is not a multiple of 16)."""
    from ddtree.kernels.tree_attention.tuning import default_config

    top = buckets[-1]
    first: dict = {default_config(b * group, head_dim): b for b in buckets}
    for n in range(1, min(top, 64) + 1):
        first.setdefault(default_config(n * group, head_dim), n)
    odd = {b - 1 for b in buckets if b > 16}
    return sorted((set(first.values()) | odd) - set(buckets))


def warm_up(engine, progress: bool = True) -> dict:
    """Run the warm-up on `engine` (an LLMEngine); returns what ran ({"prefill": [lengths],
    "prefill_extra": [lengths], "decode_batches": [b, ...], "extend_batches": [b, ...] (graphed
    extends), "seconds": s}). progress: a tqdm bar (stderr)."""
    from tqdm import tqdm

    t0 = time.perf_counter()
    cfg = engine.runner.cfg
    max_prompt = max(engine.max_context - DECODE_TOKENS - cfg.max_verify_width, 1)
    lengths = prefill_buckets(engine.scheduler.prefill_budget, max_prompt)
    graphs = engine.runner.graphs
    top_bs = graphs.buckets[-1] if graphs is not None else 1
    batches = sorted({1, min(top_bs, cfg.max_running_requests)})
    tcfg = engine.runner.target.config
    vocab = tcfg.vocab_size
    group = tcfg.num_attention_heads // tcfg.num_key_value_heads
    extra = extra_prefill_lengths(lengths, group, tcfg.head_dim)
    params = SamplingParams(temperature=0, max_tokens=DECODE_TOKENS, ignore_eos=True)
    fp8_calls = _fp8_library(engine)
    ext = graphs.extend if graphs is not None else None
    ext_batches = sorted({1, ext.buckets[-1]}) if ext is not None else []
    bar = tqdm(
        total=len(lengths) + len(extra) + len(batches) + len(ext_batches),
        desc="warm-up",
        unit="step",
        disable=not progress,
        leave=False,
    )
    # the eager extend first (what prefills the extend graphs do not take run it: long prompts,
    # many passes), with the graphs off so that short prompts compile its kernels too
    with ext.eager() if ext is not None else contextlib.nullcontext():
        _eager_prefills(engine, lengths, extra, max_prompt, params, bar)
    # the graphed extend (captured with the runner): a turn-sized prompt at batch 1 and at the
    # largest extend bucket, through the pass planning and the static loads a first request takes
    for b in ext_batches:
        n = min(EXTEND_TOKENS, ext.widths[-1], max_prompt)
        _drain(engine, [[(11 * i + 5 + j) % vocab for i in range(n)] for j in range(b)], params)
        bar.update()
    # decode rounds at batch 1 and the largest captured batch (short prompts), full depth first
    block = getattr(engine.decoder.cfg, "block_size", 1) or 1
    n_dec = min(block * FULL_ROUNDS + DECODE_TOKENS, max(engine.max_context - 8 - 1, 1))
    decode = SamplingParams(temperature=0, max_tokens=n_dec, ignore_eos=True)
    for b in batches:
        _drain(engine, [[(3 * i + j) % vocab for i in range(8)] for j in range(b)], decode)
        bar.update()
    packed = _packed_rounds(engine, batches, vocab, decode)
    bar.close()
    engine.runner.bm.clear_cache()  # the synthetic prompts leave no cached pages behind
    engine.decoder.budgets.reset()  # ... and nothing learned by the budget policy
    out = {
        "prefill": lengths,
        "prefill_extra": extra,
        "decode_batches": batches,
        "extend_batches": ext_batches,
        "fp8_library_calls": fp8_calls,
        "seconds": time.perf_counter() - t0,
        "graph_pool_bytes": graphs.pool_bytes() if graphs is not None else 0,
        "packed_batches": packed,
    }
    logger.info(
        "Warm-up done in %.1f s: prefill %s (+ %s) tokens, decode batches %s; CUDA graph pool "
        "%.2f GiB.",
        out["seconds"],
        lengths,
        extra,
        batches,
        out["graph_pool_bytes"] / 2**30,
    )
    return out


class _Packing(ScriptedPolicy):
    """The warm-up's packed rounds: batch-wide budgets of 1, 4 and 16 rows a request in turn
    (each request capped at the spec's budget)."""

    SHARES = (1, 4, 16)

    def __init__(self):
        self.k = 0

    def choose(self, slots, owners, caps, ctx, extra_s=0.0) -> Decision:
        self.k += 1
        caps = np.asarray(caps, dtype=np.int64)
        rows = len(slots) * self.SHARES[self.k % len(self.SHARES)]
        return Decision(1 + int(caps.max()), caps, np.zeros(len(slots)), 0.0, rows=rows)


def _packed_rounds(engine, batches: list[int], vocab: int, params: SamplingParams) -> list[int]:
    """Where `auto` may pack (a dense target), a few packed rounds at each decode batch, their
    policy scripted: the packed verify's graphs replay where they hold the rows, else it runs
    eagerly, and the kernels' variants it meets (the tree attention at the rungs' widths, split
    per call; the eager walk and commit) compile here, not in a served round. Returns the
    batches it ran at; the policy is restored."""
    planner = engine.decoder.budgets
    if not planner.packing:
        return []
    policy = planner.policy
    planner.set_policy(_Packing())
    try:
        for b in batches:
            _drain(engine, [[(5 * i + j) % vocab for i in range(8)] for j in range(b)], params)
    finally:
        planner.set_policy(policy)
    return batches


def _fp8_library(engine) -> int:
    """The FP8 library's kernels (DeepGEMM compiles one per weight shape and tile config, the
    config picked per row count) for every row count a forward may meet: a prefill chunk, or a
    verify of every running request at the widest tree (`models.quant.warm_up`)."""
    from ddtree.models import quant

    runner, cfg = engine.runner, engine.runner.cfg
    max_rows = max(engine.scheduler.prefill_budget, cfg.max_running_requests * cfg.max_verify_width)
    models = [m for m in (runner.target, runner.drafter) if m is not None]
    return sum(quant.warm_up(m, runner.dtype, max_rows) for m in models)


def _eager_prefills(engine, lengths, extra, max_prompt, params, bar) -> None:
    """One prefill per bucket and per extra length, then cached-prefix extends."""
    cfg, vocab = engine.runner.cfg, engine.runner.target.config.vocab_size
    # prefill buckets: one request each, run alone so each extend has the bucket's shape; every
    # prompt starts with its own token, so none is a prefix-cache hit on an earlier one
    for k, n in enumerate(lengths + extra):
        _drain(engine, [[(7 * i + 1 + k) % vocab for i in range(n)]], params)
        bar.update()
    if engine.runner.bm.cache is not None and lengths[-1] > cfg.page_size:
        # prefills that extend a cached prefix (attention over shared pages, the copy-on-write
        # of the last page): the shape every multi-turn request takes; two new-token counts (a
        # turn's ~200 among them), so the split counts and their merges differ
        k = len(lengths) - 1
        prompt = [(7 * i + 1 + k) % vocab for i in range(lengths[-1])]
        head = prompt[: lengths[-1] - cfg.page_size // 2]
        for new in (8, min(193, max_prompt - len(head))):
            _drain(engine, [head + [(5 * i + 3) % vocab for i in range(max(new, 1))]], params)


def _drain(engine, prompts: list[list[int]], params: SamplingParams) -> None:
    rids = [engine.add_request(p, params).rid for p in prompts]
    while any(r in engine.requests for r in rids):
        engine.step()
