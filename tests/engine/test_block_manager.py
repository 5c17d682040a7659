"""Block-manager invariants under random operations (no model needed)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager
from engine.request import Request
from engine.sampling_params import SamplingParams

BLOCK = 4


def check_invariants(manager: BlockManager, live: list[Request]) -> None:
    expected = [0] * manager.num_blocks
    for request in live:
        for block_id in request.block_ids:
            expected[block_id] += 1
    assert manager.ref_counts == expected, "reference counts must equal the block-table references"
    assert manager.free_block_ids() == {b for b, count in enumerate(expected) if count == 0}
    assert manager.num_free_blocks == len(manager.free_block_ids())  # no block free twice
    for block_hash, block_id in manager.cached_blocks.items():
        assert manager.block_hash[block_id] == block_hash
    assert len(manager.free_cpu_blocks) + sum(len(r.cpu_block_ids) for r in live) == manager.num_cpu_blocks


def new_request(number: int, tokens: list[int]) -> Request:
    return Request(f"r{number}", 0, tokens, SamplingParams(max_tokens=8))


operations = st.lists(
    st.tuples(
        st.sampled_from(["add", "grow", "free", "fork", "swap", "decode"]),
        st.integers(0, 7),
        st.lists(st.integers(0, 5), min_size=1, max_size=13),
    ),
    max_size=60,
)


@given(operations)
@settings(max_examples=200, deadline=None)
def test_random_operations_keep_counts_consistent_and_return_every_block(ops):
    manager = BlockManager(num_blocks=12, block_size=BLOCK, num_cpu_blocks=8, enable_prefix_caching=True)
    live: list[Request] = []
    swapped: list[Request] = []
    for number, (op, pick, tokens) in enumerate(ops):
        if op == "add":
            request = new_request(number, tokens)
            cached = manager.find_cached_prefix(request)
            if manager.allocate_slots(request, request.num_tokens - len(cached) * BLOCK, cached) is not None:
                request.num_computed_tokens = request.num_tokens
                manager.register_full_blocks(request)
                live.append(request)
        elif not live:
            continue
        elif op in ("grow", "decode"):
            request = live[pick % len(live)]
            request.output_token_ids.append(tokens[0])
            copies = manager.allocate_slots(request, 1)
            if copies is None:
                request.output_token_ids.pop()
                continue
            for source, destination in copies:
                assert manager.ref_counts[source] >= 1 and manager.ref_counts[destination] == 1
            request.num_computed_tokens += 1
            manager.register_full_blocks(request)
        elif op == "free":
            manager.free(live.pop(pick % len(live)))
        elif op == "fork":
            parent = live[pick % len(live)]
            child = Request(parent.request_id, 1, list(parent.prompt_token_ids), parent.params)
            child.output_token_ids = list(parent.output_token_ids)
            manager.fork(parent, child)
            child.num_computed_tokens = parent.num_computed_tokens
            live.append(child)
        elif op == "swap":
            request = live[pick % len(live)]
            if manager.swap_out(request) is not None:
                live.remove(request)
                swapped.append(request)
                if manager.can_swap_in(swapped[0], 0):
                    back = swapped.pop(0)
                    manager.swap_in(back)
                    live.append(back)
        check_invariants(manager, live + swapped)
    for request in live:
        manager.free(request)
    for request in swapped:
        manager.free_swapped(request)
    assert manager.num_free_blocks == manager.num_blocks
    assert len(manager.free_cpu_blocks) == manager.num_cpu_blocks


def test_identical_prefixes_share_full_blocks_only():
    manager = BlockManager(num_blocks=16, block_size=BLOCK, num_cpu_blocks=0, enable_prefix_caching=True)
    first = new_request(0, list(range(10)))
    assert manager.allocate_slots(first, 10) == []
    first.num_computed_tokens = 10
    manager.register_full_blocks(first)
    second = new_request(1, list(range(10)))
    cached = manager.find_cached_prefix(second)
    assert cached == first.block_ids[:2]  # two full blocks; the partial third is never shared
    third = new_request(2, list(range(8)))
    assert len(manager.find_cached_prefix(third)) == 1  # the last token always gets computed


def test_copy_on_write_gives_a_forked_child_its_own_last_block():
    manager = BlockManager(num_blocks=8, block_size=BLOCK, num_cpu_blocks=0, enable_prefix_caching=False)
    parent = new_request(0, list(range(6)))
    manager.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    child = Request("r0", 1, list(range(6)), parent.params)
    manager.fork(parent, child)
    child.num_computed_tokens = 6
    copies = manager.allocate_slots(child, 1)
    assert copies == [(parent.block_ids[1], child.block_ids[1])]
    assert child.block_ids[0] == parent.block_ids[0] and child.block_ids[1] != parent.block_ids[1]
    assert manager.allocate_slots(parent, 1) == []  # now the only owner: writes in place


def test_evicted_cached_block_is_forgotten():
    manager = BlockManager(num_blocks=2, block_size=BLOCK, num_cpu_blocks=0, enable_prefix_caching=True)
    first = new_request(0, [1, 2, 3, 4, 5])
    manager.allocate_slots(first, 5)
    first.num_computed_tokens = 5
    manager.register_full_blocks(first)
    manager.free(first)
    other = new_request(1, [9, 9, 9, 9, 9, 9, 9, 9])
    manager.allocate_slots(other, 8)  # takes both blocks, evicting the cached one
    assert manager.cached_blocks == {}
    assert manager.find_cached_prefix(new_request(2, [1, 2, 3, 4, 5])) == []


def test_blocks_holding_nothing_reusable_go_before_a_cached_prefix():
    manager = BlockManager(num_blocks=8, block_size=BLOCK, num_cpu_blocks=0, enable_prefix_caching=True)
    partial = new_request(0, [9, 9, 9])  # one block, never full: nothing to cache
    manager.allocate_slots(partial, 3)
    prefix = new_request(1, list(range(8)))  # two full blocks
    manager.allocate_slots(prefix, 8)
    prefix.num_computed_tokens = 8
    manager.register_full_blocks(prefix)
    manager.free(prefix)
    manager.free(partial)  # freed last: a least-recently-freed queue would hand the prefix out first
    other = new_request(2, [7] * 24)
    assert manager.allocate_slots(other, 24) == []  # six blocks: every free block without a cached prefix
    again = new_request(3, list(range(8)) + [5])
    assert len(manager.find_cached_prefix(again)) == 2  # the prefix survived
    assert sorted(other.block_ids) == other.block_ids  # handed out lowest id first: neighbours in the pool
