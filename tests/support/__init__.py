"""Test-only code the tests and the benchmarks share (never imported by the package)."""
