"""Run INSIDE the vllm==0.33.0 virtualenv: does vLLM itself accept our commands and settings?

Reads a JSON list of cases on stdin, ``{"name", "command", "env", "expect": {...}}``, where
``command`` is the launcher's full command (``vllm serve MODEL ... --data-parallel-address
IP``). For each case, with ``VLLM_TARGET_DEVICE=cpu`` (no GPU here), it:

1. parses ``command[1:]`` with the parser ``vllm serve`` itself builds (the ``serve``
   subcommand of a ``FlexibleArgumentParser``, filled by ``make_arg_parser``), then runs
   ``validate_parsed_serve_args`` as the CLI does;
2. builds ``EngineArgs.from_cli_args`` and checks the DP fields landed as planned;
3. builds a ``ParallelConfig`` from those fields the way ``EngineArgs.create_engine_config``
   does for a ``--data-parallel-size-local`` launch (the rest of that method needs the
   model's Hugging Face config, which this offline machine cannot fetch);
4. checks every ``VLLM_*`` variable in ``env`` is one vLLM knows (``vllm.envs``), and reads
   ``VLLM_RAY_DP_PACK_STRATEGY`` through ``vllm.envs``.

Writes a JSON list ``{"name", "ok", "errors", "facts"}`` on stdout. Standard library and vLLM
only: neither the operator nor the launcher is installed in that virtualenv.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

os.environ["VLLM_TARGET_DEVICE"] = "cpu"

from vllm_serve_args import engine_args, parallel_config, serve_parser


def check_case(parser: Any, case: dict[str, Any]) -> dict[str, Any]:
    """Check one case; never raises."""
    import vllm.envs as envs

    errors: list[str] = []
    facts: dict[str, Any] = {}
    saved = dict(os.environ)
    os.environ.update(case.get("env", {}))
    try:
        command = case["command"]
        if command[:2] != ["vllm", "serve"]:
            errors.append(f"command must start with 'vllm serve', got {command[:2]}")
            return {"name": case["name"], "ok": False, "errors": errors, "facts": facts}
        try:
            args, engine = engine_args(parser, command)
        except ValueError as exc:
            errors.append(str(exc))
            return {"name": case["name"], "ok": False, "errors": errors, "facts": facts}
        facts.update(
            model=engine.model,
            data_parallel_size=engine.data_parallel_size,
            data_parallel_size_local=engine.data_parallel_size_local,
            data_parallel_address=engine.data_parallel_address,
            data_parallel_backend=engine.data_parallel_backend,
            tensor_parallel_size=engine.tensor_parallel_size,
            api_server_count=getattr(args, "api_server_count", None),
            port=getattr(args, "port", None),
            pack_strategy=envs.VLLM_RAY_DP_PACK_STRATEGY,
        )
        for key, want in case.get("expect", {}).items():
            if facts.get(key) != want:
                errors.append(f"{key}: vLLM read {facts.get(key)!r}, the plan says {want!r}")
        parallel = parallel_config(engine)
        facts.update(
            distributed_executor_backend=parallel.distributed_executor_backend,
            world_size=parallel.world_size,
            data_parallel_master_ip=parallel.data_parallel_master_ip,
        )
        if parallel.distributed_executor_backend != "ray":
            errors.append(
                f"ParallelConfig chose executor {parallel.distributed_executor_backend!r}, "
                "not 'ray'"
            )
        if parallel.data_parallel_master_ip != engine.data_parallel_address:
            errors.append(
                f"ParallelConfig changed the DP master IP to {parallel.data_parallel_master_ip}"
            )
        unknown = sorted(
            name
            for name in case.get("env", {})
            if name.startswith("VLLM_") and name not in envs.environment_variables
        )
        if unknown:
            errors.append(f"environment variables vLLM does not know: {', '.join(unknown)}")
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
        facts["traceback"] = traceback.format_exc(limit=5)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return {"name": case["name"], "ok": not errors, "errors": errors, "facts": facts}


def main() -> int:
    """Check every case from stdin; print the results as JSON."""
    cases = json.load(sys.stdin)
    parser = serve_parser()
    results = [check_case(parser, case) for case in cases]
    json.dump(results, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
