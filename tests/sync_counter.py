"""SyncCounter (hf_swiftspec/tools/counters.py): counts the tensor calls that read device values on the host, and the
tensors made of host data, for tests that bound a round's reads and copies."""

from hf_swiftspec.tools.counters import SyncCounter, library_line  # noqa: F401
