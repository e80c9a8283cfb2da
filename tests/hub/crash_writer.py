"""Child process for the crash test: 4 producers append through the hub API until killed.

Prints one line per acknowledged batch, after its commit: ``first_offset count run producer i``.
Payloads are derived from (run, producer, i, j) so the parent can check every byte.
"""

from __future__ import annotations

import asyncio
import random
import sys

from taproom.config import load_config
from taproom.hub import Hub
from taproom.records import BatchBuilder


def payload(run: int, producer: int, i: int, j: int) -> bytes:
    head = f"{run}:{producer}:{i}:{j}:".encode()
    return head + bytes((run * 7 + producer * 13 + i + j) % 251 for _ in range(50 + j % 200))


async def producer(hub: Hub, run: int, number: int) -> None:
    rng = random.Random(run * 100 + number)
    i = 0
    while True:
        n = rng.randint(1, 60)
        builder = BatchBuilder()
        for j in range(n):
            builder.add("crash", payload(run, number, i, j), stream=f"p{number}", seq=i)
        commit = await hub.ingest(builder.build())
        sys.stdout.write(f"{commit.first_offset} {commit.count} {run} {number} {i}\n")
        sys.stdout.flush()
        i += 1


async def main(journal_dir: str, run: int) -> None:
    config = load_config(
        text=f'[journal]\ndir = "{journal_dir}"\nsegment_bytes = 1048576\n', env={}
    )
    async with Hub(config) as hub:
        await asyncio.gather(*(producer(hub, run, k) for k in range(4)))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
