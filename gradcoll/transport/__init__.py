"""Transports: point-to-point byte links between ranks (see ``gradcoll.transport.base``)."""

from .base import Deadline, Request, Transport

__all__ = ["Transport", "Request", "Deadline"]
