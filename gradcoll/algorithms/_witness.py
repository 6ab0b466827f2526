"""The out-of-band channel the error path also sends its records over, so a cascade learns its root cause.

The error path (``_alarm``) sends this rank's record to every peer over the
transport, which wakes a peer blocked in a receive from it. But links are
exactly what fails: a peer this rank dropped the link to, or one that
closed its group, never reads an alarm from it. A group built by
``init_process_group`` therefore also has a *witness channel* that outlives
its links, the control channel (``gradcoll.observe.diagnosis``): every
record is also published there, and every rank's channel keeps the first
record each rank published in the group's life. A rank whose own failure
is a cascade (an alarm woke it, a peer closed or dropped its link) finds
the record of the rank that saw the first failure there, even when that
rank failed one call earlier, and raises the root cause instead.

The group attaches its channel to its transport (``attach``); this layer
never imports the channel's module (the layers are independent), it only
calls the three methods of ``Witnesses``, and the channel calls ``wake``
when a record arrives: a collective of this rank still blocked in a receive
(from a rank that will never send, or that is itself blocked) stops at
once, as if the alarm had come over its link. A rank that closes its group
publishes a *left* record first (``announce_close``), so peers still inside
a collective name the rank that closed, whatever their links made of it.
"""

from __future__ import annotations

import weakref
from typing import Protocol

from ..errors import ProtocolError
from ..transport.base import Transport
from ..transport.frame import FrameMismatch
from . import tags
from ._common import note_closing
from ._handshake import pack, unpack, with_status
from ._verdict import LEFT

__all__ = ["Witnesses", "attach", "of", "failing", "wake", "announce_close"]


class Witnesses(Protocol):
    """What the error path needs of an out-of-band channel (``gradcoll.observe.diagnosis.ControlChannel``)."""

    def publish(self, record: bytes) -> None:
        """Send this rank's record to every peer (best effort) and keep it as this rank's."""

    def records(self) -> dict[int, bytes]:
        """The first record each rank (this one included) published in the group's life."""

    def wait_records(self, timeout: float) -> None:
        """Block until a record arrives or ``timeout`` seconds pass."""


_CHANNELS: weakref.WeakKeyDictionary[Transport, Witnesses] = weakref.WeakKeyDictionary()
_FAILING: weakref.WeakSet[Transport] = weakref.WeakSet()  # transports whose collective is in its error path


def attach(transport: Transport, channel: Witnesses | None) -> None:
    """Make ``channel`` the witness channel of ``transport``'s collectives (None: detach)."""
    if channel is None:
        _CHANNELS.pop(transport, None)
    else:
        _CHANNELS[transport] = channel


def of(transport: Transport) -> Witnesses | None:
    """The witness channel attached to ``transport``, if any."""
    return _CHANNELS.get(transport)


def failing(transport: Transport) -> None:
    """``transport``'s collective entered its error path: it wants its receives, so ``wake`` leaves it alone."""
    _FAILING.add(transport)


def wake(transport: Transport, src: int, record: bytes, running: int | None) -> int:
    """Rank ``src`` published ``record``: stop this rank's collective waiting for frames that will not come.

    Called by the channel (its own thread) when a record arrives, and again
    while a collective is still running, because a receive posted after the
    first call would otherwise wait for its timeout. ``running`` is the seq
    of the collective this rank is inside (None: none). A record of a later
    call than that one says nothing about it: its rank finished this call,
    so whatever it had to send for it is sent (a rank that closed its group
    after its last call, a root that failed the next one), and this rank is
    left alone. The interrupted receive fails as if ``src``'s alarm had
    arrived over the transport. Returns how many receives it stopped.
    """
    if running is None or transport in _FAILING or transport.closed:
        return 0
    try:
        seq = unpack(record, 1)[0].seq
    except ProtocolError:
        return 0
    if seq > running:
        return 0
    text = f"rank {transport.rank}: rank {src} published an error record on the control channel"
    return transport.interrupt(lambda peer: FrameMismatch(text, peer=src, tag=tags.ALARM, payload=bytes(record)))


def announce_close(transport: Transport, seq: int) -> None:
    """Publish that this rank closes its group at ``seq`` (a no-op without a witness channel)."""
    note_closing(transport)  # the peers may drop their links before this transport is marked closed
    channel = _CHANNELS.get(transport)
    if channel is not None:
        desc = (0, 0, 0, 0, 0, -1, 0, seq)  # no call: only the seq and the status mean something
        channel.publish(bytes(pack([with_status(desc, (LEFT, -1, 0.0), transport.rank)])))
