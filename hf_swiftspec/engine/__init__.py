"""Decode engines: serial and asynchronous loops over the same two workers."""

from .asynchronous import run_threads
from .links import SwiftSpecWorkerError
from .request import DecodeRequest, DecodeResult
from .adaptive import run_serial
from .workers import DraftModelDrafter, TargetWorker

__all__ = [
    "DecodeRequest",
    "DecodeResult",
    "DraftModelDrafter",
    "SwiftSpecWorkerError",
    "TargetWorker",
    "run_serial",
    "run_threads",
]
