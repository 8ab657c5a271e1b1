"""OutputPump: items put from other threads reach the loop in order, one per loop iteration, and
nothing after close()."""

from __future__ import annotations

import asyncio
import threading

from pagedllm.engine.output_pump import OutputPump


def test_items_from_threads_arrive_in_order_one_per_iteration_and_none_after_close():
    got: list[tuple[int, int]] = []
    ticks = 0

    async def run() -> None:
        nonlocal ticks
        pump = OutputPump(lambda item: got.append((item, ticks)))
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
    # The loop ran other work between items: never two items in one loop iteration.
    seen = [t for _, t in got]
    assert all(b > a for a, b in zip(seen[1:], seen[2:]))
