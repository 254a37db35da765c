"""Every Prometheus metric of the service, declared once, named as vLLM names its own
(`vllm:time_to_first_token_seconds` -> `kvstore:time_to_first_token_seconds`).

One registry per app (tests run several servers in one process). Buckets fit what was measured on
2 cores: first tokens from milliseconds (a restored session) to tens of seconds (a long prefill).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TOKEN_GAP = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5)
BYTES = (2**20, 2**22, 2**24, 2**26, 2**28, 2**30, 2**32)
ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256, 512, 1024, 2048)
STEP = (0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("kvstore:time_to_first_token_seconds",
                              "Time to the first token, by how the context was obtained "
                              "(restored from disk, reused in memory or on a fork, computed)",
                              ["context"], buckets=LATENCY, registry=r)
        self.itl = Histogram("kvstore:inter_token_latency_seconds", "Time between two tokens of a reply",
                             buckets=TOKEN_GAP, registry=r)
        self.e2e = Histogram("kvstore:e2e_request_latency_seconds", "Request latency, arrival to last byte",
                             buckets=LATENCY, registry=r)
        self.queue = Histogram("kvstore:request_queue_time_seconds", "Time a request waited before it ran",
                               buckets=LATENCY, registry=r)
        self.running = Gauge("kvstore:num_requests_running", "Requests running on an engine", registry=r)
        self.waiting = Gauge("kvstore:num_requests_waiting", "Requests waiting for their session or an engine",
                             registry=r)
        self.prompt_tokens = Counter("kvstore:prompt_tokens_total",
                                     "Prompt tokens, by source: computed (prefilled) or restored (KV reused)",
                                     ["source"], registry=r)
        self.generation_tokens = Counter("kvstore:generation_tokens_total", "Generated tokens", registry=r)
        self.restore_seconds = Histogram("kvstore:session_restore_seconds",
                                         "Reopening a session from the store (checksums verified)",
                                         buckets=LATENCY, registry=r)
        self.restore_bytes = Counter("kvstore:session_restore_bytes_total", "KV bytes restored from the store",
                                     registry=r)
        self.checkpoint_seconds = Histogram("kvstore:checkpoint_seconds", "The last checkpoint of a reply",
                                            buckets=LATENCY, registry=r)
        self.resident = Gauge("kvstore:kv_resident_bytes", "KV bytes of the sessions engines hold open",
                              ["engine"], registry=r)
        self.restarts = Counter("kvstore:engine_restarts_total", "Engine processes restarted after they died",
                                registry=r)
        self.errors = Counter("kvstore:request_errors_total", "Requests answered with an error, by HTTP status",
                              ["code"], registry=r)
        self.requests = Counter("kvstore:request_success_total", "Requests finished, by finish reason",
                                ["finished_reason"], registry=r)
        self.kv_usage = Gauge("kvstore:kv_cache_usage_perc", "Fraction of an engine's paged KV memory in use",
                              ["engine"], registry=r)
        self.evictions = Counter("kvstore:kv_evictions_total",
                                 "Idle sessions evicted from KV memory to make room (restored on their next request)",
                                 registry=r)
        self.prewarmed = Counter("kvstore:kv_prewarmed_sessions_total",
                                 "Sessions an engine restored into KV memory after it started, the ones it held "
                                 "open before (--prewarm), before any request asked for them", registry=r)
        self.step_sessions = Histogram("kvstore:batch_sessions_per_step",
                                       "Sessions computed in one forward of an engine step (continuous batching)",
                                       buckets=ROWS, registry=r)
        self.step_tokens = Histogram("kvstore:batch_tokens_per_step",
                                     "Tokens computed in one forward of an engine step, by kind: decode (one per "
                                     "generating session) or prefill (prompt chunks)", ["kind"], buckets=ROWS, registry=r)
        self.step_seconds = Histogram("kvstore:engine_step_seconds",
                                      "Seconds of one engine step that ran a forward: the forward and the jobs' own "
                                      "work around it (sampling, streaming, checkpoints)", buckets=STEP, registry=r)
        self.model_seconds = Histogram("kvstore:model_forward_seconds",
                                       "Seconds of the model calls of one engine step (the forward and the output "
                                       "head); the rest of kvstore:engine_step_seconds is the jobs' own work",
                                       buckets=STEP, registry=r)

        self.prefix_queries = Counter("kvstore:prefix_cache_queries",
                                      "Prompt tokens of requests that looked up the prefix cache (no session named)",
                                      registry=r)
        self.prefix_hits = Counter("kvstore:prefix_cache_hits",
                                   "Prompt tokens whose KV came from the prefix cache (a stored prefix, forked)",
                                   registry=r)
        self.prefix_entries = Gauge("kvstore:prefix_cache_entries", "Sessions kept as prefix-cache entries",
                                    registry=r)
        self.prefix_bytes = Gauge("kvstore:prefix_cache_bytes",
                                  "KV bytes the prefix-cache entries wrote (their budget: --prefix-cache)", registry=r)
        self.prefix_evictions = Counter("kvstore:prefix_cache_evictions",
                                        "Prefix-cache entries deleted, least recently used first, to fit the budget",
                                        registry=r)

    def prefix_held(self, end) -> None:
        """A `retain` job's end: the prefix cache's entries and bytes, the entries it evicted."""
        self.prefix_entries.set(end["prefix_entries"])
        self.prefix_bytes.set(end["prefix_bytes"])
        self.prefix_evictions.inc(end["prefix_evicted"])

    def engine_steps(self, msg) -> None:
        """An engine's `stats` message: its forwards since the last one, its KV memory, its evictions."""
        if "kv_blocks" in msg:
            self.kv_usage.labels(str(msg["engine"])).set(msg["kv_used"] / msg["kv_blocks"])
        self.evictions.inc(msg.get("evictions", 0))
        for sessions, decode, prefill, model_s, step_s in msg["steps"]:
            self.step_sessions.observe(sessions)
            self.model_seconds.observe(model_s)
            self.step_seconds.observe(step_s)
            if decode:
                self.step_tokens.labels("decode").observe(decode)
            if prefill:
                self.step_tokens.labels("prefill").observe(prefill)
