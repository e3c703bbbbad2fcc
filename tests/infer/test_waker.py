"""`infer.routes.waker`: the engine's thread sets the events of a step's requests with one call into the event
loop for all of them, and never loses one."""

import asyncio
import threading

from meshlm.infer.routes import waker


def test_one_call_into_the_loop_wakes_every_event_set_before_it_runs():
    async def main():
        loop = asyncio.get_running_loop()
        events = [asyncio.Event() for _ in range(64)]
        calls = []
        inner = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: calls.append(1) or inner(*a)
        wake = waker(loop)
        assert waker(loop) is wake  # one per loop
        # the engine's thread notifies every request of a step while the loop is busy elsewhere
        thread = threading.Thread(target=lambda: [wake(e) for e in events])
        thread.start()
        thread.join()
        assert len(calls) == 1
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 5)
        # the next step's notifications schedule the loop again: none is lost after a flush
        for e in events:
            e.clear()
        thread = threading.Thread(target=lambda: [wake(e) for e in events[:3]])
        thread.start()
        thread.join()
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events[:3])), 5)
        assert len(calls) == 2 and not any(e.is_set() for e in events[3:])

    asyncio.run(main())
