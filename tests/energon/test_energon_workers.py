"""Global worker numbering and the topology refusal (pure, property-tested)."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from energon_pack.energon.workers import Topology, resumable_topologies, topology_refusal

sizes = st.integers(min_value=1, max_value=12)


@given(world_size=sizes, num_workers=st.integers(min_value=0, max_value=12))
def test_global_workers_number_every_worker_of_every_rank_once(
    world_size: int, num_workers: int
) -> None:
    topology = Topology(world_size, num_workers)
    numbers = [
        topology.global_worker(rank, worker)
        for rank in range(world_size)
        for worker in range(max(num_workers, 1))
    ]
    assert numbers == list(range(topology.global_workers))


@given(global_workers=st.integers(min_value=1, max_value=200))
def test_resumable_topologies_are_every_split_of_the_global_count(global_workers: int) -> None:
    splits = [tuple(map(int, text.split("x"))) for text in resumable_topologies(global_workers)]
    assert all(ranks * workers == global_workers for ranks, workers in splits)
    divisors = [ranks for ranks in range(1, global_workers + 1) if global_workers % ranks == 0]
    assert [ranks for ranks, _ in splits] == divisors


@given(saved=st.tuples(sizes, sizes), current=st.tuples(sizes, st.integers(0, 12)))
def test_the_refusal_names_both_topologies_and_each_that_resumes(
    saved: tuple[int, int], current: tuple[int, int]
) -> None:
    before, now = Topology(*saved), Topology(*current)
    message = topology_refusal(before, before.global_workers, now)
    assert f"saved at {before} = {before.global_workers} global worker" in message
    assert f"this loader runs {now} = {now.global_workers} global worker" in message
    listed = re.search(r"use ([\dx, or]+) \(", message)
    assert listed is not None
    assert re.split(r", | or ", listed.group(1)) == resumable_topologies(before.global_workers)


def test_a_state_without_worker_processes_is_sent_back_to_its_topology() -> None:
    message = topology_refusal(Topology(2, 0), 2, Topology(1, 0))
    assert "saved at 2 ranks x 0 workers = 2 global workers" in message
    assert "restore it at 2 ranks x 0 workers (a state saved without worker processes" in message
