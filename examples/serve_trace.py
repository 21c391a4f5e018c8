"""Where a served request's time goes: `swiftspec serve --continuous-batching` run in this process, its running
batch timed round by round, the slowest requests' time split into rounds (by tree size), prefills and the wait.

    OMP_NUM_THREADS=1 python examples/serve_trace.py --clients 4

The server runs here (one torch thread, as serve_latency.py's) and the clients in a process of their own
(serve_latency.run_clients: 4 warm-up requests at once, then the prompts `clients` at a time). The engine's round
(engine/rounds.one_round) and its prefill pieces are wrapped to time them; nothing else changes. Prints the clients'
p50 / p99 / tokens/s, the rounds by rows and tree size, and for the slowest requests: the time in the engine, the
wait before its first round, its own prefill, the other requests' prefills that ran while it decoded (every row
waits for each), and its rounds by kind (quiet: plain with no proposal built; T=n: n nodes a row verified).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field

from serve_latency import free_port

from hf_swiftspec.engine import continuous, continuous_device, rounds
from hf_swiftspec.serving.server import ServeOptions, serve

CLIENTS = """
import sys, time
sys.path.insert(0, {examples!r})
import openai, serve_latency
from hf_swiftspec.bench import load_prompts
texts = [p.text[-400:] for s in ('humaneval', 'spec_bench') for p in load_prompts(s)]
client = openai.OpenAI(base_url='http://localhost:{port}/v1', api_key='unused', max_retries=0, timeout=600)
for _ in range(360):  # the server loads the pair meanwhile
    try:
        client.completions.create(model={pair!r}, prompt='def f', max_tokens=2, temperature=0)
        break
    except (openai.APIConnectionError, openai.InternalServerError):
        time.sleep(0.5)
serve_latency.run_clients(client, {pair!r}, texts[-4:], 4, {max_tokens})
print('WARM', flush=True)
sys.stdin.readline()
r = serve_latency.run_clients(client, {pair!r}, texts[:{requests}], {clients}, {max_tokens})
print(f"clients: p50 {{r['p50']:.2f}} s, p99 {{r['p99']:.2f}} s, {{r['tokens_per_s']:.1f}} tokens/s", flush=True)
"""


@dataclass
class Trace:
    """What the wrapped engine saw: (kind, start, seconds, keys, tree size, tokens by key, quiet) per event."""

    events: list = field(default_factory=list)
    spans: dict = field(default_factory=dict)  # key: (joined, done)

    def wrap(self) -> None:
        one_round, done = rounds.one_round, continuous.ContinuousEngine.done

        def timed_round(sides, rows):
            start = time.perf_counter()
            before = {rows.members[i].key: len(rows.members[i].result.tokens) for i in rows.live}
            keep = one_round(sides, rows)
            after = {m.key: len(m.result.tokens) for m in rows.members.values()}
            plan = sides.policy.plan
            self.events.append(("round", start, time.perf_counter() - start, list(before), sides.policy.last_budget,
                                {k: after.get(k, n + 1) - n for k, n in before.items()}, plan.quiet))
            return keep

        def timed(prefill_piece):
            def timed_prefill(engine, joining):  # a request's piece (the host round's) or a group's (the device round's)
                start = time.perf_counter()
                prefill_piece(engine, joining)
                self.events.append(("prefill", start, time.perf_counter() - start, [m.key for m in joining.members]))
            return timed_prefill

        def timed_done(engine, member):
            self.spans[member.key] = (member.joined_at, time.perf_counter())
            done(engine, member)

        rounds.one_round = timed_round
        for engine in (continuous.ContinuousEngine, continuous_device.DeviceContinuousEngine):
            engine.prefill_piece = timed(engine.prefill_piece)
        continuous.ContinuousEngine.done = timed_done

    def report(self, slowest: int) -> None:
        by_shape = defaultdict(lambda: [0, 0.0])
        for e in self.events:
            if e[0] == "round":
                shape = by_shape[(len(e[3]), "quiet" if e[6] else f"T={e[4]}")]
                shape[0] += 1
                shape[1] += e[2]
        prefills = [e for e in self.events if e[0] == "prefill"]
        print(f"prefills: {len(prefills)}, {sum(e[2] for e in prefills):.2f} s")
        print("| rows | round | rounds | ms a round |")
        print("|---|---|---|---|")
        for (rows, kind), (count, seconds) in sorted(by_shape.items()):
            print(f"| {rows} | {kind} | {count} | {1e3 * seconds / count:.1f} |")
        for key in sorted(self.spans, key=lambda k: self.spans[k][0] - self.spans[k][1])[:slowest]:
            joined, done = self.spans[key]
            mine = [e for e in self.events if e[0] == "round" and key in e[3]]
            own = sum(e[2] for e in prefills if key in e[3])
            others = [e for e in prefills if key not in e[3] and joined <= e[1] <= done]
            first = mine[0][1] if mine else done
            kinds = defaultdict(lambda: [0, 0.0, 0])
            for e in mine:
                kind = kinds["quiet" if e[6] else f"T={e[4]}"]
                kind[0] += 1
                kind[1] += e[2]
                kind[2] += e[5][key]
            print(f"request {key[:8]}: {done - joined:.2f} s in the engine; waited {first - joined - own:.2f} s before its "
                  f"first round; its prefill {own:.3f} s; {len(others)} other prefills while it decoded, "
                  f"{sum(e[2] for e in others):.2f} s; {len(mine)} rounds, {sum(e[2] for e in mine):.2f} s, "
                  f"{sum(e[5][key] for e in mine)} tokens")
            print("    " + "; ".join(f"{kind}: {n} rounds, {s:.2f} s, {t} tokens" for kind, (n, s, t) in sorted(kinds.items())))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="swiftspec-demo-pystdlib")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--slowest", type=int, default=3, help="requests to break down, slowest first")
    args = parser.parse_args()
    trace = Trace()
    trace.wrap()
    port = free_port()
    serve(ServeOptions(args.pair, port=port, threads=1, continuous_batching=True, log_level="error"), blocking=False)
    code = CLIENTS.format(examples=os.path.dirname(os.path.abspath(__file__)), port=port, pair=args.pair,
                          max_tokens=args.max_tokens, requests=args.requests, clients=args.clients)
    clients = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    if clients.stdout.readline().strip() != "WARM":
        raise SystemExit("the clients did not warm the server up")
    trace.events.clear()
    trace.spans.clear()
    clients.stdin.write("\n")
    clients.stdin.flush()
    print(f"{args.pair}, {args.clients} clients, {args.requests} requests of {args.max_tokens} tokens, greedy")
    print(clients.stdout.read().strip())
    trace.report(args.slowest)
    os._exit(0)  # the server's threads do not stop on their own


if __name__ == "__main__":
    sys.exit(main())
