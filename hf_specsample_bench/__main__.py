"""`python -m hf_specsample_bench`: the benchmark command line (see `cli.py`)."""

from .cli import main

main()
