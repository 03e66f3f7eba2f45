"""Benchmarks run through `moray bench NAME`; each writes a JSON result file."""
