"""Head jobs and engines: job state, the Ray dashboard, the health probe, the transport to the
head pod, and engine metrics."""
