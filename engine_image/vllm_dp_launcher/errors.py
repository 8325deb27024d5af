"""Errors the launcher reports, each with the exit status it ends the launch with."""


class LauncherError(Exception):
    """A launch that cannot proceed; the message is shown to the user as is."""

    exit_status = 1


class PlanError(LauncherError):
    """The launch plan is malformed or inconsistent."""

    exit_status = 2


class ClusterNotReadyError(LauncherError):
    """The Ray cluster never reached the planned shape, or its shape cannot hold the plan."""

    exit_status = 3


class PreflightError(LauncherError):
    """A GPU node could not reach the launcher's node over TCP (ZMQ)."""

    exit_status = 4


class EngineNotFoundError(LauncherError):
    """The engine executable (the plan's command[0]) is not on PATH."""

    exit_status = 127
