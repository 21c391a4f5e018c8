"""Decode engines: serial and asynchronous loops over the target's worker and the drafters."""

from .asynchronous import run_threads
from .links import SwiftSpecWorkerError
from .request import DecodeRequest, DecodeResult
from .adaptive import run_serial
from .workers import TargetWorker

__all__ = [
    "DecodeRequest",
    "DecodeResult",
    "SwiftSpecWorkerError",
    "TargetWorker",
    "run_serial",
    "run_threads",
]
