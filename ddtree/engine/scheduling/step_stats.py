"""Per-step counters of the engine since start: what a serving run's prefill and decode steps were
(how many prefill steps, how many replayed the extend graphs and in how many passes, how many
request chunks and tokens they took, the decode batches), and the host time of scheduling and of
the prefix cache's inserts. `/metrics` exports them (`ddtree_prefill_*`, `ddtree_decode_*`,
`ddtree_host_seconds`); `bench prefix-cache` reads them per workload, so a cache-on vs cache-off
gap shows as a different step plan (more eager steps, more passes, smaller batches) or as host
time, not only as throughput.

`graphable` counts prefill steps the extend graphs would take at the default widths
(`EXTEND_WIDTHS` up to the prefill budget), whether or not graphs run: on the CPU (no capture) it
shows the path the device would take."""

from __future__ import annotations

from dataclasses import dataclass, fields

from ddtree.engine.config import extend_widths


def step_metric(name: str) -> str:
    """The Prometheus counter of StepStats field `name` (rendered with a `_total` suffix)."""
    return f"ddtree_step_{name}"


@dataclass
class StepStats:
    prefill_steps: int = 0
    graphed_steps: int = 0  # prefill steps replayed as extend graphs
    graph_passes: int = 0  # their passes (`plan_passes`)
    graphable_steps: int = 0  # prefill steps the default extend widths would take
    prefill_chunks: int = 0  # request chunks over all prefill steps (batch sizes summed)
    prefill_tokens: int = 0  # tokens computed (cached ones excluded)
    prompts_done: int = 0  # prompts whose prefill ended (a first token, or a recompute)
    decode_steps: int = 0
    decode_reqs: int = 0  # decode batch sizes summed
    schedule_s: float = 0.0  # host: Scheduler.schedule (admission, prefix match, allocation)
    # host: inserting prefilled pages into the prefix cache. On a GPU this includes waiting for
    # the prefill itself whenever the insertion rewrites block-table entries (a missed prompt whose
    # pages another request cached: a synchronous host-to-device copy), so a high value with a low
    # hit rate is the misses' prefill time, not the cache's own cost
    cache_insert_s: float = 0.0

    def __post_init__(self):
        self.widths: list[int] = []  # what `graphable` is judged at (`set_budget`)

    def set_budget(self, prefill_budget: int) -> None:
        """`graphable` at the extend graphs' default widths for this prefill budget."""
        self.widths = list(extend_widths(prefill_budget))

    def on_prefill(self, q_lens: list[int], passes, graphable: bool, finished: int) -> None:
        """One prefill step: its chunk lengths, the graph passes it replayed (None: eager),
        whether the default widths would take it, how many of its requests ended their prompt."""
        self.prefill_steps += 1
        self.prefill_chunks += len(q_lens)
        self.prefill_tokens += sum(q_lens)
        self.prompts_done += finished
        if passes is not None:
            self.graphed_steps += 1
            self.graph_passes += len(passes)
        self.graphable_steps += graphable

    def on_decode(self, batch: int) -> None:
        self.decode_steps += 1
        self.decode_reqs += batch

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def summarize(delta: dict[str, float]) -> dict[str, float | None]:
    """Ratios of a run's counter deltas (`StepStats.as_dict` names): what the report prints."""

    def ratio(a: str, b: str) -> float | None:
        return delta[a] / delta[b] if delta.get(b) else None

    return {
        "prefill_steps": delta["prefill_steps"],
        "graphed_share": ratio("graphed_steps", "prefill_steps"),
        "graphable_share": ratio("graphable_steps", "prefill_steps"),
        "passes_per_graphed_step": ratio("graph_passes", "graphed_steps"),
        "mean_prefill_batch": ratio("prefill_chunks", "prefill_steps"),
        "tokens_per_prefill_step": ratio("prefill_tokens", "prefill_steps"),
        "chunks_per_prompt": ratio("prefill_chunks", "prompts_done"),
        "decode_steps": delta["decode_steps"],
        "mean_decode_batch": ratio("decode_reqs", "decode_steps"),
        "schedule_ms_per_step": (
            1e3 * delta["schedule_s"] / (delta["prefill_steps"] + delta["decode_steps"])
            if delta["prefill_steps"] + delta["decode_steps"]
            else None
        ),
        "cache_insert_ms_per_prompt": (
            1e3 * delta["cache_insert_s"] / delta["prompts_done"] if delta["prompts_done"] else None
        ),
    }
