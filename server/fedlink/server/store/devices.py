"""Device enrollment, authentication, presence (calls, polls, sign-offs), approval and revocation."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from types import MappingProxyType

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from fedlink.common.errors import AlreadyExists, ResourceExhausted, Unauthenticated
from fedlink.server.domain import Assignment, Device, DeviceState, new_id, transition_device
from fedlink.server.store import rows
from fedlink.server.store.core import StoreCore
from fedlink.server.store.protocol import NewDevice, Page
from fedlink.server.store.schema import among, assignments, devices, state_is

#: Device ids per SELECT when reading back a batch enrolment.
_ENROL_CHUNK = 500
_NO_INFO: Mapping[str, str] = MappingProxyType({})
#: Key of the PostgreSQL advisory lock that serialises capped enrolments (count, then insert).
_ENROLMENT_LOCK = 0x66656E726F6C6C  # "fenroll"
#: An OFFLINE device that calls comes back ONLINE; PENDING (awaiting approval) stays PENDING.
_CALLED_STATE = sa.case(
    (devices.c.state == DeviceState.OFFLINE.value, DeviceState.ONLINE.value), else_=devices.c.state
)


class DeviceQueries(StoreCore):
    """The devices part of the SQL store."""

    async def enroll_device(
        self,
        device_info: Mapping[str, str],
        user_info: Mapping[str, str],
        credential_hash: str,
        *,
        device_id: str | None = None,
        pending: bool = False,
        enrolment_digest: str | None = None,
        max_devices: int | None = None,
    ) -> Device:
        """Enroll a device under the hash of its credential (never the credential itself).

        Args:
            pending: Enrol it PENDING (awaiting an operator's approval) rather than ONLINE.
            enrolment_digest: A digest of the enrolment request, for :meth:`enrolment_digest`.
            max_devices: Refuse the enrolment (ResourceExhausted) if this many devices that are not
                revoked are enrolled already; None: no cap.

        Raises:
            AlreadyExists: a device with this id or credential is enrolled already.
            ResourceExhausted: ``max_devices`` are enrolled.
        """
        now = self._clock.now()
        values = {
            "device_id": device_id or new_id(),
            "credential_hash": credential_hash,
            "device_info": rows.dump_map(device_info),
            "user_info": rows.dump_map(user_info),
            "state": (DeviceState.PENDING if pending else DeviceState.ONLINE).value,
            "enrolled_at": now,
            "last_seen": now,
            "enrolment_digest": enrolment_digest,
        }

        async def work(conn: AsyncConnection) -> Device:
            if max_devices is not None:
                await _check_cap(conn, max_devices)
            inserted = (
                await conn.execute(self._db.insert_ignore(devices).values(values).returning(devices))
            ).first()
            if inserted is None:
                raise AlreadyExists("a device with this id or credential is enrolled already")
            return rows.device(inserted)

        return await self._db.write(work)

    async def enroll_devices(self, new_devices: Sequence[NewDevice]) -> list[Device]:
        """Enroll many devices in one transaction (all or none); returns them in the given order.

        AlreadyExists (and nothing enrolled) if any id or credential hash is enrolled already or
        given twice. A new device without an id gets a fresh one.
        """
        now = self._clock.now()
        values = [
            {
                "device_id": new.device_id or new_id(),
                "credential_hash": new.credential_hash,
                "device_info": rows.dump_map(new.device_info),
                "user_info": rows.dump_map(new.user_info),
                "state": DeviceState.ONLINE.value,
                "enrolled_at": now,
                "last_seen": now,
                "polled_job_name": new.polled_job_name,
            }
            for new in new_devices
        ]
        if not values:
            return []
        ids = [str(v["device_id"]) for v in values]
        hashes = {str(v["device_id"]): str(v["credential_hash"]) for v in values}

        async def work(conn: AsyncConnection) -> list[Device]:
            await conn.execute(self._db.insert_ignore(devices), values)
            found: dict[str, Device] = {}
            for start in range(0, len(ids), _ENROL_CHUNK):
                chunk = ids[start : start + _ENROL_CHUNK]
                query = sa.select(devices).where(devices.c.device_id.in_(chunk))
                for row in await conn.execute(query):
                    if row.credential_hash == hashes[row.device_id]:
                        found[row.device_id] = rows.device(row)
            if len(found) != len(ids) or len(set(ids)) != len(ids):
                # Rolls the whole batch back: a device that was ignored is enrolled already.
                raise AlreadyExists("a device with one of these ids or credentials is enrolled already")
            return [found[device_id] for device_id in ids]

        return await self._db.write(work)

    async def authenticate_device(self, credential_hash: str) -> Device:
        """Return the device with this credential; Unauthenticated if unknown or revoked."""
        async with self._db.read() as conn:
            row = (
                await conn.execute(sa.select(devices).where(devices.c.credential_hash == credential_hash))
            ).first()
        if row is None:
            raise Unauthenticated("unknown device credential")
        found = rows.device(row)
        if found.state is DeviceState.REVOKED:
            raise Unauthenticated(f"the credential of device {found.device_id} was revoked")
        return found

    async def get_device(self, device_id: str) -> Device:
        """Return a device; NotFound if unknown."""
        async with self._db.read() as conn:
            row = await self._fetch_one(
                conn, sa.select(devices).where(devices.c.device_id == device_id), f"device {device_id}"
            )
        return rows.device(row)

    async def enrolment_digest(self, device_id: str) -> str | None:
        """The digest a device was enrolled with (None for one enrolled before it was kept); NotFound
        if unknown."""
        query = sa.select(devices.c.enrolment_digest).where(devices.c.device_id == device_id)
        async with self._db.read() as conn:
            row = await self._fetch_one(conn, query, f"device {device_id}")
        digest: str | None = row[0]
        return digest

    async def touch_devices(self, device_ids: Sequence[str], now: datetime) -> None:
        """Record that these devices were seen at ``now`` (OFFLINE ones come back ONLINE).

        A device whose ``last_seen`` is ``now`` or later is left alone: calls are recorded in batches,
        and a batch taken before a device signed off must not bring it back.
        """
        if not device_ids:
            return
        statement = (
            sa.update(devices)
            .where(
                devices.c.device_id.in_(sorted(set(device_ids))),
                devices.c.state != DeviceState.REVOKED.value,
                devices.c.last_seen < now,
            )
            .values(last_seen=now, state=_CALLED_STATE)
        )

        async def work(conn: AsyncConnection) -> None:
            await conn.execute(statement)

        await self._db.write(work)

    async def record_polls(self, polls: Sequence[tuple[str, str]], now: datetime) -> None:
        """Record that each ``(device_id, job_name)`` asked for a job of that name ("" for any) at
        ``now``: the device is seen (an OFFLINE one comes back ONLINE) and may be sampled for such jobs."""
        if not polls:
            return
        statement = (
            sa.update(devices)
            .where(
                devices.c.device_id == sa.bindparam("b_device_id"),
                devices.c.state != DeviceState.REVOKED.value,
            )
            .values(polled_job_name=sa.bindparam("b_job_name"), last_seen=now, state=_CALLED_STATE)
        )
        params = [{"b_device_id": device_id, "b_job_name": name} for device_id, name in dict(polls).items()]

        async def work(conn: AsyncConnection) -> None:
            await conn.execute(statement, params)

        await self._db.write(work)

    async def sign_off_device(self, device_id: str, now: datetime) -> list[Assignment]:
        """Record that a device stopped taking part: ONLINE becomes OFFLINE (seen at ``now``) and the
        assignments it still holds are RELEASED; returns those."""
        signed_off = (
            sa.update(devices)
            .where(devices.c.device_id == device_id, devices.c.state == DeviceState.ONLINE.value)
            .values(state=DeviceState.OFFLINE.value, last_seen=now)
        )
        released = (
            sa.update(assignments)
            .where(assignments.c.device_id == device_id, state_is(assignments.c.state, "LEASED"))
            .values(state="RELEASED")
            .returning(assignments)
        )

        async def work(conn: AsyncConnection) -> list[Assignment]:
            await conn.execute(signed_off)
            return [rows.assignment(r) for r in await conn.execute(released)]

        return await self._db.write(work)

    async def mark_offline(self, older_than: datetime) -> int:
        """Move ONLINE devices not seen since ``older_than`` to OFFLINE; return how many moved.

        A device holding a lease stays ONLINE: it is working on a task (and renews the lease), not gone.
        """
        holds_lease = sa.exists().where(
            assignments.c.device_id == devices.c.device_id, state_is(assignments.c.state, "LEASED")
        )
        statement = (
            sa.update(devices)
            .where(
                devices.c.state == DeviceState.ONLINE.value,
                devices.c.last_seen < older_than,
                ~holds_lease,
            )
            .values(state=DeviceState.OFFLINE.value)
        )

        async def work(conn: AsyncConnection) -> int:
            return (await conn.execute(statement)).rowcount

        return await self._db.write(work)

    async def revoke_device(self, device_id: str) -> Device:
        """Revoke a device's credential for good; IllegalTransition if it was revoked already."""

        async def work(conn: AsyncConnection) -> Device:
            where = devices.c.device_id == device_id
            row = await self._fetch_one(conn, sa.select(devices).where(where), f"device {device_id}")
            transition_device(DeviceState(row.state), DeviceState.REVOKED)
            updated = (
                await conn.execute(
                    sa.update(devices).where(where).values(state=DeviceState.REVOKED.value).returning(devices)
                )
            ).one()
            return rows.device(updated)

        return await self._db.write(work)

    async def approve_device(self, device_id: str) -> Device:
        """Approve a PENDING device (it becomes ONLINE, seen now); an approved one is returned as it is.

        Raises:
            NotFound: no such device.
            IllegalTransition: the device was revoked.
        """
        now = self._clock.now()

        async def work(conn: AsyncConnection) -> Device:
            where = devices.c.device_id == device_id
            row = await self._fetch_one(conn, sa.select(devices).where(where), f"device {device_id}")
            state = DeviceState(row.state)
            if state in (DeviceState.ONLINE, DeviceState.OFFLINE):
                return rows.device(row)
            transition_device(state, DeviceState.ONLINE)
            statement = (
                sa.update(devices)
                .where(where)
                .values(state=DeviceState.ONLINE.value, last_seen=now)
                .returning(devices)
            )
            return rows.device((await conn.execute(statement)).one())

        return await self._db.write(work)

    async def list_devices(
        self, *, page_size: int = 100, page_token: str = "", state: DeviceState | None = None
    ) -> Page[Device]:
        """List devices, newest enrollment first."""
        size = rows.check_page_size(page_size)
        query = sa.select(devices).order_by(devices.c.enrolled_at.desc(), devices.c.device_id.desc())
        if state is not None:
            query = query.where(devices.c.state == state.value)
        if page_token:
            when, last_id = rows.decode_page_token(page_token)
            query = query.where(rows.before(devices.c.enrolled_at, devices.c.device_id, when, last_id))
        async with self._db.read() as conn:
            found = [rows.device(r) for r in (await conn.execute(query.limit(size + 1))).all()]
        items = found[:size]
        token = (
            rows.encode_page_token(items[-1].enrolled_at, items[-1].device_id) if len(found) > size else ""
        )
        return Page(items=items, next_page_token=token)

    async def online_devices(
        self, *, with_info: bool, job_name: str | None = None
    ) -> list[tuple[str, Mapping[str, str]]]:
        """Every ONLINE device's id (and device_info if ``with_info``): two columns, not whole rows.

        With ``job_name``, only the devices whose last GetJob asked for a job of that name or for any
        job. A round of 10,000 devices samples from all of them; reading and converting whole rows, a
        page at a time, had cost the round boundary ~0.5 s."""
        columns = (devices.c.device_id, devices.c.device_info) if with_info else (devices.c.device_id,)
        query = sa.select(*columns).where(devices.c.state == DeviceState.ONLINE.value)
        if job_name is not None:
            query = query.where(devices.c.polled_job_name.in_(["", job_name]))
        async with self._db.read() as conn:
            found = (await conn.execute(query)).all()
        if not with_info:
            return [(row[0], _NO_INFO) for row in found]
        return [(device_id, rows.load_map(info)) for device_id, info in found]

    async def authenticate_devices(self, credential_hashes: Sequence[str]) -> list[Device | Unauthenticated]:
        """Authenticate many credentials with one read: per hash, in order, its device or the
        Unauthenticated that :meth:`authenticate_device` would raise for it."""
        if not credential_hashes:
            return []
        async with self._db.read() as conn:
            array = conn.dialect.name == "postgresql"
            statement = sa.select(devices).where(among(devices.c.credential_hash, "hashes", array=array))
            found = (await conn.execute(statement, {"hashes": sorted(set(credential_hashes))})).all()
        by_hash = {row.credential_hash: rows.device(row) for row in found}
        return [_callable(by_hash.get(credential_hash)) for credential_hash in credential_hashes]


async def _check_cap(conn: AsyncConnection, max_devices: int) -> None:
    """Refuses an enrolment beyond ``max_devices`` devices that are not revoked."""
    if conn.dialect.name == "postgresql":
        # Two enrolments counting at once would both see room for one more (SQLite's single writer
        # serialises them already): they take turns until commit.
        await conn.execute(sa.select(sa.func.pg_advisory_xact_lock(_ENROLMENT_LOCK)))
    not_revoked = devices.c.state != DeviceState.REVOKED.value
    count = sa.select(sa.func.count()).select_from(devices).where(not_revoked)
    enrolled = (await conn.execute(count)).scalar_one()
    if enrolled >= max_devices:
        raise ResourceExhausted(
            f"the coordinator has its cap of {max_devices} enrolled devices (revoked ones do not count): "
            "an operator can revoke devices that are gone, or raise max_devices"
        )


def _callable(device: Device | None) -> Device | Unauthenticated:
    if device is None:
        return Unauthenticated("unknown device credential")
    if device.state is DeviceState.REVOKED:
        return Unauthenticated(f"the credential of device {device.device_id} was revoked")
    return device
