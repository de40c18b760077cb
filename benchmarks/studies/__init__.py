"""Finished one-off studies (``python -m benchmarks.studies.<name>``), kept so their results in
``benchmarks/results/`` can be reproduced; ``docs/studies.md`` says what each found."""
