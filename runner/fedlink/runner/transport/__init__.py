"""How the Runner reaches the coordinator: the :class:`Transport` interface and its gRPC implementation."""

from fedlink.runner.transport.backoff import Backoff
from fedlink.runner.transport.base import Ack, JobOffer, LeaseAck, ResultReport, Status, TaskOffer, Transport

__all__ = ["Ack", "Backoff", "JobOffer", "LeaseAck", "ResultReport", "Status", "TaskOffer", "Transport"]
