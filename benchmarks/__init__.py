"""safeio's benchmark suite: safety measured side by side with what users would otherwise write.

Run ``python -m benchmarks`` (or ``./dev.sh bench``); ``--quick`` for a smoke run, ``--only NAME`` for
one benchmark. Results go to ``docs/benchmarks/results/`` (results.json; results.md and results.png,
a page of the docs site). Absolute times on a shared machine are noise, so every figure is a ratio of
methods interleaved in one run.
"""
