"""Long-poll wake-ups across replicas that share one PostgreSQL store: LISTEN/NOTIFY.

Several ``fedlink serve`` replicas may run on one database; a task the driver creates on replica A must
wake the device long-polling on replica B at once, not at its next poll. :class:`PgTaskNotifier` wakes
this replica's waiters as :class:`~fedlink.server.coordination.notify.LocalTaskNotifier` does, and
publishes every notification on the channel ``fedlink_tasks``; a listener on a dedicated connection
wakes the local waiters of what the other replicas publish (each notification names its replica, so
a replica skips its own).

* Payload: JSON ``{"replica": ..., "job": ..., "devices": [...]}``; without ``devices`` it concerns
  the whole job (also used when the device list would not fit PostgreSQL's 8000-byte payload limit);
  without ``job``, everything.
* Run progress rides the same channel: a replica that records reports for a run another replica drives
  relays them (:meth:`PgTaskNotifier.relay_progress`), ``{"replica": ..., "job": ..., "reported":
  [task ids], "urgent": true|false}``, split over several notifications when the ids would not fit
  one; the driver's replica hands them to :attr:`PgTaskNotifier.on_progress`. A relay lost with a
  connection costs the driver at most its own periodic look at the run.
* Batching: the notifications of one loop tick go out in one round trip (one ``pg_notify`` per job,
  device sets of a job merged), and those raised while a round trip is in flight go in the next.
* Outages: the listener reconnects with backoff when its connection drops (a restart, a failover,
  ``pg_terminate_backend``); notifications raised meanwhile are kept (merged per job) and sent once it
  is back. After every (re)connection it wakes all local waiters once, since another replica's
  notification may have been missed while it was away. Waiters re-check the store, so a spurious
  wake-up costs a read, never a wrong answer, and a missed one costs at most one long-poll wait.
* Dead connections that never say goodbye (a silent network partition) are found by a ``SELECT 1``
  when the connection was idle for ``ping_interval``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import secrets
import time
from collections.abc import Callable, Collection, Sequence
from types import TracebackType
from typing import Any

from sqlalchemy.engine import make_url

from fedlink.server.coordination.notify import LocalTaskNotifier, Waiter

log = logging.getLogger(__name__)

#: The channel every replica of a database publishes on and listens to.
CHANNEL = "fedlink_tasks"
#: PostgreSQL refuses a NOTIFY payload of 8000 bytes or more (its default build).
MAX_PAYLOAD_BYTES = 7999
#: How the listener's connection shows in ``pg_stat_activity``.
LISTENER_APPLICATION_NAME = "fedlink-notify"
# SQLAlchemy's options in a URL's query that are not asyncpg.connect's.
_SQLALCHEMY_ONLY = ("prepared_statement_cache_size", "prepared_statement_name_func", "async_creator_fn")
# One round trip for a tick's notifications, whatever their number.
_PUBLISH = "SELECT pg_notify($1, payload) FROM unnest($2::text[]) AS payload"
# The fewest bytes one more device id adds to a payload (a one-character id, its quotes and comma):
# a set larger than the limit allows at this rate cannot fit, and is not kept device by device.
_MIN_BYTES_PER_DEVICE = 4


def asyncpg_connect_args(url: str) -> dict[str, Any]:
    """The arguments of ``asyncpg.connect`` for a ``postgresql+asyncpg://`` URL, read as SQLAlchemy's
    asyncpg dialect reads them: host, port, user, password, database, then the URL's query options."""
    parsed = make_url(url)
    params: dict[str, Any] = parsed.translate_connect_args(username="user")
    params.update(parsed.query)
    for key in _SQLALCHEMY_ONLY:
        params.pop(key, None)
    name = params.pop("application_name", None)
    if name is not None:  # not an argument of asyncpg.connect: a server setting, as for the store
        settings = dict(params.get("server_settings") or {})
        settings["application_name"] = f"{name if isinstance(name, str) else name[-1]}-notify"
        params["server_settings"] = settings
    return params


def encode_progress(replica: str, job_id: str, task_ids: Collection[str], urgent: bool) -> list[str]:
    """The payloads relaying a job's progress: the reported ``task_ids`` (sorted, as many notifications
    as their length needs; one with none), and ``urgent``."""
    head = {"replica": replica, "job": job_id, "urgent": urgent}
    empty = len(json.dumps({**head, "reported": []}, separators=(",", ":")))
    payloads: list[str] = []
    chunk: list[str] = []
    size = empty
    for task_id in sorted(task_ids):
        extra = len(json.dumps(task_id)) + 1
        if chunk and size + extra > MAX_PAYLOAD_BYTES:
            payloads.append(json.dumps({**head, "reported": chunk}, separators=(",", ":")))
            chunk, size = [], empty
        chunk.append(task_id)
        size += extra
    if chunk or not payloads:
        payloads.append(json.dumps({**head, "reported": chunk}, separators=(",", ":")))
    return payloads


def encode(replica: str, job_id: str | None, devices: Collection[str] | None) -> str:
    """The payload of one notification: for ``devices`` of ``job_id``, its whole job when ``devices``
    is None or the list would not fit, everything when ``job_id`` is None (or not even that fits)."""
    if job_id is None:
        return json.dumps({"replica": replica}, separators=(",", ":"))
    if devices is not None:
        payload = json.dumps(
            {"replica": replica, "job": job_id, "devices": sorted(devices)}, separators=(",", ":")
        )
        if len(payload) <= MAX_PAYLOAD_BYTES:  # json.dumps escapes to ASCII: characters are bytes
            return payload
    payload = json.dumps({"replica": replica, "job": job_id}, separators=(",", ":"))
    return payload if len(payload) <= MAX_PAYLOAD_BYTES else encode(replica, None, None)


class PgTaskNotifier:
    """A :class:`~fedlink.server.coordination.notify.TaskNotifier` whose notifications also wake the
    waiters of the other replicas on the same PostgreSQL database.

    ``async with PgTaskNotifier(url) as notifier`` (or :meth:`start` and :meth:`close`).

    Args:
        url: The store's ``postgresql+asyncpg://`` URL.
        replica: A label for this replica in the payloads (a random suffix makes it unique per instance).
        channel: The NOTIFY channel.
        connect_timeout: How long opening the listener's connection may take; :meth:`start` waits this
            long for the listener before going on without it (it keeps trying in the background).
        reconnect_delay: The first wait before connecting again after a failed attempt (doubled on
            each further failure, with jitter).
        max_reconnect_delay: The longest wait between attempts.
        ping_interval: How long the connection may sit idle before a ``SELECT 1`` checks it.
    """

    def __init__(
        self,
        url: str,
        *,
        replica: str = "",
        channel: str = CHANNEL,
        connect_timeout: float = 10.0,
        reconnect_delay: float = 0.1,
        max_reconnect_delay: float = 5.0,
        ping_interval: float = 30.0,
    ) -> None:
        self._connect_args = asyncpg_connect_args(url)
        self.replica = f"{replica or 'fedlink'}/{secrets.token_hex(4)}"
        self._channel = channel
        self._connect_timeout = connect_timeout
        self._reconnect_delay = reconnect_delay
        self._max_reconnect_delay = max_reconnect_delay
        self._ping_interval = ping_interval
        self._local = LocalTaskNotifier()
        # What to publish: job -> devices, or None for the whole job. Kept while disconnected.
        self._outbox: dict[str, set[str] | None] = {}
        # Progress to relay: job -> (reported task ids, urgent). Kept while disconnected.
        self._progress_out: dict[str, tuple[set[str], bool]] = {}
        #: Told what other replicas relay of a job's progress: (job, reported task ids, urgent).
        self.on_progress: Callable[[str, Sequence[str], bool], None] | None = None
        # Set by notify() and by the connection's end: the listener task has something to do.
        self._wake = asyncio.Event()
        self._listening = asyncio.Event()
        self._connection: Any = None  # asyncpg.Connection, while listening
        self._task: asyncio.Task[None] | None = None
        self._listened = False
        #: Round trips that published notifications (one per batch).
        self.publishes = 0
        #: Notifications received from other replicas.
        self.received = 0
        #: Times the listener connected again after losing its connection.
        self.reconnects = 0

    # ---- TaskNotifier ----
    def notify(self, job_id: str, devices: Collection[str] | None = None) -> None:
        """Wakes this replica's waiters of ``job_id`` (of ``devices``, or all) and, in this loop tick's
        batch, the other replicas' ones."""
        self._local.notify(job_id, devices)
        if devices is not None and not devices:
            return
        if job_id not in self._outbox:
            self._outbox[job_id] = None if devices is None else set(devices)
        else:
            pending = self._outbox[job_id]
            if pending is not None:
                if devices is None:
                    self._outbox[job_id] = None
                else:
                    pending.update(devices)
        pending = self._outbox[job_id]
        if pending is not None and len(pending) * _MIN_BYTES_PER_DEVICE > MAX_PAYLOAD_BYTES:
            self._outbox[job_id] = None  # cannot fit anyway: the whole job, without holding the set
        self._wake.set()

    def relay_progress(self, job_id: str, task_id: str | None, urgent: bool) -> None:
        """Tells the other replicas (the one driving ``job_id``) that a report for ``task_id`` was
        recorded here, or with ``urgent``, that the run changed; in this loop tick's batch."""
        reported, was_urgent = self._progress_out.get(job_id, (set(), False))
        if task_id is not None:
            reported.add(task_id)
        self._progress_out[job_id] = (reported, was_urgent or urgent)
        self._wake.set()

    def notify_all(self) -> None:
        """Wakes every waiter of this replica (on shutdown: the other replicas are not told)."""
        self._local.notify_all()

    def waiter(self, job_id: str, device_id: str) -> Waiter:
        """Returns a waiter for the next notification of ``job_id`` that concerns ``device_id``, from
        this replica or another."""
        return self._local.waiter(job_id, device_id)

    # ---- lifecycle ----
    @property
    def listening(self) -> bool:
        """Whether the listener is connected and listening now."""
        return self._listening.is_set()

    @property
    def listener_pid(self) -> int | None:
        """The PostgreSQL backend process of the listener's connection, while it is listening."""
        connection = self._connection
        return None if connection is None else int(connection.get_server_pid())

    async def wait_listening(self, seconds: float) -> bool:
        """Waits up to ``seconds`` for the listener to listen; tells whether it does."""
        try:
            async with asyncio.timeout(seconds):
                await self._listening.wait()
        except TimeoutError:
            return False
        return True

    async def start(self) -> None:
        """Starts the listener and waits (up to ``connect_timeout``) until it listens."""
        if self._task is not None:
            return
        self._task = asyncio.create_task(self._run(), name="pg-task-notifier")
        if not await self.wait_listening(self._connect_timeout):
            log.warning(
                "not listening for other replicas' task notifications yet (still trying): until then "
                "their tasks reach this replica's long polls when those polls end"
            )

    async def close(self) -> None:
        """Stops the listener and closes its connection; safe to call twice."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def __aenter__(self) -> PgTaskNotifier:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # ---- the listener ----
    async def _run(self) -> None:
        failures = 0
        while True:
            if failures:
                delay = min(self._max_reconnect_delay, self._reconnect_delay * 2 ** (failures - 1))
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            try:
                connection = await self._connect()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if failures == 0:
                    log.warning("cannot connect to listen for task notifications (retrying): %r", exc)
                failures += 1
                continue
            opened = time.monotonic()
            try:
                await self._serve(connection)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("the connection listening for task notifications broke: %r", exc)
            finally:
                self._listening.clear()
                self._connection = None
                await self._hang_up(connection)
            # A connection that broke at once (LISTEN refused, a database going down) is tried again
            # with backoff; after one that served a while, at once.
            lived = time.monotonic() - opened
            failures = failures + 1 if lived < self._max_reconnect_delay else 0

    async def _hang_up(self, connection: Any) -> None:
        if connection.is_closed():
            return
        try:
            await connection.close(timeout=2)
        except asyncio.CancelledError:
            connection.terminate()
            raise
        except Exception:
            connection.terminate()

    async def _connect(self) -> Any:
        import asyncpg

        params = dict(self._connect_args)
        settings = dict(params.pop("server_settings", None) or {})
        settings.setdefault("application_name", LISTENER_APPLICATION_NAME)
        timeout = params.pop("timeout", self._connect_timeout)
        return await asyncpg.connect(**params, server_settings=settings, timeout=timeout)

    async def _serve(self, connection: Any) -> None:
        """Listens and publishes on ``connection`` until it breaks (raises then)."""
        connection.add_termination_listener(lambda _connection: self._wake.set())
        await connection.add_listener(self._channel, self._heard)
        self._connection = connection
        self._listening.set()
        if self._listened:
            self.reconnects += 1
            log.info("listening for task notifications again")
        self._listened = True
        # Whatever another replica published while this one was not listening is lost: every local
        # waiter looks at the store again.
        self._local.notify_all()
        while True:
            if connection.is_closed():
                raise ConnectionError("the server closed the connection")
            if self._outbox or self._progress_out:
                await self._publish(connection)
                continue  # what was raised during the round trip goes out now, in one more
            self._wake.clear()
            try:
                async with asyncio.timeout(self._ping_interval):
                    await self._wake.wait()
            except TimeoutError:
                await connection.execute("SELECT 1", timeout=self._connect_timeout)

    async def _publish(self, connection: Any) -> None:
        # Let the rest of this tick's notifications in first: they go out in the same round trip.
        await asyncio.sleep(0)
        outbox, self._outbox = self._outbox, {}
        progress, self._progress_out = self._progress_out, {}
        payloads = [encode(self.replica, job_id, devices) for job_id, devices in outbox.items()]
        for job_id, (reported, urgent) in progress.items():
            payloads += encode_progress(self.replica, job_id, reported, urgent)
        try:
            await connection.execute(_PUBLISH, self._channel, payloads, timeout=self._connect_timeout)
        except BaseException:
            self._keep(outbox)  # sent again once connected again (a duplicate costs a spurious wake-up)
            for job_id, (reported, urgent) in progress.items():  # a duplicate report is read, not counted
                for task_id in reported or (None,):
                    self.relay_progress(job_id, task_id, urgent)
            raise
        self.publishes += 1

    def _keep(self, outbox: dict[str, set[str] | None]) -> None:
        for job_id, devices in outbox.items():
            if job_id in self._outbox:
                pending = self._outbox[job_id]
                if pending is None or devices is None:
                    self._outbox[job_id] = None
                else:
                    pending.update(devices)
            else:
                self._outbox[job_id] = devices

    def _heard(self, _connection: Any, _pid: int, _channel: str, payload: str) -> None:
        try:
            message = json.loads(payload)
            replica = message["replica"]
            job_id = message.get("job")
            devices = message.get("devices")
        except (ValueError, TypeError, KeyError):
            log.warning("ignored a malformed task notification: %.200r", payload)
            return
        if replica == self.replica:
            return
        self.received += 1
        if "reported" in message:
            reported = message["reported"]
            if job_id is not None and isinstance(reported, list) and self.on_progress is not None:
                self.on_progress(str(job_id), [str(t) for t in reported], bool(message.get("urgent")))
            return
        if job_id is None:
            self._local.notify_all()
        elif isinstance(devices, list):
            self._local.notify(str(job_id), [str(d) for d in devices])
        else:
            self._local.notify(str(job_id))
