"""/metrics of a `--dp-size` server: every replica's own registry (the one-engine server's metrics,
rendered in the replica's process), each sample labelled `dp_rank`, beside the HTTP process's own:
the event loop's lag (`ddtree_http_loop_lag_seconds`, which replicas, having no HTTP loop, leave
out) and the dispatcher's per-replica counts. Sum over `dp_rank` for the server's totals.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from ddtree.server.metrics import ROUND_BUCKETS

PARENT_ONLY = ("ddtree_http_loop_lag_seconds",)  # families the HTTP process reports, not replicas


class DPMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.loop_lag = Histogram(
            "ddtree_http_loop_lag_seconds",
            "How late the HTTP event loop ran a timer due every LOOP_PROBE_S (the HTTP process; "
            "the engines run in the replica processes)",
            buckets=ROUND_BUCKETS,
            registry=r,
        )
        self.dispatched = Counter(
            "ddtree_dp_dispatched_requests",
            "Requests the dispatcher sent to each replica (--load-balance-method)",
            ["dp_rank"],
            registry=r,
        )
        self.in_flight = Gauge(
            "ddtree_dp_requests_in_flight",
            "Requests dispatched to each replica and not finished",
            ["dp_rank"],
            registry=r,
        )
        self.up = Gauge(
            "ddtree_dp_replica_up",
            "1 while the replica takes requests; 0 when it is starting, unhealthy or dead",
            ["dp_rank"],
            registry=r,
        )

    def render(self, replicas: dict[int, bytes]) -> bytes:
        """This process's metrics, then every replica's (rank -> its /metrics text) labelled."""
        merged: dict[str, object] = {}
        for rank, text in sorted(replicas.items()):
            for fam in text_string_to_metric_families(text.decode()):
                if fam.name.removesuffix("_created") in PARENT_ONLY:
                    continue
                labelled = [
                    Sample(s.name, {**s.labels, "dp_rank": str(rank)}, s.value, s.timestamp)
                    for s in fam.samples
                ]
                if fam.name in merged:
                    merged[fam.name].samples += labelled
                else:
                    fam.samples = labelled
                    merged[fam.name] = fam
        out = CollectorRegistry(auto_describe=False)
        out.register(_Families(list(merged.values())))
        return generate_latest(self.registry) + generate_latest(out)


class _Families:
    def __init__(self, families: list):
        self.families = families

    def collect(self):
        return self.families
