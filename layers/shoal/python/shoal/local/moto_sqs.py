"""moto's SQS made to receive in time (``shoal.local.aws.adapt_moto`` applies it, process-wide
and idempotent), with moto's answers.

moto checks each message a receive hands out against its queue's retention period, and reads
that period through ``get_queue_attributes``, which builds every attribute of the queue twice,
the approximate message counts among them: a walk of every message in the queue, per message
received. A receive of ten from a queue of a few thousand messages (the push queue in a
fan-out to 1,000 connections under ``shoal dev``) was thus quadratic, 2 % of the process's
CPU in that fan-out (py-spy, 2026-12-05). This reads the period itself. A send asks the
same mapping up to four times for one attribute (``ContentBasedDeduplication``), each build
counting every message: another 4 %. Within a send, the mapping answers what is asked of it
by name.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import Any

#: set while this thread runs a send (``SQSBackend.send_message``)
_sending = threading.local()


def read_retention_directly() -> None:
    """Replace ``SQSBackend.is_message_valid_based_on_retention_period`` by one that reads the
    queue's retention period from the queue, not from a build of all its attributes."""
    from moto.sqs import models

    backend = models.SQSBackend
    if getattr(backend.is_message_valid_based_on_retention_period, "_direct", False):
        return
    original = backend.is_message_valid_based_on_retention_period

    def is_message_valid_based_on_retention_period(
        self: Any, queue_name: str, message: Any
    ) -> bool:
        retention_s = self.get_queue(queue_name).message_retention_period
        # moto's module clock, looked up at each call as moto's own check does (the tests and
        # the emulator set it)
        return bool(int(retention_s) + message.sent_timestamp / 1000 > models.unix_time())

    is_message_valid_based_on_retention_period._direct = True  # type: ignore[attr-defined]
    is_message_valid_based_on_retention_period._moto = original  # type: ignore[attr-defined]
    backend.is_message_valid_based_on_retention_period = is_message_valid_based_on_retention_period


class _AsAsked(Mapping[str, Any]):
    """A queue's attributes as moto's ``Queue.attributes`` gives them, each built when it is
    asked for by name; iterated or measured, the whole mapping is built as moto builds it."""

    def __init__(self, queue: Any, build: Any) -> None:
        self._queue = queue
        self._build = build

    def __getitem__(self, name: str) -> Any:
        from moto.core.utils import camelcase_to_underscores
        from moto.sqs.models import Queue

        queue = self._queue
        plain = name in Queue.BASE_ATTRIBUTES or (
            queue.fifo_queue and name in Queue.FIFO_ATTRIBUTES
        )
        # moto writes these two its own way (the policy, the redrive policy as JSON)
        if plain and name not in ("Policy", "RedrivePolicy"):
            value = getattr(queue, camelcase_to_underscores(name))
            return str(value).lower() if isinstance(value, bool) else value
        return self._build(queue)[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._build(self._queue))

    def __len__(self) -> int:
        return len(self._build(self._queue))


def build_attributes_as_asked_while_sending() -> None:
    """Within ``SQSBackend.send_message`` and ``send_message_batch`` (whose check of every
    entry comes before the entries' sends: two builds an entry, 7.5 % of the server's GIL time
    an hour into a soak, py-spy ``--gil``), ``Queue.attributes`` builds only the attributes
    asked for; everywhere else it is moto's property as it was."""
    from moto.sqs import models

    if getattr(models.SQSBackend.send_message, "_as_asked", False):
        return
    built = models.Queue.attributes

    def attributes(queue: Any) -> Any:
        if getattr(_sending, "on", False):
            return _AsAsked(queue, built.fget)
        return built.fget(queue)

    def sending(send: Any) -> Any:
        def within(self: Any, *args: Any, **kwargs: Any) -> Any:
            outer = getattr(_sending, "on", False)
            _sending.on = True
            try:
                return send(self, *args, **kwargs)
            finally:
                _sending.on = outer

        within._as_asked = True  # type: ignore[attr-defined]
        return within

    models.Queue.attributes = property(attributes)
    models.SQSBackend.send_message = sending(models.SQSBackend.send_message)
    models.SQSBackend.send_message_batch = sending(models.SQSBackend.send_message_batch)
