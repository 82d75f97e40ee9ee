"""Command-line tools: benchmarks (and later convert, inspect, preflight, compare)."""
