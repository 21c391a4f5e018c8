"""One forward of per-row queries over the tree cache, and what it is built from: the token tree (tree.py), the
target's choices (verify.py), the caches (cache.py, recurrent.py), attention over the tree (attention.py), the
runner that replays steps (capture.py, on replay.py's runner, which the device round's phases share:
phase_graphs.py), and the checks that run a model once (probes.py)."""
