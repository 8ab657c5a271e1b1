"""OutputPump: items put from other threads reach the loop in order, in one batch per loop
iteration (what was queued by then), and nothing after close()."""

from __future__ import annotations

import asyncio
import threading

from pagedllm.engine.output_pump import OutputPump


def test_items_from_threads_arrive_in_order_one_batch_per_iteration_and_none_after_close():
    got: list[tuple[int, int]] = []
    batches: list[tuple[list[int], int]] = []
    ticks = 0

    def handle(items: list[int]) -> None:
        batches.append((items, ticks))
        got.extend((i, ticks) for i in items)

    async def run() -> None:
        nonlocal ticks
        pump = OutputPump(handle)
        pump.put(-1)  # before bind: waits for the loop
        pump.bind(asyncio.get_running_loop())
        senders = [threading.Thread(target=lambda k=k: [pump.put(k * 100 + i) for i in range(50)]) for k in range(3)]
        for t in senders:
            t.start()
        for t in senders:
            t.join()
        while len(got) < 151:
            ticks += 1
            await asyncio.sleep(0)
        pump.close()
        pump.put(999)
        for _ in range(5):
            await asyncio.sleep(0)

    asyncio.run(run())
    items = [i for i, _ in got]
    assert items[0] == -1 and sorted(items[1:]) == sorted(k * 100 + i for k in range(3) for i in range(50))
    for k in range(3):  # each sender's items in its own order
        mine = [i for i in items if i // 100 == k and i >= 0]
        assert mine == sorted(mine)
    assert 999 not in items
    # The loop ran other work between batches: never two batches in one loop iteration, no empty one.
    seen = [t for _, t in batches]
    assert all(b > a for a, b in zip(seen, seen[1:]))
    assert all(items for items, _ in batches)
    # Items queued together come together: the 150 put while the loop was blocked in join() are
    # one batch, not 150.
    assert len(batches) <= 3


def test_a_batch_is_what_was_queued_when_the_loop_got_to_it():
    async def run() -> list[list[int]]:
        batches: list[list[int]] = []
        pump = OutputPump(batches.append)
        pump.bind(asyncio.get_running_loop())
        pump.put(1)
        pump.put(2)
        await asyncio.sleep(0)
        pump.put(3)
        for _ in range(3):
            await asyncio.sleep(0)
        return batches

    assert asyncio.run(run()) == [[1, 2], [3]]
