"""`python -m vllm_cpu_launch`: the same entry point as the console script."""

from vllm_cpu_launch.cli import main

raise SystemExit(main())
