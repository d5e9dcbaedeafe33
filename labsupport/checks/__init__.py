"""Checks for the attendee's exercises. Each check runs the attendee's code against the real
engine (or the engine's own reference pieces) and raises ``CheckFailed`` with a message saying
what differs and where to look.

The tests prove every check passes the reference solution (taken from the chapter notebook
itself) and fails planted wrong implementations, so a check can never be a rubber stamp.
"""
from .acceptance import check_acceptance_rule
from .admission import check_admission
from .base import CheckFailed, first_difference, passed
from .copy_on_write import check_copy_on_write
from .decoding import check_cached_attention, check_greedy_generate
from .memory import check_block_allocator, check_chain_hashes, check_longest_prefix, check_slot_mapping
from .mystery import FUNCTIONS as MYSTERY_FUNCTIONS
from .mystery import check_bug_fix, planted_bug
from .mystery import evidence as mystery_evidence
from .mystery import workload as mystery_workload
from .paged_read import check_paged_read, check_paged_read_mixed
from .prefix_admission import admission_scenario, check_leak_finder, check_prefix_admission
from .pd import check_kv_handoff, check_land_transfers, check_pack_blocks, check_unpack_blocks
from .scheduling import check_chunk_rule, check_schedule
from .serving import check_goodput, check_request_streams
from .slo_routing import check_choose_worker, compare_routing

__all__ = ["CheckFailed", "first_difference", "passed", "check_greedy_generate", "check_cached_attention",
           "check_slot_mapping", "check_block_allocator", "check_paged_read", "check_paged_read_mixed", "check_chain_hashes", "check_longest_prefix",
           "check_prefix_admission", "check_leak_finder", "planted_bug", "check_bug_fix", "MYSTERY_FUNCTIONS",
           "mystery_workload", "mystery_evidence", "admission_scenario",
           "check_schedule", "check_chunk_rule", "check_admission", "check_copy_on_write", "check_goodput", "check_request_streams", "check_pack_blocks", "check_unpack_blocks",
           "check_kv_handoff", "check_land_transfers", "check_acceptance_rule", "check_choose_worker",
           "compare_routing"]
