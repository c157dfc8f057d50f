"""The asyncio SDK (`forkbox.AsyncForkbox`) against a real `forkbox serve`."""

import asyncio

import pytest

import forkbox
from forkbox import AsyncForkbox, Result, Stdout


def run(coro):
    return asyncio.run(coro)


def test_async_exec_batch_and_session_flow(server):
    async def main():
        async with AsyncForkbox(server.url, server.key) as fb:
            r = await fb.exec("print('a'); 2 ** 10")
            assert (r.stdout, r.value) == ("a\n", "1024")
            rs = await fb.exec_batch(["1", "2", "3"])
            assert [x.value for x in rs] == ["1", "2", "3"]
            s = await fb.sessions.create(tags={"suite": "sdk-async"}, timeout=10)
            assert isinstance(s, forkbox.AsyncSession)
            assert (await s.exec("y = [1]")).checkpoint == 1
            assert (await s.exec("y.append(2); y")).value == "[1, 2]"
            assert [c.seq for c in await s.checkpoints()] == [1, 2]
            assert s.id in [x.id for x in await fb.sessions.list(tags={"suite": "sdk-async"})]
            assert (await fb.sessions.get(s.id)).info.checkpoint == 2
            t = await s.fork(1)
            assert (await t.exec("y")).value == "[1]"
            await s.revert(1)
            assert s.info.checkpoint == 1 and (await s.exec("y")).value == "[1]"
            # One numbering per tree: the fork's exec took 3.
            assert (await s.refresh()).info.checkpoint == 4
            await t.delete()
            await s.delete()
            with pytest.raises(forkbox.SessionNotFound):
                await fb.sessions.get(s.id)

    run(main())


def test_async_errors(server):
    async def main():
        async with AsyncForkbox(server.url, "fbk_wrong") as bad:
            with pytest.raises(forkbox.Unauthorized):
                await bad.exec("1")
        async with AsyncForkbox(server.url, server.key) as fb:
            s = await fb.sessions.create(timeout=1)
            with pytest.raises(forkbox.CheckpointNotFound):
                await s.revert(5)
            with pytest.raises(forkbox.Timeout):
                await s.exec("while True: pass")
            with pytest.raises(forkbox.InvalidRequest):
                await fb.sessions.create(memory_mb=10**9)
            # Two execs at once on one session: one of them is refused as busy.
            results = await asyncio.gather(s.exec("import time; time.sleep(0.8)"), s.exec("import time; time.sleep(0.8)"),
                                           return_exceptions=True)
            assert sum(isinstance(r, forkbox.SessionBusy) for r in results) == 1, results
            await s.delete()

    run(main())


def test_async_stream_order_and_concurrency(server):
    async def main():
        async with AsyncForkbox(server.url, server.key) as fb:
            s = await fb.sessions.create()
            events = [ev async for ev in s.stream("for i in range(3): print(i, flush=True)\n'end'")]
            assert [e.data for e in events if isinstance(e, Stdout)] and isinstance(events[-1], Result)
            assert "".join(e.data for e in events if isinstance(e, Stdout)) == "0\n1\n2\n"
            assert events[-1].result.value == "'end'"
            # Several sessions driven at once from one event loop.
            ss = await asyncio.gather(*(fb.sessions.create() for _ in range(3)))
            rs = await asyncio.gather(*(x.exec(f"{i} * 3") for i, x in enumerate(ss)))
            assert [r.value for r in rs] == ["0", "3", "6"]
            await asyncio.gather(*(x.delete() for x in [s, *ss]))

    run(main())


def test_async_files_and_interrupt(server):
    async def main():
        async with AsyncForkbox(server.url, server.key) as fb:
            s = await fb.sessions.create(timeout=30)
            await s.upload("/work/a.txt", b"hello")
            assert await s.download("/work/a.txt") == b"hello"
            assert [e.name for e in await s.files("/work")] == ["a.txt"]
            with pytest.raises(forkbox.FileNotFound):
                await s.download("/work/nope")
            task = asyncio.create_task(s.exec("while True: pass"))
            await asyncio.sleep(1.5)
            assert await s.interrupt() is True
            r = await task
            assert r.error.type == "KeyboardInterrupt"
            assert (await s.exec("open('/work/a.txt').read()")).value == "'hello'"
            await s.delete()

    run(main())


def test_async_background_process_follow_and_stdin(server):
    async def main():
        async with AsyncForkbox(server.url, server.key) as fb:
            s = await fb.sessions.create()
            p = await s.start_command("read line; echo got $line; sleep 0.2; echo bye", stdin=True)
            await s.write_stdin(p.pid, "hi\n")
            out = [e.data async for e in s.follow(p.pid, stream="stdout") if isinstance(e, Stdout)]
            assert "".join(out) == "got hi\nbye\n"
            assert (await s.process(p.pid)).exit_code == 0
            await s.delete()

    run(main())
