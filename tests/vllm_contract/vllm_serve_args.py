"""Run INSIDE the vllm==0.33.0 virtualenv: read a command the way `vllm serve` does.

Shared by check_with_vllm.py (parser and ParallelConfig) and place_with_vllm.py (placement).
"""

from __future__ import annotations

import contextlib
import io
from typing import Any


def serve_parser() -> Any:
    """Build the parser of ``vllm <subcommand>`` with only ``serve`` registered."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    subparsers = parser.add_subparsers(required=True, dest="subparser")
    ServeSubcommand().subparser_init(subparsers)
    return parser


def engine_args(parser: Any, command: list[str]) -> tuple[Any, Any]:
    """Parse ``command`` (``vllm serve ...``) as the CLI does: (argparse namespace, EngineArgs).

    Raises ValueError with vLLM's own message when its parser rejects the command.
    """
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.common.cli_args import validate_parsed_serve_args

    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = parser.parse_args(command[1:])
    except SystemExit as exc:
        message = stderr.getvalue().strip()
        raise ValueError(f"vllm's parser rejected the command: {message}") from exc
    validate_parsed_serve_args(args)
    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    return args, EngineArgs.from_cli_args(args)


def parallel_config(engine: Any) -> Any:
    """The ParallelConfig ``EngineArgs.create_engine_config`` builds for a DP launch.

    The rest of that method needs the model's Hugging Face config, which this offline machine
    cannot fetch; the DP and executor checks all live in ParallelConfig.
    """
    from vllm.config import ParallelConfig

    return ParallelConfig(
        pipeline_parallel_size=engine.pipeline_parallel_size,
        tensor_parallel_size=engine.tensor_parallel_size,
        data_parallel_size=engine.data_parallel_size,
        data_parallel_rank=engine.data_parallel_rank or 0,
        data_parallel_external_lb=False,
        data_parallel_size_local=engine.data_parallel_size_local,
        data_parallel_master_ip=engine.data_parallel_address,
        data_parallel_backend=engine.data_parallel_backend,
        data_parallel_hybrid_lb=engine.data_parallel_hybrid_lb,
        enable_expert_parallel=engine.enable_expert_parallel,
        all2all_backend=engine.all2all_backend,
        distributed_executor_backend=engine.distributed_executor_backend,
        nnodes=engine.nnodes,
    )
