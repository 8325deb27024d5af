"""Entry point for ``python -m vllm_dp_launcher``."""

from vllm_dp_launcher.cli import main

raise SystemExit(main())
