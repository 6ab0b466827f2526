"""Transports: point-to-point byte links between ranks (see :mod:`gradcoll.transport.base`)."""

from .base import Deadline, Request, Transport

__all__ = ["Transport", "Request", "Deadline"]
