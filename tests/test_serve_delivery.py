"""A finished request leaves the server's books before its client hears of it.

The router (cli/routing.py) sends a request that finds another in flight to transformers' batch of the
target alone, where it does not speculate. A client that sends its next request as soon as its answer
arrives must find the server idle: under load, the answer used to reach the client before the finished
request was forgotten, and the next request was batched (no speculation, no usage.speculation).
"""

from types import SimpleNamespace

from transformers import GenerationConfig

from hf_swiftspec.serving.batching import ServedRequest, ServingManager
from hf_swiftspec.models import compat


class AnswersAtOnce:
    """An event loop that runs a callback the moment it is scheduled: the fastest client there can be."""

    def call_soon_threadsafe(self, callback, *args):
        callback(*args)


def test_a_finished_request_is_forgotten_before_its_handler_runs():
    manager = ServingManager(SimpleNamespace(generation_config=GenerationConfig()))
    in_flight_when_answered = []
    request = ServedRequest("r1", input_ids=[1, 2], tokens=[3, 4], added=True)
    request.handler = (lambda output: in_flight_when_answered.append("r1" in manager.requests), AnswersAtOnce())
    manager.requests["r1"] = request

    manager.deliver(request, compat.cb_request_status().DECODING)  # a streamed chunk: still in flight
    manager.deliver(request, compat.cb_request_status().FINISHED)

    assert in_flight_when_answered == [True, False]
    assert manager.requests == {}
