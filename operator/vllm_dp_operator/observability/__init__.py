"""The operator's own metrics and their HTTP endpoint."""
