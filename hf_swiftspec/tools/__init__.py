"""Tools around the decoder, never imported by it: random-weight models (tiny ones for tests and examples,
real-shaped ones for benches) and the architecture sweep that writes the table in docs/source/en/architectures.md."""
