"""What the engine reports after each step: its queues, caches, tiers and speculation, read by
`/metrics` (``app/metrics.py``) and the server's status."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_free_blocks: int
    num_total_blocks: int
    num_waiting_clients: int = 0  # clients with a request waiting (scheduler.FairQueue)
    max_waiting_per_client: int = 0  # requests (sequences) the most-waiting client has queued
    grammar_cache_bytes: int = 0  # the compiled-grammar cache's size estimate
    grammar_compile_timeouts: int = 0  # compiles failed for running past their time limit
    # preemptions by why: "kv_cache", "fair_share", "priority"
    preemptions_by_reason: dict[str, int] = field(default_factory=dict)
    # the host tier (--kv-offload-size): its blocks, those in use, copied out, copied back
    host_tier_blocks: int = 0
    host_tier_used: int = 0
    host_tier_stored: int = 0
    host_tier_hits: int = 0
    # its disk part (--kv-offload-path): blocks, those in use, written, copied back
    disk_tier_blocks: int = 0
    disk_tier_used: int = 0
    disk_tier_stored: int = 0
    disk_tier_hits: int = 0
    swapped_out_blocks: int = 0  # copied out of the device into either tier
    # preempted requests resumed with second-tier blocks: "swap" (copied back) or
    # "recompute" (computed again), whichever was measured cheaper (core/swap_policy.py)
    resumptions_by_method: dict[str, int] = field(default_factory=dict)
    resumption_cost_per_token: dict[str, float] = field(default_factory=dict)  # what it compares
    spec_decode_num_drafts: int = 0  # runs of speculative tokens verified
    spec_decode_num_draft_tokens: int = 0  # speculative tokens proposed
    spec_decode_num_accepted_tokens: int = 0  # of which the target accepted
    spec_decode_accepted_per_pos: tuple[int, ...] = ()  # accepted at each position of a run
    spec_decode_num_trimmed_tokens: int = 0  # proposals dropped: they would not pay
