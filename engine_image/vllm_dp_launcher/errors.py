"""Errors the launcher reports, each with the exit status and cause it ends the launch with.

The cause is a short slug printed on the final ``stage=exited`` line (see ``stages``), so
that whoever reads the Ray job's log can tell a launcher failure from an engine's status.
"""

import signal

# vllm serve exited 0 although no stop signal was forwarded to it: an engine that ended on
# its own (vLLM exits 0 after EngineDeadError, vllm#48966) must not look like success.
ENGINE_ENDED_STATUS = 6


class LauncherError(Exception):
    """A launch that cannot proceed; the message is shown to the user as is."""

    exit_status = 1
    cause = "launcher-error"


class RayConnectError(LauncherError):
    """The launcher could not connect to the Ray cluster as a driver."""

    cause = "ray-unreachable"


class PlanError(LauncherError):
    """The launch plan is malformed or inconsistent."""

    exit_status = 2
    cause = "bad-plan"


class ClusterNotReadyError(LauncherError):
    """The Ray cluster never reached the planned shape, or its shape cannot hold the plan."""

    exit_status = 3
    cause = "cluster-not-ready"


class PreflightError(LauncherError):
    """A GPU node could not reach the launcher's node over TCP (ZMQ)."""

    exit_status = 4
    cause = "preflight-failed"


class GpusHeldError(LauncherError):
    """GPUs of the cluster are held by another Ray job (a stale driver) or were never freed."""

    exit_status = 5
    cause = "gpus-held"


class StoppedError(BaseException):
    """A stop signal arrived before vllm serve started: there is nothing to drain.

    A BaseException, like KeyboardInterrupt, so that the ``except Exception`` around Ray
    calls (connecting, listing holders, the preflight) cannot swallow a stop.
    """

    cause = "stopped"

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} before vllm serve started")
        self.exit_status = 128 + signum


class EngineNotFoundError(LauncherError):
    """The engine executable (the plan's command[0]) is not on PATH."""

    exit_status = 127
    cause = "engine-not-found"
