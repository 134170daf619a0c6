"""Device authentication that thousands of concurrent calls share: one store read per batch.

Every device RPC proves who it is with its credential; reading the store once per call made that read
the coordinator's largest per-call cost. Calls that arrive together are checked together, with one
``SELECT ... WHERE credential_hash IN (...)``. Nothing is cached: a
:class:`~fedlink.server.protocol.batching.Batcher` starts a read only after the calls it answers
arrived, so a device revoked (by any coordinator sharing the database) before its call arrived is
refused, exactly as with a read per call.
"""

from __future__ import annotations

from collections.abc import Sequence

from fedlink.common.errors import Unauthenticated
from fedlink.server.credentials import hash_credential
from fedlink.server.domain import Device
from fedlink.server.protocol.batching import Batcher
from fedlink.server.store import StateStore

#: Credentials checked by one read (one bound parameter each on SQLite, whose limit is 32,766).
_BATCH = 1_000
#: While calls arrive together, how long a read waits for more of them (see Batcher): a read costs
#: about the same for 1 or 100 credentials, and 1,000 busy devices had made ~8.5 per read.
AUTH_LINGER_SECONDS = 0.01


class DeviceAuthenticator:
    """Turns device credentials into devices, coalescing concurrent checks."""

    def __init__(self, store: StateStore) -> None:
        self._store = store
        self._checks: Batcher[str, Device] = Batcher(
            self._check_batch, max_batch=_BATCH, linger=AUTH_LINGER_SECONDS
        )

    async def device(self, credential: str | None) -> Device:
        """The device ``credential`` belongs to.

        Raises:
            Unauthenticated: no credential, or an unknown or revoked one.
        """
        if not credential:
            raise Unauthenticated("this call needs a device credential: authorization: Bearer <credential>")
        return await self._checks.submit(hash_credential(credential))

    async def _check_batch(self, credential_hashes: Sequence[str]) -> Sequence[Device | BaseException]:
        return await self._store.authenticate_devices(credential_hashes)
