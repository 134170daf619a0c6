"""A claim worker run as its own process by test_store_claims: prints "task device slot" per claim."""

from __future__ import annotations

import asyncio
import sys
from datetime import datetime, timedelta

from fedlink.server.store import create_store


async def main(url: str, job_id: str, prefix: str, now_text: str) -> None:
    now = datetime.fromisoformat(now_text)
    stores = [await create_store(url, auto_migrate=False, pool_size=1) for _ in range(4)]

    async def claim(index: int) -> list[str]:
        got = []
        for n in range(12):
            device = f"{prefix}-{index}-{n}"
            claimed = await stores[index].claim_task(device, job_id, now, timedelta(seconds=30))
            if claimed is not None:
                got.append(f"{claimed.task_id} {claimed.device_id} {claimed.slot}")
        return got

    try:
        for lines in await asyncio.gather(*(claim(i) for i in range(4))):
            for line in lines:
                print(line)
    finally:
        for store in stores:
            await store.close()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:5]))
