"""Decode engines: the serial loop here; the asynchronous one reuses the same workers."""

from .request import DecodeRequest, DecodeResult
from .serial import run_serial
from .workers import DraftWorker, TargetWorker

__all__ = ["DecodeRequest", "DecodeResult", "DraftWorker", "TargetWorker", "run_serial"]
