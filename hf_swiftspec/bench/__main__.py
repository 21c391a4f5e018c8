"""`python -m hf_swiftspec.bench`: the same as `swiftspec bench`."""

import sys

from .command import bench_main, build_parser

sys.exit(bench_main(build_parser().parse_args()))
